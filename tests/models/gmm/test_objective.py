"""The mixture's closed-form negative ELBO against Pyro's own ELBO estimate, and its block shares."""

import pyro

from pyro_pdvi.models.gmm import GMMModel, block_negative_elbo, cavi, negative_elbo

from .helpers import monte_carlo_loss, small_problem


def test_negative_elbo_matches_pyro_trace_enum_elbo():
    data, m, rho, alpha = small_problem()
    gmm = GMMModel(data.data, data.prior, init_means=m, init_log_variances=rho, init_logits=alpha)
    exact = negative_elbo(data.data, data.prior, m, rho, alpha)
    mean, stderr = monte_carlo_loss(gmm)
    assert stderr > 0
    assert abs(mean - exact) < 4 * stderr, (mean, exact, stderr)


def test_block_negative_elbo_matches_pyro_on_a_block():
    data, m, rho, alpha = small_problem()
    gmm = GMMModel(data.data, data.prior, init_means=m, init_log_variances=rho, init_logits=alpha)
    block = data.blocks[1]
    exact = block_negative_elbo(data.data[block], data.prior, m, rho, alpha[block], len(data.data))
    # Pyro scales the block's local terms by N/|b|; f_b is that loss times |b|/N.
    weight = len(block) / len(data.data)
    mean, stderr = monte_carlo_loss(gmm, block)
    assert abs(weight * mean - exact) < 4 * weight * stderr, (weight * mean, exact)


def test_block_shares_add_up_to_negative_elbo():
    data, m, rho, alpha = small_problem(num_data=70, block_size=16)  # uneven last block
    total = sum(
        block_negative_elbo(data.data[b], data.prior, m, rho, alpha[b], len(data.data)) for b in data.blocks
    )
    exact = negative_elbo(data.data, data.prior, m, rho, alpha)
    assert abs(total - exact) < 1e-10


def test_collapsed_objective_is_below_mean_field():
    data, m, rho, _ = small_problem()
    fit = cavi(data.data, data.prior)
    collapsed = GMMModel(data.data, data.prior, collapsed=True, init_means=fit.m, init_log_variances=fit.rho)
    mean, stderr = monte_carlo_loss(collapsed, batches=5, particles=100)
    assert "alpha" not in pyro.get_param_store()
    assert mean < fit.losses[-1] + 4 * stderr
