"""Argument checks shared by the engines and the models, with errors that name the argument."""

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


def check_non_negative(value: Any, name: str) -> float:
    """Return ``value`` as a float if it is a real number (not a ``bool``) of at least 0.

    :raises ValueError: ``Invalid <name>: <value>; use a non-negative number``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"Invalid {name}: {value!r}; use a non-negative number")
    return float(value)


def check_choice(value: Any, choices: tuple, name: str) -> Any:
    """Return ``value`` if it is one of ``choices``.

    :raises ValueError: ``Invalid <name>: <value>; use one of <choices>``.
    """
    if isinstance(value, str) and value in choices:
        return value
    raise ValueError(f"Invalid {name}: {value!r}; use one of {choices}")
