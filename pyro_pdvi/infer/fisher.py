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
guide's full-covariance Gaussian site (``AutoMultivariateNormal``, ``AutoLowRankMultivariateNormal``)
has it in closed form too, ``dmu' Sigma^-1 dmu + tr(Sigma^-1 dSigma Sigma^-1 dSigma) / 2``: a sum
of squares of outputs whitened by the Cholesky factor, whose derivatives are exact by one batched
backward pass up to :data:`EXACT_OUTPUTS` outputs (:func:`_full_covariance_fisher`). The
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

DENSE_DIMENSIONS = 1024
"""A full-covariance site of more dimensions takes the Monte Carlo estimate: its closed form
needs the dense covariance, which a low-rank guide of many dimensions never forms."""

EXACT_OUTPUTS = 1024
"""Up to this many whitened outputs a full-covariance site's Fisher diagonal is exact (one
backward pass per output, batched); beyond, :data:`PROBES` Rademacher probes estimate it."""

PROBES = 64
"""Rademacher probes of a full-covariance site with more than :data:`EXACT_OUTPUTS` outputs."""


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
                total += _full_covariance_fisher(site, leaf, probes)
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
    return isinstance(fn, Delta) or gaussian_parameters(fn) is not None or _dense_gaussian(fn) is not None


def _dense_gaussian(fn: torch.distributions.Distribution) -> torch.distributions.Distribution | None:
    """A ``MultivariateNormal`` or ``LowRankMultivariateNormal`` of at most
    :data:`DENSE_DIMENSIONS` dimensions behind ``Independent``, else ``None``."""
    while isinstance(fn, torch.distributions.Independent):
        fn = fn.base_dist
    full_covariance = (torch.distributions.MultivariateNormal, torch.distributions.LowRankMultivariateNormal)
    if isinstance(fn, full_covariance) and fn.event_shape[-1] <= DENSE_DIMENSIONS:
        return fn
    return None


def full_covariance_parameters(
    fn: torch.distributions.Distribution,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(loc, covariance, scale_tril)`` of a ``MultivariateNormal`` or
    ``LowRankMultivariateNormal`` behind ``Independent`` (the site of an
    ``AutoMultivariateNormal`` or ``AutoLowRankMultivariateNormal``) of at most
    :data:`DENSE_DIMENSIONS` dimensions, else ``None``."""
    fn = _dense_gaussian(fn)
    return None if fn is None else (fn.loc, fn.covariance_matrix, fn.scale_tril)


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


def _full_covariance_fisher(site: dict, leaf: torch.Tensor, probes: torch.Generator) -> torch.Tensor:
    """A full-covariance Gaussian site's Fisher diagonal in the params, zero for other sites.

    The Fisher information of ``N(mu, Sigma)`` is ``dmu' Sigma^-1 dmu`` in its mean and
    ``tr(Sigma^-1 dSigma Sigma^-1 dSigma) / 2`` in its covariance, with no cross term. With
    ``L`` the Cholesky factor at the point (held fixed), both are sums of squares of the
    whitened outputs ``L^-1 mu`` and ``C = L^-1 Sigma L^-T``: ``C``'s diagonal over ``sqrt(2)``
    and its strict upper triangle. So ``F_jj`` is the sum over those outputs of their squared
    derivative in param ``j``: exact from one backward pass per output, unbiased from a few
    Rademacher combinations of them (:data:`EXACT_OUTPUTS`). A diagonal ``Sigma`` gives the
    Normal's ``1 / sigma^2`` and ``2 / sigma^2``.

    :param site: a guide sample site, its scale as the data plate set it.
    :param leaf: the flat global params the site's distribution was built from.
    :param probes: the generator of the Rademacher vectors.
    """
    parameters = full_covariance_parameters(site["fn"])
    if parameters is None:
        return torch.zeros_like(leaf)
    loc, covariance, scale_tril = parameters
    cholesky = scale_tril.detach()
    outputs = []
    if loc.requires_grad:
        outputs.append(torch.linalg.solve_triangular(cholesky, loc.unsqueeze(-1), upper=False).squeeze(-1))
    if covariance.requires_grad:
        half = torch.linalg.solve_triangular(cholesky, covariance, upper=False)
        whitened = torch.linalg.solve_triangular(cholesky, half.mT, upper=False)
        rows, columns = torch.triu_indices(*whitened.shape[-2:], offset=1, device=whitened.device)
        outputs.append(whitened.diagonal(dim1=-2, dim2=-1) / 2.0**0.5)
        outputs.append(whitened[..., rows, columns])
    if not outputs:
        return torch.zeros_like(leaf)
    flat = torch.cat([output.reshape(-1) for output in outputs]) * site["scale"]
    exact = flat.numel() <= EXACT_OUTPUTS
    if exact:
        cotangents = torch.eye(flat.numel(), dtype=flat.dtype, device=flat.device)
    else:
        signs = 2 * torch.randint(0, 2, (PROBES, flat.numel()), generator=probes) - 1
        cotangents = signs.to(flat)
    (gradients,) = torch.autograd.grad(flat, leaf, cotangents, is_grads_batched=True, allow_unused=True)
    if gradients is None:
        return torch.zeros_like(leaf)
    squares = gradients.square()
    return squares.sum(0) if exact else squares.mean(0)
