"""The closed-form JKO step for diagonal Gaussian factors (``scheme="gaussian"``).

Each coordinate's factor is ``N(mu, s^2)``. The JKO step of factor ``j`` [1, eq. 16]
minimises ``E_q[V_j] - H(q) + W2(q, q_j)^2 / (2 tau)``; for one-dimensional Gaussians
``W2^2 = (mu - mu_0)^2 + (s - s_0)^2`` and ``-H = -log s + const``. With ``V_j`` replaced
by its quadratic model about the current factor,
``V_j(x) ≈ g (x - mu_0) + a (x - mu_0)^2 / 2`` with ``g = E_q[dV/dx]`` and
``a = E_q[d^2V/dx^2]``, the minimiser is Gaussian (the optimal map of a quadratic
potential is affine) and in closed form::

    mu = mu_0 - tau g / (1 + tau a)                     # implicit (proximal) in the mean
    (a + 1/tau) s^2 - (s_0 / tau) s - 1 = 0             # proximal in s: -log s is the entropy

For a Gaussian target ``V_j`` *is* quadratic, so this is the exact JKO step [1, eq. 16]
and its fixed point the exact mean-field optimum (means ``m``, variances ``1/Lambda_jj``)
for every ``tau``; for other targets its fixed point is the mean-field Gaussian
(``AutoNormal``) optimum, ``E_q[dV] = 0`` and ``s^2 = 1 / E_q[d^2 V]``, up to the Monte
Carlo error of ``g`` and ``a``.

``g`` and ``a`` are averages over ``n`` configurations ``mu + s * eps`` from all factors
at once; ``a`` by Stein's identity ``E[d^2V/dx_j^2] = E[dV/dx_j eps_j] / s_j``, so one
gradient pass gives both. The base normals ``eps`` come in antithetic pairs and are
whitened to empirical mean 0 and covariance exactly ``I`` when ``n/2 >= D``
(moment matching [2, Sec. 4.5]): then ``g`` and ``a`` are exact for every quadratic
potential, which is what makes the fixed point exact in floating point. With fewer
configurations each coordinate is only scaled to unit second moment (exact when the
Hessian is diagonal, noisy otherwise).

[1] Yao, Yang (2022), "Mean-field variational inference via Wasserstein gradient flow",
    arXiv:2207.08074.
[2] Glasserman (2003), "Monte Carlo Methods in Financial Engineering", Springer.
"""

from __future__ import annotations

import torch


def moment_matched_normals(
    num_samples: int,
    dim: int,
    generator: torch.Generator,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """``(num_samples, dim)`` antithetic standard normals with matched moments.

    :param num_samples: an even ``n``.
    :param dim: D.
    :param generator: the engine's random generator.
    :returns: rows ``[eps; -eps]``; their mean is exactly 0, and their second moment is
        exactly ``I`` if ``n/2 >= D`` (else its diagonal is exactly 1).
    """
    half = torch.randn(num_samples // 2, dim, generator=generator, dtype=dtype, device=device)
    if half.shape[0] >= dim:
        second_moment = half.T @ half / half.shape[0]
        cholesky = torch.linalg.cholesky(second_moment)
        half = torch.linalg.solve_triangular(cholesky, half.T, upper=False).T
    else:
        half = half / half.square().mean(0).sqrt()
    return torch.cat([half, -half])


def expected_gradient_and_curvature(
    gradients: torch.Tensor, base_noise: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``E_q[dV/dx_j]`` and, by Stein's identity, ``E_q[d^2V/dx_j^2]``, each ``(D,)``.

    :param gradients: ``dV/du`` at ``mu + scale * base_noise``, ``(n, D)``.
    :param base_noise: the base normals, ``(n, D)``.
    :param scale: the factors' standard deviations, ``(D,)``.
    """
    return gradients.mean(0), (gradients * base_noise).mean(0) / scale


def gaussian_jko_step(
    loc: torch.Tensor, scale: torch.Tensor, grad: torch.Tensor, curvature: torch.Tensor, step: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The closed-form JKO step of every diagonal Gaussian factor (module docstring).

    :param loc: ``mu_0``, ``(D,)``.
    :param scale: ``s_0``, ``(D,)``.
    :param grad: ``g = E_q[dV/dx]``, ``(D,)``.
    :param curvature: ``a = E_q[d^2V/dx^2]``, ``(D,)``.
    :param step: ``tau`` per coordinate, ``(D,)``.
    :returns: the new ``(mu, s)``; NaN where ``a + 1/tau <= 0`` (the step's subproblem is
        then unbounded: a smaller ``tau`` is needed).
    """
    precision = curvature + step.reciprocal()
    new_loc = loc - grad / precision
    pull = scale / step
    new_scale = (pull + (pull.square() + 4 * precision).sqrt()) / (2 * precision)
    bounded = precision > 0
    nan = torch.full_like(loc, float("nan"))
    return torch.where(bounded, new_loc, nan), torch.where(bounded, new_scale, nan)
