"""The block objective's two kernels, the loop and ``vmap``, compute the same ``f_b`` and
gradients (deterministic losses, and Monte Carlo ones at shared noise)."""

import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import Trace_ELBO, TraceEnum_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoDelta, AutoNormal

from pyro_pdvi.infer.objective import BlockObjective
from pyro_pdvi.infer.sites import GlobalLayout, find_data_plate, split_param_sites
from pyro_pdvi.models.gmm import GMMModel, make_biased_gmm

from ..toy_models import LinearGaussian


def build_objective(model, guide, loss_fn, idx, randomness="different"):
    """The block objective of a model and guide (params created), with the current params."""
    guide_trace = poutine.trace(guide).get_trace(idx)
    model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(idx)
    store = pyro.get_param_store()
    unconstrained = {k: v.detach() for k, v in store.named_parameters()}
    traces = [guide_trace, model_trace]
    plate = find_data_plate(traces, len(idx), None)
    global_sites, local_sites = split_param_sites(
        traces, plate, store.get_state()["constraints"], unconstrained
    )
    layout = GlobalLayout(global_sites)
    objective = BlockObjective(model, guide, loss_fn, plate, layout, local_sites, randomness)
    return objective, unconstrained, layout, local_sites


def random_point(unconstrained, layout, local_sites, indices, spread=0.3):
    """Different copies per block, and each block's rows, near the current params."""
    m = len(indices)
    copies = {
        name: unconstrained[name] + spread * torch.randn(m, *unconstrained[name].shape)
        for name in layout.names
    }
    # Stacked as BlockProblem stacks them: (m, *rows_shape).
    rows = {
        s.name: unconstrained[s.name]
        .index_select(s.axis, indices.reshape(-1))
        .unflatten(s.axis, indices.shape)
        .movedim(s.axis - 1, 0)
        for s in local_sites
    }
    rows = {k: v + spread * torch.randn_like(v) for k, v in rows.items()}
    return copies, rows


def assert_kernels_agree(objective, indices, copies, rows, idx, seed):
    """The vectorized kernel's losses and gradients equal the loop's, block by block."""
    leaves = {k: v.clone().requires_grad_() for k, v in {**copies, **rows}.items()}
    losses = objective.bind(indices, [seed] * len(indices), (idx,), {})
    mapped = losses({k: leaves[k] for k in copies}, {k: leaves[k] for k in rows}, vectorize=True)
    grads = dict(zip(leaves, torch.autograd.grad(mapped.sum(), list(leaves.values()))))
    looped_leaves = {k: v.clone().requires_grad_() for k, v in {**copies, **rows}.items()}
    looped = losses({k: looped_leaves[k] for k in copies}, {k: looped_leaves[k] for k in rows})
    looped_grads = dict(zip(looped_leaves, torch.autograd.grad(looped.sum(), list(looped_leaves.values()))))
    torch.testing.assert_close(mapped.detach(), looped.detach(), rtol=1e-12, atol=1e-10)
    for name in leaves:
        torch.testing.assert_close(grads[name], looped_grads[name], rtol=1e-10, atol=1e-10)
    return mapped.detach()


def test_map_autodelta_losses_and_gradients_agree():
    problem = LinearGaussian()
    guide = AutoDelta(problem.model, create_plates=problem.create_plates)
    idx = torch.arange(problem.N)
    objective, unconstrained, layout, local_sites = build_objective(
        problem.model, guide, Trace_ELBO().differentiable_loss, idx
    )
    assert [s.name for s in local_sites] == ["AutoDelta.u"]
    indices = torch.stack(problem.blocks[:3])
    copies, rows = random_point(unconstrained, layout, local_sites, indices)
    assert_kernels_agree(objective, indices, copies, rows, idx, seed=3)


@pytest.mark.parametrize("saturated", [False, True], ids=["soft", "zero_probabilities"])
def test_gmm_traceenum_losses_and_gradients_agree_at_shared_noise(saturated):
    """Enumerated z, Monte Carlo c: with randomness="same" every block sees the loop's draw.

    ``zero_probabilities``: some q(z_i) put probability exactly 0 on a component, which sends
    Pyro's Dice expectation through its masked branch (the one vmap needs rewritten)."""
    data = make_biased_gmm(60, 3, 2, 15, 0.9, seed=3, separation=3.0)
    gmm = GMMModel(data.data, data.prior)
    elbo = TraceEnum_ELBO(max_plate_nesting=1, num_particles=4, vectorize_particles=True)
    idx = torch.arange(60)
    objective, unconstrained, layout, local_sites = build_objective(
        gmm.model, gmm.guide, elbo.differentiable_loss, idx, randomness="same"
    )
    indices = torch.stack(data.blocks)
    copies, rows = random_point(unconstrained, layout, local_sites, indices, spread=0.2)
    if saturated:
        rows["alpha"][:, :5, 1:] = -800.0  # exp(-800) underflows: these probabilities are 0
        assert (torch.softmax(rows["alpha"], -1) == 0).any()
    losses = assert_kernels_agree(objective, indices, copies, rows, idx, seed=11)
    assert torch.isfinite(losses).all()


def test_autonormal_different_randomness_gives_each_block_its_own_draw():
    """randomness="different": each block its own draw, all of it reproducible from one seed."""
    problem = LinearGaussian()
    guide = AutoNormal(problem.model, create_plates=problem.create_plates)
    idx = torch.arange(problem.N)
    elbo = TraceMeanField_ELBO(num_particles=4, vectorize_particles=True)
    objective, unconstrained, layout, local_sites = build_objective(
        problem.model, guide, elbo.differentiable_loss, idx
    )
    indices = torch.stack(problem.blocks[:2])
    # The same copies and rows for both blocks' data: only the noise can tell them apart.
    copies = {k: unconstrained[k].expand(2, *unconstrained[k].shape) for k in layout.names}
    rows = {s.name: unconstrained[s.name].index_select(s.axis, indices[0]).expand(2, -1) for s in local_sites}
    same_data = torch.stack([indices[0], indices[0]])
    losses = objective.bind(same_data, [5, 5], (idx,), {})
    losses(copies, rows, vectorize=True)  # the ELBO's first call guesses max_plate_nesting
    first = losses(copies, rows, vectorize=True)
    again = losses(copies, rows, vectorize=True)
    assert torch.equal(first, again)
    assert float((first[0] - first[1]).abs()) > 1e-6


def test_bound_losses_select_one_block():
    problem = LinearGaussian()
    guide = AutoDelta(problem.model, create_plates=problem.create_plates)
    idx = torch.arange(problem.N)
    objective, unconstrained, layout, local_sites = build_objective(
        problem.model, guide, Trace_ELBO().differentiable_loss, idx
    )
    indices = torch.stack(problem.blocks[:3])
    copies, rows = random_point(unconstrained, layout, local_sites, indices)
    losses = objective.bind(indices, [1, 2, 3], (idx,), {})
    all_three = losses(copies, rows)
    second = losses.select(1)({k: v[1:2] for k, v in copies.items()}, {k: v[1:2] for k, v in rows.items()})
    assert float(second) == pytest.approx(float(all_three[1]), rel=1e-14)


def test_randomness_is_checked():
    with pytest.raises(ValueError, match="Invalid randomness"):
        BlockObjective(None, None, None, None, GlobalLayout([]), [], randomness="error")
