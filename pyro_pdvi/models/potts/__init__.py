"""A Gaussian mixture with a Potts prior on a spatial graph: the model of [1, App. C.1].

* :mod:`.graph`: :class:`SpatialGraph`, the neighbour graph in CSR form (built from spot
  coordinates by :func:`pyro_pdvi.spatial.knn_graph`);
* :mod:`.objective`: the exact :func:`potts_negative_elbo` and its patch share
  :func:`potts_block_negative_elbo`;
* :mod:`.coordinate_ascent`: full-batch mean-field coordinate ascent, the reference fixed point;
* :mod:`.solver`: :class:`PottsBlockSolver`, the closed-form patch solver for PDVI (its
  ``q(c)`` half is the mixture's :class:`~pyro_pdvi.models.gmm.solver.ComponentStep`);
* :mod:`.model`: :class:`PottsGMMModel`, the sites in Pyro with the exact loss.

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
"""

from .coordinate_ascent import coordinate_ascent
from .graph import BACKENDS, SpatialGraph, scatter_available
from .model import PottsGMMModel
from .objective import potts_block_negative_elbo, potts_energy, potts_negative_elbo
from .solver import PottsBlockSolver

__all__ = [
    "BACKENDS",
    "PottsBlockSolver",
    "PottsGMMModel",
    "SpatialGraph",
    "coordinate_ascent",
    "potts_block_negative_elbo",
    "potts_energy",
    "potts_negative_elbo",
    "scatter_available",
]
