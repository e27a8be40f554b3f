"""``PDVI.run``: epochs over the blocks, the order, the callback, the losses it returns."""

import pyro
import pytest
import torch
from pyro.infer import TraceMeanField_ELBO

from pyro_pdvi import PDVI, GenericSolver, RunResult

from ..toy_models import Hierarchical


def make_pdvi(problem, guide=None):
    return PDVI(
        problem.model,
        guide or problem.guide,
        pyro.optim.Adam({"lr": 0.05}),
        TraceMeanField_ELBO(num_particles=4, vectorize_particles=True),
        blocks=problem.blocks,
        eta=0.5,
        solver=GenericSolver(inner_steps=5),
    )


def record_blocks(pdvi):
    """The block ids of every step the PDVI takes."""
    visited = []
    original = pdvi._step

    def recording(block_ids, args, kwargs):
        visited.append(block_ids.tolist())
        return original(block_ids, args, kwargs)

    pdvi._step = recording
    return visited


def test_cyclic_epochs_visit_every_block_in_order_and_return_the_mean_step_loss():
    problem = Hierarchical(num_data=20, num_blocks=4)
    pdvi = make_pdvi(problem)
    visited = record_blocks(pdvi)
    step_losses = []
    original = pdvi._step
    pdvi._step = lambda *a: step_losses.append(original(*a)) or step_losses[-1]
    result = pdvi.run(3, None, order="cyclic", progress_bar=False)
    assert isinstance(result, RunResult) and result.losses.shape == (3,)
    assert visited == [[0], [1], [2], [3]] * 3
    assert pdvi.num_steps == 12
    expected = torch.tensor(step_losses).reshape(3, 4).mean(1)
    torch.testing.assert_close(result.losses, expected, rtol=1e-14, atol=0)


def test_shuffled_epochs_are_permutations_drawn_from_pdvi_s_own_generator():
    problem = Hierarchical(num_data=20, num_blocks=4)
    pdvi = make_pdvi(problem)
    visited = record_blocks(pdvi)
    pdvi.run(5, None, progress_bar=False)
    epochs = [sorted(sum(visited[4 * e : 4 * e + 4], [])) for e in range(5)]
    assert all(epoch == [0, 1, 2, 3] for epoch in epochs)
    assert len({tuple(sum(visited[4 * e : 4 * e + 4], [])) for e in range(5)}) > 1  # the order changes

    # After set-up, draws from torch's generator (here, in the callback) do not change the order.
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    again = make_pdvi(problem)
    repeat = record_blocks(again)
    again.run(5, None, progress_bar=False, callback=lambda epoch, loss: torch.randn(7) is None)
    assert repeat == visited


def test_run_equals_the_same_steps_by_hand():
    """PDVI sets the data plate's subsample itself: ``run(data)`` is ``step(blocks[b])`` in its
    order (cyclic here: a shuffled order also draws from the generator that seeds the noise)."""
    problem = Hierarchical(num_data=20, num_blocks=4)
    pdvi = make_pdvi(problem)
    losses = pdvi.run(2, None, order="cyclic", progress_bar=False).losses
    by_run = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    by_hand = make_pdvi(problem)
    step_losses = [by_hand.step(problem.blocks[b]) for _ in range(2) for b in range(4)]
    torch.testing.assert_close(losses, torch.tensor(step_losses).reshape(2, 4).mean(1), rtol=1e-14, atol=0)
    for name, value in pyro.get_param_store().items():
        assert torch.equal(value.detach(), by_run[name]), name


def test_subsample_arg_passes_the_block_indices():
    problem = Hierarchical(num_data=20, num_blocks=4)
    seen = []

    def model(idx):
        seen.append(idx)
        return problem.model(idx)

    pdvi = PDVI(
        model,
        problem.guide,
        pyro.optim.Adam({"lr": 0.05}),
        TraceMeanField_ELBO(num_particles=4, vectorize_particles=True),
        blocks=problem.blocks,
        eta=0.5,
        solver=GenericSolver(inner_steps=3),
    )
    pdvi.run(1, order="cyclic", progress_bar=False, subsample_arg="idx")
    passed = [idx for idx in seen if idx is not None]
    assert passed and all(any(torch.equal(idx, block) for block in problem.blocks) for idx in passed)


def test_callback_sees_every_epoch_and_can_stop_the_run(capsys):
    problem = Hierarchical(num_data=20, num_blocks=4)
    pdvi = make_pdvi(problem)
    calls = []

    def callback(epoch, loss):
        calls.append((epoch, loss))
        return epoch == 2

    result = pdvi.run(10, None, callback=callback, progress_bar=True)
    assert [epoch for epoch, _ in calls] == [1, 2]
    assert result.losses.tolist() == [loss for _, loss in calls]
    assert pdvi.num_steps == 8
    assert "PDVI" in capsys.readouterr().err  # the tqdm bar


@pytest.mark.parametrize(
    "kwargs, match",
    [({"num_epochs": 0}, "Invalid num_epochs"), ({"num_epochs": 1, "order": "random"}, "Invalid order")],
)
def test_run_argument_errors(kwargs, match):
    problem = Hierarchical(num_data=20, num_blocks=4)
    pdvi = make_pdvi(problem)
    num_epochs = kwargs.pop("num_epochs")
    with pytest.raises(ValueError, match=match):
        pdvi.run(num_epochs, None, progress_bar=False, **kwargs)
    assert pdvi.num_steps == 0


def test_a_run_pinned_by_a_tiny_step_size_warns_that_it_has_not_converged():
    """The issue's logistic-regression symptom on the hierarchical model: a step size far too
    small pins every copy to a consensus that creeps; the residual is tiny, the gradient not."""
    problem = Hierarchical(num_data=20, num_blocks=4)
    pdvi = PDVI(
        problem.model,
        problem.guide,
        pyro.optim.Adam({"lr": 0.05}),
        TraceMeanField_ELBO(num_particles=8, vectorize_particles=True),
        blocks=problem.blocks,
        eta=1e-5,
        solver=GenericSolver(inner_steps=5),
    )
    with pytest.warns(UserWarning, match=r"(?s)PDVI.run has not converged.*step sizes \{'default': 1e-05\}"):
        result = pdvi.run(6, None, progress_bar=False)
    assert result.gradient_norms.shape == (6,) and not result.gradient_norms.isnan().any()
    assert float(result.gradient_norms[-1]) > 0.9 * float(result.gradient_norms[0])
    assert result.noise_level is not None and 3 * result.noise_level < float(result.gradient_norms[-1])


def test_a_converged_run_records_a_vanishing_gradient_and_does_not_warn(recwarn):
    """The App. C.3 quadratic (deterministic): the gradient norm falls to zero at a linear rate."""
    from pyro_pdvi.models.quadratic import Quadratic

    problem = Quadratic(num_data=12, num_blocks=4, scale_b=1.0)
    pdvi = PDVI(
        problem.model,
        problem.guide,
        pyro.optim.Adam({"lr": 0.1}),
        problem.loss,
        blocks=problem.blocks,
        solver=GenericSolver(inner_steps=30),
    )
    result = pdvi.run(40, subsample_arg="idx", progress_bar=False)
    assert not [w for w in recwarn if "has not converged" in str(w.message)]
    norms = result.gradient_norms
    assert float(norms[-1]) < 1e-7 * float(norms[0])
    assert result.noise_level == 0.0  # a deterministic objective has no Monte Carlo noise
