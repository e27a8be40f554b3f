"""Inference: the PDVI engine and its parts."""

from .antithetic import AntitheticNoise
from .blocks import BlockPartition
from .consensus import ConsensusState
from .lbfgs import BatchedLBFGSResult, batched_lbfgs
from .pdvi import PDVI, NonFiniteStepError
from .primal import BlockBatch, BlockBatchSolution, BlockProblem, BlockSolution, LocalSolver
from .vectorized import VectorizationError

__all__ = [
    "PDVI",
    "AntitheticNoise",
    "BatchedLBFGSResult",
    "BlockBatch",
    "BlockBatchSolution",
    "BlockPartition",
    "BlockProblem",
    "BlockSolution",
    "ConsensusState",
    "LocalSolver",
    "NonFiniteStepError",
    "VectorizationError",
    "batched_lbfgs",
]
