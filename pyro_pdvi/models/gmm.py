"""Bayesian Gaussian mixture with known diagonal noise: the synthetic model of [1, App. C.2]
(the model of [1, App. C.1] without its Potts term), with everything exact that can be.

Model, with ``K`` components in ``d`` dimensions and equal weights::

    c_k ~ N(xi, diag(sigma1_sq))              k = 1..K      (global)
    z_i ~ Categorical(1/K, ..., 1/K)          i = 1..N      (local)
    x_i | z_i, c ~ N(c_{z_i}, diag(sigma0_sq))

Mean-field family, in the unconstrained coordinates of [1, App. C.1]::

    q(c_kj) = N(m_kj, exp(rho_kj))            rho = log-variance
    q(z_i)  = Categorical(phi_i),  phi_i = softmax(alpha_i)

This module gives

* :class:`GMMPrior`, :func:`make_biased_gmm` (non-i.i.d. blocks as in [1, App. C.2]),
  :func:`kmeans` and :func:`prior_from_data` (the hyperparameters of [1, App. C.1]);
* :func:`negative_elbo` and :func:`block_negative_elbo`, the closed-form objective and
  its block share ``f_b`` [1, App. A.1];
* :func:`cavi`, full-batch coordinate ascent [2], the optimum every method is measured by;
* :class:`GMMBlockSolver`, the coordinate-descent solve of one block's augmented
  Lagrangian [1, App. C.1], a :data:`~pyro_pdvi.infer.primal.LocalSolver` for
  :class:`~pyro_pdvi.PDVI`;
* :class:`GMMModel`, the same model and guide in Pyro;
* :func:`wasserstein_gmm` [3] and :func:`adjusted_rand_index` [4], the metrics of [1, Sec. 5].

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
[2] Blei, Kucukelbir, McAuliffe (2017), "Variational Inference: A Review for
    Statisticians", JASA 112(518), Sec. 2.4 and 3.
[3] Delon, Desolneux (2020), "A Wasserstein-type distance in the space of Gaussian
    mixture models", SIAM J. Imaging Sci. 13(2).
[4] Hubert, Arabie (1985), "Comparing partitions", J. Classification 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from pyro.ops.indexing import Vindex

from ..checks import check_positive_int
from ..infer.primal import BlockBatch, BlockBatchSolution, BlockProblem, BlockSolution

LOG_2PI = math.log(2.0 * math.pi)

#: Param names of :class:`GMMModel`'s guide, which :class:`GMMBlockSolver` expects by default.
SITE_NAMES = ("m", "rho", "alpha")


# --------------------------------------------------------------------------- hyperparameters


@dataclass(frozen=True)
class GMMPrior:
    """Hyperparameters of the mixture.

    :param xi: prior mean of every component centre, shape ``(d,)``.
    :param sigma0_sq: known observation variance per coordinate, shape ``(d,)``
        (``Sigma_0 = diag(sigma0_sq)``).
    :param sigma1_sq: prior variance of the centres per coordinate, shape ``(d,)``
        (``Sigma_1 = diag(sigma1_sq)``).
    :param num_components: K.
    :raises ValueError: on shapes that disagree, non-positive variances or ``K < 1``.
    """

    xi: torch.Tensor
    sigma0_sq: torch.Tensor
    sigma1_sq: torch.Tensor
    num_components: int

    def __post_init__(self) -> None:
        if isinstance(self.num_components, bool) or not isinstance(self.num_components, int):
            raise ValueError(f"Invalid num_components: {self.num_components!r}; use a positive int")
        if self.num_components < 1:
            raise ValueError(f"Invalid num_components: {self.num_components}; use a positive int")
        if self.xi.dim() != 1:
            raise ValueError(f"xi must be a 1-D tensor of length d, got shape {tuple(self.xi.shape)}")
        for name in ("sigma0_sq", "sigma1_sq"):
            value = getattr(self, name)
            if value.shape != self.xi.shape:
                raise ValueError(
                    f"{name} must have the shape of xi {tuple(self.xi.shape)}, got {tuple(value.shape)}"
                )
            if not bool((value > 0).all()):
                raise ValueError(f"{name} must be positive everywhere, got {value.tolist()}")

    @property
    def dim(self) -> int:
        """d, the data dimension."""
        return self.xi.shape[0]

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> GMMPrior:
        """The same prior with tensors of ``dtype`` on ``device``."""
        return GMMPrior(
            self.xi.to(device=device, dtype=dtype),
            self.sigma0_sq.to(device=device, dtype=dtype),
            self.sigma1_sq.to(device=device, dtype=dtype),
            self.num_components,
        )


class BiasedGMMData(NamedTuple):
    """What :func:`make_biased_gmm` returns.

    :param data: ``x``, shape ``(N, d)``.
    :param labels: the true component of each datum, shape ``(N,)``.
    :param centers: the true centres ``c_k``, shape ``(K, d)``.
    :param blocks: 1-D LongTensors (sorted) that partition ``range(N)``.
    :param prior: the hyperparameters the data were drawn with.
    """

    data: torch.Tensor
    labels: torch.Tensor
    centers: torch.Tensor
    blocks: list[torch.Tensor]
    prior: GMMPrior


def make_biased_gmm(
    num_data: int,
    num_components: int,
    dim: int,
    block_size: int,
    purity: float,
    seed: int = 0,
    separation: float = 1.0,
    dtype: torch.dtype = torch.float64,
) -> BiasedGMMData:
    """Synthetic mixture data in blocks that each hold mostly one cluster [1, App. C.2].

    The truth is ``xi = 0``, ``sigma0_sq = 1`` and ``sigma1_sq = separation**2`` in every
    coordinate; the centres are drawn from the prior ``N(xi, diag(sigma1_sq))``. The data
    are cut into ``ceil(N / block_size)`` blocks (the last one smaller if ``block_size``
    does not divide ``N``). Block ``b`` is dominated by cluster ``b mod K``: a number
    ``round(purity * |b|)`` of its points come from that cluster and the rest from the
    other ``K - 1`` clusters uniformly, so the measured purity is ``purity`` up to
    rounding (with ``K = 1`` every block is pure). The clusters are therefore equally
    frequent up to rounding (exactly when the number of blocks is a multiple of K and
    every block has the same size) instead of multinomially; given its label each ``x_i``
    is drawn exactly from the model. Indices are assigned to blocks by a random
    permutation, so blocks are not contiguous ranges.

    :param num_data: N.
    :param num_components: K.
    :param dim: d.
    :param block_size: size of every block but possibly the last.
    :param purity: fraction of each block from its dominant cluster, in ``[0, 1]``;
        1.0 gives pure blocks.
    :param seed: seed of a private :class:`torch.Generator`; the global RNG is untouched.
    :param separation: prior standard deviation of the centres in units of the
        observation standard deviation.
    :param dtype: floating dtype of the data.
    :returns: data, labels, centres, blocks and the true prior.
    :rtype: BiasedGMMData
    """
    for name, value in (
        ("num_data", num_data),
        ("num_components", num_components),
        ("dim", dim),
        ("block_size", block_size),
    ):
        check_positive_int(value, name)
    if not 0.0 <= purity <= 1.0:
        raise ValueError(f"Invalid purity: {purity}; use a fraction in [0, 1]")
    if not separation > 0:
        raise ValueError(f"Invalid separation: {separation}; use a positive float")
    generator = torch.Generator().manual_seed(seed)
    prior = GMMPrior(
        xi=torch.zeros(dim, dtype=dtype),
        sigma0_sq=torch.ones(dim, dtype=dtype),
        sigma1_sq=torch.full((dim,), float(separation) ** 2, dtype=dtype),
        num_components=num_components,
    )
    centers = prior.xi + prior.sigma1_sq.sqrt() * torch.randn(
        num_components, dim, generator=generator, dtype=dtype
    )

    order = torch.randperm(num_data, generator=generator)
    labels = torch.empty(num_data, dtype=torch.long)
    blocks = []
    for b, start in enumerate(range(0, num_data, block_size)):
        members = order[start : start + block_size]
        size = len(members)
        dominant = b % num_components
        block_labels = torch.full((size,), dominant, dtype=torch.long)
        num_dominant = round(purity * size)
        if num_components > 1 and num_dominant < size:
            offsets = torch.randint(1, num_components, (size - num_dominant,), generator=generator)
            block_labels[num_dominant:] = (dominant + offsets) % num_components
        labels[members] = block_labels[torch.randperm(size, generator=generator)]
        blocks.append(members.sort().values)
    noise = torch.randn(num_data, dim, generator=generator, dtype=dtype)
    data = centers[labels] + prior.sigma0_sq.sqrt() * noise
    return BiasedGMMData(data, labels, centers, blocks, prior)


def kmeans(
    data: torch.Tensor, num_components: int, num_iterations: int = 100, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means with k-means++ seeding (a private generator; deterministic).

    :param data: ``(N, d)``.
    :param num_components: K (at most N).
    :param num_iterations: maximum Lloyd iterations; stops early when labels settle.
    :param seed: seed of the k-means++ draws.
    :returns: centres ``(K, d)`` and labels ``(N,)``; an emptied cluster keeps its centre.
    """
    num_data = data.shape[0]
    if not 1 <= num_components <= num_data:
        raise ValueError(f"Invalid num_components: {num_components}; use 1 <= K <= N = {num_data}")
    generator = torch.Generator().manual_seed(seed)
    first = int(torch.randint(num_data, (), generator=generator))
    centers = [data[first]]
    closest = (data - data[first]).square().sum(-1)
    for _ in range(1, num_components):
        weights = closest.cpu().double()
        if weights.sum() <= 0:  # all remaining points coincide with a centre
            weights = torch.ones_like(weights)
        pick = int(torch.multinomial(weights, 1, generator=generator))
        centers.append(data[pick])
        closest = torch.minimum(closest, (data - data[pick]).square().sum(-1))
    centers = torch.stack(centers)
    labels = torch.cdist(data, centers).argmin(-1)
    for _ in range(num_iterations):
        one_hot = torch.nn.functional.one_hot(labels, num_components).to(data.dtype)
        counts = one_hot.sum(0)
        sums = one_hot.T @ data
        filled = counts > 0
        centers = torch.where(filled[:, None], sums / counts.clamp_min(1)[:, None], centers)
        new_labels = torch.cdist(data, centers).argmin(-1)
        if torch.equal(new_labels, labels):
            break
        labels = new_labels
    return centers, labels


def prior_from_data(
    data: torch.Tensor, num_components: int, labels: torch.Tensor | None = None, seed: int = 0
) -> GMMPrior:
    """Empirical hyperparameters as in [1, App. C.1, "Bayesian model settings"].

    ``xi`` is the data mean; with cluster labels (from :func:`kmeans` when not given),
    ``sigma0_sq`` is the pooled within-cluster variance per coordinate,
    ``sum_k sum_{i in k} (x_ij - xbar_kj)^2 / N``, and ``sigma1_sq`` the (population)
    variance of the cluster means per coordinate. Both are floored at ``1e-12`` times
    the data variance so that the prior stays proper (e.g. for ``K = 1``).

    :param data: ``(N, d)``.
    :param num_components: K.
    :param labels: cluster labels ``(N,)`` in ``range(K)``; k-means when ``None``.
    :param seed: seed of :func:`kmeans`.
    :rtype: GMMPrior
    """
    if labels is None:
        _, labels = kmeans(data, num_components, seed=seed)
    one_hot = torch.nn.functional.one_hot(labels.long(), num_components).to(data.dtype)
    counts = one_hot.sum(0)
    means = (one_hot.T @ data) / counts.clamp_min(1)[:, None]
    residual = data - means[labels.long()]
    means = means[counts > 0]  # an empty cluster has no mean
    floor = 1e-12 * data.var(0, unbiased=False).clamp_min(torch.finfo(data.dtype).tiny)
    return GMMPrior(
        xi=data.mean(0),
        sigma0_sq=residual.square().mean(0).maximum(floor),
        sigma1_sq=means.var(0, unbiased=False).maximum(floor),
        num_components=num_components,
    )


# --------------------------------------------------------------------------- the exact ELBO


def expected_log_likelihood(
    data: torch.Tensor, prior: GMMPrior, m: torch.Tensor, rho: torch.Tensor
) -> torch.Tensor:
    """``E_q[log N(x_i | c_k, Sigma_0)]`` for every datum and component, shape ``(N, K)``::

        -1/2 sum_j [ log(2 pi sigma0_j^2) + ((x_ij - m_kj)^2 + exp(rho_kj)) / sigma0_j^2 ]

    Computed about ``xi`` by expanding the square, so memory is ``O(N (K + d))``.

    :param data: ``(N, d)``.
    :param prior: the hyperparameters.
    :param m: ``(K, d)``.
    :param rho: ``(K, d)``.
    :rtype: torch.Tensor
    """
    precision = prior.sigma0_sq.reciprocal()
    centred_data = data - prior.xi
    centred_means = m - prior.xi
    quadratic = (
        (centred_data.square() * precision).sum(-1, keepdim=True)
        - 2.0 * centred_data @ (centred_means * precision).T
        + ((centred_means.square() + rho.exp()) * precision).sum(-1)
    )
    return -0.5 * (quadratic + (LOG_2PI + prior.sigma0_sq.log()).sum())


def local_negative_elbo(
    data: torch.Tensor, prior: GMMPrior, m: torch.Tensor, rho: torch.Tensor, alpha: torch.Tensor
) -> torch.Tensor:
    """Per-datum local terms ``E_q[log q(z_i) - log p(z_i) - log p(x_i | z_i, c)]``, shape ``(N,)``.

    The ``log p(z_i) = log(1/K)`` term is included, so these add up with
    :func:`global_negative_elbo` to Pyro's ELBO exactly, constants included.
    """
    log_phi = torch.log_softmax(alpha, -1)
    inner = log_phi + math.log(prior.num_components) - expected_log_likelihood(data, prior, m, rho)
    return (log_phi.exp() * inner).sum(-1)


def global_negative_elbo(prior: GMMPrior, m: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """``E_q[log q(c) - log p(c)] = KL(q(c) || p(c))``, terms (B) + (E) of [1, App. C.1]::

    1/2 sum_kj [ log sigma1_j^2 - rho_kj + ((m_kj - xi_j)^2 + exp(rho_kj)) / sigma1_j^2 - 1 ]
    """
    ratio = ((m - prior.xi).square() + rho.exp()) / prior.sigma1_sq
    return 0.5 * (prior.sigma1_sq.log() - rho + ratio - 1.0).sum()


def negative_elbo(
    data: torch.Tensor, prior: GMMPrior, m: torch.Tensor, rho: torch.Tensor, alpha: torch.Tensor
) -> torch.Tensor:
    """The exact mean-field negative ELBO, [1, App. C.1] without the Potts term (C) and
    with the mixture-weight term ``-sum_ik phi_ik log(1/K) = N log K``, so that it equals
    the expectation of Pyro's ELBO loss for :class:`GMMModel` (constants included).

    :param data: ``x``, ``(N, d)``.
    :param prior: the hyperparameters.
    :param m: variational means of the centres, ``(K, d)``.
    :param rho: variational log-variances of the centres, ``(K, d)``.
    :param alpha: logits of ``q(z_i)``, ``(N, K)``.
    :returns: a scalar tensor, differentiable in ``m, rho, alpha``.
    """
    return local_negative_elbo(data, prior, m, rho, alpha).sum() + global_negative_elbo(prior, m, rho)


def block_negative_elbo(
    data_block: torch.Tensor,
    prior: GMMPrior,
    m: torch.Tensor,
    rho: torch.Tensor,
    alpha_block: torch.Tensor,
    num_data: int,
) -> torch.Tensor:
    """Block share ``f_b = sum_{i in b} (local terms) + |b|/N * KL(q(c) || p(c))``
    [1, App. A.1], so that the ``f_b`` of a partition add up to :func:`negative_elbo`.

    :param data_block: the block's data, ``(|b|, d)``.
    :param prior: the hyperparameters.
    :param m: ``(K, d)``.
    :param rho: ``(K, d)``.
    :param alpha_block: the block's logits, ``(|b|, K)``.
    :param num_data: N.
    :rtype: torch.Tensor
    """
    weight = data_block.shape[0] / num_data
    local = local_negative_elbo(data_block, prior, m, rho, alpha_block).sum()
    return local + weight * global_negative_elbo(prior, m, rho)


# --------------------------------------------------------------------------- CAVI


def _component_update(
    data: torch.Tensor, prior: GMMPrior, phi: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact minimiser of the negative ELBO over ``q(c)`` given ``phi``: the conjugate
    Gaussian posterior ``precision = N_k / sigma0^2 + 1 / sigma1^2``,
    ``m = xi + sum_i phi_ik (x_i - xi) / sigma0^2 / precision``, ``rho = -log precision``."""
    counts = phi.sum(0)[:, None]
    precision = counts / prior.sigma0_sq + prior.sigma1_sq.reciprocal()
    m = prior.xi + (phi.T @ (data - prior.xi)) / prior.sigma0_sq / precision
    return m, -precision.log()


class CAVIResult(NamedTuple):
    """What :func:`cavi` returns.

    :param m: means at the fixed point, ``(K, d)``.
    :param rho: log-variances, ``(K, d)``.
    :param alpha: logits (normalised: ``alpha = log phi``), ``(N, K)``.
    :param losses: the negative ELBO after every sweep, ``(num_sweeps,)``.
    :param converged: whether the change fell below ``tol`` before ``num_iterations``.
    """

    m: torch.Tensor
    rho: torch.Tensor
    alpha: torch.Tensor
    losses: torch.Tensor
    converged: bool


@torch.no_grad()
def cavi(
    data: torch.Tensor,
    prior: GMMPrior,
    m: torch.Tensor | None = None,
    rho: torch.Tensor | None = None,
    alpha: torch.Tensor | None = None,
    num_iterations: int = 1000,
    tol: float = 1e-10,
    seed: int = 0,
) -> CAVIResult:
    """Full-batch coordinate ascent VI [2, Sec. 2.4 and 3] for the mixture.

    One sweep sets ``phi_i = softmax_k E_q[log p(x_i | c_k)]`` (the mixture weights are
    equal, so they cancel), then ``q(c_k)`` to its conjugate Gaussian form given ``phi``
    (:func:`_component_update`). Each half-step is an exact minimisation, so the negative
    ELBO never increases. It stops when the largest change of ``m`` and ``rho`` in a sweep
    is below ``tol``; then ``m, rho`` are exactly optimal given ``alpha`` and the gradient
    in ``alpha`` is of the order of that change.

    Initialisation: ``m`` if given, else ``q(c)`` from ``alpha`` if given, else k-means
    centres (:func:`kmeans` with ``seed``); ``rho`` if given, else from ``alpha`` if given,
    else ``log sigma1_sq``.

    :param data: ``(N, d)``.
    :param prior: the hyperparameters.
    :param m: initial means ``(K, d)``.
    :param rho: initial log-variances ``(K, d)``.
    :param alpha: initial logits ``(N, K)``.
    :param num_iterations: maximum number of sweeps.
    :param tol: stopping threshold on the parameter change.
    :param seed: seed of the k-means initialisation.
    :rtype: CAVIResult
    """
    num_components = prior.num_components
    if alpha is not None:
        from_alpha = _component_update(data, prior, torch.softmax(alpha, -1))
        m = from_alpha[0] if m is None else m
        rho = from_alpha[1] if rho is None else rho
    if m is None:
        m = kmeans(data, num_components, seed=seed)[0]
    if rho is None:
        rho = prior.sigma1_sq.log().expand(num_components, -1)
    m, rho = m.detach().clone(), rho.detach().clone()
    losses = []
    converged = False
    for _ in range(num_iterations):
        alpha = torch.log_softmax(expected_log_likelihood(data, prior, m, rho), -1)
        new_m, new_rho = _component_update(data, prior, alpha.exp())
        losses.append(negative_elbo(data, prior, new_m, new_rho, alpha))
        change = max(float((new_m - m).abs().max()), float((new_rho - rho).abs().max()))
        m, rho = new_m, new_rho
        if change < tol:
            converged = True
            break
    return CAVIResult(m, rho, alpha, torch.stack(losses), converged)


# --------------------------------------------------------------------------- PD-VI local solver


def augmented_component_update(
    phi: torch.Tensor,
    centred_data: torch.Tensor,
    prior: GMMPrior,
    weight: float,
    problem: BlockProblem,
    rho: torch.Tensor,
    newton_steps: int,
    site_names: tuple[str, str] = SITE_NAMES[:2],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Minimiser of a block's augmented Lagrangian over ``q(c) = N(m, exp(rho))`` given the
    block's responsibilities ``phi`` (the ``m`` and ``rho`` half of a sweep of
    :class:`GMMBlockSolver`; the Potts solver of :mod:`pyro_pdvi.spatial` shares it).

    ``m`` solves the diagonal quadratic exactly; ``rho`` takes ``newton_steps`` Newton
    steps on the strictly convex ``h(rho) = a exp(rho) - (w/2) rho + mu rho + (rho -
    rho_0)^2 / (2 eta)``, started at ``min(rho, cap)`` with the cap
    ``rho_0 - eta (mu - w/2)`` an upper bound of the root: ``h'`` is increasing and
    convex, so Newton from the right of the root decreases monotonically onto it.

    :param phi: the block's responsibilities ``(|b|, K)``.
    :param centred_data: the block's ``x - xi``, ``(|b|, d)``.
    :param prior: the hyperparameters.
    :param weight: ``w = |b| / N``.
    :param problem: the block's subproblem (consensus, dual, step sizes of the sites).
    :param rho: the current log-variances (the Newton start).
    :param newton_steps: Newton steps on ``rho``.
    :param site_names: names of the means and log-variances sites.
    :returns: the new ``(m, rho)``.
    """
    means, log_variances = site_names
    m_0, rho_0 = problem.consensus[means], problem.consensus[log_variances]
    mu_m, mu_rho = problem.dual[means], problem.dual[log_variances]
    eta_m, eta_rho = problem.step_sizes[means], problem.step_sizes[log_variances]
    counts = phi.sum(0)[:, None]
    precision = counts / prior.sigma0_sq + weight / prior.sigma1_sq + eta_m.reciprocal()
    rhs = (phi.T @ centred_data) / prior.sigma0_sq - mu_m + (m_0 - prior.xi) / eta_m
    m = prior.xi + rhs / precision

    rho_cap = rho_0 - eta_rho * (mu_rho - 0.5 * weight)
    curvature = 0.5 * (counts / prior.sigma0_sq + weight / prior.sigma1_sq)
    rho = torch.minimum(rho, rho_cap)
    for _ in range(newton_steps):
        scaled = curvature * rho.exp()
        gradient = scaled - 0.5 * weight + mu_rho + (rho - rho_0) / eta_rho
        rho = torch.minimum(rho - gradient / (scaled + eta_rho.reciprocal()), rho_cap)
    return m, rho


class GMMBlockSolver:
    """Coordinate-descent solve of one block's augmented Lagrangian [1, App. C.1]::

        L_b(alpha_b, m, rho) = f_b(alpha_b, m, rho)
                               + <mu_m, m - m_0> + <mu_rho, rho - rho_0>
                               + 1/2 ||m - m_0||^2 / eta_m + 1/2 ||rho - rho_0||^2 / eta_rho

    with ``f_b`` = :func:`block_negative_elbo`. Starting from the consensus ``(m_0, rho_0)``,
    each sweep

    1. sets ``alpha_b = log softmax E_q[log p(x_i | c_k)]``, the exact minimiser in ``alpha_b``;
    2. sets ``m`` to the exact minimiser of the (diagonal) quadratic in ``m``::

           (N_k / sigma0^2 + w / sigma1^2 + 1 / eta_m) (m - xi)
               = sum_i phi_ik (x_i - xi) / sigma0^2 - mu_m + (m_0 - xi) / eta_m

       with ``w = |b| / N`` and ``N_k = sum_{i in b} phi_ik``;
    3. takes ``newton_steps`` Newton steps on the strictly convex scalar problems in ``rho``,
       ``h(rho) = a exp(rho) - (w/2) rho + mu_rho rho + (rho - rho_0)^2 / (2 eta_rho)``,
       ``a = N_k / (2 sigma0^2) + w / (2 sigma1^2)``. As ``h'`` is increasing and convex,
       Newton converges from any start; each iterate is also capped at
       ``rho_0 - eta_rho (mu_rho - w/2)``, an upper bound of the root.

    Pass an instance as ``PDVI(..., local_solver=GMMBlockSolver(data, prior))`` with
    :class:`GMMModel`'s mean-field guide (``collapsed=False``). The solve is
    deterministic, so the paper's global update has no Monte Carlo noise to pass on
    (PDVI's default ``global_update="auto"`` takes it with a local solver); on
    cluster-sorted blocks it reached the CAVI optimum in 7 epochs where the consensus
    rule had not in 15 (``docs/benchmarks.md``, section 1b). A step over several equal-size blocks goes
    through :meth:`solve_batch`, the same sweeps vectorized over the blocks, which is
    what makes the closed-form path fast on a GPU (``docs/benchmarks.md``, section 5).

    :param data: the full data ``(N, d)``; the block's rows are taken by ``problem.indices``.
    :param prior: the hyperparameters.
    :param num_sweeps: coordinate-descent sweeps per solve (the authors use 10-15).
    :param newton_steps: Newton steps on ``rho`` per sweep.
    :param site_names: param names of the means, log-variances and logits in the guide.
    :param tol: stop early once no ``m`` or ``rho`` entry moves more than this in a sweep
        (0 never stops early).
    """

    def __init__(
        self,
        data: torch.Tensor,
        prior: GMMPrior,
        num_sweeps: int = 10,
        newton_steps: int = 5,
        site_names: tuple[str, str, str] = SITE_NAMES,
        tol: float = 0.0,
    ) -> None:
        for name, value in (("num_sweeps", num_sweeps), ("newton_steps", newton_steps)):
            check_positive_int(value, name)
        if len(site_names) != 3 or len(set(site_names)) != 3:
            raise ValueError(
                f"site_names must name the means, log-variances and logits, three distinct names; "
                f"got {site_names!r}"
            )
        if not tol >= 0:
            raise ValueError(f"Invalid tol: {tol}; use a non-negative float")
        self.data = data
        self.prior = prior
        self.num_sweeps = num_sweeps
        self.newton_steps = newton_steps
        self.site_names = tuple(site_names)
        self.tol = tol
        self._priors: dict[tuple[torch.dtype, torch.device], GMMPrior] = {}

    def _check_sites(self, problem: BlockProblem | BlockBatch) -> None:
        means, log_variances, logits = self.site_names
        for name, where in (
            (means, problem.consensus),
            (log_variances, problem.consensus),
            (logits, problem.local),
        ):
            if name not in where:
                kind = "local" if where is problem.local else "global"
                which = (
                    f"block {problem.block}'s problem"
                    if isinstance(problem, BlockProblem)
                    else f"the batch of blocks {problem.blocks.tolist()}"
                )
                raise ValueError(
                    f'GMMBlockSolver expects a {kind} param site "{name}", but {which} has global '
                    f"sites {sorted(problem.consensus)} and local sites {sorted(problem.local)}. Pass "
                    "site_names= matching the guide's param names; the logits must be created inside "
                    "the data plate with event_dim=1 (a collapsed guide without them has a different "
                    "objective, which this solver does not minimise)."
                )

    def _prior_on(self, dtype: torch.dtype, device: torch.device) -> GMMPrior:
        """The prior on ``device``, cached: a copy from host memory each solve would make
        the host wait for the device (a pageable host-to-device copy synchronises)."""
        key = (dtype, device)
        if key not in self._priors:
            self._priors[key] = self.prior.to(dtype, device)
        return self._priors[key]

    @torch.no_grad()
    def __call__(self, problem: BlockProblem) -> BlockSolution:
        """Solve block ``problem.block``'s augmented Lagrangian.

        :param problem: the block's subproblem from the PDVI engine.
        :returns: ``lambda_b = (m, rho)``, the block's new logits, and ``f_b`` there.
        :rtype: BlockSolution
        """
        self._check_sites(problem)
        means, log_variances, logits = self.site_names
        m_0 = problem.consensus[means]
        rho_0 = problem.consensus[log_variances]
        dtype, device = m_0.dtype, m_0.device
        prior = self._prior_on(dtype, device)
        data = self.data.index_select(0, problem.indices.to(self.data.device)).to(device, dtype)
        weight = data.shape[0] / problem.num_data
        centred_data = data - prior.xi
        m, rho = m_0.clone(), rho_0.clone()
        # No warm start of alpha_b is needed: each sweep begins with its exact update.
        for _ in range(self.num_sweeps):
            alpha = torch.log_softmax(expected_log_likelihood(data, prior, m, rho), -1)
            new_m, new_rho = augmented_component_update(
                alpha.exp(),
                centred_data,
                prior,
                weight,
                problem,
                rho,
                self.newton_steps,
                (means, log_variances),
            )

            # Only an early stop needs the change on the host (a sync per sweep on a GPU).
            converged = (
                self.tol > 0
                and max(float((new_m - m).abs().max()), float((new_rho - rho).abs().max())) <= self.tol
            )
            m, rho = new_m, new_rho
            if converged:
                break
        loss = block_negative_elbo(data, prior, m, rho, alpha, problem.num_data)
        return BlockSolution(globals={means: m, log_variances: rho}, local={logits: alpha}, loss=loss)

    @torch.no_grad()
    def solve_batch(self, batch: BlockBatch) -> BlockBatchSolution:
        """Solve the augmented Lagrangians of ``m`` equal-size blocks at once: the sweeps of
        :meth:`__call__`, vectorized over the blocks (no Python loop over them).

        Each sweep is two batched matrix products over the data and one softmax: the data
        are scaled once, ``x~_i = [(x_i - xi) / sigma0^2, 1]``, so that

        * ``x~_i . [m_k - xi, -1/2 sum_j ((m_kj - xi_j)^2 + exp(rho_kj)) / sigma0_j^2]`` is
          ``E_q[log p(x_i | c_k)]`` up to a term constant in ``k``, which the softmax drops;
        * ``phi^T x~`` holds ``sum_i phi_ik (x_i - xi) / sigma0^2`` and the counts ``N_k``.

        ``f_b`` is then assembled from these statistics and ``sum_i ||x_i - xi||^2 / sigma0^2``
        (taken once), exactly as :func:`block_negative_elbo` gives it. With ``tol = 0`` nothing
        is read back to the host, so on a GPU the sweeps queue without waiting; with
        ``tol > 0`` each block stops on its own (later sweeps leave it unchanged), as in the
        loop over blocks, at the cost of one host synchronisation per sweep.

        :param batch: the stacked subproblems from the PDVI engine.
        :returns: ``lambda_b = (m, rho)`` of shape ``(m, K, d)``, the new logits
            ``(m, s, K)`` and ``f_b`` of shape ``(m,)``.
        :rtype: BlockBatchSolution
        """
        self._check_sites(batch)
        means, log_variances, logits = self.site_names
        m_0 = batch.consensus[means]
        rho_0 = batch.consensus[log_variances]
        dtype, device = m_0.dtype, m_0.device
        prior = self._prior_on(dtype, device)
        num_batch, size = batch.indices.shape
        num_components, dim = m_0.shape
        weight = size / batch.num_data
        mu_m, mu_rho = batch.dual[means], batch.dual[log_variances]
        eta_m, eta_rho = batch.step_sizes[means], batch.step_sizes[log_variances]

        data = self.data.index_select(0, batch.indices.reshape(-1).to(self.data.device)).to(device, dtype)
        centred = data - prior.xi
        scaled = torch.cat([centred / prior.sigma0_sq, centred.new_ones(num_batch * size, 1)], -1)
        scaled = scaled.view(num_batch, size, dim + 1)
        squares = (centred * scaled.view(-1, dim + 1)[:, :dim]).view(num_batch, size * dim).sum(1)
        del data, centred

        precision_0, precision_1 = prior.sigma0_sq.reciprocal(), prior.sigma1_sq.reciprocal()
        m = m_0.expand(num_batch, -1, -1).clone()
        rho = rho_0.expand(num_batch, -1, -1).clone()
        rho_cap = rho_0 - eta_rho * (mu_rho - 0.5 * weight)
        # Everything that does not change between sweeps, so that a sweep is few kernels.
        prior_precision = weight * precision_1
        fixed_precision_m = prior_precision + eta_m.reciprocal()
        pull_m = (m_0 - prior.xi) / eta_m - mu_m
        inverse_eta_rho = eta_rho.reciprocal()
        fixed_gradient_rho = mu_rho - 0.5 * weight - rho_0 * inverse_eta_rho
        half_prior_precision = 0.5 * prior_precision
        minus_half_precision_0 = (-0.5 * precision_0).unsqueeze(-1)
        early_stop = self.tol > 0
        active = torch.ones(num_batch, dtype=torch.bool, device=device) if early_stop else None
        alpha = phi = statistics = None
        for sweep in range(self.num_sweeps):
            centred_means = m - prior.xi
            second_moments = torch.addcmul(rho.exp(), centred_means, centred_means)
            bias = torch.matmul(second_moments, minus_half_precision_0)  # (m, K, 1)
            weights = torch.cat([centred_means, bias], -1).transpose(1, 2)  # (m, d + 1, K)
            scores = torch.bmm(scaled, weights)
            if early_stop or sweep == self.num_sweeps - 1:
                new_alpha = torch.log_softmax(scores, -1)
                new_phi = new_alpha.exp()
            else:
                new_alpha, new_phi = None, torch.softmax(scores, -1)
            del scores
            new_statistics = torch.bmm(new_phi.transpose(1, 2), scaled)  # (m, K, d + 1)
            counts = new_statistics[..., dim:]

            data_precision = counts * precision_0
            new_m = torch.addcdiv(
                prior.xi, new_statistics[..., :dim] + pull_m, data_precision + fixed_precision_m
            )

            curvature = torch.add(half_prior_precision, data_precision, alpha=0.5)
            new_rho = torch.minimum(rho, rho_cap)
            for _ in range(self.newton_steps):
                scaled_rho = curvature * new_rho.exp()
                gradient = torch.addcmul(scaled_rho + fixed_gradient_rho, new_rho, inverse_eta_rho)
                new_rho = torch.minimum(
                    new_rho.addcdiv(gradient, scaled_rho + inverse_eta_rho, value=-1.0), rho_cap
                )

            if not early_stop:
                m, rho, alpha, phi, statistics = new_m, new_rho, new_alpha, new_phi, new_statistics
                continue
            # A block that has converged keeps its values, as the loop over blocks leaves it.
            change = torch.maximum(
                (new_m - m).abs().flatten(1).amax(1), (new_rho - rho).abs().flatten(1).amax(1)
            )
            keep = active.view(-1, 1, 1)
            m, rho = torch.where(keep, new_m, m), torch.where(keep, new_rho, rho)
            alpha = new_alpha if alpha is None else torch.where(keep, new_alpha, alpha)
            phi = new_phi if phi is None else torch.where(keep, new_phi, phi)
            statistics = (
                new_statistics if statistics is None else torch.where(keep, new_statistics, statistics)
            )
            active = active & (change > self.tol)
            if not bool(active.any()):  # the one host synchronisation of an early stop
                break

        loss = self._batch_loss(prior, m, rho, alpha, phi, statistics, squares, size, batch.num_data)
        return BlockBatchSolution(globals={means: m, log_variances: rho}, local={logits: alpha}, loss=loss)

    @staticmethod
    def _batch_loss(
        prior: GMMPrior,
        m: torch.Tensor,
        rho: torch.Tensor,
        alpha: torch.Tensor,
        phi: torch.Tensor,
        statistics: torch.Tensor,
        squares: torch.Tensor,
        size: int,
        num_data: int,
    ) -> torch.Tensor:
        """:func:`block_negative_elbo` of every block of a batch, shape ``(m,)``, from the
        sufficient statistics ``phi^T x~`` of :meth:`solve_batch` (``sum_k phi_ik = 1``)::

            sum_ik phi_ik (alpha_ik + log K) + 1/2 [ sum_i ||x_i - xi||^2 / sigma0^2
                - 2 sum_k S_k . (m_k - xi) + sum_k N_k sum_j ((m_kj - xi_j)^2 + exp(rho_kj)) / sigma0_j^2
                + |b| sum_j log(2 pi sigma0_j^2) ] + |b|/N KL(q(c) || p(c))
        """
        dim = m.shape[-1]
        centred_means = m - prior.xi
        sums, counts = statistics[..., :dim], statistics[..., dim]
        second_moments = ((centred_means.square() + rho.exp()) / prior.sigma0_sq).sum(-1)
        quadratic = (
            squares - 2.0 * (sums * centred_means).flatten(1).sum(1) + (counts * second_moments).sum(1)
        )
        log_normaliser = size * (LOG_2PI + prior.sigma0_sq.log()).sum()
        entropy = (phi * alpha).flatten(1).sum(1) + size * math.log(prior.num_components)
        ratio = (centred_means.square() + rho.exp()) / prior.sigma1_sq
        divergence = 0.5 * (prior.sigma1_sq.log() - rho + ratio - 1.0).flatten(1).sum(1)
        return entropy + 0.5 * (quadratic + log_normaliser) + (size / num_data) * divergence

    def augmented_lagrangian(
        self, problem: BlockProblem, m: torch.Tensor, rho: torch.Tensor, alpha: torch.Tensor
    ) -> torch.Tensor:
        """``L_b`` at ``(alpha_b, m, rho)``, differentiable (for checks and diagnostics)."""
        self._check_sites(problem)
        means, log_variances, _ = self.site_names
        prior = self.prior.to(m.dtype, m.device)
        data = self.data.index_select(0, problem.indices.to(self.data.device)).to(m.device, m.dtype)
        f_b = block_negative_elbo(data, prior, m, rho, alpha, problem.num_data)
        return f_b + problem.penalty({means: m, log_variances: rho})


# --------------------------------------------------------------------------- Pyro model and guide


class GMMModel:
    """The mixture as a Pyro model and mean-field guide, closing over the data.

    ``model(idx)`` and ``guide(idx)`` take the subsample ``idx`` of the data plate
    ``pyro.plate("data", N, subsample=idx)`` (``None``: all data). The guide's params are
    the global ``m`` and ``rho`` (``(K, d)``, outside the data plate) and, unless
    ``collapsed``, the local ``alpha`` (``(N, K)``, created inside the data plate with
    ``event_dim=1`` so that Pyro and :class:`~pyro_pdvi.PDVI` slice it by the subsample).

    * ``collapsed=False`` (mean-field, [1, App. C.1]): the guide enumerates ``z``, so use
      ``TraceEnum_ELBO(max_plate_nesting=1)``: its loss is then exact in ``z`` and Monte
      Carlo only in ``c``, an unbiased estimate of :func:`negative_elbo` (and of
      :func:`block_negative_elbo` times ``N/|b|`` on a block). This is the form
      :class:`GMMBlockSolver` solves.
    * ``collapsed=True``: no local params; the *model* enumerates ``z`` (use the same
      ``TraceEnum_ELBO``), so the loss estimates ``E_q[-log p(x | c)] + KL(q(c) || p(c))``,
      with ``z`` summed out exactly. This is a different, tighter objective: it is at most
      :func:`negative_elbo` for any ``alpha``, and there is no closed form for it.

    :param data: ``(N, d)``.
    :param prior: the hyperparameters.
    :param collapsed: drop ``q(z)`` and sum ``z`` out in the model.
    :param init_means: initial ``m``; default ``K`` distinct data points drawn with ``seed``.
    :param init_log_variances: initial ``rho``; default ``log(sigma0_sq K / N)``, the
        posterior variance of a centre holding ``N/K`` points.
    :param init_logits: initial ``alpha``; default the responsibilities given the initial
        ``m, rho`` (one CAVI half-step).
    :param seed: seed of the default initial means.
    """

    def __init__(
        self,
        data: torch.Tensor,
        prior: GMMPrior,
        *,
        collapsed: bool = False,
        init_means: torch.Tensor | None = None,
        init_log_variances: torch.Tensor | None = None,
        init_logits: torch.Tensor | None = None,
        seed: int = 0,
    ) -> None:
        if data.dim() != 2 or data.shape[1] != prior.dim:
            raise ValueError(f"data must have shape (N, {prior.dim}), got {tuple(data.shape)}")
        self.data = data
        self.prior = prior.to(data.dtype, data.device)
        self.collapsed = collapsed
        num_data, num_components = data.shape[0], prior.num_components
        if init_means is None:
            if num_components > num_data:
                raise ValueError(f"cannot pick K = {num_components} initial means from N = {num_data} data")
            pick = torch.randperm(num_data, generator=torch.Generator().manual_seed(seed))[:num_components]
            init_means = data[pick.to(data.device)]
        if init_log_variances is None:
            scale = num_components / num_data
            init_log_variances = (self.prior.sigma0_sq * scale).log().expand(num_components, -1)
        if init_logits is None and not collapsed:
            init_logits = torch.log_softmax(
                expected_log_likelihood(data, self.prior, init_means, init_log_variances), -1
            )
        self.init_means = init_means.detach().clone()
        self.init_log_variances = init_log_variances.detach().clone()
        self.init_logits = None if init_logits is None else init_logits.detach().clone()

    @property
    def num_data(self) -> int:
        """N."""
        return self.data.shape[0]

    def model(self, idx: torch.Tensor | None = None) -> None:
        """``c ~ N(xi, Sigma_1)``, ``z_i ~ Cat(1/K)``, ``x_i ~ N(c_{z_i}, Sigma_0)`` on subsample ``idx``."""
        prior, num_components = self.prior, self.prior.num_components
        centres = pyro.sample(
            "c", dist.Normal(prior.xi, prior.sigma1_sq.sqrt()).expand([num_components, prior.dim]).to_event(2)
        )
        weights = torch.full(
            (num_components,), 1.0 / num_components, dtype=self.data.dtype, device=self.data.device
        )
        infer = {"enumerate": "parallel"} if self.collapsed else {}
        with pyro.plate("data", self.num_data, subsample=idx) as ind:
            z = pyro.sample("z", dist.Categorical(probs=weights), infer=infer)
            # Vindex broadcasts c's particle dims against z's enumeration dims.
            loc = Vindex(centres)[..., z, :]
            pyro.sample("x", dist.Normal(loc, prior.sigma0_sq.sqrt()).to_event(1), obs=self.data[ind])

    def guide(self, idx: torch.Tensor | None = None) -> None:
        """``q(c_kj) = N(m_kj, exp(rho_kj))`` and, unless collapsed, ``q(z_i) = Cat(softmax(alpha_i))``."""
        m = pyro.param(SITE_NAMES[0], lambda: self.init_means.clone())
        rho = pyro.param(SITE_NAMES[1], lambda: self.init_log_variances.clone())
        pyro.sample("c", dist.Normal(m, (0.5 * rho).exp()).to_event(2))
        if self.collapsed:
            return
        with pyro.plate("data", self.num_data, subsample=idx):
            alpha = pyro.param(SITE_NAMES[2], lambda: self.init_logits.clone(), event_dim=1)
            pyro.sample("z", dist.Categorical(logits=alpha), infer={"enumerate": "parallel"})


# --------------------------------------------------------------------------- metrics


def _as_tensor(value: torch.Tensor | np.ndarray) -> torch.Tensor:
    return torch.as_tensor(value).detach().to("cpu", torch.float64)


def gaussian_w2_squared(
    means_a: torch.Tensor, cov_diag_a: torch.Tensor, means_b: torch.Tensor, cov_diag_b: torch.Tensor
) -> torch.Tensor:
    """Pairwise squared 2-Wasserstein distances between diagonal Gaussians::

        W2^2(N(a, diag(S)), N(b, diag(T))) = ||a - b||^2 + ||sqrt(S) - sqrt(T)||^2

    :param means_a: ``(K, d)``.
    :param cov_diag_a: ``(K, d)`` or ``(d,)`` (shared).
    :param means_b: ``(L, d)``.
    :param cov_diag_b: ``(L, d)`` or ``(d,)``.
    :returns: ``(K, L)``.
    """
    root_a = cov_diag_a.sqrt().expand_as(means_a)
    root_b = cov_diag_b.sqrt().expand_as(means_b)
    mean_part = (means_a[:, None, :] - means_b[None, :, :]).square().sum(-1)
    cov_part = (root_a[:, None, :] - root_b[None, :, :]).square().sum(-1)
    return mean_part + cov_part


def wasserstein_gmm(
    true_means: torch.Tensor | np.ndarray,
    true_cov_diag: torch.Tensor | np.ndarray,
    fitted_means: torch.Tensor | np.ndarray,
    fitted_cov_diag: torch.Tensor | np.ndarray,
) -> float:
    """Distance between two equal-weight mixtures of K diagonal Gaussians, the metric of
    [1, Fig. 3]: the mixture Wasserstein distance MW2 of [3] with weights ``1/K``::

        MW2 = sqrt( min_{permutation pi} (1/K) sum_k W2^2(N_k, N'_{pi(k)}) )

    With equal weights the optimal coupling of the components is a permutation, found by
    :func:`scipy.optimize.linear_sum_assignment`. It is an upper bound of the exact W2
    between the two mixture densities, zero iff the mixtures have the same components.

    For this model compare the true mixture ``N(c_k, Sigma_0)`` with the fitted posterior
    predictive components ``N(m_k, Sigma_0 + diag(exp(rho_k)))``, see
    :func:`predictive_components`.

    :param true_means: ``(K, d)``.
    :param true_cov_diag: ``(K, d)`` or ``(d,)``.
    :param fitted_means: ``(K, d)``.
    :param fitted_cov_diag: ``(K, d)`` or ``(d,)``.
    :rtype: float
    """
    true_means, fitted_means = _as_tensor(true_means), _as_tensor(fitted_means)
    if true_means.shape != fitted_means.shape:
        raise ValueError(
            f"both mixtures need the same number of components and dimension, got "
            f"{tuple(true_means.shape)} and {tuple(fitted_means.shape)}"
        )
    cost = gaussian_w2_squared(
        true_means, _as_tensor(true_cov_diag), fitted_means, _as_tensor(fitted_cov_diag)
    )
    # Imported here so that the model and solvers need no scipy (e.g. on a bare GPU machine).
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(cost.numpy())
    return math.sqrt(float(cost.numpy()[rows, cols].mean()))


def predictive_components(
    prior: GMMPrior, m: torch.Tensor, rho: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Means and diagonal covariances of the fitted components ``N(m_k, Sigma_0 + diag(exp(rho_k)))``,
    the predictive law of ``x`` given ``z = k`` under ``q(c_k)``.

    :returns: ``(K, d)`` means and ``(K, d)`` variances.
    """
    return m.detach(), (prior.sigma0_sq + rho.exp()).detach()


def adjusted_rand_index(
    labels_true: torch.Tensor | np.ndarray, labels_pred: torch.Tensor | np.ndarray
) -> float:
    """Adjusted Rand index [4] of two labelings of the same items (1 for identical
    partitions up to renaming, about 0 for independent ones). When both labelings put
    everything in one cluster, or each item alone, it is 1.

    :param labels_true: ``(N,)`` labels of any hashable kind numpy can sort.
    :param labels_pred: ``(N,)``.
    :rtype: float
    """
    labels_true = np.asarray(labels_true.cpu() if isinstance(labels_true, torch.Tensor) else labels_true)
    labels_pred = np.asarray(labels_pred.cpu() if isinstance(labels_pred, torch.Tensor) else labels_pred)
    if labels_true.ndim != 1 or labels_true.shape != labels_pred.shape:
        raise ValueError(
            f"labels must be two 1-D arrays of the same length, got shapes {labels_true.shape} "
            f"and {labels_pred.shape}"
        )
    _, rows = np.unique(labels_true, return_inverse=True)
    _, cols = np.unique(labels_pred, return_inverse=True)
    table = np.zeros((rows.max(initial=-1) + 1, cols.max(initial=-1) + 1), dtype=np.int64)
    np.add.at(table, (rows, cols), 1)

    def pairs(counts: np.ndarray) -> float:
        counts = counts.astype(np.float64)
        return float((counts * (counts - 1.0) / 2.0).sum())

    num_pairs = pairs(np.array([labels_true.size]))
    index = pairs(table)
    row_pairs, col_pairs = pairs(table.sum(1)), pairs(table.sum(0))
    expected = row_pairs * col_pairs / num_pairs if num_pairs > 0 else 0.0
    maximum = 0.5 * (row_pairs + col_pairs)
    if maximum == expected:
        return 1.0
    return (index - expected) / (maximum - expected)
