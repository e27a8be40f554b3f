"""How the factors are represented and moved: particles or diagonal Gaussians.

A scheme owns its state (an immutable tuple) and proposes the next one; the engine
checks the proposal and commits it, so a refused step changes nothing.

* :class:`ParticleScheme` (``"langevin"``, ``"ula"``): every factor is an empirical
  measure of ``P`` particles; one Langevin step per iteration (:mod:`.langevin`) with the
  mean-field drift from permuted particles (:mod:`.factors`).
* :class:`GaussianScheme` (``"gaussian"``): every coordinate is ``N(mu, s^2)``; one
  closed-form JKO step per iteration (:mod:`.gaussian`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .factors import FactorLayout, drift_per_particle, product_configurations
from .gaussian import expected_gradient_and_curvature, gaussian_jko_step, moment_matched_normals
from .langevin import ParticleState, euler_maruyama_step, leimkuhler_matthews_step, noise_variance
from .potential import Potential

SCHEMES = ("langevin", "ula", "gaussian")


class GaussianState(NamedTuple):
    """Diagonal Gaussian factors: ``loc`` and ``scale``, each ``(D,)`` unconstrained."""

    loc: torch.Tensor
    scale: torch.Tensor


class Scheme:
    """What the engine needs from a scheme (shared plumbing; see the subclasses).

    :param potential: the model's potential.
    :param factors: the factor layout.
    :param num_particles: P.
    :param num_draws: R.
    """

    def __init__(
        self, potential: Potential, factors: FactorLayout, num_particles: int, num_draws: int
    ) -> None:
        self.potential = potential
        self.factors = factors
        self.num_particles = num_particles
        self.num_draws = num_draws
        self.state: tuple = ()
        self.steps: torch.Tensor | None = None
        self.curvature: torch.Tensor | None = None

    def set_steps(self, steps: torch.Tensor, curvature: torch.Tensor | None) -> None:
        """Step per coordinate ``(D,)`` and, when measured, curvature per coordinate ``(D,)``."""
        self.steps, self.curvature = steps, curvature

    def mean_step_fraction(self, fraction: float) -> float:
        """``step_fraction`` as the fraction the means move by (see :mod:`.step_sizes`)."""
        return fraction

    def from_mean_steps(self, steps: torch.Tensor, curvature: torch.Tensor) -> torch.Tensor:
        """Steps of the scheme from the steps the means move by."""
        return steps

    def state_dict(self) -> dict:
        """The state's tensors, cloned."""
        return {name: value.clone() for name, value in self.state._asdict().items()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (same names and shapes)."""
        current = self.state._asdict()
        for name, value in state.items():
            if name not in current or value.shape != current[name].shape:
                raise ValueError(
                    f"state entry {name!r} of shape {tuple(value.shape)} does not fit this engine "
                    f"({ {k: tuple(v.shape) for k, v in current.items()} })"
                )
        self.state = type(self.state)(**{name: state[name].to(current[name]) for name in current})

    def _local_log_probs(self, configurations: torch.Tensor, args: tuple, kwargs: dict) -> dict | None:
        if not self.potential.layout.enumerated:
            return None
        return self.potential.value_and_grad(configurations, args, kwargs, grad=False).local_log_probs


class ParticleScheme(Scheme):
    """Factors as particles, moved by Leimkuhler-Matthews (``"langevin"``) or
    Euler-Maruyama (``"ula"``) steps.

    :param integrator: ``"langevin"`` or ``"ula"``.
    :param drift_noise_correction: reduce the injected noise by the drift's Monte Carlo
        variance (``"langevin"`` with ``num_draws >= 2``).
    """

    def __init__(
        self,
        potential: Potential,
        factors: FactorLayout,
        num_particles: int,
        num_draws: int,
        integrator: str,
        drift_noise_correction: bool,
    ) -> None:
        super().__init__(potential, factors, num_particles, num_draws)
        self.integrator = integrator
        self.drift_noise_correction = drift_noise_correction and integrator == "langevin" and num_draws >= 2

    def initialize(self, initial: torch.Tensor, init_scale: float, generator: torch.Generator) -> None:
        """Particles ``initial + init_scale * N(0, I)``."""
        shape = (self.num_particles, initial.shape[0])
        noise = torch.randn(shape, generator=generator, dtype=initial.dtype, device=initial.device)
        particles = initial + init_scale * noise
        last_noise = torch.randn(shape, generator=generator, dtype=initial.dtype, device=initial.device)
        self.state = ParticleState(particles, last_noise if self.integrator == "langevin" else 0 * last_noise)

    def curvature_points(self, args: tuple, kwargs: dict, generator: torch.Generator):
        """Configurations from the product of the factors, and the E-step at them."""
        configurations, _ = product_configurations(
            self.state.particles, self.factors, self.num_draws, generator
        )
        return configurations, self._local_log_probs(configurations, args, kwargs)

    def propose(
        self, args: tuple, kwargs: dict, generator: torch.Generator
    ) -> tuple[ParticleState, torch.Tensor]:
        """The next particles and the loss (energy part) at the current ones."""
        state = self.state
        configurations, index = product_configurations(
            state.particles, self.factors, self.num_draws, generator
        )
        value = self.potential.value_and_grad(configurations, args, kwargs)
        drifts = -drift_per_particle(value.grad, index)  # (R, P, D)
        drift = drifts.mean(0)
        loss = value.energy.mean() + value.local_neg_entropy
        if self.integrator == "ula":
            return euler_maruyama_step(state, drift, self.steps, generator), loss
        drift_variance = drifts.var(0).mean(0) if self.drift_noise_correction else None
        amplitude = noise_variance(self.steps, drift_variance, self.num_draws, self.curvature)
        return leimkuhler_matthews_step(state, drift, self.steps, amplitude, generator), loss

    def samples(self) -> torch.Tensor:
        """The particles, ``(P, D)``."""
        return self.state.particles


class GaussianScheme(Scheme):
    """Diagonal Gaussian factors with the closed-form JKO step."""

    def initialize(self, initial: torch.Tensor, init_scale: float, generator: torch.Generator) -> None:
        """``N(initial, init_scale^2)`` in every coordinate."""
        self.state = GaussianState(initial.clone(), torch.full_like(initial, init_scale))

    def mean_step_fraction(self, fraction: float) -> float:
        """The implicit step moves the mean by ``tau / (1 + tau a)``: fraction ``f / (1 + f)``."""
        return fraction / (1 + fraction)

    def from_mean_steps(self, steps: torch.Tensor, curvature: torch.Tensor) -> torch.Tensor:
        """``tau`` with ``tau / (1 + tau a) = steps``."""
        return steps / (1 - steps * curvature)

    def _configurations(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        loc, scale = self.state
        base = moment_matched_normals(self.num_particles, loc.shape[0], generator, loc.dtype, loc.device)
        return loc + scale * base, base

    def curvature_points(self, args: tuple, kwargs: dict, generator: torch.Generator):
        """Configurations from the factors, and the E-step at them."""
        configurations, _ = self._configurations(generator)
        return configurations, self._local_log_probs(configurations, args, kwargs)

    def propose(
        self, args: tuple, kwargs: dict, generator: torch.Generator
    ) -> tuple[GaussianState, torch.Tensor]:
        """The next factors and the negative ELBO estimate at the current ones."""
        loc, scale = self.state
        configurations, base = self._configurations(generator)
        value = self.potential.value_and_grad(configurations, args, kwargs)
        grad, curvature = expected_gradient_and_curvature(value.grad, base, scale)
        entropy = scale.log().sum() + 0.5 * loc.shape[0] * (1 + math.log(2 * math.pi))
        loss = value.energy.mean() + value.local_neg_entropy - entropy
        return GaussianState(*gaussian_jko_step(loc, scale, grad, curvature, self.steps)), loss

    def samples(self) -> torch.Tensor:
        """``num_particles`` fresh draws from the factors (torch's global RNG), ``(P, D)``."""
        loc, scale = self.state
        return loc + scale * torch.randn(self.num_particles, loc.shape[0], dtype=loc.dtype, device=loc.device)


def make_scheme(
    name: str,
    potential: Potential,
    factors: FactorLayout,
    num_particles: int,
    num_draws: int,
    drift_noise_correction: bool = True,
) -> Scheme:
    """The scheme called ``name`` (one of :data:`SCHEMES`)."""
    if name == "gaussian":
        return GaussianScheme(potential, factors, num_particles, num_draws)
    return ParticleScheme(potential, factors, num_particles, num_draws, name, drift_noise_correction)
