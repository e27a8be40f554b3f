"""The particle scheme: one Langevin step per factor and iteration, all in parallel.

The JKO step of factor ``j`` [1, eq. 16] moves ``q_j`` along the Wasserstein gradient
flow of ``KL(q_j ⊗ q_{-j} || pi)``, whose potential is ``V_j = -E_{q_{-j}}[log pi]``
and whose entropy term is Langevin noise [1, Sec. 2.4 and 5]: each particle follows
``dtheta_j = -grad V_j dt + sqrt(2) dW``. Two discretisations are offered:

* ``"ula"``, Euler-Maruyama (the paper's particle method)::

      x' = x - h grad V_j(x) + sqrt(2h) xi

  Its systematic error does not vanish with more steps or particles: for a factor of
  precision ``a`` it converges to the variance ``1 / (a (1 - a h / 2))``.
* ``"langevin"`` (default), the Leimkuhler-Matthews scheme [2]::

      x_{k+1} = x_k - h grad V_j(x_k) + sqrt(h/2) (xi_k + xi_{k+1})

  at the same cost (one gradient per step; the previous noise ``xi_k`` is kept). Its
  stationary variance for a Gaussian factor is exactly ``1/a`` for every ``h < 2/a``,
  and its bias for smooth non-Gaussian factors is ``O(h^2)`` instead of ``O(h)`` [2].

The drift ``grad V_j`` is itself a Monte Carlo average over ``R`` draws of the other
factors (:func:`~.factors.product_configurations`), whose noise would add the variance
``h^2 s^2 / R`` per step (``s^2``: the variance of one draw) on top of the Langevin
noise. With ``R >= 2`` draws, ``s^2`` is estimated from their spread and the injected
noise is reduced by as much (the noise correction of stochastic-gradient MCMC, as in
SGHMC [3]), so that the stationary variance of a Gaussian factor stays ``1/a``; for the
Leimkuhler-Matthews scheme the reduction is ``h^2 s^2 / (2 R (2 - a h))`` per unit of
``xi`` variance, with ``a`` the factor's measured curvature.

Both schemes are explicit, so a particle that wanders where the potential is much
stiffer than where the step was measured (the far tail of a log-transformed scale, where
the curvature grows like ``exp(u)``) could be thrown arbitrarily far. The drift move
``h * drift`` is therefore clipped to :data:`DRIFT_CLIP` standard deviations of one
step's noise, ``sqrt(2h)``: for a Gaussian factor at the default ``a h = 1/4`` the clip
touches only particles more than 14 standard deviations from the mean, so it changes
nothing in the bulk and only slows a particle that starts far out.

[1] Yao, Yang (2022), "Mean-field variational inference via Wasserstein gradient flow",
    arXiv:2207.08074.
[2] Leimkuhler, Matthews (2013), "Rational construction of stochastic numerical methods
    for molecular sampling", Appl. Math. Res. Express 2013(1).
[3] Chen, Fox, Guestrin (2014), "Stochastic gradient Hamiltonian Monte Carlo", ICML.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

#: Largest drift move per step, in standard deviations ``sqrt(2h)`` of one step's noise.
DRIFT_CLIP = 5.0


class ParticleState(NamedTuple):
    """The particles of every factor.

    :param particles: ``(P, D)`` unconstrained.
    :param noise: the last Leimkuhler-Matthews noise ``xi_k``, ``(P, D)`` (``"ula"``: unused,
        zeros).
    """

    particles: torch.Tensor
    noise: torch.Tensor


def noise_variance(
    step: torch.Tensor,
    drift_variance: torch.Tensor | None,
    num_draws: int,
    curvature: torch.Tensor | None,
) -> torch.Tensor:
    """Variance of the Leimkuhler-Matthews noise amplitude per coordinate, ``(D,)``.

    ``h/2`` minus the drift-noise correction ``h^2 s^2 / (2 R (2 - a h))`` (see the module
    docstring), floored at 0. ``s^2`` is the particles' average variance of one drift
    draw, ``(D,)``, or ``None`` for no correction.
    """
    variance = step / 2
    if drift_variance is None:
        return variance
    a_h = (curvature * step).clamp(max=1.0) if curvature is not None else torch.zeros_like(step)
    return (variance - step.square() * drift_variance / (2 * num_draws * (2 - a_h))).clamp_min(0.0)


def drift_move(drift: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``h * drift``, clipped to ``DRIFT_CLIP * sqrt(2h)`` in every coordinate."""
    limit = DRIFT_CLIP * (2 * step).sqrt()
    return (step * drift).clamp(-limit, limit)


def leimkuhler_matthews_step(
    state: ParticleState,
    drift: torch.Tensor,
    step: torch.Tensor,
    amplitude_variance: torch.Tensor,
    generator: torch.Generator,
) -> ParticleState:
    """One Leimkuhler-Matthews step of every particle.

    :param state: particles and the previous noise.
    :param drift: ``-grad V_j`` per particle and coordinate, ``(P, D)``.
    :param step: ``h`` per coordinate, ``(D,)``.
    :param amplitude_variance: squared noise amplitude per coordinate, ``(D,)``
        (``h/2`` without correction; :func:`noise_variance`).
    :param generator: the engine's random generator.
    """
    particles, noise = state
    new_noise = torch.randn(
        particles.shape, generator=generator, dtype=particles.dtype, device=particles.device
    )
    moved = particles + drift_move(drift, step) + amplitude_variance.sqrt() * (noise + new_noise)
    return ParticleState(moved, new_noise)


def euler_maruyama_step(
    state: ParticleState, drift: torch.Tensor, step: torch.Tensor, generator: torch.Generator
) -> ParticleState:
    """One unadjusted Langevin (Euler-Maruyama) step: ``x + h drift + sqrt(2h) xi`` (drift clipped)."""
    particles = state.particles
    xi = torch.randn(particles.shape, generator=generator, dtype=particles.dtype, device=particles.device)
    return ParticleState(particles + drift_move(drift, step) + (2 * step).sqrt() * xi, state.noise)
