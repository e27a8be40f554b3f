"""The rising-objective safeguard: on a non-convex model a step size too large for it makes the
objective climb; PDVI halves its step sizes until it falls again, and says so."""

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO, TraceEnum_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_pdvi import PDVI, GenericSolver
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
    assert pdvi.diagnostics["step_decay"] is None  # exact solves: no stationarity test
    assert pdvi.step_sizes["default"] == pytest.approx(3e-2 * pdvi.diagnostics["damping"])
    peak = max(range(len(objectives)), key=objectives.__getitem__)
    assert peak < 25 and objectives[-1] < objectives[peak] - 1000
    assert all(b <= a + 1e-6 * abs(a) for a, b in zip(objectives[-5:], objectives[-4:]))  # falling at the end


def test_guard_counts_two_rises_in_a_row():
    """Exact ``f_b`` (a solver's): any two rises in a row above the relative tolerance."""
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


def _decisions(totals, monte_carlo):
    guard = RisingObjectiveGuard(monte_carlo)
    decisions = []
    for total in totals:
        guard.add(torch.tensor([float(total)]), torch.tensor([1.0]))
        decisions.append(guard.end_epoch())
    return decisions


def test_monte_carlo_noise_does_not_damp_but_a_climb_through_it_does():
    """Stationary noise of sd 1 around 1000 (Monte Carlo f_b): rises within it do not count,
    though the same estimate from exact f_b is damped; a climb of 5 per epoch through the same
    noise is damped within a few epochs of starting."""
    noise = torch.randn(60, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    flat = (1000 + noise).tolist()
    assert not any(_decisions(flat, monte_carlo=True))
    assert any(_decisions([1000 + 50 * e for e in noise.tolist()], monte_carlo=False))
    climb = flat[:30] + [flat[30 + k] + 5 * (k + 1) for k in range(30)]
    decisions = _decisions(climb, monte_carlo=True)
    assert not any(decisions[:30]) and any(decisions[30:36])


def test_guard_state_round_trips():
    guard = RisingObjectiveGuard(monte_carlo=True)
    for total in [3.0, 2.0, 2.5, 1.0, 1.5, 1.2]:
        guard.add(torch.tensor([total]), torch.tensor([1.0]))
        guard.end_epoch()
    copy = RisingObjectiveGuard(monte_carlo=True)
    copy.load_state_dict(guard.state_dict())
    assert copy.noise_sd() == guard.noise_sd() > 0


def test_monte_carlo_noise_of_a_convex_fit_is_not_damped():
    """Bayesian logistic regression with Pyro's one-particle ELBO and the paper's global update
    (which hands each block's noise to lambda_0 in full): near the optimum the per-epoch
    objective estimate only wobbles with Monte Carlo noise, and PDVI keeps its step sizes; the
    plain rule (exact f_b assumed), which these rises fool, damps the same runs. How often either
    halves depends on the trajectory (on seed 1 alone the noise-aware rule kept 1.0 before 13n's
    line search and halved twice after it), so the test counts halvings over four seeds: measured
    2 against 7 with the halving line search, 4 against 11 with interpolation (13n)."""
    pyro.set_rng_seed(0)
    features = torch.randn(300, 20)
    labels = torch.distributions.Bernoulli(logits=features @ torch.randn(20)).sample()
    blocks = list(torch.arange(300).split(15))

    def model(idx):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([20]).to_event(1))
        with pyro.plate("data", 300, subsample=idx):
            pyro.sample("y", dist.Bernoulli(logits=features[idx] @ w), obs=labels[idx])

    def damping(monte_carlo_noise: bool, seed: int) -> float:
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        pdvi = PDVI(
            model,
            AutoNormal(model),
            pyro.optim.Adam({}),
            Trace_ELBO(),
            blocks=blocks,
            step_decay=False,
            global_update="paper",
            # The solve this noise was measured with (13e): the trust box of the default
            # solve (13f) leaves fewer rises to damp.
            solver=GenericSolver(trust=None),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pdvi.step(blocks[0])
            assert pdvi._guard.monte_carlo  # the generic solve through a one-particle ELBO
            pdvi._guard.monte_carlo = monte_carlo_noise
            for _ in range(20):
                for b in torch.randperm(len(blocks)).tolist():
                    pdvi.step(blocks[b])
        return pdvi.diagnostics["damping"]

    noise_aware, plain = zip(*[(damping(True, seed), damping(False, seed)) for seed in range(1, 5)])
    assert all(a >= b for a, b in zip(noise_aware, plain))
    halvings = [-sum(math.log2(d) for d in rule) for rule in (noise_aware, plain)]
    assert halvings[0] <= halvings[1] / 2
