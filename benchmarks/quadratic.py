"""PD-VI vs P2D-VI on the strongly convex quadratic of the paper's App. C.3 (Fig. 2).

Epochs (one block per step, random order) until the consensus is within 1e-6
relative error of the exact optimum from one linear solve, for one step size
(PD-VI) and one per site (P2D-VI), both ``eta="auto"``, over several
``eta_scale`` values, with the two global sites' curvatures equal or 100x apart.

Example::

    python examples/benchmark_quadratic.py --eta-scales 1,2,4 --epochs 40
"""

from __future__ import annotations

import argparse

import pyro
import torch

from pyro_pdvi import PDVI
from pyro_pdvi.models.quadratic import Quadratic


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-data", type=int, default=12)
    parser.add_argument("--num-blocks", type=int, default=4)
    parser.add_argument("--eta-scales", default="1,2,4", help="values of eta_scale to compare")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--tolerance", type=float, default=1e-6, help="target relative error")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return parser.parse_args(argv)


def epochs_to_tolerance(problem: Quadratic, groups, eta_scale: float, args) -> tuple[int | None, float]:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    _, optimum = problem.optimum()
    pdvi = PDVI(
        problem.model,
        problem.guide,
        pyro.optim.Adam({"lr": 0.1}),
        problem.loss,
        blocks=problem.blocks,
        groups=groups,
        eta_scale=eta_scale,
        inner_steps=30,
    )
    error = float("inf")
    for epoch in range(1, args.epochs + 1):
        for b in torch.randperm(len(problem.blocks)).tolist():
            pdvi.step(problem.blocks[b])
        consensus = torch.cat([pyro.param("a").detach(), pyro.param("b").detach()])
        error = float((consensus - optimum).norm() / optimum.norm())
        if error < args.tolerance:
            return epoch, error
    return None, error


def main(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(args.threads)
    torch.set_default_dtype(torch.float64)
    scales = [float(s) for s in args.eta_scales.split(",")]
    print(
        f"epochs to relative error < {args.tolerance:g} (at most {args.epochs}; final error if not reached)\n"
    )
    print("| curvatures of a, b | groups | " + " | ".join(f"eta_scale {s:g}" for s in scales) + " |")
    print("|---|---|" + "---|" * len(scales))
    rows = []
    for scale_b, groups in [(1.0, None), (10.0, None), (10.0, "per_site")]:
        problem = Quadratic(num_data=args.num_data, num_blocks=args.num_blocks, scale_b=scale_b)
        cells = []
        for eta_scale in scales:
            epochs, error = epochs_to_tolerance(problem, groups, eta_scale, args)
            rows.append(
                {
                    "scale_b": scale_b,
                    "groups": groups,
                    "eta_scale": eta_scale,
                    "epochs": epochs,
                    "error": error,
                }
            )
            cells.append(str(epochs) if epochs is not None else f"> {args.epochs} ({error:.2g})")
        label = "equal" if scale_b == 1.0 else f"{scale_b**2:g}x apart"
        print(f"| {label} | {groups or 'one (PD-VI)'} | " + " | ".join(cells) + " |")
    return rows


if __name__ == "__main__":
    main(parse_args())
