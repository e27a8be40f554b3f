"""The spatial side of the Potts prior's graph [1, App. C.1]: from spot coordinates to the
neighbour graph and the fixed patches.

* :func:`nearest_neighbours` finds each spot's k nearest with a k-d tree (``O(N log N)``
  time, ``O(N k)`` memory, so it is safe at 150k+ spots);
* :func:`knn_graph` builds the symmetric k-nearest-neighbour graph from them. The default
  keeps an edge when each end is among the other's ``k`` nearest neighbours, the edge set
  ``E = {(i, j): j in N(i) and i in N(j)}`` of [1, App. C.1].
* :func:`grid_patches` cuts the spots into a grid of spatial patches of near-equal size,
  the fixed PD-VI blocks of [1, Sec. 5]; :func:`default_num_patches` says how many.

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..models.potts.graph import SpatialGraph


def _as_array(coords: torch.Tensor | np.ndarray) -> np.ndarray:
    return np.asarray(coords.detach().cpu() if isinstance(coords, torch.Tensor) else coords, dtype=np.float64)


def nearest_neighbours(
    coords: torch.Tensor | np.ndarray, num_neighbors: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each spot's ``k`` nearest other spots, by a k-d tree (``O(N log N)``).

    :param coords: ``(N, D)`` spot coordinates.
    :param num_neighbors: k (self excluded).
    :returns: distances and indices, each ``(N, k)``, nearest first.
    """
    from scipy.spatial import cKDTree

    coords = _as_array(coords)
    if coords.ndim != 2:
        raise ValueError(f"coords must have shape (N, 2), got {coords.shape}")
    num_nodes = coords.shape[0]
    if (
        isinstance(num_neighbors, bool)
        or not isinstance(num_neighbors, int)
        or not 1 <= num_neighbors < num_nodes
    ):
        raise ValueError(
            f"Invalid num_neighbors: {num_neighbors!r}; use an int in [1, N - 1 = {num_nodes - 1}]"
        )
    if not np.isfinite(coords).all():
        raise ValueError("coords contain NaN or inf")
    distance, neighbour = cKDTree(coords).query(coords, k=num_neighbors + 1)
    # Drop the spot itself (not always in column 0 when coordinates repeat).
    is_self = neighbour == np.arange(num_nodes)[:, None]
    order = np.argsort(is_self, axis=1, kind="stable")[:, :num_neighbors]
    return np.take_along_axis(distance, order, 1), np.take_along_axis(neighbour, order, 1)


def knn_graph(
    coords: torch.Tensor | np.ndarray,
    num_neighbors: int = 6,
    weight: float = 1.0,
    bandwidth: float | None = None,
    mutual: bool = True,
    backend: str = "auto",
    dtype: torch.dtype | None = None,
    neighbours: tuple[np.ndarray, np.ndarray] | None = None,
) -> SpatialGraph:
    """Symmetric k-nearest-neighbour graph of spot coordinates [1, App. C.1].

    Edge weights are ``r_ij = weight`` (constant), or with ``bandwidth`` set
    ``r_ij = weight * exp(-|l_i - l_j|^2 / (2 bandwidth^2))``, decaying with distance.

    :param coords: ``(N, 2)`` (or ``(N, D)``) spot coordinates.
    :param num_neighbors: k, neighbours per spot (self excluded).
    :param weight: the Potts interaction strength ``r`` (>= 0).
    :param bandwidth: length scale of the distance decay; ``None`` for constant weights.
    :param mutual: keep ``(i, j)`` when both are among each other's k nearest (the edge set
        of [1, App. C.1]); ``False`` keeps it when either is.
    :param backend: neighbour-sum backend of the graph, one of :data:`BACKENDS`.
    :param dtype: dtype of the weights (default: torch's default dtype).
    :param neighbours: :func:`nearest_neighbours` of ``coords`` for this ``num_neighbors``,
        if already computed.
    :rtype: SpatialGraph
    """
    import scipy.sparse

    if not (math.isfinite(weight) and weight >= 0):
        raise ValueError(f"Invalid weight: {weight}; use a non-negative float")
    if bandwidth is not None and not bandwidth > 0:
        raise ValueError(f"Invalid bandwidth: {bandwidth}; use a positive float or None")
    distance, neighbour = nearest_neighbours(coords, num_neighbors) if neighbours is None else neighbours
    num_nodes = neighbour.shape[0]
    rows = np.repeat(np.arange(num_nodes), num_neighbors)
    directed = scipy.sparse.csr_matrix(
        (distance.ravel() + 1.0, (rows, neighbour.ravel())), shape=(num_nodes, num_nodes)
    )  # +1 so that zero distances stay stored entries
    symmetric = directed.minimum(directed.T) if mutual else directed.maximum(directed.T)
    symmetric = symmetric.tocsr()
    symmetric.eliminate_zeros()
    edge_distance = symmetric.data - 1.0
    if bandwidth is None:
        symmetric.data = np.full_like(edge_distance, weight)
    else:
        symmetric.data = weight * np.exp(-(edge_distance**2) / (2.0 * bandwidth**2))
    return SpatialGraph.from_scipy(symmetric, backend, dtype)


#: Spots per patch that :func:`default_num_patches` aims at.
SPOTS_PER_PATCH = 10000


def default_num_patches(num_spots: int, max_patches: int = 25) -> int:
    """The number of patches ``fit_potts_mixture(num_patches="auto")`` cuts: one per
    :data:`SPOTS_PER_PATCH` spots (rounded), at least 1, at most ``max_patches`` (the paper
    cut 150k spots into 25-30 [1, Sec. 5]). Small patches drop a larger share of the edges
    and their curvatures vary more, which slows PD-VI down or, at a few dozen spots, makes its
    objective rise in some epochs (``docs/benchmarks.md``, section 7).

    :param num_spots: N.
    :param max_patches: the upper end.
    """
    return int(min(max(round(num_spots / SPOTS_PER_PATCH), 1), max_patches))


def grid_patches(coords: torch.Tensor | np.ndarray, num_patches: int) -> list[torch.Tensor]:
    """Fixed spatial patches: a grid of ``nx x ny`` cells with ``nx * ny = num_patches``
    (``nx`` chosen for the aspect ratio of the coordinates), cut at quantiles so that the
    patches hold near-equal numbers of spots (columns by x, then each column by y).

    :param coords: ``(N, 2)``.
    :param num_patches: number of patches (the paper uses about 25-30).
    :returns: sorted 1-D LongTensors partitioning ``range(N)``.
    """
    coords = _as_array(coords)
    if coords.ndim != 2 or coords.shape[1] < 2:
        raise ValueError(f"coords must have shape (N, 2), got {coords.shape}")
    num_nodes = coords.shape[0]
    if isinstance(num_patches, bool) or not isinstance(num_patches, int) or not 1 <= num_patches <= num_nodes:
        raise ValueError(f"Invalid num_patches: {num_patches!r}; use an int in [1, N = {num_nodes}]")
    extent = coords[:, :2].max(0) - coords[:, :2].min(0)
    aspect = extent[0] / extent[1] if extent[1] > 0 else float(num_patches)
    divisors = [n for n in range(1, num_patches + 1) if num_patches % n == 0]
    num_columns = min(divisors, key=lambda n: abs(math.log(n * n / num_patches / max(aspect, 1e-12))))
    num_rows = num_patches // num_columns
    patches = []
    for column in np.array_split(np.lexsort((coords[:, 1], coords[:, 0])), num_columns):
        by_y = column[np.lexsort((coords[column, 0], coords[column, 1]))]
        patches.extend(torch.from_numpy(np.sort(cell)) for cell in np.array_split(by_y, num_rows))
    return patches
