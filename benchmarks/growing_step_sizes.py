"""An experiment, not an option of PDVI: the rising-objective safeguard also *grows* every step
size while the objective keeps falling (a "bold driver" over epochs), on the generic suite.

Why (``docs/benchmarks.md`` 13zh): on PPCA the ELBO gap crawls after about 5 s (a nearly flat
valley that rotates the loadings and every latent together), and a looser penalty crawls faster
there but is slower in the first seconds. This script lets the step sizes start at the defaults
and grow: after every epoch in which the safeguard's objective fell for ``--after`` epochs in a
row, from epoch ``--start`` on, every step size is multiplied by ``--factor``, up to ``--cap``
times its rule's; the first halving by the safeguard (two rises in a row) stops the growth for
the rest of the run. PDVI applies the change as it applies the safeguard's halving (``h = H
mean(mu)`` moves ``lambda_0``; the fixed point is kept).

Every other argument is ``benchmarks/suite.py``'s; its PDVI configurations run with the growth::

    python benchmarks/growing_step_sizes.py --factor 1.19 --after 1 --cap 16 -- \\
        --models ppca --seeds 0,1,2 --budget-seconds 20 --svi-lrs "" --decay-lr 0 \\
        --pdvi-configs defaults --eta-grid "" --no-plots --out results/growing
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: import this checkout's benchmarks and pyro_pdvi, not an installed copy.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import suite  # noqa: E402
from pyro_pdvi.infer.safeguard import RisingObjectiveGuard  # noqa: E402


class GrowingGuard(RisingObjectiveGuard):
    """The safeguard, which also multiplies the damping by ``factor`` after ``after`` falling
    epochs in a row (from epoch ``start``, up to ``cap``), until its first halving."""

    factor = 2.0
    after = 2
    start = 3
    cap = 16.0

    def __init__(self, monte_carlo: bool = False) -> None:
        super().__init__(monte_carlo)
        self.falls = 0  # falling epochs in a row
        self.stopped = False  # halved once: no more growth

    def end_epoch(self) -> bool:
        if super().end_epoch():
            self.stopped = True
            return True
        fell = len(self.epochs) >= 2 and self.epochs[-1] < self.epochs[-2]
        self.falls = self.falls + 1 if fell else 0
        grows = len(self.epochs) >= self.start and self.falls >= self.after
        if grows and self.damping * self.factor <= self.cap and not self.stopped:
            self.damping *= self.factor
            self.falls = 0
            return True  # PDVI then applies the new damping (and warns as for a halving)
        return False


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """This script's options before ``--``; the suite's after it (``suite_args``)."""
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--factor", type=float, default=GrowingGuard.factor, help="growth per growing epoch")
    parser.add_argument("--after", type=int, default=GrowingGuard.after, help="falling epochs in a row")
    parser.add_argument("--start", type=int, default=GrowingGuard.start, help="first epoch that may grow")
    parser.add_argument("--cap", type=float, default=GrowingGuard.cap, help="largest damping")
    args = parser.parse_args(argv[:split])
    args.suite_args = argv[split + 1 :]
    return args


def main(args: argparse.Namespace) -> dict:
    GrowingGuard.factor, GrowingGuard.after = args.factor, args.after
    GrowingGuard.start, GrowingGuard.cap = args.start, args.cap
    # PDVI builds its guard by this name (pyro_pdvi/infer/pdvi.py).
    import pyro_pdvi.infer.pdvi as pdvi_module

    pdvi_module.RisingObjectiveGuard = GrowingGuard
    try:
        return suite.main(suite.parse_args(args.suite_args))
    finally:
        pdvi_module.RisingObjectiveGuard = RisingObjectiveGuard


if __name__ == "__main__":
    main(parse_args())
