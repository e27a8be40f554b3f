"""``step_size="auto"``: a step per factor from its curvature, then one check of the coupling.

Factor ``j`` moves on the potential ``V_j = -E_{q_{-j}}[log pi]``; its curvature ``L_j``
is the largest |eigenvalue| of its diagonal Hessian block at configurations drawn from
the current factors, averaged over them, measured by power iteration with Hessian-vector products
(central differences of the batched gradient, as ``pyro_pdvi``'s PD-VI measures its
curvatures). All factors are measured in one batch. The step is ``h_j = fraction / L_j``.

The factors move in parallel [1, eq. 16], so they also interact: for a Gaussian target
the means follow ``mu' - m = (I - S Lambda)(mu - m)`` with ``S = diag(h)``, which needs
the largest eigenvalue of ``S^(1/2) Lambda S^(1/2)`` below 2 (parallel CAVI, the limit of
large steps, can diverge [1, Sec. 3.2]). :func:`coupling_eigenvalue` measures it, and
:func:`auto_step_sizes` shrinks every step by the same factor when it exceeds
:data:`COUPLING_LIMIT`, which keeps every mode of the mean dynamics monotone.

[1] Yao, Yang (2022), "Mean-field variational inference via Wasserstein gradient flow",
    arXiv:2207.08074.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .factors import FactorLayout

#: Largest allowed eigenvalue of ``S^(1/2) E[Hessian] S^(1/2)`` (2 is the stability limit).
COUPLING_LIMIT = 1.0

Gradient = Callable[[torch.Tensor], torch.Tensor]


def _difference_step(points: torch.Tensor) -> float:
    return float(torch.finfo(points.dtype).eps) ** 0.5 * (1.0 + float(points.abs().max()))


def _hessian_vector_products(
    gradient: Gradient, points: torch.Tensor, directions: torch.Tensor
) -> torch.Tensor:
    """``H(points[b]) v[k, b]`` for every direction, ``(k, B, D)``, by central differences
    (one gradient call on ``2 k B`` configurations)."""
    epsilon = _difference_step(points)
    shifted = points + epsilon * directions  # (k, B, D)
    mirrored = points - epsilon * directions
    batch = torch.cat([shifted, mirrored]).reshape(-1, points.shape[1])
    plus, minus = gradient(batch).reshape(2, *shifted.shape)
    return (plus - minus) / (2 * epsilon)


def factor_curvatures(
    gradient: Gradient, points: torch.Tensor, factors: FactorLayout, num_iterations: int = 10
) -> torch.Tensor:
    """``L_j``: the largest |eigenvalue| of the Hessian block ``H_jj`` at every configuration,
    averaged over the configurations, for every factor, ``(m,)``.

    The |eigenvalue| is taken per configuration before averaging, so that a factor that
    starts where its potential bends both ways (between two modes) is not measured as flat.

    :param gradient: ``(n, D) -> dV/du (n, D)``.
    :param points: ``(B, D)`` configurations.
    :param factors: the factor layout.
    :param num_iterations: power iterations (one suffices, and is used, when every factor
        is a single coordinate).
    """
    device, dtype = points.device, points.dtype
    factor_of = factors.factor_of.to(device)
    masks = (factor_of[None, :] == torch.arange(factors.num_factors, device=device)[:, None]).to(dtype)
    masks = masks[:, None, :]  # (m, 1, D)
    generator = torch.Generator().manual_seed(0)
    shape = (factors.num_factors, points.shape[0], points.shape[1])
    directions = (torch.rand(shape, generator=generator, dtype=dtype, device="cpu").to(device) + 0.5) * masks
    directions = directions / directions.norm(dim=-1, keepdim=True)
    norms = torch.zeros(shape[:2], dtype=dtype, device=device)
    for _ in range(1 if factors.all_scalar else num_iterations):
        products = _hessian_vector_products(gradient, points, directions) * masks
        norms = products.norm(dim=-1)
        safe = norms[..., None].clamp_min(torch.finfo(dtype).tiny)
        directions = torch.where(norms[..., None] > 0, products / safe, directions)
    return norms.mean(1)


def coupling_eigenvalue(
    gradient: Gradient, points: torch.Tensor, steps: torch.Tensor, num_iterations: int = 20
) -> float:
    """Largest |eigenvalue| of ``S^(1/2) mean_b H(points[b]) S^(1/2)``, ``S = diag(steps)``."""
    generator = torch.Generator().manual_seed(1)
    root = steps.sqrt()
    vector = torch.randn(points.shape[1], generator=generator, dtype=points.dtype, device="cpu").to(
        points.device
    )
    vector = vector / vector.norm()
    eigenvalue = 0.0
    for _ in range(num_iterations):
        directions = (root * vector).expand(1, *points.shape)
        product = root * _hessian_vector_products(gradient, points, directions)[0].mean(0)
        norm = product.norm()
        eigenvalue = float(norm)
        if not eigenvalue > 0:
            break
        vector = product / norm
    return eigenvalue


def auto_step_sizes(
    gradient: Gradient, points: torch.Tensor, factors: FactorLayout, fraction: float
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Step per coordinate ``fraction / L_j``, shrunk to respect the coupling limit.

    The steps are those the means move by (``h`` for Langevin; for the Gaussian scheme's
    implicit step ``tau / (1 + tau a)``, which the caller converts back to ``tau``).

    :param gradient: ``(n, D) -> dV/du (n, D)``.
    :param points: ``(B, D)`` configurations drawn from the current factors.
    :param factors: the factor layout.
    :param fraction: ``h_j L_j`` before the coupling check.
    :returns: steps ``(D,)``, curvature ``L_j`` per coordinate ``(D,)`` and the coupling
        eigenvalue of the returned steps.
    :raises ValueError: when a factor has no measurable curvature (names it; give a float).
    """
    curvature = factor_curvatures(gradient, points, factors)
    flat = ~(curvature > 0) | ~torch.isfinite(curvature)
    if bool(flat.any()):
        names = [factors.names[j] for j in flat.nonzero().flatten().tolist()]
        raise ValueError(
            f'step_size="auto" measured no finite positive curvature for factors {names[:5]}; '
            "their potential is flat or not finite where the particles start: pass a float step_size"
        )
    per_coordinate = curvature[factors.factor_of.to(curvature.device)]
    steps = fraction / per_coordinate
    coupling = coupling_eigenvalue(gradient, points, steps)
    if coupling > COUPLING_LIMIT:
        steps = steps * (COUPLING_LIMIT / coupling)
        coupling = COUPLING_LIMIT
    return steps, per_coordinate, coupling
