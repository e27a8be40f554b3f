"""Every read and write of PDVI's params in Pyro's param store, in one place.

The param store holds what the rest of Pyro sees (``pyro.param``, ``Predictive``,
``get_state``): PDVI writes the consensus ``lambda_0`` into the global params and each
solved block's rows into the local params after every accepted step, and reads a block's
current rows as the warm start of its next solve. Values are unconstrained tensors.
"""

from __future__ import annotations

import pyro
import torch

from .sites import GlobalLayout, LocalSite


class ParamStoreView:
    """PDVI's global and local params in the param store.

    :param layout: the flat layout of the global params.
    :param local_sites: the local param sites.
    """

    def __init__(self, layout: GlobalLayout, local_sites: list[LocalSite]) -> None:
        self.layout = layout
        self.local_sites = local_sites

    @staticmethod
    def _unconstrained() -> dict[str, torch.Tensor]:
        return dict(pyro.get_param_store().named_parameters())

    def consensus(self) -> torch.Tensor:
        """The global params as one flat vector (detached)."""
        params = self._unconstrained()
        return self.layout.flatten({s.name: params[s.name].detach() for s in self.layout.sites})

    def rows(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        """The current rows of the blocks with data ``indices`` (``(m, s)``) of every local
        site, shaped ``(m, *rows_shape)`` (see :mod:`~pyro_pdvi.infer.problem`; detached)."""
        params = self._unconstrained()
        flat = indices.reshape(-1)
        return {
            s.name: params[s.name]
            .detach()
            .index_select(s.axis, flat.to(params[s.name].device))
            .unflatten(s.axis, indices.shape)
            .movedim(s.axis - 1, 0)
            for s in self.local_sites
        }

    def write_consensus(self, consensus: torch.Tensor) -> None:
        """Write ``lambda_0``, the flat global vector, into the global params."""
        params = self._unconstrained()
        with torch.no_grad():
            for name, value in self.layout.unflatten(consensus).items():
                params[name].copy_(value)

    def write_rows(self, indices: torch.Tensor, rows: dict[str, torch.Tensor]) -> None:
        """Write the new rows of the blocks with data ``indices`` (``(m, s)``) into the local
        params; ``rows`` as :meth:`rows` returns them, ``(m, *rows_shape)``."""
        params = self._unconstrained()
        flat = indices.reshape(-1)
        with torch.no_grad():
            for site in self.local_sites:
                stacked = rows[site.name].movedim(0, site.axis - 1).flatten(site.axis - 1, site.axis)
                params[site.name].index_copy_(site.axis, flat.to(params[site.name].device), stacked)
