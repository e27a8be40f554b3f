"""Is a run converged? The full gradient norm that :meth:`~pyro_pdvi.PDVI.run` records, and
the warning it gives when the run has stalled away from the optimum.

A small consensus residual ``||lambda_b - lambda_0||`` says the blocks agree with the
consensus, not that the consensus is optimal: with a step size far too small the copies are
pinned to ``lambda_0`` and ``lambda_0`` creeps (measured on a label-sorted logistic
regression: residual 0.008 while ``||grad_lambda f||`` stayed at 16). The optimum is where
the full gradient ``sum_b grad_lambda f_b(phi_b, lambda_0)`` vanishes, the paper's Fig. 4
metric [1]. It costs about one SVI epoch to evaluate (one gradient of every block), so
:class:`ConvergenceMonitor` measures it after every epoch when that costs at most a quarter
of an epoch, else after the first, the middle and the last epoch; and once more at the end,
at fresh Monte Carlo noise, to tell a gradient from the noise of its estimate.

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632, Sec. 5.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

#: A measurement after every epoch if it costs at most this share of an epoch.
AFFORDABLE_SHARE = 0.25
#: Stalled: over the second half of the run the gradient norm fell by less than this factor.
STALL_FACTOR = 0.5
#: Converged: the gradient norm is within this many noise levels of zero.
NOISE_MULTIPLE = 3.0


class ConvergenceMonitor:
    """Records ``||grad_lambda f||`` during a run and judges the end of it.

    :param gradient: ``() -> sum_b grad_lambda f_b`` at the current state (one Monte Carlo
        draw per block).
    :param num_epochs: the run's epochs.
    :param every_epoch_allowed: ``False`` for the fixed sparse schedule (first, middle, last),
        whatever the cost, e.g. when several processes must measure together.
    """

    def __init__(
        self,
        gradient: Callable[[], torch.Tensor],
        num_epochs: int,
        every_epoch_allowed: bool = True,
    ) -> None:
        self.gradient = gradient
        self.num_epochs = num_epochs
        self.every_epoch = every_epoch_allowed
        self.norms = [math.nan] * num_epochs
        self.noise_level: float | None = None
        self._last: torch.Tensor | None = None

    def due(self, epoch: int) -> bool:
        """Whether to measure after ``epoch`` (1-based)."""
        sparse = {1, (self.num_epochs + 1) // 2, self.num_epochs}
        return self.every_epoch or epoch in sparse

    def measure(self, epoch: int, epoch_seconds: float) -> float:
        """Measure after ``epoch``; after the first, decide whether every epoch is affordable.

        :param epoch: 1-based.
        :param epoch_seconds: how long the epoch's steps took.
        :returns: the gradient norm.
        """
        start = time.perf_counter()
        self._last = self.gradient()
        self.norms[epoch - 1] = float(self._last.norm())
        if epoch == 1 and time.perf_counter() - start > AFFORDABLE_SHARE * epoch_seconds:
            self.every_epoch = False
        return self.norms[epoch - 1]

    def finish(self, epochs_run: int) -> str | None:
        """The verdict at the end of a run of ``epochs_run`` epochs.

        Measures the gradient once more at fresh noise: half the norm of the difference of two
        independent estimates is the noise level of one. A gradient norm within
        ``NOISE_MULTIPLE`` noise levels of zero is converged; one that fell by less than
        ``STALL_FACTOR`` over the second half of the run, and is above the noise, has stalled.

        :returns: ``None`` if converged or still progressing, else why it has stalled.
        """
        if self._last is None or math.isnan(self.norms[epochs_run - 1]):
            return None
        again = self.gradient()
        self.noise_level = float((again - self._last).norm()) / 2.0
        last = self.norms[epochs_run - 1]
        if last <= NOISE_MULTIPLE * self.noise_level:
            return None
        earlier = [
            (e, n)
            for e, n in enumerate(self.norms[: epochs_run - 1], 1)
            if not math.isnan(n) and e <= epochs_run / 2
        ]
        if not earlier:
            return None
        epoch, before = earlier[-1]
        if last <= STALL_FACTOR * before:
            return None
        return (
            f"the full gradient norm ||grad_lambda f|| is {last:.3g} after epoch {epochs_run}, "
            f"{last / before:.2f} times its value after epoch {epoch} ({before:.3g}), and above its "
            f"Monte Carlo noise ({self.noise_level:.2g})"
        )
