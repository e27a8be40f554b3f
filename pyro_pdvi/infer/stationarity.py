"""Smaller steps once a coordinate only wanders: a per-coordinate stationarity test.

PD-VI converges with a constant step size when the block solves are exact [1, Thm. 4.7]. Through
a Monte Carlo loss they are not: each solve sees fresh noise, and with a constant step the
consensus ``lambda_0`` ends in a cloud around the optimum whose width grows with the step size
(measured in ``docs/benchmarks.md`` 13b: on the regression with an unknown noise scale, a 4x
smaller fixed eta gave a 4x smaller error after the same 20 CPU s). Stochastic approximation
needs decaying steps there, and the question is when to start.

Pflug's test [2] answers it from the iterates: while a coordinate is still travelling to the
optimum its successive moves point the same way, ``<Delta_t, Delta_{t-1}> > 0``; once it only
wanders in the noise, successive moves are negatively correlated. :class:`StationarityTest`
adds up ``Delta_t,j * Delta_{t-1},j`` over epochs (``Delta_t`` the change of ``lambda_0`` over
epoch ``t``) for every coordinate ``j``, and after at least :data:`MIN_EPOCHS` epochs halves the
step size of each coordinate whose sum is negative, then starts that coordinate's sum again [3]
(the same test with a scalar step size). Coordinates that are still moving keep their step size.
A change of step sizes keeps PD-VI's fixed point (``lambda_0`` moves with ``h = H mean(mu)``).

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
[2] Pflug (1990), "Non-asymptotic confidence bounds for stochastic approximation algorithms
    with constant step size", Monatshefte fur Mathematik 110.
[3] Chee, Toulis (2018), "Convergence diagnostics for stochastic gradient descent with constant
    learning rate", AISTATS.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: Epochs a coordinate's sum runs before it may halve that coordinate's step size.
MIN_EPOCHS = 10


class StationarityTest:
    """Per-coordinate Pflug test on ``lambda_0`` once an epoch (see the module docstring).

    :attr decay: the factor on each coordinate's step size, flat like ``lambda_0`` (``None``
        before the first epoch ends).
    """

    def __init__(self) -> None:
        self.previous: torch.Tensor | None = None
        self.last_move: torch.Tensor | None = None
        self.products: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        self.decay: torch.Tensor | None = None

    def end_epoch(self, consensus: torch.Tensor) -> bool:
        """Take ``lambda_0`` at the end of an epoch (one copy to the host, where the step sizes
        are kept).

        :param consensus: the flat ``lambda_0``.
        :returns: whether some coordinate's step size was halved now.
        """
        current = consensus.detach().to("cpu", torch.float64).clone()
        if self.previous is None:
            self.previous = current
            self.products = torch.zeros_like(current)
            self.counts = torch.zeros_like(current)
            self.decay = torch.ones_like(current)
            return False
        move = current - self.previous
        self.previous = current
        if self.last_move is not None:
            self.products += move * self.last_move
            self.counts += 1
        self.last_move = move
        stationary = (self.counts >= MIN_EPOCHS) & (self.products < 0)
        if not bool(stationary.any()):
            return False
        self.decay = torch.where(stationary, 0.5 * self.decay, self.decay)
        # Start those coordinates' sums again, from the first move at the new step size.
        self.products = torch.where(stationary, 0.0, self.products)
        self.counts = torch.where(stationary, 0.0, self.counts)
        self.last_move = torch.where(stationary, 0.0, self.last_move)
        return True

    def change_coordinates(self, forward: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Carry the last ``lambda_0`` and move into new coordinates ``lambda~ = T lambda``
        (:mod:`~pyro_pdvi.infer.coupling`), so that the next move is measured in one of them.

        :param forward: ``x -> T x`` along the last axis, on the host in float64.
        """
        if self.previous is not None:
            self.previous = forward(self.previous)
        if self.last_move is not None:
            self.last_move = forward(self.last_move)

    def state_dict(self) -> dict[str, Any]:
        return {key: _copy(getattr(self, key)) for key in _KEYS}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in _KEYS:
            setattr(self, key, _copy(state[key]))


_KEYS = ("previous", "last_move", "products", "counts", "decay")


def _copy(value: torch.Tensor | None) -> torch.Tensor | None:
    return None if value is None else value.clone()
