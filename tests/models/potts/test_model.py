"""The Potts mixture's Pyro sites: the loss callable is the scaled exact patch objective."""

import pyro
import pytest
import torch

from pyro_pdvi.models.potts import PottsGMMModel, potts_block_negative_elbo, potts_negative_elbo

from .helpers import random_state, small_problem


def test_loss_callable_is_scaled_block_objective():
    data, prior, graph, patches, _ = small_problem()
    m, rho, alpha = random_state(prior, 120)
    model = PottsGMMModel(data, prior, graph, init_means=m, init_log_variances=rho, init_logits=alpha)
    full = model.loss(model.model, model.guide, None)
    assert float(full.detach()) == pytest.approx(
        float(potts_negative_elbo(data, prior, graph, m, rho, alpha)), rel=1e-13
    )
    # differentiable in the param store's values, with the exact gradient
    store = pyro.get_param_store()
    grads = torch.autograd.grad(full, [store["m"], store["alpha"]])
    leaves = [m.clone().requires_grad_(), alpha.clone().requires_grad_()]
    expected = torch.autograd.grad(potts_negative_elbo(data, prior, graph, leaves[0], rho, leaves[1]), leaves)
    for got, want in zip(grads, expected):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    p = patches[2]
    scaled = model.loss(model.model, model.guide, p).detach()
    f_b = potts_block_negative_elbo(data[p], prior, graph.subgraph(p), m, rho, alpha[p], 120)
    assert float(scaled) == pytest.approx(float(f_b) * 120 / len(p), rel=1e-13)
