"""The two-line baseline a spatial-omics user would write before trying a spatial model: a
diagonal Gaussian mixture on neighbour-averaged features.

What it does in scikit-learn::

    _, neighbours = cKDTree(coords).query(coords, k=7)          # each spot and its 6 nearest
    labels = GaussianMixture(K, covariance_type="diag").fit_predict(pcs[neighbours].mean(1))

:func:`neighbour_averaged_mixture` is the same in torch (no scikit-learn needed): greedy
k-means++ and Lloyd's iterations for the start, as scikit-learn's default, then EM. The
benchmark (``benchmarks/spatial_domains.py``) reports scikit-learn's when it is installed.
"""

from __future__ import annotations

import numpy as np
import torch

from .graph import nearest_neighbours
from .init import _expectation_maximisation, _greedy_seeding, _lloyd, neighbour_average


def neighbour_averaged_mixture(
    features: torch.Tensor | np.ndarray,
    coords: torch.Tensor | np.ndarray,
    num_domains: int,
    *,
    num_neighbors: int = 6,
    num_iterations: int = 100,
    tol: float = 1e-3,
    seed: int = 0,
) -> torch.Tensor:
    """Labels of a diagonal Gaussian mixture (EM from one k-means start) on each spot's
    features averaged with those of its ``num_neighbors`` nearest spots.

    :param features: ``(N, d)``.
    :param coords: ``(N, 2)``.
    :param num_domains: K.
    :param num_neighbors: neighbours averaged with each spot.
    :param num_iterations: maximum Lloyd and EM iterations.
    :param tol: EM stops when the mean log-likelihood gains less.
    :param seed: seed of the k-means++ draws.
    :returns: ``(N,)`` labels.
    """
    features = torch.as_tensor(features, dtype=torch.float64)
    neighbours = torch.from_numpy(nearest_neighbours(coords, num_neighbors)[1])
    smoothed = neighbour_average(features, neighbours)
    generator = torch.Generator().manual_seed(seed)
    _, labels, _ = _lloyd(smoothed, _greedy_seeding(smoothed, num_domains, generator), num_iterations)
    mixture, _ = _expectation_maximisation(smoothed, labels, num_domains, num_iterations, tol)
    return mixture.log_joint(smoothed).argmax(-1)
