"""The epochs of :meth:`PDVI.run <pyro_pdvi.PDVI.run>`: one step per block in a shuffled or
cyclic order, a progress bar, the per-epoch losses and the convergence check of
:mod:`~pyro_pdvi.infer.convergence`, in the spirit of NumPyro's ``SVI.run``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
from tqdm.auto import tqdm

from ..checks import check_choice, check_positive_int
from ..errors import warn_user
from .convergence import ConvergenceMonitor

if TYPE_CHECKING:
    from .pdvi import PDVI

ORDERS = ("shuffle", "cyclic")


class RunResult(NamedTuple):
    """What :meth:`PDVI.run` returns.

    :param losses: per epoch, the mean of its steps' losses (each an estimate of the full
        loss, as :meth:`PDVI.step` returns it), shape ``(num_epochs,)``.
    :param gradient_norms: per epoch, ``||grad_lambda f||`` over all blocks after it (NaN where
        not measured; see :mod:`~pyro_pdvi.infer.convergence`).
    :param noise_level: the Monte Carlo noise of one gradient-norm estimate at the end
        (``None`` if not measured).
    """

    losses: torch.Tensor
    gradient_norms: torch.Tensor
    noise_level: float | None


def run_epochs(
    pdvi: PDVI,
    num_epochs: int,
    args: tuple,
    kwargs: dict,
    order: str,
    progress_bar: bool,
    callback: Callable[[int, float], bool | None] | None,
    subsample_arg: str | None,
    check_convergence: bool,
) -> RunResult:
    """The body of :meth:`PDVI.run <pyro_pdvi.PDVI.run>` (see there for the arguments)."""
    check_positive_int(num_epochs, "num_epochs")
    check_choice(order, ORDERS, "order")
    first = pdvi._epoch_blocks()[0]
    if pdvi._state is None:
        pdvi._setup(args, pdvi._with_block(kwargs, first, subsample_arg), torch.tensor([first]))
    monitor = ConvergenceMonitor(
        lambda: pdvi._all_reduce(pdvi._gradient_sum(pdvi._epoch_blocks(), args, kwargs, subsample_arg)),
        num_epochs,
        every_epoch_allowed=not pdvi._shares_steps,
    )
    losses, residuals = [], []
    bar = tqdm(range(1, num_epochs + 1), desc="PDVI", unit="epoch", disable=not progress_bar)
    for epoch in bar:
        blocks = pdvi._epoch_blocks()
        if order == "shuffle":
            blocks = [blocks[i] for i in torch.randperm(len(blocks), generator=pdvi._rng).tolist()]
        total, residual, start = 0.0, 0.0, time.perf_counter()
        for b in blocks:
            total += pdvi._step(torch.tensor([b]), args, pdvi._with_block(kwargs, b, subsample_arg))
            residual = residual + pdvi.diagnostics["consensus_residual"].mean()  # read once an epoch
        losses.append(total / len(blocks))
        residuals.append(float(residual) / len(blocks))
        shown = {"loss": f"{losses[-1]:.4g}"}
        if check_convergence and monitor.due(epoch):
            shown["grad"] = f"{monitor.measure(epoch, time.perf_counter() - start):.3g}"
        bar.set_postfix(shown)
        if callback is not None and callback(epoch, losses[-1]) is True:
            break
    stalled = monitor.finish(len(losses)) if check_convergence else None
    if stalled is not None:
        warn_user(
            f"PDVI.run has not converged: {stalled}. The mean consensus residual ||lambda_b - "
            f"lambda_0|| was {residuals[-1]:.2g} in the last epoch: if that is small, the blocks are "
            f"pinned to a consensus that creeps, and the step sizes {pdvi.step_sizes} are too small "
            f"for this model: try a larger eta (or eta=AutoStepSize(scale=...) above the "
            f"{pdvi.auto_step_size.scale:g} in use). Else run more epochs.",
        )
    return RunResult(
        torch.tensor(losses),
        torch.tensor(monitor.norms[: len(losses)]),
        monitor.noise_level,
    )
