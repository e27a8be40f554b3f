"""Coordinates in which PD-VI's preconditioner couples a shared site with one-block coordinates.

A group's random effect ``a_j`` with one block per group is informed by its own block only
(a *concentrated* coordinate, :mod:`~pyro_pdvi.infer.consensus`), and the data fix only its sum
with the intercept ``alpha`` that every block informs. The direction that moves ``alpha`` up and
every ``a_j`` down is left to the priors: its curvature is about ``1/n`` of ``alpha``'s. A diagonal
``D`` cannot see it, and PD-VI crawls along it, ~7% per epoch (``docs/benchmarks.md`` 13k).

The fix is the arrowhead preconditioner of the total Hessian's ``(alpha, a)`` block, which is
diagonal in the coordinates ``lambda~ = T lambda``,

    lambda~_j = lambda_j + sum_s R_js lambda_s   (j concentrated, s shared),
    lambda~_s = lambda_s                        (every other coordinate),

with ``R_Js = H_JJ^{-1} H_Js`` from the total Hessian ``H``, ``J`` the concentrated coordinates
of one block (a group's intercept and slope, which its data tie together): in the example
``a~_j ~ a_j + alpha``, the group's total intercept. Moving a shared ``s`` with ``a~`` held moves
the concentrated coordinates by ``-R_.s``, along which the data stay put, so ``s``'s curvature
there is the reduced one ``v_s^T H v_s`` (``v_s = e_s - sum_j R_js e_j``), not ``H_ss``, and its
step size grows by their ratio. PD-VI in these coordinates is PD-VI with the non-diagonal
``D = T^T D~ T``; a linear bijection changes neither the objective's minimiser nor the fixed
point: the state (consensus, copies, duals) is kept in ``lambda~`` and the model is evaluated at
``T^{-1} lambda~``.

``R`` only maps shared to concentrated coordinates (no coordinate is both), so ``T = I + E``
with ``E^2 = 0``: ``T^{-1} = I - E``, and the duals, which pair with differences of copies,
transform by ``T^{-T} = I - E^T``.

``T`` and the growth are measured once, when the concentrated coordinates are found (after every
block's first step), from Hessian-vector products of every block (:func:`measure_coupling`), by
double backward: one model evaluation per block, whose graph serves both passes, and one
backward pass per direction (``docs/benchmarks.md`` 13p: 1.1-1.6 CPU s on the suite's
random-effects model, 30 model evaluations and about 250 backward passes; 13m's 60 evaluations,
one per block and pass, took 1.6-2.2 s; 13l's finite differences of ``vmap``-ped gradients took
about 0.5 s plus, once per process, 0.8-1.2 s for torch's import of its ``vmap`` machinery, and
needed a model that ``vmap`` can map). The Hessian moves as the hyper-scales and noise scale
settle; ``T`` does not follow it (any ``T`` keeps the fixed point; a stale one is only a weaker
preconditioner). Only coordinates whose step sizes follow the natural rule (a block's share of
each coordinate's curvature) are coupled: the growth presumes them, and with one step size for a
whole group (a fixed ``eta``, a Delta guide's curvature rule) a MAP fit of the suite's model went
slower coupled (13l). And only a shared coordinate that shifts alike the concentrated
coordinates of the site it ties most, as an intercept does every group's effect: a noise
scale's cross-curvature with the group effects, large while the residuals are, has each group's
sign and vanishes at the optimum (13m).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .problem import SiteViews

if TYPE_CHECKING:
    from .objective import BlockLosses
    from .sites import GlobalLayout

#: A shared coordinate is coupled where the concentrated coordinates explain at least this
#: fraction of its curvature (``E_s / H_ss``, :func:`measure_coupling`): there the reduced
#: curvature is far below ``H_ss``; elsewhere the diagonal preconditioner is nearly right.
EXPLAINED_FRACTION = 0.5

#: A shared coordinate is coupled only where it shifts the concentrated coordinates of the site it
#: ties most alike: the entries of ``R`` of one sign carry at least this fraction of that site's
#: ``sum |R_js|`` (:func:`measure_coupling`).
COMMON_SHIFT_FRACTION = 0.9

#: A coupled coordinate's step size grows by at most this factor (``H_ss / reduced``), so that a
#: reduced curvature lost in the finite differences' error cannot make it unbounded.
MAX_STEP_GROWTH = 1000.0


class Coupling:
    """The linear map ``lambda~ = T lambda`` of the module docstring.

    :param rows: the concentrated coordinate ``j`` of each entry of ``R``, shape ``(k,)``.
    :param cols: its shared coordinate ``s``, shape ``(k,)``.
    :param values: ``R_js``, shape ``(k,)``.
    :param step_growth: per coordinate, the factor by which its step size grows in ``lambda~``
        (``H_ss / (v_s^T H v_s)`` at a shared coordinate, 1 elsewhere), shape ``(P,)``.
    """

    def __init__(
        self, rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor, step_growth: torch.Tensor
    ) -> None:
        if set(rows.tolist()) & set(cols.tolist()):
            raise ValueError("a coordinate cannot be both concentrated and shared in a coupling")
        self.rows, self.cols, self.values = rows, cols, values
        self.step_growth = step_growth

    def __len__(self) -> int:
        return len(self.values)

    def to(self, like: torch.Tensor) -> Coupling:
        """The same map with tensors on ``like``'s device (values in its dtype)."""
        return Coupling(
            self.rows.to(like.device),
            self.cols.to(like.device),
            self.values.to(like),
            self.step_growth.to(like),
        )

    def _moved(self, x: torch.Tensor, into: torch.Tensor, source: torch.Tensor, sign: float) -> torch.Tensor:
        out = x.clone()
        return out.index_add_(-1, into, sign * x[..., source] * self.values.to(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``T x`` along the last axis: a point, a copy or a difference of them."""
        return self._moved(x, self.rows, self.cols, 1.0)

    def inverse(self, x: torch.Tensor) -> torch.Tensor:
        """``T^{-1} x``: the params of a point in ``lambda~``."""
        return self._moved(x, self.rows, self.cols, -1.0)

    def dual_forward(self, mu: torch.Tensor) -> torch.Tensor:
        """``T^{-T} mu``: a dual (or gradient) in ``lambda~``."""
        return self._moved(mu, self.cols, self.rows, -1.0)

    def dual_inverse(self, mu: torch.Tensor) -> torch.Tensor:
        """``T^T mu~``: a dual of ``lambda~`` as a gradient in the params."""
        return self._moved(mu, self.cols, self.rows, 1.0)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The map's tensors, for :meth:`from_state_dict` (a PDVI checkpoint keeps them)."""
        return {"rows": self.rows, "cols": self.cols, "values": self.values, "step_growth": self.step_growth}

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]) -> Coupling:
        """The map saved by :meth:`state_dict`."""
        return cls(state["rows"], state["cols"], state["values"], state["step_growth"])


#: ``(b, V) -> V H_b``: block ``b``'s Hessian times each row of ``V``.
HessianProducts = Callable[[int, torch.Tensor], torch.Tensor]


def measure_coupling(
    hessian_products: HessianProducts,
    owned: list[torch.Tensor],
    shared: torch.Tensor,
    information: torch.Tensor,
    sites: torch.Tensor | None = None,
    owner_columns: HessianProducts | None = None,
) -> Coupling | None:
    """Find ``R`` and how much the coupled coordinates' step sizes grow.

    Two passes over the blocks. First each block's Hessian columns at the concentrated
    coordinates ``J`` it owns: no other block's data touch them, so they give ``H_JJ`` (plus the
    other blocks' measured shares of their priors on the diagonal) and ``H_Js``, and
    ``R_Js = H_JJ^{-1} H_Js`` (the block's coordinates together: a group's intercept and slope are
    tied by its data). The concentrated coordinates explain ``E_s = sum_b H_sJ H_JJ^{-1} H_Js`` of
    a shared coordinate's curvature. Then, for the shared coordinates they may explain much of,
    the reduced curvature ``S_s = sum_b v_s^T H_b v_s``: ``s`` is coupled where
    ``E_s >= EXPLAINED_FRACTION * H_ss`` (``H_ss = E_s + S_s``), and its step size grows by
    ``H_ss / S_s``. A direction of negative curvature (``S_s <= 0``: a non-convex spot, such as a
    noise scale and the effects of groups whose residuals are large) is never coupled, nor a
    block's coordinates whose products are not finite or whose ``H_JJ`` is not positive definite.
    With ``sites``, ``s`` must also shift alike the concentrated coordinates of the site that
    carries most of its ``sum |R_js|`` (the entries of one sign carry
    :data:`COMMON_SHIFT_FRACTION` of that site's), as an intercept shifts every group's effect:
    a cross-curvature that the residuals make takes each group's residual's sign instead, and
    vanishes at the optimum (the Fisher information of a location and a log-scale is diagonal).
    Measured on the suite's random-effects model, where the noise scale's log passed the other
    tests on two seeds of four after the first epoch, with ``R`` of both signs over the groups
    (12 and 16), and coupled to them it dragged the group effects with each of its moves
    (``docs/benchmarks.md`` 13m).

    :param hessian_products: ``(b, V) -> V H_b``, block ``b``'s Hessian times each row of
        ``V`` (``(k, P)``), at ``lambda_0`` and fixed noise.
    :param owned: for each block, the concentrated coordinates it informs.
    :param shared: boolean mask of the coordinates that may be coupled (informed by many
        blocks, not held).
    :param information: every block's measured diagonal curvature, ``(n, P)`` (for the other
        blocks' shares of a concentrated coordinate, and to pass over shared coordinates that
        the concentrated ones barely touch).
    :param sites: each coordinate's site, as an integer, ``(P,)`` (``None``: no common-shift test).
    :param owner_columns: ``(b, J) -> H_b[J, :]``, the first pass's columns, where they are at
        hand (``None``: products with unit vectors).
    :returns: the coupling, or ``None`` where no shared coordinate is coupled.
    """
    size = information.shape[1]
    shared_ids = shared.nonzero().reshape(-1)
    ratios, explained = [], information.new_zeros(len(shared_ids))
    for b, mine in enumerate(owned):
        if not len(mine):
            ratios.append(information.new_zeros(0, len(shared_ids)))
            continue
        if owner_columns is None:
            columns = hessian_products(b, unit_vectors(information, mine))
        else:
            columns = owner_columns(b, mine)
        stiffness = columns[:, mine] + torch.diag(information[:, mine].sum(0) - information[b, mine])
        cross = columns[:, shared_ids]
        try:
            ratio = torch.cholesky_solve(cross, torch.linalg.cholesky((stiffness + stiffness.T) / 2))
        except RuntimeError:  # not positive definite here: this block's coordinates stay apart
            ratio = torch.zeros_like(cross)
        if not bool(torch.isfinite(ratio).all() & torch.isfinite(cross).all()):  # left the domain
            cross, ratio = torch.zeros_like(cross), torch.zeros_like(cross)
        ratios.append(ratio)
        explained += (cross * ratio).sum(0)
    concentrated = torch.cat(owned)
    ratios = torch.cat(ratios)
    # A loose first cut by the measured diagonal, which Hutchinson's estimate can make several
    # times too large where coordinates are tied: the reduced curvature decides.
    candidates = explained >= EXPLAINED_FRACTION / 10 * information[:, shared_ids].sum(0)
    if sites is not None:
        candidates &= _shifts_a_site_alike(ratios, sites[concentrated])
    candidates = candidates.nonzero().reshape(-1)
    if not len(candidates):
        return None
    directions = unit_vectors(information, shared_ids[candidates])
    directions[:, concentrated] = -ratios[:, candidates].T
    reduced = sum((directions * hessian_products(b, directions)).sum(1) for b in range(len(owned)))
    full = explained[candidates] + reduced
    coupled = (reduced > 0) & (explained[candidates] >= EXPLAINED_FRACTION * full)
    if not bool(coupled.any()):
        return None
    growth = information.new_ones(size)
    growth[shared_ids[candidates[coupled]]] = (full / reduced)[coupled].clamp(max=MAX_STEP_GROWTH)
    chosen = ratios[:, candidates[coupled]]
    entries = chosen.nonzero()
    return Coupling(
        concentrated[entries[:, 0]],
        shared_ids[candidates[coupled]][entries[:, 1]],
        chosen[entries[:, 0], entries[:, 1]],
        growth,
    )


def _shifts_a_site_alike(ratios: torch.Tensor, sites: torch.Tensor) -> torch.Tensor:
    """For each column of ``ratios`` (``R_Js`` of every concentrated coordinate, ``(k, c)``),
    whether in the site that carries most of its ``sum |R_js|`` the entries of one sign carry
    :data:`COMMON_SHIFT_FRACTION` of that site's; ``sites`` gives each row's site."""
    masses, alike = [], []
    for site in sites.unique():
        mine = ratios[sites == site]
        up, down = mine.clamp(min=0).sum(0), (-mine).clamp(min=0).sum(0)
        masses.append(up + down)
        alike.append((up + down > 0) & (torch.maximum(up, down) >= COMMON_SHIFT_FRACTION * (up + down)))
    if not masses:
        return torch.zeros(ratios.shape[1], dtype=torch.bool, device=ratios.device)
    dominant = torch.stack(masses).argmax(0)
    return torch.stack(alike).gather(0, dominant[None]).reshape(-1)


def unit_vectors(like: torch.Tensor, coordinates: torch.Tensor) -> torch.Tensor:
    """Unit vectors of ``coordinates``, shape ``(k, P)`` (``P`` the last size of ``like``)."""
    units = like.new_zeros(len(coordinates), like.shape[-1])
    units[torch.arange(len(coordinates)), coordinates] = 1.0
    return units


class CoupledLosses:
    """The blocks' ``f_b`` as a function of copies in ``lambda~``: evaluated at ``T^{-1}``
    of them (a :class:`~pyro_pdvi.infer.objective.BlockLosses` seen through a coupling, or
    through a :class:`~pyro_pdvi.infer.whitening.SiteWhitening`: any map with ``inverse``).

    :param losses: the blocks' objective in the params' coordinates.
    :param coupling: the map ``T``.
    :param layout: the global sites' layout (to flatten the copies).
    """

    def __init__(self, losses: BlockLosses, coupling: Coupling, layout: GlobalLayout) -> None:
        self.losses = losses
        self.coupling = coupling
        self.layout = layout

    def __call__(
        self, copies: dict[str, torch.Tensor], rows: dict[str, torch.Tensor], vectorize: bool = False
    ) -> torch.Tensor:
        if isinstance(copies, SiteViews) and list(copies) == list(self.layout.slices):
            flat = copies.flat  # the solver's flat copies, in the layout's order: no concatenation
        else:
            flat = self.layout.flatten(copies, batch_dims=1)
        return self.losses(self.layout.unflatten(self.coupling.inverse(flat)), rows, vectorize)

    def select(self, i: int) -> CoupledLosses:
        """The ``i``-th block's objective alone."""
        return CoupledLosses(self.losses.select(i), self.coupling, self.layout)
