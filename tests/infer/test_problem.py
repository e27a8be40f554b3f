"""Several blocks per step: the engine's stacking of a step's blocks into one problem, and
its unstacking, must give exactly what one block per problem gives."""

import pyro
import pytest
import torch
from pyro.infer import TraceEnum_ELBO

from pyro_pdvi import PDVI, BlockProblem, BlockSolution
from pyro_pdvi.models.gmm import GMMBlockSolver, GMMModel, make_biased_gmm


class BlockByBlockSolver(GMMBlockSolver):
    """Solves a problem block by block (:meth:`BlockProblem.block`), stacked; records its calls."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batch_sizes = []

    def solve(self, problem: BlockProblem) -> BlockSolution:
        self.batch_sizes.append(len(problem))
        solutions = [super(BlockByBlockSolver, self).solve(problem.block(i)) for i in range(len(problem))]
        return BlockSolution(
            globals={k: torch.cat([s.globals[k] for s in solutions]) for k in solutions[0].globals},
            local={k: torch.cat([s.local[k] for s in solutions]) for k in solutions[0].local},
            loss=torch.cat([s.loss for s in solutions]),
        )


def run(solver_cls, data, schedule):
    pyro.clear_param_store()
    gmm = GMMModel(data.data, data.prior)
    solver = solver_cls(data.data, data.prior)
    pdvi = PDVI(
        gmm.model,
        gmm.guide,
        pyro.optim.Adam({"lr": 0.01}),
        TraceEnum_ELBO(max_plate_nesting=1),
        blocks=data.blocks,
        eta=1e-2,
        groups=[{"sites": ["rho"], "eta": 1e-1}],
        solver=solver,
        global_update="paper",
    )
    losses = [pdvi.step(torch.cat([data.blocks[b] for b in step])) for step in schedule]
    store = pyro.get_param_store()
    return solver, losses, {k: store[k].detach().clone() for k in ("m", "rho", "alpha")}, pdvi


def test_batched_step_equals_loop_over_blocks():
    data = make_biased_gmm(120, 3, 2, 20, 0.9, seed=3, separation=3.0)
    schedule = [[0, 3], [1, 2, 5], [4, 0], [3, 1]]
    looped, loop_losses, loop_params, loop_pdvi = run(BlockByBlockSolver, data, schedule)
    _, batched_losses, batched_params, batched_pdvi = run(GMMBlockSolver, data, schedule)
    assert looped.batch_sizes == [2, 3, 2, 2]
    assert batched_losses == pytest.approx(loop_losses, rel=1e-12, abs=0)
    for name in batched_params:
        torch.testing.assert_close(batched_params[name], loop_params[name], rtol=0, atol=1e-12)
    torch.testing.assert_close(batched_pdvi.state.duals, loop_pdvi.state.duals, rtol=0, atol=1e-12)


def test_unequal_blocks_are_separate_problems():
    data = make_biased_gmm(60, 3, 2, 20, 0.9, seed=3, separation=3.0)
    blocks = [data.blocks[0], torch.cat([data.blocks[1], data.blocks[2][:5]]), data.blocks[2][5:]]
    data = data._replace(blocks=blocks)
    solver, _, params, _ = run(BlockByBlockSolver, data, [[0, 1], [1, 2]])
    assert solver.batch_sizes == [1, 1, 1, 1]
    assert torch.isfinite(params["alpha"]).all()


def test_whitened_globals_equal_the_per_site_copies_penalty_and_gradients():
    """The solver's flat copies and penalty (``WhitenedGlobals``) are the per-site forms'
    (``BlockProblem.whitened_copies`` and ``penalty``), values and gradients in the whitened
    coordinates, with held coordinates at ``lambda_0`` and a site that no mask holds."""
    from pyro_pdvi.infer.problem import SiteViews, WhitenedGlobals

    generator = torch.Generator().manual_seed(0)
    shapes = {"a": (2, 3), "b": (4,), "c": ()}
    m = 3

    def draw(*shape):
        return torch.randn(shape, generator=generator, dtype=torch.float64)

    problem = BlockProblem(
        blocks=torch.arange(m),
        indices=torch.zeros(m, 1, dtype=torch.long),
        consensus={k: draw(*s) for k, s in shapes.items()},
        dual={k: draw(m, *s) for k, s in shapes.items()},
        step_sizes={k: draw(*s).exp() for k, s in shapes.items()},  # per coordinate
        local={},
        num_blocks=m,
        num_data=m,
        held={"a": torch.tensor([[True, False, False], [False, False, True]]), "c": torch.tensor(True)},
    )
    flat = WhitenedGlobals(problem)
    assert flat.size == 11
    z = draw(m, flat.size).requires_grad_()
    copies, penalty = flat.copies(z)
    assert isinstance(copies, SiteViews) and copies.flat.shape == (m, 11)
    per_site_z = {k: v.reshape(m, *shapes[k]) for k, v in zip(shapes, z.split([6, 4, 1], dim=1))}
    expected_copies = problem.whitened_copies(per_site_z)
    expected_penalty = problem.penalty(expected_copies)
    for k in shapes:
        torch.testing.assert_close(copies[k], expected_copies[k], rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(penalty, expected_penalty, rtol=1e-13, atol=1e-13)
    # Held coordinates are lambda_0 exactly, and their whitened coordinates get no gradient.
    assert torch.equal(copies["a"][:, 0, 0], problem.consensus["a"][0, 0].expand(m))
    weights = draw(m, 11)
    (grad,) = torch.autograd.grad((copies.flat * weights).sum() + penalty.sum(), z)
    per_site_weights = zip(shapes, weights.split([6, 4, 1], dim=1))
    weighted = sum((expected_copies[k].reshape(m, -1) * w).sum() for k, w in per_site_weights)
    (expected,) = torch.autograd.grad(weighted + expected_penalty.sum(), z)
    torch.testing.assert_close(grad, expected, rtol=1e-13, atol=1e-13)
    assert torch.equal(grad[:, [0, 5, 10]], torch.zeros(m, 3, dtype=torch.float64))
