"""An experiment: an escape from a saddle of PPCA's reduced objective built from what PDVI has,
then PDVI going on, with knobs that PDVI's own escape (:mod:`pyro_pdvi.infer.saddle_escape`,
since 13zk, on by default) fixes. Its runs use ``--pdvi-config no_escape``, PDVI without it.

Why (``docs/benchmarks.md`` 13zj): PDVI's default run on PPCA stalls near a saddle of the
loadings' rotation. An exact escape (the reduced Hessian of the benchmark's closed form) halved
the ELBO gap at once, and PDVI went on from there to a gap 3.3x smaller after 30 more epochs.
This script does the same from PDVI's own quantities:

1. after ``--epochs-before`` epochs of PDVI (the suite's start and block orders), the
   reduced Hessian on the global coordinates that the solves move (PPCA's ``W_loc``; the locals
   eliminated per datum:
   :class:`pyro_pdvi.infer.reduced_hessian.BlockSchurComplement`), over every block, scaled: in full
   (``--hessian full``, scaled by its locals-fixed diagonal) or by ``--lanczos-iterations``
   Lanczos steps (``--hessian lanczos``, scaled by the guide's Fisher information, ``--scale
   fisher``, or by the step sizes, ``--scale step-sizes``);
2. along each negative direction in turn, the best of the ``--steps`` (both signs), each trial
   point scored by the blocks' own objectives at one common noise, with every block's rows
   carried along ``-H_pp^-1 H_pl v`` and then solved with ``--inner-steps`` evaluations by PDVI's
   solver at that point;
3. ``lambda_0``, every copy and the rows moved there, each block's dual by minus the change of
   its gradient less the mean change, as PDVI's escape does since 13zm (``--keep-duals``: the
   duals kept, as in 13zj-13zk);

for at most ``--rounds`` rounds, or until no negative curvature is left; then ``--epochs-after``
epochs of PDVI from its own state. Printed: the ELBO gap before, after each round and every 5
epochs after, each with the CPU seconds of PDVI's epochs and the escape so far (the scoring
against the reference left out), and each round's seconds by part. ``--rounds 0`` runs PDVI
alone, for a comparison at equal CPU seconds (with ``--pdvi-config defaults``: PDVI with its own
escape). With ``--lanczos-start drift`` Lanczos starts from
``lambda_0``'s displacement over the last ``--drift-lag`` epochs (13zk: it points mostly along
the negative directions), and 20 iterations do what 60 from a random start did. ``--model
odlogit`` measures what the check costs a model with a latent per datum and no saddle. ::

    python benchmarks/saddle_escape.py --seed 0 --hessian full --rounds 3
    python benchmarks/saddle_escape.py --seed 0 --hessian lanczos --scale fisher --steps 0.03,0.3,3
    python benchmarks/saddle_escape.py --seed 0 --epochs-before 20 --epochs-after 40 --hessian lanczos \
        --lanczos-start drift --drift-lag 10 --lanczos-iterations 20 --steps 1 --inner-steps 3 --rounds 2
    python benchmarks/saddle_escape.py --seed 0 --epochs-before 20 --epochs-after 60 --rounds 0
    python benchmarks/saddle_escape.py --seed 0 --epochs-before 20 --epochs-after 40 --rounds 0 \
        --pdvi-config defaults
    python benchmarks/saddle_escape.py --model ppca_cancer --epochs-before 20 --epochs-after 5 \
        --hessian lanczos --lanczos-start drift --lanczos-iterations 20 --steps 1 --inner-steps 3 --rounds 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: import this checkout's benchmarks and pyro_pdvi, not an installed copy.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import floats  # noqa: E402
from benchmarks.generic_suite.baselines import PDVI_CONFIGS, pdvi  # noqa: E402
from benchmarks.generic_suite.metrics import Scorer  # noqa: E402
from benchmarks.generic_suite.models import make_problem  # noqa: E402
from benchmarks.generic_suite.references import compute_reference  # noqa: E402
from benchmarks.generic_suite.runner import common_start  # noqa: E402
from benchmarks.reduced_hessian import scaled_spectrum  # noqa: E402
from pyro_pdvi import PDVI  # noqa: E402
from pyro_pdvi.infer.reduced_hessian import (  # noqa: E402
    BlockSchurComplement,
    lanczos,
    scaled_reduced_products,
)
from pyro_pdvi.infer.saddle_escape import TrialScorer, moved_coordinates  # noqa: E402

#: The blocks' noise seeds of the line search (one fixed noise per block, common to every trial).
TRIAL_SEED = 5000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the start and the block orders")
    parser.add_argument(
        "--model",
        choices=("ppca", "ppca_cancer", "odlogit"),
        default="ppca",
        help="a suite model with a latent per datum",
    )
    parser.add_argument("--quick", action="store_true", help="the suite's quick size")
    parser.add_argument(
        "--pdvi-config",
        default="no_escape",
        choices=sorted(PDVI_CONFIGS),
        help="PDVI's configuration; 'defaults' checks for saddles itself (at epoch 20, then 40, ...)",
    )
    parser.add_argument("--epochs-before", type=int, default=30, help="PDVI epochs before the escape")
    parser.add_argument("--epochs-after", type=int, default=30, help="PDVI epochs after it")
    parser.add_argument(
        "--hessian", choices=("full", "lanczos"), default="full", help="how the directions are found"
    )
    parser.add_argument("--lanczos-iterations", type=int, default=60, help="with --hessian lanczos")
    parser.add_argument(
        "--lanczos-start",
        choices=("random", "drift"),
        default="random",
        help="Lanczos's first vector: a random one, or lambda_0's displacement over the last --drift-lag "
        "epochs before the escape (in the scaled coordinates)",
    )
    parser.add_argument("--drift-lag", type=int, default=10, help="with --lanczos-start drift")
    parser.add_argument(
        "--scale", choices=("fisher", "step-sizes"), default="fisher", help="Lanczos's scaling"
    )
    parser.add_argument(
        "--steps", type=floats, default=[0.01, 0.03, 0.1, 0.3, 1.0, 3.0], help="trial step lengths (list)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="most rounds (0: PDVI alone, for comparison)")
    parser.add_argument(
        "--inner-steps", type=int, default=20, help="evaluations of a trial point's local solves"
    )
    parser.add_argument(
        "--keep-duals", action="store_true", help="keep the duals across the jump (13zj-13zk's runs)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    if args.epochs_before < 1:
        parser.error("--epochs-before must be at least 1: the escape moves a state that every block has made")
    if args.lanczos_start == "drift" and args.hessian != "lanczos":
        parser.error("--lanczos-start drift needs --hessian lanczos")
    if args.lanczos_start == "drift" and not 1 <= args.drift_lag <= args.epochs_before:
        parser.error("--drift-lag must be between 1 and --epochs-before")
    return args


def negative_directions(
    algo: PDVI,
    schurs: list[BlockSchurComplement],
    coordinates: torch.Tensor,
    args: argparse.Namespace,
    seed: int,
    drift: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The reduced Hessian's negative directions on ``coordinates`` (unit norm, most negative
    first) and its smallest scaled eigenvalues or Ritz values; Lanczos starts from ``drift`` (in
    the params' coordinates, scaled here) where one is given."""
    if args.hessian == "full":
        unit = torch.eye(len(coordinates))
        reduced, fixed = (sum(parts) for parts in zip(*(s.reduced(unit, coordinates) for s in schurs)))
        scale = fixed.diagonal().double().clamp(min=1e-300).rsqrt()
        values, vectors = scaled_spectrum(reduced, fixed.diagonal())
    else:
        if args.scale == "fisher":
            scale = algo._step_sizes.fisher[coordinates].double().clamp(min=1e-300).rsqrt()
        else:
            scale = algo._state.step_sizes[coordinates].double().sqrt()
        apply = scaled_reduced_products(schurs, coordinates, scale)
        start = None if drift is None else drift.double() / scale
        values, vectors = lanczos(apply, len(coordinates), args.lanczos_iterations, seed, start)
    directions = [scale * vectors[:, j] for j in range(int((values < 0).sum()))]
    return [(d / d.norm()).float() for d in directions], values


def main(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(args.threads)
    problem = make_problem(args.model, args.quick)
    scorer = Scorer(problem, compute_reference(problem))
    guide, order, first = common_start(problem, args.seed)
    algo = pdvi(args.pdvi_config).build(problem, guide).algo
    num_blocks = len(problem.blocks)
    rows: list[dict] = []
    consensus_by_epoch: list[torch.Tensor] = []
    clock = [0.0]  # CPU seconds of PDVI's epochs and the escape, the scoring left out

    def run(epochs: int, label: str, first_order: list[int] | None = None) -> None:
        for epoch in range(epochs):
            started = time.process_time()
            for b in (
                first_order
                if epoch == 0 and first_order
                else torch.randperm(num_blocks, generator=order).tolist()
            ):
                algo.step(problem.blocks[b])
            consensus_by_epoch.append(algo._consensus_params.detach().clone())
            clock[0] += time.process_time() - started
            if (epoch + 1) % 5 == 0 or epoch + 1 == epochs:
                gap = scorer()["elbo_gap"]
                rows.append({"stage": label, "epoch": epoch + 1, "elbo_gap": gap, "cpu_seconds": clock[0]})
                print(f"{label}, epoch {epoch + 1}: ELBO gap {gap:.3e}, {clock[0]:.1f} CPU s", flush=True)

    run(args.epochs_before, "before", first)
    coordinates = moved_coordinates(algo)
    drift = None
    if args.lanczos_start == "drift":
        drift = (consensus_by_epoch[-1] - consensus_by_epoch[-1 - args.drift_lag])[coordinates]
    seconds = 0.0  # the escape's CPU seconds, the scoring against the reference left out
    for round_ in range(args.rounds):
        round_start = time.process_time()
        schurs = [algo._block_schur(b, args.seed + b, (problem.blocks[b],), {}) for b in range(num_blocks)]
        built = time.process_time()
        directions, values = negative_directions(algo, schurs, coordinates, args, args.seed + round_, drift)
        curved = time.process_time()
        shown = ", ".join(f"{float(v):.1e}" for v in values[:5])
        print(
            f"round {round_ + 1}: {len(directions)} negative directions; smallest {shown} "
            f"(CPU s: local blocks {built - round_start:.1f}, curvature {curved - built:.1f})",
            flush=True,
        )
        if not directions:
            seconds += curved - round_start
            clock[0] += curved - round_start
            print(f"no negative curvature left: {seconds:.0f} CPU s in all", flush=True)
            break
        block_args = {b: ((problem.blocks[b],), {}) for b in range(num_blocks)}
        trial_seeds = [TRIAL_SEED + b for b in range(num_blocks)]
        score = TrialScorer(algo, schurs, block_args, trial_seeds, args.inner_steps)
        point = score.point
        best_value, solved = score(point)
        first_value, best = best_value, point
        taken = []  # the step taken along each direction (signed; 0 where none was better)
        for direction in directions:
            embedded = torch.zeros_like(point)
            embedded[coordinates] = direction
            base, step = best, 0.0
            for sign in (1.0, -1.0):
                for length in args.steps:
                    trial = base + sign * length * embedded
                    value, trial_rows = score(trial)
                    if value < best_value:
                        best_value, best, solved, step = value, trial, trial_rows, sign * length
            taken.append(step)
        shift = None if args.keep_duals else score.dual_shift(best, solved, coordinates)
        searched = time.process_time()
        algo._translate(best - point, solved, shift)
        gap = scorer()["elbo_gap"]
        seconds += searched - round_start
        clock[0] += searched - round_start
        rows.append({"stage": "escape", "epoch": round_ + 1, "elbo_gap": gap, "seconds": seconds})
        print(
            f"after round {round_ + 1}: objective {best_value - first_value:+.1f} nats, ELBO gap {gap:.3e}, "
            f"steps {taken}, line search {searched - curved:.1f} CPU s ({score.calls} points), "
            f"{seconds:.0f} CPU s so far",
            flush=True,
        )
    run(args.epochs_after, "after")
    return rows


if __name__ == "__main__":
    main(parse_args())
