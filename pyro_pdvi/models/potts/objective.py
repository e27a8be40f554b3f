"""The Potts mixture's exact mean-field objective [1, App. C.1] and its block share ``f_b``.

Model, with the mixture of :mod:`pyro_pdvi.models.gmm` and a graph ``E`` with weights ``r_ij``::

    c_k ~ N(xi, diag(sigma1_sq))                                   (global)
    p(zeta) ∝ exp( sum_{(i,j) in E} r_ij 1[zeta_i = zeta_j] )      (Potts prior, local)
    x_i | zeta_i, c ~ N(c_{zeta_i}, diag(sigma0_sq))

Mean-field family ``q(c_kj) = N(m_kj, exp(rho_kj))``, ``q(zeta_i) = Categorical(softmax(alpha_i))``.
The exact negative ELBO is the mixture's (:func:`pyro_pdvi.models.gmm.negative_elbo`) minus
the Potts energy ``sum_{(i,j) in E} r_ij <phi_i, phi_j>`` (:func:`potts_energy`), up to the
constant ``log Z(r) - N log K`` (the mixture's objective carries ``-E log(1/K)`` per spot).

PD-VI blocks are fixed spatial patches [1, Sec. 5]. The block objective ``f_b``
(:func:`potts_block_negative_elbo`) is the mixture's block share minus the energy of the
edges *inside* the patch, so the ``f_b`` add up to the objective on the graph with the
edges between patches dropped (:meth:`~pyro_pdvi.models.potts.SpatialGraph.restrict`), as
in the authors' code: a block's subproblem then depends on its own spots only, which is
what makes the blocks independent given ``lambda_0`` (the consensus form of [1, eq. 2]).

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
"""

from __future__ import annotations

import torch

from ..gmm import GMMPrior, block_negative_elbo, negative_elbo
from .graph import SpatialGraph


def potts_energy(graph: SpatialGraph, phi: torch.Tensor) -> torch.Tensor:
    """``sum_{(i,j) in E} r_ij sum_k phi_ik phi_jk``, each undirected edge once, i.e.
    ``1/2 sum_i <phi_i, (W phi)_i>`` for the symmetric weight matrix ``W``.

    :param graph: symmetric graph on the rows of ``phi``.
    :param phi: ``(N, K)`` probabilities.
    """
    return 0.5 * (phi * graph.neighbour_sum(phi)).sum()


def potts_negative_elbo(
    data: torch.Tensor,
    prior: GMMPrior,
    graph: SpatialGraph,
    m: torch.Tensor,
    rho: torch.Tensor,
    alpha: torch.Tensor,
) -> torch.Tensor:
    """The exact mean-field negative ELBO of [1, App. C.1] up to ``log Z(r) - N log K``: the
    mixture's :func:`~pyro_pdvi.models.gmm.negative_elbo` and the Potts term (C)
    ``-sum_{(i,j) in E} r_ij <phi_i, phi_j>``.

    :param data: ``(N, d)``.
    :param prior: the mixture's hyperparameters.
    :param graph: the symmetric neighbour graph with weights ``r_ij``.
    :param m: ``(K, d)``.
    :param rho: ``(K, d)``.
    :param alpha: ``(N, K)`` logits of ``q(zeta_i)``.
    :returns: a scalar, differentiable in ``m, rho, alpha``.
    """
    return negative_elbo(data, prior, m, rho, alpha) - potts_energy(graph, torch.softmax(alpha, -1))


def potts_block_negative_elbo(
    data_block: torch.Tensor,
    prior: GMMPrior,
    patch_graph: SpatialGraph,
    m: torch.Tensor,
    rho: torch.Tensor,
    alpha_block: torch.Tensor,
    num_data: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Block share ``f_b`` [1, App. C.1]: the mixture's block share
    (:func:`~pyro_pdvi.models.gmm.block_negative_elbo`) minus the Potts energy of the edges
    inside the block.

    With ``temperature = T != 1`` the entropy term (D) is weighted by ``T``: the annealed
    objective ``f_b + (T - 1) sum_i <phi_i, log phi_i>`` whose ``phi``-minimiser is
    ``softmax((ell + messages) / T)``, flatter for ``T > 1``.

    :param data_block: ``(|b|, d)``.
    :param prior: the hyperparameters.
    :param patch_graph: the block's induced subgraph (:meth:`SpatialGraph.subgraph`).
    :param m: ``(K, d)``.
    :param rho: ``(K, d)``.
    :param alpha_block: ``(|b|, K)``.
    :param num_data: N.
    :param temperature: ``T`` of the annealed objective (1: the exact one).
    """
    log_phi = torch.log_softmax(alpha_block, -1)
    value = block_negative_elbo(data_block, prior, m, rho, alpha_block, num_data)
    value = value - potts_energy(patch_graph, log_phi.exp())
    if temperature != 1.0:
        value = value + (temperature - 1.0) * (log_phi.exp() * log_phi).sum()
    return value
