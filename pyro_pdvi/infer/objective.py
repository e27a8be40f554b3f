"""The block objective ``f_b``: a block's share of the negative ELBO.

``f_b(phi_b, lambda) = sum_{i in b} (local terms of datum i) + |b|/N * (global
terms)`` [1, App. A.1], so that ``sum_b f_b`` is the full negative ELBO. A
Pyro ELBO on block ``b``'s subsample already scales the local terms by
``N/|b|``; multiplying it by ``|b|/N`` gives ``f_b``.

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .handlers import BlockSubsample, ParamOverride
from .sites import DataPlate, GlobalLayout, LocalSite

LossFn = Callable[..., torch.Tensor]


class BlockObjective:
    """Evaluate ``f_b`` at given global and local values, without the param store.

    :param model: the Pyro model.
    :param guide: the Pyro guide.
    :param loss_fn: ``loss_fn(model, guide, *args, **kwargs)`` returning a
        differentiable scalar (an ELBO's ``differentiable_loss``).
    :param plate: the data plate.
    :param layout: layout of the global params.
    :param local_sites: the local param sites.
    """

    def __init__(
        self,
        model: Callable,
        guide: Callable,
        loss_fn: LossFn,
        plate: DataPlate,
        layout: GlobalLayout,
        local_sites: list[LocalSite],
    ) -> None:
        self.model = model
        self.guide = guide
        self.loss_fn = loss_fn
        self.plate = plate
        self.layout = layout
        self.local_sites = local_sites
        self.site_constraints = {s.name: s.constraint for s in layout.sites}
        self.site_constraints.update({s.name: s.constraint for s in local_sites})

    def __call__(
        self,
        indices: torch.Tensor,
        global_values: dict[str, torch.Tensor],
        local_rows: dict[str, torch.Tensor],
        local_full: dict[str, torch.Tensor],
        args: tuple,
        kwargs: dict,
    ) -> torch.Tensor:
        """``f_b`` for the block with data ``indices``.

        :param indices: the block's data indices.
        :param global_values: unconstrained global values, one tensor per site.
        :param local_rows: unconstrained rows of the block for each local site.
        :param local_full: the current full unconstrained local tensors; the
            block's rows are replaced by ``local_rows``.
        :param args: positional arguments of model and guide.
        :param kwargs: keyword arguments of model and guide.
        """
        values = dict(global_values)
        for site in self.local_sites:
            values[site.name] = (
                local_full[site.name]
                .detach()
                .index_copy(site.axis, indices.to(local_full[site.name].device), local_rows[site.name])
            )

        def run_blocked(fn: Callable) -> Callable:
            # One handler instance per function: a messenger may not be entered twice.
            fn = ParamOverride(values, self.site_constraints)(fn)
            return BlockSubsample(self.plate.name, indices)(fn)

        loss = self.loss_fn(run_blocked(self.model), run_blocked(self.guide), *args, **kwargs)
        return loss * (len(indices) / self.plate.size)
