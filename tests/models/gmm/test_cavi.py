"""Full-batch CAVI: monotone, and at a stationary point of the exact objective."""

import torch

from pyro_pdvi.models.gmm import cavi, negative_elbo

from .helpers import gradient_norm, small_problem


def test_cavi_decreases_and_stops_at_a_stationary_point():
    data, _, _, _ = small_problem(num_data=90, block_size=30)
    fit = cavi(data.data, data.prior, tol=1e-12)
    assert fit.converged
    assert fit.losses.diff().max() <= 1e-9
    grad = gradient_norm(lambda *p: negative_elbo(data.data, data.prior, *p), fit.m, fit.rho, fit.alpha)
    assert grad < 1e-6


def test_cavi_from_logits_matches_from_means():
    data, _, _, _ = small_problem()
    first = cavi(data.data, data.prior, tol=1e-12)
    second = cavi(data.data, data.prior, alpha=first.alpha, tol=1e-12)
    assert torch.allclose(first.losses[-1], second.losses[-1], rtol=1e-12, atol=0)
