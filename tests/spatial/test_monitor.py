"""The fit's per-epoch record: the exact objective and gradient norm from statistics, and
the convergence and rise logic behind the fit's warnings."""

import pytest
import torch

from pyro_pdvi.models.potts import potts_negative_elbo
from pyro_pdvi.spatial.monitor import FitMonitor

from ..models.potts.helpers import random_state, small_problem


def test_record_is_the_exact_objective_and_gradient_norm():
    data, prior, graph, _, labels = small_problem()
    m, rho, alpha = random_state(prior, 120)
    monitor = FitMonitor(data, prior, graph, tol=1e-6, truth=labels)
    row = monitor.record(0, 0.0, m, rho, alpha)
    leaves = [m.clone().requires_grad_(), rho.clone().requires_grad_()]
    objective = potts_negative_elbo(data, prior, graph, *leaves, alpha)
    gradient = torch.cat([g.flatten() for g in torch.autograd.grad(objective, leaves)])
    assert row["objective"] == pytest.approx(float(objective.detach()), rel=1e-13)
    assert row["grad_norm"] == pytest.approx(float(gradient.norm()), rel=1e-11)
    assert row["changed"] == 0.0 and -1 <= row["ari"] <= 1
    flipped = alpha.clone()
    flipped[:12] = flipped[:12].flip(-1)
    changed = float((flipped.argmax(-1) != alpha.argmax(-1)).double().mean())
    assert monitor.record(1, 0.1, m, rho, flipped)["changed"] == pytest.approx(changed)
    assert monitor.history["epoch"] == [0, 1]


def fake_history(monitor, objectives):
    monitor.history["epoch"] = list(range(len(objectives)))
    monitor.history["objective"] = list(objectives)
    monitor.history["changed"] = [0.0] * len(objectives)


def test_convergence_rises_and_warnings():
    data, prior, graph, _, _ = small_problem()
    monitor = FitMonitor(data, prior, graph, tol=1e-3)
    fake_history(monitor, [100.0, 90.0, 89.95])
    assert monitor.converged and monitor.rises == [] and monitor.warnings({"epochs": "E", "rise": "R"}) == []
    fake_history(monitor, [100.0, 90.0, 90.5, 80.0])
    assert not monitor.converged and monitor.rises == [2]
    rise, unconverged = monitor.warnings({"epochs": "more epochs", "rise": "smaller steps"})
    assert "rose in epochs [2] (by up to 0.5); smaller steps" in rise
    assert "stopped after 3 epochs before converging" in unconverged and unconverged.endswith("more epochs")
    fake_history(monitor, [100.0, 100.0 + 1e-9])  # rounding is not a rise
    assert monitor.rises == [] and monitor.converged
    fake_history(monitor, [100.0, 100.5])  # a rise above tol is neither
    assert monitor.rises == [1] and not monitor.converged
