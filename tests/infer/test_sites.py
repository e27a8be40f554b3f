"""The global/local split by plate structure, the flat layout of the globals, the data plate."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer.autoguide import AutoDelta, AutoNormal
from torch.distributions import constraints

from pyro_pdvi.infer.sites import (
    DataPlate,
    GlobalLayout,
    GlobalSite,
    find_data_plate,
    monte_carlo_sites,
    split_param_sites,
)

from ..toy_models import Hierarchical


def traces(model, guide, *args):
    guide_trace = poutine.trace(guide).get_trace(*args)
    model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(*args)
    return [guide_trace, model_trace]


def split(problem, guide, idx):
    found = traces(problem.model, guide, idx)
    store = pyro.get_param_store()
    plate = find_data_plate(found, problem.N, None)
    unconstrained = dict(store.named_parameters())
    return plate, *split_param_sites(found, plate, store.get_state()["constraints"], unconstrained)


def test_hand_written_guide_params_inside_the_plate_with_event_dim_are_local():
    problem = Hierarchical(num_data=12, num_blocks=3)
    plate, global_sites, local_sites = split(problem, problem.guide, problem.blocks[0])
    assert plate == DataPlate("data", 12)
    assert [s.name for s in global_sites] == ["mu_loc", "mu_scale"]
    assert [(s.name, s.axis) for s in local_sites] == [("theta_loc", -1), ("theta_scale", -1)]
    assert global_sites[1].constraint is constraints.positive


@pytest.mark.parametrize("guide_class", [AutoNormal, AutoDelta])
def test_autoguide_with_create_plates_splits_by_the_plate(guide_class):
    problem = Hierarchical(num_data=12, num_blocks=3)
    guide = guide_class(problem.model, create_plates=lambda idx: pyro.plate("data", 12, subsample=idx))
    _, global_sites, local_sites = split(problem, guide, problem.blocks[0])
    prefix = guide_class.__name__
    assert all(s.name.endswith(".mu") for s in global_sites) and global_sites[0].name.startswith(prefix)
    assert local_sites and all(s.name.endswith(".theta") for s in local_sites)


def test_layout_flattens_and_unflattens_with_and_without_batch_dims():
    layout = GlobalLayout(
        [
            GlobalSite("a", torch.Size([2, 3]), constraints.real),
            GlobalSite("b", torch.Size([]), constraints.real),
        ]
    )
    values = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor(7.0)}
    flat = layout.flatten(values)
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 7] and layout.size == 7
    assert all(torch.equal(layout.unflatten(flat)[k], v) for k, v in values.items())
    batch = {k: torch.stack([v, v + 1]) for k, v in values.items()}
    assert layout.flatten(batch, batch_dims=1).shape == (2, 7)
    assert torch.equal(layout.unflatten(layout.flatten(batch, batch_dims=1))["b"], torch.tensor([7.0, 8.0]))
    assert layout.site_of(5) == "a" and layout.site_of(6) == "b"


def test_data_plate_errors_name_what_was_found():
    problem = Hierarchical(num_data=12, num_blocks=3)
    found = traces(problem.model, problem.guide, problem.blocks[0])
    with pytest.raises(ValueError, match=r"plate_name='obs' names no pyro.plate.*plates found: \['data'\]"):
        find_data_plate(found, 12, "obs")
    # The only plate is the data plate, whatever the blocks hold (their cover is checked against it).
    assert find_data_plate(found, 13, None) == DataPlate("data", 12)

    def two_plates(idx):
        with pyro.plate("a", 5, subsample=idx[:2]), pyro.plate("b", 6, subsample=idx[:3], dim=-2):
            pass

    with pytest.raises(
        ValueError, match=r"several plates, \{'a': 5, 'b': 6\}, and none of size 12.*plate_name="
    ):
        find_data_plate([poutine.trace(two_plates).get_trace(torch.arange(4))], 12, None)


def test_monte_carlo_sites_leave_out_delta_and_enumerated_sites():
    def guide():
        pyro.sample("a", dist.Normal(0.0, 1.0))
        pyro.sample("b", dist.Delta(torch.tensor(1.0)))
        pyro.sample("c", dist.Categorical(torch.ones(3)), infer={"enumerate": "parallel"})
        pyro.sample("d", dist.Delta(torch.ones(2, 3)).to_event(2))

    assert monte_carlo_sites(poutine.trace(guide).get_trace()) == ["a"]
