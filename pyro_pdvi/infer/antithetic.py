"""Antithetic Monte Carlo noise over an ELBO's vectorized particles.

With ``vectorize_particles=True`` an ELBO draws its ``K`` particles along a plate
named ``num_particles_vectorized``. Under :class:`AntitheticNoise` every
Gaussian guide site (``Normal``, ``MultivariateNormal``, and ``Independent`` or
``TransformedDistribution`` wrappers of them, which covers ``AutoNormal``,
``AutoDiagonalNormal`` and ``AutoMultivariateNormal``) draws its standard-normal
noise in pairs: the first ``K/2`` particles take ``z``, the others ``-z``
(Owen 2013, Sec. 8.2). Each particle is still an exact draw from the guide, so
the ELBO estimate stays unbiased, and the sample mean of the noise is exactly
zero, so every term of the objective that is linear in the noise cancels.

Why PDVI needs it. A primal solve holds its block's noise fixed and minimises
that sample-average objective exactly. For a location-scale guide the objective
has terms ``scale * mean_k(z_k) * (something of the block's data)``; on sorted,
non-i.i.d. blocks the data factor is large, so the solved scale follows the
noise's sample mean. Measured on the hierarchical benchmark
(``benchmarks/global_update_noise.py``, docs/benchmarks.md section 2):
the optimum of the fixed-noise objective had the sd of ``q(mu)`` off by 48% at
8 particles and 39% at 64 (RMS over 3 seeds); with antithetic pairs, 12% and 6%,
and its mean is exact.

Sites of other families (Gamma, Beta, discrete, ...) are drawn by Pyro as
usual; sites outside the particle plate (no vectorized particles) are an error.
:class:`LoopedAntitheticNoise` pairs the particles of an ELBO that loops over them
instead, for a model that cannot take vectorized ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pyro.poutine.messenger import Messenger
from pyro.poutine.runtime import Message
from torch.distributions import Distribution, Independent, MultivariateNormal, Normal, TransformedDistribution

PARTICLE_PLATE = "num_particles_vectorized"


def reparameterized(fn: Distribution, noise: torch.Tensor) -> torch.Tensor | None:
    """``fn``'s draw for standard-normal ``noise`` (shape ``batch + event``), or
    ``None`` if ``fn`` is not a Gaussian family this module knows."""
    if isinstance(fn, Normal):
        return fn.loc + fn.scale * noise
    if isinstance(fn, MultivariateNormal):
        return fn.loc + (fn.scale_tril @ noise.unsqueeze(-1)).squeeze(-1)
    if isinstance(fn, Independent):
        return reparameterized(fn.base_dist, noise)
    if isinstance(fn, TransformedDistribution):
        base_shape = fn.base_dist.batch_shape + fn.base_dist.event_shape
        if base_shape != noise.shape:
            return None
        value = reparameterized(fn.base_dist, noise)
        if value is None:
            return None
        for transform in fn.transforms:
            value = transform(value)
        return value
    return None


class AntitheticNoise(Messenger):
    """Draw Gaussian guide sites as antithetic pairs over the vectorized particles.

    Use around an ELBO evaluation whose ELBO has ``vectorize_particles=True`` and
    an even ``num_particles``, e.g. ``with AntitheticNoise(): svi.step(...)``, or
    ``PDVI(..., antithetic=True)``. The noise comes from torch's default generator,
    so :class:`~pyro_pdvi.infer.handlers.FixedNoise` fixes it as usual.

    :param match_second_moment: also rescale the ``K/2`` draws of every coordinate so that
        their mean square is exactly 1 (moment matching [Owen 2013, Sec. 8.5]): the noise
        then has the first two moments of a standard normal exactly, so an objective that is
        quadratic in the noise (a Gaussian target's, in a location-scale guide) is exact at
        fixed noise, scales included. The particles are no longer independent draws: the
        ELBO estimate gains a bias of order ``1/K`` for non-quadratic targets.
    """

    def __init__(self, match_second_moment: bool = False) -> None:
        super().__init__()
        self.match_second_moment = match_second_moment

    def _process_message(self, msg: Message) -> None:
        if not _gaussian_draw(msg):
            return
        fn = msg["fn"]
        frame = next((f for f in msg["cond_indep_stack"] if f.name == PARTICLE_PLATE), None)
        if frame is None or frame.size % 2:
            raise ValueError(
                f'AntitheticNoise at sample site "{msg["name"]}": antithetic pairs need the '
                "ELBO's particles vectorized in pairs; use vectorize_particles=True and an even "
                "num_particles (e.g. TraceMeanField_ELBO(num_particles=8, vectorize_particles=True))"
            )
        base = fn.base_dist if isinstance(fn, TransformedDistribution) else fn
        shape = base.batch_shape + base.event_shape
        axis = len(base.batch_shape) + frame.dim
        if axis < 0 or shape[axis] != frame.size:
            return  # the site does not vary over the particles: leave it to Pyro
        half = list(shape)
        half[axis] = frame.size // 2
        loc = _first_parameter(fn)
        z = torch.randn(half, dtype=loc.dtype, device=loc.device)
        if self.match_second_moment:
            z = matched_second_moment(z, axis, _is_multivariate(fn))
        value = reparameterized(fn, torch.cat([z, -z], dim=axis))
        if value is not None:
            msg["value"] = value


class LoopedAntitheticNoise(Messenger):
    """:class:`AntitheticNoise` for an ELBO that loops over its ``K`` particles
    (``vectorize_particles=False``): the ``k``-th visit of a Gaussian guide site within the
    ``with`` block takes the noise ``z_j`` for ``k = 2j`` and ``-z_j`` for ``k = 2j + 1``, the
    ``K/2`` draws ``z_j`` made at its first visit. For a model that cannot take vectorized
    particles: each particle is an evaluation of its own, so ``K`` cost ``K`` times one.

    :param num_particles: ``K``, the ELBO's particles, even; one ``with`` block per evaluation.
    :param match_second_moment: as in :class:`AntitheticNoise`, over the ``K/2`` draws.
    """

    def __init__(self, num_particles: int, match_second_moment: bool = False) -> None:
        super().__init__()
        if num_particles < 2 or num_particles % 2:
            raise ValueError(f"Invalid num_particles: {num_particles}; use an even number of at least 2")
        self.num_particles = num_particles
        self.match_second_moment = match_second_moment
        self._queued: dict[str, list[torch.Tensor]] = {}

    def _process_message(self, msg: Message) -> None:
        if not _gaussian_draw(msg):
            return
        fn = msg["fn"]
        base = fn.base_dist if isinstance(fn, TransformedDistribution) else fn
        shape = base.batch_shape + base.event_shape
        queued = self._queued.get(msg["name"])
        if not queued or queued[0].shape != shape:
            loc = _first_parameter(fn)
            z = torch.randn((self.num_particles // 2, *shape), dtype=loc.dtype, device=loc.device)
            if self.match_second_moment:
                z = matched_second_moment(z, 0, _is_multivariate(fn))
            queued = self._queued[msg["name"]] = [noise for draw in z for noise in (draw, -draw)]
        value = reparameterized(fn, queued.pop(0))
        if value is not None:
            msg["value"] = value


def matched_second_moment(z: torch.Tensor, axis: int, multivariate: bool) -> torch.Tensor:
    """``z`` rescaled so that the mean square over ``axis`` is exactly 1 per coordinate; for a
    multivariate site (``z``'s last dim its event) with at least as many draws as dimensions,
    whitened instead, so that the mean of ``z z'`` is exactly the identity (a full-covariance
    guide's objective on a Gaussian target is then exact at fixed noise, correlations included:
    :mod:`~pyro_pdvi.infer.cholesky_maps`).

    :param z: standard-normal draws.
    :param axis: the draws' axis.
    :param multivariate: whether the last dim is one site's event.
    """
    draws = z.shape[axis]
    if not multivariate or z.shape[-1] < 2 or axis % z.dim() == z.dim() - 1 or draws < z.shape[-1]:
        return z / z.square().mean(axis, keepdim=True).sqrt()
    moved = z.movedim(axis, -2)  # (..., draws, D)
    moment = moved.mT @ moved / draws
    cholesky, info = torch.linalg.cholesky_ex(moment)
    # Where the draws' moment is singular, the coordinates' own scaling (no host read to decide).
    singular = (info != 0)[..., None, None]
    cholesky = torch.where(singular, moment.diagonal(dim1=-2, dim2=-1).sqrt().diag_embed(), cholesky)
    whitened = torch.linalg.solve_triangular(cholesky, moved.mT, upper=False).mT
    return whitened.movedim(-2, axis)


def _is_multivariate(fn: Distribution) -> bool:
    """Whether ``fn`` is a ``MultivariateNormal``, behind ``Independent`` or a transform."""
    while isinstance(fn, (Independent, TransformedDistribution)):
        fn = fn.base_dist
    return isinstance(fn, MultivariateNormal)


def _gaussian_draw(msg: Message) -> bool:
    """Whether ``msg`` is a draw still to make from a reparameterized Gaussian family."""
    if msg["type"] != "sample" or msg["is_observed"] or msg["value"] is not None:
        return False
    fn = msg["fn"]
    return getattr(fn, "has_rsample", False) and isinstance(
        fn, (Normal, MultivariateNormal, Independent, TransformedDistribution)
    )


def _first_parameter(fn: Distribution) -> torch.Tensor:
    """A tensor parameter of the base Gaussian, for dtype and device."""
    while isinstance(fn, (Independent, TransformedDistribution)):
        fn = fn.base_dist
    return fn.loc


def has_particle_pairs(loss: object) -> bool:
    """Whether ``loss`` is a Pyro ELBO that vectorizes an even number of particles."""
    num_particles = getattr(loss, "num_particles", 1)
    return bool(getattr(loss, "vectorize_particles", False)) and num_particles % 2 == 0


def check_antithetic_loss(loss: object) -> None:
    """Raise a ``ValueError`` unless a Pyro ELBO ``loss`` vectorizes an even number of
    particles, as :class:`AntitheticNoise` needs (a loss callable is not checked)."""
    if hasattr(loss, "num_particles") and not has_particle_pairs(loss):
        raise ValueError(
            f"antithetic=True needs the ELBO's particles vectorized in pairs, but the loss has "
            f"num_particles={loss.num_particles}, vectorize_particles="
            f"{getattr(loss, 'vectorize_particles', False)}; use e.g. "
            f"{type(loss).__name__}(num_particles=16, vectorize_particles=True), or antithetic=False"
        )


def antithetic_loss(
    loss_fn: Callable[..., torch.Tensor],
    match_second_moment: bool = False,
    looped_particles: int | None = None,
) -> Callable[..., torch.Tensor]:
    """``loss_fn(model, guide, *args, **kwargs)`` evaluated under :class:`AntitheticNoise`, or
    under :class:`LoopedAntitheticNoise` for an ELBO that loops over ``looped_particles``."""

    def loss_with_antithetic_noise(model: Callable, guide: Callable, *args, **kwargs) -> torch.Tensor:
        noise = (
            AntitheticNoise(match_second_moment)
            if looped_particles is None
            else LoopedAntitheticNoise(looped_particles, match_second_moment)
        )
        with noise:
            return loss_fn(model, guide, *args, **kwargs)

    return loss_with_antithetic_noise
