"""The generic solver: every block's augmented Lagrangian through the Pyro model, by its own
L-BFGS or the user's optimizer, through the loop or the vectorized kernel, to exact optima."""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoDelta

from pyro_pdvi import PDVI, GenericSolver, VectorizationError
from pyro_pdvi.infer.problem import BlockProblem
from pyro_pdvi.models.quadratic import Quadratic

from ...toy_models import LinearGaussian


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
        solver=GenericSolver(vectorize=True),
    )
    pdvi_vec.step(blocks[0])  # one block: a plain evaluation, no vmap
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    duals = pdvi_vec.state.duals.clone()
    with pytest.raises(VectorizationError, match=r"(?s)data-dependent.*GenericSolver\(vectorize=False\)"):
        pdvi_vec.step(torch.cat(blocks[:2]))
    for name, value in pyro.get_param_store().items():
        assert torch.equal(value.detach(), before[name]), name
    assert torch.equal(pdvi_vec.state.duals, duals)
    pdvi.step(torch.cat(blocks[:2]))  # the loop path handles the same model


@pytest.fixture
def batch_sizes(monkeypatch):
    """Numbers of blocks of the problems the engine hands to the solver."""
    sizes = []
    original = GenericSolver.solve

    def counting(self, problem):
        sizes.append(len(problem))
        return original(self, problem)

    monkeypatch.setattr(GenericSolver, "solve", counting)
    return sizes


def run_linear_gaussian(problem, steps, **kwargs):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoDelta(problem.model, create_plates=problem.create_plates)
    solver = GenericSolver(
        inner_steps=kwargs.pop("inner_steps", 30),
        method=kwargs.pop("method", "lbfgs"),
        vectorize=kwargs.pop("vectorize", False),
    )
    pdvi = PDVI(
        problem.model,
        guide,
        pyro.optim.Adam({"lr": 0.05}),
        Trace_ELBO(),
        blocks=problem.blocks,
        solver=solver,
        **kwargs,
    )
    losses = [pdvi.step(torch.cat([problem.blocks[b] for b in step])) for step in steps]
    store = pyro.get_param_store()
    return losses, store["AutoDelta.w"].detach().clone(), store["AutoDelta.u"].detach().clone(), pdvi


def test_optim_method_vectorized_step_equals_the_loop():
    """Adam is coordinate-wise, so the joint solve takes exactly the loop's steps."""
    problem = LinearGaussian()
    steps = [[0, 2], [1, 3], [3, 0, 2], [1, 2]]
    common = dict(eta=0.05, method="optim", inner_steps=15)
    loop = run_linear_gaussian(problem, steps, **common)
    vectorized = run_linear_gaussian(problem, steps, vectorize=True, **common)
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
        eta=0.3,
        solver=GenericSolver(inner_steps=30, vectorize=True),
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
        solver=GenericSolver(inner_steps=30, vectorize=True),
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


def test_unequal_blocks_are_solved_as_problems_of_equal_sizes(batch_sizes):
    """Blocks of 6, 12, 6, 6 data: a step over blocks 0-2 is one problem of the two blocks of 6
    and one of the block of 12."""
    problem = LinearGaussian()
    problem.blocks = [problem.blocks[0], torch.cat(problem.blocks[1:3]), *problem.blocks[3:]]
    steps = [[0, 1, 2], [1, 2]]
    _, w_loop, _, _ = run_linear_gaussian(problem, steps, eta=0.05)
    sizes_loop = list(batch_sizes)
    _, w_vec, _, _ = run_linear_gaussian(problem, steps, eta=0.05, vectorize=True)
    assert sizes_loop == [2, 1, 1, 1] and batch_sizes[4:] == [2, 1, 1, 1]
    torch.testing.assert_close(w_vec, w_loop, rtol=0, atol=1e-9)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"vectorize": "yes"}, "Invalid vectorize"),
        ({"method": "adam"}, "Invalid method"),
        ({"inner_steps": 0}, "Invalid inner_steps"),
        ({"concentrated_steps": 0}, "Invalid concentrated_steps"),
        ({"concentrated_steps": 2.5}, "Invalid concentrated_steps"),
        ({"trust": 0.0}, "Invalid trust"),
        ({"trust": -1.0}, "Invalid trust: -1.0; use a positive float"),
        ({"trust": float("inf")}, "Invalid trust"),
        ({"trust": True}, "Invalid trust"),
        ({"trust": "on"}, "Invalid trust"),
    ],
)
def test_generic_solver_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GenericSolver(**kwargs)


def test_lbfgs_vectorized_step_equals_the_loop_at_exact_block_optima():
    """Each block's own L-BFGS through either kernel solves the blocks' quadratic augmented
    Lagrangians to |grad| <= 1e-11, so the steps agree."""
    problem = LinearGaussian()
    steps = [[0, 2], [1, 3], [3, 0, 2]]
    common = dict(eta=0.05, inner_steps=200)
    loop = run_linear_gaussian(problem, steps, **common)
    vectorized = run_linear_gaussian(problem, steps, vectorize=True, **common)
    assert vectorized[0] == pytest.approx(loop[0], rel=1e-12, abs=0)
    for got, expected in zip(vectorized[1:3], loop[1:3]):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-11)
    torch.testing.assert_close(vectorized[3].state.duals, loop[3].state.duals, rtol=0, atol=1e-11)


def test_auto_trust_boxes_inexact_solves_only():
    """``trust="auto"`` boxes solves of at most 5 evaluations; a given trust always applies."""
    assert GenericSolver().trust == 2.0
    assert GenericSolver(inner_steps=5).trust == 2.0
    assert GenericSolver(inner_steps=6).trust is None
    assert GenericSolver(inner_steps=60, trust=0.5).trust == 0.5


def test_trust_box_keeps_the_exact_solve_of_a_convex_separable_block():
    """In whitened coordinates an exact solve of a convex objective that is separable in the
    globals moves each coordinate at most ``|g_j|`` (the gradient at the start): curvatures
    of f_b from 1e-3 to 1e3 of the penalty's, the box of ``trust=1`` never binds at the
    optimum, which the solver reaches as without a box."""
    dtype = torch.float64
    curvature = torch.tensor([1e-3, 0.1, 1.0, 10.0, 100.0, 1000.0], dtype=dtype)
    target = torch.linspace(-2.0, 3.0, 6, dtype=dtype)
    eta = torch.full((6,), 0.5, dtype=dtype)
    consensus = torch.linspace(1.0, -1.0, 6, dtype=dtype)
    dual = torch.linspace(-0.3, 0.2, 6, dtype=dtype)[None]
    exact = (curvature * target - dual[0] + consensus / eta) / (curvature + 1 / eta)
    problem = BlockProblem(
        blocks=torch.tensor([0]),
        indices=torch.zeros(1, 1, dtype=torch.long),
        consensus={"w": consensus},
        dual={"w": dual},
        step_sizes={"w": eta},
        local={},
        num_blocks=1,
        num_data=1,
        losses=lambda copies, rows, vectorize=False: (
            0.5 * (curvature * (copies["w"] - target).square()).sum(1)
        ),
    )
    for trust in (1.0, None):
        solution = GenericSolver(inner_steps=300, trust=trust).solve(problem)
        assert torch.allclose(solution.globals["w"][0], exact, rtol=0, atol=1e-10), trust


def test_trust_box_bounds_every_global_move_of_a_solve():
    """On the linear-Gaussian blocks (a MAP through Pyro), each global coordinate of a 20-step
    solve moves at most ``trust * |g_j| + 1e-3`` in whitened units, ``g`` the augmented
    Lagrangian's whitened gradient at the start; without the box some move further."""
    problem_data = LinearGaussian()
    *_, pdvi = run_linear_gaussian(problem_data, [(0,)], eta=10.0)
    ids = torch.tensor([1])
    problem = pdvi._problem(ids, pdvi._block_seeds(ids), (problem_data.blocks[1],), {})
    whitened = {k: torch.zeros_like(v).requires_grad_() for k, v in problem.dual.items()}
    copies = problem.whitened_copies(whitened)
    rows = {k: v.detach() for k, v in problem.local.items()}
    value = (problem.losses(copies, rows) + problem.penalty(copies)).sum()
    start_grads = dict(zip(whitened, torch.autograd.grad(value, list(whitened.values()))))
    moves = {}
    for trust in (0.001, None):
        solution = GenericSolver(inner_steps=20, trust=trust).solve(problem)
        moves[trust] = {
            k: (solution.globals[k] - problem.consensus[k]) / problem.step_sizes[k].sqrt() for k in whitened
        }
    for k, grad in start_grads.items():
        assert (moves[0.001][k].abs() <= 0.001 * grad.abs() + 1e-3 + 1e-9).all(), k
    assert any((moves[None][k].abs() > 0.001 * g.abs() + 1e-3).any() for k, g in start_grads.items())


def test_trial_points_outside_the_domain_raise_no_nan_warnings():
    """A trial point where the objective is NaN (Pyro warns "Encountered NaN" there, forward and
    backward) is rejected by the line search; the solve warns nothing and ends finite, at the
    minimiser inside the domain."""
    from pyro.util import warn_if_nan

    def losses(copies, rows, vectorize=False):
        w = copies["w"].sum(1)
        value = torch.where(w < 2.0, (w - 1.0).square(), torch.nan)
        return warn_if_nan(value, "loss")

    problem = BlockProblem(
        blocks=torch.tensor([0]),
        indices=torch.zeros(1, 1, dtype=torch.long),
        consensus={"w": torch.tensor([-3.0])},
        dual={"w": torch.zeros(1, 1)},
        step_sizes={"w": torch.tensor([100.0])},
        local={},
        num_blocks=1,
        num_data=1,
        losses=losses,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        solution = GenericSolver(inner_steps=40, trust=None).solve(problem)
    assert torch.isfinite(solution.loss).all()
    assert abs(float(solution.globals["w"][0, 0]) - 1.0) < 0.05
