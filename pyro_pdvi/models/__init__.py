"""Models with exact objectives and closed-form local solvers for PD-VI."""

from .gmm import (
    BiasedGMMData,
    CAVIResult,
    GMMBlockSolver,
    GMMModel,
    GMMPrior,
    adjusted_rand_index,
    block_negative_elbo,
    cavi,
    kmeans,
    make_biased_gmm,
    negative_elbo,
    predictive_components,
    prior_from_data,
    wasserstein_gmm,
)
from .gmm_svi import GMMNaturalGradientSVI

__all__ = [
    "BiasedGMMData",
    "CAVIResult",
    "GMMBlockSolver",
    "GMMModel",
    "GMMNaturalGradientSVI",
    "GMMPrior",
    "adjusted_rand_index",
    "block_negative_elbo",
    "cavi",
    "kmeans",
    "make_biased_gmm",
    "negative_elbo",
    "predictive_components",
    "prior_from_data",
    "wasserstein_gmm",
]
