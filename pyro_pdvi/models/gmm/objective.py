"""The mixture's exact mean-field objective [1, App. C.1] and its block share ``f_b``
[1, App. A.1], with the closed-form update of ``q(c)`` given the responsibilities.

Model, with ``K`` components in ``d`` dimensions and equal weights::

    c_k ~ N(xi, diag(sigma1_sq))              k = 1..K      (global)
    z_i ~ Categorical(1/K, ..., 1/K)          i = 1..N      (local)
    x_i | z_i, c ~ N(c_{z_i}, diag(sigma0_sq))

Mean-field family, in the unconstrained coordinates of [1, App. C.1]::

    q(c_kj) = N(m_kj, exp(rho_kj))            rho = log-variance
    q(z_i)  = Categorical(phi_i),  phi_i = softmax(alpha_i)

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
"""

from __future__ import annotations

import math

import torch

from ...metrics import wasserstein_gmm
from .prior import GMMPrior

LOG_2PI = math.log(2.0 * math.pi)


def expected_log_likelihood(
    data: torch.Tensor, prior: GMMPrior, m: torch.Tensor, rho: torch.Tensor
) -> torch.Tensor:
    """``E_q[log N(x_i | c_k, Sigma_0)]`` for every datum and component, shape ``(N, K)``::

        -1/2 sum_j [ log(2 pi sigma0_j^2) + ((x_ij - m_kj)^2 + exp(rho_kj)) / sigma0_j^2 ]

    Computed about ``xi`` by expanding the square, so memory is ``O(N (K + d))``.

    :param data: ``(N, d)``.
    :param prior: the hyperparameters.
    :param m: ``(K, d)``.
    :param rho: ``(K, d)``.
    :rtype: torch.Tensor
    """
    precision = prior.sigma0_sq.reciprocal()
    centred_data = data - prior.xi
    centred_means = m - prior.xi
    quadratic = (
        (centred_data.square() * precision).sum(-1, keepdim=True)
        - 2.0 * centred_data @ (centred_means * precision).T
        + ((centred_means.square() + rho.exp()) * precision).sum(-1)
    )
    return -0.5 * (quadratic + (LOG_2PI + prior.sigma0_sq.log()).sum())


def optimal_logits(data: torch.Tensor, prior: GMMPrior, m: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """``log phi_i = log softmax_k E_q[log p(x_i | c_k)]``, ``(N, K)``: the exact minimiser of
    the negative ELBO in ``q(z)`` given ``q(c)`` (the weights are equal, so they cancel). With
    it, :func:`negative_elbo` judges ``q(c)`` alone, the same way for every method."""
    return torch.log_softmax(expected_log_likelihood(data, prior, m, rho), -1)


def local_negative_elbo(
    data: torch.Tensor, prior: GMMPrior, m: torch.Tensor, rho: torch.Tensor, alpha: torch.Tensor
) -> torch.Tensor:
    """Per-datum local terms ``E_q[log q(z_i) - log p(z_i) - log p(x_i | z_i, c)]``, shape ``(N,)``.

    The ``log p(z_i) = log(1/K)`` term is included, so these add up with
    :func:`global_negative_elbo` to Pyro's ELBO exactly, constants included.
    """
    log_phi = torch.log_softmax(alpha, -1)
    inner = log_phi + math.log(prior.num_components) - expected_log_likelihood(data, prior, m, rho)
    return (log_phi.exp() * inner).sum(-1)


def global_negative_elbo(prior: GMMPrior, m: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """``E_q[log q(c) - log p(c)] = KL(q(c) || p(c))``, terms (B) + (E) of [1, App. C.1]::

    1/2 sum_kj [ log sigma1_j^2 - rho_kj + ((m_kj - xi_j)^2 + exp(rho_kj)) / sigma1_j^2 - 1 ]
    """
    ratio = ((m - prior.xi).square() + rho.exp()) / prior.sigma1_sq
    return 0.5 * (prior.sigma1_sq.log() - rho + ratio - 1.0).sum()


def negative_elbo(
    data: torch.Tensor, prior: GMMPrior, m: torch.Tensor, rho: torch.Tensor, alpha: torch.Tensor
) -> torch.Tensor:
    """The exact mean-field negative ELBO, [1, App. C.1] without the Potts term (C) and
    with the mixture-weight term ``-sum_ik phi_ik log(1/K) = N log K``, so that it equals
    the expectation of Pyro's ELBO loss for :class:`GMMModel` (constants included).

    :param data: ``x``, ``(N, d)``.
    :param prior: the hyperparameters.
    :param m: variational means of the centres, ``(K, d)``.
    :param rho: variational log-variances of the centres, ``(K, d)``.
    :param alpha: logits of ``q(z_i)``, ``(N, K)``.
    :returns: a scalar tensor, differentiable in ``m, rho, alpha``.
    """
    return local_negative_elbo(data, prior, m, rho, alpha).sum() + global_negative_elbo(prior, m, rho)


def block_negative_elbo(
    data_block: torch.Tensor,
    prior: GMMPrior,
    m: torch.Tensor,
    rho: torch.Tensor,
    alpha_block: torch.Tensor,
    num_data: int,
) -> torch.Tensor:
    """Block share ``f_b = sum_{i in b} (local terms) + |b|/N * KL(q(c) || p(c))``
    [1, App. A.1], so that the ``f_b`` of a partition add up to :func:`negative_elbo`.

    :param data_block: the block's data, ``(|b|, d)``.
    :param prior: the hyperparameters.
    :param m: ``(K, d)``.
    :param rho: ``(K, d)``.
    :param alpha_block: the block's logits, ``(|b|, K)``.
    :param num_data: N.
    :rtype: torch.Tensor
    """
    weight = data_block.shape[0] / num_data
    local = local_negative_elbo(data_block, prior, m, rho, alpha_block).sum()
    return local + weight * global_negative_elbo(prior, m, rho)


def conjugate_update(
    data: torch.Tensor, prior: GMMPrior, phi: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact minimiser of the negative ELBO over ``q(c)`` given ``phi`` (the Potts term of
    :mod:`pyro_pdvi.models.potts` does not involve ``c``, so it is that model's too): the
    conjugate Gaussian posterior ``precision = N_k / sigma0^2 + 1 / sigma1^2``,
    ``m = xi + sum_i phi_ik (x_i - xi) / sigma0^2 / precision``, ``rho = -log precision``."""
    counts = phi.sum(0)[:, None]
    precision = counts / prior.sigma0_sq + prior.sigma1_sq.reciprocal()
    m = prior.xi + (phi.T @ (data - prior.xi)) / prior.sigma0_sq / precision
    return m, -precision.log()


def predictive_components(
    prior: GMMPrior, m: torch.Tensor, rho: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Means and diagonal covariances of the fitted components ``N(m_k, Sigma_0 + diag(exp(rho_k)))``,
    the predictive law of ``x`` given ``z = k`` under ``q(c_k)``: what
    :func:`~pyro_pdvi.metrics.wasserstein_gmm` compares with the true components.

    :returns: ``(K, d)`` means and ``(K, d)`` variances.
    """
    return m.detach(), (prior.sigma0_sq + rho.exp()).detach()


def fitted_w2(prior: GMMPrior, centers: torch.Tensor, m: torch.Tensor, rho: torch.Tensor) -> float:
    """W2 between the true mixture ``N(c_k, Sigma_0)`` and the fitted predictive components
    (:func:`predictive_components`): the metric of the paper's Fig. 3
    (:func:`~pyro_pdvi.metrics.wasserstein_gmm`).

    :param prior: the hyperparameters (``Sigma_0``).
    :param centers: the true centres ``(K, d)``.
    :param m: fitted means ``(K, d)``.
    :param rho: fitted log-variances ``(K, d)``.
    :rtype: float
    """
    true_var = prior.sigma0_sq.expand_as(centers)
    return wasserstein_gmm(centers, true_var, *predictive_components(prior, m.detach(), rho.detach()))
