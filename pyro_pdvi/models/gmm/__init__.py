"""Bayesian Gaussian mixture with known diagonal noise: the synthetic model of [1, App. C.2]
(the model of [1, App. C.1] without its Potts term), with everything exact that can be.

* :mod:`.prior`: :class:`GMMPrior`, :func:`kmeans`, :func:`prior_from_data`;
* :mod:`.data`: :func:`make_biased_gmm`, non-i.i.d. blocks as in [1, App. C.2];
* :mod:`.objective`: the exact :func:`negative_elbo` and its block share
  :func:`block_negative_elbo` [1, App. A.1];
* :mod:`.cavi`: full-batch coordinate ascent, the optimum every method is measured by;
* :mod:`.solver`: :class:`GMMBlockSolver`, the closed-form block solver for PDVI;
* :mod:`.model`: :class:`GMMModel`, the model and guide in Pyro.

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
"""

from .cavi import CAVIResult, cavi
from .data import BiasedGMMData, make_biased_gmm
from .model import SITE_NAMES, GMMModel
from .objective import (
    block_negative_elbo,
    conjugate_update,
    expected_log_likelihood,
    fitted_w2,
    negative_elbo,
    optimal_logits,
    predictive_components,
)
from .prior import GMMPrior, kmeans, prior_from_data
from .solver import GMMBlockSolver

__all__ = [
    "SITE_NAMES",
    "BiasedGMMData",
    "CAVIResult",
    "GMMBlockSolver",
    "GMMModel",
    "GMMPrior",
    "block_negative_elbo",
    "cavi",
    "conjugate_update",
    "expected_log_likelihood",
    "fitted_w2",
    "kmeans",
    "make_biased_gmm",
    "negative_elbo",
    "optimal_logits",
    "predictive_components",
    "prior_from_data",
]
