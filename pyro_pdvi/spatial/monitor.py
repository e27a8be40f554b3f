"""What a spatial fit records after every epoch, and when it has converged.

:class:`FitMonitor` evaluates the exact objective of [1, App. C.1] (the negative ELBO on the
patch-restricted graph, up to constants) and the norm of its gradient in the global
parameters, the paper's convergence measure [1, Fig. 4], in closed form from the
sufficient statistics ``phi^T x~`` (:mod:`pyro_pdvi.models.potts.objective`): about the cost
of one sweep of the solver, against several for an autograd pass. A fit has converged when
an epoch changes the objective by at most ``tol`` times its size; an epoch that raises it is
recorded, and the fit warns about both at the end (:meth:`FitMonitor.warnings`).

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
"""

from __future__ import annotations

import torch

from ..metrics import adjusted_rand_index
from ..models.gmm import GMMPrior
from ..models.gmm.solver import scaled_data
from ..models.potts import SpatialGraph
from ..models.potts.objective import (
    global_gradient,
    negative_elbo_from_statistics,
    potts_energy,
    row_constants,
)

#: Relative rise of the objective in one epoch that counts as a rise, not rounding.
RISE_TOLERANCE = 1e-10


class FitMonitor:
    """Per-epoch objective, gradient norm and label changes of a fit, and its convergence.

    :param features: ``(N, d)`` features of the fit.
    :param prior: the hyperparameters.
    :param graph: the objective's graph (patch-restricted, with the Potts weights).
    :param tol: converged when an epoch changes the objective by at most ``tol * |objective|``.
    :param truth: true labels, to record the ARI per epoch.
    """

    def __init__(
        self,
        features: torch.Tensor,
        prior: GMMPrior,
        graph: SpatialGraph,
        tol: float,
        truth: torch.Tensor | None = None,
    ) -> None:
        self.prior = prior
        self.graph = graph
        self.tol = tol
        self.truth = truth
        self.scaled = scaled_data(features, prior)
        self.constant = row_constants(features, prior).sum()
        self.history: dict[str, list[float]] = {
            "epoch": [],
            "seconds": [],
            "objective": [],
            "grad_norm": [],
            "changed": [],
        }
        if truth is not None:
            self.history["ari"] = []
        self._labels: torch.Tensor | None = None

    @torch.no_grad()
    def record(
        self, epoch: int, seconds: float, m: torch.Tensor, rho: torch.Tensor, alpha: torch.Tensor
    ) -> dict[str, float]:
        """Append the state after ``epoch`` (0: the start) to :attr:`history` and return its row.

        :param epoch: the epoch.
        :param seconds: fitting time so far.
        :param m: ``(K, d)`` consensus means.
        :param rho: ``(K, d)`` consensus log-variances.
        :param alpha: ``(N, K)`` logits.
        """
        log_phi = alpha - alpha.amax(-1, keepdim=True)
        phi = log_phi.exp()
        total = phi.sum(-1, keepdim=True)
        phi /= total
        log_phi -= total.log()
        statistics = phi.T @ self.scaled
        energy = potts_energy(self.graph, phi)
        objective = negative_elbo_from_statistics(
            self.prior, m, rho, statistics, (phi * log_phi).sum(), energy, self.constant, 1.0
        )
        gradient_m, gradient_rho = global_gradient(self.prior, m, rho, statistics, 1.0)
        labels = phi.argmax(-1)
        changed = 0.0 if self._labels is None else float((labels != self._labels).double().mean())
        self._labels = labels
        row = {
            "epoch": epoch,
            "seconds": seconds,
            "objective": float(objective),
            "grad_norm": float(torch.cat([gradient_m.flatten(), gradient_rho.flatten()]).norm()),
            "changed": changed,
        }
        if self.truth is not None:
            row["ari"] = adjusted_rand_index(self.truth, labels)
        for key, value in row.items():
            self.history[key].append(value)
        return row

    @property
    def converged(self) -> bool:
        """Whether the last epoch changed the objective by at most ``tol`` of its size."""
        objective = self.history["objective"]
        if len(objective) < 2:
            return False
        return abs(objective[-2] - objective[-1]) <= self.tol * abs(objective[-1])

    @property
    def rises(self) -> list[int]:
        """The epochs in which the objective rose (beyond rounding)."""
        objective = self.history["objective"]
        return [
            epoch
            for epoch, before, after in zip(self.history["epoch"][1:], objective, objective[1:])
            if after - before > RISE_TOLERANCE * abs(before)
        ]

    def warnings(self, fixes: dict[str, str]) -> list[str]:
        """The fit's problems, each with its fix.

        :param fixes: ``"epochs"``: how to allow more epochs; ``"rise"``: how to make the
            objective monotone (both phrased with the caller's argument names).
        """
        messages = []
        objective = self.history["objective"]
        if self.rises:
            messages.append(
                f"the objective rose in epochs {self.rises[:10]} (by up to "
                f"{max(b - a for a, b in zip(objective, objective[1:])):.3g}); {fixes['rise']}"
            )
        if not self.converged and len(objective) >= 2:
            change = (objective[-2] - objective[-1]) / abs(objective[-1])
            messages.append(
                f"the fit stopped after {len(objective) - 1} epochs before converging: the last "
                f"epoch changed the objective by {change:.2g} of its size (tol = {self.tol:g}) and "
                f"{100 * self.history['changed'][-1]:.2g}% of the labels; {fixes['epochs']}"
            )
        return messages
