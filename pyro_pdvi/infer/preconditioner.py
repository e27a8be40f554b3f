"""Preconditioner groups of P2D-VI and their step sizes.

P2D-VI replaces PD-VI's single step size by ``D = blkdiag(I/eta_1, ..., I/eta_J)``
over groups of the global parameters [1, Sec. 3.4]; its theory asks for
``eta_j ~ 1/L_j`` with ``L_j`` the Lipschitz constant of ``grad_lambda_j f_b``
[1, Thm. 4.7]. Groups are given like ``torch.optim`` param groups, keyed by
site name instead of tensor::

    groups=[{"sites": ["loc"], "eta": "auto"},
            {"sites": r"scale.*"},                    # a regex
            {"sites": lambda name: name.endswith("w"), "eta": 1e-3}]

or ``groups="per_site"`` (one group per global site). Sites in no group share
the default group. :func:`estimate_curvatures` measures each ``L_j`` as the
largest eigenvalue of the group's diagonal Hessian block by power iteration.

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .sites import GlobalLayout

SiteSelector = str | list[str] | tuple[str, ...] | Callable[[str], bool]
DEFAULT_GROUP = "default"


@dataclass
class Group:
    """One preconditioner group.

    :param name: group name, for diagnostics.
    :param sites: global site names in the group.
    :param eta: a fixed step size, or ``"auto"``.
    """

    name: str
    sites: list[str]
    eta: float | str


def check_eta(eta: float | str, where: str) -> float | str:
    """Validate a step size: a positive finite float or ``"auto"``."""
    if eta == "auto":
        return eta
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not eta > 0 or eta == float("inf"):
        raise ValueError(f'Invalid step size {where}: {eta!r}; use a positive float or "auto"')
    return float(eta)


def _select(selector: SiteSelector, names: list[str], where: str) -> list[str]:
    if callable(selector):
        return [name for name in names if selector(name)]
    if isinstance(selector, str):
        pattern = re.compile(selector)
        return [name for name in names if pattern.fullmatch(name)]
    if isinstance(selector, (list, tuple)):
        unknown = [name for name in selector if name not in names]
        if unknown:
            raise ValueError(
                f"{where} names sites that are not global params: {unknown}; global sites are {names}"
            )
        return list(selector)
    raise ValueError(
        f'{where}: "sites" must be a list of names, a regex string or a callable, '
        f"got {type(selector).__name__}"
    )


def resolve_groups(
    groups: list[dict] | str | None, site_names: list[str], default_eta: float | str
) -> list[Group]:
    """Assign every global site to exactly one group.

    :param groups: ``None`` (one group: PD-VI), ``"per_site"``, or a list of
        dicts with key ``"sites"`` and optional ``"eta"`` and ``"name"``.
    :param site_names: the global param sites.
    :param default_eta: step size of groups that give none, and of the default group.
    :raises ValueError: for a site in two groups, a group that matches no site,
        or an invalid step size.
    """
    default_eta = check_eta(default_eta, "eta")
    if groups is None:
        return [Group(DEFAULT_GROUP, list(site_names), default_eta)] if site_names else []
    if groups == "per_site":
        return [Group(name, [name], default_eta) for name in site_names]
    if isinstance(groups, str) or not isinstance(groups, (list, tuple)):
        raise ValueError(f'groups must be None, "per_site" or a list of dicts, got {groups!r}')
    resolved: list[Group] = []
    owner: dict[str, str] = {}
    for j, spec in enumerate(groups):
        where = f"groups[{j}]"
        if not isinstance(spec, dict) or "sites" not in spec:
            raise ValueError(f'{where} must be a dict with a "sites" key, got {spec!r}')
        extra = set(spec) - {"sites", "eta", "name"}
        if extra:
            raise ValueError(f'{where} has unknown keys {sorted(extra)}; allowed: "sites", "eta", "name"')
        name = str(spec.get("name", f"group{j}"))
        sites = _select(spec["sites"], site_names, where)
        if not sites:
            raise ValueError(f"{where} ({name!r}) matches no global site; global sites are {site_names}")
        for site in sites:
            if site in owner:
                raise ValueError(
                    f'site "{site}" is in two preconditioner groups, {owner[site]!r} and {name!r}; '
                    "put each site in one group"
                )
            owner[site] = name
        resolved.append(Group(name, sites, check_eta(spec.get("eta", default_eta), where)))
    rest = [name for name in site_names if name not in owner]
    if rest:
        resolved.append(Group(DEFAULT_GROUP, rest, default_eta))
    return resolved


def coordinate_groups(groups: list[Group], layout: GlobalLayout) -> torch.Tensor:
    """Group index of every coordinate of the flat global vector, shape (P,)."""
    index = torch.empty(layout.size, dtype=torch.long)
    for j, group in enumerate(groups):
        for site in group.sites:
            index[layout.slices[site]] = j
    return index


def estimate_curvatures(
    gradient: Callable[[torch.Tensor], torch.Tensor],
    point: torch.Tensor,
    group_of: torch.Tensor,
    num_groups: int,
    num_iterations: int = 10,
    relative_step: float | None = None,
) -> torch.Tensor:
    """Largest |eigenvalue| of each group's diagonal block of the Hessian.

    Power iteration with Hessian-vector products by central differences of
    ``gradient``, which works for every Pyro ELBO (some of their custom
    autograd functions have no double backward).

    :param gradient: ``lambda -> grad f(lambda)`` (deterministic: fix the noise).
    :param point: where to measure, a flat vector.
    :param group_of: group index per coordinate, from :func:`coordinate_groups`.
    :param num_groups: J.
    :param num_iterations: power iterations per group.
    :param relative_step: finite-difference step relative to ``1 + max|point|``;
        default ``sqrt(eps)``. A gradient that is itself only solved to some
        accuracy (a reduced objective) needs a larger step.
    :returns: ``L_j`` for each group, shape (J,).
    """
    generator = torch.Generator().manual_seed(0)
    group_of = group_of.to(point.device)
    if relative_step is None:
        relative_step = float(torch.finfo(point.dtype).eps) ** 0.5
    scale = relative_step * (1.0 + float(point.abs().max()))
    curvatures = torch.zeros(num_groups, dtype=point.dtype, device=point.device)
    for j in range(num_groups):
        mask = (group_of == j).to(point.dtype)
        v = torch.randn(point.shape, generator=generator, dtype=point.dtype).to(point.device) * mask
        v = v / v.norm()
        for _ in range(num_iterations):
            hv = (gradient(point + scale * v) - gradient(point - scale * v)) / (2 * scale)
            hv = hv * mask
            norm = hv.norm()
            if not norm > 0:
                break
            v = hv / norm
        curvatures[j] = norm
    return curvatures
