"""Reference optima of the *mean-field* family of each model, computed in float64 and
independently of Pyro's ELBO estimators and of PDVI.

Each model's negative ELBO of its mean-field Gaussian guide (LogNormal for the positive
sites, whose guide is a Normal on the log) is written in closed form here, with every
constant, so that it equals the expectation of Pyro's ``Trace_ELBO`` loss on the full data
(tested against a many-particle Monte Carlo estimate in ``tests/benchmarks``). The params
are keyed by their param-store names and given as the *constrained* values (scales
positive); :func:`compute_reference` minimises it:

* ``logreg``, ``mixed``, ``hier``, ``scale``, ``odlogit``, ``biglogreg``, ``robust``,
  ``poisson``: L-BFGS (scipy) in the unconstrained coordinates ``(loc, log scale)``, then
  Newton steps with the exact Hessian until the gradient norm is ~1e-10. ``E log sigmoid(t)``
  with ``t ~ N(m, v)`` is a 1-D Gaussian quadrature: the trapezoid rule in ``u = (t - m) /
  sqrt(v)`` on ``[-12, 12]``, exact to ~1e-15 for every variance up to hundreds, because ``log
  sigmoid`` is analytic in a strip of half-width pi around the real axis, a strip of half-width
  ``pi / sqrt(v)`` in ``u``: the rule's error falls as ``exp(-2 pi a / h)`` for a step ``h``
  and any ``a`` below that, so the step is ``min(0.25, 0.5 / sqrt(max v))`` (100-node
  Gauss-Hermite, the usual choice, errs by 6e-7 at ``v = 25`` and 5e-4 at ``v = 100`` for the
  same reason; tested). A fixed step of 0.02 cost ``biglogreg``'s 100,000 rows 6.5 s an
  evaluation.
* ``ppca``, ``ppca_cancer``: coordinate ascent (CAVI: the exact minimiser of q(z) given q(W), then of q(W)
  given q(z), both in closed form) from the methods' initial params, then L-BFGS from its
  fixed point. The model is non-convex; the reference is the stationary point reached from
  the common start.
* ``gmm``: full-batch CAVI of :func:`pyro_pdvi.models.cavi` from the methods' start.

Useful closed forms, for ``q = N(m, s^2)`` on ``u = log tau``: ``E[log tau] = m``,
``E[tau^-2] = exp(-2m + 2s^2)``, ``E[tau^2] = exp(2m + 2s^2)``, and the entropy of the
LogNormal ``q(tau)`` is ``m + 1/2 log(2 pi e s^2)``; ``E[tau] = exp(m + s^2 / 2)``, so a
``Gamma(a, b)`` prior gives ``E log p(tau) = a log b - log Gamma(a) + (a - 1) m - b exp(m +
s^2 / 2)``; for ``t ~ N(m, v)``, ``E exp(t) = exp(m + v / 2)`` (the Poisson log link).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import pyro
import torch
from scipy.optimize import minimize

from pyro_pdvi.models import cavi, negative_elbo

from .models import (
    GMM,
    PPCA,
    HierarchicalNormal,
    LogisticRegression,
    MixedEffects,
    NegativeBinomialRandomIntercept,
    NormalScale,
    OverdispersedLogistic,
    PoissonGroupedIntercepts,
    PoissonNestedSlopes,
    PoissonRandomIntercept,
    PoissonRandomSlopes,
    PoissonThreeLevels,
    Problem,
    RobustRegression,
)

LOG_2PI = math.log(2 * math.pi)
#: The largest step of the quadrature of ``E f(u)``, ``u ~ N(0, 1)``, on ``[-12, 12]`` (see the
#: module docstring), and the step times the largest standard deviation of ``t``.
QUADRATURE_STEP = 0.25
QUADRATURE_STEP_TIMES_SD = 0.5


def auto_names(*sites: str) -> list[str]:
    """AutoNormal's param names of ``sites``: their locs, then their scales."""
    return [f"AutoNormal.locs.{s}" for s in sites] + [f"AutoNormal.scales.{s}" for s in sites]


def gaussian_entropy(scale: torch.Tensor) -> torch.Tensor:
    return (0.5 * (LOG_2PI + 1) + scale.log()).sum()


def expected_normal_log_prob(loc: torch.Tensor, scale: torch.Tensor, prior_scale: float) -> torch.Tensor:
    """``sum E_q log N(u | 0, prior_scale^2)`` for ``q = N(loc, scale^2)``."""
    variance = prior_scale**2
    return (-0.5 * math.log(2 * math.pi * variance) - (loc.square() + scale.square()) / (2 * variance)).sum()


def expected_log_sigmoid(mean: torch.Tensor, variance: torch.Tensor) -> torch.Tensor:
    """``E log sigmoid(t)``, ``t ~ N(mean, variance)``, elementwise, by quadrature (module
    docstring)."""
    sd = variance.sqrt()
    step = min(QUADRATURE_STEP, QUADRATURE_STEP_TIMES_SD / max(float(sd.detach().max()), 1e-300))
    count = math.ceil(12.0 / step)
    units = torch.arange(-count, count + 1, dtype=torch.float64) * step
    weights = step * torch.exp(-0.5 * units.square()) / math.sqrt(2 * math.pi)
    nodes = mean.unsqueeze(-1) + sd.unsqueeze(-1) * units
    return (torch.nn.functional.logsigmoid(nodes) * weights).sum(-1)


def lognormal_site_terms(loc, scale, log_prior: str, prior_scale: float = 1.0) -> torch.Tensor:
    """``E_q log p(tau) + H(q(tau))`` for a LogNormal ``q(tau)`` (Normal on ``log tau``) under a
    ``LogNormal(0, prior_scale)`` or ``HalfNormal(prior_scale)`` prior."""
    entropy = gaussian_entropy(scale) + loc.sum()
    if log_prior == "lognormal":
        variance = prior_scale**2
        log_p = (
            -loc - 0.5 * math.log(2 * math.pi * variance) - (loc.square() + scale.square()) / (2 * variance)
        )
    elif log_prior == "halfnormal":
        second_moment = torch.exp(2 * loc + 2 * scale.square())
        log_p = (
            math.log(2) - 0.5 * math.log(2 * math.pi * prior_scale**2) - second_moment / (2 * prior_scale**2)
        )
    else:
        raise ValueError(log_prior)
    return log_p.sum() + entropy


# --------------------------------------------------------------------------- closed forms


def logreg_neg_elbo(problem: LogisticRegression, params: dict[str, torch.Tensor]) -> torch.Tensor:
    x, y = problem.data["x"], problem.data["y"]
    loc, scale = params["AutoNormal.locs.w"], params["AutoNormal.scales.w"]
    sign = 2 * y - 1
    likelihood = expected_log_sigmoid(sign * (x @ loc), x.square() @ scale.square()).sum()
    prior = expected_normal_log_prob(loc, scale, problem.prior_scale)
    return -(likelihood + prior + gaussian_entropy(scale))


def odlogit_neg_elbo(problem: OverdispersedLogistic, params: dict[str, torch.Tensor]) -> torch.Tensor:
    x, y = problem.data["x"], problem.data["y"]
    loc, scale = params["AutoNormal.locs.w"], params["AutoNormal.scales.w"]
    u_loc, u_scale = params["AutoNormal.locs.u"], params["AutoNormal.scales.u"]
    sign = 2 * y - 1
    variance = x.square() @ scale.square() + u_scale.square()
    likelihood = expected_log_sigmoid(sign * (x @ loc + u_loc), variance).sum()
    prior = expected_normal_log_prob(loc, scale, problem.prior_scale)
    prior = prior + expected_normal_log_prob(u_loc, u_scale, problem.effect_scale)
    return -(likelihood + prior + gaussian_entropy(scale) + gaussian_entropy(u_scale))


def ppca_neg_elbo(problem: PPCA, params: dict[str, torch.Tensor]) -> torch.Tensor:
    x = problem.data["x"]
    w_loc, w_scale, z_loc, z_scale = (params[k] for k in ("W_loc", "W_scale", "z_loc", "z_scale"))
    num_data, dim = x.shape
    noise_var = problem.noise_scale**2
    # E ||x_i - W z_i||^2 = ||x_i - M a_i||^2 + sum_k [ colsum(S^2)_k a_ik^2 + colsum(M^2 + S^2)_k b_ik^2 ]
    residual = (x - z_loc @ w_loc.T).square().sum()
    spread = (z_loc.square() @ w_scale.square().sum(0)) + (
        z_scale.square() @ (w_loc.square() + w_scale.square()).sum(0)
    )
    likelihood = -0.5 * num_data * dim * math.log(2 * math.pi * noise_var) - (residual + spread.sum()) / (
        2 * noise_var
    )
    prior = expected_normal_log_prob(w_loc, w_scale, problem.prior_scale) + expected_normal_log_prob(
        z_loc, z_scale, 1.0
    )
    return -(likelihood + prior + gaussian_entropy(w_scale) + gaussian_entropy(z_scale))


def mixed_neg_elbo(problem: MixedEffects, params: dict[str, torch.Tensor]) -> torch.Tensor:
    x, y, group = problem.data["x"], problem.data["y"], problem.data["group"]

    def q(site):
        return params[f"AutoNormal.locs.{site}"], params[f"AutoNormal.scales.{site}"]

    (m_alpha, s_alpha), (m_beta, s_beta), (m_a, s_a), (m_b, s_b) = (q(s) for s in ("alpha", "beta", "a", "b"))
    total = 0.0
    for site in ("alpha", "beta"):
        loc, scale = q(site)
        total = (
            total + expected_normal_log_prob(loc, scale, problem.fixed_prior_scale) + gaussian_entropy(scale)
        )
    for site in ("tau_a", "tau_b", "sigma"):
        total = total + lognormal_site_terms(*q(site), "lognormal")
    for (m_tau, s_tau), (loc, scale) in ((q("tau_a"), (m_a, s_a)), (q("tau_b"), (m_b, s_b))):
        inverse_variance = torch.exp(-2 * m_tau + 2 * s_tau.square())
        total = (
            total
            + (-0.5 * LOG_2PI - m_tau - 0.5 * inverse_variance * (loc.square() + scale.square())).sum()
            + gaussian_entropy(scale)
        )
    m_sigma, s_sigma = q("sigma")
    mean = m_alpha + m_a[group] + (m_beta + m_b[group]) * x
    square = (y - mean).square() + s_alpha.square() + s_a[group].square()
    square = square + x.square() * (s_beta.square() + s_b[group].square())
    inverse_variance = torch.exp(-2 * m_sigma + 2 * s_sigma.square())
    total = total + (-0.5 * LOG_2PI - m_sigma - 0.5 * inverse_variance * square).sum()
    return -total


def hier_neg_elbo(problem: HierarchicalNormal, params: dict[str, torch.Tensor]) -> torch.Tensor:
    x = problem.data["x"]
    m, s = params["AutoNormal.locs.mu"], params["AutoNormal.scales.mu"]
    t, r = params["AutoNormal.locs.theta"], params["AutoNormal.scales.theta"]
    theta_var, noise_var = problem.theta_scale**2, problem.noise_scale**2
    theta_term = -0.5 * math.log(2 * math.pi * theta_var) - ((t - m).square() + r.square() + s.square()) / (
        2 * theta_var
    )
    x_term = -0.5 * math.log(2 * math.pi * noise_var) - ((x - t).square() + r.square()) / (2 * noise_var)
    total = expected_normal_log_prob(m, s, problem.prior_scale) + gaussian_entropy(s) + gaussian_entropy(r)
    return -(total + theta_term.sum() + x_term.sum())


def scale_neg_elbo(problem: NormalScale, params: dict[str, torch.Tensor]) -> torch.Tensor:
    x, y = problem.data["x"], problem.data["y"]
    m_w, s_w = params["AutoNormal.locs.w"], params["AutoNormal.scales.w"]
    m_sigma, s_sigma = params["AutoNormal.locs.sigma"], params["AutoNormal.scales.sigma"]
    total = expected_normal_log_prob(m_w, s_w, problem.prior_scale) + gaussian_entropy(s_w)
    total = total + lognormal_site_terms(m_sigma, s_sigma, "halfnormal", problem.sigma_prior_scale)
    square = (y - x @ m_w).square() + x.square() @ s_w.square()
    inverse_variance = torch.exp(-2 * m_sigma + 2 * s_sigma.square())
    total = total + (-0.5 * LOG_2PI - m_sigma - 0.5 * inverse_variance * square).sum()
    return -total


def robust_neg_elbo(problem: RobustRegression, params: dict[str, torch.Tensor]) -> torch.Tensor:
    x, y = problem.data["x"], problem.data["y"]
    m_w, s_w = params["AutoNormal.locs.w"], params["AutoNormal.scales.w"]
    m_sigma, s_sigma = params["AutoNormal.locs.sigma"], params["AutoNormal.scales.sigma"]
    m_weight, s_weight = params["AutoNormal.locs.weight"], params["AutoNormal.scales.weight"]
    total = expected_normal_log_prob(m_w, s_w, problem.prior_scale) + gaussian_entropy(s_w)
    total = total + lognormal_site_terms(m_sigma, s_sigma, "halfnormal", problem.sigma_prior_scale)
    half_nu = 0.5 * problem.degrees_of_freedom
    weight_mean = torch.exp(m_weight + 0.5 * s_weight.square())
    weight_prior = half_nu * math.log(half_nu) - math.lgamma(half_nu) + (half_nu - 1) * m_weight
    total = total + (weight_prior - half_nu * weight_mean).sum() + gaussian_entropy(s_weight) + m_weight.sum()
    # E log N(y | x w, sigma^2 / weight) = -1/2 log 2 pi - E log sigma + 1/2 E log weight
    #                                      - 1/2 E[weight] E[sigma^-2] E[(y - x w)^2]
    square = (y - x @ m_w).square() + x.square() @ s_w.square()
    inverse_variance = torch.exp(-2 * m_sigma + 2 * s_sigma.square())
    total = (
        total
        + (-0.5 * LOG_2PI - m_sigma + 0.5 * m_weight - 0.5 * inverse_variance * weight_mean * square).sum()
    )
    return -total


def effect_terms(
    problem: PoissonRandomIntercept, params: dict[str, torch.Tensor], effect: str, scale: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A kind of Gaussian effect's terms of the count models: its scale's (``HalfNormal`` prior,
    LogNormal q) and its own expected log prior and entropy; and its means and sds under q."""
    m_tau, s_tau = params[f"AutoNormal.locs.{scale}"], params[f"AutoNormal.scales.{scale}"]
    m, s = params[f"AutoNormal.locs.{effect}"], params[f"AutoNormal.scales.{effect}"]
    total = lognormal_site_terms(m_tau, s_tau, "halfnormal", problem.tau_prior_scale)
    inverse_variance = torch.exp(-2 * m_tau + 2 * s_tau.square())
    total = total + (-0.5 * LOG_2PI - m_tau - 0.5 * inverse_variance * (m.square() + s.square())).sum()
    return total + gaussian_entropy(s), m, s


def random_intercept_terms(
    problem: PoissonRandomIntercept, params: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The count models' terms without the likelihood (``w``'s, ``tau``'s and the sites' effects'
    expected log prior and entropy), and the mean and variance under q of each datum's log mean
    ``x w + a_site``."""
    x, site = problem.data["x"], problem.data["site"]
    m_w, s_w = params["AutoNormal.locs.w"], params["AutoNormal.scales.w"]
    total = expected_normal_log_prob(m_w, s_w, problem.prior_scale) + gaussian_entropy(s_w)
    effects, m_a, s_a = effect_terms(problem, params, "a", "tau")
    total = total + effects
    return total, x @ m_w + m_a[site], x.square() @ s_w.square() + s_a[site].square()


def poisson_expected_log_likelihood(
    y: torch.Tensor, mean: torch.Tensor, variance: torch.Tensor
) -> torch.Tensor:
    """``sum E log Poisson(y | exp(t))`` for ``t ~ N(mean, variance)``."""
    return (y * mean - torch.exp(mean + 0.5 * variance) - torch.lgamma(y + 1)).sum()


def poisson_neg_elbo(problem: PoissonRandomIntercept, params: dict[str, torch.Tensor]) -> torch.Tensor:
    total, log_rate_mean, log_rate_variance = random_intercept_terms(problem, params)
    return -(total + poisson_expected_log_likelihood(problem.data["y"], log_rate_mean, log_rate_variance))


def slope_terms(
    problem: PoissonRandomSlopes, params: dict[str, torch.Tensor], terms: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``terms`` (:func:`random_intercept_terms`' three) with each site's slope on time: its prior
    (scale ``tau_b``) and entropy, and ``b_site t`` in the log rate's mean and variance."""
    time, site = problem.data["x"][:, 1], problem.data["site"]
    total, log_rate_mean, log_rate_variance = terms
    slopes, m_b, s_b = effect_terms(problem, params, "b", "tau_b")
    return (
        total + slopes,
        log_rate_mean + m_b[site] * time,
        log_rate_variance + s_b[site].square() * time.square(),
    )


def grouped_terms(
    problem: PoissonGroupedIntercepts, params: dict[str, torch.Tensor], terms: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``terms`` with each row's group's intercept (a region's, a period's): its prior (its scale
    ``problem.scale``) and entropy, and the intercept in the log rate's mean and variance."""
    return intercept_terms(problem, params, terms, problem.effect, problem.scale, problem.groups)


def intercept_terms(
    problem: PoissonRandomIntercept,
    params: dict[str, torch.Tensor],
    terms: tuple[torch.Tensor, ...],
    effect: str,
    scale: str,
    groups: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``terms`` with a random intercept ``effect`` (its prior scale ``scale``) of each row's group
    in ``groups``."""
    total, log_rate_mean, log_rate_variance = terms
    grouped, m, s = effect_terms(problem, params, effect, scale)
    return total + grouped, log_rate_mean + m[groups], log_rate_variance + s[groups].square()


def poisson_terms_neg_elbo(problem: PoissonRandomIntercept, terms: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The negative ELBO from ``terms``: their total and the counts' expected log likelihood."""
    total, log_rate_mean, log_rate_variance = terms
    return -(total + poisson_expected_log_likelihood(problem.data["y"], log_rate_mean, log_rate_variance))


def poisson_slopes_neg_elbo(problem: PoissonRandomSlopes, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """:func:`poisson_neg_elbo` with each site's slope on time (:func:`slope_terms`)."""
    return poisson_terms_neg_elbo(
        problem, slope_terms(problem, params, random_intercept_terms(problem, params))
    )


def poisson_grouped_neg_elbo(
    problem: PoissonGroupedIntercepts, params: dict[str, torch.Tensor]
) -> torch.Tensor:
    """:func:`poisson_neg_elbo` with each row's group's intercept (:func:`grouped_terms`)."""
    terms = grouped_terms(problem, params, random_intercept_terms(problem, params))
    return poisson_terms_neg_elbo(problem, terms)


def poisson_nested_slopes_neg_elbo(
    problem: PoissonNestedSlopes, params: dict[str, torch.Tensor]
) -> torch.Tensor:
    """:func:`poisson_neg_elbo` with each site's slope and its region's intercept."""
    terms = slope_terms(problem, params, random_intercept_terms(problem, params))
    return poisson_terms_neg_elbo(problem, grouped_terms(problem, params, terms))


def poisson_three_levels_neg_elbo(
    problem: PoissonThreeLevels, params: dict[str, torch.Tensor]
) -> torch.Tensor:
    """:func:`poisson_grouped_neg_elbo` with each row's country's intercept too."""
    terms = grouped_terms(problem, params, random_intercept_terms(problem, params))
    terms = intercept_terms(problem, params, terms, "k", "tau_k", problem.countries)
    return poisson_terms_neg_elbo(problem, terms)


def negbin_neg_elbo(
    problem: NegativeBinomialRandomIntercept, params: dict[str, torch.Tensor]
) -> torch.Tensor:
    """As :func:`poisson_neg_elbo`, with ``E log NB(y | r, logits = t - log r)`` for ``t ~ N(m, v)``:
    ``log NB = lgamma(y + r) - lgamma(r) - lgamma(y + 1) + r log sigmoid(-l) + y log sigmoid(l)``,
    each ``E log sigmoid`` by :func:`expected_log_sigmoid`."""
    y, r = problem.data["y"], problem.total_count
    total, log_mean, variance = random_intercept_terms(problem, params)
    logit_mean = log_mean - math.log(r)
    constant = torch.lgamma(y + r) - math.lgamma(r) - torch.lgamma(y + 1)
    likelihood = (
        constant
        + r * expected_log_sigmoid(-logit_mean, variance)
        + y * expected_log_sigmoid(logit_mean, variance)
    )
    return -(total + likelihood.sum())


def gmm_neg_elbo(problem: GMM, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """:func:`pyro_pdvi.models.negative_elbo` at the params (``alpha`` normalised first)."""
    alpha = torch.log_softmax(params["alpha"], -1)
    return negative_elbo(problem.data["x"], problem.prior64, params["m"], params["rho"], alpha)


NEG_ELBO: dict[str, Callable[[Problem, dict[str, torch.Tensor]], torch.Tensor]] = {
    "logreg": logreg_neg_elbo,
    "ppca": ppca_neg_elbo,
    "mixed": mixed_neg_elbo,
    "hier": hier_neg_elbo,
    "scale": scale_neg_elbo,
    "odlogit": odlogit_neg_elbo,
    "gmm": gmm_neg_elbo,
    "biglogreg": logreg_neg_elbo,
    "ppca_cancer": ppca_neg_elbo,
    "robust": robust_neg_elbo,
    "poisson": poisson_neg_elbo,
    "poisson200": poisson_neg_elbo,
    "poisson200_few": poisson_neg_elbo,
    "poisson1000": poisson_neg_elbo,
    "poisson_slopes": poisson_slopes_neg_elbo,
    "poisson_nested": poisson_grouped_neg_elbo,
    "poisson_crossed": poisson_grouped_neg_elbo,
    "poisson_nested100": poisson_grouped_neg_elbo,
    "poisson_crossed200": poisson_grouped_neg_elbo,
    "poisson_nested_slopes": poisson_nested_slopes_neg_elbo,
    "poisson_three_levels": poisson_three_levels_neg_elbo,
    "negbin": negbin_neg_elbo,
}

#: Each model's param names, locs first, then scales (GMM: means, log-variances, logits).
PARAM_NAMES: dict[str, list[str]] = {
    "logreg": auto_names("w"),
    "ppca": ["W_loc", "z_loc", "W_scale", "z_scale"],
    "mixed": auto_names("alpha", "beta", "tau_a", "tau_b", "sigma", "a", "b"),
    "hier": auto_names("mu", "theta"),
    "scale": auto_names("w", "sigma"),
    "odlogit": auto_names("w", "u"),
    "gmm": ["m", "rho", "alpha"],
    "biglogreg": auto_names("w"),
    "ppca_cancer": ["W_loc", "z_loc", "W_scale", "z_scale"],
    "robust": auto_names("w", "sigma", "weight"),
    "poisson": auto_names("w", "tau", "a"),
    "poisson200": auto_names("w", "tau", "a"),
    "poisson200_few": auto_names("w", "tau", "a"),
    "poisson1000": auto_names("w", "tau", "a"),
    "poisson_slopes": auto_names("w", "tau", "tau_b", "a", "b"),
    "poisson_nested": auto_names("w", "tau", "tau_c", "a", "c"),
    "poisson_crossed": auto_names("w", "tau", "tau_d", "a", "d"),
    "poisson_nested100": auto_names("w", "tau", "tau_c", "a", "c"),
    "poisson_crossed200": auto_names("w", "tau", "tau_d", "a", "d"),
    "poisson_nested_slopes": auto_names("w", "tau", "tau_b", "tau_c", "a", "b", "c"),
    "poisson_three_levels": auto_names("w", "tau", "tau_c", "tau_k", "a", "c", "k"),
    "negbin": auto_names("w", "tau", "a"),
}


def is_scale(name: str) -> bool:
    return ".scales." in name or name.endswith("_scale")


def neg_elbo(problem: Problem, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """The closed-form negative ELBO of ``problem`` at constrained ``params`` (float64)."""
    return NEG_ELBO[problem.name](problem, params)


# --------------------------------------------------------------------------- solvers


@dataclass
class Reference:
    """A reference optimum.

    :param params: constrained float64 values by param name.
    :param neg_elbo: the closed-form negative ELBO there.
    :param grad_norm: norm of its gradient in the unconstrained ``(loc, log scale)``
        coordinates (GMM: the largest parameter change of CAVI's last sweep).
    :param method: how it was computed.
    :param seconds: how long it took.
    """

    params: dict[str, torch.Tensor]
    neg_elbo: float
    grad_norm: float
    method: str
    seconds: float


class Unconstrained:
    """Flat ``(loc, log scale)`` coordinates of a problem's params and the closed form in them."""

    def __init__(self, problem: Problem, params: dict[str, torch.Tensor]) -> None:
        self.problem = problem
        self.names = PARAM_NAMES[problem.name]
        self.shapes = [params[n].shape for n in self.names]

    def flatten(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat(
            [
                (params[n].log() if is_scale(n) else params[n]).reshape(-1).to(torch.float64)
                for n in self.names
            ]
        )

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        values = flat.split([math.prod(s) for s in self.shapes])
        return {
            n: (v.exp() if is_scale(n) else v).reshape(s) for n, v, s in zip(self.names, values, self.shapes)
        }

    def loss(self, flat: torch.Tensor) -> torch.Tensor:
        return neg_elbo(self.problem, self.unflatten(flat))

    def value_and_grad(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = flat.detach().requires_grad_()
        value = self.loss(flat)
        return value.detach(), torch.autograd.grad(value, flat)[0]


def lbfgs(objective: Unconstrained, flat: torch.Tensor, max_iter: int = 20000) -> torch.Tensor:
    """scipy's L-BFGS-B on the closed form, to its own tolerance limit."""

    def fun(x):
        value, grad = objective.value_and_grad(torch.from_numpy(x))
        return float(value), grad.numpy()

    result = minimize(
        fun,
        flat.numpy(),
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": max_iter, "maxfun": 2 * max_iter, "maxcor": 30, "ftol": 0.0, "gtol": 1e-12},
    )
    return torch.from_numpy(result.x)


def newton(objective: Unconstrained, flat: torch.Tensor, steps: int = 20, tol: float = 1e-10) -> torch.Tensor:
    """Newton steps with the exact Hessian (small problems), each accepted only if it lowers
    the objective or the gradient: quadratic convergence from an L-BFGS point."""
    for _ in range(steps):
        value, grad = objective.value_and_grad(flat)
        if grad.norm() < tol:
            break
        hessian = torch.autograd.functional.hessian(objective.loss, flat)
        try:
            direction = torch.linalg.solve(hessian, grad)
        except RuntimeError:
            break
        candidate = flat - direction
        new_value, new_grad = objective.value_and_grad(candidate)
        if not (new_value <= value or new_grad.norm() < grad.norm()):
            break
        flat = candidate
    return flat


def ppca_locals(problem: PPCA, w_loc: torch.Tensor, w_scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """The exact minimiser of the closed form over q(z) given q(W) = N(M, S^2)::

        z_loc_i = (M^T M + diag(colsum S^2) + noise^2 I)^-1 M^T x_i
        z_scale_ik^-2 = 1 + colsum(M^2 + S^2)_k / noise^2

    (differentiable: :func:`ppca_reduced_neg_elbo` differentiates through it)."""
    x, noise_var = problem.data["x"], problem.noise_scale**2
    eye = torch.eye(w_loc.shape[1], dtype=x.dtype)
    gram = w_loc.T @ w_loc + torch.diag(w_scale.square().sum(0)) + noise_var * eye
    z_loc = torch.linalg.solve(gram, w_loc.T @ x.T).T
    z_scale = (1 + (w_loc.square() + w_scale.square()).sum(0) / noise_var).rsqrt().expand_as(z_loc)
    return {"z_loc": z_loc, "z_scale": z_scale}


def ppca_globals(problem: PPCA, z_loc: torch.Tensor, z_scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """The exact minimiser over q(W) given q(z): :func:`ppca_locals` with the roles swapped and
    the prior precision ``noise^2 / prior^2`` in place of ``noise^2``."""
    x, noise_var, prior_var = problem.data["x"], problem.noise_scale**2, problem.prior_scale**2
    eye = torch.eye(z_loc.shape[1], dtype=x.dtype)
    gram = z_loc.T @ z_loc + torch.diag(z_scale.square().sum(0)) + (noise_var / prior_var) * eye
    w_loc = torch.linalg.solve(gram, z_loc.T @ x).T
    second = (z_loc.square() + z_scale.square()).sum(0)
    w_scale = (1 / prior_var + second / noise_var).rsqrt().expand_as(w_loc)
    return {"W_loc": w_loc, "W_scale": w_scale}


@torch.no_grad()
def ppca_cavi(
    problem: PPCA, params: dict[str, torch.Tensor], max_sweeps: int = 2000, tol: float = 1e-12
) -> tuple[dict[str, torch.Tensor], int]:
    """Coordinate ascent for the mean-field PPCA: q(z) given q(W), then q(W) given q(z), each an
    exact minimisation, so the negative ELBO never increases. Stops when the largest change of
    a param in a sweep is below ``tol`` (or after ``max_sweeps``: CAVI is slow along the
    directions that rotate W and z together, which is why :func:`compute_reference` ends
    with Newton steps)."""
    current = {k: v.clone() for k, v in params.items()}
    sweep = 0
    while sweep < max_sweeps:
        sweep += 1
        local = ppca_locals(problem, current["W_loc"], current["W_scale"])
        new = {**ppca_globals(problem, local["z_loc"], local["z_scale"]), **local}
        change = max(float((new[k] - current[k]).abs().max()) for k in new)
        current = {k: v.contiguous() for k, v in new.items()}
        if change < tol:
            break
    return current, sweep


class PPCAReduced(Unconstrained):
    """The PPCA closed form as a function of q(W) alone, q(z) at its exact minimiser
    (:func:`ppca_locals`): 2 D K coordinates instead of 2 (N + D) K, well conditioned, and small
    enough for Newton steps with the exact Hessian. By the envelope theorem its gradient is
    the full gradient's W part, and the full gradient's z part is zero."""

    def __init__(self, problem: PPCA, params: dict[str, torch.Tensor]) -> None:
        super().__init__(problem, params)
        self.names = ["W_loc", "W_scale"]
        self.shapes = [params[n].shape for n in self.names]

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        w = super().unflatten(flat)
        return {**w, **ppca_locals(self.problem, w["W_loc"], w["W_scale"])}


def initial_params(problem: Problem) -> dict[str, torch.Tensor]:
    """The methods' common start, read from a freshly initialised guide (then float64).
    The param store is left as it was."""
    store = pyro.get_param_store()
    saved = store.get_state()
    store.clear()
    try:
        problem.initialise(problem.make_guide(), problem.blocks[0])
        return {n: store[n].detach().to("cpu", torch.float64).clone() for n in PARAM_NAMES[problem.name]}
    finally:
        store.set_state(saved)


def compute_reference(problem: Problem) -> Reference:
    """The mean-field optimum of ``problem`` (see the module docstring), in float64."""
    start = time.perf_counter()
    init = initial_params(problem)
    if isinstance(problem, GMM):
        result = cavi(
            problem.data["x"], problem.prior64, m=init["m"], rho=init["rho"], num_iterations=5000, tol=1e-10
        )
        params = {"m": result.m, "rho": result.rho, "alpha": result.alpha}
        change = float("nan") if not result.converged else 1e-10
        return Reference(
            params,
            float(result.losses[-1]),
            change,
            f"CAVI, {len(result.losses)} sweeps" + ("" if result.converged else " (not converged)"),
            time.perf_counter() - start,
        )
    objective = Unconstrained(problem, init)
    if isinstance(problem, PPCA):
        fixed_point, sweeps = ppca_cavi(problem, init)
        reduced = PPCAReduced(problem, fixed_point)
        optimum = reduced.unflatten(newton(reduced, lbfgs(reduced, reduced.flatten(fixed_point))))
        flat = objective.flatten(optimum)
        method = f"CAVI ({sweeps} sweeps), then L-BFGS and Newton in q(W) with q(z) exact"
    else:
        flat = newton(objective, lbfgs(objective, objective.flatten(init)))
        method = "L-BFGS, then Newton"
    value, grad = objective.value_and_grad(flat)
    return Reference(
        {k: v.detach() for k, v in objective.unflatten(flat).items()},
        float(value),
        float(grad.norm()),
        method,
        time.perf_counter() - start,
    )
