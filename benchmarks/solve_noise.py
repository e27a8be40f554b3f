"""How much Monte Carlo noise PDVI's block solves leave in the consensus, per model of the generic
suite and number of particles (``PDVI.solve_noise``), in posterior standard deviations.

For each model (``benchmarks/generic_suite/models.py``) and each entry of ``--particles``
(``auto``: PDVI's own choice, ``user``: the user's ELBO as the suite gives it, or a number),
PDVI runs ``--epochs`` epochs from the suite's start, then measures the noise on ``--blocks``
blocks, per global site and in all (rms over every coordinate). Printed as a table, one row per
model and particles; with ``--out`` also written as CSV. ``docs/benchmarks.md`` 13y.

Example::

    python benchmarks/solve_noise.py --models hier,scale,biglogreg --particles auto,2,8
"""

from __future__ import annotations

import csv
import math
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyro  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import names, script_parser, setup_torch  # noqa: E402
from benchmarks.generic_suite.models import PROBLEM_NAMES, make_problem  # noqa: E402
from pyro_pdvi import PDVI  # noqa: E402


def parse_args(argv: list[str] | None = None):
    parser = script_parser(__doc__)
    parser.add_argument("--models", type=names, default=list(PROBLEM_NAMES), help="suite models, comma list")
    parser.add_argument(
        "--particles",
        type=names,
        default=["auto"],
        help="comma list: auto (PDVI's choice), user (the user's ELBO) or an even number",
    )
    parser.add_argument("--epochs", type=int, default=2, help="epochs before the measurement")
    parser.add_argument("--blocks", type=int, default=8, help="blocks measured")
    parser.add_argument("--quick", action="store_true", help="the suite's quick sizes (PPCA, GMM, biglogreg)")
    parser.add_argument("--seed", type=int, default=0, help="torch's seed")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", default=None, help="CSV file to write")
    return parser.parse_args(argv)


def measure(name: str, particles: str, args) -> dict:
    """One row: the model ``name`` after ``args.epochs`` epochs with ``particles``, its noise."""
    problem = make_problem(name, quick=args.quick)
    options = {"particles": None} if particles == "user" else {}
    if particles not in ("auto", "user"):
        options["particles"] = int(particles)
    pyro.clear_param_store()
    pyro.set_rng_seed(args.seed)
    guide = problem.make_guide()
    problem.initialise(guide, problem.blocks[0])
    pdvi = PDVI(
        problem.model,
        guide,
        pyro.optim.Adam({"lr": 0.01}),
        problem.make_loss(),
        blocks=problem.blocks,
        **options,
    )
    for _ in range(args.epochs):
        for block in problem.blocks:
            pdvi.step(block)
    start = time.process_time()
    noise = pdvi.solve_noise(problem.blocks[0], num_blocks=args.blocks)
    seconds = time.process_time() - start
    sizes = {site: pyro.param(site).numel() for site in noise}
    known = [site for site, value in noise.items() if value is not None]
    total = math.sqrt(sum(sizes[s] * noise[s] ** 2 for s in known) / sum(sizes[s] for s in known))
    used = getattr(pdvi.solve_loss.loss, "num_particles", None)
    return {"model": name, "particles": used, "loss": problem.loss_name, "noise": total, "seconds": seconds,
            "sites": noise}  # fmt: skip


def main(args) -> list[dict]:
    setup_torch(args.threads, torch.float32)
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in args.models:
            for particles in args.particles:
                row = measure(name, particles, args)
                rows.append(row)
                sites = ", ".join(
                    f"{s} {v:.3g}" if v is not None else f"{s} -" for s, v in row["sites"].items()
                )
                print(f"{name:10s} {row['particles']!s:>4} particles  noise {row['noise']:.3g}  "
                      f"({row['seconds']:.2f} s)  {sites}", flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(["model", "particles", "site", "noise"])
            for row in rows:
                writer.writerow([row["model"], row["particles"], "all", row["noise"]])
                writer.writerows([row["model"], row["particles"], s, v] for s, v in row["sites"].items())
    return rows


if __name__ == "__main__":
    main(parse_args())
