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

:func:`fisher_diagonal` gives ``F_jj = E_q[(d log q(z) / d lambda_j)^2]`` from the guide alone
(no model), the guide run on a block. A Gaussian guide site (a ``Normal``, behind ``Independent``
or a parameter-free transform such as ``LogNormal``'s) has it in closed form: ``1 / sigma^2`` in
its location and ``2 / sigma^2`` in its scale, pulled back to the params through the guide's
Jacobian ``J`` (``F = J^T diag(w) J``); its diagonal ``sum_e w_e J_ej^2`` is one
vector-Jacobian product with a Rademacher vector weighted by ``sqrt(w)``, exact where each param
coordinate moves one location or scale (the usual mean-field guide) and unbiased otherwise. The
other sites take the Monte Carlo estimate: the score of their log density at draws held fixed.
The Monte Carlo estimate of a Gaussian site's is noisy (measured on the suite's GMM: a
log-variance's ``F`` over 32 draws has a relative standard deviation of 66%), and the natural
step sizes follow ``F``: it let a mixture component empty in its fifth epoch
(``docs/benchmarks.md`` 13h). A global param of a network that encodes per-datum latents gets
the block's share scaled to all data, as the data plate scales it.

[2] Amari (1998), "Natural gradient works efficiently in learning", Neural Comput. 10(2).
[3] Möllenhoff, Swaroop, Doshi-Velez, Khan (2025), "Federated ADMM from Bayesian Duality",
    arXiv:2506.13150.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pyro.distributions import Delta

from .handlers import FixedNoise, is_subsample_site, trace_guide_at
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
    """The diagonal of the guide's Fisher information at ``point``: in closed form for its
    Gaussian sites, by Monte Carlo for the others (module docstring).

    :param guide: the Pyro guide.
    :param plate: the data plate.
    :param layout: the layout of the global params.
    :param point: ``lambda_0``, the flat global vector (unconstrained).
    :param blocks: the blocks' indices to run the guide on (the estimate averages them).
    :param args: positional arguments of the guide.
    :param kwargs: keyword arguments of the guide.
    :param num_samples: draws of the latents per block, for the sites without a closed form.
    :param seed: seed of the draws and of the Rademacher vectors (torch's generator is restored
        after).
    :returns: ``(P,)``, zero where no latent's density depends on the coordinate (a Delta
        guide, an unused param).
    """
    constraints_ = {s.name: s.constraint for s in layout.sites}
    probes = torch.Generator().manual_seed(seed % 2**63)

    def run_guide(indices: torch.Tensor) -> tuple[torch.Tensor, list[dict]]:
        leaf = point.detach().requires_grad_()
        trace = trace_guide_at(guide, layout.unflatten(leaf), constraints_, plate.name, indices, args, kwargs)
        latent = [
            site
            for site in trace.nodes.values()
            if site["type"] == "sample" and not site["is_observed"] and not is_subsample_site(site)
        ]
        return leaf, latent

    total = torch.zeros_like(point)
    with FixedNoise(seed, point.device)():
        for indices in blocks:
            leaf, latent = run_guide(indices)
            for site in latent:
                total += _gaussian_fisher(site, leaf, probes)
            if all(_has_closed_form(site["fn"]) for site in latent):
                continue
            sampled = torch.zeros_like(point)
            for _ in range(num_samples):
                leaf, latent = run_guide(indices)
                log_q = sum(
                    (site["fn"].log_prob(site["value"].detach()) * site["scale"]).sum()
                    for site in latent
                    if not _has_closed_form(site["fn"])
                )
                if not isinstance(log_q, torch.Tensor) or not log_q.requires_grad:
                    continue
                (score,) = torch.autograd.grad(log_q, leaf, allow_unused=True)
                if score is not None:
                    sampled += score.square()
            total += sampled / num_samples
    return total / len(blocks)


def gaussian_parameters(fn: torch.distributions.Distribution) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(loc, scale)`` of a Normal behind ``Independent`` and bijections without parameters
    (a ``LogNormal``), else ``None``."""
    while True:
        if isinstance(fn, torch.distributions.Independent):
            fn = fn.base_dist
        elif isinstance(fn, torch.distributions.TransformedDistribution) and all(
            t.bijective and not _has_tensor_parameters(t) for t in fn.transforms
        ):
            fn = fn.base_dist
        else:
            break
    if isinstance(fn, torch.distributions.Normal):
        return fn.loc, fn.scale
    return None


def _has_closed_form(fn: torch.distributions.Distribution) -> bool:
    """Whether a site's Fisher information needs no Monte Carlo: a Gaussian's is closed form and
    a point mass has none (an ``AutoNormal`` writes each latent's constrained value as a ``Delta``
    whose ``log_density``, the transform's Jacobian, belongs to the Gaussian site before it)."""
    while isinstance(fn, torch.distributions.Independent):
        fn = fn.base_dist
    return isinstance(fn, Delta) or gaussian_parameters(fn) is not None


def _has_tensor_parameters(transform: torch.distributions.Transform) -> bool:
    """Whether a transform holds tensors that may depend on params (an affine map's loc)."""
    parts = getattr(transform, "parts", None)
    if parts is not None:
        return any(_has_tensor_parameters(part) for part in parts)
    inner = getattr(transform, "base_transform", None)
    if inner is not None:
        return _has_tensor_parameters(inner)
    return any(isinstance(value, torch.Tensor) for value in vars(transform).values())


def _gaussian_fisher(site: dict, leaf: torch.Tensor, probes: torch.Generator) -> torch.Tensor:
    """A Gaussian site's Fisher diagonal in the params (module docstring), zero for other sites.

    :param site: a guide sample site, its scale as the data plate set it.
    :param leaf: the flat global params the site's distribution was built from.
    :param probes: the generator of the Rademacher vectors.
    """
    parameters = gaussian_parameters(site["fn"])
    if parameters is None:
        return torch.zeros_like(leaf)
    loc, scale = parameters
    sigma = scale.detach()
    projection = 0.0
    # The weights are the square roots of the Fisher information in (loc, scale).
    for tensor, weight in ((loc, 1.0 / sigma), (scale, 2.0**0.5 / sigma)):
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            signs = 2 * torch.randint(0, 2, tensor.shape, generator=probes) - 1
            projection = projection + (signs.to(tensor) * weight * tensor).sum()
    if not isinstance(projection, torch.Tensor):
        return torch.zeros_like(leaf)
    (gradient,) = torch.autograd.grad(projection * site["scale"], leaf, allow_unused=True)
    return torch.zeros_like(leaf) if gradient is None else gradient.square()
