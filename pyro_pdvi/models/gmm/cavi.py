"""Full-batch coordinate ascent VI (CAVI) for the mixture [2, Sec. 2.4 and 3]: the optimum
every method is measured by.

[2] Blei, Kucukelbir, McAuliffe (2017), "Variational Inference: A Review for
    Statisticians", JASA 112(518), Sec. 2.4 and 3.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .objective import conjugate_update, negative_elbo, optimal_logits
from .prior import GMMPrior, kmeans


class CAVIResult(NamedTuple):
    """What :func:`cavi` returns.

    :param m: means at the fixed point, ``(K, d)``.
    :param rho: log-variances, ``(K, d)``.
    :param alpha: logits (normalised: ``alpha = log phi``), ``(N, K)``.
    :param losses: the negative ELBO after every sweep, ``(num_sweeps,)``.
    :param converged: whether the change fell below ``tol`` before ``num_iterations``.
    """

    m: torch.Tensor
    rho: torch.Tensor
    alpha: torch.Tensor
    losses: torch.Tensor
    converged: bool


@torch.no_grad()
def cavi(
    data: torch.Tensor,
    prior: GMMPrior,
    m: torch.Tensor | None = None,
    rho: torch.Tensor | None = None,
    alpha: torch.Tensor | None = None,
    num_iterations: int = 1000,
    tol: float = 1e-10,
    seed: int = 0,
) -> CAVIResult:
    """Full-batch coordinate ascent VI [2, Sec. 2.4 and 3] for the mixture.

    One sweep sets ``phi_i = softmax_k E_q[log p(x_i | c_k)]`` (the mixture weights are
    equal, so they cancel), then ``q(c_k)`` to its conjugate Gaussian form given ``phi``
    (:func:`_component_update`). Each half-step is an exact minimisation, so the negative
    ELBO never increases. It stops when the largest change of ``m`` and ``rho`` in a sweep
    is below ``tol``; then ``m, rho`` are exactly optimal given ``alpha`` and the gradient
    in ``alpha`` is of the order of that change.

    Initialisation: ``m`` if given, else ``q(c)`` from ``alpha`` if given, else k-means
    centres (:func:`kmeans` with ``seed``); ``rho`` if given, else from ``alpha`` if given,
    else ``log sigma1_sq``.

    :param data: ``(N, d)``.
    :param prior: the hyperparameters.
    :param m: initial means ``(K, d)``.
    :param rho: initial log-variances ``(K, d)``.
    :param alpha: initial logits ``(N, K)``.
    :param num_iterations: maximum number of sweeps.
    :param tol: stopping threshold on the parameter change.
    :param seed: seed of the k-means initialisation.
    :rtype: CAVIResult
    """
    num_components = prior.num_components
    if alpha is not None:
        from_alpha = conjugate_update(data, prior, torch.softmax(alpha, -1))
        m = from_alpha[0] if m is None else m
        rho = from_alpha[1] if rho is None else rho
    if m is None:
        m = kmeans(data, num_components, seed=seed)[0]
    if rho is None:
        rho = prior.sigma1_sq.log().expand(num_components, -1)
    m, rho = m.detach().clone(), rho.detach().clone()
    losses = []
    converged = False
    for _ in range(num_iterations):
        alpha = optimal_logits(data, prior, m, rho)
        new_m, new_rho = conjugate_update(data, prior, alpha.exp())
        losses.append(negative_elbo(data, prior, new_m, new_rho, alpha))
        change = max(float((new_m - m).abs().max()), float((new_rho - rho).abs().max()))
        m, rho = new_m, new_rho
        if change < tol:
            converged = True
            break
    return CAVIResult(m, rho, alpha, torch.stack(losses), converged)
