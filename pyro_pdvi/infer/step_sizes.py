"""Preconditioner groups of P2D-VI and their step sizes: fixed, or measured (``eta="auto"``).

P2D-VI replaces PD-VI's single step size by ``D = blkdiag(I/eta_1, ..., I/eta_J)``
over groups of the global parameters [1, Sec. 3.4]; its theory asks for
``eta_j ~ 1/L_j`` with ``L_j`` the Lipschitz constant of ``grad_lambda_j f_b``
[1, Thm. 4.7]. Groups are given like ``torch.optim`` param groups, keyed by
site name instead of tensor::

    groups=[{"sites": ["loc"], "eta": "auto"},
            {"sites": r"scale.*"},                    # a regex
            {"sites": lambda name: name.endswith("w"), "eta": 1e-3},
            {"sites": ["m"], "eta": eta_m}]           # a tensor shaped like site m

or ``groups="per_site"`` (one group per global site). A tensor ``eta`` fixes a step size per
coordinate of a one-site group (where a model's curvatures are known in closed form, as the
spatial fit's). Sites in no group share
the default group. :func:`estimate_curvatures` measures each ``L_j`` as the
largest eigenvalue of the group's diagonal Hessian block by power iteration;
:class:`AutoStepSize` says how (``eta_j = scale / L_j``, over how many blocks, when
to measure again) and :class:`StepSizes` holds a run's step sizes and curvatures.

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
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
    :param eta: a fixed step size, a tensor of them shaped like the group's one site, or ``"auto"``.
    """

    name: str
    sites: list[str]
    eta: float | str | torch.Tensor


def check_eta(eta: float | str | torch.Tensor, where: str) -> float | str | torch.Tensor:
    """Validate a step size: a positive finite float, ``"auto"`` or a tensor of positive finite
    floats (returned detached, float64, on the host)."""
    if isinstance(eta, torch.Tensor):
        eta = eta.detach().to("cpu", torch.float64)
        if eta.numel() == 0 or not bool((torch.isfinite(eta) & (eta > 0)).all()):
            raise ValueError(f"Invalid step sizes {where}: every entry must be a positive finite float")
        return eta
    if isinstance(eta, str) and eta == "auto":
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
        eta = check_eta(spec.get("eta", default_eta), where)
        if isinstance(eta, torch.Tensor) and len(sites) != 1:
            raise ValueError(
                f"{where} ({name!r}) has a tensor eta and {len(sites)} sites {sites}: a step size per "
                "coordinate needs a group of one site"
            )
        resolved.append(Group(name, sites, eta))
    rest = [name for name in site_names if name not in owner]
    if rest:
        resolved.append(Group(DEFAULT_GROUP, rest, default_eta))
    return resolved


def _group_eta(group: Group) -> float:
    """A group's one step size: 0 for ``"auto"`` (not measured yet), the geometric mean of a
    tensor's (for reports; the coordinates keep their own)."""
    if isinstance(group.eta, str):
        return 0.0
    if isinstance(group.eta, torch.Tensor):
        return float(group.eta.log().mean().exp())
    return float(group.eta)


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


#: :func:`diagonal_curvature` is exact (a product with every unit vector) where that costs at most
#: this many times the Rademacher probes' products.
EXACT_DIAGONAL_FACTOR = 2


def diagonal_curvature(
    hessian_products: Callable[[torch.Tensor], torch.Tensor],
    point: torch.Tensor,
    num_probes: int,
) -> torch.Tensor:
    """Hutchinson's estimate of the Hessian's diagonal, ``|mean_k v_k * (H v_k)|`` over
    Rademacher probes ``v_k``. Exact in one probe for a diagonal Hessian; off-diagonal terms add
    noise of mean zero. Where ``P`` is at most :data:`EXACT_DIAGONAL_FACTOR` times the probes,
    the diagonal is read exactly from the products with the ``P`` unit vectors instead.

    Why: where a coordinate is tied to a much stiffer one, the noise is larger than its diagonal.
    Measured on a linear regression with ``AutoLowRankMultivariateNormal`` (``P = 6``, four
    blocks of i.i.d. data, three seeds, each block's first measurement): four probes were off
    the exact diagonal of ``cov_factor``'s coordinates by factors up to 20 and once 165; how many
    blocks inform a coordinate (:mod:`~pyro_pdvi.infer.consensus`) then follows that noise.

    :param hessian_products: ``V -> V H`` for directions ``V`` of shape ``(k, P)``, at the point
        measured (deterministic: fix the noise).
    :param point: where it is measured, a flat vector (for the probes' shape and dtype).
    :param num_probes: Rademacher probes.
    :returns: ``(P,)``, non-negative.
    """
    size = point.numel()
    if size <= EXACT_DIAGONAL_FACTOR * num_probes:
        units = torch.eye(size, dtype=point.dtype, device=point.device).reshape(size, *point.shape)
        return (units * hessian_products(units)).sum(0).abs()
    generator = torch.Generator().manual_seed(0)
    probes = (2 * torch.randint(0, 2, (num_probes, *point.shape), generator=generator) - 1).to(point)
    return (probes * hessian_products(probes)).mean(0).abs()


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


#: Rules of ``eta="auto"`` (:class:`AutoStepSize`).
RULES = ("auto", "natural", "curvature")

#: The natural rule follows a coordinate's Fisher information when it moved by more than this factor.
FISHER_TOLERANCE = 2.0

#: ...and its step size grows by at most this factor at each update (once an epoch): the duals were
#: gathered under the smaller one, and ``lambda_0`` moves with ``h = H mean(mu)``. Measured on the
#: issue-13 suite (``docs/benchmarks.md`` 13o): AutoNormal's scales start at 0.1 and are held there
#: through the first epoch (:mod:`~pyro_pdvi.infer.scales`), so where the posterior's sds are
#: larger the locations' step sizes jumped up to 19x (logistic regression) and 28x (with a latent
#: per datum) after it, and the latter's means doubled their error in one step. Growing 4x an epoch,
#: over four seeds: at 2.5 CPU s its means, sds and ELBO gap were 1.3x, 2.3x and 1.4x closer (level
#: from 10 s on), the logistic regression's means 1.1-1.2x closer at 2.5-20 s (within the spread
#: between runs of the same code there); a factor 2 left the latter's means 2.4x further after 12
#: epochs (one seed), a factor 8 the former's means, sds and ELBO gap 1.5-1.9x further at 2.5 s
#: (four seeds). Shrinking is followed at once.
FISHER_STEP_GROWTH = 4.0

#: The natural rule's bound ``eta_j <= BLOCK_CURVATURE_BOUND / max_b h_bj`` (measured on the issue-13
#: suite: 2 slowed the logistic regression 10x, 32 let the mixed model's per-group effects oscillate).
BLOCK_CURVATURE_BOUND = 8.0

#: While the guide's Fisher information is the one measured at the start (the first epoch, where
#: the scales are held at the guide's initial values: :mod:`~pyro_pdvi.infer.scales`), the natural
#: rule's step sizes are also at most ``scale / mean_b c_bj`` (``scale`` the coordinate's constant,
#: a round site's included: :meth:`StepSizes.set_site_scale`), the mean over the blocks measured so
#: far of their diagonal curvature: the block's share of the objective's curvature that the Fisher
#: stands for once the scales are set, measured instead of read off a start that no data informed.
#: Where the posterior is narrower than the guide's start (AutoNormal's scale 0.1 against sds of
#: 0.01), the start's Fisher gave step sizes 9-24x the natural rule's at the optimum (``biglogreg``,
#: ``docs/benchmarks.md`` 13za): the first epoch, under the paper's rule, then took the means from
#: 0.52 to 0.87 and left curvatures measured there that held the step sizes 2-6x too large for
#: several epochs. Where it is wider (the small regressions: sds 0.35 against 0.1) the start's
#: Fisher is the smaller step size and this changes nothing.
START_CURVATURE_FLOOR = True

#: The default ``scale`` of each rule.
DEFAULT_SCALES = {"natural": 1.0, "curvature": 2.0}

#: The natural rule's constant that ``rule="auto"`` takes where short block solves (at most
#: :data:`SHORT_SOLVE_STEPS` evaluations, the generic solver's default 3) also fit continuous local
#: rows (a latent per datum: PPCA's factors, a random effect per datum): a penalty 4x stiffer.
#: Measured on the issue-13 suite (``docs/benchmarks.md`` 13p, four seeds, mean at 2.5 / 5 / 10 /
#: 20 CPU s, against the constant 1): the hierarchical model's E[mu] 1.6-11x / 1.9-38x / 6x / 5x
#: closer (three runs of 1/4 at 2.5 and 5 s, where its error falls by orders of magnitude),
#: PPCA's ELBO gap level / 3.6x / 4.3x closer and then 1.3x further, the overdispersed logistic
#: regression's means 1.8x / 1.5-2.3x / 1.6x closer and level at 20 s. The models with global latents
#: only want the larger steps (13n, at 5 / 20 s: 0.25 left the scale regression's means 16x / 14x
#: and the logistic regression's 2.8x / 2x further), and discrete rows set by their closed-form update
#: (:mod:`~pyro_pdvi.infer.local_cavi`: the GMM) do not count. Long solves keep 1: with 20
#: evaluations the stiffer penalty converged more slowly late in the run (a hierarchical toy, 20
#: blocks: 4.5x further after 10 epochs; with antithetic pairs, where the solves are exact in the
#: means, 0.022 against 6e-5 after 10 epochs on 4 blocks).
NATURAL_SCALE_WITH_LOCALS = 0.25

#: A round site's natural constant is ``min(1, ROUND_SITE_CONSTANT / sqrt(n))``
#: (:func:`round_site_scale`). The quadratic model of the consensus iteration
#: (``benchmarks/consensus_rate.py``, exact solves, one block per step) put the best constant of
#: a diagonal curvature at 0.5 / 0.25 / 0.125 for 6 / 20 / 100 blocks (``docs/benchmarks.md``
#: 13zd): the best penalty ``D_j = F_j / (c n)`` is about ``sqrt(n) / 1.2`` times a block's share of
#: the curvature, the geometric mean of a block's curvature and the whole's.
ROUND_SITE_CONSTANT = 1.2


def round_site_scale(num_blocks: int) -> float:
    """The natural rule's constant on a site that a diagonal penalty leaves round, for a run of
    ``num_blocks`` blocks: ``min(1, ROUND_SITE_CONSTANT / sqrt(n))``.

    :param num_blocks: n.
    """
    return min(1.0, ROUND_SITE_CONSTANT / num_blocks**0.5)


#: The most evaluations of a block solve (``GenericSolver(inner_steps=...)``, default 3) that count
#: as short for :data:`NATURAL_SCALE_WITH_LOCALS`.
SHORT_SOLVE_STEPS = 5


@dataclass(frozen=True)
class AutoStepSize:
    """How ``eta="auto"`` sets the step sizes of its groups.

    * ``rule="auto"`` (default): the natural rule for the generic solver, the curvature rule
      for a model's own (closed-form) solver, which measures the reduced curvature through it.
      Where the generic solver's short solves (its default) also fit continuous local rows (a
      latent per datum), the natural rule's default constant is
      :data:`NATURAL_SCALE_WITH_LOCALS` (a 4x stiffer penalty, measured faster there), else 1.
    * ``rule="natural"``: a step size per coordinate, ``eta_j = scale * n / F_j``
      with ``F_j`` the guide's Fisher information in param coordinate ``j``
      (:mod:`~pyro_pdvi.infer.fisher`), measured again after every epoch, so that each block's
      penalty ``1/2 ||lambda_b - lambda_0||^2_D`` is ``1/scale`` of a block's share of the
      objective's curvature in every coordinate. Coordinates with ``F_j = 0`` (Delta or
      unused params) take their group's curvature rule.
    * ``rule="curvature"``: one step size per group, ``eta_j = scale / L_j`` with ``L_j`` the
      largest curvature of the reduced block objective ``min_phi f_b`` in the group's params
      [1, Thm. 4.7], the largest ``|eigenvalue|`` of its Hessian block by power iteration
      (:func:`estimate_curvatures`), max over ``curvature_blocks`` blocks.

    Pass ``PDVI(..., eta=AutoStepSize(...))``; ``eta="auto"`` is ``AutoStepSize()``.

    :param rule: ``"auto"``, ``"natural"`` or ``"curvature"``.
    :param scale: the constant of the rule (default :data:`DEFAULT_SCALES`, and under
        ``rule="auto"`` where short solves fit local rows :data:`NATURAL_SCALE_WITH_LOCALS`). For
        ``"curvature"`` the default 2 is a compromise measured in ``docs/benchmarks.md``: of
        1, 2 and 4 it was best on the AutoDelta MAP test and for PD-VI on the quadratic.
    :param fisher_samples: draws of the guide's latents per block for ``F_j`` of the guide sites
        without a closed form (a Gaussian site's is exact: :mod:`~pyro_pdvi.infer.fisher`).
    :param fisher_blocks: blocks the Fisher estimate averages.
    :param curvature_probes: Rademacher probes of each block's diagonal curvature (natural
        rule: measured after the block's first solve, it bounds ``eta_j <= 8 / max_b h_bj``);
        where the globals have at most twice as many coordinates, it is measured exactly
        (:func:`diagonal_curvature`).
    :param curvature_blocks: how many blocks are measured (the max is used).
    :param curvature_iterations: power iterations per group and block.
    :param whiten: under the natural rule, whether the small global sites (2 to
        :data:`~pyro_pdvi.infer.whitening.MAX_WHITENED_COORDINATES` coordinates; all sites as one
        group where they have that many together, :func:`~pyro_pdvi.infer.whitening.joint_group`,
        or with larger sites where those are a random effect's,
        :func:`~pyro_pdvi.infer.whitening.probed_block_hessians`)
        get a dense penalty, ``F_s / (c n)`` with ``F_s`` the blocks' summed Hessian on the site
        measured at the end of the first epoch, where a diagonal one leaves ``F_s``
        ill-conditioned (:mod:`~pyro_pdvi.infer.whitening`).
    :param whitened_scale: the constant ``c`` of the natural rule on a whitened site (a dense
        penalty's best constant was 0.125-0.25 on every model of ``docs/benchmarks.md`` 13zb's
        quadratic model).
    :param remeasure_epochs: with the curvature rule, epochs (block visits / n) after which
        every ``"auto"`` group measures its curvature again, at the current ``lambda_0`` and
        local rows, and takes ``eta_j = scale / L_j`` with ``L_j`` the largest curvature
        measured so far (a step size only ever shrinks). The duals are kept (after an exact
        solve ``mu_b = -grad f_b``, whatever ``eta``) and ``lambda_0`` moves with
        ``h = H mean(mu)``, so the fixed point is unchanged (``docs/benchmarks.md``, section 9).
    """

    rule: str = "auto"
    scale: float | None = None
    fisher_samples: int = 16
    fisher_blocks: int = 2
    curvature_probes: int = 4
    curvature_blocks: int = 4
    curvature_iterations: int = 6
    remeasure_epochs: tuple[float, ...] = ()
    whiten: bool = True
    whitened_scale: float = 0.25

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"Invalid rule: {self.rule!r}; use one of {RULES}")
        if self.scale is None and self.rule != "auto":
            object.__setattr__(self, "scale", DEFAULT_SCALES[self.rule])
        if self.scale is not None and (
            isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not self.scale > 0
        ):
            raise ValueError(f"Invalid scale: {self.scale!r}; use a positive float")
        if not isinstance(self.whiten, bool):
            raise ValueError(f"Invalid whiten: {self.whiten!r}; use True or False")
        scale = self.whitened_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
            raise ValueError(f"Invalid whitened_scale: {scale!r}; use a positive float")
        for name in (
            "fisher_samples",
            "fisher_blocks",
            "curvature_probes",
            "curvature_blocks",
            "curvature_iterations",
        ):
            check_positive_int(getattr(self, name), name)
        object.__setattr__(self, "remeasure_epochs", _check_epochs(self.remeasure_epochs, "remeasure_epochs"))

    def resolved(self, generic_solver: bool, short_solves_fit_locals: bool = False) -> AutoStepSize:
        """The rule ``"auto"`` made concrete for a run with or without the generic solver, and
        whether its short solves also fit continuous local rows (the natural rule's constant is
        then :data:`NATURAL_SCALE_WITH_LOCALS`, unless ``scale`` was given)."""
        if self.rule != "auto":
            return self
        if not generic_solver:
            return replace(self, rule="curvature")
        scale = NATURAL_SCALE_WITH_LOCALS if self.scale is None and short_solves_fit_locals else self.scale
        return replace(self, rule="natural", scale=scale)


class StepSizes:
    """The step sizes of a run: per group (fixed, or ``scale / L_j`` from a measured
    curvature) and, with the natural rule, per coordinate from the guide's Fisher information.

    :param groups: the resolved groups (:func:`resolve_groups`).
    :param layout: the layout of the global params.
    :param auto: how ``"auto"`` groups are measured.
    :param num_blocks: n.
    """

    def __init__(
        self, groups: list[Group], layout: GlobalLayout, auto: AutoStepSize, num_blocks: int
    ) -> None:
        self.groups = groups
        self.auto = auto
        self.num_blocks = num_blocks
        self.group_of = coordinate_groups(groups, layout)
        # Held in float64 on the host: a fixed eta is the user's float exactly. A group with a
        # step size per coordinate holds them in ``coordinate_etas`` (NaN elsewhere).
        self.coordinate_etas = torch.full((layout.size,), float("nan"), dtype=torch.float64)
        shapes = {site.name: tuple(site.shape) for site in layout.sites}
        for group in groups:
            if isinstance(group.eta, torch.Tensor):
                site = group.sites[0]
                shape = shapes[site]
                if tuple(group.eta.shape) != tuple(shape):
                    raise ValueError(
                        f"group {group.name!r}: its eta has shape {tuple(group.eta.shape)}, site "
                        f'"{site}" has shape {tuple(shape)}; give one step size per coordinate'
                    )
                self.coordinate_etas[layout.slices[site]] = group.eta.reshape(-1)
        self.etas = torch.tensor([_group_eta(g) for g in groups], dtype=torch.float64)
        self.curvatures: torch.Tensor | None = None
        self.fisher: torch.Tensor | None = None
        self.block_curvature: torch.Tensor | None = None
        #: ``sum_b c_bj`` over the measured blocks and how many they are (the start's bound).
        self.block_curvature_sum: torch.Tensor | None = None
        self.measured_blocks = 0
        #: Whether the Fisher information in use is the one measured at the start.
        self.fisher_at_start = False
        #: A factor on every step size (:mod:`~pyro_pdvi.infer.safeguard` halves it).
        self.damping = 1.0
        #: A factor per coordinate, flat (:mod:`~pyro_pdvi.infer.stationarity` halves them).
        self.decay: torch.Tensor | None = None
        #: The natural rule's constant per coordinate, flat, where a site's differs from
        #: ``auto.scale`` (:meth:`set_site_scale`); ``None`` where none does.
        self.site_scales: torch.Tensor | None = None
        self.remeasured = 0

    @property
    def measured_groups(self) -> torch.Tensor:
        """Which groups set their step sizes themselves (``"auto"``), shape ``(J,)``."""
        return torch.tensor([isinstance(g.eta, str) for g in self.groups])

    @property
    def curvature_scale(self) -> float:
        """The constant of ``eta_j = scale / L_j`` (the curvature rule's default under the natural one)."""
        return DEFAULT_SCALES["curvature"] if self.auto.rule == "natural" else self.auto.scale

    @property
    def natural(self) -> bool:
        """Whether ``"auto"`` groups follow the guide's Fisher information."""
        return self.auto.rule == "natural" and bool(self.measured_groups.any())

    def set_fisher(self, fisher: torch.Tensor) -> bool:
        """Take the guide's Fisher diagonal at the current ``lambda_0`` (natural rule) where it
        moved by more than a factor :data:`FISHER_TOLERANCE` from the one in use: a new step size
        moves ``lambda_0`` (``h = H mean(mu)``), so noise in the estimate is not followed. Where
        it fell, by at most a factor :data:`FISHER_STEP_GROWTH` (the step size grows at most
        that much); the next updates take the rest.

        :returns: whether any coordinate's step size changed.
        """
        fisher = fisher.detach().to("cpu", torch.float64)
        # A coordinate whose estimate is not finite keeps the value in use (none: uninformed).
        fisher = torch.where(torch.isfinite(fisher), fisher, 0.0 if self.fisher is None else self.fisher)
        if self.fisher is None:
            self.fisher = fisher
            self.fisher_at_start = True
            return True
        self.fisher_at_start = False
        fisher = torch.where(fisher > 0, fisher.clamp(min=self.fisher / FISHER_STEP_GROWTH), fisher)
        moved = (fisher > FISHER_TOLERANCE * self.fisher) | (fisher * FISHER_TOLERANCE < self.fisher)
        self.fisher = torch.where(moved, fisher, self.fisher)
        return bool(moved.any())

    def bound_block_curvature(self, curvatures: torch.Tensor) -> bool:
        """Take more blocks' diagonal curvatures (:func:`diagonal_curvature`) into the bound
        ``eta_j <= 8 / max_b h_bj`` of the natural rule and, while the Fisher information is the
        start's, into ``eta_j <= scale / mean_b h_bj`` (:data:`START_CURVATURE_FLOOR`).

        :param curvatures: one row per block, shape ``(m, P)``.
        :returns: whether any coordinate's bound changed.
        """
        curvatures = curvatures.detach().to("cpu", torch.float64).reshape(-1, curvatures.shape[-1])
        total = curvatures.sum(0)
        if self.block_curvature_sum is not None:
            total = total + self.block_curvature_sum
        self.block_curvature_sum = total
        self.measured_blocks += len(curvatures)
        curvature = curvatures.amax(0)
        if self.block_curvature is None:
            self.block_curvature = curvature
            return True
        grew = bool((curvature > self.block_curvature).any())
        self.block_curvature = torch.maximum(self.block_curvature, curvature)
        return grew or self._start_bound_applies()

    def _start_bound_applies(self) -> bool:
        """Whether ``eta_j <= scale / mean_b h_bj`` bounds the natural rule now."""
        return START_CURVATURE_FLOOR and self.fisher_at_start and self.block_curvature_sum is not None

    def needs_curvature(self) -> bool:
        """Whether some ``"auto"`` coordinate takes the curvature rule: all of them under that
        rule, those with no Fisher information under the natural one."""
        if not bool(self.measured_groups.any()):
            return False
        if not self.natural:
            return True
        if self.fisher is None:
            raise RuntimeError("set_fisher before asking whether the curvature rule is needed")
        auto = self.measured_groups[self.group_of]
        return bool((auto & ~(self.fisher > 0)).any())

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
        needed = self.measured_groups.clone()
        if self.natural:  # only groups with coordinates that have no Fisher information
            for j in range(len(self.groups)):
                needed[j] &= bool((self.fisher[self.group_of == j] == 0).any())
        for group, measured, curvature in zip(self.groups, needed, curvatures.tolist()):
            if measured and not 0 < curvature < float("inf"):
                raise ValueError(
                    f"eta='auto' measured a curvature of {curvature} for group {group.name!r} "
                    f"(sites {group.sites}): the block objective does not change with them. Give "
                    "that group a fixed eta, or check that the sites are used by the model."
                )
        self.curvatures = curvatures.detach().to("cpu", torch.float64)
        self.etas = torch.where(self.measured_groups, self.curvature_scale / self.curvatures, self.etas)

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
        self.etas = torch.where(self.measured_groups, self.curvature_scale / self.curvatures, self.etas)
        return [g.name for g, ok in zip(self.groups, usable.tolist()) if not ok]

    def natural_coordinates(self) -> torch.Tensor:
        """Which coordinates take the natural rule's step size (``eta_j = scale * n / F_j``, a
        block's share of their curvature): an ``"auto"`` group's coordinates with Fisher
        information, under the natural rule; flat, boolean, on the host."""
        if not self.natural or self.fisher is None:
            return torch.zeros_like(self.group_of, dtype=torch.bool)
        return (self.measured_groups[self.group_of] & (self.fisher > 0)).cpu()

    def set_site_scale(self, coordinates: torch.Tensor, scale: float) -> None:
        """Give the natural rule the constant ``scale`` on ``coordinates`` (flat indices) in place
        of ``auto.scale``, in the first epoch's bound too (:data:`START_CURVATURE_FLOOR`): a round
        site's (:meth:`~pyro_pdvi.infer.upkeep.StepSizeUpkeep._set_round_sites_scale`).

        :param coordinates: flat indices of the global coordinates, a LongTensor.
        :param scale: their constant ``c`` in ``eta_j = c n / F_j``.
        """
        if self.site_scales is None:
            self.site_scales = torch.full_like(self.coordinate_etas, self.auto.scale)
        self.site_scales[coordinates.cpu()] = scale

    def per_coordinate(self, like: torch.Tensor) -> torch.Tensor:
        """``eta`` of every coordinate of the flat global vector, dtype and device of ``like``."""
        etas = self.etas[self.group_of]
        etas = torch.where(torch.isnan(self.coordinate_etas), etas, self.coordinate_etas)
        if self.natural and self.fisher is not None:
            # Coordinates without Fisher information keep their group's curvature rule.
            informed = self.measured_groups[self.group_of] & (self.fisher > 0)
            tiny = torch.finfo(torch.float64).tiny
            scale = self.auto.scale if self.site_scales is None else self.site_scales
            natural = scale * self.num_blocks / self.fisher.clamp(min=tiny)
            if self.block_curvature is not None:
                # A coordinate that few blocks inform is as stiff in one block as in all of them.
                natural = torch.minimum(natural, BLOCK_CURVATURE_BOUND / self.block_curvature.clamp(min=tiny))
            if self._start_bound_applies():
                # The start's Fisher says nothing of the posterior: the measured curvature does.
                mean = self.block_curvature_sum / self.measured_blocks
                bound = scale / mean.clamp(min=tiny)
                natural = torch.where(mean > 0, torch.minimum(natural, bound), natural)
            etas = torch.where(informed, natural, etas)
        # A collapsed scale (Fisher ~ 1/sigma^2 huge) must not round eta to 0 in ``like``'s
        # dtype: the dual step divides by it.
        if self.decay is not None:
            etas = self.decay * etas
        return (self.damping * etas).clamp(min=torch.finfo(like.dtype).tiny ** 0.5).to(like)

    def as_dict(self) -> dict[str, float]:
        """``{group name: eta_j}``: a group's step size, or where its coordinates differ (the
        natural rule) their geometric mean."""
        etas = self.per_coordinate(torch.zeros((), dtype=torch.float64))
        summary = {}
        for j, group in enumerate(self.groups):
            values = etas[self.group_of == j]
            equal = bool((values == values[0]).all())
            summary[group.name] = float(values[0] if equal else values.log().mean().exp())
        return summary

    def curvatures_as_dict(self) -> dict[str, float]:
        """``{group name: L_j}`` (empty before a measurement)."""
        if self.curvatures is None:
            return {}
        return {g.name: float(c) for g, c in zip(self.groups, self.curvatures)}

    def state_dict(self) -> dict[str, Any]:
        total = self.block_curvature_sum
        return {
            "groups": [g.name for g in self.groups],
            "group_step_sizes": self.etas.clone(),
            "remeasured": self.remeasured,
            "curvatures": None if self.curvatures is None else self.curvatures.clone(),
            "fisher": None if self.fisher is None else self.fisher.clone(),
            "block_curvature": None if self.block_curvature is None else self.block_curvature.clone(),
            "block_curvature_sum": None if total is None else total.clone(),
            "measured_blocks": self.measured_blocks,
            "fisher_at_start": self.fisher_at_start,
            "damping": self.damping,
            "decay": None if self.decay is None else self.decay.clone(),
            "site_scales": None if self.site_scales is None else self.site_scales.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = [g.name for g in self.groups]
        if state["groups"] != names:
            raise ValueError(f"saved PDVI state has groups {state['groups']}, this PDVI has {names}")
        self.etas = state["group_step_sizes"].to(torch.float64)
        self.remeasured = state["remeasured"]
        curvatures, fisher = state["curvatures"], state["fisher"]
        self.curvatures = None if curvatures is None else curvatures.to(torch.float64)
        self.fisher = None if fisher is None else fisher.to(torch.float64)
        self.damping = state["damping"]
        decay = state.get("decay")  # absent from checkpoints before the stationarity test
        self.decay = None if decay is None else decay.to(torch.float64)
        site_scales = state.get("site_scales")  # absent from checkpoints before the round sites'
        self.site_scales = None if site_scales is None else site_scales.to(torch.float64)
        bound = state["block_curvature"]
        self.block_curvature = None if bound is None else bound.to(torch.float64)
        # Absent from checkpoints before the start's bound: none applies.
        total = state.get("block_curvature_sum")
        self.block_curvature_sum = None if total is None else total.to(torch.float64)
        self.measured_blocks = state.get("measured_blocks", 0)
        self.fisher_at_start = state.get("fisher_at_start", False)
