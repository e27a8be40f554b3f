"""pyro-pdvi: scalable mean-field VI by preconditioned primal-dual optimisation
(PD-VI and P2D-VI), as a drop-in replacement for :class:`pyro.infer.SVI`, and mean-field VI
by Wasserstein gradient flow (:class:`MFWGF`), a particle engine for the same optimum."""

from .errors import NonFiniteStepError, VectorizationError
from .infer import (
    PDVI,
    AntitheticNoise,
    AutoStepSize,
    BlockProblem,
    BlockSolution,
    BlockSolver,
    GenericSolver,
    RunResult,
)
from .mfwgf import MFWGF

__version__ = "0.2.0"

__all__ = [
    "PDVI",
    "AntitheticNoise",
    "AutoStepSize",
    "BlockProblem",
    "BlockSolution",
    "BlockSolver",
    "GenericSolver",
    "MFWGF",
    "NonFiniteStepError",
    "RunResult",
    "VectorizationError",
    "__version__",
]
