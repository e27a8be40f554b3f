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

import math

import torch

from ..gmm import GMMPrior, block_negative_elbo, negative_elbo
from ..gmm.objective import LOG_2PI, global_negative_elbo
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


def likelihood_weights(prior: GMMPrior, m: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """``W_k = [m_k - xi, -1/2 sum_j ((m_kj - xi_j)^2 + exp(rho_kj)) / sigma0_j^2]``, shape
    ``(..., K, d + 1)``: with ``x~_i = [(x_i - xi) / sigma0^2, 1]``
    (:func:`~pyro_pdvi.models.gmm.solver.scaled_data`), ``x~_i . W_k`` is
    ``E_q[log p(x_i | c_k)]`` minus :func:`row_constants`, a term that does not depend on
    ``k`` (so a softmax over ``k`` drops it), and ``sum_i phi_ik x~_i`` holds everything the
    objective needs of the data.

    :param prior: the hyperparameters.
    :param m: ``(..., K, d)``.
    :param rho: ``(..., K, d)``.
    """
    centred = m - prior.xi
    quadratic = ((centred.square() + rho.exp()) / prior.sigma0_sq).sum(-1, keepdim=True)
    return torch.cat([centred, -0.5 * quadratic], -1)


def row_constants(data: torch.Tensor, prior: GMMPrior) -> torch.Tensor:
    """``c_i = -1/2 sum_j [ (x_ij - xi_j)^2 / sigma0_j^2 + log(2 pi sigma0_j^2) ]``, shape
    ``(N,)``: the part of ``E_q[log p(x_i | c_k)]`` that is the same for every ``k``."""
    normalizer = (LOG_2PI + prior.sigma0_sq.log()).sum()
    return -0.5 * (((data - prior.xi).square() / prior.sigma0_sq).sum(-1) + normalizer)


def negative_elbo_from_statistics(
    prior: GMMPrior,
    m: torch.Tensor,
    rho: torch.Tensor,
    statistics: torch.Tensor,
    phi_log_phi: torch.Tensor,
    energy: torch.Tensor,
    constant: torch.Tensor,
    weight: float,
) -> torch.Tensor:
    """The block objective ``f_b`` (:func:`potts_block_negative_elbo`) from its sufficient
    statistics, without touching the data again::

        f_b = sum_ik phi_ik log phi_ik + |b| log K - sum_i c_i - sum_k <S_k, W_k>
              + w KL(q(c) || p(c)) - sum_{(i,j) in E_b} r_ij <phi_i, phi_j>

    with ``S = phi^T x~`` (its last column the counts, so ``|b| = sum_k S_k,d+1``),
    ``W`` = :func:`likelihood_weights` and ``c_i`` = :func:`row_constants`. With ``w = 1``
    and all spots it is the full :func:`potts_negative_elbo`.

    :param prior: the hyperparameters.
    :param m: ``(K, d)``.
    :param rho: ``(K, d)``.
    :param statistics: ``S = phi^T x~``, ``(K, d + 1)``.
    :param phi_log_phi: ``sum_ik phi_ik log phi_ik``.
    :param energy: the Potts energy of the block's edges (:func:`potts_energy`).
    :param constant: ``sum_{i in b} c_i``.
    :param weight: ``w = |b| / N``.
    """
    size = statistics[:, -1].sum()
    likelihood = (statistics * likelihood_weights(prior, m, rho)).sum() + constant
    kl = global_negative_elbo(prior, m, rho)
    return phi_log_phi + size * math.log(prior.num_components) - likelihood + weight * kl - energy


def global_gradient(
    prior: GMMPrior, m: torch.Tensor, rho: torch.Tensor, statistics: torch.Tensor, weight: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_m f_b, grad_rho f_b)`` in closed form at fixed ``phi``::

        grad_m   = (N_k / sigma0^2 + w / sigma1^2) (m_k - xi) - S_k
        grad_rho = 1/2 exp(rho_k) (N_k / sigma0^2 + w / sigma1^2) - w / 2

    with ``S = phi^T x~`` (:func:`negative_elbo_from_statistics`), ``N_k`` its last column.
    With ``w = 1`` and all spots it is the gradient of :func:`potts_negative_elbo` in the
    global parameters, the paper's convergence measure [1, Fig. 4].

    :returns: two ``(K, d)`` tensors.
    """
    dim = m.shape[-1]
    precision = statistics[:, dim:] / prior.sigma0_sq + weight / prior.sigma1_sq
    return precision * (m - prior.xi) - statistics[:, :dim], 0.5 * (precision * rho.exp() - weight)
