"""A dense preconditioner per global site: PD-VI in coordinates that whiten each small site's
curvature.

The natural rule's penalty ``D = diag(F_j / (c n))`` (:mod:`~pyro_pdvi.infer.step_sizes`; the
paper's ``D`` of P2D-VI [1, Sec. 3.4] per coordinate) sees
each coordinate's curvature but not how coordinates are tied: the regression coefficients of
correlated covariates. The consensus iteration then contracts at the pace of the conditioning that
the diagonal leaves, ``kappa`` of ``S^-1/2 F S^-1/2`` (``F = sum_b H_b``, ``S = diag(F)``). On a
quadratic model of the generic suite's regressions (``benchmarks/consensus_rate.py``,
``docs/benchmarks.md`` 13zb) a dense penalty ``D = F / (c n)`` took the rate per epoch from
0.75-0.94 (diagonal, ``c = 1``) to 0.42-0.52 (dense, ``c = 0.125-0.25``) on all three models,
with the best constant the same on all of them, where the diagonal's best moved with ``kappa``.

A dense ``D`` is a diagonal one in other coordinates. With ``F_s = U' Delta U`` (``U`` unit upper
triangular, ``Delta`` diagonal: the Cholesky factor with its diagonal divided out), the map
``lambda~_s = U lambda_s`` on a site's coordinates makes the blocks' summed Hessian ``Delta``, so
the natural rule's diagonal penalty there, ``Delta / (c n)``, is ``F_s / (c n)`` in the params.
The state (consensus, copies, duals) moves to ``lambda~`` as for the coupling of
:mod:`~pyro_pdvi.infer.coupling`, by the same
:meth:`~pyro_pdvi.infer.consensus.ConsensusState.change_coordinates`; a linear bijection keeps the
fixed point. A whitened coordinate's step size is the natural rule's times ``F_jj / Delta_j``
(its curvature with the site's earlier coordinates held fixed is ``Delta_j``, not ``F_jj``), times
``whitened_scale / scale``: the constant of :class:`~pyro_pdvi.infer.step_sizes.AutoStepSize`
that a dense penalty takes.

Where the candidate sites have at most :data:`MAX_WHITENED_COORDINATES` coordinates together,
they are one group, with one dense penalty (:func:`joint_group`): it then also sees the ties
between sites, an intercept's with a random intercept per site of the data. A group may be larger
where the sites of more than :data:`MAX_UNIT_VECTOR_SITE` have a diagonal Hessian of their own (a
random effect's): those are measured by two probes each (:func:`probed_block_hessians`), come
first in the group (:func:`probed_order`) and keep the natural rule's constant, and the group's
``U`` is an arrow, the identity on them but for their ties to the others (:class:`SiteWhitening`),
so that a random effect of thousands of sites costs as much per coordinate as one of ten. Large
sites tied to each other position by position (a random intercept and a random slope per site)
are measured by the same probes, and each position's coordinates are one unit of the arrow, within
which ``U`` is dense (:class:`GroupHessians`). A large site tied to another otherwise (a random
effect per region, tied to each of its sites' effects) is measured by its unit vectors, where a
block measures few enough of them (the others, which it informs by their prior alone, skipped);
where not, a site nested in another is found by two more probes a site
(:func:`nested_positions`), and a region's effect and its sites' are one unit (its sites'
intercepts and slopes, where both are nested in it, each slope tied to its own site's intercept;
a coarser level above the regions, of few enough coordinates, is measured by its unit vectors).
Elsewhere "site" below reads "group".

``F_s`` is measured once, when every block has had its first step (at the end of the first
epoch), from every block's Hessian products with the unit vectors of the candidate coordinates at
one ``lambda_0`` (a large block's from a random subset of its data:
:data:`~pyro_pdvi.infer.upkeep.WHITENING_ROWS`): :func:`site_hessians`; a probed group's from its
few probes on every row (a subset would hold few of a random effect's sites). A site is whitened where
:func:`measure_whitening` finds ``F_s`` positive definite and a diagonal penalty leaves it at least
:data:`MIN_WHITENED_CONDITION` ill-conditioned. The Hessian moves as the fit does; ``U`` does not
follow it (a stale ``U`` is a weaker preconditioner, not a wrong one).

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .coupling import unit_vectors
from .reduced_hessian import lanczos

#: A site is whitened where it has at least 2 and at most this many coordinates to whiten: the
#: measurement takes one Hessian product per coordinate and block, and ``U`` is dense.
MAX_WHITENED_COORDINATES = 64


#: A joint group whose large sites are measured by probes (:func:`probes_apply`) is formed where
#: its blocks' Hessians between the large sites' coordinates and the others, ``n L s`` numbers
#: (:class:`GroupHessians`), are at most this many: 128 MiB in float64. Its map and measurement
#: cost ``L s`` a block, not ``(L + s)^2``: no other limit on the large sites.
MAX_PROBED_ENTRIES = 2**24

#: A probed group's coordinates measured by unit vectors (its dense part, ``s``) may number up to
#: this many where each block measures at most :data:`MAX_WHITENED_COORDINATES` of them and skips
#: the others, which it informs by their prior alone (:func:`probed_block_hessians`' ``skipped``):
#: a random effect per period of time, each period inside one block (``docs/benchmarks.md``
#: 13zu). The map's dense part is ``s x s``.
MAX_DENSE_COORDINATES = 256

#: In a joint group, a site of at most this many coordinates is measured by its unit vectors; a
#: larger one by two probes, where its own Hessian is diagonal (:func:`probed_block_hessians`).
#: Where the probes refuse a group, one of its large sites at a time is measured by its unit vectors
#: instead, as long as a block measures at most :data:`MAX_WHITENED_COORDINATES` of them
#: (:meth:`~pyro_pdvi.infer.upkeep.StepSizeUpkeep._probe_group`).
MAX_UNIT_VECTOR_SITE = 16


def joint_group(sites: list[torch.Tensor]) -> list[torch.Tensor]:
    """The coordinates of the candidate sites of at most :data:`MAX_WHITENED_COORDINATES` each, as
    one group where there are two such sites or more with at most that many together (else each
    its own group): one dense penalty then also sees the ties between sites, which a site's own cannot. A
    regression's intercept and a random intercept per site of the data (``a_g``) are tied along
    the direction that adds ``c`` to every ``a_g`` and takes it from the intercept, which only the
    priors fix: measured on the suite's Poisson model (``docs/benchmarks.md`` 13zo), no site
    alone was ill-conditioned (condition numbers 1.0 and 3.1, together 1,752) and that direction
    crawled (the intercept still 0.18 off after 40 epochs), where the joint group's penalty had
    it at the optimum by epoch 12. A larger group is formed where its large sites can be probed
    (:func:`probes_apply`, :func:`probed_order`).

    :param sites: each candidate site's flat coordinates, in the layout's order.
    :returns: ``[their coordinates, sorted]``, or those sites as given.
    """
    small = [c for c in sites if len(c) <= MAX_WHITENED_COORDINATES]
    if len(small) >= 2 and sum(len(c) for c in small) <= MAX_WHITENED_COORDINATES:
        return [torch.cat(small).sort().values]
    return small


def unit_vector_sites(sites: list[torch.Tensor]) -> list[bool]:
    """Which of a joint group's ``sites`` are measured by their unit vectors at first: those of at
    most :data:`MAX_UNIT_VECTOR_SITE` coordinates (the others, its large sites, by probes)."""
    return [len(c) <= MAX_UNIT_VECTOR_SITE for c in sites]


def probes_apply(
    sites: list[torch.Tensor],
    num_blocks: int,
    small: list[bool] | None = None,
    measured: int | None = None,
) -> bool:
    """Whether ``sites`` form a joint group whose large sites :func:`probed_block_hessians` would
    measure by probes: two sites or more, at least one large site, at most
    :data:`MAX_WHITENED_COORDINATES` unit vectors a block for the others (at most
    :data:`MAX_DENSE_COORDINATES` of them where the blocks skip some), and at most
    :data:`MAX_PROBED_ENTRIES` numbers in the blocks' Hessians between the two.

    :param sites: the candidate sites' flat coordinates.
    :param num_blocks: n.
    :param small: which sites are measured by their unit vectors (:func:`unit_vector_sites` where
        ``None``).
    :param measured: the most unit vectors a block measures where the blocks skip some
        (:func:`unit_vectors_measured`); ``None``: every block measures them all.
    """
    small = unit_vector_sites(sites) if small is None else small
    num_small = sum(len(c) for c, is_small in zip(sites, small) if is_small)
    large = sum(len(c) for c in sites) - num_small
    return (
        len(sites) >= 2
        and large > 0
        and 0 < num_small <= MAX_DENSE_COORDINATES
        and (num_small if measured is None else measured) <= MAX_WHITENED_COORDINATES
        and num_blocks * large * num_small <= MAX_PROBED_ENTRIES
    )


def unit_vectors_measured(
    sites: list[torch.Tensor], small: list[bool], skipped: torch.Tensor | None
) -> int | None:
    """The most unit vectors a block measures in the probed group of ``sites`` (those of the
    ``small`` ones) where it skips the ``skipped`` ones, ``(n, P)`` (:func:`probed_block_hessians`);
    ``None`` where none is skipped."""
    if skipped is None or not bool(skipped.any()):
        return None
    coordinates = [c for c, is_small in zip(sites, small) if is_small]
    if not coordinates:
        return 0
    return int((~skipped.cpu()[:, torch.cat(coordinates)]).sum(1).max())


def probed_order(sites: list[torch.Tensor], small: list[bool] | None = None) -> torch.Tensor:
    """A probed group's coordinates in the order it is whitened: the large sites' (those not
    ``small``, :func:`unit_vector_sites` where ``None``) first, then the others', sorted. First, a
    large site's coordinates are tied to nothing before them (their own Hessian is diagonal and not
    tied to the other large sites'), so their ``Delta_j = F_jj``: the map makes each ``a_g`` plus
    its share of the shared coordinates, which the data fix, and the shared coordinates, last,
    carry the tie."""
    small = unit_vector_sites(sites) if small is None else small
    large = [c for c, is_small in zip(sites, small) if not is_small]
    rest = [c for c, is_small in zip(sites, small) if is_small]
    rest = torch.cat(rest).sort().values if rest else sites[0][:0]
    return torch.cat([*large, rest])


@dataclass
class GroupHessians:
    """Every block's Hessian on one group's coordinates, in the group's order, stored as an arrow:
    block diagonal on its first ``L`` coordinates (a probed group's large sites, :func:`probed_order`;
    none for a group measured by unit vectors), dense on the other ``s`` and between them and the
    first. The first part's blocks are its **units**: one coordinate each (a random effect's, whose
    own Hessian is diagonal), or, where large sites are tied to each other position by position
    (each site's random intercept with its random slope), the coordinates at one position of every
    such site, or, where one is nested in another (:func:`nested_positions`), a region's effect and
    its sites'. ``n (L r + L s + s^2)`` numbers (``r`` a unit's size), where the dense matrices
    would be ``n (L + s)^2``.

    :param diagonal: the first ``L`` coordinates' curvatures, ``(n, L)``; where ``units`` is given,
        the units' blocks, ``(n, m, r, r)``.
    :param cross: the entries between those and the others, ``(n, L, s)``.
    :param dense: the others' Hessians, ``(n, s, s)``.
    :param units: each unit's coordinates among the first ``L`` (their places in the group's
        order), ``(m, r)``, ``-1`` where a unit has fewer than ``r``; ``None``: one coordinate each.
    """

    diagonal: torch.Tensor
    cross: torch.Tensor
    dense: torch.Tensor
    units: torch.Tensor | None = None

    @classmethod
    def of_sites(cls, hessians: torch.Tensor, coordinates: list[torch.Tensor]) -> list[GroupHessians]:
        """Each site's blocks of dense Hessians ``(n, k, k)`` (the sites in order, ``k = sum_s
        k_s``), as a group with no diagonal part."""
        out, start = [], 0
        for index in coordinates:
            dense = hessians[:, start : start + len(index), start : start + len(index)]
            start += len(index)
            out.append(cls(dense.new_zeros(len(dense), 0), dense.new_zeros(len(dense), 0, len(index)), dense))
        return out

    def is_finite(self) -> bool:
        """Whether every measured entry is finite."""
        return all(bool(torch.isfinite(t).all()) for t in (self.diagonal, self.cross, self.dense))

    def totals(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The blocks' sums ``(D, B, C)`` of ``F = [[D, B], [B', C]]`` (``D`` as ``diagonal``
        stores it), ``C`` symmetrised."""
        dense = self.dense.sum(0)
        return self.diagonal.sum(0), self.cross.sum(0), (dense + dense.T) / 2

    def leading_diagonal(self) -> torch.Tensor:
        """The first ``L`` coordinates' curvatures, ``(n, L)``, in the group's order."""
        if self.units is None:
            return self.diagonal
        return unpad(self.diagonal.diagonal(dim1=-2, dim2=-1), self.units)


def unpad_index(units: torch.Tensor) -> torch.Tensor:
    """Where each leading coordinate sits among the units' places, flattened, ``(L,)``."""
    present = units.reshape(-1) >= 0
    order = units.reshape(-1)[present].argsort()
    return present.nonzero().reshape(-1)[order]


def unpad(values: torch.Tensor, units: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """Values per unit and place, ``(..., m, r)``, as values per leading coordinate ``(..., L)``
    (the places marked ``-1`` dropped); ``index``: :func:`unpad_index` of ``units``, if known."""
    return values.flatten(-2)[..., unpad_index(units) if index is None else index]


def pad(values: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
    """Values per leading coordinate ``(..., L)`` as values per unit and place ``(..., m, r)``,
    zero where a unit has no coordinate."""
    padded = torch.cat([values, values.new_zeros(*values.shape[:-1], 1)], dim=-1)
    return padded[..., units.clamp(min=-1) % (values.shape[-1] + 1)]


def probed_block_hessians(
    products: Callable[[int, torch.Tensor], torch.Tensor],
    num_blocks: int,
    sites: list[torch.Tensor],
    like: torch.Tensor,
    positions: list[torch.Tensor] | None = None,
    tolerance: float = 1e-3,
    small: list[bool] | None = None,
    skipped: torch.Tensor | None = None,
    curvature: torch.Tensor | None = None,
    own_positions: list[torch.Tensor] | None = None,
) -> GroupHessians | None:
    """Every block's Hessian on a joint group's coordinates (in :func:`probed_order`), measured with few
    products where its large sites are diagonal: each ``small`` site (at first, of at most
    :data:`MAX_UNIT_VECTOR_SITE` coordinates) by its unit vectors (its rows and, by symmetry, columns),
    each other (large) site ``S`` by two probes, ``1_S`` (its ones) and ``r_S`` (random signs on it).
    Where ``S``'s own Hessian is diagonal and ``S`` is not tied to the other large sites (a random effect
    per site of the data: each ``a_g`` enters its own rows only), ``(H 1_S)_S`` is that diagonal, ``(H
    r_S)_S`` equals it times ``r_S``, and both vanish on the other large sites. Where large sites are tied
    to each other position by position (``positions`` given: each site's random intercept ``a_g`` with its
    random slope ``b_g``, and with nothing else), ``(H 1_S)_T`` is the entry between ``S``'s and ``T``'s
    coordinates of each position and ``(H r_S)_T`` equals it times ``S``'s sign there: those entries are
    the group's units (:class:`GroupHessians`), one per position. Any block where a probe shows otherwise
    (beyond ``tolerance`` of ``S``'s largest curvature) returns ``None``. This is the grouping of Hessian
    columns by Curtis, Powell & Reid (1974) for that pattern: a group of 200 sites' effects and 6 shared
    coordinates costs 8 products a block, not 206.

    :param products: ``(b, V) -> V H_b`` for directions ``V`` of shape ``(k, P)``.
    :param num_blocks: n.
    :param sites: the group's sites' flat coordinates.
    :param like: a tensor whose last size is ``P``, whose dtype and device the directions take.
    :param positions: each site's coordinates' places in their site (the index into the site's
        flattened value); ``None``: the large sites share no place, and any tie between two of them
        refuses the group.
    :param tolerance: the largest error a probe may show, relative to its site's largest curvature.
    :param small: which sites are measured by their unit vectors (:func:`unit_vector_sites` where
        ``None``); the others are probed.
    :param skipped: ``(n, P)``, the coordinates whose unit vectors block ``b`` skips, where it
        informs them by their prior's share alone (a period's effect outside its block): their row
        there is taken from the measured rows by symmetry, zero on the large sites, and
        ``curvature[b]`` on the diagonal (:func:`_rows_of_skipped`).
    :param curvature: ``(n, P)``, the blocks' curvatures, with ``skipped``.
    :param own_positions: each site's coordinates' places in their own site, where ``positions``
        nest sites in another (:func:`nested_positions`): where two nested sites share a unit (a
        site's random intercept and its random slope, both in their region's), a coordinate of one
        may be tied to the other's at its own place only (its own site's), and ``S``'s probes
        measure those ties as a single site's do. ``None``: two sites with several coordinates a
        unit refuse the group.
    :returns: the arrow (its units of one coordinate each where no two large sites are tied), float64
        on the host, or ``None``.
    """
    small = unit_vector_sites(sites) if small is None else small
    group = probed_order(sites, small)
    is_large = [not is_small for is_small in small]
    large = [c for c, keep in zip(sites, is_large) if keep]
    large_index = torch.cat(large)
    small_index = group[len(large_index) :]
    offsets = torch.tensor([0] + [len(c) for c in large]).cumsum(0)
    if positions is None:
        places = [torch.arange(int(offsets[j]), int(offsets[j + 1])) for j in range(len(large))]
    else:
        places = [p.cpu() for p, keep in zip(positions, is_large) if keep]
    every_place = torch.cat(places).unique()
    unit_of = [torch.searchsorted(every_place, p) for p in places]
    # Each site's coordinates take consecutive slots of their unit, after the previous sites' (one
    # slot a site where places are positions; a region's effect, then its sites', where nested).
    slot_of, starts = [], [0]
    for unit in unit_of:
        rank = _rank_among_equal(unit)
        slot_of.append(starts[-1] + rank)
        starts.append(starts[-1] + (int(rank.max()) + 1 if len(rank) else 0))
    single = [starts[j + 1] - starts[j] == 1 for j in range(len(large))]
    partners = None
    if sum(not one for one in single) > 1:
        if own_positions is None:
            return None  # two sites with several coordinates a unit: their ties are not measured
        own = [p.cpu() for p, keep in zip(own_positions, is_large) if keep]
        partners = _partners(own, unit_of, single)
        if partners is None:
            return None  # a coordinate's partner in another unit: the units would not hold the tie
    if num_blocks * len(every_place) * starts[-1] ** 2 > MAX_PROBED_ENTRIES:
        return None  # a region of very many sites: its unit's blocks would not fit
    units = torch.full((len(every_place), starts[-1]), -1, dtype=torch.long)
    for j, unit in enumerate(unit_of):
        units[unit, slot_of[j]] = torch.arange(int(offsets[j]), int(offsets[j + 1]))
    generator = torch.Generator().manual_seed(len(group))
    signs = [
        2 * torch.randint(0, 2, (len(site),), generator=generator, dtype=torch.float64) - 1 for site in large
    ]
    # A single site's sign at each unit (0 where it has no coordinate there).
    sign_at = torch.zeros(len(large), len(every_place), dtype=torch.float64)
    for j, unit in enumerate(unit_of):
        sign_at[j, unit] = signs[j]
    probes = like.new_zeros(2 * len(large), like.shape[-1])
    for j, (site, site_signs) in enumerate(zip(large, signs)):
        probes[2 * j, site] = 1.0
        probes[2 * j + 1, site] = site_signs.to(probes)
    blocks = torch.zeros(num_blocks, len(every_place), starts[-1], starts[-1], dtype=torch.float64)
    # The single sites' probes first: they measure the ties that the other's (nested) cannot.
    order = sorted(range(len(large)), key=lambda j: not single[j])
    crosses, denses = [], []
    for b in range(num_blocks):
        measured = torch.ones(len(small_index), dtype=torch.bool)
        if skipped is not None:
            measured = ~skipped[b].cpu()[small_index]
        found = products(b, torch.cat([unit_vectors(like, small_index[measured]), probes])).to(
            "cpu", torch.float64
        )
        rows = _rows_of_skipped(found[: int(measured.sum())], measured, small_index, b, curvature)
        found = found[int(measured.sum()) :]
        for j in order:
            site, ones, signed = large[j], found[2 * j], found[2 * j + 1]
            scale = max(float(ones[site].abs().max()), 1e-30)
            for t, other in enumerate(large):
                if single[j]:
                    tie, sign = ones[other], sign_at[j, unit_of[t]]
                    error = torch.cat([signed[other] - tie * sign, tie[sign == 0]])
                    blocks[b, unit_of[t], starts[j], slot_of[t]] = tie * (sign != 0)
                    if not single[t]:  # the transpose, which t's probes do not measure
                        blocks[b, unit_of[t], slot_of[t], starts[j]] = tie * (sign != 0)
                elif t == j:
                    tie = ones[other]
                    error = signed[other] - tie * signs[j]
                    blocks[b, unit_of[t], slot_of[t], slot_of[t]] = tie
                elif not single[t]:
                    # Each of t's coordinates tied to j's at its own place alone (none: no tie).
                    tie, partner = ones[other], partners[j, t]
                    has = partner >= 0
                    error = torch.cat([signed[other][has] - tie[has] * signs[j][partner[has]], tie[~has]])
                    blocks[b, unit_of[t][has], slot_of[j][partner[has]], slot_of[t][has]] = tie[has]
                else:
                    # Site j's ties with t's coordinate at each unit, from t's probes: their sums
                    # are what j's probes measure.
                    ties = blocks[b, unit_of[t], starts[j] : starts[j + 1], slot_of[t]]
                    signs_there = signs[j].new_zeros(len(every_place), ties.shape[-1])
                    signs_there[unit_of[j], slot_of[j] - starts[j]] = signs[j]
                    error = torch.cat(
                        [ones[other] - ties.sum(1), signed[other] - (ties * signs_there[unit_of[t]]).sum(1)]
                    )
                if not bool(torch.isfinite(error).all()) or float(error.abs().max()) > tolerance * scale:
                    return None
        crosses.append(rows[:, large_index].T)
        denses.append(rows[:, small_index])
    blocks = (blocks + blocks.transpose(-1, -2)) / 2
    diagonal = blocks.diagonal(dim1=-2, dim2=-1)
    ties = blocks - torch.diag_embed(diagonal)
    if float(ties.abs().amax()) <= tolerance * float(diagonal.abs().max()):
        return GroupHessians(unpad(diagonal, units), torch.stack(crosses), torch.stack(denses))
    return GroupHessians(blocks, torch.stack(crosses), torch.stack(denses), units)


def nested_positions(
    products: Callable[[int, torch.Tensor], torch.Tensor],
    num_blocks: int,
    sites: list[torch.Tensor],
    like: torch.Tensor,
    small: list[bool],
    positions: list[torch.Tensor],
    tolerance: float = 1e-3,
) -> list[torch.Tensor] | None:
    """The places of a probed group's coordinates where a large site ``T`` is nested in another,
    ``S``: each of ``T``'s coordinates tied to one of ``S``'s only (a site's effect to its region's).
    Two probes on each large site, summed over the blocks, find them: ``1_S`` and ``v_S``, whose
    values are distinct (``1 + (i + 1/2) / |S|`` in a random order), so that ``(H v_S)_t / (H
    1_S)_t`` is the value at ``t``'s coordinate of ``S`` where ``t`` is tied to it alone. ``T``'s
    coordinates then take their ``S`` coordinates' places, and a unit of
    :func:`probed_block_hessians`, which checks every tie on every block, holds a region's effect
    and its sites' (``docs/benchmarks.md`` 13zv).

    :param products: ``(b, V) -> V H_b``.
    :param num_blocks: n.
    :param sites: the group's sites' flat coordinates.
    :param like: a tensor whose last size is ``P``, whose dtype and device the probes take.
    :param small: which sites are measured by their unit vectors (the others are the large ones).
    :param positions: each site's places otherwise (its coordinates' indices in the site).
    :param tolerance: the smallest tie, relative to its own curvature, that ties a coordinate of
        ``T`` to ``S``; one barely tied takes the place of the coordinate of another site nested in
        ``S`` at its own place (a site's slope, barely tied to its region where its times are
        centred, goes with the site's intercept), else a unit of its own.
    :returns: every site's places, or ``None`` where no large site is nested in another, or a
        site nested in one is nested in a third (a second level).
    """
    large = [j for j, is_small in enumerate(small) if not is_small]
    generator = torch.Generator().manual_seed(len(large))
    order = {j: torch.randperm(len(sites[j]), generator=generator) for j in large}
    values = {j: 1 + (order[j].double() + 0.5) / len(sites[j]) for j in large}
    probes = like.new_zeros(2 * len(large), like.shape[-1])
    for i, j in enumerate(large):
        probes[2 * i, sites[j]] = 1.0
        probes[2 * i + 1, sites[j]] = values[j].to(probes)
    total = sum(products(b, probes).to("cpu", torch.float64) for b in range(num_blocks))
    nested = {}
    for it, t in enumerate(large):
        own = total[2 * it][sites[t]].abs()
        for i, j in enumerate(large):
            ones, valued = total[2 * i][sites[t]], total[2 * i + 1][sites[t]]
            tied = ones.abs() > tolerance * own
            # A site is nested in a coarser one only: two of the same size tied one to one are
            # tied position by position (a site's intercept and its slope).
            if len(sites[j]) >= len(sites[t]) or not bool(tied.any()):
                continue
            size = len(sites[j])
            ratio = valued[tied] / ones[tied]
            rank = ((ratio - 1) * size - 0.5).round()
            if not bool(((rank >= 0) & (rank < size)).all()):
                continue
            coordinate = torch.full((len(sites[t]),), -1, dtype=torch.long)
            coordinate[tied] = order[j].argsort()[rank.long()]
            if float((ratio - values[j][coordinate[tied]]).abs().max()) <= 0.25 / size:
                nested[t] = (j, coordinate)
                break
    if not nested or any(j in nested for j, _ in nested.values()):
        return None
    own = [p.cpu() for p in positions]
    places = list(own)
    for t, (j, coordinate) in nested.items():
        places[t] = places[j][coordinate.clamp(min=0)]
    fresh = max(int(p.max()) for p in places if len(p)) + 1
    for t, (j, coordinate) in nested.items():
        for k in (coordinate < 0).nonzero().reshape(-1).tolist():
            # A coordinate barely tied to S: the place of the coordinate at its own place of another
            # site nested in S and tied to it (a site's slope goes with its intercept), else a unit
            # of its own; probed_block_hessians checks every tie on every block.
            partners = [
                places[u][own[u] == own[t][k]]
                for u, (i, found) in nested.items()
                if u != t and i == j and bool((found[own[u] == own[t][k]] >= 0).any())
            ]
            if partners:
                places[t][k] = partners[0][0]
            else:
                places[t][k], fresh = fresh, fresh + 1
    return places


def _partners(
    own: list[torch.Tensor], unit_of: list[torch.Tensor], single: list[bool]
) -> dict[tuple[int, int], torch.Tensor] | None:
    """For every two large sites ``j != t`` that are not ``single``, which of ``j``'s coordinates
    has each of ``t``'s own place (its index among ``j``'s, ``-1`` where none): the one it may be
    tied to. ``None`` where such a pair lies in two units."""
    several = [j for j, one in enumerate(single) if not one]
    partners = {}
    for j in several:
        place_to_index = {int(p): i for i, p in enumerate(own[j])}
        for t in several:
            if t == j:
                continue
            partner = torch.tensor([place_to_index.get(int(p), -1) for p in own[t]], dtype=torch.long)
            has = partner >= 0
            if not torch.equal(unit_of[j][partner[has]], unit_of[t][has]):
                return None
            partners[j, t] = partner
    return partners


def _rank_among_equal(values: torch.Tensor) -> torch.Tensor:
    """Each entry's rank among the entries equal to it, in order: ``[3, 1, 3, 3] -> [0, 0, 1, 2]``."""
    order = torch.sort(values, stable=True).indices
    sorted_values = values[order]
    first = torch.searchsorted(sorted_values, sorted_values)
    rank = torch.empty_like(values)
    rank[order] = torch.arange(len(values)) - first
    return rank


def _rows_of_skipped(
    rows: torch.Tensor,
    measured: torch.Tensor,
    small_index: torch.Tensor,
    b: int,
    curvature: torch.Tensor | None,
) -> torch.Tensor:
    """Block ``b``'s rows of the small coordinates, ``(s, P)``, from those measured (``rows``, the
    coordinates where ``measured``): a skipped coordinate's row is its column among the measured
    rows (the Hessian is symmetric), zero elsewhere, and its curvature ``curvature[b]`` on the
    diagonal."""
    if bool(measured.all()):
        return rows
    full = rows.new_zeros(len(small_index), rows.shape[-1])
    full[measured] = rows
    skipped = small_index[~measured]
    full[(~measured).nonzero().reshape(-1)[:, None], small_index[measured]] = rows[:, skipped].T
    full[(~measured).nonzero().reshape(-1), skipped] = curvature[b].cpu().to(full)[skipped]
    return full


#: A site is whitened where the diagonal penalty leaves its curvature at least this ill-conditioned
#: (:func:`diagonal_condition`). Measured on the generic suite at the first epoch's end
#: (``docs/benchmarks.md`` 13zc): 94 for the logistic regression, 109 for the overdispersed one and
#: 419 for the scale regression, whose means were 1.2-44x closer whitened at 2.5-10 CPU s; 17 for the
#: logistic regression of 100,000 rows, whose means were 1.6-1.75x further at 5-10 s whitened (2.1x
#: closer at 20 s), as the quadratic model of 13zb predicts where a diagonal penalty is nearly right
#: (best rate 0.418 dense against 0.443 diagonal at condition number 15); 1.0 for the GMM's cluster
#: means, whose W2 was 2.1-2.4x further after 3-4 epochs whitened (the constant alone changed).
MIN_WHITENED_CONDITION = 30.0

#: :func:`site_hessians` measures this many blocks before the others, and those only for the
#: sites whose sum over these is not already round: the GMM's cluster means, whose Hessian is
#: diagonal, are then measured on 4 of its 100 blocks.
FIRST_BLOCKS = 4

#: A whitened coordinate's step size grows by at most this factor (``F_jj / Delta_j``), so that a
#: near-singular ``F_s`` (a direction the data barely fix) cannot make it unbounded.
MAX_STEP_GROWTH = 1000.0


class SiteWhitening:
    """The linear map ``lambda~ = T lambda`` of the module docstring: ``T`` is the identity but on
    each whitened group's coordinates, where it is that group's ``U = [[U_D, E], [0, V]]``: ``U_D``
    on its first ``L`` coordinates (a probed group's large sites): the identity where their own
    Hessian is diagonal, else unit upper triangular within each unit (:class:`GroupHessians`); ``E =
    Delta_D^-1 U_D^-T B`` their ties to the other ``s``; and ``V`` unit upper triangular on those
    (the whole ``U`` for a group with no diagonal part, ``L = 0``). Applying it costs ``L r + L s +
    s^2``.

    :param coordinates: each whitened group's flat coordinates, a list of ``(L_g + s_g,)``
        LongTensors.
    :param factors: each group's ``V``, ``(s_g, s_g)``.
    :param step_growth: per coordinate, the factor on its step size in ``lambda~`` (1 where not
        whitened), shape ``(P,)``.
    :param ties: each group's ``E``, ``(L_g, s_g)``; ``None``: no group has a diagonal part.
    :param units: each group's units (:class:`GroupHessians`), or ``None`` where its ``U_D`` is the
        identity; ``None``: every group's is.
    :param unit_factors: each group's ``U_D`` per unit, ``(m_g, r_g, r_g)`` (the identity where a
        unit has no coordinate), or ``None`` with its units.
    """

    def __init__(
        self,
        coordinates: list[torch.Tensor],
        factors: list[torch.Tensor],
        step_growth: torch.Tensor,
        ties: list[torch.Tensor] | None = None,
        units: list[torch.Tensor | None] | None = None,
        unit_factors: list[torch.Tensor | None] | None = None,
    ) -> None:
        self.coordinates = coordinates
        self.factors = factors
        self.ties = ties if ties is not None else [v.new_zeros(0, len(v)) for v in factors]
        self.units = units if units is not None else [None] * len(factors)
        self.unit_factors = unit_factors if unit_factors is not None else [None] * len(factors)
        self.inverses = [
            torch.linalg.solve_triangular(u, torch.eye(len(u), dtype=u.dtype, device=u.device), upper=True)
            for u in factors
        ]
        self.unit_inverses = [
            None
            if u is None
            else torch.linalg.solve_triangular(
                u, torch.eye(u.shape[-1], dtype=u.dtype, device=u.device).expand_as(u), upper=True
            )
            for u in self.unit_factors
        ]
        self._unpad_indices = [None if u is None else unpad_index(u) for u in self.units]
        self.step_growth = step_growth
        # Each group's coordinates as a slice where they are contiguous and in order (AutoNormal's
        # locations of a site are), the groups ordered: the map then concatenates pieces rather
        # than writing into a clone, whose backward costs more on the solve's small tensors.
        spans = [(int(c[0]), int(c[0]) + len(c)) for c in coordinates]
        contiguous = all(torch.equal(c.cpu(), torch.arange(a, b)) for (a, b), c in zip(spans, coordinates))
        ordered = all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        self._spans = spans if contiguous and ordered else None

    def to(self, like: torch.Tensor) -> SiteWhitening:
        """The same map with tensors on ``like``'s device (matrices in its dtype)."""
        return SiteWhitening(
            [c.to(like.device) for c in self.coordinates],
            [u.to(like) for u in self.factors],
            self.step_growth.to(like),
            [e.to(like) for e in self.ties],
            [None if u is None else u.to(like.device) for u in self.units],
            [None if u is None else u.to(like) for u in self.unit_factors],
        )

    def _unit_map(self, x: torch.Tensor, g: int, inverse: bool, transpose: bool) -> torch.Tensor:
        """Group ``g``'s first ``L`` coordinates of ``x`` mapped by ``U_D`` (or its inverse, or the
        transpose of either): each unit by its ``r x r`` matrix."""
        units = self.units[g]
        if units is None:
            return x
        matrices = (self.unit_inverses if inverse else self.unit_factors)[g].to(x)
        units, index = units.to(x.device), self._unpad_indices[g].to(x.device)
        pattern = "...mj,mji->...mi" if transpose else "...mj,mij->...mi"
        return unpad(torch.einsum(pattern, pad(x, units), matrices), units, index)

    def _group_map(self, x: torch.Tensor, g: int, kind: str) -> torch.Tensor:
        """Group ``g``'s part of ``x`` (its coordinates along the last axis, in its order) mapped by
        ``U`` (``"forward"``), ``U^-1`` (``"inverse"``), ``U^-T`` (``"dual_forward"``) or ``U^T``
        (``"dual_inverse"``)."""
        ties, factor, inverse = (m.to(x) for m in (self.ties[g], self.factors[g], self.inverses[g]))
        if not len(ties):  # no diagonal part: U = V (no concatenation in the solve's graph)
            matrix = {"forward": factor.T, "inverse": inverse.T, "dual_forward": inverse}.get(kind, factor)
            return x @ matrix
        first, rest = x[..., : len(ties)], x[..., len(ties) :]
        if kind == "forward":
            return torch.cat(
                [self._unit_map(first, g, False, False) + rest @ ties.T, rest @ factor.T], dim=-1
            )
        if kind == "inverse":
            rest = rest @ inverse.T
            return torch.cat([self._unit_map(first - rest @ ties.T, g, True, False), rest], dim=-1)
        if kind == "dual_forward":
            first = self._unit_map(first, g, True, True)
            return torch.cat([first, (rest - first @ ties) @ inverse], dim=-1)
        return torch.cat([self._unit_map(first, g, False, True), first @ ties + rest @ factor], dim=-1)

    def _mapped(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        """``x`` with each group's coordinates mapped by :meth:`_group_map`."""
        if self._spans is None:
            out = x.clone()
            for g, index in enumerate(self.coordinates):
                out[..., index] = self._group_map(x[..., index], g, kind)
            return out
        pieces, end = [], 0
        for g, (start, stop) in enumerate(self._spans):
            pieces.append(x[..., end:start])
            pieces.append(self._group_map(x[..., start:stop], g, kind))
            end = stop
        pieces.append(x[..., end:])
        return torch.cat(pieces, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``T x`` along the last axis: a point, a copy or a difference of them."""
        return self._mapped(x, "forward")

    def inverse(self, x: torch.Tensor) -> torch.Tensor:
        """``T^{-1} x``: the params of a point in ``lambda~``."""
        return self._mapped(x, "inverse")

    def dual_forward(self, mu: torch.Tensor) -> torch.Tensor:
        """``T^{-T} mu``: a dual (or gradient) in ``lambda~``."""
        return self._mapped(mu, "dual_forward")

    def dual_inverse(self, mu: torch.Tensor) -> torch.Tensor:
        """``T^T mu~``: a dual of ``lambda~`` as a gradient in the params."""
        return self._mapped(mu, "dual_inverse")

    def curvature_diagonal(self, hessians: list[GroupHessians]) -> torch.Tensor:
        """The diagonal of ``T^{-T} H_b T^{-1}`` at the whitened coordinates, for each whitened
        group's blocks' Hessians: each block's curvature in ``lambda~``, shape ``(n, k)``. Column
        ``j`` of ``U^-1`` is ``U_D^-1 e_j`` on the first ``L`` coordinates, and ``(-U_D^-1 E V^-1
        e_j, V^-1 e_j)`` on the others."""
        out = []
        for g, group in enumerate(hessians):
            inverse = self.inverses[g].to(group.dense)
            spread = -self.ties[g].to(group.dense) @ inverse
            units = self.units[g]
            if units is None:
                out.append(group.diagonal)
                own = torch.einsum("lj,bl,lj->bj", spread, group.diagonal, spread)
            else:
                unit_inverse = self.unit_inverses[g].to(group.dense)
                out.append(
                    unpad(
                        torch.einsum("mij,bmik,mkj->bmj", unit_inverse, group.diagonal, unit_inverse), units
                    )
                )
                spread = self._unit_map(spread.T, g, True, False).T
                padded = pad(spread.T, units)
                own = torch.einsum("jmu,bmuv,jmv->bj", padded, group.diagonal, padded)
            out.append(
                own
                + 2 * torch.einsum("lj,bli,ij->bj", spread, group.cross, inverse)
                + torch.einsum("ij,bik,kj->bj", inverse, group.dense, inverse)
            )
        return torch.cat(out, dim=1)

    @property
    def whitened(self) -> torch.Tensor:
        """Every whitened coordinate, flat, in the groups' order."""
        return torch.cat(self.coordinates)

    def state_dict(self) -> dict[str, list[torch.Tensor] | torch.Tensor]:
        """The map's tensors, for :meth:`from_state_dict` (a PDVI checkpoint keeps them)."""
        return {
            "coordinates": self.coordinates,
            "factors": self.factors,
            "step_growth": self.step_growth,
            "ties": self.ties,
            "units": self.units,
            "unit_factors": self.unit_factors,
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> SiteWhitening:
        """The map saved by :meth:`state_dict` (a checkpoint without ``ties`` or ``units``: none)."""
        return cls(
            state["coordinates"],
            state["factors"],
            state["step_growth"],
            state.get("ties"),
            state.get("units"),
            state.get("unit_factors"),
        )


def diagonal_condition(matrix: torch.Tensor) -> float:
    """The condition number of ``S^-1/2 F S^-1/2`` (``S = diag(F)``) of a symmetric ``F``: how far
    a diagonal penalty leaves the curvature from round; infinite where ``F`` is not positive
    definite (or not finite)."""
    diagonal = matrix.diagonal()
    if not bool(torch.isfinite(matrix).all() and (diagonal > 0).all()):
        return float("inf")
    root = diagonal.sqrt()
    eigenvalues = torch.linalg.eigvalsh(matrix / root[:, None] / root[None, :])
    return float(eigenvalues[-1] / eigenvalues[0]) if eigenvalues[0] > 0 else float("inf")


def arrow_condition(diagonal: torch.Tensor, cross: torch.Tensor, dense: torch.Tensor) -> float:
    """:func:`diagonal_condition` of ``F = [[diag(D), B], [B', C]]`` without forming it: scaled to a
    unit diagonal, its first block is ``I``, and with ``B~ = Q R`` (reduced QR, ``Q`` of ``m =
    min(L, s)`` columns) its eigenvalues are those of ``[[I_m, R], [R', C~]]``, and 1 where ``L > m``
    (the directions of the first block that ``B~`` does not reach).

    :param diagonal: ``D``, ``(L,)``.
    :param cross: ``B``, ``(L, s)``.
    :param dense: ``C``, ``(s, s)``, symmetric.
    """
    if len(diagonal) == 0:
        return diagonal_condition(dense)
    if not bool(torch.isfinite(diagonal).all() and (diagonal > 0).all() and torch.isfinite(cross).all()):
        return float("inf")
    if not bool(torch.isfinite(dense).all() and (dense.diagonal() > 0).all()):
        return float("inf")
    root, dense_root = diagonal.sqrt(), dense.diagonal().sqrt()
    r = torch.linalg.qr(cross / root[:, None] / dense_root[None, :], mode="r").R
    m = len(r)
    compressed = torch.eye(m + len(dense), dtype=dense.dtype)
    compressed[:m, m:], compressed[m:, :m] = r, r.T
    compressed[m:, m:] = dense / dense_root[:, None] / dense_root[None, :]
    eigenvalues = torch.linalg.eigvalsh(compressed)
    if len(diagonal) > m:
        eigenvalues = torch.cat([eigenvalues, eigenvalues.new_ones(1)])
    smallest, largest = float(eigenvalues.min()), float(eigenvalues.max())
    return largest / smallest if smallest > 0 else float("inf")


def measure_whitening(
    hessians: torch.Tensor | list[GroupHessians],
    coordinates: list[torch.Tensor],
    size: int,
    scale_factor: float,
    natural: torch.Tensor | None = None,
) -> tuple[SiteWhitening | None, list[torch.Tensor]]:
    """The whitening of the groups whose summed Hessian is positive definite (or, in a group with a
    diagonal part, made so by :func:`modified_ldl`) and at least
    :data:`MIN_WHITENED_CONDITION` ill-conditioned for a diagonal penalty, and the groups that a
    diagonal penalty already leaves round. A group's ``U`` is that of the Cholesky factorisation of
    ``F = [[D, B], [B', C]]`` (:class:`SiteWhitening`), ``D`` diagonal or block diagonal by units:
    ``U_D`` and ``Delta_D`` from ``D``'s, ``E = Delta_D^-1 U_D^-T B``, and ``V`` and ``Delta`` from
    the Schur complement ``C - B' D^-1 B`` (:func:`_factorise`).

    :param hessians: every block's Hessian on the candidate coordinates, the groups in order,
        ``(n, k, k)`` (``k = sum_s k_s``, symmetric up to rounding), or each group's
        (:class:`GroupHessians`).
    :param coordinates: each candidate group's flat coordinates.
    :param size: ``P``, the number of global coordinates.
    :param scale_factor: ``whitened_scale / scale``, on every whitened coordinate's step size but
        ``natural``'s.
    :param natural: coordinates that keep the natural rule's constant (growth ``F_jj /
        Delta_j`` alone): the large sites of a probed group, first in its order
        (:func:`probed_order`), where that growth is 1.
    :returns: the map (``None`` where no group is ill-conditioned), and the round groups'
        coordinates: positive definite and below the threshold, where a dense penalty is about the
        diagonal one.
    """
    if isinstance(hessians, torch.Tensor):
        hessians = GroupHessians.of_sites(hessians, coordinates)
    kept, factors, ties, units, unit_factors, round_sites = [], [], [], [], [], []
    growth = None
    for index, group in zip(coordinates, hessians):
        factorised = _factorise(group)
        growth = group.dense.new_ones(size) if growth is None else growth
        if factorised is None:
            continue  # not positive definite here (a non-convex spot): the group stays diagonal
        factor, spread, unit_factor, pivots = factorised
        if _condition(group, factorised) < MIN_WHITENED_CONDITION:
            round_sites.append(index)  # the diagonal penalty already sees this group's curvature
            continue
        kept.append(index)
        factors.append(factor)
        ties.append(spread)
        units.append(group.units)
        unit_factors.append(unit_factor)
        constant = torch.full((len(index),), scale_factor, dtype=pivots.dtype)
        if natural is not None:
            constant[torch.isin(index, natural.cpu())] = 1.0
        # F_jj / Delta_j: 1 on the first L coordinates where their units are single.
        dense = group.totals()[2]
        curvature = torch.cat([group.leading_diagonal().sum(0), dense.diagonal()]) / pivots.square()
        growth[index.to(growth.device)] = constant * curvature.clamp(max=MAX_STEP_GROWTH)
    if not kept:
        return None, round_sites
    return SiteWhitening(kept, factors, growth, ties, units, unit_factors), round_sites


def _eliminate_leading(
    group: GroupHessians,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor] | None:
    """A group's first ``L`` coordinates eliminated from its summed Hessian ``F = [[D, B], [B',
    C]]``: ``E``, ``U_D`` per unit (``None`` where units are single), ``Delta_D^1/2`` per
    coordinate, and the Schur complement ``C - B' D^-1 B``; ``None`` where ``D`` is not positive
    definite (or not finite). Per unit, ``D_u = L_u L_u'`` (Cholesky, pivots ``p``): ``U_D = (L_u /
    p)'`` and ``E = Delta_D^-1 U_D^-T B = (L_u^-1 B) / p``."""
    diagonal, cross, dense = group.totals()
    if group.units is None:
        if not bool(torch.isfinite(diagonal).all() and (diagonal > 0).all()):
            return None
        spread = cross / diagonal[:, None]
        return spread, None, diagonal.sqrt(), dense - cross.T @ spread
    absent = (group.units < 0).to(diagonal)
    lower, info = torch.linalg.cholesky_ex(diagonal + torch.diag_embed(absent))
    if bool((info != 0).any()) or not bool(torch.isfinite(lower).all()):
        return None
    pivots = lower.diagonal(dim1=-2, dim2=-1)
    unit_factor = (lower / pivots[:, None, :]).transpose(-1, -2)
    solved = torch.linalg.solve_triangular(lower, pad(cross.T, group.units).permute(1, 2, 0), upper=False)
    spread = unpad((solved / pivots[..., None]).permute(2, 0, 1), group.units).T
    return (
        spread,
        unit_factor,
        unpad(pivots, group.units),
        dense - torch.einsum("mrs,mrt->st", solved, solved),
    )


def _factorise(
    group: GroupHessians,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
    """The factors of ``F = U' Delta U`` for a group's summed Hessian (:class:`SiteWhitening`'s
    ``U``): ``V``, ``E``, ``U_D`` per unit (``None`` where units are single) and ``Delta^1/2`` per
    coordinate in the group's order (:func:`_eliminate_leading`, then ``V`` from the Schur
    complement's Cholesky factor, or, where that is not positive definite in a group with a
    diagonal part, from :func:`modified_ldl`); ``None`` where ``F`` is not positive definite (or
    not finite) otherwise."""
    eliminated = _eliminate_leading(group)
    if eliminated is None:
        return None
    spread, unit_factor, leading, schur = eliminated
    schur = (schur + schur.T) / 2
    factor, info = torch.linalg.cholesky_ex(schur)
    if int(info) == 0 and bool(torch.isfinite(factor).all()):
        rest = factor.diagonal()
        return factor.T / rest[:, None], spread, unit_factor, torch.cat([leading, rest])
    if not len(spread) or not bool(torch.isfinite(schur).all()):
        return None  # a group with no diagonal part stays diagonal where F is not positive definite
    # The floor: the Schur complement's diagonal where positive, else the coordinate's own curvature.
    own = group.totals()[2].diagonal()
    upper, pivots = modified_ldl(schur, torch.where(schur.diagonal() > 0, schur.diagonal(), own))
    return None if upper is None else (upper, spread, unit_factor, torch.cat([leading, pivots.sqrt()]))


def modified_ldl(
    matrix: torch.Tensor, floor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """``matrix = U' diag(d) U - M`` with ``U`` unit upper triangular and ``M`` diagonal, ``M_jj >=
    0``: the LDL factorisation, each pivot ``d_j`` that is not positive replaced by ``floor_j`` and
    the elimination continued with it (the modified Cholesky factorisation of Gill & Murray 1974, in
    its simplest form). A probed group's Schur complement can have such a pivot at the first
    epoch's end: on the suite's random-slopes model (``docs/benchmarks.md`` 13zq) the slope
    coefficient's, its curvature with the sites' effects held fixed (641, of its own 97,959) less
    its tie to the intercept (823), where some slopes that few data fix make the random slopes'
    prior ``b^2 / (2 tau_b^2) + log tau_b``, not convex in ``(b, log tau_b)``, weigh. The group is
    then whitened by the positive definite ``U' diag(d) U``, whose ties are ``F``'s. Refused, the
    tie of the slopes' mean with the slope coefficient crawled.

    :param matrix: symmetric, ``(s, s)``.
    :param floor: each coordinate's pivot where its own is not positive (positive): the Schur
        complement's diagonal where positive (the coordinate's curvature with the group's first
        ``L`` coordinates held fixed; its own curvature ``F_jj``, 150 times that in the example
        above, kept that tie crawling).
    :returns: ``U`` and ``d``, or ``(None, None)`` where a floor that is needed is not positive.
    """
    size = len(matrix)
    lower = torch.eye(size, dtype=matrix.dtype)
    pivots = torch.zeros(size, dtype=matrix.dtype)
    for j in range(size):
        pivot = matrix[j, j] - (lower[j, :j].square() * pivots[:j]).sum()
        pivot = pivot if pivot > 0 else floor[j]
        if not pivot > 0:
            return None, None
        pivots[j] = pivot
        below = matrix[j + 1 :, j] - (lower[j + 1 :, :j] * lower[j, :j] * pivots[:j]).sum(1)
        lower[j + 1 :, j] = below / pivot
    return lower.T.contiguous(), pivots


def without_indefinite(group: GroupHessians, coordinates: torch.Tensor) -> tuple[GroupHessians, torch.Tensor]:
    """A group with a diagonal part whose Schur complement ``C - B' D^-1 B`` is indefinite, without
    the dense coordinates whose LDL pivot is not positive, most tied factorised first (below):
    they keep their diagonal penalty, and the rest is factorised without :func:`modified_ldl`'s
    floors. At the first epoch's end a random effect's hyper-scale can make the group indefinite
    (its prior, not convex in ``(a, log tau)``). Used for a group of nested units
    (:func:`nested_positions`): on the suite's 200 sites nested in 100 regions
    (``docs/benchmarks.md`` 13zv) the regions' scale had the negative pivot on both seeds traced;
    with the modified factor the intercept's step grew 250-fold on one of them, which diverged at
    the next step, and with the replaced pivots last its sites' scales collapsed; without them both
    reached 2.3e-4. Elsewhere the modified factor stays (13zq: on the random slopes, leaving the
    slope coefficient out kept it crawling). The coordinates are factorised most tied first (the
    Schur complement's diagonal over their own curvature, smallest first) and the first whose
    pivot is not positive left out, the rest factorised again: with a random slope per site too
    (13zw) the pair that was not positive definite was the slopes' scale ``tau_b`` and the slope
    coefficient, which their ties to the slopes' effects fix (its Schur diagonal 1% of its own,
    ``tau_b``'s 95%); in the layout's order the coefficient was left out, and its split with the
    slopes crawled (0.36 off after 8 epochs, 0.0044 with ``tau_b`` left out instead).

    :param group: the group's Hessians, in the order of ``coordinates``.
    :param coordinates: its flat coordinates (the leading ``L`` first).
    :returns: the group and its coordinates, without those coordinates where needed.
    """
    eliminated = _eliminate_leading(group)
    if eliminated is None or not len(eliminated[0]) or not bool(torch.isfinite(eliminated[3]).all()):
        return group, coordinates
    schur = (eliminated[3] + eliminated[3].T) / 2
    # Most tied first: the Schur complement's diagonal over the coordinate's own curvature (the
    # inverse of its step growth) is smallest where the group's ties matter most to it.
    own = group.totals()[2].diagonal()
    kept = torch.sort(schur.diagonal() / own.clamp(min=torch.finfo(own.dtype).tiny), stable=True).indices
    while len(kept):
        # The first pivot of the plain LDL in that order that is not positive (cholesky_ex's info,
        # 1-based): its coordinate is left out, and the rest factorised again without it.
        failed = int(torch.linalg.cholesky_ex(schur[kept][:, kept])[1])
        if failed == 0:
            break
        kept = torch.cat([kept[: failed - 1], kept[failed:]])
    if len(kept) == len(schur):
        return group, coordinates
    kept = kept.sort().values
    leading = len(coordinates) - len(schur)
    reduced = GroupHessians(
        group.diagonal, group.cross[:, :, kept], group.dense[:, kept][:, :, kept], group.units
    )
    return reduced, torch.cat([coordinates[:leading], coordinates[leading:][kept.to(coordinates.device)]])


def _condition(group: GroupHessians, factorised: tuple) -> float:
    """:func:`arrow_condition` of a group's summed Hessian; where its units are not single, the
    extreme eigenvalues of ``S^-1/2 F S^-1/2`` (``S = diag(F)``) and of its inverse by Lanczos
    iterations, ``F`` and ``F^-1`` applied through the factors (:func:`_factorise`)."""
    if group.units is None:
        return arrow_condition(*group.totals())
    factor, spread, unit_factor, pivots = factorised
    size = len(pivots)
    local = SiteWhitening(
        [torch.arange(size)], [factor], pivots.new_ones(size), [spread], [group.units], [unit_factor]
    )
    scale = torch.cat([group.leading_diagonal().sum(0), group.totals()[2].diagonal()]).sqrt()
    delta = pivots.square()

    def curvature(x: torch.Tensor) -> torch.Tensor:
        return local.dual_inverse(delta * local.forward(x / scale)) / scale

    def inverse(x: torch.Tensor) -> torch.Tensor:
        return local.inverse(local.dual_forward(x * scale) / delta) * scale

    steps = min(size, LANCZOS_STEPS)
    return float(lanczos(curvature, size, steps, 0)[0][-1] * lanczos(inverse, size, steps, 0)[0][-1])


#: Lanczos iterations of :func:`_condition` (:func:`~pyro_pdvi.infer.reduced_hessian.lanczos`): the
#: largest Ritz value converges first; exact where the group has at most this many coordinates, a
#: lower bound otherwise.
LANCZOS_STEPS = 64


def site_hessians(
    products: Callable[[int, torch.Tensor], torch.Tensor],
    num_blocks: int,
    coordinates: list[torch.Tensor],
    like: torch.Tensor,
) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """Every block's Hessian on the candidate sites' coordinates, from its products with their
    unit vectors; first on :data:`FIRST_BLOCKS` blocks, and then on the others only for the sites
    whose sum over those a diagonal penalty does not already leave round
    (:data:`MIN_WHITENED_CONDITION`).

    :param products: ``(b, V) -> V H_b`` for directions ``V`` of shape ``(k, P)``.
    :param num_blocks: n.
    :param coordinates: each candidate site's flat coordinates.
    :param like: a tensor whose last size is ``P``, whose dtype and device the directions take.
    :returns: the sites still candidates, every block's Hessian on their coordinates (the sites in
        order), ``(n, k, k)``, float64 on the host, and the sites found round on the first blocks.
    """

    def measure(b: int, sites: list[torch.Tensor]) -> torch.Tensor:
        index = torch.cat(sites)
        found = products(b, unit_vectors(like, index))
        return found[:, index.to(found.device)].to("cpu", torch.float64)

    first = min(FIRST_BLOCKS, num_blocks)
    early = torch.stack([measure(b, coordinates) for b in range(first)])
    total, kept, positions, round_sites, start = early.sum(0), [], [], [], 0
    for index in coordinates:
        span = torch.arange(start, start + len(index))
        start += len(index)
        if diagonal_condition(total[span][:, span]) >= MIN_WHITENED_CONDITION:
            kept.append(index)
            positions.append(span)
        else:
            round_sites.append(index)
    if not kept:
        return [], early[:, :0, :0], round_sites
    span = torch.cat(positions)
    early = early[:, span][:, :, span]
    rest = [measure(b, kept) for b in range(first, num_blocks)]
    return kept, torch.cat([early, torch.stack(rest)]) if rest else early, round_sites
