"""Reference methods that PD-VI is measured against, beyond Pyro's own ``SVI``: Hoffman et
al.'s natural-gradient SVI for the mixture (:class:`GMMNaturalGradientSVI`). Full-batch CAVI,
the optimum itself, lives with its model (:func:`pyro_pdvi.models.gmm.cavi`)."""

from .natural_gradient import GMMNaturalGradientSVI

__all__ = ["GMMNaturalGradientSVI"]
