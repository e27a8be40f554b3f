"""Vectorized multi-block steps (``vectorize_blocks=True``): the vmapped block objective must
equal the loop over :class:`BlockObjective`, the scoped patches must leave Pyro as they found
it, and PDVI with vectorized steps must reach the same exact optima as the loop."""

import pyro
import pyro.distributions as dist
import pyro.infer.trace_elbo
import pyro.infer.traceenum_elbo
import pyro.infer.util
import pyro.ops.special
import pyro.poutine.enum_messenger
import pytest
import torch
import torch.distributions.normal
from pyro import poutine
from pyro.infer import Trace_ELBO, TraceEnum_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoDelta, AutoNormal

from pyro_pdvi import PDVI
from pyro_pdvi.infer.handlers import FixedNoise
from pyro_pdvi.infer.objective import BlockObjective
from pyro_pdvi.infer.sites import GlobalLayout, find_data_plate, split_param_sites
from pyro_pdvi.infer.vectorized import (
    BatchedBlockObjective,
    VectorizationError,
    VectorizedBlockSolver,
    vmap_compatible_pyro,
)
from pyro_pdvi.models.gmm import GMMModel, make_biased_gmm
from pyro_pdvi.models.quadratic import Quadratic


class LinearGaussian:
    """y_i = x_i'w + u_i + noise, w ~ N(0, I), u_i ~ N(0, 1): MAP (AutoDelta) is one linear solve."""

    def __init__(self, num_data=24, dim=3, sigma=0.5, block_size=6):
        g = torch.Generator().manual_seed(1)
        self.X = torch.randn(num_data, dim, generator=g)
        drift = 2.0 * torch.linspace(-1, 1, num_data)  # non-i.i.d. blocks along the data order
        self.y = self.X @ torch.tensor([1.0, -2.0, 0.5])[:dim] + 0.3 * torch.randn(num_data, generator=g)
        self.y = self.y + drift
        self.N, self.d, self.sigma = num_data, dim, sigma
        self.blocks = list(torch.arange(num_data).split(block_size))

    def model(self, idx):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([self.d]).to_event(1))
        with pyro.plate("data", self.N, subsample=idx) as ind:
            u = pyro.sample("u", dist.Normal(0.0, 1.0))
            # (X w) written to broadcast over vectorized particles of w.
            pyro.sample("y", dist.Normal((self.X[ind] * w).sum(-1) + u, self.sigma), obs=self.y[ind])

    def create_plates(self, idx):
        return pyro.plate("data", self.N, subsample=idx)

    def exact_map(self):
        A = torch.cat([self.X, torch.eye(self.N)], 1)
        H = A.T @ A / self.sigma**2 + torch.eye(self.d + self.N)
        solution = torch.linalg.solve(H, A.T @ self.y / self.sigma**2)
        return solution[: self.d], solution[self.d :]


def objectives(model, guide, loss_fn, idx, randomness="different"):
    """The loop's and the vmapped block objective of a model and guide (params created)."""
    guide_trace = poutine.trace(guide).get_trace(idx)
    model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(idx)
    store = pyro.get_param_store()
    unconstrained = {k: v.detach() for k, v in store.named_parameters()}
    traces = [guide_trace, model_trace]
    plate = find_data_plate(traces, len(idx), None)
    global_sites, local_sites = split_param_sites(
        traces, plate, store.get_state()["constraints"], unconstrained
    )
    layout = GlobalLayout(global_sites)
    loop = BlockObjective(model, guide, loss_fn, plate, layout, local_sites)
    batched = BatchedBlockObjective(model, guide, loss_fn, plate, layout, local_sites, randomness)
    return loop, batched, unconstrained, layout, local_sites


def random_point(unconstrained, layout, local_sites, indices, spread=0.3):
    """Different copies per block, and each block's rows, near the current params."""
    m = len(indices)
    copies = {
        name: unconstrained[name] + spread * torch.randn(m, *unconstrained[name].shape)
        for name in layout.names
    }
    # Stacked as the engine's BlockBatch stacks them: (m, *rows_shape).
    rows = {
        s.name: unconstrained[s.name]
        .index_select(s.axis, indices.reshape(-1))
        .unflatten(s.axis, indices.shape)
        .movedim(s.axis - 1, 0)
        for s in local_sites
    }
    rows = {k: v + spread * torch.randn_like(v) for k, v in rows.items()}
    return copies, rows


def assert_equals_loop(loop, batched, unconstrained, local_sites, indices, copies, rows, idx, noise):
    leaves = {k: v.clone().requires_grad_() for k, v in {**copies, **rows}.items()}
    with noise():
        losses = batched(indices, {k: leaves[k] for k in copies}, {k: leaves[k] for k in rows}, (idx,), {})
    grads = dict(zip(leaves, torch.autograd.grad(losses.sum(), list(leaves.values()))))
    losses = losses.detach()
    local_full = {s.name: unconstrained[s.name] for s in local_sites}
    for i, block in enumerate(indices):
        point = {k: v[i].clone().requires_grad_() for k, v in {**copies, **rows}.items()}
        with noise():
            loss = loop(
                block,
                {k: point[k] for k in copies},
                {k: point[k] for k in rows},
                local_full,
                (idx,),
                {},
            )
        block_grads = dict(zip(point, torch.autograd.grad(loss, list(point.values()))))
        assert float(losses[i]) == pytest.approx(float(loss), rel=1e-12, abs=1e-10)
        for name in point:
            torch.testing.assert_close(grads[name][i], block_grads[name], rtol=1e-10, atol=1e-10)
    return losses


def test_map_autodelta_losses_and_gradients_equal_the_loop():
    problem = LinearGaussian()
    guide = AutoDelta(problem.model, create_plates=problem.create_plates)
    idx = torch.arange(problem.N)
    loop, batched, unconstrained, layout, local_sites = objectives(
        problem.model, guide, Trace_ELBO().differentiable_loss, idx
    )
    assert [s.name for s in local_sites] == ["AutoDelta.u"]
    indices = torch.stack(problem.blocks[:3])
    copies, rows = random_point(unconstrained, layout, local_sites, indices)
    noise = FixedNoise(3, torch.device("cpu"))
    assert_equals_loop(loop, batched, unconstrained, local_sites, indices, copies, rows, idx, noise)


@pytest.mark.parametrize("saturated", [False, True], ids=["soft", "zero_probabilities"])
def test_gmm_traceenum_losses_and_gradients_equal_the_loop_at_fixed_noise(saturated):
    """Enumerated z, Monte Carlo c: with randomness="same" every block sees the loop's draw.

    ``zero_probabilities``: some q(z_i) put probability exactly 0 on a component, which sends
    Pyro's Dice expectation through its masked branch (the one vmap needs rewritten)."""
    data = make_biased_gmm(60, 3, 2, 15, 0.9, seed=3, separation=3.0)
    gmm = GMMModel(data.data, data.prior)
    elbo = TraceEnum_ELBO(max_plate_nesting=1, num_particles=4, vectorize_particles=True)
    idx = torch.arange(60)
    loop, batched, unconstrained, layout, local_sites = objectives(
        gmm.model, gmm.guide, elbo.differentiable_loss, idx, randomness="same"
    )
    indices = torch.stack(data.blocks)
    copies, rows = random_point(unconstrained, layout, local_sites, indices, spread=0.2)
    if saturated:
        rows["alpha"][:, :5, 1:] = -800.0  # exp(-800) underflows: these probabilities are 0
        probs = torch.softmax(rows["alpha"], -1)
        assert (probs == 0).any()
    noise = FixedNoise(11, torch.device("cpu"))
    losses = assert_equals_loop(loop, batched, unconstrained, local_sites, indices, copies, rows, idx, noise)
    assert torch.isfinite(losses).all()


def test_autonormal_different_randomness_gives_each_block_its_own_draw():
    """randomness="different": block i's loss is the loop's under its own noise, which differs
    from block j's; all of it reproducible from the one generator state."""
    problem = LinearGaussian()
    guide = AutoNormal(problem.model, create_plates=problem.create_plates)
    idx = torch.arange(problem.N)
    elbo = TraceMeanField_ELBO(num_particles=4, vectorize_particles=True)
    _, batched, unconstrained, layout, local_sites = objectives(
        problem.model, guide, elbo.differentiable_loss, idx
    )
    indices = torch.stack(problem.blocks[:2])
    # The same copies and rows for both blocks' data: only the noise can tell them apart.
    copies = {k: unconstrained[k].expand(2, *unconstrained[k].shape) for k in layout.names}
    rows = {s.name: unconstrained[s.name].index_select(s.axis, indices[0]).expand(2, -1) for s in local_sites}
    same_data = torch.stack([indices[0], indices[0]])
    batched(same_data, copies, rows, (idx,), {})  # the ELBO's first call guesses max_plate_nesting
    noise = FixedNoise(5, torch.device("cpu"))
    with noise():
        first = batched(same_data, copies, rows, (idx,), {})
    with noise():
        again = batched(same_data, copies, rows, (idx,), {})
    assert torch.equal(first, again)
    assert float((first[0] - first[1]).abs()) > 1e-6


def test_patches_are_scoped_and_undone_also_after_an_exception():
    originals = {
        "torch_item": pyro.infer.trace_elbo.torch_item,
        "warn_if_nan": pyro.infer.traceenum_elbo.warn_if_nan,
        "_SafeLog": pyro.ops.special._SafeLog,
        "post_sample": pyro.poutine.enum_messenger.EnumMessenger.__dict__["_pyro_post_sample"],
        "expectation": pyro.infer.util.Dice.__dict__["compute_expectation"],
        "standard_normal": torch.distributions.normal._standard_normal,
    }

    def current():
        return {
            "torch_item": pyro.infer.trace_elbo.torch_item,
            "warn_if_nan": pyro.infer.traceenum_elbo.warn_if_nan,
            "_SafeLog": pyro.ops.special._SafeLog,
            "post_sample": pyro.poutine.enum_messenger.EnumMessenger.__dict__["_pyro_post_sample"],
            "expectation": pyro.infer.util.Dice.__dict__["compute_expectation"],
            "standard_normal": torch.distributions.normal._standard_normal,
        }

    def flags():
        return (
            pyro.infer.util.is_validation_enabled(),
            dist.is_validation_enabled(),
            poutine.util.is_validation_enabled(),
        )

    for validation in (True, False):
        pyro.enable_validation(validation)
        try:
            before = flags()
            with pytest.raises(KeyError, match="inside"):
                with vmap_compatible_pyro():
                    assert flags() == (False, False, False)
                    assert all(current()[k] is not originals[k] for k in originals)
                    # Outside vmap the replacements behave as the originals.
                    assert pyro.infer.trace_elbo.torch_item(torch.tensor(2.5)) == 2.5
                    raise KeyError("inside")
            assert flags() == before
            assert current() == originals
        finally:
            pyro.enable_validation(True)


class ItemModel:
    """A model that branches on a sampled value in Python, which vmap cannot map."""

    def __init__(self):
        self.problem = LinearGaussian(num_data=8, block_size=2)

    def model(self, idx):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([self.problem.d]).to_event(1))
        scale = 2.0 if float(w.sum()) > 100 else 1.0
        with pyro.plate("data", self.problem.N, subsample=idx) as ind:
            pyro.sample("y", dist.Normal(self.problem.X[ind] @ w, scale), obs=self.problem.y[ind])


def test_a_model_vmap_cannot_map_raises_a_clear_error_and_changes_nothing():
    """Stated behaviour: no silent fallback; VectorizationError on the first vectorized step,
    naming the cause and the fix, with the param store and duals untouched. The loop runs it."""
    item = ItemModel()
    guide = AutoDelta(item.model)
    blocks = item.problem.blocks
    pdvi = PDVI(item.model, guide, pyro.optim.Adam({"lr": 0.1}), Trace_ELBO(), blocks=blocks, eta=0.1)
    pdvi_vec = PDVI(
        item.model,
        guide,
        pyro.optim.Adam({"lr": 0.1}),
        Trace_ELBO(),
        blocks=blocks,
        eta=0.1,
        vectorize_blocks=True,
    )
    pdvi_vec.step(blocks[0])  # one block: the loop, no vmap
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    duals = pdvi_vec.state.duals.clone()
    with pytest.raises(VectorizationError, match=r"(?s)data-dependent.*vectorize_blocks=False"):
        pdvi_vec.step(torch.cat(blocks[:2]))
    for name, value in pyro.get_param_store().items():
        assert torch.equal(value.detach(), before[name]), name
    assert torch.equal(pdvi_vec.state.duals, duals)
    pdvi.step(torch.cat(blocks[:2]))  # the loop path handles the same model


@pytest.fixture
def batch_sizes(monkeypatch):
    """Sizes of the batches the engine hands to the vectorized solver."""
    sizes = []
    original = VectorizedBlockSolver.solve_batch

    def counting(self, batch, noise=None):
        sizes.append(len(batch))
        return original(self, batch, noise)

    monkeypatch.setattr(VectorizedBlockSolver, "solve_batch", counting)
    return sizes


def run_linear_gaussian(problem, steps, **kwargs):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoDelta(problem.model, create_plates=problem.create_plates)
    kwargs.setdefault("inner_steps", 30)
    pdvi = PDVI(
        problem.model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO(), blocks=problem.blocks, **kwargs
    )
    losses = [pdvi.step(torch.cat([problem.blocks[b] for b in step])) for step in steps]
    store = pyro.get_param_store()
    return losses, store["AutoDelta.w"].detach().clone(), store["AutoDelta.u"].detach().clone(), pdvi


def test_optim_inner_solver_vectorized_step_equals_the_loop():
    """Adam is coordinate-wise, so the joint solve takes exactly the loop's steps."""
    problem = LinearGaussian()
    steps = [[0, 2], [1, 3], [3, 0, 2], [1, 2]]
    common = dict(eta=0.05, inner_solver="optim", inner_steps=15)
    loop = run_linear_gaussian(problem, steps, **common)
    vectorized = run_linear_gaussian(problem, steps, vectorize_blocks=True, **common)
    assert vectorized[0] == pytest.approx(loop[0], rel=1e-12, abs=0)
    torch.testing.assert_close(vectorized[1], loop[1], rtol=0, atol=1e-12)
    torch.testing.assert_close(vectorized[2], loop[2], rtol=0, atol=1e-12)
    torch.testing.assert_close(vectorized[3].state.duals, loop[3].state.duals, rtol=0, atol=1e-12)


def test_quadratic_vectorized_steps_reach_the_exact_optimum(batch_sizes):
    """The App. C.3 quadratic (a plain callable loss, not an ELBO), two blocks per step."""
    problem = Quadratic(num_data=12, num_blocks=4, scale_b=1.0)
    phi_opt, lam_opt = problem.optimum()
    pdvi = PDVI(
        problem.model,
        problem.guide,
        pyro.optim.Adam({"lr": 0.1}),
        problem.loss,
        blocks=problem.blocks,
        inner_steps=30,
        eta=0.3,
        vectorize_blocks=True,
    )
    for _ in range(60):
        for pair in ([0, 1], [2, 3]):
            pdvi.step(torch.cat([problem.blocks[b] for b in pair]))
        lam = torch.cat([pyro.param("a").detach(), pyro.param("b").detach()])
        if (lam - lam_opt).norm() / lam_opt.norm() < 1e-10:
            break
    assert set(batch_sizes) == {2}
    assert (lam - lam_opt).norm() / lam_opt.norm() <= 1e-8
    torch.testing.assert_close(
        pyro.param("phi").detach(), phi_opt, rtol=0, atol=1e-7 * float(phi_opt.abs().max())
    )


def test_per_datum_blocks_vectorized_reach_the_exact_map():
    """Every datum its own block (N = 64 blocks of 1), all 64 solved in each vectorized step."""
    problem = LinearGaussian(num_data=64, dim=2, block_size=1)
    w_exact, u_exact = problem.exact_map()
    pdvi = PDVI(
        problem.model,
        AutoDelta(problem.model, create_plates=problem.create_plates),
        pyro.optim.Adam({"lr": 0.05}),
        Trace_ELBO(),
        blocks=problem.blocks,
        inner_steps=30,
        vectorize_blocks=True,
    )
    assert len(problem.blocks) == 64
    for _ in range(200):
        pdvi.step(torch.arange(64))
        w = pyro.param("AutoDelta.w").detach()
        if (w - w_exact).norm() / w_exact.norm() < 1e-10:
            break
    assert (w - w_exact).norm() / w_exact.norm() <= 1e-8
    u = pyro.param("AutoDelta.u").detach()
    assert (u - u_exact).norm() / u_exact.norm() <= 1e-8


def test_unequal_blocks_fall_back_to_the_loop(batch_sizes):
    problem = LinearGaussian()
    problem.blocks = [problem.blocks[0], torch.cat(problem.blocks[1:3]), *problem.blocks[3:]]
    steps = [[0, 1], [1, 2]]
    _, w_loop, _, _ = run_linear_gaussian(problem, steps, eta=0.05)
    _, w_vec, _, _ = run_linear_gaussian(problem, steps, eta=0.05, vectorize_blocks=True)
    assert batch_sizes == []
    assert torch.equal(w_vec, w_loop)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"vectorize_blocks": "yes"}, "Invalid vectorize_blocks"),
        ({"vectorize_blocks": True, "local_solver": lambda problem: None}, "local_solver replaces it"),
    ],
)
def test_vectorize_blocks_argument_errors(kwargs, match):
    problem = LinearGaussian()
    guide = AutoDelta(problem.model, create_plates=problem.create_plates)
    with pytest.raises(ValueError, match=match):
        PDVI(
            problem.model, guide, pyro.optim.Adam({"lr": 0.1}), Trace_ELBO(), blocks=problem.blocks, **kwargs
        )


def test_randomness_is_checked():
    with pytest.raises(ValueError, match="Invalid randomness"):
        BatchedBlockObjective(None, None, None, None, GlobalLayout([]), [], randomness="error")


def test_lbfgs_vectorized_step_equals_the_loop_at_exact_block_optima():
    """Each block's own L-BFGS (vectorized) and primal.lbfgs (loop) both solve the blocks'
    quadratic augmented Lagrangians to |grad| <= 1e-11 (measured gap 3e-14), so the steps agree."""
    problem = LinearGaussian()
    steps = [[0, 2], [1, 3], [3, 0, 2]]
    common = dict(eta=0.05, inner_steps=200)
    loop = run_linear_gaussian(problem, steps, **common)
    vectorized = run_linear_gaussian(problem, steps, vectorize_blocks=True, **common)
    assert vectorized[0] == pytest.approx(loop[0], rel=1e-12, abs=0)
    for got, expected in zip(vectorized[1:3], loop[1:3]):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-11)
    torch.testing.assert_close(vectorized[3].state.duals, loop[3].state.duals, rtol=0, atol=1e-11)
