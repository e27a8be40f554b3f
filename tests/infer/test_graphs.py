"""Graph replay (:mod:`pyro_pdvi.infer.graphs`): a replayed ``f_b`` equals the one through Pyro
in value, gradient and Hessian products, at the fixed noise of each seed; a model the recording
cannot follow stays with Pyro, and one whose Python state the graph fixed is caught."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO, TraceEnum_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_pdvi import PDVI
from pyro_pdvi.infer import graphs
from pyro_pdvi.infer.graphs import CHECK_EVERY, CHECKED_REPLAYS, GraphReplay
from pyro_pdvi.models.gmm import GMMModel, make_biased_gmm

from ..toy_models import Hierarchical, LinearGaussian
from .test_objective import build_objective, random_point


def replaying(objective):
    """The same objective with a graph replay that records at the first evaluation."""
    objective.graphs = GraphReplay(record_after=0)
    return objective


def mu_guide(idx, **unused):
    """q(mu) = N(mu_loc, 0.1): the guide of this module's small models of one global mean."""
    pyro.sample("mu", dist.Normal(pyro.param("mu_loc", torch.tensor(0.3)), 0.1))


def twelve_points(idx):
    """A normal mean of twelve points, ``idx`` its data plate's subsample."""
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", 12, subsample=idx) as ind:
        pyro.sample("x", dist.Normal(mu, 1.0), obs=torch.linspace(-1.0, 2.0, 12)[ind])


def replaying_trace_elbo(model, guide, idx):
    """A Trace_ELBO objective of ``model`` that replays from its first evaluation, with the current
    params (:func:`build_objective`'s other values)."""
    objective, unconstrained, layout, local_sites = build_objective(
        model, guide, Trace_ELBO().differentiable_loss, idx
    )
    return replaying(objective), unconstrained, layout, local_sites


def build_objectives(model, guide, loss_fn, idx):
    """The objective through Pyro and one that replays, after one evaluation (an ELBO's first
    call guesses max_plate_nesting by tracing, which draws: it must not shift a fixed noise)."""
    through_pyro, unconstrained, layout, local_sites = build_objective(model, guide, loss_fn, idx)
    indices = idx[None]
    copies, rows = random_point(unconstrained, layout, local_sites, indices)
    # TraceEnum_ELBO refuses a loss that nothing requires the gradient of.
    through_pyro.bind(indices, [0], (idx,), {})({k: v.requires_grad_() for k, v in copies.items()}, rows)
    replayed = replaying(build_objective(model, guide, loss_fn, idx)[0])
    return through_pyro, replayed, unconstrained, layout, local_sites


def value_and_gradients(objective, indices, copies, rows, idx, seed):
    """The loop kernel's ``f_b`` of every block and their gradients in copies and rows."""
    leaves = {k: v.clone().requires_grad_() for k, v in {**copies, **rows}.items()}
    losses = objective.bind(indices, [seed] * len(indices), (idx,), {})
    values = losses({k: leaves[k] for k in copies}, {k: leaves[k] for k in rows})
    grads = torch.autograd.grad(values.sum(), list(leaves.values()))
    return values.detach(), dict(zip(leaves, grads))


def linear_gaussian_autonormal():
    problem = LinearGaussian()
    guide = AutoNormal(problem.model, create_plates=problem.create_plates)
    elbo = TraceMeanField_ELBO(num_particles=4, vectorize_particles=True)
    return problem.model, guide, elbo.differentiable_loss, problem.N, problem.blocks, 0.3


def gmm_enumerated():
    data = make_biased_gmm(60, 3, 2, 15, 0.9, seed=3, separation=3.0)
    gmm = GMMModel(data.data, data.prior)
    elbo = TraceEnum_ELBO(max_plate_nesting=1, num_particles=4, vectorize_particles=True)
    return gmm.model, gmm.guide, elbo.differentiable_loss, 60, data.blocks, 0.2


@pytest.mark.parametrize(
    "make", [linear_gaussian_autonormal, gmm_enumerated], ids=["autonormal", "traceenum"]
)
def test_replay_equals_pyro_in_values_and_gradients(make):
    """At several points, seeds and blocks, including the GMM's saturated probabilities (Pyro's
    Dice takes its masked branch there, which the recording always takes)."""
    model, guide, loss_fn, num_data, blocks, spread = make()
    idx = torch.arange(num_data)
    through_pyro, replayed, unconstrained, layout, local_sites = build_objectives(model, guide, loss_fn, idx)
    for trial, seed in enumerate([3, 4, 5, 6]):
        indices = torch.stack(blocks[trial % 2 : trial % 2 + 2])
        copies, rows = random_point(unconstrained, layout, local_sites, indices, spread)
        if "alpha" in rows and trial == 3:
            rows["alpha"][:, :5, 1:] = -800.0  # exp(-800) underflows: these probabilities are 0
        expected, expected_grads = value_and_gradients(through_pyro, indices, copies, rows, idx, seed)
        values, grads = value_and_gradients(replayed, indices, copies, rows, idx, seed)
        torch.testing.assert_close(values, expected, rtol=1e-12, atol=1e-10)
        for name in grads:
            torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-10, atol=1e-10)
    stats = replayed.graphs.stats
    assert stats.recorded == 1 and stats.failures == [] and stats.disabled is None
    assert stats.replayed == 8  # 4 trials of 2 blocks: the recording's own evaluation is a replay
    # The recording's replay is checked against the recording itself; one check through Pyro
    # follows, at other indices.
    assert stats.through_pyro == CHECKED_REPLAYS - 1


def test_enumerated_replay_equals_pyro_to_the_last_bit_in_float32():
    """Where every enumerated probability is positive Pyro's Dice sums ``prob * cost`` unmasked;
    the recorded graph, which takes the masked branch, adds the same numbers in the same order,
    so the two agree exactly. With the masked terms flattened (before) they differed here by
    4.7e-6 relative, and by 1.9e-5 on the suite's GMM (blocks of 1,000), which failed the
    replay's check there."""
    torch.set_default_dtype(torch.float32)
    data = make_biased_gmm(1000, 5, 10, 500, 0.95, seed=0)
    gmm = GMMModel(data.data.to(torch.float32), data.prior.to(torch.float32))
    elbo = TraceEnum_ELBO(max_plate_nesting=1, num_particles=64, vectorize_particles=True)
    idx = torch.arange(1000)
    through_pyro, replayed, unconstrained, layout, local_sites = build_objectives(
        gmm.model, gmm.guide, elbo.differentiable_loss, idx
    )
    for trial, seed in enumerate([3, 4, 5]):
        indices = data.blocks[trial % 2][None]
        copies, rows = random_point(unconstrained, layout, local_sites, indices, 0.05)
        expected, expected_grads = value_and_gradients(through_pyro, indices, copies, rows, idx, seed)
        values, grads = value_and_gradients(replayed, indices, copies, rows, idx, seed)
        assert values.dtype == torch.float32
        torch.testing.assert_close(values, expected, rtol=0, atol=0)
        for name in grads:
            torch.testing.assert_close(grads[name], expected_grads[name], rtol=0, atol=0)
    assert replayed.graphs.stats.disabled is None


def test_replay_draws_each_seeds_noise():
    """The same block at two seeds: different values, each equal to Pyro's at that seed."""
    model, guide, loss_fn, num_data, blocks, spread = linear_gaussian_autonormal()
    idx = torch.arange(num_data)
    through_pyro, replayed, unconstrained, layout, local_sites = build_objectives(model, guide, loss_fn, idx)
    indices = blocks[0][None]
    copies, rows = random_point(unconstrained, layout, local_sites, indices, spread)
    values = {}
    for seed in [1, 2, 1, 2, 1]:
        value, _ = value_and_gradients(replayed, indices, copies, rows, idx, seed)
        expected, _ = value_and_gradients(through_pyro, indices, copies, rows, idx, seed)
        torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-10)
        values.setdefault(seed, value)
        torch.testing.assert_close(value, values[seed], rtol=0, atol=0)
    assert not torch.equal(values[1], values[2])


def test_hessian_products_through_the_replay_equal_pyros():
    """Double backward (the coupling's and curvature rule's Hessian products) through a replay."""
    model, guide, loss_fn, num_data, blocks, spread = linear_gaussian_autonormal()
    idx = torch.arange(num_data)
    through_pyro, replayed, unconstrained, layout, local_sites = build_objectives(model, guide, loss_fn, idx)
    indices = blocks[1][None]
    copies, rows = random_point(unconstrained, layout, local_sites, indices, spread)
    direction = {k: torch.randn_like(v) for k, v in copies.items()}

    def hessian_product(objective):
        leaves = {k: v.clone().requires_grad_() for k, v in copies.items()}
        f = objective.bind(indices, [7], (idx,), {})(leaves, rows).sum()
        grads = torch.autograd.grad(f, list(leaves.values()), create_graph=True)
        inner = sum((g * direction[k]).sum() for g, k in zip(grads, leaves))
        return torch.autograd.grad(inner, list(leaves.values()))

    hessian_product(replayed)  # records
    for got, expected in zip(hessian_product(replayed), hessian_product(through_pyro)):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    assert replayed.graphs.stats.replayed == 2


class Branching:
    """A model whose Python reads a tensor's value: no graph can replay it."""

    def __init__(self):
        self.x = torch.linspace(-1.0, 2.0, 12)

    def model(self, idx):
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        noise = 0.5 if float(mu.detach()) > 0 else 1.0
        with pyro.plate("data", 12, subsample=idx) as ind:
            pyro.sample("x", dist.Normal(mu, noise), obs=self.x[ind])

    def guide(self, idx):
        mu_guide(idx)


def test_a_model_that_reads_a_value_stays_with_pyro():
    toy = Branching()
    idx = torch.arange(12)
    through_pyro, replayed, unconstrained, layout, local_sites = build_objectives(
        toy.model, toy.guide, Trace_ELBO().differentiable_loss, idx
    )
    indices = torch.arange(12).reshape(2, 6)
    for seed in [1, 2, 3]:
        copies, rows = random_point(unconstrained, layout, local_sites, indices, 1.0)
        expected, _ = value_and_gradients(through_pyro, indices, copies, rows, idx, seed)
        values, _ = value_and_gradients(replayed, indices, copies, rows, idx, seed)
        torch.testing.assert_close(values, expected, rtol=1e-12, atol=1e-12)
    stats = replayed.graphs.stats
    assert stats.recorded == 0 and stats.replayed == 0 and stats.disabled is None
    assert len(stats.failures) == 1 and "not recorded (DataDependentError" in stats.failures[0]


class Counting:
    """A model whose likelihood depends on a Python counter: a graph fixes its value."""

    def __init__(self):
        self.x = torch.linspace(-1.0, 2.0, 12)
        self.calls = 0

    def model(self, idx):
        self.calls += 1
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("data", 12, subsample=idx) as ind:
            pyro.sample("x", dist.Normal(mu, 1.0 + 0.1 * self.calls), obs=self.x[ind])

    def guide(self, idx):
        mu_guide(idx)


def test_a_graph_that_fixed_python_state_is_caught_and_pyros_value_returned():
    toy, reference = Counting(), Counting()
    idx = torch.arange(12)
    loss_fn = Trace_ELBO().differentiable_loss
    objective, unconstrained, layout, local_sites = replaying_trace_elbo(toy.model, toy.guide, idx)
    through_pyro = build_objective(reference.model, reference.guide, loss_fn, idx)[0]
    indices = torch.arange(12).reshape(1, 12)
    copies, rows = random_point(unconstrained, layout, local_sites, indices, 0.0)
    losses = objective.bind(indices, [1], (idx,), {})
    losses(copies, rows)  # recorded; its replay agrees with the recording
    # Checked against Pyro's evaluation, for which the counter moved by one.
    with pytest.warns(UserWarning, match="differed from the model in its value.*graph_replay=False"):
        value = losses(copies, rows)
    assert objective.graphs.stats.disabled.startswith("the replay of blocks of 12 data differed")
    reference.calls = toy.calls - 1  # Pyro's evaluation in the check was the model's last call
    expected = through_pyro.bind(indices, [1], (idx,), {})(copies, rows)
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-12)
    calls = toy.calls
    losses(copies, rows)
    assert toy.calls == calls + 1  # through Pyro from now on
    assert objective.graphs.stats.replayed == 1


def test_pdvi_with_and_without_replay_take_the_same_steps():
    """Float64: the same params after two epochs on the hierarchical model, the replay used."""
    results = {}
    for replay in (False, True):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        toy = Hierarchical(num_data=40, num_blocks=4)
        pdvi = PDVI(
            toy.model,
            toy.auto_guide(),
            pyro.optim.Adam({"lr": 0.01}),
            TraceMeanField_ELBO(),
            blocks=toy.blocks,
            graph_replay=replay,
        )
        for _ in range(2):
            for block in toy.blocks:
                pdvi.step(block)
        results[replay] = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
        stats = pdvi.diagnostics["graph_replay"]
        assert (stats is None) == (not replay)
    assert stats.recorded == 1 and stats.replayed > 2 * stats.through_pyro
    for name, value in results[True].items():
        torch.testing.assert_close(value, results[False][name], rtol=1e-9, atol=1e-9)


def test_graph_replay_must_be_a_bool():
    toy = Hierarchical()
    with pytest.raises(ValueError, match="Invalid graph_replay: 'yes'; use True or False"):
        PDVI(
            toy.model,
            toy.guide,
            pyro.optim.Adam({"lr": 0.01}),
            Trace_ELBO(),
            blocks=toy.blocks,
            graph_replay="yes",
        )


def _hierarchical_pdvi(toy, replay=True):
    return PDVI(
        toy.model,
        toy.auto_guide(),
        pyro.optim.Adam({"lr": 0.01}),
        TraceMeanField_ELBO(),
        blocks=toy.blocks,
        graph_replay=replay,
    )


def test_data_replaced_between_steps_is_caught_by_a_later_check():
    """The model reads ``self.x``; a new tensor there is not what the graph holds. One replay in
    CHECK_EVERY is still compared with Pyro, which finds it, warns and turns replay off."""
    toy = Hierarchical(num_data=40, num_blocks=4)
    pdvi = _hierarchical_pdvi(toy)
    for _ in range(3):
        for block in toy.blocks:
            pdvi.step(block)
    stats = pdvi.diagnostics["graph_replay"]
    assert stats.disabled is None and stats.replayed > 0
    toy.x = toy.x + 3.0
    with pytest.warns(UserWarning, match="differed from the model in its value"):
        for step in range(CHECK_EVERY):  # at least 4 evaluations a step
            pdvi.step(toy.blocks[step % 4])
            if stats.disabled is not None:
                break
    assert stats.disabled is not None


@pytest.mark.parametrize("replay", [False, True], ids=["through_pyro", "replayed"])
def test_nan_in_the_data_raises_pyros_validation_error_with_or_without_replay(replay):
    toy = Hierarchical(num_data=40, num_blocks=4)
    pdvi = _hierarchical_pdvi(toy, replay)
    for _ in range(3):
        for block in toy.blocks:
            pdvi.step(block)
    toy.x[toy.blocks[2][0]] = float("nan")  # in place: the graph reads it too
    with pytest.raises(ValueError, match="support"):
        pdvi.step(toy.blocks[2])


def test_a_python_number_among_the_arguments_is_part_of_the_signature(monkeypatch):
    """A keyword ``weight`` that the model reads as a Python float: each value its own graph (a
    replay at another value would be wrong), and past MAX_SIGNATURES values, Pyro only."""

    def model(idx, weight=1.0):
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("data", 12, subsample=idx) as ind, pyro.poutine.scale(scale=weight):
            pyro.sample("x", dist.Normal(mu, 1.0), obs=torch.linspace(-1.0, 2.0, 12)[ind])

    idx = torch.arange(12)
    objective, unconstrained, layout, local_sites = replaying_trace_elbo(model, mu_guide, idx)
    indices = idx.reshape(2, 6)
    copies, rows = random_point(unconstrained, layout, local_sites, indices, 0.0)
    values = {}
    for weight in [1.0, 2.0, 1.0, 2.0, 1.0, 2.0]:
        values.setdefault(weight, []).append(
            objective.bind(indices, [1, 2], (idx,), {"weight": weight})(copies, rows)
        )
    for seen in values.values():
        for value in seen[1:]:
            torch.testing.assert_close(value, seen[0], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(values[1.0][0], values[2.0][0])
    stats = objective.graphs.stats
    assert stats.recorded == 2 and stats.disabled is None
    monkeypatch.setattr(graphs, "MAX_SIGNATURES", 2)
    through_pyro = stats.through_pyro
    for _ in range(3):
        objective.bind(indices, [1, 2], (idx,), {"weight": 3.0})(copies, rows)
    assert stats.through_pyro == through_pyro + 6 and stats.recorded == 2


def test_one_off_evaluations_neither_record_nor_count_but_replay_a_trusted_graph():
    """A one-time pass (the coupling's measurement, with one step's arguments for every block)
    goes through Pyro where no graph is trusted, and leaves no signature behind."""

    idx = torch.arange(12)
    objective, unconstrained, layout, local_sites = replaying_trace_elbo(twelve_points, mu_guide, idx)
    indices = idx.reshape(2, 6)
    copies, rows = random_point(unconstrained, layout, local_sites, indices, 0.0)
    stats = objective.graphs.stats
    with objective.graphs.one_off():
        pyros = objective.bind(indices, [1, 2], (idx,), {})(copies, rows)
    assert (stats.recorded, stats.through_pyro, stats.replayed) == (0, 2, 0)
    assert not objective.graphs._signatures
    objective.bind(indices, [1, 2], (idx,), {})(copies, rows)  # records (record_after=0)
    assert stats.recorded == 1
    for _ in range(3):  # past the checks
        objective.bind(indices, [1, 2], (idx,), {})(copies, rows)
    replayed, through_pyro = stats.replayed, stats.through_pyro
    with objective.graphs.one_off():
        replays = objective.bind(indices, [1, 2], (idx,), {})(copies, rows)
    assert stats.replayed == replayed + 2 and stats.through_pyro == through_pyro
    torch.testing.assert_close(replays, pyros, rtol=1e-12, atol=1e-12)


class _DoubledGradient(torch.autograd.Function):
    """The identity with twice the gradient (a surrogate gradient, as in a straight-through
    estimator): a graph keeps its forward operations, not its backward."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        return 2.0 * grad


def test_a_custom_backward_is_caught_by_the_recordings_gradient_check():
    x = torch.linspace(-1.0, 2.0, 12)

    def model(idx):
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("data", 12, subsample=idx) as ind:
            pyro.sample("x", dist.Normal(_DoubledGradient.apply(mu), 1.0), obs=x[ind])

    idx = torch.arange(12)
    objective, unconstrained, layout, local_sites = replaying_trace_elbo(model, mu_guide, idx)
    indices = idx.reshape(1, 12)
    copies, rows = random_point(unconstrained, layout, local_sites, indices, 0.0)
    copies = {k: v.requires_grad_() for k, v in copies.items()}
    with pytest.warns(UserWarning, match="differed from the model in its gradient"):
        value = objective.bind(indices, [1], (idx,), {})(copies, rows)
    (grad,) = torch.autograd.grad(value.sum(), copies["mu_loc"])
    through = objective.bind(indices, [1], (idx,), {})(copies, rows)  # through Pyro from now on
    torch.testing.assert_close(value, through, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, torch.autograd.grad(through.sum(), copies["mu_loc"])[0])


def test_the_first_signatures_are_recorded_at_once_and_later_ones_by_the_ski_rental_rule():
    """``recurring=2``: the first two signatures (block sizes) are recorded at their first
    evaluation; a third waits for ``record_after`` evaluations through Pyro."""

    idx = torch.arange(12)
    objective, unconstrained, layout, local_sites = replaying_trace_elbo(twelve_points, mu_guide, idx)
    objective.graphs = GraphReplay(record_after=3, recurring=2)
    stats = objective.graphs.stats
    for size, recorded in [(2, 1), (3, 2), (4, 2), (4, 2), (4, 2), (4, 3)]:
        indices = idx[:size][None]
        copies, rows = random_point(unconstrained, layout, local_sites, indices, 0.0)
        objective.bind(indices, [1], (idx,), {})(copies, rows)
        assert stats.recorded == recorded, size
    assert stats.through_pyro == 3  # the third size's, before its recording


def test_pdvi_records_each_block_size_at_its_first_evaluation_but_not_the_warm_up():
    """Blocks of three sizes: after one epoch each size has its graph, and the evaluation before
    the first solve (an ELBO's lazy set-up draws: :meth:`PDVI._warm_up`) went through Pyro
    unrecorded, so the recordings match Pyro (replay stays on)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoNormal(twelve_points)
    blocks = [torch.arange(0, 2), torch.arange(2, 5), torch.arange(5, 12)]
    pdvi = PDVI(twelve_points, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO(), blocks=blocks)
    for block in blocks:
        pdvi.step(block)
    stats = pdvi.diagnostics["graph_replay"]
    assert stats.disabled is None and stats.recorded == 3
    assert len(pdvi._objective.graphs._signatures) == 3


def _evaluate(objective, unconstrained, layout, local_sites, indices: torch.Tensor) -> None:
    idx = torch.arange(12)
    copies, rows = random_point(unconstrained, layout, local_sites, indices[None], 0.0)
    objective.bind(indices[None], [1], (idx,), {})(copies, rows)


def test_a_new_block_size_of_a_checked_structure_is_trusted_after_its_recordings_check():
    """Blocks of 3 then of 4 data of the same model: the two programs differ only in their numbers
    (sizes, the subsample's scale). Once the first passed its checks (a second replay, and one at
    other indices), the second is trusted after its recording's own check: no evaluation through
    Pyro for it, at its own indices or others."""
    idx = torch.arange(12)
    objective, *point = replaying_trace_elbo(twelve_points, mu_guide, idx)
    stats = objective.graphs.stats
    for indices in [idx[0:3], idx[0:3], idx[3:6]]:
        _evaluate(objective, *point, indices)
    assert stats.through_pyro == 2 and stats.recorded == 1
    for indices in [idx[0:4], idx[0:4], idx[4:8], idx[8:12]]:
        _evaluate(objective, *point, indices)
    assert stats.through_pyro == 2 and stats.recorded == 2 and stats.disabled is None


def test_a_structure_not_yet_checked_at_other_indices_is_not_shared():
    """Blocks of 3 data evaluated at one place only: the size of 4 is checked on its own."""
    idx = torch.arange(12)
    objective, *point = replaying_trace_elbo(twelve_points, mu_guide, idx)
    stats = objective.graphs.stats
    for indices in [idx[0:3], idx[0:3], idx[0:3], idx[0:4], idx[0:4], idx[4:8]]:
        _evaluate(objective, *point, indices)
    assert stats.through_pyro == 1 + 2 and stats.recorded == 2


def test_the_structure_leaves_out_numbers_only():
    """Two recordings of the same model at different sizes share a structure; a model that adds
    an operation for larger blocks does not."""
    from pyro_pdvi.infer.recording import Recorder

    def program(size: int, extra: bool):
        x = torch.linspace(0.0, 1.0, 12)
        loc = torch.tensor(0.5, requires_grad=True)
        with Recorder([loc]) as recorder:
            value = (x[:size] - loc).square().sum() * (12 / size)
            if extra:
                value = value + loc.abs()
        return recorder.program(value).structure()

    assert program(3, False) == program(5, False)
    assert program(3, False) != program(5, True)
