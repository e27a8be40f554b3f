"""Hyperparameters of the Bayesian Gaussian mixture, and the empirical ones of [1, App. C.1]
(k-means labels; ``Sigma_0`` from the within-cluster variance, ``Sigma_1`` from the spread
of the cluster means).

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
