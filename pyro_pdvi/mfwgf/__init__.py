"""MF-WGF: mean-field variational inference by Wasserstein gradient flow (seed 002)."""

from .engine import MFWGF

__all__ = ["MFWGF"]
