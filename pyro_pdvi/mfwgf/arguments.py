"""Checks of MFWGF's arguments, each raising a ``ValueError`` that names the argument and the fix."""

from __future__ import annotations

from typing import Any

from ..checks import check_positive_int


def check_float(value: Any, name: str, upper: float = float("inf")) -> float:
    """``value`` as a float in ``(0, upper)``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < upper:
        raise ValueError(f"Invalid {name}: {value!r}; use a float in (0, {upper})")
    return float(value)


def check_step_size(step_size: Any) -> float | str:
    """``"auto"`` or a positive finite float."""
    if step_size == "auto":
        return step_size
    if (
        isinstance(step_size, bool)
        or not isinstance(step_size, (int, float))
        or not 0 < step_size < float("inf")
    ):
        raise ValueError(f'Invalid step_size: {step_size!r}; use a positive float or "auto"')
    return float(step_size)


def check_num_particles(num_particles: Any, scheme: str) -> int:
    """At least 2 (an empirical measure of one point has no spread); even for ``"gaussian"``."""
    check_positive_int(num_particles, "num_particles")
    if num_particles < 2:
        raise ValueError(f"Invalid num_particles: {num_particles}; use at least 2")
    if scheme == "gaussian" and num_particles % 2:
        raise ValueError(
            f"Invalid num_particles: {num_particles}; "
            'scheme="gaussian" draws antithetic pairs, use an even number'
        )
    return num_particles


def check_factors(factors: Any) -> Any:
    """``"coordinate"``, ``"site"`` or a list (its site names are checked at the first step)."""
    if isinstance(factors, str) and factors in ("coordinate", "site"):
        return factors
    if isinstance(factors, (list, tuple)):
        return factors
    raise ValueError(f'Invalid factors: {factors!r}; use "coordinate", "site" or a list of site-name lists')


def check_max_plate_nesting(value: Any) -> int | None:
    """``None`` or a non-negative int."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"Invalid max_plate_nesting: {value!r}; use a non-negative int or None")
    return value
