"""An experiment: PDVI's own estimate of the reduced objective's Hessian on PPCA, the locals
eliminated (:mod:`pyro_pdvi.infer.reduced_hessian`, which PDVI's saddle escape uses since 13zk),
against the exact one, at the point where a run without the escape crawls.

Why (``docs/benchmarks.md`` 13zj): PPCA's runs pass near saddles of the loadings' rotation. The
reduced objective ``G(lambda) = sum_b min_phi f_b(lambda, phi)`` has negative curvature along a
few rotations there, and an oracle escape along them (exact Hessian, in float64) halved the ELBO
gap at once. An escape inside PDVI needs those directions from what PDVI has: each block's
objective through the user's loss (Monte Carlo, at one fixed noise), its local rows as the short
solves left them, and Hessian products by double backward.

How: for block ``b`` with globals ``lambda`` and local rows ``phi`` (one row of ``r`` numbers per
datum), the reduced Hessian is the Schur complement

    H_red = H_ll - H_lp H_pp^-1 H_pl,

where ``H_pp`` is block diagonal, one ``r x r`` block per datum (a datum's rows meet other data
only through the globals): its blocks come from ``r`` Hessian products, direction ``e_k`` in every
datum's row at once. :class:`~pyro_pdvi.infer.reduced_hessian.BlockSchurComplement` checks that
with one random direction (the separability error printed), solves each datum's block
(eigenvalues clamped at 1e-6 of the largest), and takes ``H_red`` on the chosen global
coordinates from two batched products per coordinate. Summed over the blocks it is compared
with the exact reduced Hessian of :class:`benchmarks.generic_suite.references.PPCAReduced` at
the same ``lambda_0`` (``q(z)`` exact given ``q(W)``, float64), both scaled by the diagonal
``S`` of PDVI's locals-fixed Hessian (``S^-1/2 H S^-1/2``): the smallest eigenvalues, and the
principal cosines between the two negative subspaces.

With ``--lanczos-iterations`` and ``--lanczos-blocks``, also what an escape could afford instead
of the full matrix: :func:`lanczos` on the sum over that many random blocks (scaled up to all of
them), one product per iteration, and how close its most negative directions come to the full
estimate's. ::

    python benchmarks/reduced_hessian.py --seed 0 --epochs 30
    python benchmarks/reduced_hessian.py --seed 0 --epochs 30 --lanczos-iterations 20,40 \\
        --lanczos-blocks 8,40
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

from benchmarks.common import ints  # noqa: E402
from benchmarks.generic_suite.baselines import PDVI_CONFIGS, pdvi  # noqa: E402
from benchmarks.generic_suite.metrics import Scorer  # noqa: E402
from benchmarks.generic_suite.models import make_problem  # noqa: E402
from benchmarks.generic_suite.references import PPCAReduced, compute_reference  # noqa: E402
from benchmarks.generic_suite.runner import common_start  # noqa: E402
from pyro_pdvi import PDVI  # noqa: E402
from pyro_pdvi.infer.reduced_hessian import (  # noqa: E402
    lanczos,
    scaled_reduced_products,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the start and the block orders")
    parser.add_argument("--epochs", type=int, default=30, help="PDVI epochs before the measurement")
    parser.add_argument(
        "--pdvi-config",
        default="no_escape",
        choices=sorted(PDVI_CONFIGS),
        help="PDVI configuration (the defaults without their saddle escape: the point where it crawls)",
    )
    parser.add_argument("--quick", action="store_true", help="the suite's quick PPCA (400 digits, 10 blocks)")
    parser.add_argument("--site", default="W_loc", help="the global site whose reduced Hessian is measured")
    parser.add_argument(
        "--coordinates", type=int, default=None, help="the site's first this many coordinates only"
    )
    parser.add_argument(
        "--lanczos-iterations", type=ints, default=[], help="Lanczos runs of these many iterations (list)"
    )
    parser.add_argument(
        "--lanczos-blocks", type=ints, default=[], help="...each on this many random blocks, scaled up (list)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    return parser.parse_args(argv)


def block_reduced_hessian(
    algo: PDVI, block: int, coordinates: torch.Tensor, seed: int, args: tuple = ()
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Block ``block``'s reduced Hessian and its locals-fixed Hessian on ``coordinates`` of
    ``lambda_0`` (:class:`~pyro_pdvi.infer.reduced_hessian.BlockSchurComplement` with the unit
    vectors there).

    :returns: ``(H_red, H_ll)``, each ``(k, k)``, and the separability error.
    """
    schur = algo._block_schur(block, seed, args, {})
    reduced, fixed = schur.reduced(torch.eye(len(coordinates)), coordinates)
    return reduced, fixed, schur.separability


def scaled_spectrum(matrix: torch.Tensor, diagonal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues and eigenvectors of ``S^-1/2 A S^-1/2`` (``S = diag(diagonal)``), float64."""
    matrix, scale = matrix.double(), diagonal.double().clamp(min=1e-300).sqrt()
    matrix = (matrix + matrix.T) / 2
    return torch.linalg.eigh(matrix / torch.outer(scale, scale))


def lanczos_estimate(
    algo: PDVI,
    blocks: list[torch.Tensor],
    coordinates: torch.Tensor,
    diagonal: torch.Tensor,
    full_vectors: torch.Tensor,
    num_blocks: int,
    iterations: int,
    seed: int,
) -> dict:
    """The most negative directions of the scaled reduced Hessian by Lanczos on ``num_blocks``
    random blocks (their sum times ``n / num_blocks``), against the full estimate's: its CPU time
    (the blocks' graphs and local blocks included), the three most negative Ritz values, and the
    principal cosines between the Ritz vectors of the three and the full estimate's three most
    negative eigenvectors (``full_vectors``, ascending)."""
    start = time.process_time()
    chosen = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed))[:num_blocks].tolist()
    schurs = [algo._block_schur(b, seed + b, (blocks[b],), {}) for b in chosen]
    scale = diagonal.double().clamp(min=1e-300).rsqrt()
    apply = scaled_reduced_products(schurs, coordinates, scale, len(blocks) / len(chosen))
    values, ritz = lanczos(apply, len(coordinates), iterations, seed)
    seconds = time.process_time() - start
    cosines = torch.linalg.svdvals(ritz[:, :3].T @ full_vectors[:, :3].double())
    row = {"blocks": len(chosen), "iterations": iterations, "seconds": seconds, "values": values[:3]}
    row["cosines"] = cosines
    shown = " ".join(f"{float(v):.1e}" for v in values[:3])
    print(
        f"Lanczos, {iterations} iterations on {len(chosen)} blocks: {seconds:.1f} CPU s, most negative "
        f"{shown}, cosines with the full estimate's " + ", ".join(f"{float(c):.3f}" for c in cosines)
    )
    return row


def main(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    problem = make_problem("ppca", args.quick)
    reference = compute_reference(problem)
    scorer = Scorer(problem, reference)
    guide, order, blocks = common_start(problem, args.seed)
    algo = pdvi(args.pdvi_config).build(problem, guide).algo
    for epoch in range(args.epochs):
        for b in blocks if epoch == 0 else torch.randperm(len(problem.blocks), generator=order).tolist():
            algo.step(problem.blocks[b])
    gap = scorer()["elbo_gap"]
    if args.site not in algo.layout.slices:
        raise ValueError(f"--site {args.site!r} is not a global site; use one of {list(algo.layout.slices)}")
    coordinates = torch.arange(algo.layout.size)[algo.layout.slices[args.site]][: args.coordinates]

    start = time.process_time()
    reduced, fixed, worst = 0.0, 0.0, 0.0
    for b in range(len(problem.blocks)):
        block_reduced, block_fixed, separability = block_reduced_hessian(
            algo, b, coordinates, args.seed + b, (problem.blocks[b],)
        )
        reduced, fixed, worst = reduced + block_reduced, fixed + block_fixed, max(worst, separability)
    seconds = time.process_time() - start
    values, vectors = scaled_spectrum(reduced, fixed.diagonal())

    problem64 = make_problem("ppca", args.quick, dtype=torch.float64)
    exact_objective = PPCAReduced(problem64, {k: v.double() for k, v in reference.params.items()})
    point = algo._consensus_params.detach().double()  # W_loc, then W_scale unconstrained (log)
    exact = torch.autograd.functional.hessian(exact_objective.loss, point)[coordinates][:, coordinates]
    exact_values, exact_vectors = scaled_spectrum(exact, fixed.diagonal())
    negative = int((exact_values < 0).sum())
    cosines = None
    if negative:
        cosines = torch.linalg.svdvals(vectors[:, :negative].T @ exact_vectors[:, :negative])

    size = " (quick)" if args.quick else ""
    print(f"PPCA{size}, seed {args.seed}, PDVI {args.pdvi_config} after {args.epochs} epochs")
    print(f"ELBO gap {gap:.3g}; {len(problem.blocks)} blocks, {len(coordinates)} coordinates of {args.site}")
    print(f"PDVI's reduced Hessian: {seconds:.1f} CPU s, separability error at most {worst:.1e}")
    print("smallest scaled eigenvalues, PDVI:  " + " ".join(f"{float(v):.1e}" for v in values[:12]))
    print("smallest scaled eigenvalues, exact: " + " ".join(f"{float(v):.1e}" for v in exact_values[:12]))
    print(f"largest: PDVI {float(values[-1]):.2f}, exact {float(exact_values[-1]):.2f}")
    if cosines is not None:
        listed = ", ".join(f"{float(c):.3f}" for c in cosines)
        print(f"principal cosines of the {negative} negative directions: {listed}")
    lanczos_rows = [
        lanczos_estimate(
            algo, problem.blocks, coordinates, fixed.diagonal(), vectors, blocks, iterations, args.seed
        )
        for blocks in args.lanczos_blocks
        for iterations in args.lanczos_iterations
    ]
    return {
        "lanczos": lanczos_rows,
        "elbo_gap": gap,
        "seconds": seconds,
        "separability": worst,
        "eigenvalues": values,
        "exact_eigenvalues": exact_values,
        "cosines": cosines,
    }


if __name__ == "__main__":
    main(parse_args())
