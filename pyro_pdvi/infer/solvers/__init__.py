"""Primal solvers: what minimises the blocks' augmented Lagrangians in a PD-VI step.

A solver is any object with ``solve(problem: BlockProblem) -> BlockSolution``
(:class:`BlockSolver`); a step's blocks of equal size arrive together as one
:class:`~pyro_pdvi.infer.problem.BlockProblem`, one block as a batch of one. PDVI's
default is :class:`GenericSolver` (any Pyro model, through its ELBO); a model with a
closed-form block solve, the paper's recommendation [1, Sec. 3.2], passes its own, e.g.
:class:`pyro_pdvi.models.gmm.GMMBlockSolver`.

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..problem import BlockProblem, BlockSolution
from .generic import GenericSolver
from .lbfgs import BatchedLBFGSResult, batched_lbfgs


@runtime_checkable
class BlockSolver(Protocol):
    """The protocol of a primal solver: :meth:`solve` of a step's equal-size blocks."""

    def solve(self, problem: BlockProblem) -> BlockSolution:
        """Approximately minimise every block's augmented Lagrangian.

        :param problem: the ``m`` blocks' subproblems.
        :returns: their copies ``lambda_b``, rows ``phi_b`` and (optionally) ``f_b``.
        """
        ...


__all__ = ["BatchedLBFGSResult", "BlockSolver", "GenericSolver", "batched_lbfgs"]
