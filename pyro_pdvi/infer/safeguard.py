"""A safeguard for non-convex models: smaller steps when the objective rises.

On a non-convex model (PPCA, mixtures) a step size that is stable near one point can let the
iterates climb elsewhere: measured on probabilistic PCA with the pre-issue-13 defaults, the
-ELBO rose epoch after epoch for some fixed step sizes (by up to 101% of the optimum's). The
theory's step bound [1, Thm. 4.10] shrinks with the non-convexity, which nothing measures
cheaply. So :class:`RisingObjectiveGuard` watches the sum of the blocks' ``f_b`` over each epoch
(an estimate of the full objective, free: the solves return it) and, when it rose in two epochs
in a row by more than a relative :data:`RISE_TOLERANCE`, halves every step size (PDVI moves
``lambda_0`` with ``h = H mean(mu)``, as for any change of ``H``; the fixed point is kept). It
reads the host once an epoch.

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
"""

from __future__ import annotations

from typing import Any

import torch

#: A rise counts when an epoch's objective exceeds the last by this relative amount (above the
#: Monte Carlo noise of a sum of block losses at 16-64 particles on the suite's models).
RISE_TOLERANCE = 1e-3

#: Rises in a row that halve the step sizes.
RISES = 2


class RisingObjectiveGuard:
    """Sums the blocks' ``f_b`` over each epoch and says when to halve the step sizes."""

    def __init__(self) -> None:
        self.running: torch.Tensor | float = 0.0
        self.epochs: list[float] = []
        self.rises = 0
        self.damping = 1.0

    def add(self, losses: torch.Tensor) -> None:
        """The ``f_b`` of an accepted step's blocks (kept on their device until the epoch ends)."""
        self.running = self.running + losses.detach().sum()

    def end_epoch(self) -> bool:
        """Close an epoch.

        :returns: whether the step sizes should be halved now (two rises in a row).
        """
        total = float(self.running)
        self.running = 0.0
        rose = bool(self.epochs) and total > self.epochs[-1] + RISE_TOLERANCE * abs(self.epochs[-1])
        self.epochs.append(total)
        self.rises = self.rises + 1 if rose else 0
        if self.rises < RISES:
            return False
        self.rises = 0
        self.damping *= 0.5
        return True

    def state_dict(self) -> dict[str, Any]:
        running = self.running.clone() if isinstance(self.running, torch.Tensor) else self.running
        return {"running": running, "epochs": list(self.epochs), "rises": self.rises, "damping": self.damping}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.running, self.epochs = state["running"], list(state["epochs"])
        self.rises, self.damping = state["rises"], state["damping"]
