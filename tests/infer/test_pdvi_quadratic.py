"""PDVI against exact mathematics on the strongly convex quadratic of App. C.3."""

import math

import pyro
import pytest
import torch

from pyro_pdvi import PDVI, GenericSolver
from pyro_pdvi.models.quadratic import Quadratic

FIXED_ETAS = [{"sites": ["a"], "eta": 0.1}, {"sites": ["b"], "eta": 0.002}]


def make_pdvi(problem, **kwargs):
    kwargs.setdefault("solver", GenericSolver(inner_steps=30))
    return PDVI(
        problem.model,
        problem.guide,
        pyro.optim.Adam({"lr": 0.1}),
        problem.loss,
        blocks=problem.blocks,
        **kwargs,
    )


def consensus(problem):
    return torch.cat([pyro.param("a").detach(), pyro.param("b").detach()])


def run_epochs(problem, pdvi, num_epochs, lam_opt, stop_below=0.0):
    """Relative error of lambda_0 after each epoch (random block order)."""
    errors = []
    for _ in range(num_epochs):
        for b in torch.randperm(len(problem.blocks)).tolist():
            pdvi.step(problem.blocks[b])
        errors.append(float((consensus(problem) - lam_opt).norm() / lam_opt.norm()))
        if errors[-1] < stop_below:
            break
    return errors


def test_converges_linearly_to_exact_optimum():
    problem = Quadratic(num_data=12, num_blocks=4, scale_b=1.0)
    phi_opt, lam_opt = problem.optimum()
    pdvi = make_pdvi(problem)
    errors = run_epochs(problem, pdvi, 60, lam_opt, stop_below=1e-9)
    assert errors[-1] <= 1e-8
    assert torch.allclose(pyro.param("phi").detach(), phi_opt, rtol=0, atol=1e-7 * phi_opt.abs().max())
    # Linear rate: log error falls along a straight line (Thm. 4.6 (i)).
    logs = torch.tensor([math.log(e) for e in errors])
    epochs = torch.arange(len(logs), dtype=logs.dtype)
    slope = ((epochs - epochs.mean()) * (logs - logs.mean())).sum() / (epochs - epochs.mean()).square().sum()
    residual = logs - logs.mean() - slope * (epochs - epochs.mean())
    r_squared = 1 - residual.square().sum() / (logs - logs.mean()).square().sum()
    assert slope < -0.3  # at least a factor e^0.3 per epoch
    assert r_squared > 0.95


def test_preconditioned_groups_beat_one_step_size():
    """Group curvatures differ 100x: per-group automatic eta (P2D-VI) needs far fewer epochs."""
    problem = Quadratic(num_data=12, num_blocks=4, scale_b=10.0)
    _, lam_opt = problem.optimum()
    p2d = make_pdvi(problem, groups="per_site")
    p2d_errors = run_epochs(problem, p2d, 40, lam_opt, stop_below=1e-3)
    assert p2d_errors[-1] < 1e-3
    assert p2d.step_sizes["a"] > 30 * p2d.step_sizes["b"]

    pyro.clear_param_store()
    pd = make_pdvi(problem)
    pd_errors = run_epochs(problem, pd, 3 * len(p2d_errors), lam_opt, stop_below=1e-3)
    assert len(p2d_errors) <= 15
    assert min(pd_errors) > 1e-3  # not there after 3x the epochs


@pytest.mark.parametrize("global_update", ["consensus", "paper"])
def test_dual_identity_and_global_update_invariants(global_update):
    """mu_b = -grad_lambda f_b after an exact primal solve; lambda_0 = gamma + h, h = H mean(mu)."""
    problem = Quadratic(num_data=12, num_blocks=4)
    pdvi = make_pdvi(
        problem, groups=FIXED_ETAS, global_update=global_update, solver=GenericSolver(inner_steps=60)
    )
    for t in range(8):
        b = t % 4
        block = problem.blocks[b]
        pdvi.step(block)
        state = pdvi.state
        phi_b = pyro.param("phi").detach()[block]
        grad = problem.block_gradient(block, phi_b, state.copies[b])
        assert torch.allclose(state.duals[b], -grad, rtol=0, atol=1e-8)
        h = state.step_sizes * state.duals.mean(0)
        assert torch.allclose(state.h, h, rtol=0, atol=1e-12)
        # The consensus rule's mean leaves out the blocks not yet visited (still the start).
        visited = torch.arange(4) <= t
        gamma = state.copies[b] if global_update == "paper" else state.copies[visited].mean(0)
        assert torch.allclose(state.consensus, gamma + h, rtol=0, atol=1e-12)
        assert torch.allclose(consensus(problem), state.consensus, rtol=0, atol=0)


@pytest.mark.parametrize("global_update", ["consensus", "paper"])
def test_several_blocks_per_step_follow_the_algorithm(global_update):
    """A step over a union of m = 2 blocks equals Algorithm 1 with |S_t| = 2 and exact solves."""
    problem = Quadratic(num_data=12, num_blocks=4)
    pdvi = make_pdvi(
        problem, groups=FIXED_ETAS, global_update=global_update, solver=GenericSolver(inner_steps=60)
    )
    schedule = [(0, 2), (1, 3), (2, 3), (0, 1), (1, 2)]

    n = len(problem.blocks)
    step_sizes = torch.tensor([0.1, 0.1, 0.002, 0.002])
    lam0 = torch.zeros(4)
    duals = torch.zeros(n, 4)
    copies = torch.zeros(n, 4)
    phi = torch.zeros(problem.N, problem.p)
    h = torch.zeros(4)
    visited = torch.zeros(n, dtype=torch.bool)
    for pair in schedule:
        indices = torch.cat([problem.blocks[b] for b in pair])
        pdvi.step(indices)
        new = {}
        for b in pair:
            block = problem.blocks[b]
            phi_b, lam_b = problem.exact_block_solve(block, lam0, duals[b], step_sizes)
            new[b] = lam_b
            phi[block] = phi_b
            duals[b] = duals[b] + (lam_b - lam0) / step_sizes
            h = h + (lam_b - lam0) / n
        for b in pair:
            copies[b] = new[b]
            visited[b] = True
        if global_update == "paper":
            gamma = torch.stack([new[b] for b in pair]).mean(0)
        else:  # the mean of the visited blocks' copies
            gamma = copies[visited].mean(0)
        lam0 = gamma + h
        assert torch.allclose(consensus(problem), lam0, rtol=0, atol=1e-9)
        assert torch.allclose(pyro.param("phi").detach(), phi, rtol=0, atol=1e-9)


def test_diagnostics_and_full_gradient_norm_vanish_at_the_optimum():
    problem = Quadratic(num_data=12, num_blocks=4, scale_b=1.0)
    _, lam_opt = problem.optimum()
    pdvi = make_pdvi(problem)
    pdvi.step(problem.blocks[1])
    diagnostics = pdvi.diagnostics
    assert diagnostics["step"] == 1 and diagnostics["blocks"].tolist() == [1]
    assert set(diagnostics) >= {"block_loss", "consensus_residual", "dual_change", "step_sizes"}
    start_norm = pdvi.global_gradient_norm(problem.blocks[0])
    assert start_norm > 1.0
    run_epochs(problem, pdvi, 60, lam_opt, stop_below=1e-10)
    # At the optimum the full-data gradient in lambda is zero and blocks agree with the consensus.
    assert pdvi.global_gradient_norm(problem.blocks[0]) < 1e-7 * start_norm
    assert float(pdvi.diagnostics["consensus_residual"].max()) < 1e-8


def test_optim_method_uses_the_pyro_optimizer_and_its_per_site_args():
    """GenericSolver(method="optim"): the PyroOptim drives the primal solve, with per-site args."""
    problem = Quadratic(num_data=12, num_blocks=4, scale_b=1.0)
    _, lam_opt = problem.optimum()
    seen = []

    def per_site(name):
        seen.append(name)
        return {"lr": 0.05}

    pdvi = PDVI(
        problem.model,
        problem.guide,
        pyro.optim.Adam(per_site),
        problem.loss,
        blocks=problem.blocks,
        solver=GenericSolver(inner_steps=100, method="optim"),
    )
    errors = run_epochs(problem, pdvi, 8, lam_opt)
    assert set(seen) == {"a", "b", "phi"}
    assert errors[-1] < 0.1 * errors[0]
