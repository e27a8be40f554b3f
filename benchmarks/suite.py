"""Issue 13's measuring instrument: PDVI against the best-tuned SVI+Adam on a suite of
ordinary Pyro models, at equal fitting CPU seconds and at equal epochs.

Models (``--models``; details in ``benchmarks/generic_suite/models.py``): ``logreg``
(Bayesian logistic regression, breast_cancer, 20 blocks sorted by label), ``ppca`` (PPCA
with a local z per image, digits, 40 blocks sorted by digit), ``mixed`` (random intercept +
slope with latent LogNormal hyper-scales, one block per group), ``hier`` (the hierarchical
normal of README, 20 blocks sorted by x, one particle), ``scale`` (linear regression with an
unknown noise sd whose guide is LogNormal, diabetes, 20 blocks sorted by bmi), ``odlogit``
(``logreg`` with a Gaussian random effect per datum on the logit, a local latent), ``gmm``
(the flagship's GMM through the generic Pyro path, N = 100,000 in blocks of 1,000),
``biglogreg`` (a logistic regression on 100,000 rows in 100 blocks), ``ppca_cancer`` (the
PPCA on breast_cancer, 20 blocks sorted by label), ``robust`` (a Student-t regression with a
Gamma weight per datum, diabetes, 20 blocks sorted by age), ``poisson`` (Poisson regression
with a random intercept for each of 40 sites, 20 blocks sorted by time), ``poisson200`` and
``poisson200_few`` (the same with 200 sites, 10,000 and 2,000 rows), ``poisson1000`` (1,000
sites, 20,000 rows), ``poisson_slopes`` (200 sites, a random slope on time per site too),
``poisson_nested`` (200 sites in 20 regions, a random intercept per region too),
``poisson_crossed`` (200 sites, a random intercept per period of time too), ``poisson_nested100``
and ``poisson_crossed200`` (the same with 100 regions, 200 periods), ``poisson_nested_slopes``
(200 sites with a random intercept and slope each, nested in 100 regions),
``poisson_three_levels`` (200 sites in 100 regions in 20 countries) and ``negbin``
(negative-binomial regression with a random intercept for each of 20 sites, one block per site).

Each model has an independent reference: the optimum of its mean-field family, from the
closed-form ELBO (L-BFGS and Newton, CAVI for PPCA, full-batch CAVI for the GMM), in float64.
Every method starts from the same params, visits the blocks in the same shuffled order per
epoch (from the seed) and runs with the user's ELBO, in float32 unless ``--dtype float64``.
Only the steps are timed, in CPU seconds of the process (one torch thread), which a machine
shared with other jobs disturbs much less than wall time. Methods: SVI+Adam over ``--svi-lrs``
and one decaying schedule (``--decay-lr``), and PDVI in the named configurations of
``benchmarks/generic_suite/baselines.py`` (``PDVI_CONFIGS``): ``--pdvi-configs`` on every
seed, the fixed-eta grid ``--eta-grid`` on the first seed only.

Printed per model (and written to ``--out``/report.md): the error at the ``--checkpoints``
seconds and at the budget's end, and at equal epochs, for every SVI rate, the best SVI and
every PDVI configuration (with its ratio to the best SVI); then for all models the cost of a
step against ``SVI.step``, README's standing (PDVI defaults' means / sds / ELBO gap over the
best SVI's at each checkpoint), ``eta="auto"`` against the best fixed eta, whether the objective
ever rose, every run that failed or warned, and PDVI's saddle checks (also in runs.csv). CSVs:
history.csv (every record), runs.csv,
accuracy.csv, cost.csv, eta.csv; plots: ``<model>.png`` (error against seconds and epochs,
mean and min-max over seeds).

Examples::

    python benchmarks/suite.py --quick --seeds 0,1 --out results/suite_quick
    python benchmarks/suite.py --models logreg,ppca --budget-seconds 20
    python benchmarks/suite.py --models gmm --gmm-budget-seconds 600 --seeds 0
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: import this checkout's benchmarks and pyro_pdvi, not an installed copy.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyro  # noqa: E402
import torch  # noqa: E402

import pyro_pdvi  # noqa: E402
from benchmarks.generic_suite import report  # noqa: E402
from benchmarks.generic_suite.baselines import (  # noqa: E402
    ETA_GRID_CONFIGS,
    MAIN_PDVI_CONFIGS,
    PDVI_CONFIGS,
    pdvi,
    svi_adam,
    svi_methods,
)
from benchmarks.generic_suite.metrics import PLOTTED, Scorer  # noqa: E402
from benchmarks.generic_suite.models import PROBLEM_NAMES, make_problem  # noqa: E402
from benchmarks.generic_suite.references import compute_reference  # noqa: E402
from benchmarks.generic_suite.runner import run_method  # noqa: E402


def comma_list(kind):
    def parse(text: str) -> list:
        return [kind(v) for v in text.split(",") if v.strip()]

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models",
        type=comma_list(str),
        default=list(PROBLEM_NAMES),
        help=f"comma list of models to run, from {','.join(PROBLEM_NAMES)} (default: all)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small sizes for iteration in minutes: PPCA on 400 digits in 10 blocks, GMM N = 5,000 in "
        "5 blocks, and the quick defaults of --budget-seconds (5), --gmm-budget-seconds (60) and "
        "--checkpoints (1,2.5)",
    )
    parser.add_argument("--out", default="results/generic_suite", help="folder for CSVs, plots and report.md")
    parser.add_argument(
        "--seeds",
        type=comma_list(int),
        default=[0, 1],
        help="comma list of run seeds (block order, Monte Carlo noise; the start is the same for all)",
    )
    parser.add_argument(
        "--budget-seconds",
        type=float,
        default=None,
        help="fitting CPU seconds per run (steps only, not metrics) for every model but the GMM "
        "(default 20, quick 5); a run stops at the first step past it",
    )
    parser.add_argument(
        "--gmm-budget-seconds",
        type=float,
        default=None,
        help="fitting CPU seconds per run for the GMM (default 600, quick 60): a generic PDVI epoch of "
        "it takes minutes today",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=100_000,
        help="at most this many epochs per run (default: the budget decides)",
    )
    parser.add_argument(
        "--checkpoints",
        type=comma_list(float),
        default=None,
        help="fitting CPU seconds at which errors are compared (default 5,10,20; quick 1,2.5); the "
        "budget's end is always added",
    )
    parser.add_argument(
        "--gmm-checkpoints",
        type=comma_list(float),
        default=None,
        help="the same for the GMM (default 60,120,300; quick 15,30)",
    )
    parser.add_argument(
        "--evals-per-budget",
        type=int,
        default=40,
        help="also record the metrics whenever budget/this many seconds of fitting passed since the "
        "last record (for methods whose epoch is long); always after each epoch",
    )
    parser.add_argument(
        "--svi-lrs", type=comma_list(float), default=[0.003, 0.01, 0.03, 0.1, 0.3], help="SVI+Adam rates"
    )
    parser.add_argument(
        "--decay-lr",
        type=float,
        default=0.1,
        help="initial rate of SVI+Adam with the decaying schedule lr/(1+epoch/--decay-epochs); 0: none",
    )
    parser.add_argument("--decay-epochs", type=float, default=10.0, help="epochs to halve the decaying rate")
    parser.add_argument(
        "--pdvi-configs",
        type=comma_list(str),
        default=list(MAIN_PDVI_CONFIGS),
        help=f"PDVI configurations run on every seed, names from PDVI_CONFIGS: {','.join(PDVI_CONFIGS)}",
    )
    parser.add_argument(
        "--eta-grid",
        type=comma_list(str),
        default=list(ETA_GRID_CONFIGS),
        help="PDVI fixed-eta configurations compared with eta='auto', first seed only ('' for none)",
    )
    parser.add_argument(
        "--gmm-svi-lrs",
        type=comma_list(float),
        default=[0.03, 0.1],
        help="SVI+Adam rates for the GMM (the flagship's screening found 0.03 best, 0.1 next)",
    )
    parser.add_argument(
        "--gmm-pdvi-configs",
        type=comma_list(str),
        default=["defaults", "per_site"],
        help="PDVI configurations for the GMM",
    )
    parser.add_argument("--gmm-eta-grid", type=comma_list(str), default=[], help="fixed-eta grid for the GMM")
    parser.add_argument(
        "--user-particles",
        type=int,
        default=None,
        help="particles of the other models' user ELBO, for SVI and PDVI alike (default: each model's own; "
        "1: Pyro's default, not vectorized)",
    )
    parser.add_argument(
        "--gmm-user-particles",
        type=int,
        default=16,
        help="particles of the GMM's user ELBO, for SVI and PDVI alike (1: Pyro's default, not vectorized)",
    )
    parser.add_argument(
        "--dtype", choices=("float32", "float64"), default="float32", help="dtype of the fits"
    )
    parser.add_argument("--device", default="cpu", help="torch device of the fits (references: CPU float64)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (torch.set_num_threads)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    parser.add_argument(
        "--report-from",
        type=comma_list(str),
        default=[],
        help="comma list of --out folders of finished runs: no fitting, the report (tables, CSVs, "
        "plots) is made again from their history.csv and runs.csv, e.g. with other --checkpoints "
        "or over runs split between processes; pass the runs' --quick and budgets",
    )
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in PROBLEM_NAMES]
    if unknown:
        parser.error(f"unknown models {unknown}; use names from {PROBLEM_NAMES}")
    for config in args.pdvi_configs + args.eta_grid + args.gmm_pdvi_configs + args.gmm_eta_grid:
        if config not in PDVI_CONFIGS:
            parser.error(f"unknown PDVI configuration {config!r}; use names from {list(PDVI_CONFIGS)}")
    quick_defaults = {"budget_seconds": (20.0, 5.0), "gmm_budget_seconds": (600.0, 60.0)}
    for name, (full, quick) in quick_defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.checkpoints is None:
        args.checkpoints = [1.0, 2.5] if args.quick else [5.0, 10.0, 20.0]
    if args.gmm_checkpoints is None:
        args.gmm_checkpoints = [15.0, 30.0] if args.quick else [60.0, 120.0, 300.0]
    return args


def environment() -> str:
    """Machine, versions, threads and load, for the report."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = "?"
    try:
        import sklearn

        sklearn_version = sklearn.__version__
    except ImportError:
        sklearn_version = "not installed"
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    ) if os.path.exists("/proc/cpuinfo") else platform.processor()  # fmt: skip
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    return (
        f"{datetime.datetime.now().isoformat(timespec='minutes')}; {cpu}, {os.cpu_count()} cores; "
        f"torch threads {torch.get_num_threads()}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; "
        f"load average {load}; Python {platform.python_version()}, torch {torch.__version__}, "
        f"pyro-ppl {pyro.__version__}, scikit-learn {sklearn_version}; pyro_pdvi from "
        f"{Path(pyro_pdvi.__file__).parent} at {commit or '?'}"
    )


def methods_for(name: str, args: argparse.Namespace, first_seed: bool) -> list:
    gmm = name == "gmm"
    lrs = args.gmm_svi_lrs if gmm else args.svi_lrs
    configs = list(args.gmm_pdvi_configs if gmm else args.pdvi_configs)
    if first_seed:
        configs += [c for c in (args.gmm_eta_grid if gmm else args.eta_grid) if c not in configs]
    decay = args.decay_lr if args.decay_lr > 0 else None
    return svi_methods(lrs, decay, args.decay_epochs) + [pdvi(c) for c in configs]


def run_model(problem, scorer, budget: float, args: argparse.Namespace) -> list:
    """Every method on every seed (the eta grid on the first), after an untimed warm-up."""
    # The first steps in a process pay one-off costs (lazy imports, allocator): not on anyone's clock.
    for method in (svi_adam(0.01), pdvi("eta1")):
        run_method(problem, method, scorer, args.seeds[0], 0.0, 1, float("inf"))
    results = []
    primary = PLOTTED[problem.name][0]
    for seed in args.seeds:
        for method in methods_for(problem.name, args, seed == args.seeds[0]):
            result = run_method(
                problem, method, scorer, seed, budget, args.epochs, budget / args.evals_per_budget
            )
            results.append(result)
            print(
                f"  seed {seed} {result.label:34s} epochs {result.epochs:8.2f}  "
                f"{primary} {result.history[-1].get(primary, float('nan')):.4g}  {result.status[:90]}",
                flush=True,
            )
    return results


def main(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    logging.getLogger("pyro").setLevel(logging.WARNING)  # Pyro's "Guessed max_plate_nesting" lines
    previous_dtype = torch.get_default_dtype()
    dtype = getattr(torch, args.dtype)
    torch.set_default_dtype(dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = environment()
    command = "python benchmarks/suite.py " + " ".join(sys.argv[1:])
    print(header)
    loaded = [r for folder in args.report_from for r in report.load_results(Path(folder))]
    sections, all_results, accuracy_rows, cost_rows, eta_rows, summary_rows = [], [], [], [], [], []
    standing_rows: list[dict] = []
    try:
        for name in args.models:
            problem = make_problem(name, args.quick, dtype, args.device)
            if name == "gmm":
                problem.set_user_particles(args.gmm_user_particles)
            elif args.user_particles is not None:
                problem.set_user_particles(args.user_particles)
            reference = compute_reference(problem)
            scorer = Scorer(problem, reference)
            budget = args.gmm_budget_seconds if name == "gmm" else args.budget_seconds
            intro = (
                f"\n## {name}: {problem.title}\n\nuser's ELBO `{problem.loss_name}`; "
                f"budget {budget:g} CPU s per run; "
                f"reference: {reference.method}, -ELBO {reference.neg_elbo:.6g}, gradient norm "
                f"{reference.grad_norm:.1e}, {reference.seconds:.1f} s"
            )
            print(intro, flush=True)
            if args.report_from:
                results = [r for r in loaded if r.model == name]
            else:
                results = run_model(problem, scorer, budget, args)
            if not results:
                continue
            checkpoints = args.gmm_checkpoints if name == "gmm" else args.checkpoints
            grid = args.gmm_eta_grid if name == "gmm" else args.eta_grid
            model_report = report.ModelReport(problem, reference, results, checkpoints, budget, grid)
            table, rows = model_report.accuracy_table()
            rises = model_report.rises_table() if name.startswith("ppca") else ""
            section = intro + "\n\n" + table + ("\n\nDoes the objective rise?\n\n" + rises if rises else "")
            print("\n" + table + ("\n\n" + rises if rises else ""), flush=True)
            sections.append(section)
            all_results += results
            accuracy_rows += rows
            summary_rows.append(model_report.summary_row())
            standing_rows.append(model_report.standing_row())
            cost_rows.append(model_report.cost_row())
            eta_rows.append(model_report.eta_row(grid))
            if not args.no_plots:
                model_report.plot(out / f"{name}.png")
        tables = [
            "## Summary: PDVI against the best SVI at the budget's end and at equal epochs\n\n"
            + report.summary_table(summary_rows),
            "## Where it stands: PDVI defaults' error over the best SVI's at equal CPU seconds (means "
            "over the seeds; each metric's best SVI configuration picked at each checkpoint)\n\n"
            + report.standing_table(standing_rows, cost_rows),
            "## Cost of a step (CPU s, median over steps but the first; set-up = first step - median)\n\n"
            + report.cost_table(cost_rows),
            "## eta='auto' against fixed eta (first seed; at the budget's end and over its last half)\n\n"
            + report.eta_table(eta_rows, {k: v[0] for k, v in PLOTTED.items()}),
            "## Runs that failed or warned\n\n" + report.failures_table(all_results),
            "## PDVI's saddle checks (epoch, wall-clock s; per round: negative Ritz values, the "
            "smallest, moved)\n\n" + report.saddle_checks_table(all_results),
        ]
        for table in tables:
            print("\n" + table)
        text = (
            f"# Generic suite\n\n`{command}`\n\n{header}\n"
            + "\n".join(sections)
            + "\n\n"
            + "\n\n".join(tables)
        )
        (out / "report.md").write_text(text + "\n")
        report.write_csvs(out, all_results, accuracy_rows, cost_rows, eta_rows)
        print(f"\nwrote {out}/report.md, CSVs and plots")
    finally:
        torch.set_default_dtype(previous_dtype)
    return {
        "results": all_results,
        "accuracy": accuracy_rows,
        "cost": cost_rows,
        "eta": eta_rows,
        "standing": standing_rows,
    }


if __name__ == "__main__":
    main(parse_args())
