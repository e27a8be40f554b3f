"""A safeguard for non-convex models: smaller steps when the objective rises.

On a non-convex model (PPCA, mixtures) a step size that is stable near one point can let the
iterates climb elsewhere: measured on probabilistic PCA with the pre-issue-13 defaults, the
-ELBO rose epoch after epoch for some fixed step sizes (by up to 101% of the optimum's). The
theory's step bound [1, Thm. 4.10] shrinks with the non-convexity, which nothing measures
cheaply. So :class:`RisingObjectiveGuard` watches an estimate of the full objective over each
epoch, free from the solves: the sum of the blocks' ``f_b`` taken to ``lambda_0`` to first order,
``f_b(lambda_b) + <mu_b, lambda_b - lambda_0>`` (at an exact solve ``mu_b = -grad f_b``). When
it rose in two epochs in a row by more than its noise, the guard halves every step size (PDVI
moves ``lambda_0`` with ``h = H mean(mu)``, as for any change of ``H``; the fixed point is
kept). It reads the host once an epoch.

Through the user's loss the estimate is noisy (Monte Carlo ``f_b``, one particle for a default
``Trace_ELBO``), and noise alone rises two epochs in a row one time in four: that damped
Bayesian logistic regression (the generic suite's ``logreg``) 32-64x in 55 epochs and doubled
its error at equal time. So when the ``f_b`` are Monte Carlo estimates, a rise counts only
above :data:`RISE_SDS` standard deviations of an epoch-to-epoch change, which the guard
estimates from the recent second differences of the estimate (a robust median, blind to a
steady climb, whose second differences are small): logistic regression was then damped 0-2x.
A solver's exact ``f_b`` (the GMM's, the Potts mixture's) has no such noise, and an erratic
objective there is the iterates bouncing: the relative tolerance alone applies. (The two look
alike from the estimate: on the GMM with a step size 10x too large, the noise rule saw the
bounce as noise and did not damp.)

A primal-dual method's objective estimates also rise when all is well: each block first
minimises its own ``f_b`` with its copy away from the others, and the sum climbs to the optimum
as the copies meet. So a rise counts only in an epoch whose mean consensus residual
``||lambda_b - lambda_0||`` is not a new low (below :data:`RESIDUAL_FALL` of every earlier
epoch's): copies still converging explain the rise, copies that bounce do not. Measured on a
linear-Gaussian MAP with every block solved each step (``tests/infer/solvers``): the plain sum
of ``f_b`` rose in every epoch and was damped 8x, the first-order sum alone 4x, both rules
together not at all; on a 4-block quadratic the first-order sum alone was damped 16x.

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
"""

from __future__ import annotations

from typing import Any

import torch

#: A rise counts when an epoch's objective exceeds the last by this relative amount, at least.
RISE_TOLERANCE = 1e-3

#: ...and by this many standard deviations of the epoch-to-epoch change that noise alone makes.
RISE_SDS = 2.0

#: Epochs whose second differences give that standard deviation (the most recent ones).
NOISE_WINDOW = 12

#: Rises in a row that halve the step sizes.
RISES = 2

#: A rise does not count in an epoch whose mean consensus residual fell below this fraction of
#: the lowest so far.
RESIDUAL_FALL = 0.9


class RisingObjectiveGuard:
    """Sums the blocks' ``f_b`` over each epoch and says when to halve the step sizes.

    :param monte_carlo: whether the ``f_b`` are Monte Carlo estimates (PDVI sets it at set-up:
        its generic solve through the user's loss with Monte Carlo guide sites); then rises
        within the estimate's noise do not count.
    """

    def __init__(self, monte_carlo: bool = False) -> None:
        self.running: torch.Tensor | float = 0.0
        self.running_residual: torch.Tensor | float = 0.0
        self.visits = 0
        self.epochs: list[float] = []
        self.residuals: list[float] = []
        self.rises = 0
        self.damping = 1.0
        self.monte_carlo = monte_carlo

    def add(self, losses: torch.Tensor, residuals: torch.Tensor) -> None:
        """An accepted step's blocks (kept on their device until the epoch ends).

        :param losses: their ``f_b``, shape ``(m,)``.
        :param residuals: their ``||lambda_b - lambda_0||``, shape ``(m,)``.
        """
        self.running = self.running + losses.detach().sum()
        self.running_residual = self.running_residual + residuals.detach().sum()
        self.visits += len(losses)

    def end_epoch(self) -> bool:
        """Close an epoch.

        :returns: whether the step sizes should be halved now (two rises in a row).
        """
        total, residual = float(self.running), float(self.running_residual) / max(self.visits, 1)
        self.running, self.running_residual, self.visits = 0.0, 0.0, 0
        rose = bool(self.epochs) and total - self.epochs[-1] > max(
            RISE_TOLERANCE * abs(self.epochs[-1]), RISE_SDS * self.noise_sd()
        )
        converging = bool(self.residuals) and residual < RESIDUAL_FALL * min(self.residuals)
        self.epochs.append(total)
        self.residuals.append(residual)
        self.rises = self.rises + 1 if rose and not converging else 0
        if self.rises < RISES:
            return False
        self.halve()
        return True

    def halve(self) -> float:
        """Halve the damping (after two rises in a row, or a refused step) and start counting
        rises again.

        :returns: the new damping.
        """
        self.rises = 0
        self.damping *= 0.5
        return self.damping

    def noise_sd(self) -> float:
        """The standard deviation of an epoch-to-epoch change that noise alone makes.

        For independent noise of variance ``s^2`` on each epoch's estimate a change has variance
        ``2 s^2`` and a second difference ``6 s^2``; the median of ``|second difference|`` over
        the last :data:`NOISE_WINDOW` epochs is ``0.6745 sqrt(6) s`` for Gaussian noise. Zero
        for exact ``f_b`` and with fewer than five epochs (the relative tolerance alone then).
        """
        recent = self.epochs[-NOISE_WINDOW:]
        if not self.monte_carlo or len(recent) < 5:
            return 0.0
        second = [abs(a - 2 * b + c) for a, b, c in zip(recent, recent[1:], recent[2:])]
        median = sorted(second)[len(second) // 2]
        return median / 0.6745 / 3**0.5

    def state_dict(self) -> dict[str, Any]:
        return {
            "running": _copy(self.running),
            "running_residual": _copy(self.running_residual),
            "visits": self.visits,
            "epochs": list(self.epochs),
            "residuals": list(self.residuals),
            "rises": self.rises,
            "damping": self.damping,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.running, self.running_residual = state["running"], state["running_residual"]
        self.visits = state["visits"]
        self.epochs, self.residuals = list(state["epochs"]), list(state["residuals"])
        self.rises, self.damping = state["rises"], state["damping"]


def _copy(value: torch.Tensor | float) -> torch.Tensor | float:
    return value.clone() if isinstance(value, torch.Tensor) else value
