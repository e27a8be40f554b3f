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
from .synthetic import PottsData, critical_beta, gibbs_sweeps, lattice_graph, make_potts_data

__all__ = [
    "BACKENDS",
    "CoordinateAscentResult",
    "PottsBlockSolver",
    "PottsData",
    "PottsGMMModel",
    "SpatialGraph",
    "block_negative_elbo",
    "coordinate_ascent",
    "critical_beta",
    "gibbs_sweeps",
    "grid_patches",
    "knn_graph",
    "lattice_graph",
    "make_potts_data",
    "negative_elbo",
    "potts_energy",
    "scatter_available",
]
