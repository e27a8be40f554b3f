import pyro
import pytest
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_pdvi import PDVI
from pyro_pdvi.infer import swing
from pyro_pdvi.infer.swing import SEGMENTS, SwingMeter

from .test_estimate import _locations, _sorted_regression


def _walk(meter: SwingMeter, points: torch.Tensor) -> list[bool]:
    """Add each point; whether the meter said swinging after each."""
    said = []
    for point in points:
        meter.add(point)
        said.append(bool(meter.swinging()))
    return said


def _straight(steps: int) -> torch.Tensor:
    return torch.arange(steps + 1, dtype=torch.float64)[:, None] * torch.tensor([0.3, -0.1])


def _back_and_forth(steps: int, drift: float = 0.0) -> torch.Tensor:
    """A point pulled one way and back at every step (amplitude 1), drifting ``drift`` a step."""
    k = torch.arange(steps + 1, dtype=torch.float64)
    return torch.stack([(-1.0) ** k + drift * k, drift * k], 1)


def test_a_straight_walk_does_not_swing():
    """A straight walk's path is twice the distance between its halves' means."""
    assert not any(_walk(SwingMeter(20), _straight(200)))


def test_a_path_pulled_back_and_forth_swings_once_the_segments_have_passed():
    """Steps of 2 back and forth, drifting 0.01 a step: 20 blocks, segments of 2 steps; the
    path over 10 segments (20 steps, 40) against 0.2 between the halves' means (0.01 x 10 steps x
    sqrt 2): swinging, decided once every segment of the window has passed, not before."""
    said = _walk(SwingMeter(20), _back_and_forth(60, drift=0.01))
    points_to_fill = 2 * SEGMENTS  # the first point (before the first step) starts the first segment
    assert not any(said[: points_to_fill - 1])
    assert all(said[points_to_fill - 1 :])
    # A drift of 0.2 a step over the same swings makes progress: 40 against 2.8 is not 30x.
    assert not any(_walk(SwingMeter(20), _back_and_forth(60, drift=0.2)))


def test_progress_in_noise_is_not_swinging_and_noise_alone_may_be():
    """A drift of 1 a step with noise of sd 0.5 in each of 3 coordinates (100 blocks, 1,000
    steps): never flagged. Noise alone, a random walk: its path over an epoch is about sqrt(n)
    times the distance between its halves' means, so at 100 blocks it is flagged at some steps
    (measured: 16% of 4,000 in 3 coordinates), where the estimate averages out what ``lambda_0``
    follows step by step."""
    g = torch.Generator().manual_seed(0)
    steps = 0.5 * torch.randn(1000, 3, generator=g, dtype=torch.float64) + 1.0
    points = torch.cat([torch.zeros(1, 3, dtype=torch.float64), steps.cumsum(0)])
    assert not any(_walk(SwingMeter(100), points))
    noise = torch.randn(1001, 3, generator=g, dtype=torch.float64).cumsum(0)
    assert 0 < sum(_walk(SwingMeter(100), noise)) < 500


def test_ignored_coordinates_are_left_out():
    """A scale set by its fixed point jumps back and forth; the locations walk straight: not
    swinging. Only the scale moving: no path, not swinging."""
    steps = 100
    points = torch.cat([_straight(steps), _back_and_forth(steps)[:, :1] * 50], 1)
    assert not any(_walk(SwingMeter(20, ignored=torch.tensor([2])), points))
    assert any(_walk(SwingMeter(20), points))
    still = torch.cat([torch.zeros(steps + 1, 2, dtype=torch.float64), points[:, 2:]], 1)
    assert not any(_walk(SwingMeter(20, ignored=torch.tensor([2])), still))


def test_memory_is_one_sum_per_segment_and_a_loaded_meter_continues_alike():
    points = _back_and_forth(500, drift=0.001)
    meter = SwingMeter(100)
    _walk(meter, points[:333])
    assert len(meter.state_dict()["segments"]) == SEGMENTS
    copy = SwingMeter(100)
    copy.load_state_dict(meter.state_dict())
    assert _walk(copy, points[333:]) == _walk(meter, points[333:])


def test_every_path_swinging_the_store_holds_the_estimate_from_the_second_epoch_on(monkeypatch):
    """The sorted regression of ``test_estimate.py``, 10 blocks, with the threshold at 1 (every
    path swings): the store holds ``lambda_0`` in the first epoch and the estimate from its last
    step on, when every block has a copy (the meter decides after every step there, its segments
    one step long); with ``estimate_after_epochs=None``, ``lambda_0`` throughout. Where the store holds
    what, with the threshold as it is: ``test_estimate.py``."""
    monkeypatch.setattr(swing, "SWING_RATIO", 1.0)
    model, blocks, _ = _sorted_regression()

    def stored_is_iterate(after: float | None) -> list[bool]:
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        pdvi = PDVI(model, AutoNormal(model), pyro.optim.Adam({}), Trace_ELBO(), blocks=blocks)
        pdvi.estimate_after_epochs = after
        equal = []
        for _ in range(2):
            for block in blocks:
                pdvi.step(block)
                equal.append(torch.equal(*_locations(pdvi)))
        return equal

    equal = stored_is_iterate(2)
    assert all(equal[: len(blocks) - 1]) and not any(equal[len(blocks) - 1 :])
    assert all(stored_is_iterate(None))


def test_a_resumed_run_in_its_second_epoch_continues_as_the_uninterrupted_one(monkeypatch):
    """Split within the second epoch, with every path swinging (threshold 1): the meter is in the
    state_dict, and the param store after the next steps is the same to the bit."""
    monkeypatch.setattr(swing, "SWING_RATIO", 1.0)
    model, blocks, _ = _sorted_regression()

    def run(split: bool) -> torch.Tensor:
        pyro.clear_param_store()
        pyro.set_rng_seed(3)
        pdvi = PDVI(model, AutoNormal(model), pyro.optim.Adam({}), Trace_ELBO(), blocks=blocks)
        for b in list(range(len(blocks))) + [0, 1, 2]:
            pdvi.step(blocks[b])
        if split:
            state, params = pdvi.state_dict(), pyro.get_param_store().get_state()
            pyro.clear_param_store()
            pyro.get_param_store().set_state(params)
            pdvi = PDVI(model, AutoNormal(model), pyro.optim.Adam({}), Trace_ELBO(), blocks=blocks)
            pdvi.load_state_dict(state)
        for b in [3, 4, 5]:
            pdvi.step(blocks[b])
        assert not torch.equal(*_locations(pdvi))  # the estimate, in the second epoch
        return _locations(pdvi)[0]

    assert torch.equal(run(split=False), run(split=True))


@pytest.mark.parametrize("num_blocks", [1, 7, 10, 95])
def test_segments_cover_about_an_epoch(num_blocks):
    meter = SwingMeter(num_blocks)
    assert num_blocks <= meter.every * SEGMENTS < num_blocks + SEGMENTS
