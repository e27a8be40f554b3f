"""Preconditioner groups of P2D-VI and their step sizes: fixed, or measured (``eta="auto"``).

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
largest eigenvalue of the group's diagonal Hessian block by power iteration;
:class:`AutoStepSize` says how (``eta_j = scale / L_j``, over how many blocks, when
to measure again) and :class:`StepSizes` holds a run's step sizes and curvatures.

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..checks import check_positive_int
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


def _check_epochs(epochs: Sequence[float], name: str) -> tuple[float, ...]:
    """A sequence of positive finite numbers, returned sorted."""
    if isinstance(epochs, (str, bytes)) or not isinstance(epochs, Sequence):
        raise ValueError(
            f"Invalid {name}: {epochs!r}; use a sequence of positive numbers of epochs, e.g. (1,)"
        )
    for value in epochs:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(
                f"Invalid {name}: {epochs!r}; every entry must be a positive finite number of epochs"
            )
    return tuple(sorted(float(value) for value in epochs))


@dataclass(frozen=True)
class AutoStepSize:
    """How ``eta="auto"`` measures a group's step size: ``eta_j = scale / L_j`` with ``L_j``
    the largest curvature of the reduced block objective ``min_phi f_b`` in the group's
    params [1, Thm. 4.7], the largest ``|eigenvalue|`` of its Hessian block by power
    iteration (:func:`estimate_curvatures`), max over ``curvature_blocks`` blocks.

    Pass ``PDVI(..., eta=AutoStepSize(...))``; ``eta="auto"`` is ``AutoStepSize()``.

    :param scale: the constant in ``eta_j = scale / L_j``. The default 2 is a compromise
        measured in ``docs/benchmarks.md``: of 1, 2 and 4 it was best on the AutoDelta MAP
        test and for PD-VI on the quadratic, 1 was best for P2D-VI on the quadratic and 4
        for the consensus rule on the GMM.
    :param curvature_blocks: how many blocks are measured (the max is used).
    :param curvature_iterations: power iterations per group and block.
    :param remeasure_epochs: epochs (block visits / n) after which every ``"auto"`` group
        measures its curvature again, at the current ``lambda_0`` and local rows, and takes
        ``eta_j = scale / L_j`` with ``L_j`` the largest curvature measured so far: each
        measurement is a lower bound of the Lipschitz constant that [1, Thm. 4.7] asks
        for, so a step size only ever shrinks. The duals are kept (after an exact solve
        ``mu_b = -grad f_b``, whatever ``eta``) and ``lambda_0`` moves with
        ``h = H mean(mu)``, so the fixed point is unchanged. Each measurement costs what
        the set-up's does. Default ``()``: measure at set-up only. ``(1, 2)`` fixed a step
        2x too large on well-separated GMM clusters (``docs/benchmarks.md``, section 9).
    """

    scale: float = 2.0
    curvature_blocks: int = 4
    curvature_iterations: int = 6
    remeasure_epochs: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not self.scale > 0:
            raise ValueError(f"Invalid scale: {self.scale!r}; use a positive float")
        check_positive_int(self.curvature_blocks, "curvature_blocks")
        check_positive_int(self.curvature_iterations, "curvature_iterations")
        object.__setattr__(self, "remeasure_epochs", _check_epochs(self.remeasure_epochs, "remeasure_epochs"))


class StepSizes:
    """The step size ``eta_j`` of every group of a run, and the curvatures measured so far.

    :param groups: the resolved groups (:func:`resolve_groups`).
    :param layout: the layout of the global params.
    :param auto: how ``"auto"`` groups are measured.
    """

    def __init__(self, groups: list[Group], layout: GlobalLayout, auto: AutoStepSize) -> None:
        self.groups = groups
        self.auto = auto
        self.group_of = coordinate_groups(groups, layout)
        # Held in float64 on the host: a fixed eta is the user's float exactly.
        self.etas = torch.tensor(
            [0.0 if g.eta == "auto" else float(g.eta) for g in groups], dtype=torch.float64
        )
        self.curvatures: torch.Tensor | None = None
        self.remeasured = 0

    @property
    def measured_groups(self) -> torch.Tensor:
        """Which groups take ``eta_j = scale / L_j``, shape ``(J,)``."""
        return torch.tensor([g.eta == "auto" for g in self.groups])

    def measure(
        self,
        reduced_gradients: Sequence[Callable[[torch.Tensor], torch.Tensor]],
        point: torch.Tensor,
        relative_step: float | None = None,
    ) -> torch.Tensor:
        """Each group's curvature ``L_j`` at ``point``, the max over blocks of
        :func:`estimate_curvatures` of their reduced gradients.

        The curvature is that of the reduced block objective ``g_b(lambda) = min_phi
        f_b(phi, lambda)``, the function whose gradient the dual tracks (``mu_b = -grad g_b``
        after an exact primal solve). Where the locals are strongly coupled to the globals it
        is much smaller than the ``lambda``-block of the Hessian of ``f_b`` (5x on the
        linear-Gaussian test), and a step size from the latter is needlessly small.

        :param reduced_gradients: ``lambda -> grad g_b(lambda)`` of each measured block.
        :param point: ``lambda_0``, a flat vector.
        :param relative_step: the finite-difference step (see :func:`estimate_curvatures`).
        :returns: ``(J,)`` on the host.
        """
        curvatures = [
            estimate_curvatures(
                gradient,
                point,
                self.group_of,
                len(self.groups),
                self.auto.curvature_iterations,
                relative_step,
            )
            for gradient in reduced_gradients
        ]
        return torch.stack(curvatures).amax(0).cpu()

    def set_curvatures(self, curvatures: torch.Tensor) -> None:
        """Take ``eta_j = scale / L_j`` in every ``"auto"`` group from the first measurement.

        :raises ValueError: naming a group whose curvature is not a positive finite number.
        """
        for group, measured, curvature in zip(self.groups, self.measured_groups, curvatures.tolist()):
            if measured and not 0 < curvature < float("inf"):
                raise ValueError(
                    f"eta='auto' measured a curvature of {curvature} for group {group.name!r} "
                    f"(sites {group.sites}): the block objective does not change with them. Give "
                    "that group a fixed eta, or check that the sites are used by the model."
                )
        self.curvatures = curvatures.detach().to("cpu", torch.float64)
        self.etas = torch.where(self.measured_groups, self.auto.scale / self.curvatures, self.etas)

    def remeasure_due(self, block_visits: int, num_blocks: int) -> bool:
        """Whether the run has passed the next of ``remeasure_epochs`` (counted once)."""
        passed = sum(1 for e in self.auto.remeasure_epochs if block_visits >= e * num_blocks)
        if passed <= self.remeasured or self.curvatures is None:
            return False
        self.remeasured = passed
        return True

    def update_curvatures(self, measured: torch.Tensor) -> list[str]:
        """Keep the largest curvature of each group so far and its step size.

        :returns: the names of groups whose new measurement was unusable (kept as they were).
        """
        measured = measured.detach().to("cpu", torch.float64)
        usable = torch.isfinite(measured) & (measured > 0)
        self.curvatures = torch.where(usable, torch.maximum(self.curvatures, measured), self.curvatures)
        self.etas = torch.where(self.measured_groups, self.auto.scale / self.curvatures, self.etas)
        return [g.name for g, ok in zip(self.groups, usable.tolist()) if not ok]

    def per_coordinate(self, like: torch.Tensor) -> torch.Tensor:
        """``eta`` of every coordinate of the flat global vector, dtype and device of ``like``."""
        return self.etas.to(like)[self.group_of.to(like.device)]

    def as_dict(self) -> dict[str, float]:
        """``{group name: eta_j}``."""
        return {g.name: float(eta) for g, eta in zip(self.groups, self.etas)}

    def curvatures_as_dict(self) -> dict[str, float]:
        """``{group name: L_j}`` (empty before a measurement)."""
        if self.curvatures is None:
            return {}
        return {g.name: float(c) for g, c in zip(self.groups, self.curvatures)}

    def state_dict(self) -> dict[str, Any]:
        return {
            "groups": [g.name for g in self.groups],
            "group_step_sizes": self.etas.clone(),
            "remeasured": self.remeasured,
            "curvatures": None if self.curvatures is None else self.curvatures.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = [g.name for g in self.groups]
        if state["groups"] != names:
            raise ValueError(f"saved PDVI state has groups {state['groups']}, this PDVI has {names}")
        self.etas = state["group_step_sizes"].to(torch.float64)
        self.remeasured = state["remeasured"]
        curvatures = state["curvatures"]
        self.curvatures = None if curvatures is None else curvatures.to(torch.float64)
