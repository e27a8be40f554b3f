"""BlockPartition: the host check and the device check (run here on CPU tensors) agree."""

import pytest
import torch

from pyro_pdvi.infer.blocks import BlockPartition


@pytest.fixture
def partition():
    order = torch.randperm(30, generator=torch.Generator().manual_seed(0))
    return BlockPartition(list(order.chunk(5)))


@pytest.mark.parametrize("chosen", [[0], [3], [1, 4], [0, 1, 2, 3, 4]])
def test_device_check_finds_the_same_blocks(partition, chosen):
    indices = torch.cat([partition.blocks[b] for b in chosen])
    indices = indices[torch.randperm(len(indices))]
    assert partition._blocks_in_on_device(indices).tolist() == chosen
    assert partition.blocks_in(indices).tolist() == chosen


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p.blocks[0][:-1], "not a union of whole blocks"),
        (lambda p: torch.cat([p.blocks[0], p.blocks[0][:1]]), "repeated index"),
        (lambda p: torch.cat([p.blocks[2], torch.tensor([30])]), "outside range"),
        (lambda p: torch.cat([p.blocks[2], torch.tensor([-1])]), "outside range"),
    ],
)
def test_device_check_falls_back_to_the_named_error(partition, make, message):
    with pytest.raises(ValueError, match=message):
        partition._blocks_in_on_device(make(partition))


def test_device_copies_are_cached_and_stacked(partition):
    assert partition.block(2) is partition.block(2)
    torch.testing.assert_close(
        partition.stacked(torch.tensor([3, 1])), torch.stack([partition.blocks[3], partition.blocks[1]])
    )
    uneven = BlockPartition([torch.tensor([0, 1]), torch.tensor([2])])
    assert uneven.stacked(torch.tensor([0])).tolist() == [[0, 1]]
