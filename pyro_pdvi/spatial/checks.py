"""Checks of a user's spatial data before a fit, with errors that name the user's own argument
(``adata.obsm["X_pca"]``, ``n_domains``, ...) and the fix, and the handling of spots that
share a position (:func:`duplicate_positions`, :func:`merge_duplicates`, :func:`jitter`).
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import operator
import warnings

import numpy as np


def require_spatial_extra(caller: str) -> None:
    """Raise an ``ImportError`` naming the ``spatial`` extra if pandas, anndata or scipy is missing."""
    missing = [name for name in ("pandas", "anndata", "scipy") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(
            f"{caller} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
            "installed: pip install 'pyro-pdvi[spatial]'"
        )


def check_count(value: object, name: str, low: int, high: int | None = None, why: str = "") -> int:
    """``value`` as an ``int`` in ``[low, high]``; numpy integers pass, bools and floats do not.

    :param value: the argument.
    :param name: its name as the user wrote it.
    :param low: the smallest allowed.
    :param high: the largest allowed (``None``: no bound).
    :param why: what sets ``high``, for the message.
    :raises ValueError: ``Invalid <name>: <value>; use an int in [low, high] (why)``.
    """
    number = None
    if not isinstance(value, (bool, np.bool_)):
        try:
            number = operator.index(value)
        except TypeError:
            pass
    if number is None or number < low or (high is not None and number > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        reason = f" ({why})" if why else ""
        raise ValueError(f"Invalid {name}: {value!r}; use an int {bounds}{reason}")
    return int(number)


def check_non_negative_number(value: object, name: str) -> float:
    """``value`` as a finite float ``>= 0``; numpy numbers pass, bools do not.

    :raises ValueError: ``Invalid <name>: <value>; use a non-negative number``.
    """
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, numbers.Real)
        or not 0 <= value < math.inf
    ):
        raise ValueError(f"Invalid {name}: {value!r}; use a non-negative number")
    return float(value)


def check_matrix(values: np.ndarray, where: str, what: str, fix: str) -> np.ndarray:
    """A 2-D finite float64 array, else a ``ValueError`` naming ``where``, the spots and ``fix``.

    :param values: the array.
    :param where: how the user refers to it (``'adata.obsm["X_pca"]'``).
    :param what: what it should hold, for the shape message.
    :param fix: what to do about non-finite values.
    """
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2:
        raise ValueError(f"{where} must be a 2-D array of {what}, got shape {values.shape}")
    bad = ~np.isfinite(values).all(1)
    if bad.any():
        rows = np.flatnonzero(bad)
        raise ValueError(
            f"{where} has NaN or inf in {rows.size} of {values.shape[0]} spots (the first at positions "
            f"{rows[:5].tolist()}); {fix}"
        )
    return values


def drop_constant_columns(features: np.ndarray, where: str) -> np.ndarray:
    """The columns of ``features`` that vary across spots; a warning names the others, and a
    ``ValueError`` is raised when none varies.

    :param features: ``(N, d)`` finite values.
    :param where: how the user refers to them.
    """
    spread = features.std(0)
    varying = spread > 1e-12 * max(float(np.abs(features).max()), 1e-300)
    if not varying.any():
        raise ValueError(
            f"{where} is the same for every spot (all {features.shape[1]} columns constant), so it "
            "cannot tell domains apart; check that it holds expression features (e.g. run "
            "sc.pp.normalize_total, sc.pp.log1p and sc.pp.pca on counts that are not all zero)"
        )
    if not varying.all():
        warnings.warn(
            f"{where}: columns {np.flatnonzero(~varying).tolist()[:10]} are constant across spots and "
            "were left out of the fit",
            stacklevel=3,
        )
    return features[:, varying]


def duplicate_positions(coords: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Groups of spots at the same position.

    :param coords: ``(N, D)`` finite coordinates.
    :returns: the distinct positions ``(M, D)`` and the position of every spot ``(N,)``.
    """
    positions, group = np.unique(coords, axis=0, return_inverse=True)
    return positions, group.reshape(-1)


def merge_duplicates(features: np.ndarray, group: np.ndarray, num_groups: int) -> np.ndarray:
    """The mean features of the spots at each position, ``(M, d)``."""
    sums = np.zeros((num_groups, features.shape[1]))
    np.add.at(sums, group, features)
    return sums / np.bincount(group, minlength=num_groups)[:, None]


def jitter(coords: np.ndarray, positions: np.ndarray, seed: int) -> np.ndarray:
    """``coords`` moved by independent uniform shifts of at most 1% of the median distance
    between neighbouring distinct positions in each coordinate (seeded), so that spots that
    shared a position become each other's nearest neighbours.

    :param coords: ``(N, D)``.
    :param positions: the distinct positions (:func:`duplicate_positions`), at least two.
    :param seed: seed of the shifts.
    """
    from scipy.spatial import cKDTree

    spacing = float(np.median(cKDTree(positions).query(positions, k=2)[0][:, 1]))
    scale = 0.01 * (spacing if spacing > 0 and math.isfinite(spacing) else 1.0)
    rng = np.random.default_rng(seed)
    return coords + rng.uniform(-scale, scale, size=coords.shape)
