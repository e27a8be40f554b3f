"""The Potts mixture's objective against its terms written out, and its patch shares."""

import pytest

from pyro_pdvi.models.potts import potts_block_negative_elbo, potts_negative_elbo

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
