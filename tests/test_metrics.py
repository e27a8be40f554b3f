"""The shared scores: the mixture Wasserstein distance and the adjusted Rand index."""

import numpy as np
import pytest
import torch

from pyro_pdvi.metrics import adjusted_rand_index, gaussian_w2_squared, wasserstein_gmm
from pyro_pdvi.models.gmm import cavi, make_biased_gmm, predictive_components


def test_wasserstein_gmm_is_zero_for_identical_mixtures_and_permutation_invariant():
    generator = torch.Generator().manual_seed(0)
    means, cov = torch.randn(4, 3, generator=generator), torch.rand(4, 3, generator=generator) + 0.5
    assert wasserstein_gmm(means, cov, means, cov) == 0.0
    other_means, other_cov = means + 0.3 * torch.randn(4, 3, generator=generator), cov * 1.5
    distance = wasserstein_gmm(means, cov, other_means, other_cov)
    perm = torch.tensor([2, 0, 3, 1])
    assert distance > 0
    assert wasserstein_gmm(means, cov, other_means[perm], other_cov[perm]) == pytest.approx(
        distance, rel=1e-14
    )
    assert wasserstein_gmm(means[perm], cov[perm], other_means, other_cov) == pytest.approx(
        distance, rel=1e-14
    )


def test_wasserstein_gmm_hand_computed():
    # 1-D, components {N(0, 1), N(3, 1)} vs {N(2.5, 4), N(0.5, 1)}: matching 0 <-> 0.5 costs
    # 0.25 + 0, 3 <-> 2.5 costs 0.25 + (1 - 2)^2 = 1.25; the other matching costs
    # (2.5^2 + 1) + (2.5^2 + 0) = 13.5. MW2 = sqrt((0.25 + 1.25) / 2).
    true_means, true_var = torch.tensor([[0.0], [3.0]]), torch.tensor([1.0])
    fitted_means, fitted_var = torch.tensor([[2.5], [0.5]]), torch.tensor([[4.0], [1.0]])
    assert wasserstein_gmm(true_means, true_var, fitted_means, fitted_var) == pytest.approx(
        0.75**0.5, rel=1e-14
    )
    pairwise = gaussian_w2_squared(true_means, true_var, fitted_means, fitted_var)
    assert torch.allclose(pairwise, torch.tensor([[7.25, 0.25], [1.25, 6.25]]))


def test_wasserstein_gmm_of_cavi_fit_is_small():
    data = make_biased_gmm(600, 3, 2, 100, 1.0, seed=5, separation=5.0)
    fit = cavi(data.data, data.prior)
    distance = wasserstein_gmm(
        data.centers, data.prior.sigma0_sq, *predictive_components(data.prior, fit.m, fit.rho)
    )
    assert distance < 0.3


def test_adjusted_rand_index():
    labels = np.array([0, 0, 1, 1, 2, 2, 2])
    assert adjusted_rand_index(labels, np.array([2, 2, 0, 0, 1, 1, 1])) == pytest.approx(1.0)
    assert adjusted_rand_index(torch.tensor(labels), torch.tensor(labels + 5)) == pytest.approx(1.0)
    # Contingency [[2, 0, 0], [0, 1, 1]]: index 1, row pairs 2, column pairs 1, 6 pairs in all:
    # (1 - 2/6) / (1.5 - 2/6) = 4/7.
    assert adjusted_rand_index([0, 0, 1, 1], [0, 0, 1, 2]) == pytest.approx(4 / 7, rel=1e-14)
    # Contingency [[1, 1], [1, 1]]: index 0, row and column pairs 2: (0 - 2/3) / (2 - 2/3) = -1/2.
    assert adjusted_rand_index([0, 0, 1, 1], [0, 1, 0, 1]) == pytest.approx(-0.5, rel=1e-14)
    assert adjusted_rand_index([3, 3, 3], [1, 1, 1]) == 1.0
