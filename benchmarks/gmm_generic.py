"""PDVI vs Pyro's SVI+Adam on a Bayesian GMM with cluster-sorted blocks, through the
generic Pyro path (``GenericSolver``: L-BFGS on each block's augmented Lagrangian through
``GMMModel``'s model/guide pair and ``TraceEnum_ELBO``, exactly what a Pyro user would write),
or with ``--closed-form`` through the mixture's own block solver (``GMMBlockSolver``).

Every method starts from the same initial means and sees the same fixed, non-i.i.d. blocks
(each holds mostly one cluster) in the same fresh random order each epoch. After each epoch
the script measures, from the global params alone (locals re-solved in closed form, so every
method is judged the same way):

* the gap of the exact negative ELBO to the full-batch CAVI optimum, relative;
* W2 between the true and fitted mixtures, as a ratio to CAVI's W2 (paper Fig. 3).

It prints a table (epochs to reach the optimum, final values, seconds of the first epoch and
per epoch after it) and writes ``gmm_generic.csv`` and ``gmm_generic.png`` under ``--out``.

Example::

    python benchmarks/gmm_generic.py --num-data 2000 --epochs 10 --out results
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: import this checkout's benchmarks and pyro_pdvi, not an installed copy.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyro  # noqa: E402
import torch  # noqa: E402
from pyro.infer import SVI  # noqa: E402

from benchmarks.common import (  # noqa: E402
    add_gmm_data_arguments,
    add_step_size_arguments,
    auto_step_size,
    cost_split,
    first_epoch,
    floats,
    gmm_elbo,
    gmm_pdvi,
    gmm_problem_from,
    markdown_table,
    pyplot,
    run_epochs,
    save_figure,
    script_parser,
    setup_torch,
    write_csv,
)
from pyro_pdvi import PDVI, GenericSolver  # noqa: E402
from pyro_pdvi.models.gmm import GMMBlockSolver  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    add_gmm_data_arguments(parser, num_data=2000, dim=10, block_size=200, separation=1.0)
    parser.add_argument("--epochs", type=int, default=10, help="passes over the data for PDVI")
    parser.add_argument("--svi-epochs", type=int, default=30, help="passes over the data for SVI")
    parser.add_argument("--lrs", default="0.01,0.03,0.1", help="Adam learning rates to try for SVI")
    parser.add_argument("--particles", type=int, default=16, help="vectorized ELBO particles (both methods)")
    parser.add_argument(
        "--closed-form",
        action="store_true",
        help="PDVI solves each block with GMMBlockSolver (closed-form coordinate descent) instead of L-BFGS",
    )
    parser.add_argument(
        "--rules",
        default="auto,paper,consensus",
        help="PDVI global_update rules to run (comma list); P2D-VI runs with the first",
    )
    parser.add_argument("--warmup-epochs", type=float, default=5.0, help="PDVI warmup_epochs (rule 'auto')")
    parser.add_argument(
        "--antithetic",
        choices=("off", "on", "both"),
        default="off",
        help="PDVI draws its particles in antithetic pairs (PDVI(antithetic=True))",
    )
    parser.add_argument(
        "--eta-scales", default="2", help="AutoStepSize(scale=...) values of PDVI to run (comma list)"
    )
    add_step_size_arguments(parser, scale=False)
    parser.add_argument(
        "--inner-steps",
        type=int,
        default=10,
        help="GenericSolver(inner_steps=...): evaluations of the block objective per L-BFGS solve "
        "(one per iteration, rejected trial steps included)",
    )
    parser.add_argument("--seed", type=int, default=0, help="data, initial means and block order")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", default="results", help="folder for the CSV and the plot")
    parser.add_argument("--quiet", action="store_true", help="no per-epoch lines")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> list[dict]:
    setup_torch(args.threads)
    problem = gmm_problem_from(args, args.seed)
    gmm, blocks = problem.gmm, problem.blocks
    print(
        f"N={args.num_data} K={args.num_components} d={args.dim} blocks={len(blocks)}x{args.block_size} "
        f"purity={args.purity}; CAVI: -ELBO {problem.cavi_loss:.4f}, W2 {problem.cavi_w2:.4f}, "
        f"{len(problem.optimum.losses)} iterations; threads={torch.get_num_threads()}"
    )

    def evaluate(epoch: int) -> dict:
        scores = problem.score_params()
        return {"gap": scores["gap"], "w2_ratio": scores["w2_ratio"]}

    def run(name: str, setting: str, make_algo, epochs: int) -> list[dict]:
        def report(row: dict) -> None:
            if not args.quiet:
                print(
                    f"  {name:8s} {setting:28s} epoch {row['epoch']:3d}  -ELBO gap {row['gap']:9.2e}  "
                    f"W2/W2* {row['w2_ratio']:6.3f}"
                )

        algo, rows = run_epochs(make_algo, blocks, epochs, args.seed, evaluate, callback=report)
        if isinstance(algo, PDVI):
            setting += " eta=" + ",".join(f"{eta:.2g}" for eta in algo.step_sizes.values())
        return [{"method": name, "setting": setting, **row} for row in rows]

    if args.closed_form:
        solver, solver_name = GMMBlockSolver(problem.data, problem.prior), "closed form x10 sweeps"
    else:
        solver, solver_name = GenericSolver(inner_steps=args.inner_steps), f"lbfgs x{args.inner_steps}"
    rules = args.rules.split(",")
    variants = [("PD-VI", None, rule) for rule in rules] + [("P2D-VI", "per_site", rules[0])]
    antithetic_settings = {"off": [False], "on": [True], "both": [False, True]}[args.antithetic]
    histories = []
    for scale in floats(args.eta_scales):
        for name, groups, rule in variants:
            for antithetic in antithetic_settings:
                setting = f"{rule}, auto x{scale:g}, {solver_name}" + (", antithetic" if antithetic else "")
                make = partial(
                    gmm_pdvi,
                    gmm,
                    blocks,
                    args.particles,
                    eta=auto_step_size(args, scale),
                    groups=groups,
                    solver=solver,
                    global_update=rule,
                    warmup_epochs=args.warmup_epochs,
                    antithetic=antithetic,
                )
                histories.append(run(name, setting, make, args.epochs))
    for lr in floats(args.lrs):
        make = partial(SVI, gmm.model, gmm.guide, pyro.optim.Adam({"lr": lr}), gmm_elbo(args.particles))
        histories.append(run("SVI+Adam", f"lr={lr:g}", make, args.svi_epochs))

    rows = [row for history in histories for row in history]
    out = Path(args.out)
    write_csv(rows, out / "gmm_generic.csv")
    lines = []
    for history in histories:
        last = history[-1]
        first_s, steady = cost_split(history)
        lines.append(
            [
                last["method"],
                last["setting"],
                first_epoch(history, "gap", 1e-3),
                first_epoch(history, "w2_ratio", 1.1),
                f"{last['gap']:.2e}",
                f"{last['w2_ratio']:.3f}",
                f"{first_s:.2f}",
                f"{steady:.3f}",
            ]
        )
    header = ["method", "setting", "epochs to gap<1e-3", "epochs to W2<=1.1xW2*", "final gap"]
    header += ["final W2/W2*", "first epoch s", "s/epoch after"]
    print("\n" + markdown_table(header, lines))
    plot(histories, out / "gmm_generic.png")
    return rows


def plot(histories: list[list[dict]], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for history in histories:
        label = f"{history[0]['method']} {history[0]['setting']}"
        epochs = [row["epoch"] for row in history]
        gaps = [max(row["gap"], 1e-8) for row in history]
        axes[0].semilogy(epochs, gaps, label=label)
        axes[1].plot(epochs, [row["w2_ratio"] for row in history], label=label)
        axes[2].semilogy([row["seconds"] for row in history], gaps)
    axes[0].set(xlabel="epoch", ylabel="relative -ELBO gap to CAVI")
    axes[1].set(xlabel="epoch", ylabel="W2 / W2 at the CAVI optimum", ylim=(0.9, 3))
    axes[1].axhline(1.1, color="grey", lw=0.5)
    axes[2].set(xlabel="seconds (1 thread)", ylabel="relative -ELBO gap to CAVI")
    axes[0].legend(fontsize=7)
    save_figure(fig, path)


if __name__ == "__main__":
    main(parse_args())
