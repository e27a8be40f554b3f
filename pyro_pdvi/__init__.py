"""pyro-pdvi: scalable mean-field VI by preconditioned primal-dual optimisation
(PD-VI and P2D-VI), as a drop-in replacement for :class:`pyro.infer.SVI`."""

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

__version__ = "0.2.0"

__all__ = [
    "PDVI",
    "AntitheticNoise",
    "AutoStepSize",
    "BlockProblem",
    "BlockSolution",
    "BlockSolver",
    "GenericSolver",
    "NonFiniteStepError",
    "RunResult",
    "VectorizationError",
    "__version__",
]
