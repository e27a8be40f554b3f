"""PD-VI over several processes with :mod:`torch.distributed`.

PD-VI is a consensus method [1, Sec. 3.3]: given ``lambda_0``, the blocks' primal
steps are independent, and the global update needs only sums over the step's
blocks. :class:`DistributedPDVI` runs one :class:`~pyro_pdvi.PDVI` per process
(rank); in each step every rank solves its own block(s), then one all-reduce
of ``[sum (mu_b' - mu_b), sum (lambda_b' - lambda_b), sum lambda_b', m]`` gives
every rank the same ``h`` and ``lambda_0`` (see
:meth:`~pyro_pdvi.infer.consensus.ConsensusState.propose`). A run on ``R`` ranks
with one block each per step equals the one-process run with those ``R``
blocks per step, to rounding.

Usage, one process per rank (e.g. ``torchrun --nproc_per_node=2 script.py``)::

    torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=60))
    pyro.set_rng_seed(0)                    # PDVI's noise generator is broadcast from rank 0
    pdvi = DistributedPDVI(model, guide, optim, loss, blocks=blocks)
    pdvi.run(num_epochs, data)                # one step per owned block, every rank in step
    torch.save(pdvi.state_dict(), f"pdvi_rank{rank}.pt")   # with the param store

Failures: a rank whose step raises tells the others through the step's first
collective, so every rank raises :class:`DistributedStepError` and no rank
applies the step; a rank that dies makes the others' collective fail when the
connection drops, or after the process group's ``timeout`` at the latest. Resume
by restarting every rank from its last ``state_dict`` and param store.

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from pyro.optim import PyroOptim

from .infer.pdvi import PDVI

__all__ = ["DistributedPDVI", "DistributedStepError"]


class DistributedStepError(RuntimeError):
    """A step failed on some rank (or a rank stopped answering); no rank applied it."""


class DistributedPDVI(PDVI):
    """:class:`~pyro_pdvi.PDVI` with its blocks spread over the processes of a
    :mod:`torch.distributed` process group (gloo on CPU, NCCL on GPU).

    Every rank holds the whole model, data and param store; it solves and keeps
    up to date only the blocks it owns (their duals, copies and local rows); all
    ranks hold the same ``lambda_0`` after every step. Each rank must call
    :meth:`step` equally often, each time with a union of blocks it owns (one
    block per rank per step is the usual choice); different ranks' blocks must
    differ.

    :param model: the Pyro model, as for :class:`~pyro_pdvi.PDVI`.
    :param guide: the Pyro guide.
    :param optim: a :class:`pyro.optim.PyroOptim`.
    :param loss: a Pyro ELBO or loss callable.
    :param blocks: the fixed blocks, the same list on every rank.
    :param owned_blocks: the block ids this rank owns; default round robin,
        ``range(rank, n, world_size)``.
    :param process_group: the group to work in (default: the default group, which
        must have been initialised with ``torch.distributed.init_process_group``).
    :param kwargs: every other keyword argument of :class:`~pyro_pdvi.PDVI`.
    """

    def __init__(
        self,
        model: Callable,
        guide: Callable,
        optim: PyroOptim,
        loss: Any,
        *,
        blocks: Sequence[torch.Tensor],
        owned_blocks: Sequence[int] | None = None,
        process_group: dist.ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "DistributedPDVI needs an initialised process group: call "
                'torch.distributed.init_process_group("gloo" or "nccl", timeout=...) in every '
                "process first (torchrun sets the environment it reads)"
            )
        super().__init__(model, guide, optim, loss, blocks=blocks, **kwargs)
        if self.auto_step_size.remeasure_epochs:
            raise ValueError(
                "DistributedPDVI does not support AutoStepSize(remeasure_epochs=...) (every rank "
                "would have to measure the same blocks); leave remeasure_epochs out"
            )
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        num_blocks = len(self.partition)
        if owned_blocks is None:
            owned_blocks = range(self.rank, num_blocks, self.world_size)
        owned = sorted(int(b) for b in owned_blocks)
        if not owned or owned[0] < 0 or owned[-1] >= num_blocks or len(set(owned)) != len(owned):
            raise ValueError(
                f"rank {self.rank}: owned_blocks must be distinct block ids in range({num_blocks}), "
                f"got {owned}"
            )
        self.owned_blocks: list[int] = owned
        # NCCL reduces CUDA tensors only; gloo takes CPU tensors.
        nccl = dist.get_backend(process_group) == "nccl"
        self._comm_device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self._check_ownership()

    # ------------------------------------------------------------ collectives

    def _collective(self, operation: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        try:
            operation(*args, group=self.process_group, **kwargs)
        except Exception as error:  # the backends raise RuntimeError subclasses of their own
            raise DistributedStepError(
                f"rank {self.rank}: a collective of step {self.num_steps + 1} failed ({error}); another "
                "rank has probably stopped. Restart every rank from its last state_dict and param store."
            ) from error

    def _all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        total = tensor.detach().to(self._comm_device, copy=True)
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        self._collective(dist.all_reduce, total, op=reduce_op)
        return total.to(tensor.device)

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        value = tensor.detach().to(self._comm_device, copy=True)
        self._collective(dist.broadcast, value, 0)
        return value.to(tensor.device)

    def _all_gather_objects(self, value: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        self._collective(dist.all_gather_object, gathered, value)
        return gathered

    def _check_ownership(self) -> None:
        owners = self._all_gather_objects(self.owned_blocks)
        seen: dict[int, int] = {}
        for rank, owned in enumerate(owners):
            for b in owned:
                if b in seen:
                    raise ValueError(
                        f"block {b} is owned by ranks {seen[b]} and {rank}; give each block one owner"
                    )
                seen[b] = rank

    # ------------------------------------------------------------------ hooks

    _shares_steps = True

    def _seed_generator(self) -> None:
        seed = self._broadcast(torch.randint(0, 2**62, (1,)))
        self._rng = torch.Generator().manual_seed(int(seed))

    def _after_setup(self) -> None:
        """Every rank starts from rank 0's ``lambda_0`` and step sizes."""
        state = self._state
        consensus = self._broadcast(state.consensus)
        self._step_sizes.etas = self._broadcast(self._step_sizes.etas)
        state.consensus = consensus
        state.copies[:] = consensus
        state.copy_mean = consensus.clone()
        state.set_step_sizes(self._step_sizes.per_coordinate(consensus))
        self._params.write_consensus(state.consensus)

    def _epoch_blocks(self) -> list[int]:
        return list(self.owned_blocks)

    def _solve_everywhere(self, block_ids: torch.Tensor, args: tuple, kwargs: dict):
        """This rank solves its block(s); one all-reduce tells every rank whether all could.

        :raises DistributedStepError: if this or another rank failed; then no rank changes anything.
        """
        foreign = sorted(set(block_ids.tolist()) - set(self.owned_blocks))
        seeds = self._block_seeds(block_ids)
        error: BaseException | None = None
        if foreign:
            error = ValueError(f"rank {self.rank} stepped on blocks {foreign}, which it does not own")
        else:
            try:
                solved = self._solve(block_ids, seeds, args, kwargs)
            except Exception as caught:
                error = caught
        failed = self._all_reduce(torch.tensor([float(error is not None)], dtype=self._state.consensus.dtype))
        if error is not None:
            raise DistributedStepError(
                f"rank {self.rank}: step {self.num_steps + 1} failed on blocks {block_ids.tolist()} "
                f"({type(error).__name__}: {error}); no rank applied the step"
            ) from error
        if bool(failed):
            raise DistributedStepError(
                f"rank {self.rank}: step {self.num_steps + 1} failed on another rank (its error says why); "
                "no rank applied the step"
            )
        return solved

    def run(self, num_epochs: int, *args: Any, **kwargs: Any):
        """:meth:`PDVI.run` over this rank's blocks; every rank must own as many blocks (each
        rank makes the same number of steps), and every rank must call it.

        :rtype: ~pyro_pdvi.infer.pdvi.RunResult
        """
        counts = self._all_gather_objects(len(self.owned_blocks))
        if len(set(counts)) > 1:
            raise ValueError(
                f"DistributedPDVI.run needs every rank to own as many blocks, got {counts} blocks per "
                "rank; pass owned_blocks= with equal counts, or step yourself"
            )
        return super().run(num_epochs, *args, **kwargs)

    def global_gradient_norm(self, *args: Any, **kwargs: Any) -> float:
        """``||grad_lambda f(phi, lambda_0)||``: each rank sums over its owned blocks
        (whose local rows it holds), then one all-reduce.

        :rtype: float
        """
        if self._state is None:
            raise RuntimeError("call step() at least once before global_gradient_norm()")
        return float(self._all_reduce(self._gradient_sum(self.owned_blocks, args, kwargs)).norm())
