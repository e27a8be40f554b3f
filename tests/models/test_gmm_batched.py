"""GMMBlockSolver.solve_batch: the sweeps vectorized over the blocks of a step must give
exactly what the loop of ``__call__`` over the blocks gives, alone and inside PDVI."""

import pyro
import pytest
import torch
from pyro.infer import TraceEnum_ELBO

from pyro_pdvi import PDVI, BlockBatch
from pyro_pdvi.models import gmm
from pyro_pdvi.models.gmm import GMMBlockSolver, GMMModel, make_biased_gmm


def block_batch(data, block_ids, seed, eta_m, eta_rho):
    """Random consensus, duals and warm starts for the given blocks (all of one size)."""
    generator = torch.Generator().manual_seed(seed)
    num_components, dim = data.centers.shape
    count = len(block_ids)

    def draw(*shape, scale=1.0, shift=0.0):
        return shift + scale * torch.randn(*shape, generator=generator)

    indices = torch.stack([data.blocks[b] for b in block_ids])
    return BlockBatch(
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
    solutions = [solver(batch.problem(i)) for i in range(len(batch))]
    return (
        {k: torch.stack([s.globals[k] for s in solutions]) for k in ("m", "rho")},
        torch.stack([s.local["alpha"] for s in solutions]),
        torch.stack([s.loss for s in solutions]),
    )


def assert_batch_equals_loop(solver, batch):
    solution = solver.solve_batch(batch)
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
def test_solve_batch_equals_loop_over_blocks(eta_m, eta_rho, num_sweeps):
    data = make_biased_gmm(200, 4, 3, 25, 0.8, seed=5, separation=3.0)
    batch = block_batch(data, [6, 0, 3, 7, 2], seed=1, eta_m=eta_m, eta_rho=eta_rho)
    solver = GMMBlockSolver(data.data, data.prior, num_sweeps=num_sweeps, newton_steps=4)
    assert_batch_equals_loop(solver, batch)


def test_solve_batch_early_stop_is_per_block(monkeypatch):
    """With tol > 0 each block stops after its own sweep count; the batch must freeze
    converged blocks exactly where the loop stops them."""
    data = make_biased_gmm(160, 3, 2, 20, 0.9, seed=2, separation=3.0)
    batch = block_batch(data, [1, 4, 5, 7], seed=3, eta_m=1.0, eta_rho=1.0)
    # Different duals make the blocks converge at different speeds.
    batch.dual["m"] = batch.dual["m"] * torch.tensor([0.0, 1.0, 10.0, 100.0]).view(-1, 1, 1)
    solver = GMMBlockSolver(data.data, data.prior, num_sweeps=200, tol=1e-7)
    # __call__ evaluates the expected log-likelihood once per sweep: count the sweeps.
    calls = []
    counted = gmm.expected_log_likelihood
    monkeypatch.setattr(gmm, "expected_log_likelihood", lambda *a: calls.append(1) or counted(*a))
    sweeps = []
    for i in range(len(batch)):
        calls.clear()
        solver(batch.problem(i))
        sweeps.append(len(calls))
    monkeypatch.undo()
    assert len(set(sweeps)) > 1 and max(sweeps) < 200, sweeps  # the blocks stop at different sweeps
    assert_batch_equals_loop(solver, batch)


def test_solve_batch_reads_nothing_back_to_the_host(monkeypatch):
    """With tol = 0 no tensor value reaches Python (on a GPU that would be a sync)."""
    data = make_biased_gmm(90, 3, 2, 30, 0.9, seed=1)
    batch = block_batch(data, [0, 1, 2], seed=0, eta_m=1.0, eta_rho=1.0)
    solver = GMMBlockSolver(data.data, data.prior)
    solver.solve_batch(batch)  # fills the prior cache

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor value was read on the host")

    for name in ("__bool__", "__float__", "__int__", "__index__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    solution = solver.solve_batch(batch)
    monkeypatch.undo()
    assert torch.isfinite(solution.loss).all()


def test_solve_batch_names_missing_sites():
    data = make_biased_gmm(60, 3, 2, 20, 0.9, seed=1)
    batch = block_batch(data, [0, 2], seed=0, eta_m=1.0, eta_rho=1.0)
    batch.local = {}
    with pytest.raises(ValueError, match=r'local param site "alpha", but the batch of blocks \[0, 2\]'):
        GMMBlockSolver(data.data, data.prior).solve_batch(batch)


class LoopOnly:
    """The same solver without ``solve_batch``: the engine then loops over the blocks."""

    def __init__(self, solver):
        self.solver = solver

    def __call__(self, problem):
        return self.solver(problem)


def run_pdvi(local_solver, data, schedule, global_update):
    pyro.clear_param_store()
    gmm = GMMModel(data.data, data.prior)
    pdvi = PDVI(
        gmm.model,
        gmm.guide,
        pyro.optim.Adam({"lr": 0.01}),
        TraceEnum_ELBO(max_plate_nesting=1),
        blocks=data.blocks,
        eta=1e-2,
        groups=[{"sites": ["rho"], "eta": 1e-1}],
        local_solver=local_solver,
        global_update=global_update,
    )
    losses = [pdvi.step(torch.cat([data.blocks[b] for b in step])) for step in schedule]
    store = pyro.get_param_store()
    params = {k: store[k].detach().clone() for k in ("m", "rho", "alpha")}
    return losses, params, pdvi.state


@pytest.mark.parametrize("global_update", ["paper", "consensus"])
def test_pdvi_steps_with_solve_batch_equal_the_loop(global_update):
    data = make_biased_gmm(240, 3, 2, 30, 0.9, seed=3, separation=3.0)
    schedule = [[0, 3, 5], [1, 2, 4, 6, 7], list(range(8)), [7, 0]]
    solver = GMMBlockSolver(data.data, data.prior)
    calls = []
    solve_batch = solver.solve_batch
    solver.solve_batch = lambda batch: calls.append(len(batch)) or solve_batch(batch)
    batched = run_pdvi(solver, data, schedule, global_update)
    looped = run_pdvi(LoopOnly(GMMBlockSolver(data.data, data.prior)), data, schedule, global_update)
    assert calls == [3, 5, 8, 2]
    assert batched[0] == pytest.approx(looped[0], rel=1e-12, abs=0)
    for name in ("m", "rho", "alpha"):
        torch.testing.assert_close(batched[1][name], looped[1][name], rtol=0, atol=1e-12)
    for name in ("duals", "copies", "consensus"):
        torch.testing.assert_close(getattr(batched[2], name), getattr(looped[2], name), rtol=0, atol=1e-12)
