"""Dual and consensus state of PD-VI: the duals ``mu_b``, the block copies
``lambda_b`` and the consensus ``lambda_0`` [1, Alg. 1], on one flat vector.

With ``H = diag(step_sizes)`` (``D = H^{-1}`` in the augmented Lagrangian):

* dual step, for each block ``b`` of the step: ``mu_b += D (lambda_b - lambda_0)``;
* ``h = H * mean_b(mu_b)``, kept exactly through the running dual mean
  (the paper's ``h += (1/n) sum_{b in S} (lambda_b - lambda_0)`` is the same
  update when ``H`` is fixed);
* global step, one of three rules that share the same fixed point (every copy
  equal to ``lambda_0`` and ``mean(mu) = 0``, i.e. ``sum_b grad f_b = 0``):

  - ``"paper"``: ``lambda_0 = gamma + h`` with ``gamma`` the mean of this
    step's block copies, as in the paper;
  - ``"consensus"``: ``lambda_0 = mean_b(lambda_b) + h`` over every
    block's latest copy, the exact minimiser of the augmented Lagrangian in
    ``lambda_0`` [1, Sec. 3.3] (in the first epoch, over the blocks visited so far: a block
    not yet visited still holds the start, which no data informed). With one block per step
    the paper's rule hands that block's Monte Carlo noise to ``lambda_0`` in full; averaging
    all copies divides it by about ``sqrt(n)``, but moves ``lambda_0`` only ``1/n`` of a
    block's change per step (measured in docs/benchmarks.md);
  - ``"weighted"``: per coordinate ``j``, ``lambda_0j = w_j gamma_j + (1 - w_j)
    mean_b(lambda_bj) + h_j``, by how much the step's blocks inform coordinate ``j``
    (``c_bj``, the diagonal curvature of ``f_b``, measured once per block:
    :meth:`ConsensusState.set_information`). Where they hold at least
    :data:`INFORMED_FRACTION` of an average block's information, ``w_j = 1``: the paper's rule,
    which follows the data block by block. Where they barely inform it, ``w_j`` is their
    share ``sum_{b in S} c_bj / sum_b c_bj``, so their copy (which their solve hardly moved,
    and which the paper's rule would hand over with a stale dual at every step: the runaway of
    ``docs/benchmarks.md`` 13d) counts for little, and the coordinate is averaged over the
    blocks, as under the consensus rule. A coordinate no block is measured to inform takes the
    consensus rule. A coordinate whose information at most :data:`CONCENTRATED_BLOCKS` blocks
    hold (effective number ``(sum_b c_bj)^2 / sum_b c_bj^2``, over every block once all are
    measured, less those that most blocks inform where their owners are measured again at one
    point: a group's random effect, which only its group's block informs) always takes the
    paper's rule: averaging the copies there pulls it back to where it was before its own
    block's last move (``docs/benchmarks.md`` 13j).

  :class:`~pyro_pdvi.PDVI` may switch the rule between steps (its
  ``global_update="auto"``); the state is the same for all.

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .sites import GlobalLayout

GLOBAL_UPDATES = ("consensus", "paper", "weighted")

#: The weighted rule hands a block's copy to ``lambda_0`` in a coordinate (the paper's rule) where
#: the block holds at least this fraction of an average block's information about it
#: (``docs/benchmarks.md`` 13e: 0.2 against 0.5 gave the scale regression 30x closer means, and
#: PPCA, the logistic regression and the random-effects model smaller errors).
INFORMED_FRACTION = 0.2

#: The weighted rule follows the step's copy (the paper's rule) in a coordinate that at most this
#: many blocks inform, by the effective number ``(sum_b c_bj)^2 / sum_b c_bj^2`` (13j).
CONCENTRATED_BLOCKS = 2.0


#: Before every block is measured, a coordinate counts as one that a single block informs (a
#: group's random effect with one block per group) where one of the blocks seen holds more than
#: this share of its information over them: 0.996-1.0 for the group effects of the tests' and the
#: suite's random-effects models, 0.79 for a coefficient whose covariate sorts the blocks (the
#: tests' regression sorted by its first covariate). Such sites keep the rule's constant in the
#: first epoch (:meth:`~pyro_pdvi.infer.upkeep.StepSizeUpkeep._scale_round_sites_early`) and their
#: scales their start in what PDVI reports then
#: (:meth:`~pyro_pdvi.infer.scales.ScaleFixedPoint.early_scales_at`).
EARLY_CONCENTRATED_SHARE = 0.9

#: A concentrated coordinate that, its owners measured again at one point, at least this fraction
#: of the blocks inform is released (:meth:`ConsensusState.release_shared`).
SHARED_BLOCKS_FRACTION = 0.5


def _effective_blocks(information: torch.Tensor) -> torch.Tensor:
    """How many blocks inform each coordinate, ``(sum_b c_bj)^2 / sum_b c_bj^2``, shape ``(P,)``."""
    total = information.sum(0)
    return total.square() / information.square().sum(0).clamp(min=torch.finfo(total.dtype).tiny)


class ConsensusUpdate(NamedTuple):
    """A computed, not yet applied, update of :class:`ConsensusState`."""

    block_ids: torch.Tensor
    copies: torch.Tensor
    duals: torch.Tensor
    dual_mean: torch.Tensor
    copy_mean: torch.Tensor
    visited_sum: torch.Tensor
    num_visited: torch.Tensor
    consensus: torch.Tensor


class ConsensusState:
    """Per-block duals and copies of the global params, and their consensus.

    :param consensus: initial ``lambda_0``, a flat vector of size P.
    :param num_blocks: n, the number of blocks.
    :param step_sizes: per-coordinate step sizes ``eta`` (size P), the diagonal of H.
    :param global_update: ``"consensus"``, ``"paper"`` or ``"weighted"`` (see the module docstring).
    """

    def __init__(
        self,
        consensus: torch.Tensor,
        num_blocks: int,
        step_sizes: torch.Tensor,
        global_update: str = "consensus",
    ) -> None:
        if global_update not in GLOBAL_UPDATES:
            raise ValueError(f"global_update must be one of {GLOBAL_UPDATES}, got {global_update!r}")
        self.global_update = global_update
        self.num_blocks = num_blocks
        self.consensus = consensus.detach().clone()
        self.step_sizes = step_sizes.detach().clone()
        self.duals = consensus.new_zeros(num_blocks, consensus.numel())
        self.copies = self.consensus.expand(num_blocks, -1).clone()
        self.dual_mean = torch.zeros_like(self.consensus)
        self.copy_mean = self.consensus.clone()
        #: ``c_bj``, each block's diagonal curvature, ``(n, P)``: the weights of ``"weighted"``
        #: (zero until measured).
        self.information = torch.zeros_like(self.duals)
        self.information_total = torch.zeros_like(self.consensus)
        #: Where at most :data:`CONCENTRATED_BLOCKS` blocks inform a coordinate (once every block
        #: is measured).
        self.concentrated = torch.zeros_like(self.consensus, dtype=torch.bool)
        self.num_measured = torch.zeros((), dtype=torch.long, device=consensus.device)
        #: Which blocks have had a step, the sum of their copies and their number: the mean of
        #: the consensus and weighted rules leaves out the copies of blocks not yet visited (the
        #: start, which no data has informed); once every block was visited it is every block's.
        self.visited = torch.zeros(num_blocks, dtype=torch.bool, device=consensus.device)
        self.visited_sum = torch.zeros_like(self.consensus)
        self.num_visited = self.consensus.new_zeros(())

    def set_information(self, block_ids: torch.Tensor, curvature: torch.Tensor) -> None:
        """Record ``c_bj``, the diagonal curvature of ``f_b`` in every coordinate, of some blocks.

        :param block_ids: the blocks, shape ``(m,)``.
        :param curvature: their diagonal curvatures, non-negative, shape ``(m, P)``.
        """
        self.information[block_ids.to(self.duals.device)] = curvature.to(self.information)
        self._count_informing_blocks()

    def set_coordinate_information(self, coordinates: torch.Tensor, curvature: torch.Tensor) -> None:
        """Replace every block's ``c_bj`` at some coordinates, after a change of coordinates that
        changed them (:mod:`~pyro_pdvi.infer.whitening`); which coordinates are concentrated is
        kept (they were found, and acted on, once).

        :param coordinates: the coordinates, ``(k,)``.
        :param curvature: every block's diagonal curvature there, non-negative, ``(n, k)``.
        """
        concentrated = self.concentrated.clone()
        self.information[:, coordinates.to(self.duals.device)] = curvature.to(self.information)
        self._count_informing_blocks()
        self.concentrated = concentrated

    def _count_informing_blocks(self) -> None:
        """The totals ``sum_b c_bj``, the blocks measured, and the concentrated coordinates."""
        # Kept, not summed at every step: (n, P) can be large.
        self.information_total = self.information.sum(0)
        self.num_measured = (self.information.sum(1) > 0).sum()
        total = self.information_total
        self.concentrated = (
            (total > 0)
            & (_effective_blocks(self.information) <= CONCENTRATED_BLOCKS)
            & (self.num_measured == self.num_blocks)
        )

    def release_shared(
        self, diagonal: Callable[[int, torch.Tensor], torch.Tensor], candidates: torch.Tensor
    ) -> torch.Tensor:
        """Measure again, at one point, the information of each concentrated coordinate's owner
        (the block that informs it most), again for a coordinate whose owner changed, until every
        such owner is measured there; a coordinate that at least :data:`SHARED_BLOCKS_FRACTION`
        of the blocks inform there (effective number) is no longer concentrated, and takes those
        values.

        Why: each block is measured after its first solve, at the ``lambda_0`` of that moment,
        which moves most in the first epoch. A block measured at a far point (the first, after a
        step that only its data informed) can look like the one block that informs a coordinate
        that every block informs. Measured with ``AutoLowRankMultivariateNormal`` on a linear
        regression of four i.i.d. blocks (float64, two seeds of three): the first block's
        information about a ``cov_factor`` coordinate was 74x and 14x its value at the common
        point, about a ``scale`` one 22x and 13x; measured again, 2.6-3.5 of the 4 blocks inform
        them. Only so clear a case is released: on the suite's random-effects model (30 blocks,
        one per group) 11 and 22 group effects of two seeds of four had 2.0-5.1 informing
        blocks at the common point, and releasing them left the means' rms error (four seeds) 1.5x
        and 1.7x larger after 20 CPU s in two pinned pairs (``docs/benchmarks.md`` 13t).

        :param diagonal: ``(b, J) -> c_bJ``, block ``b``'s diagonal curvature at the coordinates
            ``J`` (``(k,)``), at one ``lambda_0`` for every block. A value that is not finite
            keeps the first measurement.
        :param candidates: the coordinates that may be released, a boolean mask ``(P,)`` (those
            the solves move).
        :returns: the coordinates released, a boolean mask ``(P,)``.
        """
        candidates = candidates.to(self.concentrated.device) & self.concentrated
        confirmed = self.information.clone()
        measured_again = torch.zeros_like(confirmed, dtype=torch.bool)
        while True:
            owner = confirmed.argmax(0)
            flagged = candidates & (_effective_blocks(confirmed) <= CONCENTRATED_BLOCKS)
            pending = flagged & ~measured_again.gather(0, owner[None])[0]
            if not bool(pending.any()):
                break
            for b in owner[pending].unique().tolist():
                mine = (pending & (owner == b)).nonzero().reshape(-1)
                values = diagonal(b, mine).to(confirmed).abs()
                confirmed[b, mine] = torch.where(torch.isfinite(values), values, confirmed[b, mine])
                measured_again[b, mine] = True
        shared = max(CONCENTRATED_BLOCKS, SHARED_BLOCKS_FRACTION * self.num_blocks)
        released = candidates & (_effective_blocks(confirmed) > shared)
        self.information[:, released] = confirmed[:, released]
        self._count_informing_blocks()
        return released

    def estimate(self) -> torch.Tensor:
        """``x_j = sum_b c_bj lambda_bj / sum_b c_bj + h_j``: the measured blocks' copies weighted
        by their information, plus ``h``; ``lambda_0`` where no block is measured to inform ``j``.

        Each copy ``lambda_b`` solves its block's augmented Lagrangian, so ``grad f_b(lambda_b) =
        -mu_b``; the minimiser of the blocks' quadratic models ``f_b(lambda_b) - mu_b (x -
        lambda_b) + 1/2 c_b (x - lambda_b)^2`` is ``sum_b c_b lambda_b / C + sum_b mu_b / C``
        (``C = sum_b c_b``), and the second term is ``h`` where ``eta = n / C`` (the natural rule's
        step size). At the fixed point every copy is ``lambda_0`` and ``mean(mu) = 0``: ``x =
        lambda_0``. Off it, ``x`` averages the blocks that ``lambda_0``'s global update follows
        one step at a time, so it carries less of the last block's pull (``docs/benchmarks.md``
        13t). ``O(nP)``.
        """
        total = self.information_total
        weighted = (self.information * self.copies).sum(0) / total.clamp(min=torch.finfo(total.dtype).tiny)
        return torch.where(total > 0, weighted + self.h, self.consensus)

    def owners(self, coordinates: torch.Tensor) -> torch.Tensor:
        """Which blocks inform some of ``coordinates`` (a boolean mask) most, ``(n,)``, on the CPU."""
        owners = torch.zeros(self.num_blocks, dtype=torch.bool)
        owners[self.information.argmax(0)[coordinates].cpu()] = True
        return owners

    def information_share(
        self, step_information: torch.Tensor, num_step_blocks: torch.Tensor
    ) -> torch.Tensor:
        """``w_j`` of the weighted rule (module docstring): 1 where the step's blocks hold at least
        :data:`INFORMED_FRACTION` of an average measured block's information about coordinate
        ``j`` (each), and wherever at most :data:`CONCENTRATED_BLOCKS` blocks inform it; else their
        share ``sum_{b in S} c_bj / sum_b c_bj`` (0 where no block is measured to inform it).

        :param step_information: ``sum_{b in S} c_bj``, shape ``(P,)``.
        :param num_step_blocks: ``|S|``.
        """
        total = self.information_total
        share = torch.where(total > 0, step_information / total, 0.0).clamp(0.0, 1.0)
        informed = (share * self.num_measured >= INFORMED_FRACTION * num_step_blocks) | self.concentrated
        return torch.where(informed, 1.0, share)

    @property
    def h(self) -> torch.Tensor:
        """``h = H * mean_b(mu_b)``, the dual correction of the consensus."""
        return self.step_sizes * self.dual_mean

    def propose(
        self,
        block_ids: torch.Tensor,
        copies: torch.Tensor,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> ConsensusUpdate:
        """Compute the dual and global update for new block copies, without applying it.

        :param block_ids: the distinct blocks of this step, shape (m,).
        :param copies: their new copies ``lambda_b``, shape (m, P).
        :param all_reduce: for a step whose blocks are spread over processes: sums a
            tensor over them (each process passes its own blocks). The global update
            needs only sums over the step's blocks: of the dual and copy changes (for
            ``mean(mu)`` and ``mean(lambda_b)``), of the copies (for ``gamma``) and of their
            information (for ``w``).
        """
        block_ids = block_ids.to(self.duals.device)
        size = self.consensus.numel()
        duals = self.duals[block_ids] + (copies - self.consensus) / self.step_sizes
        visited = self.visited[block_ids].to(copies.dtype)[:, None]
        sums = torch.cat(
            [
                (duals - self.duals[block_ids]).sum(0),
                (copies - self.copies[block_ids]).sum(0),
                copies.sum(0),
                self.information[block_ids].sum(0),
                (copies - visited * self.copies[block_ids]).sum(0),
                (1 - visited).sum().reshape(1),
                copies.new_full((1,), len(block_ids)),
            ]
        )
        if all_reduce is not None:
            sums = all_reduce(sums)
        dual_mean = self.dual_mean + sums[:size] / self.num_blocks
        copy_mean = self.copy_mean + sums[size : 2 * size] / self.num_blocks
        step_mean = sums[2 * size : 3 * size] / sums[-1]
        visited_sum = self.visited_sum + sums[4 * size : 5 * size]
        num_visited = self.num_visited + sums[5 * size]
        visited_mean = visited_sum / num_visited
        if self.global_update == "paper":
            base = step_mean
        elif self.global_update == "consensus":
            base = visited_mean
        else:
            share = self.information_share(sums[3 * size : 4 * size], sums[-1])
            base = share * step_mean + (1 - share) * visited_mean
        consensus = base + self.step_sizes * dual_mean
        return ConsensusUpdate(
            block_ids, copies, duals, dual_mean, copy_mean, visited_sum, num_visited, consensus
        )

    def apply(self, update: ConsensusUpdate) -> None:
        """Apply a proposal from :meth:`propose`."""
        self.duals[update.block_ids] = update.duals
        self.copies[update.block_ids] = update.copies
        self.dual_mean = update.dual_mean
        self.copy_mean = update.copy_mean
        self.visited[update.block_ids] = True
        self.visited_sum = update.visited_sum
        self.num_visited = update.num_visited
        self.consensus = update.consensus

    def translate(self, move: torch.Tensor, dual_shift: torch.Tensor | None = None) -> None:
        """Move ``lambda_0``, every copy and the copies' means by ``move`` (flat, size P), and
        the duals by ``dual_shift`` (``(n, P)``, zero mean over the blocks, so that their mean and
        ``h`` are kept; ``None``: the duals kept): the saddle escape's jump
        (:mod:`~pyro_pdvi.infer.saddle_escape`)."""
        move = move.to(self.consensus)
        self.consensus = self.consensus + move
        self.copies = self.copies + move
        self.copy_mean = self.copy_mean + move
        self.visited_sum = self.visited_sum + move * self.num_visited
        if dual_shift is not None:
            self.duals = self.duals + dual_shift.to(self.duals)

    def set_step_sizes(self, step_sizes: torch.Tensor) -> None:
        """Change H. The duals are kept, so ``lambda_0`` moves with ``h = H * mean(mu)``."""
        old_h = self.h
        self.step_sizes = step_sizes.detach().clone().to(self.consensus)
        self.consensus = self.consensus - old_h + self.h

    def change_coordinates(
        self,
        forward: Callable[[torch.Tensor], torch.Tensor],
        dual_forward: Callable[[torch.Tensor], torch.Tensor],
        step_sizes: torch.Tensor,
    ) -> None:
        """Carry the state into new coordinates ``lambda~ = T lambda`` (linear) with new step
        sizes (:mod:`~pyro_pdvi.infer.coupling`): copies and consensus move by ``T``, duals by
        ``T^{-T}``, and ``lambda_0`` keeps its part that is not ``h``, ``T (lambda_0 - h)``, plus
        the new ``H~ T^{-T} mean(mu)``. The fixed point is the same point in the new coordinates.

        :param forward: ``x -> T x`` along the last axis.
        :param dual_forward: ``mu -> T^{-T} mu`` along the last axis.
        :param step_sizes: the step sizes in the new coordinates.
        """
        base = forward(self.consensus - self.h)
        self.copies = forward(self.copies)
        self.copy_mean = forward(self.copy_mean)
        self.visited_sum = forward(self.visited_sum)
        self.duals = dual_forward(self.duals)
        self.dual_mean = dual_forward(self.dual_mean)
        self.step_sizes = step_sizes.detach().clone().to(self.consensus)
        self.consensus = base + self.h

    def state_dict(self) -> dict[str, torch.Tensor | str]:
        return {
            "global_update": self.global_update,
            "consensus": self.consensus.clone(),
            "step_sizes": self.step_sizes.clone(),
            "duals": self.duals.clone(),
            "copies": self.copies.clone(),
            "dual_mean": self.dual_mean.clone(),
            "copy_mean": self.copy_mean.clone(),
            "information": self.information.clone(),
            "visited": self.visited.clone(),
            "visited_sum": self.visited_sum.clone(),
            "num_visited": self.num_visited.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["duals"].shape != self.duals.shape:
            raise ValueError(
                f"saved PDVI state has duals of shape {tuple(state['duals'].shape)} "
                f"(blocks x global coordinates) but this PDVI has {tuple(self.duals.shape)}"
            )
        self.global_update = state["global_update"]
        for key in ("consensus", "step_sizes", "duals", "copies", "dual_mean", "copy_mean"):
            setattr(self, key, state[key].detach().clone().to(self.duals))
        # Absent from checkpoints before the weighted rule: every block counts as visited.
        information = state.get("information", torch.zeros_like(self.duals)).to(self.duals)
        self.set_information(torch.arange(len(information)), information)
        self.visited = state.get("visited", torch.ones_like(self.visited)).clone().to(self.visited)
        self.visited_sum = state.get("visited_sum", self.copies[self.visited].sum(0)).clone().to(self.duals)
        self.num_visited = state.get("num_visited", self.visited.sum()).clone().to(self.duals)


def find_non_finite(
    block_ids: torch.Tensor,
    losses: torch.Tensor,
    rows: list[dict[str, torch.Tensor]],
    update: ConsensusUpdate,
    layout: GlobalLayout,
) -> tuple[int, str]:
    """The first block and quantity of a step that is not finite (the slow path of a refused
    step, for its error message).

    :param block_ids: the step's blocks, shape ``(m,)``.
    :param losses: their ``f_b``, shape ``(m,)``.
    :param rows: each block's new local rows, by site.
    :param update: the proposed update (copies, duals, consensus).
    :param layout: the layout of the global params, to name a site.
    :returns: the block id and a description such as ``'value of site "m"'``.
    """
    ids = block_ids.tolist()
    for i, b in enumerate(ids):
        if not torch.isfinite(losses[i]):
            return b, "loss f_b"
        for name, value in {**layout.unflatten(update.copies[i]), **rows[i]}.items():
            if not torch.isfinite(value).all():
                return b, f'value of site "{name}"'
    for b, dual in zip(ids, update.duals):
        if not torch.isfinite(dual).all():
            return b, f'dual of site "{layout.site_of(int((~torch.isfinite(dual)).nonzero()[0]))}"'
    bad = int((~torch.isfinite(update.consensus)).nonzero()[0])
    return ids[0], f'consensus of site "{layout.site_of(bad)}"'
