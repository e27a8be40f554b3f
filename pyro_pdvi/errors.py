"""The errors pyro-pdvi raises beyond ``ValueError`` for bad arguments, and how its engine warns.

Every engine (:class:`~pyro_pdvi.PDVI`, and the particle engine beside it) refuses a step
that would leave a non-finite value and says so with :class:`NonFiniteStepError`; nothing
is changed by a refused step. A warning points at the user's line that called into the package
(:func:`warn_user`), wherever inside it the warning is raised.
"""

from __future__ import annotations

import os
import sys
import warnings

import pyro
import torch

#: Frames in these folders are the package's or its libraries', never the user's line.
_LIBRARY_FOLDERS = tuple(
    os.path.dirname(os.path.abspath(module.__file__)) + os.sep
    for module in (sys.modules[__name__.rsplit(".", 1)[0]], pyro, torch)
)


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first caller outside pyro-pdvi, Pyro and torch: the
    user's ``step``, ``run`` or a subclass's call, however deep inside the engine it is raised.

    :param message: the warning's text.
    :param category: its class.
    """
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_FOLDERS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


class NonFiniteStepError(RuntimeError):
    """A step produced a non-finite loss or update; nothing was changed."""


class VectorizationError(RuntimeError):
    """``torch.func.vmap`` could not map the model, guide and loss over stacked blocks."""
