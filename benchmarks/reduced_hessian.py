"""An experiment, not part of PDVI: PDVI's own estimate of the reduced objective's Hessian on
PPCA, the locals eliminated, against the exact one, at the point where a default run crawls.

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
datum's row at once. :func:`block_reduced_hessian` checks that with one random direction (the
separability error printed), solves each datum's block (eigenvalues clamped at 1e-6 of the
largest), and takes ``H_red`` on the chosen global coordinates from two batched products per
coordinate. Summed over the blocks it is compared with the exact reduced Hessian of
:class:`benchmarks.generic_suite.references.PPCAReduced` at the same ``lambda_0`` (``q(z)`` exact
given ``q(W)``, float64), both scaled by the diagonal of PDVI's locals-fixed Hessian (``S^-1/2 H
S^-1/2``, the units of the natural rule's step sizes): the smallest eigenvalues, and the principal
cosines between the two negative subspaces. ::

    python benchmarks/reduced_hessian.py --seed 0 --epochs 30
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

from benchmarks.generic_suite.baselines import PDVI_CONFIGS, pdvi  # noqa: E402
from benchmarks.generic_suite.metrics import Scorer  # noqa: E402
from benchmarks.generic_suite.models import make_problem  # noqa: E402
from benchmarks.generic_suite.references import PPCAReduced, compute_reference  # noqa: E402
from benchmarks.generic_suite.runner import common_start  # noqa: E402
from pyro_pdvi import PDVI  # noqa: E402
from pyro_pdvi.infer.hessian_products import hessian_products  # noqa: E402

#: A datum's local Hessian block is solved with its eigenvalues at least this fraction of its largest.
LOCAL_EIGENVALUE_FLOOR = 1e-6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the start and the block orders")
    parser.add_argument("--epochs", type=int, default=30, help="PDVI epochs before the measurement")
    parser.add_argument(
        "--pdvi-config", default="defaults", choices=sorted(PDVI_CONFIGS), help="PDVI configuration"
    )
    parser.add_argument("--quick", action="store_true", help="the suite's quick PPCA (400 digits, 10 blocks)")
    parser.add_argument("--site", default="W_loc", help="the global site whose reduced Hessian is measured")
    parser.add_argument(
        "--coordinates", type=int, default=None, help="the site's first this many coordinates only"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    return parser.parse_args(argv)


def block_reduced_hessian(
    algo: PDVI, block: int, coordinates: torch.Tensor, seed: int, args: tuple = ()
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Block ``block``'s reduced Hessian and its locals-fixed Hessian on ``coordinates`` of
    ``lambda_0``, at its current local rows and the noise of ``seed`` (module docstring).

    :param algo: a PDVI that has taken steps (its param store holds the rows).
    :param block: the block's index.
    :param coordinates: flat global coordinates, ``(k,)``.
    :param seed: the Monte Carlo noise of the block's objective.
    :param args: the arguments of model and guide at the block's steps.
    :returns: ``(H_red, H_ll)``, each ``(k, k)``, and the relative error of the block-diagonal
        local Hessian on a random direction (0 where the rows are separable by datum).
    """
    point = algo._consensus_params.detach()
    size = point.numel()
    indices = algo.partition.stacked(torch.tensor([block]), algo.device)
    losses = algo._objective.bind(indices, [seed], args, {})
    rows = algo._params.rows(indices)
    names = list(rows)
    num_data = indices.shape[-1]
    widths = [rows[name][0, 0].numel() for name in names]
    width = sum(widths)
    joint = torch.cat([point, torch.cat([rows[n].reshape(num_data, -1) for n in names], 1).reshape(-1)])
    joint = joint.detach().requires_grad_()

    def split(flat: torch.Tensor) -> tuple[dict, dict]:
        local = flat[size:].reshape(num_data, width).split(widths, dim=1)
        copies = {k: v.unsqueeze(0) for k, v in algo.layout.unflatten(flat[:size]).items()}
        return copies, {n: part.reshape(rows[n].shape) for n, part in zip(names, local)}

    (gradient,) = torch.autograd.grad(losses(*split(joint)).sum(), joint, create_graph=True)

    def products(local_directions: torch.Tensor | None, global_directions: torch.Tensor | None):
        """``H`` times directions given by their global and local parts, each ``(m, ...)``."""
        count = len(local_directions if local_directions is not None else global_directions)
        directions = joint.new_zeros(count, joint.numel())
        if global_directions is not None:
            directions[:, :size] = global_directions
        if local_directions is not None:
            directions[:, size:] = local_directions.reshape(count, -1)
        result = hessian_products(gradient, joint, directions)
        return result[:, :size], result[:, size:].reshape(count, num_data, width)

    # Column k of every datum's local block, from one direction per k.
    unit_rows = torch.eye(width).to(joint).unsqueeze(1).expand(width, num_data, width)
    _, columns = products(unit_rows, None)
    local_blocks = columns.permute(1, 2, 0)  # (data, row, column)
    local_blocks = (local_blocks + local_blocks.mT) / 2
    probe = torch.randn(1, num_data, width, generator=torch.Generator().manual_seed(seed)).to(joint)
    _, exact = products(probe, None)
    blockwise = (local_blocks @ probe[0].unsqueeze(-1)).squeeze(-1)
    separability = float((exact[0] - blockwise).norm() / exact[0].norm())
    values, vectors = torch.linalg.eigh(local_blocks)
    floor = LOCAL_EIGENVALUE_FLOOR * values.amax(-1, keepdim=True).clamp(min=torch.finfo(values.dtype).tiny)
    inverse = vectors @ torch.diag_embed(1 / values.maximum(floor)) @ vectors.mT

    unit_globals = torch.zeros(len(coordinates), size).to(joint)
    unit_globals[torch.arange(len(coordinates)), coordinates] = 1.0
    globals_part, locals_part = products(None, unit_globals)
    solved = (inverse.unsqueeze(0) @ locals_part.unsqueeze(-1)).squeeze(-1)  # H_pp^-1 H_pl e_j
    coupling, _ = products(solved, None)
    fixed = globals_part[:, coordinates]
    return fixed - coupling[:, coordinates], fixed, separability


def scaled_spectrum(matrix: torch.Tensor, diagonal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues and eigenvectors of ``S^-1/2 A S^-1/2`` (``S = diag(diagonal)``), float64."""
    matrix, scale = matrix.double(), diagonal.double().clamp(min=1e-300).sqrt()
    matrix = (matrix + matrix.T) / 2
    return torch.linalg.eigh(matrix / torch.outer(scale, scale))


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
    return {
        "elbo_gap": gap,
        "seconds": seconds,
        "separability": worst,
        "eigenvalues": values,
        "exact_eigenvalues": exact_values,
        "cosines": cosines,
    }


if __name__ == "__main__":
    main(parse_args())
