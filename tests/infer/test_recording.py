"""Graph replay's recorder (:mod:`pyro_pdvi.infer.recording`): a compiled recording equals the
recorded function to the last bit, in value, gradient and the draws it makes, after common
subexpressions and dead code are dropped, and drops neither a draw nor a write."""

import pytest
import torch

from pyro_pdvi.infer.recording import DataDependentError, Recorder


def record(function, *inputs):
    """``function(*inputs)`` run under a recorder from a fixed generator state: its value, the
    simplified program, and the generator's state after the run."""
    torch.manual_seed(7)
    recorder = Recorder(list(inputs))
    with recorder:
        value = function(*inputs)
    return value, recorder.program(value), torch.get_rng_state()


def replay(program, *inputs):
    """The compiled program on ``inputs`` from the recording's generator state."""
    torch.manual_seed(7)
    value = program.compile()(*inputs)
    return value, torch.get_rng_state()


def test_repeated_operations_merged_dead_ones_dropped_draws_kept():
    def function(x):
        x.sin()  # dead, pure: dropped
        torch.randn(3)  # dead, but a draw: kept, or the next draw would shift
        noise = torch.randn(3)
        return (x.exp() * noise).sum() + (x.exp() * noise).sum()

    x = torch.tensor([0.1, -0.4, 2.0], dtype=torch.float64, requires_grad=True)
    value, program, state = record(function, x)
    ops = [step.op.__name__ for step in program.steps if step is not None]
    assert ops.count("randn.default") == 2 and ops.count("exp.default") == 1
    assert "sin.default" not in ops and ops.count("mul.Tensor") == 1
    replayed, replayed_state = replay(program, x)
    assert torch.equal(replayed, value) and torch.equal(replayed_state, state)
    (gradient,) = torch.autograd.grad(value, x)
    (replayed_gradient,) = torch.autograd.grad(replayed, x)
    assert torch.equal(replayed_gradient, gradient)


def test_noise_drawn_in_place_into_fresh_tensors_is_not_merged():
    """``empty(...).normal_()``, as torch.distributions draws: two equal ``empty`` calls are two
    tensors, each written once."""

    def function(x):
        first = torch.empty(4, dtype=x.dtype).normal_()
        second = torch.empty(4, dtype=x.dtype).normal_()
        return (x * first).sum() + (x * second).sum() + (x * first).sum()

    x = torch.ones(4, dtype=torch.float64)
    value, program, state = record(function, x)
    replayed, replayed_state = replay(program, x)
    assert torch.equal(replayed, value) and torch.equal(replayed_state, state)
    ops = [step.op.__name__ for step in program.steps if step is not None]
    assert ops.count("empty.memory_format") == 2 and ops.count("normal_.default") == 2
    assert ops.count("mul.Tensor") == 2  # the repeated x * first merged


def test_a_write_that_a_view_sees_keeps_every_operation():
    """``view + 1`` before and after a write to the viewed tensor are different values: a program
    with such a write is not merged."""

    def function(x):
        y = x * 1.0
        view = y[:2]
        before = view + 1.0
        y.add_(1.0)
        after = view + 1.0
        return before.sum() * 10.0 + after.sum()

    x = torch.tensor([1.0, 2.0, 3.0])
    value, program, _ = record(function, x)
    replayed, _ = replay(program, x)
    assert torch.equal(replayed, value)
    assert float(value) == pytest.approx(5.0 * 10.0 + 7.0)


def test_numbers_of_other_types_are_other_operations():
    """``pow(x, 2)`` and ``pow(x, 2.0)`` of an integer tensor differ in dtype: never merged."""

    def function(x):
        return torch.stack([x.pow(2).to(torch.float64), x.pow(2.0).to(torch.float64)]).sum()

    x = torch.tensor([1, 2, 3])
    value, program, _ = record(function, x)
    replayed, _ = replay(program, x)
    assert torch.equal(replayed, value)
    pows = [step for step in program.steps if step is not None and "pow" in str(step.op)]
    assert len(pows) == 2


def test_output_read_by_a_later_kept_operation_is_returned():
    """The returned tensor is kept alive past its last read (a draw made after it)."""

    def function(x):
        out = x.exp()
        torch.normal(out, 1.0)  # a draw that reads it: kept, and the last reader of ``out``
        return out

    x = torch.tensor([0.5, 1.5])
    value, program, state = record(function, x)
    replayed, replayed_state = replay(program, x)
    assert torch.equal(replayed, value) and torch.equal(replayed_state, state)


def test_operations_with_several_outputs():
    def function(x):
        parts = x.split(2)
        largest, where = x.max(0)
        return parts[0].sum() * parts[1].prod() + largest * where

    x = torch.tensor([0.3, -1.2, 0.8, 2.5], dtype=torch.float64, requires_grad=True)
    value, program, _ = record(function, x)
    replayed, _ = replay(program, x)
    assert torch.equal(replayed, value)
    assert torch.equal(torch.autograd.grad(replayed, x)[0], torch.autograd.grad(value, x)[0])


def test_constants_and_inputs_are_kept_apart():
    """A tensor that is not an input (data) is the program's constant; the inputs are its
    arguments, so a replay at other inputs follows them and keeps the constant."""
    data = torch.tensor([1.0, 2.0, 3.0])

    def function(x):
        return ((data - x) ** 2).sum()

    value, program, _ = record(function, torch.tensor(0.5))
    assert torch.equal(program.compile()(torch.tensor(0.5)), value)
    assert float(program.compile()(torch.tensor(1.0))) == pytest.approx(5.0)


def test_reading_a_value_in_python_cannot_be_recorded():
    def function(x):
        return x * 2.0 if float(x.sum()) > 0 else x

    with pytest.raises(DataDependentError, match="read a tensor's value"):
        record(function, torch.ones(2))
