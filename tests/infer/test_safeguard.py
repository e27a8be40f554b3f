"""The rising-objective safeguard: on a non-convex model a step size too large for it makes the
objective climb; PDVI halves its step sizes until it falls again, and says so."""

import pyro
import pytest
import torch
from pyro.infer import TraceEnum_ELBO

from pyro_pdvi import PDVI
from pyro_pdvi.infer.safeguard import RisingObjectiveGuard
from pyro_pdvi.models.gmm import GMMBlockSolver, GMMModel, make_biased_gmm, negative_elbo, optimal_logits


def test_rising_objective_halves_the_step_sizes_and_the_objective_falls_again():
    """The GMM on pure blocks with a step size 10x the stable one (algorithm.md: 3e-3 diverged
    there without a safeguard): the objective rises while the copies bounce, the safeguard
    damps, the objective falls."""
    data = make_biased_gmm(2000, 5, 10, 200, 1.0, seed=0)
    gmm = GMMModel(data.data, data.prior)
    pdvi = PDVI(
        gmm.model,
        gmm.guide,
        pyro.optim.Adam({}),
        TraceEnum_ELBO(max_plate_nesting=1),
        blocks=data.blocks,
        eta=3e-2,
        groups=[{"sites": ["rho"], "eta": 0.3}],
        solver=GMMBlockSolver(data.data, data.prior),
    )
    objectives = []
    with pytest.warns(UserWarning, match="the objective rose in 2 epochs in a row"):
        for _ in range(40):
            for b in torch.randperm(len(data.blocks)).tolist():
                pdvi.step(data.blocks[b])
            m, rho = pyro.param("m").detach(), pyro.param("rho").detach()
            objectives.append(
                float(
                    negative_elbo(
                        data.data, data.prior, m, rho, optimal_logits(data.data, data.prior, m, rho)
                    )
                )
            )
    assert pdvi.diagnostics["damping"] < 1
    assert pdvi.step_sizes["default"] == pytest.approx(3e-2 * pdvi.diagnostics["damping"])
    peak = max(range(len(objectives)), key=objectives.__getitem__)
    assert peak < 25 and objectives[-1] < objectives[peak] - 1000
    assert all(b <= a + 1e-6 * abs(a) for a, b in zip(objectives[-5:], objectives[-4:]))  # falling at the end


def test_guard_counts_two_rises_in_a_row():
    guard = RisingObjectiveGuard()
    decisions = []
    for total in [10.0, 9.0, 9.5, 8.0, 8.5, 9.0, 8.0]:
        guard.add(torch.tensor([total]), torch.tensor([1.0]))
        decisions.append(guard.end_epoch())
    assert decisions == [False, False, False, False, False, True, False]
    assert guard.damping == 0.5


def test_guard_ignores_rises_while_the_copies_converge():
    """The objective estimate climbs to the optimum as the copies meet: no damping while the
    mean consensus residual reaches new lows, damping once it stalls."""
    guard = RisingObjectiveGuard()
    decisions = []
    for total, residual in [(8.0, 1.0), (9.0, 0.5), (9.5, 0.25), (9.7, 0.2), (9.9, 0.2), (10.1, 0.21)]:
        guard.add(torch.tensor([total, total]), torch.tensor([residual, residual]))
        decisions.append(guard.end_epoch())
    assert decisions == [False, False, False, False, False, True]
