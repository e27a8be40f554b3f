"""Hessian-vector products by double backward, many directions in one batched backward pass.

``H V`` for a gradient graph (``gradient = grad f(point)`` built with ``create_graph=True``) and
``k`` directions ``V`` takes ``k`` backward passes through the gradient's graph one at a time.
torch batches them in one pass (``torch.autograd.grad(..., is_grads_batched=True)``, which runs
the backward engine under the legacy ``vmap``), but its public entry point checks the shapes of
explicit ``grad_outputs`` with ``torch.fx.experimental.symbolic_shapes``, whose first import
pulls in sympy: 0.36-0.73 CPU s once per process (measured with torch 2.13 on this project's
2-core machines), about what batching saves on the suite's random-effects model.
:func:`hessian_products` calls the same batched backward without that check, through two private
torch functions (``torch._vmap_internals._vmap`` and
``torch.autograd.graph._engine_run_backward``), and falls back to one backward pass per direction
(each with a scalar output, which imports nothing) where those functions are missing or refuse
the graph.

Why: the pass over every block at the end of the first epoch
(:meth:`~pyro_pdvi.infer.upkeep.StepSizeUpkeep._pass_over_every_block`) takes some 250 products
on the generic suite's random-effects model, 0.74 s of its 1 s one at a time
(``docs/benchmarks.md`` 13t).
"""

from __future__ import annotations

import warnings

import torch


def _batched_backward(gradient: torch.Tensor, point: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
    """``directions @ H`` by one batched backward pass (private torch functions)."""
    from torch._vmap_internals import _vmap
    from torch.autograd.graph import _engine_run_backward

    def vector_jacobian_product(direction: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _engine_run_backward(
            (gradient,), (direction,), True, False, (point,), True, accumulate_grad=False
        )

    with warnings.catch_warnings():
        # An op without a batching rule runs in a loop under vmap, with a performance warning.
        warnings.simplefilter("ignore")
        (products,) = _vmap(vector_jacobian_product, 0, 0, allow_none_pass_through=True)(directions)
    return torch.zeros_like(directions) if products is None else products


def _one_at_a_time(gradient: torch.Tensor, point: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
    """``directions @ H`` by one backward pass per direction."""
    products = []
    for direction in directions:
        # A scalar output: an explicit grad_outputs tensor makes torch import sympy.
        (product,) = torch.autograd.grad(
            (gradient * direction).sum(), point, retain_graph=True, allow_unused=True
        )
        products.append(torch.zeros_like(direction) if product is None else product)
    return torch.stack(products)


def hessian_products(gradient: torch.Tensor, point: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
    """The products ``H v_k`` of the Hessian of ``f`` at ``point`` with each direction.

    :param gradient: ``grad f(point)``, computed with ``create_graph=True``; its graph is kept.
    :param point: the leaf tensor that ``gradient`` was taken with respect to, flat ``(P,)``.
    :param directions: ``(k, P)``, one direction per row.
    :returns: ``(k, P)``, detached; zero rows where ``f`` is linear in ``point``.
    :raises RuntimeError: where the graph has no double backward (as one backward pass would).
    """
    if not len(directions):
        return torch.zeros_like(directions)
    if not gradient.requires_grad:  # f is linear in the point
        return torch.zeros_like(directions)
    if len(directions) > 1:
        try:
            return _batched_backward(gradient, point, directions).detach()
        except (ImportError, AttributeError, TypeError, RuntimeError):
            # A missing private function, a changed signature, or an op that cannot batch: the
            # loop below, which raises for a graph with no double backward at all.
            pass
    return _one_at_a_time(gradient, point, directions).detach()
