"""Argument checks shared by the engine and the models, with errors that name the argument."""

from __future__ import annotations

from typing import Any


def check_positive_int(value: Any, name: str) -> int:
    """Return ``value`` if it is an ``int`` (not a ``bool``) of at least 1.

    :param value: the argument.
    :param name: its name, for the error.
    :raises ValueError: ``Invalid <name>: <value>; use a positive int``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Invalid {name}: {value!r}; use a positive int")
    return value
