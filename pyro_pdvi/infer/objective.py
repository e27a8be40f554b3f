"""The block objective ``f_b``: a block's share of the negative ELBO, through the Pyro model.

``f_b(phi_b, lambda) = sum_{i in b} (local terms of datum i) + |b|/N * (global terms)``
[1, App. A.1], so that ``sum_b f_b`` is the full negative ELBO. A Pyro ELBO on block
``b``'s subsample already scales the local terms by ``N/|b|``; multiplying it by ``|b|/N``
gives ``f_b``.

:class:`BlockObjective` evaluates ``f_b`` of ``m`` equal-size blocks at given copies
``lambda_b`` and rows ``phi_b`` (stacked along a leading block axis), without touching the
param store, by one of two kernels that compute the same thing:

* the loop: one Pyro loss per block, each block with its own Monte Carlo noise;
* the vectorized kernel: one Pyro loss mapped over the blocks by :func:`torch.func.vmap`
  (inside :func:`~pyro_pdvi.infer._vmap.vmap_compatible_pyro`), each block drawing its own
  noise from the first block's seed. It saves Python overhead where a block's objective is
  cheap (small blocks) and needs a model that ``vmap`` can map (no Python branching on
  sampled values, no ``.item()``); measured in ``docs/benchmarks.md``, section 6.

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from pyro.infer import ELBO

from ..errors import VectorizationError
from ._vmap import vmap_compatible_pyro
from .graphs import GraphReplay
from .handlers import BlockSubsample, FixedNoise, ParamOverride, module_parameters, networks_of
from .sites import DataPlate, GlobalLayout, LocalSite

LossFn = Callable[..., torch.Tensor]
Values = dict[str, torch.Tensor]

#: ``randomness=`` values of :func:`torch.func.vmap` that the vectorized kernel accepts.
RANDOMNESS = ("different", "same")


def loss_function(loss: Any) -> LossFn:
    """The differentiable ``loss(model, guide, *args, **kwargs)`` of a Pyro ELBO or callable.

    :raises ValueError: for an ELBO without ``differentiable_loss`` or anything else.
    """
    if type(loss).__name__.startswith("Jit") and isinstance(loss, ELBO):
        raise ValueError(
            f"PDVI cannot use {type(loss).__name__}: it evaluates the loss at its own values of the "
            "params (each block's copy), which a torch.jit-compiled ELBO bakes in as constants. Use "
            f"{type(loss).__name__[3:]}, the same ELBO without JIT, with the same arguments."
        )
    if hasattr(loss, "differentiable_loss"):
        return loss.differentiable_loss
    if isinstance(loss, ELBO):
        raise ValueError(
            f"{type(loss).__name__} has no differentiable_loss, which PDVI needs for its primal "
            "solve; use Trace_ELBO, TraceMeanField_ELBO or TraceEnum_ELBO"
        )
    if callable(loss):
        return loss
    raise ValueError(f"loss must be a Pyro ELBO or a callable, got {type(loss).__name__}")


class BlockObjective:
    """``f_b`` of a model, guide and loss on stacked blocks (see the module docstring).

    :param model: the Pyro model.
    :param guide: the Pyro guide.
    :param loss_fn: ``loss_fn(model, guide, *args, **kwargs)`` returning a differentiable
        scalar (an ELBO's ``differentiable_loss``).
    :param plate: the data plate.
    :param layout: layout of the global params.
    :param local_sites: the local param sites.
    :param randomness: ``randomness=`` of :func:`torch.func.vmap` in the vectorized kernel:
        ``"different"`` (each block its own draw) or ``"same"`` (all blocks share one draw,
        which tests use to hold the two kernels equal).
    :param graph_replay: evaluate a block by replaying a recorded graph of its torch operations
        where that is safe (:mod:`~pyro_pdvi.infer.graphs`), not through Pyro every time.
    :param num_blocks: how many blocks the run visits again every epoch (graph replay records
        that many signatures at their first evaluation).
    """

    def __init__(
        self,
        model: Callable,
        guide: Callable,
        loss_fn: LossFn,
        plate: DataPlate,
        layout: GlobalLayout,
        local_sites: list[LocalSite],
        randomness: str = "different",
        graph_replay: bool = False,
        num_blocks: int = 0,
    ) -> None:
        if randomness not in RANDOMNESS:
            raise ValueError(f"Invalid randomness: {randomness!r}; use one of {RANDOMNESS}")
        self.randomness = randomness
        self.model = model
        self.guide = guide
        self.loss_fn = loss_fn
        self.plate = plate
        self.site_constraints = {s.name: s.constraint for s in layout.sites}
        self.site_constraints.update({s.name: s.constraint for s in local_sites})
        self.row_names = frozenset(s.name for s in local_sites)
        self.networks = networks_of(model, guide)
        self.graphs = GraphReplay(recurring=num_blocks) if graph_replay else None

    def one_off(self) -> contextlib.AbstractContextManager:
        """Evaluations inside are not recorded for replay (:meth:`GraphReplay.one_off`); nothing
        where graphs are not replayed."""
        return self.graphs.one_off() if self.graphs is not None else contextlib.nullcontext()

    def bind(self, indices: torch.Tensor, seeds: Sequence[int], args: tuple, kwargs: dict) -> BlockLosses:
        """The objective of the blocks with data ``indices`` (``(m, s)``) at the noise of
        ``seeds`` (one per block), as a function of copies and rows only."""
        return BlockLosses(self, indices, list(seeds), args, kwargs)

    def one_block(
        self, copies: Values, rows: Values, indices: torch.Tensor, args: tuple, kwargs: dict
    ) -> torch.Tensor:
        """``f_b`` of one block: ``copies`` shaped like the global sites, ``rows`` like the
        block's rows of the local sites, ``indices`` of shape ``(s,)``; by a replay of its
        recorded graph where one is trusted (``graph_replay``), else through Pyro."""
        if self.graphs is not None:
            return self.graphs.evaluate(self._through_pyro, copies, rows, indices, args, kwargs)
        return self._through_pyro(copies, rows, indices, args, kwargs)

    def _through_pyro(
        self, copies: Values, rows: Values, indices: torch.Tensor, args: tuple, kwargs: dict
    ) -> torch.Tensor:
        """``f_b`` of one block through the Pyro model, guide and loss (:meth:`one_block`)."""
        values = {**copies, **rows}

        def run_blocked(fn: Callable) -> Callable:
            # One handler instance per function: a messenger may not be entered twice.
            fn = ParamOverride(values, self.site_constraints, self.row_names)(fn)
            return BlockSubsample(self.plate.name, indices)(fn)

        with module_parameters(copies, self.networks):
            loss = self.loss_fn(run_blocked(self.model), run_blocked(self.guide), *args, **kwargs)
        return loss * (indices.shape[-1] / self.plate.size)

    def losses_and_gradients(
        self, indices: torch.Tensor, copies: Values, rows: Values, args: tuple, kwargs: dict
    ) -> tuple[torch.Tensor, Values, Values]:
        """The blocks' ``f_b`` and their gradients in copies and rows (each block's own), by
        ``vmap(grad_and_value(f_b))``: inside ``vmap`` a tensor does not report
        ``requires_grad``, which ``TraceEnum_ELBO`` checks of its loss; inside
        ``grad_and_value`` it does."""
        mapped = torch.func.vmap(
            torch.func.grad_and_value(
                lambda c, r, i: self._through_pyro(c, r, i, args, kwargs), argnums=(0, 1)
            ),
            randomness=self.randomness,
        )
        try:
            with vmap_compatible_pyro(), torch.enable_grad():
                (copy_grads, row_grads), losses = mapped(copies, rows, indices)
        except (RuntimeError, NotImplementedError) as error:
            raise VectorizationError(
                "torch.func.vmap could not evaluate the model, guide and loss over "
                f"{indices.shape[0]} stacked blocks ({type(error).__name__}: {error}). Vectorized "
                "blocks need a model and guide without data-dependent Python control flow, "
                "`.item()` or in-place writes into captured tensors; use "
                "GenericSolver(vectorize=False) for this model."
            ) from error
        return losses, copy_grads, row_grads


class _MappedLossAndGradient(torch.autograd.Function):
    """The vectorized block losses as a differentiable function of the stacked copies and
    rows, with the per-block gradients of :meth:`BlockObjective.losses_and_gradients`
    (first order: enough for L-BFGS and torch optimizers)."""

    @staticmethod
    def forward(ctx: Any, objective, indices, copy_names, row_names, args, kwargs, *tensors):
        copies = dict(zip(copy_names, (t.detach() for t in tensors)))
        rows = dict(zip(row_names, (t.detach() for t in tensors[len(copy_names) :])))
        losses, copy_grads, row_grads = objective.losses_and_gradients(indices, copies, rows, args, kwargs)
        ctx.save_for_backward(*copy_grads.values(), *row_grads.values())
        return losses

    @staticmethod
    def backward(ctx: Any, grad_losses: torch.Tensor):
        grads = tuple(
            grad_losses.reshape(grad_losses.shape + (1,) * (g.dim() - 1)) * g for g in ctx.saved_tensors
        )
        return (None,) * 6 + grads


class BlockLosses:
    """The ``f_b`` of a step's blocks as a function of their copies and rows, at the step's
    fixed Monte Carlo noise (:meth:`BlockObjective.bind`), by the loop or the vectorized kernel.

    :param objective: the block objective.
    :param indices: the blocks' data indices, ``(m, s)``.
    :param seeds: one noise seed per block.
    :param args: the positional arguments of the step.
    :param kwargs: the keyword arguments of the step.
    """

    def __init__(
        self, objective: BlockObjective, indices: torch.Tensor, seeds: list[int], args: tuple, kwargs: dict
    ) -> None:
        self.objective = objective
        self.indices = indices
        self.seeds = seeds
        self.args = args
        self.kwargs = kwargs

    def __call__(self, copies: Values, rows: Values, vectorize: bool = False) -> torch.Tensor:
        """``f_b`` of every block, shape ``(m,)``, differentiable in ``copies`` and ``rows``
        (shaped ``(m, ...)``). ``TraceEnum_ELBO`` refuses to evaluate a loss that nothing
        requires the gradient of: pass copies that require grad.

        :param vectorize: the vectorized kernel (one ``vmap``-ped loss, every block drawing
            its own noise from the first block's seed) instead of the loop (each block at
            the noise of its own seed).
        :raises VectorizationError: when ``vmap`` cannot map the model, guide or loss.
        """
        device = self.indices.device
        if vectorize:
            with FixedNoise(self.seeds[0], device)():
                return _MappedLossAndGradient.apply(
                    self.objective, self.indices, list(copies), list(rows), self.args, self.kwargs,
                    *copies.values(), *rows.values(),
                )  # fmt: skip
        losses = []
        for i, seed in enumerate(self.seeds):
            with FixedNoise(seed, device)():
                block_copies = {k: v[i] for k, v in copies.items()}
                block_rows = {k: v[i] for k, v in rows.items()}
                losses.append(
                    self.objective.one_block(
                        block_copies, block_rows, self.indices[i], self.args, self.kwargs
                    )
                )
        return torch.stack(losses)

    def select(self, i: int) -> BlockLosses:
        """The ``i``-th block's objective alone."""
        keep = slice(i, i + 1)
        return BlockLosses(self.objective, self.indices[keep], self.seeds[keep], self.args, self.kwargs)
