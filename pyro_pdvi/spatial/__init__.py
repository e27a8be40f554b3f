"""Spatial domain detection: a Gaussian mixture with a Potts prior on a neighbour graph [1, App. C.1].

For analysts: :func:`fit_spatial_domains` (AnnData in, domains out, scanpy's conventions) and
:func:`plot_spatial_domains`. Underneath, one job per module: :mod:`.checks` (the user's
data, with errors that name it), :mod:`.graph` (neighbours, kNN graph, patches),
:mod:`.init` (the start: a mixture of neighbour-averaged features, the Potts weight by
pseudo-likelihood), :mod:`.fit` (P2D-VI / PD-VI / SVI runs on tensors), :mod:`.monitor`
(objective, gradient norm, convergence), :mod:`.baseline` (the neighbour-averaged mixture
to beat), :mod:`.synthetic` (tissue with known domains); the model itself (objective, patch
solver, Pyro sites) is :mod:`pyro_pdvi.models.potts`.

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
"""

from .api import expression_features, fit_spatial_domains, plot_spatial_domains
from .baseline import neighbour_averaged_mixture
from .fit import METHODS, SpatialFit, fit_potts_mixture
from .graph import default_num_patches, grid_patches, knn_graph, nearest_neighbours
from .init import mixture_labels, neighbour_average, pseudo_likelihood_weight
from .synthetic import PottsData, make_irregular_data, make_potts_data

__all__ = [
    "METHODS",
    "PottsData",
    "SpatialFit",
    "default_num_patches",
    "expression_features",
    "fit_potts_mixture",
    "fit_spatial_domains",
    "grid_patches",
    "knn_graph",
    "make_irregular_data",
    "make_potts_data",
    "mixture_labels",
    "nearest_neighbours",
    "neighbour_average",
    "neighbour_averaged_mixture",
    "plot_spatial_domains",
    "pseudo_likelihood_weight",
]
