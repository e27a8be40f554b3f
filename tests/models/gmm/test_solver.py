"""The mixture's closed-form block solver: stationary points of the augmented Lagrangian,
monotone sweeps, blocks of a batch independent of each other, no host reads, and PDVI with it
at the CAVI optimum."""

import pyro
import pytest
import torch
from pyro.infer import TraceEnum_ELBO

from pyro_pdvi import PDVI, BlockProblem
from pyro_pdvi.models.gmm import (
    GMMBlockSolver,
    GMMModel,
    block_negative_elbo,
    cavi,
    make_biased_gmm,
    negative_elbo,
)

from .helpers import gradient_norm, small_problem


def block_problem(data, seed, eta_m, eta_rho, block=1):
    generator = torch.Generator().manual_seed(seed)
    num_components, dim = data.centers.shape
    indices = data.blocks[block]

    def draw(scale=1.0, shift=0.0):
        return shift + scale * torch.randn(num_components, dim, generator=generator)

    return BlockProblem(
        blocks=torch.tensor([block]),
        indices=indices[None],
        consensus={"m": draw(2.0), "rho": draw(0.5, -1.0)},
        dual={"m": draw()[None], "rho": draw(0.1)[None]},
        step_sizes={
            "m": torch.full((num_components, dim), eta_m),
            "rho": torch.full((num_components, dim), eta_rho),
        },
        local={"alpha": torch.randn(1, len(indices), num_components, generator=generator)},
        num_blocks=len(data.blocks),
        num_data=len(data.data),
    )


@pytest.mark.parametrize("eta_m, eta_rho", [(1e-2, 1e-1), (1.0, 1.0), (100.0, 100.0), (1e-4, 1e3)])
def test_block_solver_reaches_a_stationary_point_of_the_augmented_lagrangian(eta_m, eta_rho):
    data, _, _, _ = small_problem()
    problem = block_problem(data, seed=3, eta_m=eta_m, eta_rho=eta_rho)
    solver = GMMBlockSolver(data.data, data.prior, num_sweeps=300)
    solution = solver.solve(problem)
    m, rho, alpha = solution.globals["m"], solution.globals["rho"], solution.local["alpha"]
    assert m.shape == rho.shape == (1, *problem.consensus["m"].shape)
    assert alpha.shape == problem.local["alpha"].shape
    grad = gradient_norm(lambda *p: solver.augmented_lagrangian(problem, *p).sum(), m, rho, alpha)
    assert grad < 1e-8
    block = problem.indices[0]
    f_b = block_negative_elbo(data.data[block], data.prior, m[0], rho[0], alpha[0], problem.num_data)
    torch.testing.assert_close(solution.loss, f_b.reshape(1), rtol=1e-13, atol=0)


def test_block_solver_sweeps_never_increase_the_augmented_lagrangian():
    data, _, _, _ = small_problem()
    problem = block_problem(data, seed=4, eta_m=1.0, eta_rho=1.0)
    values = []
    for sweeps in range(1, 12):
        solution = GMMBlockSolver(data.data, data.prior, num_sweeps=sweeps).solve(problem)
        values.append(
            GMMBlockSolver(data.data, data.prior).augmented_lagrangian(
                problem, solution.globals["m"], solution.globals["rho"], solution.local["alpha"]
            )
        )
    assert torch.cat(values).diff().max() <= 1e-10


def test_block_solver_names_missing_sites():
    data, _, _, _ = small_problem()
    problem = block_problem(data, seed=0, eta_m=1.0, eta_rho=1.0)
    problem.local = {}
    with pytest.raises(ValueError, match='local param site "alpha"'):
        GMMBlockSolver(data.data, data.prior).solve(problem)
    with pytest.raises(ValueError, match="num_sweeps"):
        GMMBlockSolver(data.data, data.prior, num_sweeps=0)


def test_pdvi_with_block_solver_reaches_the_cavi_optimum():
    data = make_biased_gmm(200, 3, 2, 50, 0.95, seed=2, separation=3.0)
    reference = cavi(data.data, data.prior, tol=1e-12)
    gmm = GMMModel(data.data, data.prior)
    pdvi = PDVI(
        gmm.model,
        gmm.guide,
        pyro.optim.Adam({"lr": 0.01}),
        TraceEnum_ELBO(max_plate_nesting=1),
        blocks=data.blocks,
        eta=1e-2,
        groups=[{"sites": ["rho"], "eta": 1e-1}],
        solver=GMMBlockSolver(data.data, data.prior),
    )
    for _ in range(40):
        for b in torch.randperm(len(data.blocks)).tolist():
            pdvi.step(data.blocks[b])
    store = pyro.get_param_store()
    reached = negative_elbo(data.data, data.prior, store["m"], store["rho"], store["alpha"]).detach()
    gap = float(reached - reference.losses[-1])
    assert -1e-6 < gap < 1e-3 * abs(float(reference.losses[-1])), gap


def block_batch(data, block_ids, seed, eta_m, eta_rho):
    """Random consensus, duals and warm starts for the given blocks (all of one size)."""
    generator = torch.Generator().manual_seed(seed)
    num_components, dim = data.centers.shape
    count = len(block_ids)

    def draw(*shape, scale=1.0, shift=0.0):
        return shift + scale * torch.randn(*shape, generator=generator)

    indices = torch.stack([data.blocks[b] for b in block_ids])
    return BlockProblem(
        blocks=torch.tensor(block_ids),
        indices=indices,
        consensus={"m": draw(num_components, dim, scale=2.0), "rho": draw(num_components, dim, shift=-1.0)},
        dual={"m": draw(count, num_components, dim), "rho": draw(count, num_components, dim, scale=0.1)},
        step_sizes={
            "m": torch.full((num_components, dim), eta_m),
            "rho": torch.full((num_components, dim), eta_rho),
        },
        local={"alpha": draw(count, indices.shape[1], num_components)},
        num_blocks=len(data.blocks),
        num_data=len(data.data),
    )


def loop_over(solver, batch):
    """Each block solved alone, as a problem of one."""
    solutions = [solver.solve(batch.block(i)) for i in range(len(batch))]
    return (
        {k: torch.cat([s.globals[k] for s in solutions]) for k in ("m", "rho")},
        torch.cat([s.local["alpha"] for s in solutions]),
        torch.cat([s.loss for s in solutions]),
    )


def assert_batch_equals_loop(solver, batch):
    solution = solver.solve(batch)
    copies, alpha, losses = loop_over(solver, batch)
    for name in ("m", "rho"):
        assert solution.globals[name].shape == copies[name].shape
        torch.testing.assert_close(solution.globals[name], copies[name], rtol=0, atol=1e-12)
    assert solution.local["alpha"].shape == batch.local["alpha"].shape
    # alpha = log phi reaches -1e4 for far-away components, where one rounding is 2e-12:
    # those entries are compared relative to their size.
    torch.testing.assert_close(solution.local["alpha"], alpha, rtol=1e-12, atol=1e-12)
    # f_b is a sum over the block: compare relative to its size.
    torch.testing.assert_close(solution.loss, losses, rtol=1e-12, atol=0)
    return solution


@pytest.mark.parametrize(
    "eta_m, eta_rho, num_sweeps", [(1e-2, 1e-1, 10), (1.0, 1.0, 3), (100.0, 100.0, 10), (1e-4, 1e3, 1)]
)
def test_a_batch_equals_each_block_solved_alone(eta_m, eta_rho, num_sweeps):
    data = make_biased_gmm(200, 4, 3, 25, 0.8, seed=5, separation=3.0)
    batch = block_batch(data, [6, 0, 3, 7, 2], seed=1, eta_m=eta_m, eta_rho=eta_rho)
    solver = GMMBlockSolver(data.data, data.prior, num_sweeps=num_sweeps, newton_steps=4)
    assert_batch_equals_loop(solver, batch)


def test_early_stop_is_per_block():
    """With tol > 0 each block stops after its own sweep count; the batch must freeze
    converged blocks exactly where each block alone stops."""
    data = make_biased_gmm(160, 3, 2, 20, 0.9, seed=2, separation=3.0)
    batch = block_batch(data, [1, 4, 5, 7], seed=3, eta_m=1.0, eta_rho=1.0)
    # Different duals make the blocks converge at different speeds.
    batch.dual["m"] = batch.dual["m"] * torch.tensor([0.0, 1.0, 10.0, 100.0]).view(-1, 1, 1)
    solver = GMMBlockSolver(data.data, data.prior, num_sweeps=200, tol=1e-7)
    sweeps = []
    for i in range(len(batch)):
        stopped = solver.solve(batch.block(i)).globals["m"]
        # The fixed number of sweeps that gives the same means (to rounding: the early-stop path
        # takes phi as exp(log_softmax), the other as softmax).
        for count in range(1, 201):
            fixed = GMMBlockSolver(data.data, data.prior, num_sweeps=count).solve(batch.block(i))
            if float((fixed.globals["m"] - stopped).abs().max()) < 1e-12:
                break
        sweeps.append(count)
    assert len(set(sweeps)) > 1 and max(sweeps) < 200, sweeps  # the blocks stop at different sweeps
    assert_batch_equals_loop(solver, batch)


def test_solve_reads_nothing_back_to_the_host(monkeypatch):
    """With tol = 0 no tensor value reaches Python (on a GPU that would be a sync)."""
    data = make_biased_gmm(90, 3, 2, 30, 0.9, seed=1)
    batch = block_batch(data, [0, 1, 2], seed=0, eta_m=1.0, eta_rho=1.0)
    solver = GMMBlockSolver(data.data, data.prior)
    solver.solve(batch)  # fills the prior cache

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor value was read on the host")

    for name in ("__bool__", "__float__", "__int__", "__index__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    solution = solver.solve(batch)
    monkeypatch.undo()
    assert torch.isfinite(solution.loss).all()


def test_solve_names_missing_sites():
    data = make_biased_gmm(60, 3, 2, 20, 0.9, seed=1)
    batch = block_batch(data, [0, 2], seed=0, eta_m=1.0, eta_rho=1.0)
    batch.local = {}
    with pytest.raises(ValueError, match=r'local param site "alpha", but the problem of blocks \[0, 2\]'):
        GMMBlockSolver(data.data, data.prior).solve(batch)
