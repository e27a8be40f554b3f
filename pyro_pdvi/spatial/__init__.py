"""Spatial domain detection: a Gaussian mixture with a Potts prior on a neighbour graph [1, App. C.1].

For analysts: :func:`fit_spatial_domains` (AnnData in, domains out) and
:func:`plot_spatial_domains`. Underneath: :mod:`.graph` (kNN CSR graph, patches, neighbour
sums), :mod:`.potts` (exact objective, closed-form patch solver, Pyro model), :mod:`.fit`
(P2D-VI / PD-VI / SVI runs), :mod:`.synthetic` (Potts data with known domains).

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
"""

from .api import expression_features, fit_spatial_domains, plot_spatial_domains
from .fit import METHODS, SpatialFit, curvature_step_sizes, fit_potts_mixture
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
    "METHODS",
    "CoordinateAscentResult",
    "PottsBlockSolver",
    "PottsData",
    "PottsGMMModel",
    "SpatialFit",
    "SpatialGraph",
    "block_negative_elbo",
    "coordinate_ascent",
    "critical_beta",
    "curvature_step_sizes",
    "expression_features",
    "fit_potts_mixture",
    "fit_spatial_domains",
    "gibbs_sweeps",
    "grid_patches",
    "knn_graph",
    "lattice_graph",
    "make_potts_data",
    "negative_elbo",
    "plot_spatial_domains",
    "potts_energy",
    "scatter_available",
]
