"""Spatial domain detection: a Gaussian mixture with a Potts prior on a neighbour graph [1, App. C.1].

For analysts: :func:`fit_spatial_domains` (AnnData in, domains out) and
:func:`plot_spatial_domains`. Underneath: :mod:`.graph` (kNN graph of the spots, patches),
:mod:`.fit` (P2D-VI / PD-VI / SVI runs on tensors), :mod:`.synthetic` (Potts data with known
domains); the model itself (objective, patch solver, Pyro sites) is
:mod:`pyro_pdvi.models.potts`.

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
"""

from .api import expression_features, fit_spatial_domains, plot_spatial_domains
from .fit import METHODS, SpatialFit, fit_potts_mixture
from .graph import grid_patches, knn_graph
from .synthetic import PottsData, make_potts_data

__all__ = [
    "METHODS",
    "PottsData",
    "SpatialFit",
    "expression_features",
    "fit_potts_mixture",
    "fit_spatial_domains",
    "grid_patches",
    "knn_graph",
    "make_potts_data",
    "plot_spatial_domains",
]
