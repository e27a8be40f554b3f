"""The guide's Fisher information in the global params: the geometry of ``eta="auto"``.

For a mean-field Gaussian guide the Hessian of the negative ELBO at its optimum is the guide's
Fisher information in its own params: ``1 / sigma^2`` in a location, ``2`` in a log-scale. So
the Fisher diagonal ``F_j`` says how stiff the objective is in every coordinate, without
measuring curvature, and it follows the scales as they shrink (the curvature of ``f`` in a
log-scale at the start, ``2 P sigma^2`` for data precision ``P``, can be orders of magnitude
above its value at the optimum, which left scales stuck at their initial values with a step
size measured at the start). The block objectives share that stiffness, about ``F_j / n``
each, which :class:`~pyro_pdvi.infer.step_sizes.StepSizes` turns into per-coordinate step
sizes: a natural-gradient preconditioner [2], the geometry in which Bayesian ADMM [3] works.

:func:`fisher_diagonal` estimates ``F_jj = E_q[(d log q(z) / d lambda_j)^2]`` by Monte Carlo
from the guide alone (no model): the guide run on a block, its latent values held fixed, the
score of its log density in each global param. A global param of a network that encodes
per-datum latents gets the block's share scaled to all data, as the data plate scales it.

[2] Amari (1998), "Natural gradient works efficiently in learning", Neural Comput. 10(2).
[3] Möllenhoff, Swaroop, Doshi-Velez, Khan (2025), "Federated ADMM from Bayesian Duality",
    arXiv:2506.13150.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pyro import poutine

from .handlers import BlockSubsample, FixedNoise, ParamOverride, is_subsample_site
from .sites import DataPlate, GlobalLayout


def fisher_diagonal(
    guide: Callable,
    plate: DataPlate,
    layout: GlobalLayout,
    point: torch.Tensor,
    blocks: list[torch.Tensor],
    args: tuple,
    kwargs: dict,
    num_samples: int,
    seed: int,
) -> torch.Tensor:
    """Monte Carlo estimate of the diagonal of the guide's Fisher information at ``point``.

    :param guide: the Pyro guide.
    :param plate: the data plate.
    :param layout: the layout of the global params.
    :param point: ``lambda_0``, the flat global vector (unconstrained).
    :param blocks: the blocks' indices to run the guide on (the estimate averages them).
    :param args: positional arguments of the guide.
    :param kwargs: keyword arguments of the guide.
    :param num_samples: draws of the latents per block.
    :param seed: seed of the draws (torch's generator is restored after).
    :returns: ``(P,)``, zero where no latent's density depends on the coordinate (a Delta
        guide, an unused param).
    """
    constraints_ = {s.name: s.constraint for s in layout.sites}
    total = torch.zeros_like(point)
    with FixedNoise(seed, point.device)():
        for indices in blocks:
            for _ in range(num_samples):
                leaf = point.detach().requires_grad_()
                guided = ParamOverride(layout.unflatten(leaf), constraints_)(guide)
                trace = poutine.trace(BlockSubsample(plate.name, indices)(guided)).get_trace(*args, **kwargs)
                log_q = sum(
                    (site["fn"].log_prob(site["value"].detach()) * site["scale"]).sum()
                    for site in trace.nodes.values()
                    if site["type"] == "sample" and not site["is_observed"] and not is_subsample_site(site)
                )
                if not isinstance(log_q, torch.Tensor) or not log_q.requires_grad:
                    continue
                (score,) = torch.autograd.grad(log_q, leaf, allow_unused=True)
                if score is not None:
                    total += score.square()
    return total / (num_samples * len(blocks))
