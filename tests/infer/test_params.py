"""Reads and writes of the param store: a block's rows and back, the consensus."""

import pyro
import torch
from torch.distributions import constraints

from pyro_pdvi.infer.params import ParamStoreView
from pyro_pdvi.infer.sites import GlobalLayout, GlobalSite, LocalSite


def test_rows_of_equal_blocks_round_trip_on_any_plate_axis():
    pyro.param("g", torch.zeros(2, 3))
    pyro.param("by_row", torch.arange(30.0).reshape(10, 3))  # plate axis -2
    pyro.param("by_column", torch.arange(20.0).reshape(2, 10))  # plate axis -1
    layout = GlobalLayout([GlobalSite("g", torch.Size([2, 3]), constraints.real)])
    view = ParamStoreView(
        layout, [LocalSite("by_row", -2, constraints.real), LocalSite("by_column", -1, constraints.real)]
    )
    indices = torch.tensor([[7, 1], [4, 8]])
    rows = view.rows(indices)
    assert rows["by_row"].shape == (2, 2, 3) and rows["by_column"].shape == (2, 2, 2)
    assert torch.equal(rows["by_row"][1, 0], torch.arange(12.0, 15.0))  # datum 4
    assert torch.equal(rows["by_column"][0, :, 1], torch.tensor([1.0, 11.0]))  # datum 1
    view.write_rows(indices, {k: -v for k, v in rows.items()})
    assert torch.equal(
        pyro.param("by_row").detach()[[7, 1, 4, 8]], -torch.arange(30.0).reshape(10, 3)[[7, 1, 4, 8]]
    )
    untouched = [0, 2, 3, 5, 6, 9]
    assert torch.equal(
        pyro.param("by_column").detach()[:, untouched], torch.arange(20.0).reshape(2, 10)[:, untouched]
    )
    view.write_consensus(torch.arange(6.0))
    assert torch.equal(view.consensus(), torch.arange(6.0))
    assert torch.equal(pyro.param("g").detach(), torch.arange(6.0).reshape(2, 3))
