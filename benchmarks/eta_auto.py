"""How good is ``eta="auto"``'s step size on a GMM, against a grid of fixed ones?

Closed-form path (``GMMBlockSolver``), cluster-sorted blocks (``make_biased_gmm``),
float64, one block per step in a fresh random order each epoch, the global update the
default ``"auto"`` picks (the paper's rule, the solve being deterministic). After each
epoch: the relative gap of the exact negative ELBO to the full-batch CAVI optimum (q(z)
re-solved in closed form) and W2 to the true mixture as a ratio to the CAVI optimum's.

With ``--curvatures`` it also prints the curvature ``L_j`` that ``eta="auto"`` measures (the
reduced block objective ``min_phi f_b``, max over 4 blocks), per group, at the initial point
and at the CAVI optimum (a PDVI started there, with ``AutoStepSize(scale=1)``: ``L_j =
1 / eta_j``), for one group (PD-VI) or one per site (P2D-VI).

Example (the well-separated case: d = 2, separation 3)::

    python benchmarks/eta_auto.py --dim 2 --separation 3 --etas 1e-3,3e-3,1e-2,3e-2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: import this checkout's benchmarks and pyro_pdvi, not an installed copy.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyro  # noqa: E402

from benchmarks.common import (  # noqa: E402
    GMMProblem,
    add_gmm_data_arguments,
    first_epoch,
    floats,
    gmm_pdvi,
    gmm_problem_from,
    ints,
    markdown_table,
    run_epochs,
    script_parser,
    setup_torch,
    step_sizes_text,
)
from pyro_pdvi import AutoStepSize  # noqa: E402
from pyro_pdvi.models.gmm import GMMBlockSolver, GMMModel  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    add_gmm_data_arguments(parser, num_data=2000, dim=2, block_size=200, separation=3.0)
    parser.add_argument("--seeds", default="0", help="data/start/block-order seeds (comma list)")
    parser.add_argument("--epochs", type=int, default=15, help="passes over the data")
    parser.add_argument("--etas", default="", help="fixed step sizes to compare (comma list)")
    parser.add_argument(
        "--remeasure",
        default="none,1",
        help="AutoStepSize(remeasure_epochs=...) of the eta='auto' runs, comma list of '+'-joined "
        "epochs ('none': ())",
    )
    parser.add_argument("--groups", default="none", help="'none' (PD-VI), 'per_site' (P2D-VI), or both")
    parser.add_argument("--curvatures", action="store_true", help="print L_j at the start and optimum")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--quiet", action="store_true", help="no per-epoch lines")
    return parser.parse_args(argv)


def pdvi(problem: GMMProblem, gmm: GMMModel, eta: float | AutoStepSize, groups: str | None):
    return gmm_pdvi(
        gmm, problem.blocks, eta=eta, groups=groups, solver=GMMBlockSolver(problem.data, problem.prior)
    )


def run(problem: GMMProblem, eta, groups, args: argparse.Namespace, label: str) -> dict:
    etas = []

    def evaluate(epoch: int) -> dict:
        etas.append(dict(algo.step_sizes))
        scores = problem.score_params()
        return {"gap": scores["gap"], "w2_ratio": scores["w2_ratio"]}

    def report(row: dict) -> None:
        if not args.quiet:
            print(
                f"  {label:34s} epoch {row['epoch']:3d} gap {row['gap']:9.2e} W2/W2* {row['w2_ratio']:7.3f}  "
                + step_sizes_text(algo, " ")
            )

    def make():
        nonlocal algo
        algo = pdvi(problem, problem.gmm, eta, groups)
        return algo

    algo = None
    _, history = run_epochs(make, problem.blocks, args.epochs, problem.seed, evaluate, callback=report)
    return {"label": label, "history": history, "seconds": history[-1]["seconds"], "etas": etas}


def curvatures(problem: GMMProblem, groups: str | None) -> dict[str, list[float]]:
    """``L_j`` as ``eta="auto"`` measures it at set-up, from the start and from the CAVI optimum."""
    optimum = problem.optimum
    at_optimum = GMMModel(
        problem.data,
        problem.prior,
        init_means=optimum.m,
        init_log_variances=optimum.rho,
        init_logits=optimum.alpha,
    )
    measured = []
    for gmm in (problem.gmm, at_optimum):
        pyro.clear_param_store()
        pyro.set_rng_seed(problem.seed)
        algo = pdvi(problem, gmm, AutoStepSize(scale=1.0), groups)
        algo.step(problem.blocks[0])  # the set-up measures
        measured.append({name: 1.0 / eta for name, eta in algo.step_sizes.items()})
    return {name: [measured[0][name], measured[1][name]] for name in measured[0]}


def main(args: argparse.Namespace) -> list[dict]:
    setup_torch(args.threads)
    groups_list = [None if g == "none" else g for g in args.groups.split(",")]
    results = []
    for seed in ints(args.seeds):
        problem = gmm_problem_from(args, seed)
        print(
            f"seed {seed}: N={args.num_data} K={args.num_components} d={args.dim} "
            f"blocks={len(problem.blocks)}x{args.block_size} purity={args.purity} "
            f"separation={args.separation}; CAVI -ELBO {problem.cavi_loss:.4f} W2* {problem.cavi_w2:.4f} "
            f"({len(problem.optimum.losses)} sweeps)"
        )
        for groups in groups_list:
            kind = "P2D-VI" if groups else "PD-VI"
            if args.curvatures:
                for name, (start, optimum) in curvatures(problem, groups).items():
                    print(
                        f"  {kind} curvature L[{name}]: start {start:.4g}, CAVI optimum {optimum:.4g} "
                        f"(ratio {optimum / start:.3g})"
                    )
            for setting in args.remeasure.split(","):
                epochs = () if setting == "none" else tuple(float(e) for e in setting.split("+"))
                label = f"{kind} auto, remeasure {setting}"
                eta = AutoStepSize(remeasure_epochs=epochs)
                results.append({"seed": seed, **run(problem, eta, groups, args, label)})
            for eta in floats(args.etas):
                label = f"{kind} eta={eta:g}"
                results.append({"seed": seed, **run(problem, eta, groups, args, label)})

    lines = []
    for r in results:
        history = r["history"]
        start = ",".join(f"{v:.3g}" for v in r["etas"][0].values())
        end = ",".join(f"{v:.3g}" for v in r["etas"][-1].values())
        lines.append(
            [
                r["seed"],
                r["label"],
                start if start == end else f"{start} -> {end}",
                first_epoch(history, "gap", 1e-3),
                first_epoch(history, "w2_ratio", 1.1),
                f"{history[-1]['gap']:.2e}",
                f"{history[-1]['w2_ratio']:.3f}",
                f"{r['seconds']:.1f}",
            ]
        )
    header = ["seed", "run", "eta (start -> end)", "epochs to gap<1e-3", "epochs to W2<=1.1xW2*"]
    print("\n" + markdown_table(header + ["final gap", "final W2/W2*", "s"], lines))
    return results


if __name__ == "__main__":
    main(parse_args())
