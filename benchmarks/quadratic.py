"""PD-VI vs P2D-VI on the strongly convex quadratic of the paper's App. C.3 (Fig. 2).

Epochs (one block per step, a fresh random order each epoch) until the consensus is within
``--tolerance`` relative error of the exact optimum from one linear solve, for one step size
(PD-VI) and one per site (P2D-VI), both ``eta="auto"``, over several ``AutoStepSize(scale=...)``
values, with the two global sites' curvatures equal or 100x apart. The block solve is
``GenericSolver(inner_steps=30)`` (L-BFGS, exact on a quadratic).

Example::

    python benchmarks/quadratic.py --eta-scales 1,2,4 --epochs 40
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: import this checkout's benchmarks and pyro_pdvi, not an installed copy.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyro  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import floats, markdown_table, run_epochs, script_parser, setup_torch  # noqa: E402
from pyro_pdvi import PDVI, AutoStepSize, GenericSolver  # noqa: E402
from pyro_pdvi.models.quadratic import Quadratic  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--num-data", type=int, default=12, help="N")
    parser.add_argument("--num-blocks", type=int, default=4, help="fixed contiguous blocks")
    parser.add_argument("--eta-scales", default="1,2,4", help="AutoStepSize(scale=...) values to compare")
    parser.add_argument("--epochs", type=int, default=40, help="at most this many passes over the blocks")
    parser.add_argument("--tolerance", type=float, default=1e-6, help="target relative error")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return parser.parse_args(argv)


def epochs_to_tolerance(problem: Quadratic, groups, scale: float, args) -> tuple[int | None, float]:
    """The first epoch whose relative error is below the tolerance (``None``), and that error."""
    _, optimum = problem.optimum()

    def make() -> PDVI:
        return PDVI(
            problem.model,
            problem.guide,
            pyro.optim.Adam({"lr": 0.1}),
            problem.loss,
            blocks=problem.blocks,
            eta=AutoStepSize(scale=scale),
            groups=groups,
            solver=GenericSolver(inner_steps=30),
        )

    def evaluate(epoch: int) -> dict:
        consensus = torch.cat([pyro.param("a").detach(), pyro.param("b").detach()])
        return {"error": float((consensus - optimum).norm() / optimum.norm())}

    _, rows = run_epochs(
        make, problem.blocks, args.epochs, 0, evaluate, callback=lambda row: row["error"] < args.tolerance
    )
    last = rows[-1]
    return (last["epoch"] if last["error"] < args.tolerance else None), last["error"]


def main(args: argparse.Namespace) -> list[dict]:
    setup_torch(args.threads)
    scales = floats(args.eta_scales)
    print(
        f"epochs to relative error < {args.tolerance:g} (at most {args.epochs}; final error if not reached)\n"
    )
    rows, lines = [], []
    for scale_b, groups in [(1.0, None), (10.0, None), (10.0, "per_site")]:
        problem = Quadratic(num_data=args.num_data, num_blocks=args.num_blocks, scale_b=scale_b)
        cells = []
        for scale in scales:
            epochs, error = epochs_to_tolerance(problem, groups, scale, args)
            rows.append(
                {"scale_b": scale_b, "groups": groups, "eta_scale": scale, "epochs": epochs, "error": error}
            )
            cells.append(str(epochs) if epochs is not None else f"> {args.epochs} ({error:.2g})")
        label = "equal" if scale_b == 1.0 else f"{scale_b**2:g}x apart"
        lines.append([label, groups or "one (PD-VI)", *cells])
    print(markdown_table(["curvatures of a, b", "groups", *(f"scale {s:g}" for s in scales)], lines))
    return rows


if __name__ == "__main__":
    main(parse_args())
