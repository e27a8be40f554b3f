"""Fixed data blocks: the partition of ``range(N)`` that PD-VI keeps a dual per.

The paper [1] splits the data into ``n`` fixed blocks (a block may be a single
datum, or a spatial patch) and keeps one dual variable per block. This module
validates such a partition once, and maps the subsample indices that a Pyro
``plate`` records back to the blocks they are made of.

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632, Sec. 3.3.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


def _preview(values: torch.Tensor, limit: int = 8) -> str:
    items = values.tolist()
    text = ", ".join(str(v) for v in items[:limit])
    return f"[{text}{', ...' if len(items) > limit else ''}] ({len(items)} in all)"


class _DeviceBlocks(NamedTuple):
    blocks: list[torch.Tensor]
    stack: torch.Tensor | None  # (n, s) when every block has size s
    block_of: torch.Tensor
    sizes: torch.Tensor


class BlockPartition:
    """A validated partition of ``range(N)`` into fixed blocks.

    The blocks are checked when given (non-empty 1-D integer tensors, no negative or
    repeated index, no index in two blocks) and against ``N``, the size of the data plate,
    once the model has shown it (:meth:`check_covers`): every index of ``range(N)`` in
    exactly one block.

    :param blocks: 1-D integer tensors (or sequences of ints).
    :raises ValueError: naming the block and the indices when a block is malformed or two
        blocks share indices.
    """

    def __init__(self, blocks: Sequence[torch.Tensor | Sequence[int]]) -> None:
        if isinstance(blocks, torch.Tensor) or not isinstance(blocks, Sequence):
            raise ValueError(
                "blocks must be a list of 1-D LongTensors that partition range(N), "
                f"got {type(blocks).__name__}"
            )
        if len(blocks) == 0:
            raise ValueError("blocks must hold at least one block, got an empty list")
        tensors = []
        for b, block in enumerate(blocks):
            block = torch.as_tensor(block)
            if block.dim() != 1 or block.numel() == 0:
                raise ValueError(
                    f"block {b} must be a non-empty 1-D tensor of indices, got shape {tuple(block.shape)}"
                )
            if block.dtype.is_floating_point or block.dtype == torch.bool:
                raise ValueError(f"block {b} must hold integer indices, got dtype {block.dtype}")
            block = block.detach().to("cpu", torch.long)
            if (block < 0).any():
                raise ValueError(f"block {b} holds negative indices {_preview(block[block < 0])}")
            if block.unique().numel() != block.numel():
                raise ValueError(f"block {b} holds a repeated index; each index must appear once")
            tensors.append(block)
        self.blocks: list[torch.Tensor] = tensors
        self.sizes = torch.tensor([len(b) for b in tensors])
        #: N: the number of indices, until :meth:`check_covers` confirms it is the plate's size.
        self.num_data = int(self.sizes.sum())
        block_of = torch.full((max(int(block.max()) for block in tensors) + 1,), -1, dtype=torch.long)
        for b, block in enumerate(tensors):
            taken = block_of[block]
            if (taken >= 0).any():
                first = int(taken[taken >= 0][0])
                raise ValueError(
                    f"blocks {first} and {b} share the indices {_preview(block[taken >= 0])}; every "
                    "datum must be in exactly one block"
                )
            block_of[block] = b
        self.block_of = block_of
        self._on_device: dict[torch.device, _DeviceBlocks] = {}

    def check_covers(self, size: int, plate_name: str) -> None:
        """Check that the blocks partition ``range(size)``, the data plate's indices.

        :param size: N, the size of the data plate.
        :param plate_name: its name, for the message.
        :raises ValueError: naming the indices out of range or in no block (a few, and how many).
        """
        where = f'the data plate "{plate_name}" (size {size})'
        for b, block in enumerate(self.blocks):
            outside = block[block >= size]
            if outside.numel():
                raise ValueError(
                    f"block {b} holds indices outside {where}: {_preview(outside)}; indices run "
                    f"from 0 to {size - 1}"
                )
        missing = torch.ones(size, dtype=torch.bool)
        missing[torch.cat(self.blocks)] = False
        if missing.any():
            raise ValueError(
                f"the blocks do not cover {where}: no block holds the indices "
                f"{_preview(missing.nonzero().reshape(-1))}; every datum must be in exactly one block "
                f"(e.g. blocks = list(torch.arange({size}).chunk(num_blocks)))"
            )

    def __len__(self) -> int:
        return len(self.blocks)

    def _device_copies(self, device: torch.device | str) -> _DeviceBlocks:
        """The partition's tensors on ``device``, copied once."""
        device = torch.device(device)
        if device not in self._on_device:
            blocks = [block.to(device) for block in self.blocks]
            equal = bool((self.sizes == self.sizes[0]).all())
            self._on_device[device] = _DeviceBlocks(
                blocks,
                torch.stack(blocks) if equal else None,
                self.block_of[: self.num_data].to(device),
                self.sizes.to(device),
            )
        return self._on_device[device]

    def block(self, b: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Block ``b``'s indices on ``device`` (cached)."""
        return self._device_copies(device).blocks[b]

    def stacked(self, block_ids: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
        """The indices of equal-size blocks ``block_ids`` as one ``(m, s)`` tensor on ``device``."""
        copies = self._device_copies(device)
        if copies.stack is not None:
            return copies.stack.index_select(0, block_ids.to(copies.stack.device))
        return torch.stack([copies.blocks[b] for b in block_ids.tolist()])

    def blocks_in(self, indices: torch.Tensor) -> torch.Tensor:
        """The blocks whose union is exactly ``indices``, checked where ``indices`` lives
        (on a GPU: no copy of the indices to the host, one synchronisation).

        :param indices: subsample indices recorded by the data plate.
        :returns: the sorted block ids, a LongTensor on the CPU.
        :raises ValueError: naming the foreign indices when ``indices`` is not a
            union of whole blocks.
        """
        indices = torch.as_tensor(indices).detach().reshape(-1)
        if indices.device.type == "cpu" or indices.numel() == 0:
            return self._blocks_in_on_host(indices)
        return self._blocks_in_on_device(indices)

    def _blocks_in_on_device(self, indices: torch.Tensor) -> torch.Tensor:
        """:meth:`blocks_in` without sorting or copying ``indices`` to the host."""
        copies = self._device_copies(indices.device)
        indices = indices.long()
        inside = (indices >= 0) & (indices < self.num_data)
        safe = indices.clamp(0, self.num_data - 1)  # an out-of-range gather is a fatal device error
        ids = copies.block_of[safe]
        counts = torch.bincount(ids, minlength=len(self))
        position = torch.arange(indices.numel(), device=indices.device)
        owner = torch.empty(self.num_data, dtype=torch.long, device=indices.device)
        owner[safe] = position
        present = counts > 0
        bad = torch.stack(
            [~inside.all(), (owner[safe] != position).any(), (present & (counts != copies.sizes)).any()]
        )
        if bool(bad.any()):
            return self._blocks_in_on_host(indices)  # the slow path names what is wrong
        return present.nonzero().reshape(-1).cpu()

    def _blocks_in_on_host(self, indices: torch.Tensor) -> torch.Tensor:
        """The blocks whose union is exactly ``indices``.

        :param indices: subsample indices recorded by the data plate.
        :returns: the sorted block ids, a LongTensor.
        :raises ValueError: naming the foreign indices when ``indices`` is not a
            union of whole blocks.
        """
        indices = torch.as_tensor(indices).detach().to("cpu", torch.long).reshape(-1)
        outside = indices[(indices < 0) | (indices >= self.num_data)]
        if outside.numel():
            raise ValueError(
                f"the step's subsample holds indices outside range({self.num_data}) "
                f"covered by the blocks: {_preview(outside)}"
            )
        if indices.unique().numel() != indices.numel():
            raise ValueError("the step's subsample holds a repeated index")
        ids = self.block_of[indices]
        block_ids, counts = ids.unique(return_counts=True)
        partial = block_ids[counts != self.sizes[block_ids]]
        if partial.numel():
            b = int(partial[0])
            present = torch.zeros(self.num_data, dtype=torch.bool)
            present[indices] = True
            missing = self.blocks[b][~present[self.blocks[b]]]
            foreign = indices[ids == b]
            raise ValueError(
                f"the step's subsample is not a union of whole blocks: it holds "
                f"{foreign.numel()} indices of block {b} {_preview(foreign)} but not the "
                f"block's indices {_preview(missing)}. Pass blocks[b] (or a union of whole "
                "blocks) as the plate's subsample."
            )
        return block_ids
