"""pyro-pdvi: scalable mean-field VI by preconditioned primal-dual optimisation
(PD-VI and P2D-VI), as a drop-in replacement for :class:`pyro.infer.SVI`."""

from .infer import (
    PDVI,
    AntitheticNoise,
    BlockBatch,
    BlockBatchSolution,
    BlockPartition,
    BlockProblem,
    BlockSolution,
    ConsensusState,
    LocalSolver,
    NonFiniteStepError,
    VectorizationError,
)

__version__ = "0.1.0"

__all__ = [
    "PDVI",
    "AntitheticNoise",
    "BlockBatch",
    "BlockBatchSolution",
    "BlockPartition",
    "BlockProblem",
    "BlockSolution",
    "ConsensusState",
    "LocalSolver",
    "NonFiniteStepError",
    "VectorizationError",
    "__version__",
]
