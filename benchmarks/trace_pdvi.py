"""Where a PDVI run loses ground, epoch by epoch: one model of the generic suite, one PDVI
configuration, one seed, and after every epoch the error against the model's reference, the
dual correction ``|h| = |H mean(mu)|`` and every change of the step sizes in that epoch (at which
step, how many coordinates, by which factors, and how far ``lambda_0`` moved in that step: the
step's whole move, the held scales' jump to their fixed point included).

``docs/benchmarks.md`` 13o found this way that the locations' step sizes grew 19-28x at once at
the first epoch's last step (the scales' fixed point sets AutoNormal's scales then), which moved
``lambda_0`` away from the optimum with duals gathered under the small ones. The run is the
suite's (:func:`benchmarks.generic_suite.runner.common_start`, as in ``run_method``): the same
start, block orders and configurations; it reads no seconds but the steps' own CPU time.

Examples::

    python benchmarks/trace_pdvi.py --model odlogit --epochs 10
    python benchmarks/trace_pdvi.py --model ppca --quick --pdvi-config warmup0 --every-step
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: import this checkout's benchmarks and pyro_pdvi, not an installed copy.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.generic_suite.baselines import PDVI_CONFIGS, pdvi  # noqa: E402
from benchmarks.generic_suite.metrics import PLOTTED, Scorer  # noqa: E402
from benchmarks.generic_suite.models import PROBLEM_NAMES, make_problem  # noqa: E402
from benchmarks.generic_suite.references import compute_reference  # noqa: E402
from benchmarks.generic_suite.runner import common_start  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="odlogit", choices=PROBLEM_NAMES, help="the suite's model")
    parser.add_argument(
        "--pdvi-config", default="defaults", choices=sorted(PDVI_CONFIGS), help="PDVI configuration"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the start and the block orders")
    parser.add_argument("--epochs", type=int, default=10, help="epochs to run")
    parser.add_argument("--quick", action="store_true", help="the suite's quick sizes (PPCA, GMM)")
    parser.add_argument(
        "--every-step", action="store_true", help="a row after every step, not only after every epoch"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--out", default=None, help="also write the rows to this CSV file")
    return parser.parse_args(argv)


def _changes(before: torch.Tensor, after: torch.Tensor) -> str:
    """How the step sizes changed in one step (how many coordinates, the smallest and largest
    factor), or '' where none did."""
    ratio = after / before
    changed = ratio != 1
    if not bool(changed.any()):
        return ""
    return f"{int(changed.sum())} coords x{float(ratio.min()):.3g}-{float(ratio.max()):.3g}"


def trace(args: argparse.Namespace) -> list[dict]:
    """Run the traced fit; one dict per row (see the module docstring)."""
    torch.set_num_threads(args.threads)
    problem = make_problem(args.model, args.quick)
    scorer = Scorer(problem, compute_reference(problem))
    primary, secondary = PLOTTED[args.model]
    guide, order, blocks = common_start(problem, args.seed)
    num_blocks = len(problem.blocks)
    algo = pdvi(args.pdvi_config).build(problem, guide).algo
    rows, seconds, events = [], 0.0, []

    def row(epoch: float) -> dict:
        metrics = scorer()
        state = algo.state
        return {
            "epoch": epoch,
            "cpu_s": round(seconds, 3),
            primary: metrics.get(primary, float("nan")),
            secondary: metrics.get(secondary, float("nan")),
            "elbo_gap": metrics.get("elbo_gap", float("nan")),
            "h_norm": float(state.h.norm()) if state is not None else 0.0,
            "step_size_changes": "; ".join(events),
        }

    rows.append(row(0.0))
    for epoch in range(args.epochs):
        if epoch:
            blocks = torch.randperm(num_blocks, generator=order).tolist()
        for visit, b in enumerate(blocks):
            state = algo.state
            before = None if state is None else (state.step_sizes.clone(), state.consensus.clone())
            start = time.process_time()
            algo.step(problem.blocks[b])
            seconds += time.process_time() - start
            state = algo.state
            change = "" if before is None else _changes(before[0], state.step_sizes)
            if change:
                move = float((state.consensus - before[1]).norm())
                events.append(f"step {algo.num_steps}: {change}, lambda_0 moved {move:.3g}")
            if args.every_step and visit + 1 < num_blocks:
                rows.append(row(epoch + (visit + 1) / num_blocks))
                events = []
        rows.append(row(epoch + 1.0))
        events = []
    return rows


def main(args: argparse.Namespace) -> list[dict]:
    rows = trace(args)
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k]) for k in keys), flush=True)
    if args.out:
        with open(args.out, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
    return rows


if __name__ == "__main__":
    main(parse_args())
