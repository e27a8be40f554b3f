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
so that a random effect of thousands of sites costs as much per coordinate as one of ten.
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

#: A site is whitened where it has at least 2 and at most this many coordinates to whiten: the
#: measurement takes one Hessian product per coordinate and block, and ``U`` is dense.
MAX_WHITENED_COORDINATES = 64


#: A joint group whose large sites are measured by probes (:func:`probes_apply`) is formed where
#: its blocks' Hessians between the large sites' coordinates and the others, ``n L s`` numbers
#: (:class:`GroupHessians`), are at most this many: 128 MiB in float64. Its map and measurement
#: cost ``L s`` a block, not ``(L + s)^2``: no other limit on the large sites.
MAX_PROBED_ENTRIES = 2**24

#: In a joint group, a site of at most this many coordinates is measured by its unit vectors; a
#: larger one by two probes, where its own Hessian is diagonal (:func:`probed_block_hessians`).
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


def probes_apply(sites: list[torch.Tensor], num_blocks: int) -> bool:
    """Whether ``sites`` form a joint group whose large sites :func:`probed_block_hessians` would
    measure by probes: two sites or more, at least one site of more than
    :data:`MAX_UNIT_VECTOR_SITE`, at most :data:`MAX_WHITENED_COORDINATES` unit vectors for the
    others, and at most :data:`MAX_PROBED_ENTRIES` numbers in the blocks' Hessians between the two.

    :param sites: the candidate sites' flat coordinates.
    :param num_blocks: n.
    """
    sizes = [len(c) for c in sites]
    small = sum(k for k in sizes if k <= MAX_UNIT_VECTOR_SITE)
    large = sum(sizes) - small
    return (
        len(sites) >= 2
        and large > 0
        and 0 < small <= MAX_WHITENED_COORDINATES
        and num_blocks * large * small <= MAX_PROBED_ENTRIES
    )


def probed_order(sites: list[torch.Tensor]) -> torch.Tensor:
    """A probed group's coordinates in the order it is whitened: the large sites' (more than
    :data:`MAX_UNIT_VECTOR_SITE` coordinates) first, then the others', sorted. First, a large site's
    coordinates are tied to nothing before them (their own Hessian is diagonal and not tied to the
    other large sites'), so their ``Delta_j = F_jj``: the map makes each ``a_g`` plus its share of
    the shared coordinates, which the data fix, and the shared coordinates, last, carry the tie."""
    large = [c for c in sites if len(c) > MAX_UNIT_VECTOR_SITE]
    small = [c for c in sites if len(c) <= MAX_UNIT_VECTOR_SITE]
    rest = torch.cat(small).sort().values if small else sites[0][:0]
    return torch.cat([*large, rest])


@dataclass
class GroupHessians:
    """Every block's Hessian on one group's coordinates, in the group's order, stored as an arrow:
    diagonal on its first ``L`` coordinates (a probed group's large sites, :func:`probed_order`;
    none for a group measured by unit vectors), dense on the other ``s`` and between them and the
    first. ``n (L + L s + s^2)`` numbers, where the dense matrices would be ``n (L + s)^2``.

    :param diagonal: the first ``L`` coordinates' curvatures, ``(n, L)``.
    :param cross: the entries between those and the others, ``(n, L, s)``.
    :param dense: the others' Hessians, ``(n, s, s)``.
    """

    diagonal: torch.Tensor
    cross: torch.Tensor
    dense: torch.Tensor

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
        """The blocks' sums ``(D, B, C)`` of ``F = [[diag(D), B], [B', C]]``, ``C`` symmetrised."""
        dense = self.dense.sum(0)
        return self.diagonal.sum(0), self.cross.sum(0), (dense + dense.T) / 2


def probed_block_hessians(
    products: Callable[[int, torch.Tensor], torch.Tensor],
    num_blocks: int,
    sites: list[torch.Tensor],
    like: torch.Tensor,
    tolerance: float = 1e-3,
) -> GroupHessians | None:
    """Every block's Hessian on a joint group's coordinates (in :func:`probed_order`), measured with few
    products where its large sites are diagonal: each site of at most :data:`MAX_UNIT_VECTOR_SITE`
    coordinates by its unit vectors (its rows and, by symmetry, columns), each larger site ``S`` by two
    probes, ``1_S`` (its ones) and ``r_S`` (random signs on it). Where ``S``'s own Hessian is diagonal
    and ``S`` is not tied to the other large sites (a random effect per site of the data: each ``a_g``
    enters its own rows only), ``(H 1_S)_S`` is that diagonal, ``(H r_S)_S`` equals it times ``r_S``, and
    both vanish on the other large sites; any block where a probe shows otherwise (beyond ``tolerance``
    of the diagonal's largest entry) returns ``None``. This is the grouping of Hessian columns by Curtis,
    Powell & Reid (1974) for that pattern: a group of 200 sites' effects and 6 shared coordinates costs 8
    products a block, not 206.

    :param products: ``(b, V) -> V H_b`` for directions ``V`` of shape ``(k, P)``.
    :param num_blocks: n.
    :param sites: the group's sites' flat coordinates.
    :param like: a tensor whose last size is ``P``, whose dtype and device the directions take.
    :returns: the arrow (diagonal on the large sites), float64 on the host, or ``None``.
    """
    group = probed_order(sites)
    large = [c for c in sites if len(c) > MAX_UNIT_VECTOR_SITE]
    large_index = torch.cat(large)
    small_index = group[len(large_index) :]
    generator = torch.Generator().manual_seed(len(group))
    signs = [
        2 * torch.randint(0, 2, (len(site),), generator=generator, dtype=torch.float64) - 1 for site in large
    ]
    directions = [unit_vectors(like, small_index)]
    for site, site_signs in zip(large, signs):
        probes = like.new_zeros(2, like.shape[-1])
        probes[0, site] = 1.0
        probes[1, site] = site_signs.to(probes)
        directions.append(probes)
    directions = torch.cat(directions)
    diagonals, crosses, denses = [], [], []
    for b in range(num_blocks):
        found = products(b, directions).to("cpu", torch.float64)
        rows = found[: len(small_index)]
        diagonal = []
        for j, site in enumerate(large):
            ones, signed = found[len(small_index) + 2 * j], found[len(small_index) + 2 * j + 1]
            others = large_index[~torch.isin(large_index, site)]
            error = torch.cat([signed[site] - ones[site] * signs[j], ones[others], signed[others]])
            scale = float(ones[site].abs().max())
            if not bool(torch.isfinite(error).all()) or float(error.abs().max()) > tolerance * max(
                scale, 1e-30
            ):
                return None
            diagonal.append(ones[site])
        diagonals.append(torch.cat(diagonal))
        crosses.append(rows[:, large_index].T)
        denses.append(rows[:, small_index])
    return GroupHessians(torch.stack(diagonals), torch.stack(crosses), torch.stack(denses))


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
    each whitened group's coordinates, where it is that group's ``U = [[I, E], [0, V]]``: ``I`` on
    its first ``L`` coordinates (a probed group's large sites, whose own Hessian is diagonal), ``E =
    diag(D)^-1 B`` their ties to the other ``s``, and ``V`` unit upper triangular on those (the whole
    ``U`` for a group with no diagonal part, ``L = 0``). Applying it costs ``L s + s^2``.

    :param coordinates: each whitened group's flat coordinates, a list of ``(L_g + s_g,)``
        LongTensors.
    :param factors: each group's ``V``, ``(s_g, s_g)``.
    :param step_growth: per coordinate, the factor on its step size in ``lambda~`` (1 where not
        whitened), shape ``(P,)``.
    :param ties: each group's ``E``, ``(L_g, s_g)``; ``None``: no group has a diagonal part.
    """

    def __init__(
        self,
        coordinates: list[torch.Tensor],
        factors: list[torch.Tensor],
        step_growth: torch.Tensor,
        ties: list[torch.Tensor] | None = None,
    ) -> None:
        self.coordinates = coordinates
        self.factors = factors
        self.ties = ties if ties is not None else [v.new_zeros(0, len(v)) for v in factors]
        self.inverses = [
            torch.linalg.solve_triangular(u, torch.eye(len(u), dtype=u.dtype, device=u.device), upper=True)
            for u in factors
        ]
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
        )

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
            return torch.cat([first + rest @ ties.T, rest @ factor.T], dim=-1)
        if kind == "inverse":
            rest = rest @ inverse.T
            return torch.cat([first - rest @ ties.T, rest], dim=-1)
        if kind == "dual_forward":
            return torch.cat([first, (rest - first @ ties) @ inverse], dim=-1)
        return torch.cat([first, first @ ties + rest @ factor], dim=-1)

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
        ``j`` of ``U^-1`` is ``e_j`` on the first ``L`` coordinates, and ``(-E V^-1 e_j, V^-1 e_j)``
        on the others."""
        out = []
        for ties, inverse, group in zip(self.ties, self.inverses, hessians):
            inverse = inverse.to(group.dense)
            spread = -ties.to(group.dense) @ inverse
            out.append(group.diagonal)
            out.append(
                torch.einsum("lj,bl,lj->bj", spread, group.diagonal, spread)
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
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> SiteWhitening:
        """The map saved by :meth:`state_dict` (a checkpoint without ``ties``: none)."""
        return cls(state["coordinates"], state["factors"], state["step_growth"], state.get("ties"))


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
    """The whitening of the groups whose summed Hessian is positive definite and at least
    :data:`MIN_WHITENED_CONDITION` ill-conditioned for a diagonal penalty, and the groups that a
    diagonal penalty already leaves round. A group's ``U`` is that of the Cholesky factorisation of
    ``F = [[diag(D), B], [B', C]]`` (:class:`SiteWhitening`): ``E = diag(D)^-1 B``, and ``V`` and
    ``Delta`` from the Schur complement ``C - B' diag(D)^-1 B``.

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
    kept, factors, ties, round_sites = [], [], [], []
    growth = None
    for index, group in zip(coordinates, hessians):
        diagonal, cross, dense = group.totals()
        growth = dense.new_ones(size) if growth is None else growth
        spread = cross / diagonal[:, None]
        schur = dense - cross.T @ spread
        factor, info = torch.linalg.cholesky_ex((schur + schur.T) / 2)
        if int(info) != 0 or not bool(torch.isfinite(factor).all() and (diagonal > 0).all()):
            continue  # not positive definite here (a non-convex spot): the group stays diagonal
        if arrow_condition(diagonal, cross, dense) < MIN_WHITENED_CONDITION:
            round_sites.append(index)  # the diagonal penalty already sees this group's curvature
            continue
        pivots = factor.diagonal()
        kept.append(index)
        factors.append(factor.T / pivots[:, None])
        ties.append(spread)
        constant = torch.full((len(index),), scale_factor, dtype=dense.dtype)
        if natural is not None:
            constant[torch.isin(index, natural.cpu())] = 1.0
        # F_jj / Delta_j: 1 on the first L coordinates, whose Delta_j is D_j.
        curvature = torch.cat([diagonal, dense.diagonal()]) / torch.cat([diagonal, pivots.square()])
        growth[index.to(growth.device)] = constant * curvature.clamp(max=MAX_STEP_GROWTH)
    if not kept:
        return None, round_sites
    return SiteWhitening(kept, factors, growth, ties), round_sites


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
