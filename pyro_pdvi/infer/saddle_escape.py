"""An escape from saddles of the reduced objective, for models with a latent per datum.

Where a model has local rows, PDVI's fixed point is a stationary point of the reduced objective
``G(lambda) = sum_b min_phi f_b(lambda, phi)``, and ``G`` can have saddles: PPCA's loadings
pass near saddles of their rotation, whose negative curvature the consensus iteration follows
by about the step size times that curvature an epoch, a crawl (``docs/benchmarks.md`` 13zj).
Once per check, :class:`SaddleEscape`:

1. takes the reduced Hessian on the global coordinates that the solves move (the scales held at
   their fixed point left out), summed over every block at one fixed noise each, with the
   locals eliminated per datum (:class:`~pyro_pdvi.infer.reduced_hessian.BlockSchurComplement`),
   scaled by the guide's Fisher information;
2. finds its most negative directions by :data:`LANCZOS_ITERATIONS` Lanczos steps started from
   ``lambda_0``'s displacement over the last :data:`DRIFT_EPOCHS` epochs, which points mostly
   along them (cosine 0.84 on PPCA: 13zk; 20 iterations from there found what 60 from a random
   start did);
3. along each of the :data:`MAX_DIRECTIONS` most negative in turn, tries a step of
   :data:`STEP_FRACTION` of ``lambda_0``'s norm on those coordinates, the way the drift goes,
   each trial point scored by the blocks' objectives at their fixed noise with every block's
   rows carried along ``-H_pp^-1 H_pl v`` and then solved (:data:`TRIAL_SOLVE_STEPS`
   evaluations); keeps the best point if it lowers the sum;
4. moves ``lambda_0``, every copy and every block's rows there, and each block's dual by minus
   the change of its gradient, less the mean change (:meth:`TrialScorer.dual_shift`,
   :meth:`~pyro_pdvi.infer.consensus.ConsensusState.translate`);

for at most :data:`MAX_ROUNDS` rounds, until no negative curvature is left. The first check is
after :data:`FIRST_CHECK_EPOCH` epochs (ten in was too early on PPCA: the descent of the first
epochs was not over, 13zk); a check that moved the state is followed by another after twice as
many epochs, one that found no negative curvature (or no better point) by none. A curvature
steeper than :data:`STEEPEST_SADDLE` says the descent is not over: no step is tried, and the
check comes again after twice as many epochs.

Measured inside PDVI on PPCA (digits, 40 blocks sorted by digit; seeds 0-5, ``docs/benchmarks.md``
13zl-13zm): the check cost 5-9 CPU s, and at 20 CPU s, its seconds included, the ELBO gap was
0.52x (geometric mean) that of the same runs without it, ahead on every seed; on the hierarchical
normal model it found no negative curvature and cost 3 of 166 epochs. With a fixed ``eta=0.1``,
which settles later, the first check is put off as too steep and the second, near the end of a
20 s budget, cost more than it gained by then (1.8x worse at 20 s, better per epoch).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from .reduced_hessian import BlockSchurComplement, lanczos, scaled_reduced_products
from .solvers import GenericSolver

if TYPE_CHECKING:
    from .pdvi import PDVI

#: The epoch (block visits / n) after which the first check runs.
FIRST_CHECK_EPOCH = 20
#: Lanczos starts from ``lambda_0``'s displacement over this many epochs.
DRIFT_EPOCHS = 10
#: Lanczos steps of a check.
LANCZOS_ITERATIONS = 20
#: The most rounds of a check (the third found nothing on PPCA: 13zk).
MAX_ROUNDS = 2
#: A trial step along a negative direction is this fraction of ``lambda_0``'s norm on the moved
#: coordinates (or of the guide's spread there, where larger): about 10 degrees of a rotation.
STEP_FRACTION = 0.2
#: Evaluations of a trial point's local solves (3 did what 5 and 20 did on PPCA: 13zj).
TRIAL_SOLVE_STEPS = 3
#: A Ritz value below minus this (the Fisher-scaled curvature: steeper than the guide's own
#: precision) says the run is not near a fixed point yet, where a check's scores mislead; the check
#: is put off to twice its epoch (PPCA with ``eta=0.1`` at epoch 20: -53 to -159, against -0.0004
#: to -0.012 for the saddles of its default runs, 13zm).
STEEPEST_SADDLE = 1.0
#: The most negative directions tried in a round (PPCA's checks found one or two, 13zl; a run
#: far from a fixed point can show many, 13zm).
MAX_DIRECTIONS = 2


@dataclass
class EscapeRound:
    """One round of a check.

    :param negative: the number of negative Ritz values found.
    :param smallest: the smallest Ritz value (scaled by the Fisher information).
    :param steps: the step along each direction tried (at most :data:`MAX_DIRECTIONS`), signed
        the way ``lambda_0`` drifts; 0 where the trial point was not better.
    :param objective_change: the change of the blocks' summed objective at their fixed noise.
    """

    negative: int
    smallest: float
    steps: list[float] = field(default_factory=list)
    objective_change: float = 0.0

    @property
    def moved(self) -> bool:
        """Whether the round moved the state."""
        return any(step != 0 for step in self.steps)

    @property
    def too_steep(self) -> bool:
        """Whether the round found curvature too steep for a saddle near a fixed point
        (:data:`STEEPEST_SADDLE`): no step was tried."""
        return self.smallest < -STEEPEST_SADDLE


class SaddleEscape:
    """When to check for a saddle, and ``lambda_0``'s history that starts the search.

    :attr checks: one entry per check: the epoch, its rounds (:class:`EscapeRound`) and its
        wall-clock seconds.
    :attr next_check: the epoch of the next check; ``None`` once one found nothing to do.
    """

    def __init__(self) -> None:
        self.history: list[torch.Tensor] = []
        self.next_check: int | None = FIRST_CHECK_EPOCH
        self.checks: list[dict] = []

    def end_epoch(self, epoch: int, consensus: torch.Tensor) -> bool:
        """Record ``lambda_0`` (params' coordinates) at the end of epoch ``epoch`` (1 for the
        first); whether a check is due now."""
        self.history = [*self.history[-DRIFT_EPOCHS:], consensus.detach().clone()]
        return self.next_check is not None and epoch >= self.next_check and len(self.history) > DRIFT_EPOCHS

    def drift(self) -> torch.Tensor:
        """``lambda_0``'s displacement over the last :data:`DRIFT_EPOCHS` epochs."""
        return self.history[-1] - self.history[0]

    def state_dict(self) -> dict:
        """The history and the next check (the checks' records are diagnostics, not state)."""
        return {"history": [h.cpu() for h in self.history], "next_check": self.next_check}

    def load_state_dict(self, state: dict, device: torch.device | str = "cpu") -> None:
        """Restore from :meth:`state_dict`."""
        self.history = [h.to(device) for h in state["history"]]
        self.next_check = state["next_check"]

    def failed(self, epoch: int, reason: str, seconds: float = 0.0) -> None:
        """Record a check at ``epoch`` that raised (``reason``) after ``seconds``; no other follows."""
        self.checks.append({"epoch": epoch, "rounds": [], "failed": reason, "seconds": seconds})
        self.next_check = None

    def checked(self, epoch: int, rounds: list[EscapeRound], seconds: float = 0.0) -> None:
        """Record a check at ``epoch`` that took ``seconds``; the next after twice as many epochs
        if it moved the state or found curvature too steep for a saddle, else none.
        ``lambda_0``'s history starts again from the state it left."""
        moved = any(r.moved for r in rounds)
        self.checks.append({"epoch": epoch, "rounds": rounds, "seconds": seconds})
        self.next_check = 2 * epoch if moved or rounds[-1].too_steep else None
        self.history = self.history[-1:] if not moved else []


def step_length(consensus: torch.Tensor, spread: torch.Tensor) -> float:
    """A trial step's length: :data:`STEP_FRACTION` of the larger of ``lambda_0``'s norm and the
    guide's spread (the norm of its standard deviations) on the moved coordinates."""
    return STEP_FRACTION * max(float(consensus.norm()), float(spread.norm()))


def negative_directions(
    schurs: list[BlockSchurComplement],
    coordinates: torch.Tensor,
    scale: torch.Tensor,
    start: torch.Tensor,
    seed: int,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The scaled reduced Hessian's negative directions on ``coordinates``, in the params'
    coordinates (unit norm, most negative first), and its Ritz values.

    :param scale: ``S^1/2``, the scaling of the coordinates (``F^-1/2``, ``F`` the Fisher diagonal).
    :param start: Lanczos's first vector in the params' coordinates (the drift).
    """
    apply = scaled_reduced_products(schurs, coordinates, scale)
    scale = scale.double().cpu()
    values, vectors = lanczos(
        apply, len(coordinates), LANCZOS_ITERATIONS, seed, start.double().cpu() / scale, -STEEPEST_SADDLE
    )
    directions = [scale * vectors[:, j] for j in range(int((values < 0).sum()))]
    return [d / d.norm() for d in directions], values


class TrialScorer:
    """The blocks' objectives summed at a trial ``lambda`` (flat, params' coordinates), each
    block's rows carried from its current ones along ``-H_pp^-1 H_pl (lambda - lambda_0)`` and
    solved with :data:`TRIAL_SOLVE_STEPS` evaluations, at each block's fixed noise.

    :param pdvi: the run (its state at ``lambda_0``).
    :param schurs: every block's Schur complement at ``lambda_0`` and its rows.
    :param block_args: every block's step arguments ``(args, kwargs)``.
    :param seeds: every block's noise seed (those of ``schurs``).
    :param inner_steps: evaluations of a trial point's local solves.
    :attr calls: the points scored so far.
    """

    def __init__(
        self,
        pdvi: PDVI,
        schurs: list[BlockSchurComplement],
        block_args: dict[int, tuple[tuple, dict]],
        seeds: list[int],
        inner_steps: int = TRIAL_SOLVE_STEPS,
    ) -> None:
        self.pdvi, self.schurs, self.block_args, self.seeds = pdvi, schurs, block_args, seeds
        self.point = pdvi._consensus_params.detach().clone()
        self.calls = 0
        solver = pdvi.solver
        self.solver = GenericSolver(
            inner_steps=inner_steps,
            method=solver.method,
            vectorize=solver.vectorize,
            local_cavi=solver.local_cavi,
        )

    def __call__(self, trial: torch.Tensor) -> tuple[float, list[tuple[torch.Tensor, dict]]]:
        """The summed objective at ``trial`` and every block's ``(indices, rows)`` there."""
        self.calls += 1
        pdvi = self.pdvi
        total, solved = 0.0, []
        copies = {k: v.unsqueeze(0) for k, v in pdvi.layout.unflatten(trial).items()}
        for b, schur in enumerate(self.schurs):
            args, kwargs = self.block_args[b]
            problem = pdvi._problem(torch.tensor([b]), [self.seeds[b]], args, kwargs, consensus=trial)
            moves = schur.row_moves(trial - self.point)  # (data, r)
            names = list(problem.local)
            widths = [problem.local[n][0, 0].numel() for n in names]
            carried = {
                n: problem.local[n] + part.reshape(problem.local[n].shape).to(problem.local[n])
                for n, part in zip(names, moves.split(widths, dim=1))
            }
            rows = self.solver.solve(replace(problem, local=carried)).local
            with torch.no_grad():
                total += float(problem.losses(copies, rows).sum())
            solved.append((problem.indices, rows))
        return total, solved

    def gradients(self, point: torch.Tensor, rows: list[dict] | None = None) -> torch.Tensor:
        """Every block's gradient of its objective in the globals at ``point`` (flat, params'
        coordinates) with its ``rows`` (``None``: its current ones), at its fixed noise, ``(n, P)``."""
        pdvi, gradients = self.pdvi, []
        for b in range(len(self.schurs)):
            args, kwargs = self.block_args[b]
            problem = pdvi._problem(torch.tensor([b]), [self.seeds[b]], args, kwargs, consensus=point)
            copies = {
                name: value.unsqueeze(0).detach().requires_grad_(True)
                for name, value in pdvi.layout.unflatten(point).items()
            }
            loss = problem.losses(copies, problem.local if rows is None else rows[b]).sum()
            parts = dict(zip(copies, torch.autograd.grad(loss, list(copies.values()))))
            gradients.append(pdvi.layout.flatten(parts, batch_dims=1)[0])
        return torch.stack(gradients)

    def dual_shift(
        self, best: torch.Tensor, solved: list[tuple[torch.Tensor, dict]], coordinates: torch.Tensor
    ) -> torch.Tensor:
        """How the duals follow a jump from :attr:`point` to ``best`` (its rows ``solved``), ``(n, P)``.

        At the iteration's fixed point each block's dual is minus its gradient at ``lambda_0``, up
        to a shift common to all blocks; the jump changes each block's gradient by
        ``g_b(best) - g_b(point)`` (same noise at both), and the duals follow by minus that, less
        its mean over the blocks (which keeps ``lambda_0`` where the jump put it), on the moved
        ``coordinates``. Kept duals instead made the epoch after an escape worse before it was
        better (PPCA, 13zl-13zm)."""
        before = self.gradients(self.point)
        after = self.gradients(best, [rows for _, rows in solved])
        shift = before - after
        shift = shift - shift.mean(0, keepdim=True)
        moved = torch.zeros(shift.shape[-1], dtype=torch.bool, device=shift.device)
        moved[coordinates.to(shift.device)] = True
        return shift * moved


def run_check(
    pdvi: PDVI, escape: SaddleEscape, block_args: dict[int, tuple[tuple, dict]], seed: int
) -> list[EscapeRound]:
    """One check (module docstring): at most :data:`MAX_ROUNDS` rounds of the reduced Hessian's
    negative directions and a step along each, the state moved after each round that found a
    better point.

    :param pdvi: the run; its solves' coordinates are the params' (no coupling or whitening).
    :param escape: the trigger, whose history gives the drift.
    :param block_args: every block's step arguments.
    :param seed: the check's noise seeds derive from it (not from the run's generator).
    :returns: the rounds.
    """
    coordinates = moved_coordinates(pdvi)
    scale = coordinate_scale(pdvi)[coordinates]
    start = escape.drift()[coordinates]
    rounds: list[EscapeRound] = []
    num_blocks = len(pdvi.partition)
    for round_ in range(MAX_ROUNDS):
        seeds = [(seed + 7919 * round_ + b) % 2**62 for b in range(num_blocks)]
        schurs = [pdvi._block_schur(b, seeds[b], *block_args[b]) for b in range(num_blocks)]
        directions, values = negative_directions(schurs, coordinates, scale, start, seed + round_)
        record = EscapeRound(negative=len(directions), smallest=float(values[0]))
        rounds.append(record)
        if not directions or record.too_steep:
            break
        score = TrialScorer(pdvi, schurs, block_args, seeds)
        point = score.point
        best_value, solved = score(point)
        first_value, best = best_value, point
        length = step_length(point[coordinates], scale)
        drift = start.double().cpu() / scale
        for direction in directions[:MAX_DIRECTIONS]:
            # The run drifts away from the saddle: the step goes the drift's way along the
            # direction (the better sign on PPCA every time both were tried, 13zm).
            sign = -1.0 if float((direction / scale) @ drift) < 0 else 1.0
            embedded = torch.zeros_like(point)
            embedded[coordinates.to(point.device)] = direction.to(point)
            trial = best + sign * length * embedded
            value, trial_rows = score(trial)
            better = value < best_value  # a non-finite value is never better
            if better:
                best_value, best, solved = value, trial, trial_rows
            record.steps.append(sign * length if better else 0.0)
        record.objective_change = best_value - first_value
        if best is point:
            break
        pdvi._translate(best - point, solved, score.dual_shift(best, solved, coordinates))
    return rounds


def coordinate_scale(pdvi: PDVI) -> torch.Tensor:
    """``S^1/2`` of the Lanczos operator, per global coordinate (float64, on the CPU): ``F^-1/2``,
    the guide's standard deviation where its Fisher information ``F`` is known (the natural
    rule), else the square root of the step size (13zj: a little worse on PPCA)."""
    fisher = pdvi._step_sizes.fisher
    if fisher is not None and bool((fisher > 0).all()):
        return fisher.double().cpu().rsqrt()
    return pdvi._state.step_sizes.double().cpu().sqrt()


def moved_coordinates(pdvi: PDVI) -> torch.Tensor:
    """The global coordinates that the solves move: all but the scales held at their fixed point."""
    moved = torch.ones(pdvi.layout.size, dtype=torch.bool)
    for site, held in pdvi._held_coordinates().items():
        moved[pdvi.layout.slices[site]] &= ~held.reshape(-1).cpu()
    return torch.arange(pdvi.layout.size)[moved]
