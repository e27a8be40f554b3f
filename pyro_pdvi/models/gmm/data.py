"""Synthetic mixture data in non-i.i.d. blocks, as in the paper's experiment [1, App. C.2].

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...checks import check_positive_int
from .prior import GMMPrior


class BiasedGMMData(NamedTuple):
    """What :func:`make_biased_gmm` returns.

    :param data: ``x``, shape ``(N, d)``.
    :param labels: the true component of each datum, shape ``(N,)``.
    :param centers: the true centres ``c_k``, shape ``(K, d)``.
    :param blocks: 1-D LongTensors (sorted) that partition ``range(N)``.
    :param prior: the hyperparameters the data were drawn with.
    """

    data: torch.Tensor
    labels: torch.Tensor
    centers: torch.Tensor
    blocks: list[torch.Tensor]
    prior: GMMPrior


def make_biased_gmm(
    num_data: int,
    num_components: int,
    dim: int,
    block_size: int,
    purity: float,
    seed: int = 0,
    separation: float = 1.0,
    dtype: torch.dtype = torch.float64,
) -> BiasedGMMData:
    """Synthetic mixture data in blocks that each hold mostly one cluster [1, App. C.2].

    The truth is ``xi = 0``, ``sigma0_sq = 1`` and ``sigma1_sq = separation**2`` in every
    coordinate; the centres are drawn from the prior ``N(xi, diag(sigma1_sq))``. The data
    are cut into ``ceil(N / block_size)`` blocks (the last one smaller if ``block_size``
    does not divide ``N``). Block ``b`` is dominated by cluster ``b mod K``: a number
    ``round(purity * |b|)`` of its points come from that cluster and the rest from the
    other ``K - 1`` clusters uniformly, so the measured purity is ``purity`` up to
    rounding (with ``K = 1`` every block is pure). The clusters are therefore equally
    frequent up to rounding (exactly when the number of blocks is a multiple of K and
    every block has the same size) instead of multinomially; given its label each ``x_i``
    is drawn exactly from the model. Indices are assigned to blocks by a random
    permutation, so blocks are not contiguous ranges.

    :param num_data: N.
    :param num_components: K.
    :param dim: d.
    :param block_size: size of every block but possibly the last.
    :param purity: fraction of each block from its dominant cluster, in ``[0, 1]``;
        1.0 gives pure blocks.
    :param seed: seed of a private :class:`torch.Generator`; the global RNG is untouched.
    :param separation: prior standard deviation of the centres in units of the
        observation standard deviation.
    :param dtype: floating dtype of the data.
    :returns: data, labels, centres, blocks and the true prior.
    :rtype: BiasedGMMData
    """
    for name, value in (
        ("num_data", num_data),
        ("num_components", num_components),
        ("dim", dim),
        ("block_size", block_size),
    ):
        check_positive_int(value, name)
    if not 0.0 <= purity <= 1.0:
        raise ValueError(f"Invalid purity: {purity}; use a fraction in [0, 1]")
    if not separation > 0:
        raise ValueError(f"Invalid separation: {separation}; use a positive float")
    generator = torch.Generator().manual_seed(seed)
    prior = GMMPrior(
        xi=torch.zeros(dim, dtype=dtype),
        sigma0_sq=torch.ones(dim, dtype=dtype),
        sigma1_sq=torch.full((dim,), float(separation) ** 2, dtype=dtype),
        num_components=num_components,
    )
    centers = prior.xi + prior.sigma1_sq.sqrt() * torch.randn(
        num_components, dim, generator=generator, dtype=dtype
    )

    order = torch.randperm(num_data, generator=generator)
    labels = torch.empty(num_data, dtype=torch.long)
    blocks = []
    for b, start in enumerate(range(0, num_data, block_size)):
        members = order[start : start + block_size]
        size = len(members)
        dominant = b % num_components
        block_labels = torch.full((size,), dominant, dtype=torch.long)
        num_dominant = round(purity * size)
        if num_components > 1 and num_dominant < size:
            offsets = torch.randint(1, num_components, (size - num_dominant,), generator=generator)
            block_labels[num_dominant:] = (dominant + offsets) % num_components
        labels[members] = block_labels[torch.randperm(size, generator=generator)]
        blocks.append(members.sort().values)
    noise = torch.randn(num_data, dim, generator=generator, dtype=dtype)
    data = centers[labels] + prior.sigma0_sq.sqrt() * noise
    return BiasedGMMData(data, labels, centers, blocks, prior)
