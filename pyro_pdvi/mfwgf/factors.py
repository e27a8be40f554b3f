"""Mean-field factors: which coordinates move together, and draws from their product.

A factor is a set of unconstrained coordinates whose joint distribution ``q_j`` MF-WGF
keeps as it is; different factors are independent under ``q = q_1 ⊗ ... ⊗ q_m``
[1, Sec. 3.1]. ``factors="coordinate"`` (the default, as ``AutoNormal``) makes every
scalar coordinate a factor; ``"site"`` one factor per site; a list groups sites.

The mean-field drift of factor ``j`` is ``E_{q_{-j}}[grad_j log p(theta_j, theta_{-j})]``
[1, eq. 16]. :func:`product_configurations` estimates it for *all* factors with one batch:
permuting each factor's particles by its own random permutation turns the ``P`` particle
rows into ``P`` draws from the product of the factors' empirical measures, so the
gradient at row ``i`` is, for every factor ``l``, a drift sample for particle
``perm_l[i]`` with the other factors drawn independently of it.

[1] Yao, Yang (2022), "Mean-field variational inference via Wasserstein gradient flow",
    arXiv:2207.08074.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .sites import SiteLayout

FactorSpec = str | Sequence[str | Sequence[str]]


@dataclass(frozen=True)
class FactorLayout:
    """The factor of every coordinate.

    :param factor_of: factor index of each unconstrained coordinate, ``(D,)`` (long).
    :param names: a readable name per factor, e.g. ``"loc[2]"`` or ``"loc+scale"``.
    """

    factor_of: torch.Tensor
    names: tuple[str, ...]

    @property
    def num_factors(self) -> int:
        """m, the number of factors."""
        return len(self.names)

    @property
    def all_scalar(self) -> bool:
        """Whether every factor is one coordinate."""
        return self.num_factors == self.factor_of.shape[0]


def resolve_factors(factors: FactorSpec, layout: SiteLayout) -> FactorLayout:
    """Assign every coordinate to one factor.

    :param factors: ``"coordinate"``, ``"site"``, or a list whose items are a site name or a
        list of site names (one factor each); sites not listed get one factor per coordinate.
    :param layout: the model's latent sites.
    :raises ValueError: for an unknown spec, a name that is not a continuous latent site,
        or a site in two factors.
    """
    names = layout.names
    if factors == "coordinate":
        groups: list[list[str]] = []
    elif factors == "site":
        groups = [[name] for name in names]
    elif isinstance(factors, (list, tuple)):
        groups = [[item] if isinstance(item, str) else list(item) for item in factors]
    else:
        raise ValueError(
            f'Invalid factors: {factors!r}; use "coordinate", "site" or a list of site-name lists'
        )
    owner: dict[str, int] = {}
    for j, group in enumerate(groups):
        if not group:
            raise ValueError(f"factors[{j}] is empty; list at least one site name")
        for name in group:
            if name not in names:
                raise ValueError(
                    f'factors[{j}] names "{name}", which is not a continuous latent site; '
                    f"the sites are {names}"
                )
            if name in owner:
                raise ValueError(
                    f'site "{name}" is in factors[{owner[name]}] and factors[{j}]; use one factor'
                )
            owner[name] = j
    sites = {site.name: site for site in layout.sites}
    factor_of = torch.empty(layout.size, dtype=torch.long, device="cpu")
    labels: list[str] = []
    for group in groups:
        for name in group:
            factor_of[sites[name].coordinates] = len(labels)
        labels.append("+".join(group))
    for site in layout.sites:
        if site.name in owner:
            continue
        for k in range(site.size):
            factor_of[site.start + k] = len(labels)
            labels.append(site.name if site.size == 1 else f"{site.name}[{k}]")
    return FactorLayout(factor_of, tuple(labels))


def product_configurations(
    particles: torch.Tensor, factors: FactorLayout, num_draws: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``num_draws * P`` draws from the product of the factors' empirical measures.

    :param particles: ``(P, D)``.
    :param factors: the factor layout.
    :param num_draws: R, independent sets of permutations.
    :param generator: the engine's random generator.
    :returns: configurations ``(R * P, D)`` and ``index (R, P, D)``: row ``i`` of draw ``r``
        takes coordinate ``d`` from particle ``index[r, i, d]``.
    """
    num_particles = particles.shape[0]
    device = particles.device
    keys = torch.rand(num_draws, factors.num_factors, num_particles, generator=generator, device=device)
    permutations = keys.argsort(-1)  # (R, m, P)
    index = permutations[:, factors.factor_of.to(device), :].transpose(1, 2)  # (R, P, D)
    configurations = particles.gather(0, index.reshape(-1, particles.shape[1]))
    return configurations, index


def drift_per_particle(gradients: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Send each configuration's gradient back to the particles it came from.

    :param gradients: ``(R * P, D)`` at the configurations of :func:`product_configurations`.
    :param index: its ``index``, ``(R, P, D)``.
    :returns: ``(R, P, D)``: entry ``[r, k, d]`` is the gradient in coordinate ``d`` at the
        draw ``r`` configuration that took coordinate ``d`` from particle ``k``.
    """
    per_draw = gradients.reshape(index.shape)
    return torch.zeros_like(per_draw).scatter_(1, index, per_draw)
