"""The effect handlers PDVI runs a model under: fixed noise, served params, forced subsample."""

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from torch.distributions import constraints

from pyro_pdvi.infer.handlers import BlockSubsample, FixedNoise, ParamOverride


def test_fixed_noise_replays_the_same_draws_and_restores_the_caller_s_state():
    noise = FixedNoise(123, torch.device("cpu"))
    torch.manual_seed(0)
    with noise():
        first = torch.randn(5)
    after = torch.randn(3)
    torch.manual_seed(0)
    with noise():
        again = torch.randn(5)
    assert torch.equal(first, again)
    assert torch.equal(torch.randn(3), after)  # the caller's generator did not move
    with FixedNoise(124, torch.device("cpu"))():
        assert not torch.equal(torch.randn(5), first)


def test_param_override_serves_given_values_and_block_rows_unsliced():
    def guide(idx):
        scale = pyro.param("scale", torch.tensor(1.0), constraint=constraints.positive)
        with pyro.plate("data", 10, subsample=idx):
            rows = pyro.param("rows", torch.zeros(10), event_dim=0)
        return scale, rows

    idx = torch.tensor([2, 5, 7])
    values = {"scale": torch.tensor(0.0), "rows": torch.tensor([1.0, 2.0, 3.0])}
    override = ParamOverride(
        values, {"scale": constraints.positive, "rows": constraints.real}, frozenset({"rows"})
    )
    scale, rows = override(guide)(idx)
    assert float(scale) == 1.0  # exp(0): the value is unconstrained
    assert torch.equal(rows, values["rows"])  # the block's rows, not sliced again by the plate
    assert "scale" not in pyro.get_param_store() and "rows" not in pyro.get_param_store()


def test_block_subsample_forces_the_data_plate_and_no_other():
    def model():
        with pyro.plate("data", 10, subsample_size=3) as ind:
            pyro.sample("x", dist.Normal(0.0, 1.0))
        with pyro.plate("other", 10, subsample_size=3) as other:
            pass
        return ind, other

    block = torch.tensor([4, 0, 9])
    trace = poutine.trace(BlockSubsample("data", block)(model)).get_trace()
    ind, other = trace.nodes["_RETURN"]["value"]
    assert torch.equal(ind, block)
    assert len(other) == 3 and not torch.equal(other, block)
