"""The scales of Gaussian global guide sites by the mean-field fixed point (Price's theorem)."""

from dataclasses import replace

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.distributions import constraints
from pyro.infer import TraceMeanField_ELBO
from pyro.infer.autoguide import AutoDelta, AutoNormal
from torch.distributions.transforms import ExpTransform

from pyro_pdvi import PDVI, GenericSolver
from pyro_pdvi.infer.params import ParamStoreView
from pyro_pdvi.infer.scales import ScaleFixedPoint, ScaleMap, find_scale_maps, visit_weight_order
from pyro_pdvi.infer.sites import GlobalLayout, find_sites

NUM_DATA = 12
DIM = 3
#: Per-datum noise sds: blocks of four sorted from precise to vague data.
NOISE = torch.linspace(0.3, 3.0, NUM_DATA, dtype=torch.float64)
DATA = torch.linspace(-2.0, 2.0, NUM_DATA, dtype=torch.float64)[:, None] + torch.arange(DIM)
PRIOR_SD = 2.0
BLOCKS = [torch.arange(4 * b, 4 * b + 4) for b in range(3)]


def normal_means(idx=None):
    """``z ~ N(0, PRIOR_SD^2 I)``, ``x_i ~ N(z, NOISE_i^2 I)``: a conjugate model whose mean-field
    optimum is the exact posterior, precision ``1 / PRIOR_SD^2 + sum_i 1 / NOISE_i^2`` in each coordinate."""
    z = pyro.sample("z", dist.Normal(torch.zeros(DIM), PRIOR_SD).to_event(1))
    with pyro.plate("data", NUM_DATA, subsample=idx) as i:
        pyro.sample("x", dist.Normal(z, NOISE[i, None]).to_event(1), obs=DATA[i])


def exact_posterior_sd() -> torch.Tensor:
    return (PRIOR_SD**-2 + NOISE.pow(-2).sum()).rsqrt().expand(DIM)


def _pdvi(model, guide, **options) -> PDVI:
    return PDVI(model, guide, pyro.optim.Adam({"lr": 0.01}), TraceMeanField_ELBO(), blocks=BLOCKS, **options)


def _epochs(pdvi: PDVI, num_epochs: int) -> None:
    for _ in range(num_epochs):
        for block in BLOCKS:
            pdvi.step(block)


def test_finds_positive_softplus_and_log_scales_and_rejects_shared_ones():
    """A scale entry that is one coordinate's own function qualifies (a ``positive`` param, a
    ``softplus_positive`` one, ``exp(u / 2)`` of a log-variance); one param scaling several entries,
    a scale of two params, a scale whose coordinate also moves a location, and local sites do not."""

    def guide(idx=None):
        loc = pyro.param("loc", torch.zeros(DIM))
        pyro.sample(
            "a",
            dist.Normal(
                loc, pyro.param("a_scale", torch.full((DIM,), 0.5), constraint=constraints.positive)
            ).to_event(1),
        )
        pyro.sample(
            "b",
            dist.Normal(loc, pyro.param("b_log_var", torch.tensor([0.1, -0.3, 0.2])).mul(0.5).exp()).to_event(
                1
            ),
        )
        pyro.sample(
            "c",
            dist.Normal(
                loc, pyro.param("c_scale", torch.full((DIM,), 0.5), constraint=constraints.softplus_positive)
            ).to_event(1),
        )
        shared = pyro.param("shared", torch.tensor(0.5), constraint=constraints.positive)
        pyro.sample("d", dist.Normal(loc, shared.expand(DIM)).to_event(1))
        two = pyro.param("e_1", torch.zeros(DIM)).exp() + pyro.param("e_2", torch.zeros(DIM)).exp()
        pyro.sample("e", dist.Normal(loc, two).to_event(1))
        f_param = pyro.param("f_param", torch.ones(DIM), constraint=constraints.positive)
        pyro.sample("f", dist.Normal(f_param, f_param).to_event(1))
        with pyro.plate("data", NUM_DATA, subsample=idx):
            pyro.sample("g", dist.Normal(pyro.param("g_loc", torch.zeros(NUM_DATA), event_dim=0), 1.0))

    def model(idx=None):
        for name in "abcdef":
            pyro.sample(name, dist.Normal(torch.zeros(DIM), 1.0).to_event(1))
        with pyro.plate("data", NUM_DATA, subsample=idx) as i:
            g = pyro.sample("g", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal(g, 1.0), obs=DATA[i, 0])

    block = BLOCKS[0]
    found = find_sites(model, guide, (block,), {}, NUM_DATA, None)
    layout = GlobalLayout(found.global_sites)
    point = ParamStoreView(layout, found.local_sites).consensus()
    maps = {m.site: m for m in find_scale_maps(guide, found.plate, layout, point, block, (), {})}
    assert sorted(maps) == ["a", "b", "c"]
    params = {"a": "a_scale", "b": "b_log_var", "c": "c_scale"}
    for site, param in params.items():
        coordinates = maps[site].coordinates
        span = layout.slices[param]
        assert coordinates.tolist() == list(range(span.start, span.stop))
        sigma = maps[site].transform(point[coordinates] + 0.3)
        expected = {
            "a": (point[coordinates] + 0.3).exp(),
            "b": (0.5 * (point[coordinates] + 0.3)).exp(),
            "c": torch.nn.functional.softplus(point[coordinates] + 0.3),
        }[site]
        assert torch.allclose(sigma, expected, rtol=1e-12)


def test_finds_the_scales_of_a_large_site_in_a_permuted_order():
    """3,000 scale entries over 6,000 param coordinates (a Jacobian of 18 million elements, which
    the full Jacobian this replaced did not take), each entry the exp of a coordinate of a
    param stored in reverse order: every entry is matched to its own coordinate."""
    size = 3000

    def guide(idx=None):
        loc = pyro.param("loc", torch.zeros(size))
        log_scale = pyro.param("log_scale", torch.linspace(-1.0, 1.0, size))
        pyro.sample("z", dist.Normal(loc, log_scale.flip(0).exp()).to_event(1))
        with pyro.plate("data", NUM_DATA, subsample=idx):
            pass

    def model(idx=None):
        pyro.sample("z", dist.Normal(torch.zeros(size), 1.0).to_event(1))
        with pyro.plate("data", NUM_DATA, subsample=idx) as i:
            pyro.sample("x", dist.Normal(0.0, 1.0), obs=DATA[i, 0])

    pyro.clear_param_store()
    block = BLOCKS[0]
    found = find_sites(model, guide, (block,), {}, NUM_DATA, None)
    layout = GlobalLayout(found.global_sites)
    point = ParamStoreView(layout, found.local_sites).consensus()
    (scale_map,) = find_scale_maps(guide, found.plate, layout, point, block, (), {})
    span = layout.slices["log_scale"]
    assert scale_map.coordinates.tolist() == list(range(span.stop - 1, span.start - 1, -1))
    expected = torch.linspace(-1.0, 1.0, size).flip(0).exp()
    assert torch.allclose(scale_map.transform(point[scale_map.coordinates]), expected, rtol=1e-6)


class SolverWithoutHeldGradients(GenericSolver):
    """A solver that does not hand on the gradient in the held coordinates: PDVI evaluates it."""

    def solve(self, problem):
        return replace(super().solve(problem), held_gradients=None)


@pytest.mark.parametrize("method", ["lbfgs", "optim", "without_held_gradients"])
def test_fixed_point_scales_are_exact_after_one_epoch_of_a_conjugate_model(method):
    """With antithetic, moment-matched particles Price's estimate of a quadratic log joint is exact,
    so once every block has been seen the scales are the exact posterior's (float64), wherever the
    means are; the primal-dual iteration is still far off then. The held scales' duals stay zero
    (the solves, L-BFGS or the user's optimizer, never move them). A solver that does not hand on
    the held gradient gets the same scales from PDVI's own evaluation."""
    guide = AutoNormal(normal_means, init_scale=0.5)
    if method == "without_held_gradients":
        solver = SolverWithoutHeldGradients()
    else:
        solver = GenericSolver(method=method)
    pdvi = _pdvi(normal_means, guide, solver=solver)
    _epochs(pdvi, 1)
    sd = pyro.param("AutoNormal.scales.z").detach()
    assert torch.allclose(sd, exact_posterior_sd(), rtol=1e-10)
    assert pdvi.diagnostics["scale_fixed_point"] == {
        "params": ["AutoNormal.scales.z"],
        "non_positive": 0,
        "non_finite": 0,
    }
    span = pdvi.layout.slices["AutoNormal.scales.z"]
    assert bool((pdvi.state.duals[:, span] == 0).all())

    pyro.clear_param_store()
    guide = AutoNormal(normal_means, init_scale=0.5)
    _epochs(_pdvi(normal_means, guide, scale_update="primal_dual"), 1)
    error = (pyro.param("AutoNormal.scales.z").detach() / exact_posterior_sd() - 1).abs().max()
    assert error > 0.01


def test_fixed_point_run_reaches_the_exact_posterior():
    """Means by the primal-dual iteration, scales by their fixed point: the exact posterior."""
    guide = AutoNormal(normal_means, init_scale=0.5)
    pdvi = _pdvi(normal_means, guide)
    _epochs(pdvi, 40)
    precision = PRIOR_SD**-2 + NOISE.pow(-2).sum()
    mean = (DATA / NOISE[:, None].square()).sum(0) / precision
    assert torch.allclose(pyro.param("AutoNormal.locs.z").detach(), mean, atol=1e-6)
    assert torch.allclose(pyro.param("AutoNormal.scales.z").detach(), exact_posterior_sd(), rtol=1e-10)


def test_a_precision_that_is_not_positive_leaves_the_scale_where_it_is():
    """A log joint convex in a latent (here a factor ``+z^2``, stronger than the data) gives no
    fixed point: the scale stays, and the diagnostics count it."""

    def model(idx=None):
        normal_means(idx)
        z = pyro.sample("w", dist.Normal(0.0, 1.0))
        pyro.factor("convex", 2.0 * z.square())

    guide = AutoNormal(model, init_scale=0.5)
    pdvi = _pdvi(model, guide)
    _epochs(pdvi, 1)
    assert torch.allclose(pyro.param("AutoNormal.scales.w").detach(), torch.tensor(0.5), rtol=1e-12)
    assert pdvi.diagnostics["scale_fixed_point"]["non_positive"] == 1
    assert torch.allclose(pyro.param("AutoNormal.scales.z").detach(), exact_posterior_sd(), rtol=1e-10)


def test_a_resumed_run_continues_as_the_uninterrupted_one():
    def run(split: bool) -> torch.Tensor:
        pyro.clear_param_store()
        pyro.set_rng_seed(1)
        guide = AutoNormal(normal_means, init_scale=0.5)
        pdvi = _pdvi(normal_means, guide)
        _epochs(pdvi, 2)
        if split:
            state, params = pdvi.state_dict(), pyro.get_param_store().get_state()
            pyro.clear_param_store()
            pyro.get_param_store().set_state(params)
            guide = AutoNormal(normal_means, init_scale=0.5)
            pdvi = _pdvi(normal_means, guide)
            pdvi.load_state_dict(state)
        _epochs(pdvi, 1)
        return pyro.param("AutoNormal.locs.z").detach().clone()

    assert torch.equal(run(split=False), run(split=True))


def test_scale_update_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="Invalid scale_update"):
        _pdvi(normal_means, AutoNormal(normal_means), scale_update="newton")

    class OwnSolver:  # a model's closed-form solver sets every global param itself
        def solve(self, problem):
            raise NotImplementedError

    solver = OwnSolver()
    with pytest.raises(ValueError, match="needs the GenericSolver"):
        _pdvi(normal_means, AutoNormal(normal_means), scale_update="fixed_point", solver=solver)
    pdvi = _pdvi(normal_means, AutoDelta(normal_means), scale_update="fixed_point")
    with pytest.raises(ValueError, match="scale_update='primal_dual'"):
        pdvi.step(BLOCKS[0])
    assert pdvi.state is None
    # "auto" with a guide that has no such site: the primal-dual iteration, silently.
    pdvi = _pdvi(normal_means, AutoDelta(normal_means), solver=GenericSolver())
    pdvi.step(BLOCKS[0])
    assert "scale_fixed_point" not in pdvi.diagnostics


def poisson_effects(idx=None):
    """``z ~ N(0, I)``, ``theta_i ~ N(0, 1)``, ``x_i ~ Poisson(exp(z + theta_i))``: the scale's
    share ``h_b`` depends on the location of ``z`` and on the rows of ``theta``."""
    z = pyro.sample("z", dist.Normal(torch.zeros(DIM), 1.0).to_event(1))
    with pyro.plate("data", NUM_DATA, subsample=idx) as i:
        theta = pyro.sample("theta", dist.Normal(torch.zeros(()), 1.0))
        pyro.sample(
            "x",
            dist.Poisson((z + theta.unsqueeze(-1)).exp()).to_event(1),
            obs=DATA[i].abs().round(),
        )


def poisson_guide(model):
    return AutoNormal(
        model, init_scale=0.5, create_plates=lambda idx=None: pyro.plate("data", NUM_DATA, subsample=idx)
    )


@pytest.mark.parametrize("method", ["lbfgs", "optim"])
def test_the_solve_hands_on_the_held_gradient_at_its_solution(method):
    """The solver returns ``grad f_b`` in the held scale coordinates at each block's solution (its
    new copies and rows, the step's noise): what one more evaluation there gives, so the fixed
    point needs no extra model call. Only the held sites are handed on."""
    pdvi = _pdvi(poisson_effects, poisson_guide(poisson_effects), solver=GenericSolver(method=method))
    _epochs(pdvi, 1)  # duals and rows away from their start
    blocks = torch.tensor([0, 2])
    problem = pdvi._problem(blocks, pdvi._block_seeds(blocks), (), {})
    solution = pdvi.solver.solve(problem)
    copies = {k: v.clone().requires_grad_() for k, v in solution.globals.items()}
    f = problem.losses(copies, solution.local)
    name = "AutoNormal.scales.z"
    (expected,) = torch.autograd.grad(f.sum(), copies[name])
    assert set(solution.held_gradients) == {name}
    assert problem.held[name].all()
    assert expected.abs().amax() > 1e-2  # a gradient worth comparing
    assert torch.allclose(solution.held_gradients[name], expected, rtol=1e-10, atol=1e-12)


def test_the_fixed_point_costs_no_model_call_beyond_the_solve():
    """A step with the scales' fixed point calls the model as often as a step without it."""
    calls = []

    def counted(idx=None):
        calls.append(1)
        return poisson_effects(idx)

    per_step = {}
    for update in ("fixed_point", "primal_dual"):
        pyro.clear_param_store()
        pdvi = _pdvi(counted, poisson_guide(counted), scale_update=update)
        _epochs(pdvi, 1)  # set-up and first visits out of the way
        calls.clear()
        _epochs(pdvi, 1)
        per_step[update] = len(calls) / len(BLOCKS)
    assert per_step["fixed_point"] == per_step["primal_dual"]


def test_the_visits_weights_grow_with_an_order_that_follows_the_blocks():
    assert [visit_weight_order(n) for n in (1, 20, 26, 27, 34, 35, 100)] == [1, 1, 1, 2, 2, 3, 3]
    for num_blocks, order in [(20, 1), (30, 2), (100, 3)]:
        fixed = ScaleFixedPoint(
            [ScaleMap("z", "s", torch.tensor([0]), ExpTransform())], num_blocks, torch.zeros(1)
        )
        values = torch.tensor([5.0, 1.0, 3.0, 2.0, 4.0], dtype=torch.float64)
        for value in values:
            fixed.record(torch.tensor([0]), value.reshape(1, 1))
        # The k-th visit's weight is k (k + 1) ... (k + order - 1).
        ks = torch.arange(1, len(values) + 1, dtype=torch.float64)
        weights = torch.stack([ks + i for i in range(order)]).prod(0)
        expected = (weights * values).sum() / weights.sum()
        assert float(fixed.information[0, 0]) == pytest.approx(float(expected), rel=1e-12)


#: Eight blocks of two data for the first epoch's reported scales: block ``b`` has noise sd
#: ``EARLY_NOISE[b]`` on both of its data.
EARLY_NOISE = torch.tensor([0.5, 2.0, 1.0, 0.7, 1.5, 0.9, 3.0, 1.2], dtype=torch.float64)
EARLY_BLOCKS = [torch.arange(2 * b, 2 * b + 2) for b in range(len(EARLY_NOISE))]


def early_means(idx=None):
    """``normal_means`` over the eight blocks of ``EARLY_NOISE``."""
    noise = EARLY_NOISE.repeat_interleave(2)
    data = torch.linspace(-2.0, 2.0, len(noise), dtype=torch.float64)[:, None] + torch.arange(DIM)
    z = pyro.sample("z", dist.Normal(torch.zeros(DIM), PRIOR_SD).to_event(1))
    with pyro.plate("data", len(noise), subsample=idx) as i:
        pyro.sample("x", dist.Normal(z, noise[i, None]).to_event(1), obs=data[i])


def test_the_first_epoch_reports_scales_from_the_blocks_seen_and_the_solves_keep_theirs():
    """From the 4th block of the first epoch the param store holds the scales of the seen blocks'
    precisions plus, for each block not yet seen, the median seen one's (torch's median: the lower
    middle value of an even count); exact here, where Price's estimate is exact (the conjugate
    model). The state, which the solves use, keeps the scales until every block has been seen."""
    guide = AutoNormal(early_means, init_scale=0.5)
    pdvi = PDVI(early_means, guide, pyro.optim.Adam({"lr": 0.01}), TraceMeanField_ELBO(), blocks=EARLY_BLOCKS)
    order = [6, 0, 3, 5, 1, 2, 4, 7]
    shares = [(2 / 16) / PRIOR_SD**2 + 2 / EARLY_NOISE[b] ** 2 for b in range(len(EARLY_NOISE))]
    for k, b in enumerate(order, start=1):
        pdvi.step(EARLY_BLOCKS[b])
        if k == 1:
            span = pdvi.layout.slices["AutoNormal.scales.z"]
            held = pdvi.state.consensus[span].clone()
        reported = pyro.param("AutoNormal.scales.z").detach()
        if k < 4:
            assert torch.allclose(reported, torch.full((DIM,), 0.5, dtype=torch.float64), rtol=1e-12)
        elif k < len(order):
            seen = torch.stack([shares[s] for s in order[:k]])
            precision = seen.sum() + (len(order) - k) * seen.median()
            assert torch.allclose(reported, precision.rsqrt().expand(DIM), rtol=1e-10), k
            assert torch.equal(pdvi.state.consensus[span], held)
    precision = torch.stack(shares).sum()
    assert torch.allclose(
        pyro.param("AutoNormal.scales.z").detach(), precision.rsqrt().expand(DIM), rtol=1e-10
    )


def group_effects(idx=None):
    """A shared mean ``m`` and an effect per group, one group per block: ``x_i ~ N(m + e_g(i), 0.3^2)``."""
    groups = torch.arange(6).repeat_interleave(3)
    data = torch.linspace(-1.0, 2.0, len(groups), dtype=torch.float64)
    m = pyro.sample("m", dist.Normal(torch.zeros((), dtype=torch.float64), 2.0))
    with pyro.plate("groups", 6):
        e = pyro.sample("e", dist.Normal(torch.zeros((), dtype=torch.float64), 1.0))
    with pyro.plate("data", len(groups), subsample=idx) as i:
        pyro.sample("x", dist.Normal(m + e[..., groups[i]], 0.3), obs=data[i])


def test_the_first_epoch_keeps_the_start_of_a_site_that_one_seen_block_informs():
    """A group's effect is informed by its own block only: before every block has been seen, the
    other blocks say only what the prior does about it, so the effects' site keeps its start in
    the param store, while the shared mean's scale is estimated from the blocks seen."""
    blocks = [torch.arange(3 * g, 3 * g + 3) for g in range(6)]
    guide = AutoNormal(group_effects, init_scale=0.5)
    pdvi = PDVI(group_effects, guide, pyro.optim.Adam({"lr": 0.01}), TraceMeanField_ELBO(), blocks=blocks)
    for g in range(4):
        pdvi.step(blocks[g])
    assert torch.allclose(
        pyro.param("AutoNormal.scales.e").detach(), torch.full((6,), 0.5, dtype=torch.float64)
    )
    # The mean's coordinate: the first of the fixed point's (its scale site comes first in the guide).
    fixed = pdvi._scales
    assert fixed.maps[0].params == "AutoNormal.scales.m"
    seen = fixed.information[:4, 0]
    precision = seen.sum() + 2 * seen.median()
    assert float(pyro.param("AutoNormal.scales.m")) == pytest.approx(float(precision.rsqrt()), rel=1e-10)
