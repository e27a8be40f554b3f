"""Guides beyond mean field: a conjugate Bayesian linear regression under Pyro's three Gaussian
autoguides, PDVI at its defaults against SVI+Adam, scored against each family's exact optimum.

The model: sklearn's diabetes (442 x 10, standardised, + intercept; ``y`` standardised),
``w ~ N(0, I)``, ``y ~ N(x w, s^2)`` with ``s`` known (the least-squares residual sd), 20 blocks
sorted by bmi, ``Trace_ELBO()`` (one particle, Pyro's default). Its posterior is
``N(m, P^-1)``, ``P = I + X'X / s^2``, and the negative ELBO of ``q = N(mu, Sigma)`` is
``KL(q || posterior)`` up to a constant: ``(tr(P Sigma) + (mu - m)' P (mu - m) - log det Sigma)
/ 2`` plus a constant. So within every Gaussian family the optimal mean is ``m``, and the optimal
covariance is

* ``AutoMultivariateNormal``: ``P^-1`` (the exact posterior);
* ``AutoDiagonalNormal``: ``diag(1 / P_jj)`` (mean field);
* ``AutoLowRankMultivariateNormal`` (rank 2, Pyro's ``S (F F' + I) S``): no closed form;
  minimised here in float64 by L-BFGS on the expression above.

Printed per guide and method, mean over the seeds at each checkpoint of CPU seconds (one
thread, float32 as the suite): the relative error of the mean, the relative Frobenius error of
the covariance against its family's optimum, and the ELBO gap ``KL(q || post) - KL(q* || post)``
in nats; then PDVI over the best SVI per metric. All runs start from ``init_to_feasible``
(``w = 0``) with ``init_scale=0.1`` and visit the blocks in the suite's orders::

    python benchmarks/full_covariance.py --seeds 0,1,2 --budget-seconds 20

``--logreg`` runs the suite's logistic regression (breast_cancer, 31 coefficients, 20 blocks
sorted by label, ``Trace_ELBO()``) under ``AutoMultivariateNormal`` instead: no closed-form
optimum there, so it prints the full data's negative ELBO, estimated from the guide's moments
with 2,000 draws held fixed for every method and checkpoint (common random numbers), mean over
the seeds; methods as above plus PDVI with ``scale_update="primal_dual"``::

    python benchmarks/full_covariance.py --logreg --seeds 0 --budget-seconds 20

Why (``docs/benchmarks.md`` 13zi): until session 34 a full-covariance site's Fisher information
was a 16-draw Monte Carlo estimate, and its covariance was left to the Monte Carlo primal-dual
iteration; now the first is exact (:mod:`pyro_pdvi.infer.fisher`) and the second is set by its
fixed point (:mod:`pyro_pdvi.infer.cholesky_maps`). The model is written ``(x * w).sum(-1)``,
which takes PDVI's vectorized particles (``x @ w`` does not: PDVI would draw them in a loop).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: import this checkout's benchmarks and pyro_pdvi, not an installed copy.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyro  # noqa: E402
import pyro.distributions as dist  # noqa: E402
import torch  # noqa: E402
from pyro.infer import Trace_ELBO  # noqa: E402
from pyro.infer.autoguide import (  # noqa: E402
    AutoDiagonalNormal,
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
)
from pyro.infer.autoguide.initialization import init_to_feasible  # noqa: E402

from benchmarks.common import as_a_user_runs, floats, ints, names  # noqa: E402
from benchmarks.generic_suite.baselines import pdvi, svi_methods  # noqa: E402
from benchmarks.generic_suite.metrics import at_seconds  # noqa: E402
from benchmarks.generic_suite.models import (  # noqa: E402
    Problem,
    design_matrix,
    make_problem,
    sorted_blocks,
    standardise,
)
from benchmarks.generic_suite.runner import run_method  # noqa: E402

GUIDES = ("AutoDiagonalNormal", "AutoMultivariateNormal", "AutoLowRankMultivariateNormal")
METRICS = ("mean_error", "cov_error", "elbo_gap")
RANK = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--guides", type=names, default=",".join(GUIDES), help=f"comma list from {GUIDES}")
    parser.add_argument("--seeds", type=ints, default="0,1,2", help="comma list of seeds")
    parser.add_argument("--budget-seconds", type=float, default=20.0, help="fitting CPU seconds per run")
    parser.add_argument(
        "--checkpoints", type=floats, default="1,2.5,5,10,20", help="comma list of CPU seconds to report"
    )
    parser.add_argument(
        "--svi-lrs", type=floats, default="0.003,0.01,0.03,0.1", help="comma list of SVI+Adam rates"
    )
    parser.add_argument("--decay-lr", type=float, default=0.1, help="SVI+Adam lr/(1+epoch/10); 0: none")
    parser.add_argument("--num-data", type=int, default=None, help="the first rows only (tests)")
    parser.add_argument("--logreg", action="store_true", help="the suite's logistic regression (docstring)")
    args = parser.parse_args(argv)
    unknown = [g for g in args.guides if g not in GUIDES]
    if unknown:
        parser.error(f"unknown guides {unknown}; use names from {GUIDES}")
    return args


class ConjugateRegression(Problem):
    """The linear regression of the module docstring under one of :data:`GUIDES`."""

    def __init__(
        self, guide_name: str, dtype: torch.dtype, num_data: int | None = None, num_blocks: int = 20
    ):
        from sklearn.datasets import load_diabetes

        raw = load_diabetes()
        features, x = design_matrix(raw.data, num_data)
        y = standardise(torch.as_tensor(raw.target, dtype=torch.float64))[:num_data]
        solution = torch.linalg.lstsq(x, y.unsqueeze(-1)).solution.squeeze(-1)
        noise = float((y - x @ solution).square().mean().sqrt())
        super().__init__(
            name="conjugate",
            title=f"conjugate linear regression, diabetes ({len(x)} x {x.shape[1]}), noise sd {noise:.3f} "
            f"known, {guide_name}, {num_blocks} blocks sorted by bmi",
            num_data=len(x),
            blocks=sorted_blocks(features[:, raw.feature_names.index("bmi")], num_blocks),
            loss_class=Trace_ELBO,
            loss_kwargs={},
            primary="elbo_gap",
            data={"x": x, "y": y},
        )
        self.guide_name, self.noise = guide_name, noise
        self.x, self.y = x.to(dtype), y.to(dtype)

    def _model(self, idx):
        zero = self.x.new_zeros(())
        w = pyro.sample("w", dist.Normal(zero, 1.0).expand([self.x.shape[1]]).to_event(1))
        with pyro.plate("data", self.num_data, subsample=idx) as ind:
            pyro.sample("y", dist.Normal((self.x[ind] * w).sum(-1), self.noise), obs=self.y[ind])

    def make_guide(self):
        kwargs = {"init_loc_fn": init_to_feasible, "init_scale": 0.1}
        if self.guide_name == "AutoLowRankMultivariateNormal":
            return AutoLowRankMultivariateNormal(self.model, rank=RANK, **kwargs)
        return {"AutoDiagonalNormal": AutoDiagonalNormal, "AutoMultivariateNormal": AutoMultivariateNormal}[
            self.guide_name
        ](self.model, **kwargs)

    def posterior(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(m, P)``: the exact posterior's mean and precision, float64."""
        x, y = self.data["x"], self.data["y"]
        precision = torch.eye(x.shape[1], dtype=torch.float64) + x.T @ x / self.noise**2
        return torch.linalg.solve(precision, x.T @ y / self.noise**2), precision


def kl_to_posterior(mean: torch.Tensor, covariance: torch.Tensor, posterior_mean, precision) -> torch.Tensor:
    """``KL(N(mean, covariance) || N(posterior_mean, precision^-1))``, float64."""
    difference = mean - posterior_mean
    return 0.5 * (
        (precision * covariance).sum()
        + difference @ precision @ difference
        - len(mean)
        - torch.logdet(precision @ covariance)
    )


def low_rank_covariance(factor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Pyro's ``AutoLowRankMultivariateNormal`` covariance, ``S (F F' + I) S`` with ``S = diag(scale)``."""
    inner = factor @ factor.T + torch.eye(len(scale), dtype=factor.dtype)
    return scale[:, None] * inner * scale[None, :]


def family_optimum(guide_name: str, precision: torch.Tensor) -> torch.Tensor:
    """The covariance that minimises ``KL(q || posterior)`` within the guide's family (module
    docstring), float64."""
    if guide_name == "AutoMultivariateNormal":
        return torch.linalg.inv(precision)
    if guide_name == "AutoDiagonalNormal":
        return torch.diag(1.0 / precision.diagonal())
    factor, diagonal = low_rank_optimum(precision)
    return factor @ factor.T + torch.diag(diagonal)


def low_rank_objective(factor: torch.Tensor, diagonal: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    """``(tr(P Sigma) - log det Sigma) / 2`` of ``Sigma = W W' + diag(d)``: its KL to the posterior,
    with the optimal mean, up to a constant."""
    covariance = factor @ factor.T + torch.diag(diagonal)
    return 0.5 * ((precision * covariance).sum() - torch.logdet(covariance))


def low_rank_optimum(precision: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W, d)`` of the rank-:data:`RANK` guide's optimal covariance ``W W' + diag(d)``: L-BFGS in
    float64 on :func:`low_rank_objective` over ``W`` and ``log d``, from a small random ``W`` and
    the mean-field variances. Pyro's ``S (F F' + I) S`` is the same family with ``W = S F``,
    ``d = s^2``; on correlated covariates the optimum puts some ``d_j`` at 0 (there ``s_j -> 0``,
    ``F_j -> infinity``: a limit that no finite guide params reach, but the covariance does)."""
    generator = torch.Generator().manual_seed(0)
    unit = precision.diagonal().rsqrt()[:, None]  # W in units of the mean-field sds: better conditioned
    factor = (
        0.1 * torch.randn(len(precision), RANK, generator=generator, dtype=torch.float64)
    ).requires_grad_()
    log_diagonal = (-precision.diagonal().log()).clone().requires_grad_()
    optimiser = torch.optim.LBFGS(
        [factor, log_diagonal],
        max_iter=10000,
        tolerance_grad=1e-15,
        tolerance_change=1e-18,
        history_size=50,
        line_search_fn="strong_wolfe",
    )

    def closure():
        optimiser.zero_grad()
        loss = low_rank_objective(factor * unit, log_diagonal.exp(), precision)
        loss.backward()
        return loss

    for _ in range(10):
        optimiser.step(closure)
    return (factor * unit).detach(), log_diagonal.detach().exp()


def guide_moments(guide_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, covariance)`` of the guide from the param store's values, float64."""
    store = pyro.get_param_store()

    def value(name: str) -> torch.Tensor:
        return store[f"{guide_name}.{name}"].detach().to("cpu", torch.float64)

    loc = value("loc")
    if guide_name == "AutoDiagonalNormal":
        return loc, torch.diag(value("scale").square())
    if guide_name == "AutoMultivariateNormal":
        tril = value("scale")[:, None] * value("scale_tril")
        return loc, tril @ tril.T
    return loc, low_rank_covariance(value("cov_factor"), value("scale"))


class GaussianScorer:
    """The metrics of the module docstring, of the param store's guide against its family's optimum."""

    def __init__(self, problem: ConjugateRegression) -> None:
        self.problem = problem
        self.posterior_mean, self.precision = problem.posterior()
        self.optimum = family_optimum(problem.guide_name, self.precision)
        self.optimum_kl = float(
            kl_to_posterior(self.posterior_mean, self.optimum, self.posterior_mean, self.precision)
        )

    def __call__(self) -> dict[str, float]:
        mean, covariance = guide_moments(self.problem.guide_name)
        if not (bool(torch.isfinite(mean).all()) and bool(torch.isfinite(covariance).all())):
            return {"non_finite": 1.0}
        kl = float(kl_to_posterior(mean, covariance, self.posterior_mean, self.precision))
        return {
            "mean_error": float((mean - self.posterior_mean).norm() / self.posterior_mean.norm()),
            "cov_error": float((covariance - self.optimum).norm() / self.optimum.norm()),
            "elbo_gap": kl - self.optimum_kl,
        }


def main(args: argparse.Namespace) -> list[dict]:
    """Every guide and method (module docstring); the rows as printed. Runs in float32 at one
    thread, the caller's default dtype and warning filters put back after."""
    with as_a_user_runs(torch.float32):
        return _run(args)


def _run(args: argparse.Namespace) -> list[dict]:
    if args.logreg:
        return _run_logreg(args)
    rows = []
    methods = svi_methods(args.svi_lrs, args.decay_lr or None, 10.0) + [pdvi("defaults")]
    for guide_name in args.guides:
        problem = ConjugateRegression(guide_name, torch.float32, args.num_data)
        scorer = GaussianScorer(problem)
        print(f"\n## {problem.title}\n", flush=True)
        print(f"optimum's KL to the posterior {scorer.optimum_kl:.4g} nats\n")
        print(
            "| method | " + " | ".join(f"{t:g} s: mean / cov / gap" for t in args.checkpoints) + " | epochs |"
        )
        print("|---|" + "---|" * (len(args.checkpoints) + 1))
        # The first steps in a process pay one-off costs (lazy imports): not on anyone's clock.
        for method in methods[:1] + methods[-1:]:
            run_method(problem, method, scorer, args.seeds[0], 0.0, 1, float("inf"))
        guide_rows = []
        for method in methods:
            runs = [
                run_method(problem, method, scorer, s, args.budget_seconds, 10**6, 0.25) for s in args.seeds
            ]
            row = {"guide": guide_name, "method": method.label}
            for t in args.checkpoints:
                records = [at_seconds(run.history, t) or {} for run in runs]
                for metric in METRICS:
                    row[f"{metric}@{t:g}"] = sum(r.get(metric, math.nan) for r in records) / len(records)
            row["epochs"] = sum(run.epochs for run in runs) / len(runs)
            guide_rows.append(row)
            cells = [" / ".join(f"{row[f'{m}@{t:g}']:.3g}" for m in METRICS) for t in args.checkpoints]
            print(f"| {method.label} | " + " | ".join(cells) + f" | {row['epochs']:.0f} |", flush=True)
        print_ratios(guide_rows, args.checkpoints)
        rows += guide_rows
    return rows


class LogisticElboScorer:
    """The full data's negative ELBO of the param store's ``AutoMultivariateNormal`` on the suite's
    logistic regression: the likelihood's expectation from :data:`ELBO_DRAWS` standard-normal
    draws made once (the same for every method and checkpoint), the prior's and the entropy in
    closed form; float64."""

    def __init__(self, problem: Problem, seed: int = 0) -> None:
        self.x, self.y = problem.data["x"], problem.data["y"]
        self.prior_scale = problem.prior_scale
        generator = torch.Generator().manual_seed(seed)
        self.noise = torch.randn(ELBO_DRAWS, self.x.shape[1], generator=generator, dtype=torch.float64)

    def __call__(self) -> dict[str, float]:
        mean, covariance = guide_moments("AutoMultivariateNormal")
        cholesky, info = torch.linalg.cholesky_ex(covariance)
        if not (bool(torch.isfinite(mean).all()) and int(info) == 0):
            return {"non_finite": 1.0}
        draws = mean + self.noise @ cholesky.T
        likelihood = dist.Bernoulli(logits=draws @ self.x.T).log_prob(self.y).sum(-1).mean()
        size = len(mean)
        prior = -0.5 * ((mean.square().sum() + covariance.trace()) / self.prior_scale**2) - size * (
            math.log(self.prior_scale) + 0.5 * math.log(2 * math.pi)
        )
        entropy = cholesky.diagonal().log().sum() + 0.5 * size * (1 + math.log(2 * math.pi))
        return {"neg_elbo": float(-(likelihood + prior + entropy))}


#: Draws of the likelihood's expectation in :class:`LogisticElboScorer`.
ELBO_DRAWS = 2000


def _run_logreg(args: argparse.Namespace) -> list[dict]:
    problem = make_problem("logreg", False, torch.float32, "cpu")
    problem.make_guide = lambda: AutoMultivariateNormal(
        problem.model, init_loc_fn=init_to_feasible, init_scale=0.1
    )
    scorer = LogisticElboScorer(problem)
    methods = svi_methods(args.svi_lrs, args.decay_lr or None, 10.0) + [pdvi("defaults"), pdvi("scale_pd")]
    print(
        f"\n## {problem.title.replace('AutoNormal', 'AutoMultivariateNormal')}: negative ELBO\n", flush=True
    )
    print("| method | " + " | ".join(f"{t:g} s" for t in args.checkpoints) + " | epochs |")
    print("|---|" + "---|" * (len(args.checkpoints) + 1))
    for method in methods[:1] + methods[-2:-1]:
        run_method(problem, method, scorer, args.seeds[0], 0.0, 1, float("inf"))
    rows = []
    for method in methods:
        runs = [run_method(problem, method, scorer, s, args.budget_seconds, 10**6, 0.25) for s in args.seeds]
        row = {"method": method.label, "epochs": sum(run.epochs for run in runs) / len(runs)}
        for t in args.checkpoints:
            records = [at_seconds(run.history, t) or {} for run in runs]
            row[f"neg_elbo@{t:g}"] = sum(r.get("neg_elbo", math.nan) for r in records) / len(records)
        rows.append(row)
        cells = [f"{row[f'neg_elbo@{t:g}']:.3f}" for t in args.checkpoints]
        print(f"| {method.label} | " + " | ".join(cells) + f" | {row['epochs']:.0f} |", flush=True)
    return rows


def print_ratios(rows: list[dict], checkpoints: list[float]) -> None:
    """PDVI's error over the best SVI's, per metric and checkpoint (the best chosen per cell)."""
    pdvi_row = next(r for r in rows if r["method"].startswith("PDVI"))
    svi_rows = [r for r in rows if not r["method"].startswith("PDVI")]
    cells = []
    for t in checkpoints:
        ratios = []
        for metric in METRICS:
            best = min((r[f"{metric}@{t:g}"] for r in svi_rows), default=math.nan)
            ratios.append(f"x{pdvi_row[f'{metric}@{t:g}'] / best:.2g}" if best > 0 else "n/a")
        cells.append(" / ".join(ratios))
    print("| PDVI / best SVI | " + " | ".join(cells) + " | |\n", flush=True)


if __name__ == "__main__":
    main(parse_args())
