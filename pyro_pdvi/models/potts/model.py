"""The Potts mixture's sites in Pyro (:class:`PottsGMMModel`), with its exact objective as a loss.

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
"""

from __future__ import annotations

import torch
from pyro import poutine

from ..gmm import SITE_NAMES, GMMModel, GMMPrior
from .graph import SpatialGraph
from .objective import potts_block_negative_elbo, potts_negative_elbo


class PottsGMMModel(GMMModel):
    """The Potts mixture's sites in Pyro, with its exact objective as a loss callable.

    ``model`` and ``guide`` are :class:`~pyro_pdvi.models.gmm.GMMModel`'s (params ``m``,
    ``rho`` global and ``alpha`` local inside ``pyro.plate("data", N, subsample=idx)``), so
    :class:`~pyro_pdvi.PDVI` finds the global/local split by plate structure. The Potts
    prior couples all ``zeta_i`` and has no per-site Pyro form here, so the objective is
    :meth:`loss`, a callable ``loss(model, guide, idx)`` that runs the guide to read the
    param values and returns the exact :func:`~pyro_pdvi.models.potts.potts_block_negative_elbo`
    of the subsample ``idx``
    scaled by ``N/|idx|`` (so PDVI's ``|b|/N`` scaling gives ``f_b`` back, and
    :class:`pyro.infer.SVI` steps with it are unbiased for whole-patch subsamples drawn
    uniformly). Potts edges count when both ends are in ``idx``.

    :param data: ``(N, d)``.
    :param prior: the hyperparameters.
    :param graph: the symmetric graph (restricted to the PD-VI patches).
    :param kwargs: initial values, see :class:`~pyro_pdvi.models.gmm.GMMModel`.
    """

    def __init__(self, data: torch.Tensor, prior: GMMPrior, graph: SpatialGraph, **kwargs) -> None:
        super().__init__(data, prior, **kwargs)
        if graph.num_rows != data.shape[0] or graph.num_cols != data.shape[0]:
            raise ValueError(
                f"graph must be square over the N = {data.shape[0]} spots, "
                f"got {graph.num_rows} x {graph.num_cols}"
            )
        self.graph = graph.to(data.device, data.dtype)

    def loss(self, model, guide, idx: torch.Tensor | None = None) -> torch.Tensor:
        """``N/|idx| * f_idx`` at the guide's current (or PDVI-overridden) params."""
        trace = poutine.trace(guide).get_trace(idx)
        names = SITE_NAMES
        m, rho, alpha = (trace.nodes[name]["value"] for name in names)
        indices = trace.nodes["data"]["value"].to(self.data.device)
        if alpha.shape[0] != indices.numel():  # the trace holds the full param, not the plate's slice
            alpha = alpha.index_select(0, indices)
        data = self.data[indices]
        subgraph = self.graph.subgraph(indices)
        f_b = potts_block_negative_elbo(data, self.prior, subgraph, m, rho, alpha, self.num_data)
        return f_b * (self.num_data / indices.numel())

    def negative_elbo(self, m: torch.Tensor, rho: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        """The full objective :func:`~pyro_pdvi.models.potts.potts_negative_elbo` on this
        model's data and graph."""
        return potts_negative_elbo(self.data, self.prior, self.graph, m, rho, alpha)
