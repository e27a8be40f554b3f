"""Models with exact objectives and closed-form block solvers for PD-VI: the Bayesian Gaussian
mixture (:mod:`.gmm`), the mixture with a Potts prior on a spatial graph (:mod:`.potts`) and
the strongly convex quadratic of the paper's App. C.3 (:mod:`.quadratic`)."""

from .gmm import (
    BiasedGMMData,
    CAVIResult,
    GMMBlockSolver,
    GMMModel,
    GMMPrior,
    block_negative_elbo,
    cavi,
    expected_log_likelihood,
    fitted_w2,
    kmeans,
    make_biased_gmm,
    negative_elbo,
    optimal_logits,
    predictive_components,
    prior_from_data,
)
from .quadratic import Quadratic

__all__ = [
    "BiasedGMMData",
    "CAVIResult",
    "GMMBlockSolver",
    "GMMModel",
    "GMMPrior",
    "Quadratic",
    "block_negative_elbo",
    "cavi",
    "expected_log_likelihood",
    "fitted_w2",
    "kmeans",
    "make_biased_gmm",
    "negative_elbo",
    "optimal_logits",
    "predictive_components",
    "prior_from_data",
]
