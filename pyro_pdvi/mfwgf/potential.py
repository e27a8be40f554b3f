"""The potential ``V = -log p`` of a batch of configurations, and its gradient, in one pass.

A configuration is a flat unconstrained vector of all continuous latent sites (see
:mod:`.sites`). ``B`` configurations are evaluated by one trace of the model inside a
particle plate of size ``B`` (Pyro's ``SVGD`` plumbing): no ``vmap``, no loop over
particles, the same code on CPU and GPU. In unconstrained coordinates the potential is::

    V(u) = -log p(x, T(u)) - log |det dT/du|(u)

and enumerated discrete locals enter through their mean-field factors (:mod:`.estep`).

[1] Yao, Yang (2022), "Mean-field variational inference via Wasserstein gradient flow",
    arXiv:2207.08074.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from pyro import poutine

from .estep import sum_out_locals
from .sites import SiteLayout, vectorize


class PotentialValue(NamedTuple):
    """What :meth:`Potential.value_and_grad` returns.

    :param energy: ``V`` of every configuration, ``(B,)``.
    :param grad: ``dV/du``, ``(B, D)`` (``None`` when not asked for).
    :param local_log_probs: the mean-field factors of the enumerated locals used.
    :param local_neg_entropy: ``E_q[log q(z)]`` of those factors (0 without locals).
    """

    energy: torch.Tensor
    grad: torch.Tensor | None
    local_log_probs: dict[str, torch.Tensor]
    local_neg_entropy: torch.Tensor


class Potential:
    """``V`` of a Pyro model in the unconstrained coordinates of a :class:`SiteLayout`.

    :param model: the Pyro model (vectorisable over a plate left of its own plates, as
        Pyro's ``SVGD`` requires).
    :param layout: its latent sites.
    """

    def __init__(self, model: Callable, layout: SiteLayout) -> None:
        self.model = model
        self.layout = layout

    @property
    def particle_dim(self) -> int:
        """Dimension of the particle plate, left of the model's plates."""
        return -self.layout.max_plate_nesting - 1

    def value_and_grad(
        self,
        configurations: torch.Tensor,
        args: tuple,
        kwargs: dict,
        local_log_probs: dict[str, torch.Tensor] | None = None,
        grad: bool = True,
    ) -> PotentialValue:
        """``V`` and ``dV/du`` at ``B`` configurations, with one trace and one backward pass.

        :param configurations: ``(B, D)`` unconstrained.
        :param args: the model's positional arguments.
        :param kwargs: its keyword arguments.
        :param local_log_probs: fixed factors for the enumerated locals; default: the E-step
            on this batch [1, eq. 18].
        :param grad: whether to compute the gradient.
        """
        layout, batch = self.layout, configurations.shape[0]
        with torch.enable_grad():
            flat = configurations.detach().requires_grad_(grad)
            values, log_det = layout.particle_values(flat)
            model = vectorize(poutine.condition(self.model, data=values), batch, layout.max_plate_nesting)
            if layout.enumerated:
                model = poutine.enum(model, first_available_dim=self.particle_dim - 1)
            trace = poutine.trace(model).get_trace(*args, **kwargs)
            trace.compute_log_prob()
            summed = sum_out_locals(trace, self.particle_dim, batch, local_log_probs)
            energy = -(summed.log_joint + log_det)
            gradient = torch.autograd.grad(energy.sum(), flat)[0] if grad else None
        return PotentialValue(
            energy.detach(), gradient, summed.local_log_probs, summed.local_neg_entropy.detach()
        )

    def gradient(
        self,
        configurations: torch.Tensor,
        args: tuple,
        kwargs: dict,
        local_log_probs: dict[str, torch.Tensor] | None = None,
        chunk_size: int | None = None,
    ) -> torch.Tensor:
        """``dV/du`` at ``(B, D)`` configurations, in chunks of at most ``chunk_size``
        (to bound memory when ``B`` is large, e.g. for curvature measurements)."""
        chunk_size = chunk_size or configurations.shape[0]
        return torch.cat(
            [
                self.value_and_grad(chunk, args, kwargs, local_log_probs).grad
                for chunk in configurations.split(chunk_size)
            ]
        )
