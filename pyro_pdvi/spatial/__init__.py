"""Spatial domain detection: a Gaussian mixture with a Potts prior on a neighbour graph [1, App. C.1].

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
"""

from .graph import BACKENDS, SpatialGraph, grid_patches, knn_graph, scatter_available
from .potts import (
    CoordinateAscentResult,
    PottsBlockSolver,
    PottsGMMModel,
    block_negative_elbo,
    coordinate_ascent,
    negative_elbo,
    potts_energy,
)

__all__ = [
    "BACKENDS",
    "CoordinateAscentResult",
    "PottsBlockSolver",
    "PottsGMMModel",
    "SpatialGraph",
    "block_negative_elbo",
    "coordinate_ascent",
    "grid_patches",
    "knn_graph",
    "negative_elbo",
    "potts_energy",
    "scatter_available",
]
