"""The flagship benchmark: the Bayesian GMM of the paper's App. C.2 on biased blocks,
every baseline of its Sec. 5 side by side.

Data (``make_biased_gmm``): N points, K components in d dimensions with equal weights,
cut into fixed blocks that each hold mostly one cluster (``--purities``: the share of a
block's dominant cluster; 1.0 gives pure blocks). Every method starts from the same
initial means (K random data points) and sees the same blocks in the same fresh random
order each epoch (one epoch = one pass over the data):

* CAVI      full-batch coordinate ascent, one sweep per epoch; run to convergence
            (``--cavi-iterations``) it is the optimum every method is measured against.
* NG-SVI    Hoffman et al. (2013) natural-gradient SVI (``GMMNaturalGradientSVI``), one
            block per step, decaying Robbins-Monro steps ``(t + tau)^-kappa`` or a
            constant step, each over a small grid.
* Pyro SVI  ``pyro.infer.SVI`` with Adam, RMSprop and SGD on ``GMMModel`` (the guide
            enumerates z; ``TraceEnum_ELBO(max_plate_nesting=1, num_particles=P,
            vectorize_particles=True)``), each over a learning-rate grid.
* PD-VI / P2D-VI  ``pyro_pdvi.PDVI`` with ``eta="auto"`` (no tuning): one step-size
            group (PD-VI) or one per site (P2D-VI, ``groups="per_site"``), with the
            closed-form block solver (``solver=GMMBlockSolver(data, prior)``) and, on a reduced data set
            (``--generic-num-data``, first seed only), through the generic Pyro path
            (``GenericSolver``: L-BFGS on the same ELBO, ``--inner-steps`` evaluations, the
            ``--global-update`` rule), which costs about 1 s per 1,000 points per epoch on one
            CPU thread; and "PDVI generic defaults", PDVI as a user calls it:
            ``PDVI(model, guide, optim, loss, blocks=blocks)``, every option at its default.

Metrics after every epoch: W2 between the true mixture N(c_k, Sigma_0) and the fitted
predictive components N(m_k, Sigma_0 + diag(exp(rho_k))) (paper Fig. 3), also as a
ratio to the CAVI optimum's W2; the relative gap of the exact negative ELBO to the CAVI
optimum, with the local q(z) re-solved in closed form (judges q(c) alone, the same for
every method) and with the method's own q(z) (the param store's ``alpha`` for Pyro SVI
and PDVI); and the adjusted Rand index of the hard assignments argmax q(z) (re-solved)
against the true labels. Seconds count only the steps (not the metrics), first-epoch
one-off costs included (PDVI's curvature measurement for ``eta="auto"``).

Where a method has a grid, the setting with the lowest final W2 (mean over seeds) is
the one reported in the table; every setting is in the CSV. Outputs under ``--out``:
``gmm_biased_batches.csv`` (every epoch of every run), ``gmm_biased_batches_table.csv``
(the table) and ``gmm_biased_batches.png`` (W2 ratio against epochs and seconds, and
the ELBO gap, mean and min-max band over seeds, best setting of each method).

The flagship configuration (tens of minutes per seed and purity on one thread, most of
it Pyro SVI with 16 particles on 100 blocks per epoch; ``docs/benchmarks.md`` section 8
shows how it was split into parallel parts with ``--methods`` and merged with
``--from-csv``)::

    python benchmarks/gmm_biased_batches.py --num-data 100000 --epochs 30 --seeds 0,1,2 \\
        --purities 0.95,1.0 --generic-num-data 5000 --generic-epochs 10 --out results
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: import this checkout's benchmarks and pyro_pdvi, not an installed copy.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyro  # noqa: E402
import torch  # noqa: E402
from pyro.infer import SVI  # noqa: E402

from benchmarks.common import (  # noqa: E402
    SCORE_KEYS,
    GMMProblem,
    add_gmm_data_arguments,
    add_step_size_arguments,
    append_csv,
    auto_step_size,
    cost_split,
    floats,
    gmm_elbo,
    gmm_pdvi,
    gmm_problem_from,
    ints,
    markdown_table,
    names,
    pyplot,
    read_csv,
    run_epochs,
    save_figure,
    script_parser,
    setup_torch,
    step_sizes_text,
    write_csv,
)
from pyro_pdvi import PDVI, GenericSolver  # noqa: E402
from pyro_pdvi.baselines import GMMNaturalGradientSVI  # noqa: E402
from pyro_pdvi.models.gmm import GMMBlockSolver, cavi  # noqa: E402

#: Method names in table order.
METHODS = (
    "CAVI",
    "NG-SVI decaying",
    "NG-SVI constant",
    "SVI+Adam",
    "SVI+RMSprop",
    "SVI+SGD",
    "PD-VI closed-form",
    "P2D-VI closed-form",
    "PD-VI generic",
    "P2D-VI generic",
    "PDVI generic defaults",
)


#: ``--antithetic`` as ``PDVI(antithetic=...)`` takes it.
ANTITHETIC = {"auto": "auto", "on": True, "off": False}


def pairs(text: str) -> list[tuple[float, float]]:
    """A comma list of ``tau:kappa`` pairs."""
    return [(float(tau), float(kappa)) for tau, kappa in (item.split(":") for item in names(text))]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    data = parser.add_argument_group("data")
    add_gmm_data_arguments(data, num_data=10000, dim=10, block_size=1000, separation=1.0, purity=False)
    data.add_argument(
        "--purities", default="0.95,1.0", help="comma list: share of each block from its dominant cluster"
    )
    data.add_argument("--seeds", default="0", help="comma list of seeds (data, initial means, block order)")
    run = parser.add_argument_group("run")
    run.add_argument("--epochs", type=int, default=10, help="passes over the data for every method")
    run.add_argument(
        "--cavi-iterations", type=int, default=5000, help="max CAVI sweeps for the reference optimum"
    )
    run.add_argument("--particles", type=int, default=16, help="vectorized ELBO particles (Pyro SVI, PDVI)")
    run.add_argument(
        "--optimizers",
        default="adam,rmsprop,sgd",
        help="Pyro SVI optimizers to run (comma list of adam, rmsprop, sgd; empty for none)",
    )
    run.add_argument(
        "--svi-seeds",
        default="",
        help="comma list: seeds on which the Pyro SVI runs (the costly ones) are made; all seeds if empty",
    )
    run.add_argument("--svi-epochs", type=int, default=0, help="epochs of the Pyro SVI runs; --epochs if 0")
    run.add_argument("--adam-lrs", default="0.01,0.03,0.1", help="learning-rate grid of SVI+Adam")
    run.add_argument("--rmsprop-lrs", default="0.003,0.01,0.03", help="learning-rate grid of SVI+RMSprop")
    run.add_argument(
        "--sgd-lrs",
        default="0.1,0.3,1.0",
        help="SGD grid in units of K/N, the inverse curvature of the loss in a mean with N/K points "
        "(so 1.0 is a Newton step in m for balanced clusters; the lr passed to SGD is value*K/N)",
    )
    run.add_argument(
        "--ng-decaying",
        default="1:0.55,1:0.7,10:0.7,100:0.7",
        help="NG-SVI Robbins-Monro grid, comma list of tau:kappa for rho_t = (t + tau)^-kappa",
    )
    run.add_argument("--ng-constant", default="0.01,0.03,0.1,0.3", help="NG-SVI constant step grid")
    run.add_argument(
        "--global-update",
        default="paper",
        help="PDVI global update(s), comma list of paper, consensus (GMMBlockSolver recommends paper)",
    )
    add_step_size_arguments(run)
    run.add_argument(
        "--antithetic",
        choices=tuple(ANTITHETIC),
        default="auto",
        help="PDVI(antithetic=...): antithetic particle pairs; auto (PDVI's default) is on for an even "
        "number of vectorized particles",
    )
    run.add_argument("--sweeps", type=int, default=10, help="coordinate-descent sweeps of GMMBlockSolver")
    run.add_argument(
        "--generic-num-data",
        type=int,
        default=2000,
        help="N of the reduced data set for PDVI through the generic Pyro path, first seed only "
        "(0 skips it; it costs about 1 s per 1,000 points per epoch)",
    )
    run.add_argument("--generic-epochs", type=int, default=5, help="epochs of the generic-path PDVI runs")
    run.add_argument(
        "--inner-steps",
        type=int,
        default=10,
        help="GenericSolver(inner_steps=...) of the generic PDVI runs: evaluations of the block "
        "objective per L-BFGS solve",
    )
    run.add_argument(
        "--methods",
        default="",
        help="comma list to run only some methods (names as in the table); all if empty",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--out", default="results", help="folder for the CSVs and the plot")
    out.add_argument(
        "--from-csv",
        default="",
        help="comma list of per-epoch CSVs written by earlier runs (e.g. parts of one configuration run in "
        "parallel processes): run nothing, merge them, print the table and plot",
    )
    out.add_argument("--quiet", action="store_true", help="no progress bars")
    out.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    out.add_argument("--device", default="cpu", help="torch device of the data and params, e.g. cuda")
    return parser.parse_args(argv)


# --------------------------------------------------------------------------- the methods


class CAVIStepper:
    """Full-batch CAVI as the epoch loop sees it: one sweep per epoch."""

    per_epoch = True

    def __init__(self, problem: GMMProblem) -> None:
        self.problem = problem
        self.m = problem.gmm.init_means.clone()
        self.rho = problem.gmm.init_log_variances.clone()

    def step(self, block: None) -> None:
        sweep = cavi(self.problem.data, self.problem.prior, m=self.m, rho=self.rho, num_iterations=1)
        self.m, self.rho = sweep.m, sweep.rho

    def score(self) -> dict:
        return self.problem.score(self.m, self.rho)


class NaturalGradientStepper(GMMNaturalGradientSVI):
    """Natural-gradient SVI from the problem's start, scored by its own ``q(c)``."""

    def __init__(self, problem: GMMProblem, **schedule) -> None:
        gmm = problem.gmm
        super().__init__(problem.data, problem.prior, gmm.init_means, gmm.init_log_variances, **schedule)
        self.problem = problem

    def score(self) -> dict:
        return self.problem.score(self.m, self.rho)


def score_of(problem: GMMProblem, stepper) -> dict:
    """A method's scores: its own ``q(c)``, or the param store's (Pyro's SVI and PDVI, whose own
    ``q(z)`` is the store's ``alpha``)."""
    if hasattr(stepper, "score"):
        return stepper.score()
    return problem.score_params(with_own=True)


def train(
    problem: GMMProblem,
    purity: float,
    method: str,
    setting: str,
    make_stepper: Callable,
    epochs: int,
    quiet: bool,
    progress_path: Path | None = None,
) -> list[dict]:
    """Run one method for ``epochs`` passes; score after every epoch (appended to
    ``progress_path`` as it comes, so a run stopped early leaves its epochs behind).

    A learning rate too large for the grid makes Pyro refuse a non-positive scale, PDVI a
    non-finite step: that run is recorded as diverged (NaN), not a crash of the benchmark."""
    stepper = None
    head = {
        "purity": purity,
        "seed": problem.seed,
        "num_data": problem.data.shape[0],
        "method": method,
        "setting": setting,
    }

    def make() -> object:
        nonlocal stepper
        stepper = make_stepper()
        return stepper

    def record(row: dict) -> None:
        if progress_path is not None:
            append_csv(as_row(head, row, problem), progress_path)

    _, history = run_epochs(
        make,
        problem.blocks,
        epochs,
        problem.seed,
        lambda epoch: score_of(problem, stepper),
        callback=record,
        catch=(ValueError, RuntimeError),
        nan_keys=SCORE_KEYS,
        label=f"p={purity} s={problem.seed} {method} {setting}",
        progress=not quiet,
    )
    if isinstance(stepper, PDVI):
        head["setting"] = f"{setting} (eta {step_sizes_text(stepper)})"
    return [as_row(head, row, problem) for row in history]


def as_row(head: dict, row: dict, problem: GMMProblem) -> dict:
    """A per-epoch CSV row: the run, the epoch, the seconds, the scores, the CAVI optimum's W2."""
    return {**head, **row, "cavi_w2": problem.cavi_w2}


def runs_for(
    problem: GMMProblem, args: argparse.Namespace, generic: bool
) -> list[tuple[str, str, Callable, int]]:
    """``(method, setting, make_stepper, epochs)`` for every run on ``problem``."""
    gmm, blocks, epochs = problem.gmm, problem.blocks, args.epochs
    pdvi = partial(
        gmm_pdvi,
        gmm,
        blocks,
        args.particles,
        eta=auto_step_size(args),
        antithetic=ANTITHETIC[args.antithetic],
    )
    rules = names(args.global_update)
    runs = []
    if generic:
        # PDVI as a user calls it: the user's ELBO, every option at its default.
        defaults = partial(gmm_pdvi, gmm, blocks, args.particles)
        runs.append(("PDVI generic defaults", "defaults", defaults, args.generic_epochs))
        solver = GenericSolver(inner_steps=args.inner_steps)
        for rule in rules:
            runs.append(
                ("PD-VI generic", rule, partial(pdvi, solver=solver, global_update=rule), args.generic_epochs)
            )
            runs.append(
                (
                    "P2D-VI generic",
                    rule,
                    partial(pdvi, groups="per_site", solver=solver, global_update=rule),
                    args.generic_epochs,
                )
            )
        return runs
    runs.append(("CAVI", "full batch", partial(CAVIStepper, problem), epochs))
    for tau, kappa in pairs(args.ng_decaying):
        make = partial(NaturalGradientStepper, problem, tau=tau, kappa=kappa)
        runs.append(("NG-SVI decaying", f"tau={tau:g} kappa={kappa:g}", make, epochs))
    for step in floats(args.ng_constant):
        runs.append(
            (
                "NG-SVI constant",
                f"step={step:g}",
                partial(NaturalGradientStepper, problem, step_size=step),
                epochs,
            )
        )
    optimizers = {
        "adam": ("SVI+Adam", pyro.optim.Adam, floats(args.adam_lrs), 1.0),
        "rmsprop": ("SVI+RMSprop", pyro.optim.RMSprop, floats(args.rmsprop_lrs), 1.0),
        "sgd": ("SVI+SGD", pyro.optim.SGD, floats(args.sgd_lrs), args.num_components / problem.data.shape[0]),
    }
    svi_seeds = ints(args.svi_seeds) if args.svi_seeds.strip() else None
    optimizer_keys = names(args.optimizers)
    if svi_seeds is not None and problem.seed not in svi_seeds:
        optimizer_keys = []
    for key in optimizer_keys:
        if key not in optimizers:
            raise ValueError(f"Invalid optimizer {key!r} in --optimizers; use adam, rmsprop, sgd")
        name, optim, grid, unit = optimizers[key]
        for value in grid:
            lr = value * unit
            setting = f"lr={value:g}xK/N" if key == "sgd" else f"lr={lr:g}"
            make = partial(svi, gmm, optim, lr, args.particles)
            runs.append((name, setting, make, args.svi_epochs or epochs))
    for rule in rules:
        solver = GMMBlockSolver(problem.data, problem.prior, num_sweeps=args.sweeps)
        runs.append(("PD-VI closed-form", rule, partial(pdvi, solver=solver, global_update=rule), epochs))
        runs.append(
            (
                "P2D-VI closed-form",
                rule,
                partial(pdvi, groups="per_site", solver=solver, global_update=rule),
                epochs,
            )
        )
    return runs


def svi(gmm, optim, lr: float, particles: int) -> SVI:
    """Pyro's SVI on ``GMMModel`` with ``optim({"lr": lr})``."""
    return SVI(gmm.model, gmm.guide, optim({"lr": lr}), gmm_elbo(particles))


# --------------------------------------------------------------------------- the table and the plot


def summarise(rows: list[dict]) -> list[dict]:
    """One line per (purity, method): the setting with the lowest mean final W2 over seeds."""
    runs: dict[tuple, dict[int, list[dict]]] = {}
    for row in rows:
        key = (row["purity"], row["method"], row["setting"].split(" (")[0])
        runs.setdefault(key, {}).setdefault(row["seed"], []).append(row)
    by_method: dict[tuple, list[tuple[float, str, list[list[dict]]]]] = {}
    for (purity, method, setting), seeds in runs.items():
        histories = list(seeds.values())
        final = statistics.fmean(
            h[-1]["w2_ratio"] if math.isfinite(h[-1]["w2_ratio"]) else math.inf for h in histories
        )
        by_method.setdefault((purity, method), []).append((final, setting, histories))
    table = []
    for (purity, method), candidates in sorted(
        by_method.items(), key=lambda item: (item[0][0], METHODS.index(item[0][1]))
    ):
        final, setting, histories = min(candidates, key=lambda c: c[0])
        reached = []
        for history in histories:
            hit = next((r["epoch"] for r in history if r["w2_ratio"] <= 1.1), None)
            reached.append("-" if hit is None else str(hit))
        lasts = [h[-1] for h in histories]
        table.append(
            {
                "purity": purity,
                "method": method,
                "setting": histories[0][-1]["setting"],
                "N": lasts[0]["num_data"],
                "epochs": lasts[0]["epoch"],
                "seeds": len(histories),
                "epochs_to_1.1x_cavi_w2": " ".join(reached),
                "final_w2": statistics.fmean(r["w2"] for r in lasts),
                "cavi_w2": statistics.fmean(r["cavi_w2"] for r in lasts),
                "final_w2_ratio": statistics.fmean(r["w2_ratio"] for r in lasts),
                "final_gap": statistics.fmean(r["gap"] for r in lasts),
                "final_gap_own_qz": statistics.fmean(r["gap_own"] for r in lasts),
                "final_ari": statistics.fmean(r["ari"] for r in lasts),
                "first_epoch_s": statistics.fmean(cost_split(h)[0] for h in histories),
                "s_per_epoch": statistics.median(cost_split(h)[1] for h in histories),
                "grid_size": len(candidates),
                "diverged_settings": sum(not math.isfinite(c[0]) for c in candidates),
            }
        )
    return table


def print_table(table: list[dict]) -> None:
    header = [
        "purity",
        "method",
        "best setting",
        "N",
        "epochs",
        "epochs to W2<=1.1xW2* (per seed)",
        "final W2 (W2*)",
        "W2/W2*",
        "-ELBO gap (q(z) re-solved)",
        "-ELBO gap (own q(z))",
        "ARI",
        "first epoch s",
        "s/epoch",
    ]
    lines = [
        [
            f"{r['purity']:g}",
            r["method"],
            r["setting"],
            r["N"],
            r["epochs"],
            r["epochs_to_1.1x_cavi_w2"],
            f"{r['final_w2']:.4f} ({r['cavi_w2']:.4f})",
            f"{r['final_w2_ratio']:.3f}",
            f"{r['final_gap']:.2e}",
            f"{r['final_gap_own_qz']:.2e}",
            f"{r['final_ari']:.3f}",
            f"{r['first_epoch_s']:.2f}",
            f"{r['s_per_epoch']:.3f}",
        ]
        for r in table
    ]
    print(markdown_table(header, lines))


def plot(rows: list[dict], table: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    purities = sorted({r["purity"] for r in table})
    fig, axes = plt.subplots(len(purities), 3, figsize=(16, 4.2 * len(purities)), squeeze=False)
    colours = {method: f"C{i}" for i, method in enumerate(METHODS)}
    for row_axes, purity in zip(axes, purities):
        for line in (r for r in table if r["purity"] == purity):
            setting = line["setting"]
            chosen = [
                r
                for r in rows
                if r["purity"] == purity and r["method"] == line["method"] and r["setting"] == setting
            ]
            seeds = sorted({r["seed"] for r in chosen})
            epochs = sorted({r["epoch"] for r in chosen})
            curves = {
                key: torch.tensor(
                    [
                        [next(r[key] for r in chosen if r["seed"] == s and r["epoch"] == e) for e in epochs]
                        for s in seeds
                    ]
                )
                for key in ("w2_ratio", "seconds", "gap")
            }
            style = "--" if "generic" in line["method"] else "-"
            label = f"{line['method']} ({setting.split(' (')[0]})"
            x_epochs = torch.tensor(epochs, dtype=torch.float64)
            for ax, x, key in (
                (row_axes[0], x_epochs, "w2_ratio"),
                (row_axes[1], curves["seconds"].mean(0), "w2_ratio"),
                (row_axes[2], x_epochs, "gap"),
            ):
                values = curves[key].clamp_min(1e-7) if key == "gap" else curves[key]
                marker = "o" if len(epochs) == 1 else None
                ax.plot(x, values.mean(0), style, marker=marker, color=colours[line["method"]], label=label)
                ax.fill_between(x, values.amin(0), values.amax(0), color=colours[line["method"]], alpha=0.2)
        row_axes[0].set(
            xlabel="epoch", ylabel="W2 / W2 of CAVI optimum", yscale="log", title=f"purity {purity:g}"
        )
        row_axes[1].set(
            xlabel="seconds (1 thread, steps only)", ylabel="W2 / W2 of CAVI optimum", yscale="log"
        )
        row_axes[1].set_xscale("log")
        row_axes[2].set(xlabel="epoch", ylabel="relative -ELBO gap to CAVI (q(z) re-solved)", yscale="log")
        for ax in row_axes[:2]:
            ax.axhline(1.1, color="grey", lw=0.8, ls=":")
        row_axes[0].legend(fontsize=7)
    save_figure(fig, path, dpi=100)


# --------------------------------------------------------------------------- main

#: How the per-epoch CSV's columns are read back (``--from-csv``).
COLUMN_TYPES = {"purity": float, "seed": int, "num_data": int, "epoch": int, "method": str, "setting": str}
COLUMN_TYPES.update({key: float for key in ("seconds", "cavi_w2", *SCORE_KEYS)})


def main(args: argparse.Namespace) -> list[dict]:
    setup_torch(args.threads)
    wanted = set(names(args.methods))
    unknown = wanted - set(METHODS)
    if unknown:
        raise ValueError(f"Invalid --methods {sorted(unknown)}; choose from {list(METHODS)}")
    out = Path(args.out)
    rows = read_csv(names(args.from_csv), COLUMN_TYPES) if args.from_csv.strip() else []
    seeds = [] if rows else ints(args.seeds)
    for purity in floats(args.purities) if seeds else []:
        for seed in seeds:
            sizes = [(args.num_data, False)]
            if args.generic_num_data > 0 and seed == seeds[0]:
                sizes.append((args.generic_num_data, True))
            for num_data, generic in sizes:
                problem = gmm_problem_from(args, seed, purity, num_data)
                print(
                    f"purity {purity:g} seed {seed}: N={num_data} K={args.num_components} "
                    f"d={args.dim} blocks={len(problem.blocks)}x{args.block_size}; CAVI optimum -ELBO "
                    f"{problem.cavi_loss:.2f}, W2 {problem.cavi_w2:.4f} after {len(problem.optimum.losses)} "
                    f"sweeps (converged: {problem.optimum.converged}); threads={torch.get_num_threads()}",
                    flush=True,
                )
                for method, setting, make_stepper, epochs in runs_for(problem, args, generic):
                    if wanted and method not in wanted:
                        continue
                    history = train(
                        problem,
                        purity,
                        method,
                        setting,
                        make_stepper,
                        epochs,
                        args.quiet,
                        out / "gmm_biased_batches_progress.csv",
                    )
                    last = history[-1]
                    print(
                        f"  {method} {last['setting']}: W2/W2* {last['w2_ratio']:.3f}, gap {last['gap']:.2e} "
                        f"after {last['epoch']} epochs, {last['seconds']:.1f} s",
                        flush=True,
                    )
                    rows += history
                    write_csv(rows, out / "gmm_biased_batches.csv")  # partial results survive
    write_csv(rows, out / "gmm_biased_batches.csv")
    table = summarise(rows)
    write_csv(table, out / "gmm_biased_batches_table.csv")
    print()
    print_table(table)
    plot(rows, table, out / "gmm_biased_batches.png")
    return table


if __name__ == "__main__":
    main(parse_args())
