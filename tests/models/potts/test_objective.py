"""The Potts mixture's objective against its terms written out, and its patch shares."""

import pytest
import torch

from pyro_pdvi.models.gmm import expected_log_likelihood
from pyro_pdvi.models.gmm.solver import scaled_data
from pyro_pdvi.models.potts import potts_block_negative_elbo, potts_energy, potts_negative_elbo
from pyro_pdvi.models.potts.objective import (
    global_gradient,
    likelihood_weights,
    negative_elbo_from_statistics,
    row_constants,
)

from .helpers import direct_negative_elbo, random_state, small_problem


def test_negative_elbo_equals_direct_double_sum():
    data, prior, graph, patches, _ = small_problem(num_spots=40, num_patches=1)
    m, rho, alpha = random_state(prior, 40)
    assert float(potts_negative_elbo(data, prior, graph, m, rho, alpha)) == pytest.approx(
        direct_negative_elbo(data, prior, graph, m, rho, alpha), rel=1e-13
    )


def test_block_objectives_add_up_to_patch_restricted_objective():
    data, prior, graph, patches, _ = small_problem()
    m, rho, alpha = random_state(prior, 120)
    blocks = sum(
        potts_block_negative_elbo(data[p], prior, graph.subgraph(p), m, rho, alpha[p], 120) for p in patches
    )
    assert float(blocks) == pytest.approx(
        float(potts_negative_elbo(data, prior, graph, m, rho, alpha)), rel=1e-13
    )


def test_statistics_give_the_expected_log_likelihood_block_objective_and_gradient():
    data, prior, graph, patches, _ = small_problem()
    m, rho, alpha = random_state(prior, 120)
    scaled = scaled_data(data, prior)
    ell = expected_log_likelihood(data, prior, m, rho)
    assert torch.allclose(
        scaled @ likelihood_weights(prior, m, rho).T + row_constants(data, prior)[:, None], ell
    )
    p = patches[1]
    phi = torch.softmax(alpha[p], -1)
    subgraph = graph.subgraph(p)
    weight = len(p) / 120
    value = negative_elbo_from_statistics(
        prior,
        m,
        rho,
        phi.T @ scaled[p],
        (phi * phi.log()).sum(),
        potts_energy(subgraph, phi),
        row_constants(data[p], prior).sum(),
        weight,
    )
    leaves = [m.clone().requires_grad_(), rho.clone().requires_grad_()]
    f_b = potts_block_negative_elbo(data[p], prior, subgraph, *leaves, alpha[p], 120)
    assert float(value) == pytest.approx(float(f_b.detach()), rel=1e-13)
    expected = torch.autograd.grad(f_b, leaves)
    for got, want in zip(global_gradient(prior, m, rho, phi.T @ scaled[p], weight), expected):
        assert torch.allclose(got, want, rtol=1e-11, atol=1e-11)
