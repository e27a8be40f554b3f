"""The errors pyro-pdvi raises beyond ``ValueError`` for bad arguments.

Every engine (:class:`~pyro_pdvi.PDVI`, and the particle engine beside it) refuses a step
that would leave a non-finite value and says so with :class:`NonFiniteStepError`; nothing
is changed by a refused step.
"""

from __future__ import annotations


class NonFiniteStepError(RuntimeError):
    """A step produced a non-finite loss or update; nothing was changed."""


class VectorizationError(RuntimeError):
    """``torch.func.vmap`` could not map the model, guide and loss over stacked blocks."""
