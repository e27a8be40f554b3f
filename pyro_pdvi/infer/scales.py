"""The scales of Gaussian global guide sites by the mean-field fixed point (Price's theorem).

For a guide site ``q(z) = N(m, sigma^2)`` (a ``Normal``, behind ``Independent`` or a bijection
without parameters, as in ``AutoNormal``), Price's theorem [1, 2] gives the negative ELBO's
derivative in a scale as ``d(-ELBO)/d sigma_i = sigma_i E_q[-d^2 g / dz_i^2] - 1 / sigma_i``, ``g``
the log joint seen from ``z`` (the transform's Jacobian included). So at the mean-field optimum

    sigma_i^-2 = E_q[-d^2 g / dz_i^2] = sum_b h_bi,    h_bi = (d f_b / d sigma_i + s_b / sigma_i) / sigma_i,

a sum over the blocks, ``s_b = |b| / N`` block ``b``'s share of the global terms of ``f_b``
(:mod:`~pyro_pdvi.infer.objective`), and ``h_bi`` needs only the gradient of ``f_b``, at no
Hessian. :class:`ScaleFixedPoint` keeps each block's ``h_bi``, refreshed at every visit (from the
gradient at the block's solution, which the :class:`~pyro_pdvi.infer.solvers.GenericSolver` hands
on from its last accepted evaluation: no extra model call) and averaged over its visits with
weights growing as a power of the visit (:func:`visit_weight_order`: linearly, ``2 / (k + 1)`` for
the ``k``-th visit, up to 26 blocks, faster with more blocks, which average the Monte Carlo noise
among themselves: the bias of early visits then fades faster), and
sets every such scale to ``(sum_b h_bi)^(-1/2)`` after each step once every block has been seen.
The solves hold these coordinates at ``lambda_0`` (no copy, no dual moves them): the primal-dual
iteration runs on the locations and the other params. This is the variance-reduced
stored-gradient idea of SAG [3] applied to the scales' natural parameters (precisions, which add
over the blocks as in partitioned VI [4]). The fixed point is the mean-field optimum's, whatever
the averaging.

Why: under the primal-dual iteration a scale's step size is bounded by the block curvature seen at
its blocks' first visits (:mod:`~pyro_pdvi.infer.step_sizes`), which can hold it far from its
optimum for many epochs, and its end state is a noise cloud. Measured on the generic suite
(``docs/benchmarks.md`` 13i): standard deviations 3-43x closer on its five small models; exact
after one epoch on a Gaussian model (``tests/infer/test_scales.py``).

A full-covariance site (``MultivariateNormal``, as ``AutoMultivariateNormal``'s) takes the same
fixed point in matrix form, ``Sigma^-1 = sum_b H_b``, its Cholesky factor mapped to and from the
params by :class:`~pyro_pdvi.infer.cholesky_maps.CholeskyMap`, whose block information, the lower
triangle of ``H_b``, has as many entries as the coordinates it sets: this class stores and
averages both kinds alike.

A site's scale qualifies when each of its entries is one param coordinate's own elementwise
function, ``sigma_i = T(u_j)``, that no location depends on: either the param's constrained value
(``constraint=positive`` or ``softplus_positive``, as ``AutoNormal``'s scales) or ``exp(c u_j + d)``
(a log-scale or log-variance param); :func:`find_scale_maps` checks this on the guide.

[1] Price (1958), "A useful theorem for nonlinear devices having Gaussian inputs", IRE Trans.
    Inf. Theory 4(2).
[2] Opper, Archambeau (2009), "The variational Gaussian approximation revisited", Neural Comput.
    21(3).
[3] Schmidt, Le Roux, Bach (2017), "Minimizing finite sums with the stochastic average
    gradient", Math. Program. 162.
[4] Ashman, Bui, Nguyen, et al. (2022), "Partitioned variational inference: a framework for
    probabilistic federated learning", arXiv:2202.12275.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.distributions import biject_to
from torch.distributions.transforms import AffineTransform, ComposeTransform, ExpTransform, Transform

from .cholesky_maps import CholeskyMap, cholesky_map
from .consensus import EARLY_CONCENTRATED_SHARE
from .fisher import gaussian_parameters
from .handlers import FixedNoise, is_subsample_site, trace_guide_at
from .sites import DataPlate, GlobalLayout

#: Relative tolerance of the checks that a scale is ``T(u_j)``.
MAP_TOLERANCE = 1e-5


#: The highest order of the visits' weights (:func:`visit_weight_order`).
MAX_VISIT_WEIGHT_ORDER = 3

#: The blocks at which order 1 (weights growing linearly) was measured to average the visits'
#: Monte Carlo noise well enough (``docs/benchmarks.md`` 13i, the suite's small models).
LINEAR_WEIGHT_BLOCKS = 20

#: The first epoch's reported scales are estimated once this many blocks have been seen
#: (:meth:`ScaleFixedPoint.early_scales_at`).
EARLY_ESTIMATE_BLOCKS = 4


def visit_weight_order(num_blocks: int) -> int:
    """The order ``p`` of the weights with which a block's ``h_b`` averages its visits: the
    ``k``-th visit enters with weight ``(p + 1) / (k + p)``, so the visits' weights grow as
    ``k (k + 1) ... (k + p - 1)`` and the bias of early visits, made far from the optimum, fades as
    ``1 / k^(p + 1)``, while the Monte Carlo noise of the average grows with ``p``: its variance is
    ``(p + 1)^2 / (2 p + 1)`` times a plain mean's. The sum over ``n`` blocks averages that noise
    further, ``1 / n`` in variance, so the order is the highest (at most
    :data:`MAX_VISIT_WEIGHT_ORDER`) whose noise over ``n`` blocks is at most order 1's over
    :data:`LINEAR_WEIGHT_BLOCKS`: 1 up to 26 blocks, 2 up to 34, then 3. Measured in
    ``docs/benchmarks.md`` 13z: order 3 put ``biglogreg``'s (100 blocks) sds 4x and its means 2x
    closer at 20-30 s; on the 20-block models it left the sds 1.1-1.25x further.

    :param num_blocks: the run's blocks.
    """
    order = 1
    for p in range(2, MAX_VISIT_WEIGHT_ORDER + 1):
        # noise factor of order p over n blocks <= order 1's (4/3) over LINEAR_WEIGHT_BLOCKS
        if (p + 1) ** 2 / (2 * p + 1) / num_blocks <= (4 / 3) / LINEAR_WEIGHT_BLOCKS:
            order = p
    return order


class ScaleMap(NamedTuple):
    """The scale entries of one guide site as functions of param coordinates.

    :param site: the guide site's name.
    :param params: the names of the param sites its scale comes from (comma-separated).
    :param coordinates: the flat param coordinate of each entry, shape ``(K,)``.
    :param transform: ``sigma = transform(u)`` elementwise, ``u`` the coordinates' values.
    """

    site: str
    params: str
    coordinates: torch.Tensor
    transform: Transform

    def scales_at(self, point: torch.Tensor) -> torch.Tensor:
        """The scale entries at the flat params ``point``."""
        return self.transform(point[self.coordinates])

    @property
    def precision_entries(self) -> torch.Tensor:
        """Which of the block information's entries are precisions: every one."""
        return torch.ones(len(self.coordinates), dtype=torch.bool)

    def information(self, gradients: torch.Tensor, shares: torch.Tensor, point: torch.Tensor) -> torch.Tensor:
        """Blocks' ``h_bi`` (module docstring), ``(m, K)`` in float64.

        :param gradients: ``grad_lambda f_b``, ``(m, P)``.
        :param shares: ``s_b``, ``(m,)``.
        :param point: ``lambda_0``, ``(P,)``, the blocks' scales held there.
        """
        u = point.detach().to(torch.float64)[self.coordinates].requires_grad_()
        with torch.enable_grad():
            sigma = self.transform(u)
            (slope,) = torch.autograd.grad(sigma.sum(), u)
        sigma = sigma.detach()
        gradient = gradients.detach().to(torch.float64)[:, self.coordinates]
        return (gradient / slope + shares.to(torch.float64)[:, None] / sigma) / sigma

    def values(self, precision: torch.Tensor, point: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The coordinates' values whose scales are ``precision^(-1/2)`` where it is positive
        (their values in ``point`` elsewhere), and where it is, ``(K,)`` each in float64."""
        usable = precision > 0
        values = self.transform.inv(torch.where(usable, precision, 1.0).rsqrt())
        return torch.where(usable, values, point.detach().to(torch.float64)[self.coordinates]), usable


def find_scale_maps(
    guide: Callable,
    plate: DataPlate,
    layout: GlobalLayout,
    point: torch.Tensor,
    indices: torch.Tensor,
    args: tuple,
    kwargs: dict,
    seed: int = 0,
) -> list[ScaleMap]:
    """The global Gaussian guide sites whose scales the fixed point can set (module docstring).

    :param guide: the Pyro guide.
    :param plate: the data plate.
    :param layout: the layout of the global params.
    :param point: ``lambda_0``, flat (unconstrained).
    :param indices: a block's data indices to run the guide on.
    :param args: positional arguments of the guide.
    :param kwargs: keyword arguments of the guide.
    :param seed: seed of the guide's draws and of a random projection (torch's generator is
        restored after).
    :returns: one :class:`ScaleMap` (or, for a full-covariance site,
        :class:`~pyro_pdvi.infer.cholesky_maps.CholeskyMap`) per qualifying site, no two sharing a
        coordinate.
    """
    constraints = {s.name: s.constraint for s in layout.sites}
    noise = FixedNoise(seed, point.device)
    weights = torch.Generator().manual_seed(seed % 2**63)

    def run(at: torch.Tensor) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        leaf = at.detach().requires_grad_()
        with noise():
            trace = trace_guide_at(
                guide, layout.unflatten(leaf), constraints, plate.name, indices, args, kwargs
            )
        gaussian = {}
        for name, site in trace.nodes.items():
            if site["type"] != "sample" or site["is_observed"] or is_subsample_site(site):
                continue
            parameters = gaussian_parameters(site["fn"])
            full = parameters is None and _cholesky_parameters(site["fn"]) is not None
            if full:
                parameters = _cholesky_parameters(site["fn"])
            in_plate = any(frame.name == plate.name for frame in site["cond_indep_stack"])
            scaled = not (isinstance(site["scale"], (int, float)) and site["scale"] == 1.0)
            if parameters is not None and not in_plate and not scaled:
                gaussian[name] = (*parameters, full)
        return leaf, gaussian

    leaf, gaussian = run(point)
    # Coordinates that any location depends on cannot be set by a scale's fixed point.
    probe = sum(
        (torch.randn(loc.shape, generator=weights).to(loc) * loc).sum()
        for loc, _, _ in gaussian.values()
        if isinstance(loc, torch.Tensor) and loc.requires_grad
    )
    located = torch.zeros_like(point, dtype=torch.bool)
    if isinstance(probe, torch.Tensor):
        (grad,) = torch.autograd.grad(probe, leaf, retain_graph=True, allow_unused=True)
        if grad is not None:
            located = grad != 0
    maps, used = [], torch.zeros_like(located)
    for name, (_, scale, full) in gaussian.items():
        found = cholesky_map(name, scale, leaf, layout) if full else _scale_map(name, scale, leaf, layout)
        if found is None or bool((located | used)[found.coordinates].any()):
            continue
        used[found.coordinates] = True
        maps.append(found)
    if not maps:
        return []
    # The map must hold away from the start too (equal initial values fit many forms).
    shifted = point.detach().clone()
    for found in maps:
        shifted[found.coordinates] += 0.1 * torch.linspace(-1, 1, len(found.coordinates)).to(point)
    _, moved = run(shifted)
    return [
        found
        for found in maps
        if found.site in moved
        and torch.allclose(
            moved[found.site][1].detach().to(torch.float64).reshape(-1),
            found.scales_at(shifted).to(torch.float64).reshape(-1),
            rtol=100 * MAP_TOLERANCE,
            atol=0.0,
        )
    ]


def _cholesky_parameters(fn: torch.distributions.Distribution) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(loc, scale_tril)`` of a ``MultivariateNormal`` behind ``Independent``, else ``None``."""
    while isinstance(fn, torch.distributions.Independent):
        fn = fn.base_dist
    if isinstance(fn, torch.distributions.MultivariateNormal) and fn.batch_shape == ():
        return fn.loc, fn.scale_tril
    return None


def _scale_map(name: str, scale: torch.Tensor, leaf: torch.Tensor, layout: GlobalLayout) -> ScaleMap | None:
    """The site's :class:`ScaleMap` if each scale entry is one coordinate's own function.

    Two vector-Jacobian products find which coordinate each entry depends on, whatever the site's
    size (the full Jacobian, one backward pass per entry, was left out beyond 2^24 elements, so a
    large site kept the primal-dual iteration): with ``sigma_i = T(u_j(i))`` the entries weighted by
    ``w_i = 1 + i / K`` pull back to ``w_i T'`` at ``j(i)`` and the entries weighted by one to
    ``T'`` there, so their ratio is ``w_i`` and names the entry. A coordinate that several
    entries share gives a ratio between theirs, and an entry that several coordinates share
    leaves more coordinates than entries: both are refused here or by the check at a shifted
    point in :func:`find_scale_maps`. So is a site whose dtype cannot tell ratios ``1 / K`` apart
    (rounding of about ``eps``: beyond some 10^6 entries in float32), which keeps the primal-dual
    iteration.
    """
    if not isinstance(scale, torch.Tensor) or not scale.requires_grad:
        return None
    flat = scale.reshape(-1)
    size = len(flat)
    weights = 1.0 + torch.arange(size, device=flat.device).to(flat.dtype) / size
    try:
        # Scalar outputs: an explicit grad_outputs tensor makes torch import sympy (0.5 CPU s, once).
        weighted, slopes = (
            torch.autograd.grad((flat * w).sum(), leaf, retain_graph=True, allow_unused=True)[0]
            for w in (weights, torch.ones_like(flat))
        )
    except RuntimeError:  # an op without a backward in this form: leave the site to the primal-dual iteration
        return None
    if weighted is None:
        return None
    coordinates = ((weighted != 0) | (slopes != 0)).nonzero().reshape(-1)
    if len(coordinates) != size or not bool((slopes[coordinates] != 0).all()):
        return None
    ratio = weighted[coordinates] / slopes[coordinates]
    entries = ((ratio - 1.0) * size).round().long()
    if not bool(((entries >= 0) & (entries < size)).all()):
        return None
    # Each entry named once, and each ratio within a quarter of the spacing 1 / K of its entry's.
    if len(entries.unique()) != size or not bool(((ratio - weights[entries]).abs() <= 0.25 / size).all()):
        return None
    coordinates = coordinates[entries.argsort()]  # the coordinate of entry 0, 1, ...
    sigma, slope = flat.detach(), slopes[coordinates]
    u = leaf.detach()[coordinates]
    owners = sorted({layout.site_of(j) for j in coordinates.tolist()})
    params = ", ".join(owners)
    if len(owners) == 1:
        constraint = next(s.constraint for s in layout.sites if s.name == owners[0])
        transform = biject_to(constraint)
        if torch.allclose(transform(u), sigma, rtol=MAP_TOLERANCE, atol=0.0):
            return ScaleMap(name, params, coordinates, transform)
    ratio = slope / sigma  # d log sigma / du: a constant c for sigma = exp(c u + d)
    if not bool((ratio != 0).all()) or not torch.allclose(
        ratio, ratio[:1].expand_as(ratio), rtol=MAP_TOLERANCE
    ):
        return None
    c = float(ratio[0])
    offset = sigma.log() - c * u
    return ScaleMap(name, params, coordinates, ComposeTransform([AffineTransform(offset, c), ExpTransform()]))


class ScaleFixedPoint:
    """Each block's share ``h_bi`` of the precisions of the mapped scales, and the scales they give
    (module docstring).

    :param maps: the scale maps (:func:`find_scale_maps`).
    :param num_blocks: n.
    :param point: ``lambda_0``, flat, for the dtype and device.
    """

    def __init__(self, maps: list[ScaleMap | CholeskyMap], num_blocks: int, point: torch.Tensor) -> None:
        self.maps = maps
        self.coordinates = torch.cat([m.coordinates for m in maps]).to(point.device)
        size = len(self.coordinates)
        self.information = point.new_zeros(num_blocks, size, dtype=torch.float64)
        self.visits = torch.zeros(num_blocks, dtype=torch.long, device=point.device)
        self.visit_weight_order = visit_weight_order(num_blocks)
        #: ``sum_b h_bi`` over every process's blocks.
        self.total = point.new_zeros(size, dtype=torch.float64)
        # Counters are device tensors: a step reads nothing on the host.
        self.num_seen = torch.zeros((), dtype=torch.long, device=point.device)
        #: How many coordinates had no positive precision at the last update (left as they were).
        self.non_positive = torch.zeros((), dtype=torch.long, device=point.device)
        #: How often a block's ``h_b`` was not finite (its previous one kept).
        self.non_finite = torch.zeros((), dtype=torch.long, device=point.device)

    @property
    def param_names(self) -> list[str]:
        """The param sites whose coordinates the fixed point sets."""
        return [m.params for m in self.maps]

    def block_information(
        self, gradients: torch.Tensor, shares: torch.Tensor, point: torch.Tensor
    ) -> torch.Tensor:
        """``h_b`` of blocks from ``grad_lambda f_b`` at points whose scale coordinates are
        ``point``'s (the block's solution, where the solves hold them at ``lambda_0``): each map's
        (:meth:`ScaleMap.information`, :meth:`~pyro_pdvi.infer.cholesky_maps.CholeskyMap.information`).

        :param gradients: ``(m, P)`` (only the scale coordinates are read).
        :param shares: ``s_b = |b| / N``, ``(m,)``.
        :param point: ``lambda_0``, ``(P,)``.
        :returns: ``(m, K)`` in float64.
        """
        return torch.cat([m.information(gradients, shares, point) for m in self.maps], dim=1)

    def record(self, block_ids: torch.Tensor, information: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Average new ``h_b`` into the blocks' stored ones (weight ``(p + 1) / (k + p)`` at the
        ``k``-th visit, ``p`` the :func:`visit_weight_order`); a block whose ``h_b`` is not finite
        keeps its stored one.

        :returns: the change of ``sum_b h_b`` and the number of blocks seen for the first time
            (for :meth:`add`, after summing them over processes).
        """
        block_ids = block_ids.to(self.visits.device)
        finite = torch.isfinite(information).all(1)
        self.non_finite = self.non_finite + (~finite).sum()
        first = ((self.visits[block_ids] == 0) & finite).sum()
        self.visits[block_ids] += finite.long()
        order = self.visit_weight_order
        visits = self.visits[block_ids].to(torch.float64)
        weight = torch.where(finite, (order + 1) / (visits + order), 0.0)[:, None]
        old = self.information[block_ids]
        new = old + weight * (torch.where(finite[:, None], information, 0.0) - old)
        self.information[block_ids] = new
        return (new - old).sum(0), first

    def add(self, change: torch.Tensor, first_seen: torch.Tensor) -> None:
        """Take the change of ``sum_b h_b`` and of the blocks seen (summed over processes)."""
        self.total += change
        self.num_seen = self.num_seen + first_seen.round().long()

    def scales_at(self, point: torch.Tensor) -> torch.Tensor:
        """The coordinates' values at the fixed point ``sigma_i = (sum_b h_bi)^(-1/2)``, shape
        ``(K,)``, in ``point``'s dtype: their values in ``point`` until every block has been seen,
        and where the precision is not positive."""
        ready = self.num_seen >= len(self.visits)
        values, usable = self._values_at(point, self.total, ready.expand(len(self.total)))
        self.non_positive = torch.where(ready, (~usable).sum(), 0)
        return values

    def early_scales_at(self, point: torch.Tensor) -> torch.Tensor:
        """Before every block has been seen: the scales of ``sum_b h_bi`` estimated from the blocks
        seen, each block not yet seen counted as the median seen one (per coordinate), once
        :data:`EARLY_ESTIMATE_BLOCKS` have been seen. Not for a site of which some coordinate is
        held by one seen block (more than
        :data:`~pyro_pdvi.infer.consensus.EARLY_CONCENTRATED_SHARE` of the seen blocks' ``h``: a
        group's random effect): where that block is not yet seen, the others say only what the
        prior does, and the prior's scale is further from the optimum than the guide's start.
        Elsewhere (before that many blocks, once every block has been seen, where the estimated
        precision is not positive) the coordinates' values in ``point``. Of this process's blocks
        only; ``O(nK)``, as :meth:`~pyro_pdvi.infer.consensus.ConsensusState.estimate` is.

        What PDVI reports in the first epoch (``PDVI._reported_params``); the solves keep the
        scales held. With such scales in the solves, the random-effects model's ELBO gap was 2-7x
        larger in epochs 2-3 (``docs/benchmarks.md`` 13ze).

        :param point: ``lambda_0``, flat.
        :returns: ``(K,)`` in ``point``'s dtype.
        """
        seen = self.visits > 0
        count = seen.sum()
        early = (count >= EARLY_ESTIMATE_BLOCKS) & (count < len(self.visits))
        seen_information = torch.where(seen[:, None], self.information, 0.0)
        typical = torch.where(seen[:, None], self.information, float("nan")).nanmedian(0).values
        total = seen_information.sum(0) + (len(self.visits) - count) * typical
        shares = seen_information.clamp(min=0)
        held_by_one = shares.max(0).values > EARLY_CONCENTRATED_SHARE * shares.sum(0)
        # Of a Cholesky map's entries, the precisions on the diagonal (its others may be negative).
        sites = torch.cat(
            [
                held_by_one[span][m.precision_entries.to(held_by_one.device)]
                .any()
                .expand(span.stop - span.start)
                for m, span in zip(self.maps, self._spans())
            ]
        )
        return self._values_at(point, total, early & ~sites)[0]

    def _spans(self) -> list[slice]:
        """Each map's entries among the coordinates."""
        spans, start = [], 0
        for m in self.maps:
            spans.append(slice(start, start + len(m.coordinates)))
            start += len(m.coordinates)
        return spans

    def _values_at(
        self, point: torch.Tensor, precision: torch.Tensor, use: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The coordinates' values at the fixed point of ``precision`` where ``use`` and the
        precision allows (positive; a Cholesky map's positive definite), their values in
        ``point`` elsewhere: ``(K,)`` in ``point``'s dtype, and where the precision allowed."""
        u = point.detach().to(torch.float64)[self.coordinates]
        values, usable = [], []
        for m, span in zip(self.maps, self._spans()):
            value, ok = m.values(precision[span], point)
            values.append(value)
            usable.append(ok.expand(span.stop - span.start))
        usable = torch.cat(usable)
        return torch.where(use & usable, torch.cat(values), u).to(point.dtype), usable

    def state_dict(self) -> dict:
        return {
            "params": self.param_names,
            "information": self.information.clone(),
            "visits": self.visits.clone(),
            "total": self.total.clone(),
            "num_seen": self.num_seen,
            "non_positive": self.non_positive,
            "non_finite": self.non_finite,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["params"] != self.param_names or state["information"].shape != self.information.shape:
            raise ValueError(
                f"saved PDVI state sets the scale params {state['params']} by their fixed point, "
                f"this PDVI {self.param_names}: build it with the same guide"
            )
        self.information = state["information"].clone().to(self.information)
        self.visits = state["visits"].clone().to(self.visits)
        self.total = state["total"].clone().to(self.total)
        for key in ("num_seen", "non_positive", "non_finite"):
            setattr(self, key, torch.as_tensor(state[key]).to(self.visits))
