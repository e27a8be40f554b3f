"""Errors of a fit against its model's reference optimum, read from Pyro's param store, and
the summaries over a run's history (value at a number of seconds or epochs, rises of the
objective).

Metrics (all in float64; smaller is better; the global sites are those outside the data plate):

* ``rmse_mean``: root mean square error of the global variational means (AutoNormal's
  locs, i.e. in the unconstrained space: the mean of ``log tau`` for a LogNormal site);
  PPCA: of ``W_loc`` after matching its columns to the reference's (permutation and signs).
* ``rmse_mean_rotated`` (PPCA): of ``W_loc R`` with ``R`` the orthogonal matrix that best
  matches the reference (orthogonal Procrustes). PPCA's posterior is unchanged by any rotation
  ``W -> W R``, ``z -> R' z``; only the mean-field family's diagonal covariances pin one,
  weakly: ``rmse_mean`` also measures where along that nearly flat valley a fit sits.
* ``sd_error``: root mean square of ``s / s* - 1`` over the global variational sds.
* ``min_sd_ratio``, ``max_sd_ratio``: the smallest and largest ``s / s*`` over the global
  variational sds (GMM: of the centres' sds): a collapsed scale shows as a value near 0, a
  blown-up one as a large value (the report flags < 0.01 and > 100).
* ``elbo_gap``: ``(L - L*) / |L*|`` with ``L`` the closed-form negative ELBO at the fit's
  params (its own local params included) and ``L*`` the reference's.
* ``elbo_gap_resolved`` (PPCA, GMM): the same with the local params replaced by their exact
  optimum given the fit's global params: it judges the global solution alone.
* ``mu_error``, ``mu_sd_error`` (hier): ``|E_q[mu] - E_q*[mu]|`` and ``|sd_q[mu] / sd_q*[mu] - 1|``.
* ``hyper_sd_error`` (mixed): ``sd_error`` over the sites ``tau_a, tau_b, sigma`` only.
* ``sigma_sd_error`` (scale): ``|s / s* - 1|`` for q(log sigma).
* ``w2_ratio`` (GMM): W2 between the true mixture and the fitted predictive components, over
  the W2 of the reference (the flagship's metric).
"""

from __future__ import annotations

import math
import statistics

import pyro
import torch
from scipy.optimize import linear_sum_assignment

from pyro_pdvi.models import predictive_components
from pyro_pdvi.models.gmm import expected_log_likelihood

try:  # where main keeps it since the metrics moved out of the models (after f5559c3)
    from pyro_pdvi.metrics import wasserstein_gmm
except ImportError:  # pyro_pdvi at f5559c3, this branch's base
    from pyro_pdvi.models import wasserstein_gmm

from .models import GMM, PPCA, Problem
from .references import PARAM_NAMES, Reference, is_scale, neg_elbo, ppca_locals

#: Per model: the metric that ranks methods, then the one plotted beside it.
PLOTTED = {
    "logreg": ("rmse_mean", "sd_error"),
    "ppca": ("elbo_gap", "elbo_gap_resolved"),
    "mixed": ("rmse_mean", "hyper_sd_error"),
    "hier": ("mu_error", "mu_sd_error"),
    "scale": ("rmse_mean", "sigma_sd_error"),
    "odlogit": ("rmse_mean", "sd_error"),
    "gmm": ("w2_ratio", "elbo_gap_resolved"),
    "biglogreg": ("rmse_mean", "sd_error"),
    "ppca_cancer": ("elbo_gap", "elbo_gap_resolved"),
    "robust": ("rmse_mean", "sd_error"),
    "poisson": ("rmse_mean", "sd_error"),
    "poisson200": ("rmse_mean", "sd_error"),
    "poisson200_few": ("rmse_mean", "sd_error"),
    "poisson1000": ("rmse_mean", "sd_error"),
    "poisson_slopes": ("rmse_mean", "sd_error"),
    "poisson_nested": ("rmse_mean", "sd_error"),
    "poisson_crossed": ("rmse_mean", "sd_error"),
    "poisson_nested100": ("rmse_mean", "sd_error"),
    "poisson_crossed200": ("rmse_mean", "sd_error"),
    "poisson_nested_slopes": ("rmse_mean", "sd_error"),
    "poisson_three_levels": ("rmse_mean", "sd_error"),
    "negbin": ("rmse_mean", "sd_error"),
}

#: Per model: the three errors of README's standing (the posterior means, the standard
#: deviations, the ELBO gap), each PDVI's defaults over the best SVI's at a checkpoint.
#: PPCA's means are compared up to a rotation (docs/benchmarks.md 13zh); the GMM has one.
STANDING = {
    "ppca": ("rmse_mean_rotated", "sd_error", "elbo_gap"),
    "ppca_cancer": ("rmse_mean_rotated", "sd_error", "elbo_gap"),
    "hier": ("mu_error", "mu_sd_error", "elbo_gap"),
    "mixed": ("rmse_mean", "hyper_sd_error", "elbo_gap"),
    "gmm": ("w2_ratio",),
}
DEFAULT_STANDING = ("rmse_mean", "sd_error", "elbo_gap")

#: Metrics that are relative objective gaps: plotted on a symmetric log scale (they may be negative).
GAP_METRICS = ("elbo_gap", "elbo_gap_resolved")


def rms(values: torch.Tensor) -> float:
    return float(values.square().mean().sqrt())


def procrustes_rotation(loadings: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """The orthogonal ``R`` that minimises ``||loadings R - reference||_F`` (from the SVD of
    ``loadings' reference``)."""
    left, _, right_t = torch.linalg.svd(loadings.T @ reference)
    return left @ right_t


def read_params(names: list[str]) -> dict[str, torch.Tensor]:
    """Constrained values of ``names`` from Pyro's param store, as float64."""
    store = pyro.get_param_store()
    return {name: store[name].detach().to("cpu", torch.float64) for name in names}


def align_columns(loadings: torch.Tensor, reference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The permutation and signs of ``loadings``' columns that best match ``reference``'s (by
    absolute inner product): PPCA's likelihood does not change under them."""
    inner = loadings.T @ reference
    rows, cols = linear_sum_assignment(-inner.abs().numpy())
    order = torch.as_tensor(rows)[torch.as_tensor(cols).argsort()]
    signs = torch.sign(inner[order, torch.arange(len(order))])
    return order, torch.where(signs == 0, torch.ones_like(signs), signs)


class Scorer:
    """Metrics of the param store's current values against ``reference``."""

    def __init__(self, problem: Problem, reference: Reference) -> None:
        self.problem = problem
        self.reference = reference
        self.names = PARAM_NAMES[problem.name]
        self.global_names = [n for n in self.names if not self._is_local(n)]
        if isinstance(problem, GMM):
            self.true_var = problem.prior64.sigma0_sq.expand_as(problem.data["centers"])
            self.reference_w2 = self._w2(reference.params["m"], reference.params["rho"])

    def _is_local(self, name: str) -> bool:
        return name in ("z_loc", "z_scale", "alpha") or name.endswith((".theta", ".u", ".weight"))

    def _w2(self, m: torch.Tensor, rho: torch.Tensor) -> float:
        prior = self.problem.prior64
        return wasserstein_gmm(
            self.problem.data["centers"], self.true_var, *predictive_components(prior, m, rho)
        )

    def gap(self, params: dict[str, torch.Tensor]) -> float:
        return (float(neg_elbo(self.problem, params)) - self.reference.neg_elbo) / abs(
            self.reference.neg_elbo
        )

    def __call__(self) -> dict[str, float]:
        params = read_params(self.names)
        if not all(bool(torch.isfinite(v).all()) for v in params.values()):
            return {"non_finite": 1.0}
        with torch.no_grad():
            if isinstance(self.problem, GMM):
                return self._gmm(params)
            if isinstance(self.problem, PPCA):
                return self._ppca(params)
            return self._auto_normal(params)

    def _location_scale(self, params, names) -> dict[str, float]:
        ref = self.reference.params
        locs = [n for n in names if not is_scale(n)]
        scales = [n for n in names if is_scale(n)]
        ratios = torch.cat([(params[n] / ref[n]).reshape(-1) for n in scales])
        return {
            "rmse_mean": rms(torch.cat([(params[n] - ref[n]).reshape(-1) for n in locs])),
            "sd_error": rms(ratios - 1),
            "min_sd_ratio": float(ratios.min()),
            "max_sd_ratio": float(ratios.max()),
        }

    def _auto_normal(self, params) -> dict[str, float]:
        ref = self.reference.params
        out = {**self._location_scale(params, self.global_names), "elbo_gap": self.gap(params)}
        if self.problem.name == "hier":
            out["mu_error"] = abs(float(params["AutoNormal.locs.mu"] - ref["AutoNormal.locs.mu"]))
            mu_sd = float(params["AutoNormal.scales.mu"])
            out["mu_sd"] = mu_sd
            out["mu_sd_error"] = abs(mu_sd / float(ref["AutoNormal.scales.mu"]) - 1)
            out["theta_rmse_mean"] = rms(params["AutoNormal.locs.theta"] - ref["AutoNormal.locs.theta"])
        if self.problem.name == "mixed":
            hyper = [f"AutoNormal.scales.{s}" for s in ("tau_a", "tau_b", "sigma")]
            out["hyper_sd_error"] = rms(torch.stack([params[n] / ref[n] - 1 for n in hyper]))
        if self.problem.name == "scale":
            name = "AutoNormal.scales.sigma"
            out["sigma_sd_error"] = abs(float(params[name] / self.reference.params[name]) - 1)
        return out

    def _ppca(self, params) -> dict[str, float]:
        ref = self.reference.params
        order, signs = align_columns(params["W_loc"], ref["W_loc"])
        resolved = {**params, **ppca_locals(self.problem, params["W_loc"], params["W_scale"])}
        ratios = params["W_scale"][:, order] / ref["W_scale"]
        return {
            "rmse_mean": rms(params["W_loc"][:, order] * signs - ref["W_loc"]),
            "rmse_mean_rotated": rms(
                params["W_loc"] @ procrustes_rotation(params["W_loc"], ref["W_loc"]) - ref["W_loc"]
            ),
            "sd_error": rms(ratios - 1),
            "min_sd_ratio": float(ratios.min()),
            "max_sd_ratio": float(ratios.max()),
            "elbo_gap": self.gap(params),
            "elbo_gap_resolved": self.gap(resolved),
        }

    def _gmm(self, params) -> dict[str, float]:
        prior, data = self.problem.prior64, self.problem.data["x"]
        resolved = dict(params, alpha=expected_log_likelihood(data, prior, params["m"], params["rho"]))
        # Components matched to the reference's by their means (the labels are arbitrary).
        ref_m, ref_rho = self.reference.params["m"], self.reference.params["rho"]
        rows, cols = linear_sum_assignment(torch.cdist(params["m"], ref_m).numpy())
        ratios = (0.5 * (params["rho"][rows] - ref_rho[cols])).exp()
        return {
            "w2_ratio": self._w2(params["m"], params["rho"]) / self.reference_w2,
            "min_sd_ratio": float(ratios.min()),
            "max_sd_ratio": float(ratios.max()),
            "elbo_gap": self.gap(params),
            "elbo_gap_resolved": self.gap(resolved),
        }


# --------------------------------------------------------------------------- summaries of a history


def last_at(history: list[dict], key: str, value: float) -> dict | None:
    """The last record whose ``key`` ("seconds" or "epoch", possibly fractional) is at most
    ``value`` (``None`` if there is none)."""
    found = None
    for row in history:
        if row[key] <= value + 1e-9:
            found = row
    return found


def late_geometric_mean(history: list[dict], key: str, budget: float, share: float = 0.5) -> float | None:
    """The geometric mean of ``key`` over the records in the last ``share`` of a run's ``budget``
    seconds (its positive, finite values; ``None`` if there are none): a level that one record's
    Monte Carlo noise does not decide, where a run has reached its noise floor (the hierarchical
    model's ``mu_error`` swings between 1e-8 and 2e-5 from one epoch to the next there, 13zn).
    A run whose steps are longer than the last share has no record in it: its level there is the
    record in force over it, the last one before it."""
    start = (1 - share) * budget
    window = [row for row in history if start <= row["seconds"] <= budget + 1e-9]
    if not window:
        in_force = at_seconds(history, start)
        window = [in_force] if in_force is not None else []
    values = [row[key] for row in window if key in row and math.isfinite(row[key]) and row[key] > 0]
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None


def at_seconds(history: list[dict], seconds: float) -> dict | None:
    """The last record at or before ``seconds`` of fitting time."""
    return last_at(history, "seconds", seconds)


def at_epoch(history: list[dict], epoch: float) -> dict | None:
    """The last record at or before ``epoch``."""
    return last_at(history, "epoch", epoch)


def objective_rises(history: list[dict], key: str = "elbo_gap", tol: float = 1e-6) -> dict[str, float]:
    """How often the objective rose from one whole epoch to the next (by more than ``tol``
    relative to the reference), the largest rise, and how far the end is above the best."""
    values = [row[key] for row in history if float(row["epoch"]).is_integer() and key in row]
    values = [v for v in values if math.isfinite(v)]
    if len(values) < 2:
        return {"rises": 0, "largest_rise": 0.0, "end_above_best": 0.0}
    rises = [b - a for a, b in zip(values, values[1:])]
    return {
        "rises": sum(r > tol for r in rises),
        "largest_rise": max(0.0, max(rises)),
        "end_above_best": values[-1] - min(values),
    }
