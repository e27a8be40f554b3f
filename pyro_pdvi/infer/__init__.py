"""Inference: the PDVI engine and its parts.

* :mod:`.pdvi`: :class:`PDVI`, the step as the algorithm's loop, :meth:`PDVI.run`, checkpoints;
* :mod:`.blocks`: the fixed partition, and which blocks a subsample is made of;
* :mod:`.sites`: the global/local split of the params and the flat layout of the globals;
* :mod:`.params`: every read and write of the param store;
* :mod:`.problem`: the blocks' subproblems (:class:`BlockProblem`) and solutions;
* :mod:`.objective`: ``f_b`` through the Pyro model, by a loop or by ``vmap``;
* :mod:`.solvers`: the :class:`BlockSolver` protocol, :class:`GenericSolver`, batched L-BFGS;
* :mod:`.step_sizes`: preconditioner groups, ``eta="auto"`` (:class:`AutoStepSize`);
* :mod:`.consensus`: duals, copies and ``lambda_0``;
* :mod:`.handlers`, :mod:`.antithetic`, :mod:`._vmap`: the Pyro effect handlers PDVI runs under.
"""

from .antithetic import AntitheticNoise
from .blocks import BlockPartition
from .consensus import ConsensusState
from .pdvi import PDVI
from .problem import BlockProblem, BlockSolution
from .run import RunResult
from .solvers import BatchedLBFGSResult, BlockSolver, GenericSolver, batched_lbfgs
from .step_sizes import AutoStepSize

__all__ = [
    "PDVI",
    "AntitheticNoise",
    "AutoStepSize",
    "BatchedLBFGSResult",
    "BlockPartition",
    "BlockProblem",
    "BlockSolution",
    "BlockSolver",
    "ConsensusState",
    "GenericSolver",
    "RunResult",
    "batched_lbfgs",
]
