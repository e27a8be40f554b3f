"""The reduced objective's Hessian in the globals, the locals eliminated per datum, and its most
negative directions by Lanczos.

PDVI's fixed point is a stationary point of the reduced objective ``G(lambda) = sum_b min_phi
f_b(lambda, phi)``. Where a model has a latent per datum, ``G`` can have saddles that the
consensus iteration leaves only slowly (PPCA's loadings' rotation: ``docs/benchmarks.md`` 13zj):
there its Hessian has negative eigenvalues. For block ``b`` with globals ``lambda`` and rows
``phi`` (``r`` numbers per datum) it is the Schur complement

    H_red = H_ll - H_lp H_pp^-1 H_pl,

where ``H_pp`` is block diagonal, one ``r x r`` block per datum (a datum's rows meet other data
only through the globals): its blocks come from ``r`` Hessian products, direction ``e_k`` in
every datum's row at once. :class:`BlockSchurComplement` takes them by double backward through
one evaluation of the block's objective at a fixed noise, solves each datum's block
(eigenvalues clamped at :data:`LOCAL_EIGENVALUE_FLOOR` of its largest) and gives ``H_red``
times directions in the globals from two batched products each. :func:`lanczos` finds the
smallest eigenvalues of the sum over the blocks, scaled (:func:`scaled_reduced_products`).

Tested against the hierarchical normal model's exact ``N / (tau^2 + sigma^2) + 1 / s0^2``
(1e-9); on PPCA its most negative directions matched the exact reduced Hessian's (principal
cosines 1.000, 0.987, 0.977; 13zj).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .hessian_products import hessian_products
from .objective import BlockLosses
from .sites import GlobalLayout

#: A datum's local Hessian block is solved with its eigenvalues at least this fraction of its largest.
LOCAL_EIGENVALUE_FLOOR = 1e-6


class BlockSchurComplement:
    """One block's Hessian at ``point`` and its ``rows``, at the noise ``losses`` were bound to,
    with the locals eliminated (module docstring): products with directions in the globals.

    :param losses: the block's objective (:meth:`~pyro_pdvi.infer.objective.BlockObjective.bind`
        with one block).
    :param layout: the flat layout of the global params.
    :param point: ``lambda``, flat, in the params' coordinates.
    :param rows: the block's rows of every local site, ``(1, data, ...)`` each.
    :attr local_inverse: ``H_pp^-1``, one ``(r, r)`` block per datum.
    """

    def __init__(
        self, losses: BlockLosses, layout: GlobalLayout, point: torch.Tensor, rows: dict[str, torch.Tensor]
    ) -> None:
        self.size = point.numel()
        names = list(rows)
        self.num_data = next(iter(rows.values())).shape[1]
        widths = [rows[name][0, 0].numel() for name in names]
        self.width = sum(widths)
        local = torch.cat([rows[n].reshape(self.num_data, -1) for n in names], 1).reshape(-1)
        self.joint = torch.cat([point.detach(), local.to(point)]).requires_grad_()

        def split(flat: torch.Tensor) -> tuple[dict, dict]:
            parts = flat[self.size :].reshape(self.num_data, self.width).split(widths, dim=1)
            copies = {k: v.unsqueeze(0) for k, v in layout.unflatten(flat[: self.size]).items()}
            return copies, {n: part.reshape(rows[n].shape) for n, part in zip(names, parts)}

        loss = losses(*split(self.joint)).sum()
        (self.gradient,) = torch.autograd.grad(loss, self.joint, create_graph=True)
        # Column k of every datum's local block, from one direction per k.
        unit_rows = torch.eye(self.width).to(self.joint).unsqueeze(1).expand(-1, self.num_data, -1)
        _, columns = self.products(unit_rows, None)
        local_blocks = columns.permute(1, 2, 0)  # (data, row, column)
        local_blocks = (local_blocks + local_blocks.mT) / 2
        self._local_blocks, self._seed = local_blocks, losses.seeds[0]
        values, vectors = torch.linalg.eigh(local_blocks)
        largest = values.amax(-1, keepdim=True).clamp(min=torch.finfo(values.dtype).tiny)
        floor = LOCAL_EIGENVALUE_FLOOR * largest
        self.local_inverse = vectors @ torch.diag_embed(1 / values.maximum(floor)) @ vectors.mT

    @property
    def separability(self) -> float:
        """The relative error of the block-diagonal local Hessian on one random direction (0 where
        the rows are separable by datum, as a model with a plate makes them): one more product,
        taken only when asked for."""
        generator = torch.Generator().manual_seed(self._seed % 2**63)
        probe = torch.randn(1, self.num_data, self.width, generator=generator).to(self.joint)
        _, exact = self.products(probe, None)
        blockwise = (self._local_blocks @ probe[0].unsqueeze(-1)).squeeze(-1)
        return float((exact[0] - blockwise).norm() / exact[0].norm().clamp(min=1e-300))

    def products(
        self, local_directions: torch.Tensor | None, global_directions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The joint Hessian times directions given by their global part ``(m, P)`` and local part
        ``(m, data, r)`` (either may be ``None``: zero); the products' two parts alike."""
        count = len(local_directions if local_directions is not None else global_directions)
        directions = self.joint.new_zeros(count, self.joint.numel())
        if global_directions is not None:
            directions[:, : self.size] = global_directions
        if local_directions is not None:
            directions[:, self.size :] = local_directions.reshape(count, -1)
        result = hessian_products(self.gradient, self.joint, directions)
        return result[:, : self.size], result[:, self.size :].reshape(count, self.num_data, self.width)

    def row_moves(self, global_move: torch.Tensor) -> torch.Tensor:
        """``-H_pp^-1 H_pl v``: how each datum's rows follow a move ``v`` of the globals (flat,
        ``(P,)``) to first order, ``(data, r)`` (the implicit-function direction)."""
        _, coupled = self.products(None, global_move.to(self.joint).unsqueeze(0))
        return -(self.local_inverse @ coupled[0].unsqueeze(-1)).squeeze(-1)

    def reduced(
        self, directions: torch.Tensor, coordinates: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(H_red V, H_ll V)`` on ``coordinates`` for directions ``V`` there, ``(m, k)`` each."""
        embedded = self.joint.new_zeros(len(directions), self.size)
        embedded[:, coordinates] = directions.to(self.joint)
        globals_part, locals_part = self.products(None, embedded)
        solved = (self.local_inverse.unsqueeze(0) @ locals_part.unsqueeze(-1)).squeeze(-1)  # H_pp^-1 H_pl v
        coupling, _ = self.products(solved, None)
        fixed = globals_part[:, coordinates]
        return fixed - coupling[:, coordinates], fixed


def lanczos(
    apply: Callable[[torch.Tensor], torch.Tensor],
    dimension: int,
    iterations: int,
    seed: int,
    start: torch.Tensor | None = None,
    stop_below: float = -math.inf,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ritz values (ascending) and vectors ``(dimension, m)`` of a symmetric operator after
    ``iterations`` Lanczos steps from ``start`` or a random start, fully reorthogonalised
    (float64).

    :param apply: ``v -> A v`` for ``v`` of shape ``(dimension,)``.
    :param dimension: the operator's dimension.
    :param iterations: the most Lanczos steps (fewer where the Krylov space is exhausted).
    :param seed: the random start's seed.
    :param start: the first Krylov vector (any norm); a draw of ``seed`` where ``None`` or zero.
    :param stop_below: stop as soon as a Ritz value is below this: the operator's smallest
        eigenvalue is then below it too (Ritz values lie within the spectrum).
    """
    basis = torch.zeros(dimension, iterations, dtype=torch.float64)
    if start is None or not bool(start.norm() > 0):
        vector = torch.randn(dimension, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    else:
        vector = start.detach().double().cpu().clone()
    alphas, betas = [], []
    for i in range(iterations):
        basis[:, i] = vector / vector.norm()
        image = apply(basis[:, i]).double().cpu()
        alphas.append(float(basis[:, i] @ image))
        image = image - basis[:, : i + 1] @ (basis[:, : i + 1].T @ image)
        image = image - basis[:, : i + 1] @ (basis[:, : i + 1].T @ image)
        beta = float(image.norm())
        below = float(torch.linalg.eigvalsh(_tridiagonal(alphas, betas))[0]) < stop_below
        if i + 1 == iterations or beta < 1e-12 or below:
            basis = basis[:, : i + 1]
            break
        betas.append(beta)
        vector = image
    values, small = torch.linalg.eigh(_tridiagonal(alphas, betas))
    return values, basis @ small


def _tridiagonal(alphas: list[float], betas: list[float]) -> torch.Tensor:
    """Lanczos's tridiagonal matrix from its diagonal and the first ``len(alphas) - 1`` of its
    off-diagonal entries."""
    tridiagonal = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if len(alphas) > 1:
        off = torch.tensor(betas[: len(alphas) - 1], dtype=torch.float64)
        tridiagonal += torch.diag(off, 1) + torch.diag(off, -1)
    return tridiagonal


def scaled_reduced_products(
    schurs: list[BlockSchurComplement], coordinates: torch.Tensor, scale: torch.Tensor, weight: float = 1.0
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``v -> weight S^1/2 (sum_b H_red,b) S^1/2 v`` on ``coordinates`` (``S^1/2 = diag(scale)``),
    float64 on the CPU: the operator that :func:`lanczos` takes."""
    scale = scale.double().cpu()

    def apply(vector: torch.Tensor) -> torch.Tensor:
        direction = (scale * vector).unsqueeze(0)
        total = sum(schur.reduced(direction, coordinates)[0][0].double().cpu() for schur in schurs)
        return weight * scale * total

    return apply
