"""Synthetic biased blocks, and the empirical hyperparameters."""

import itertools

import pytest
import torch

from pyro_pdvi.models.gmm import GMMPrior, make_biased_gmm, prior_from_data


@pytest.mark.parametrize(
    "num_data, block_size, purity", [(1000, 100, 1.0), (1000, 100, 0.95), (1030, 100, 0.7), (500, 1, 1.0)]
)
def test_make_biased_gmm_blocks_partition_and_purity(num_data, block_size, purity):
    num_components = 5
    data = make_biased_gmm(num_data, num_components, 3, block_size, purity, seed=7)
    assert data.data.shape == (num_data, 3) and data.centers.shape == (num_components, 3)
    everything = torch.cat(data.blocks)
    assert torch.equal(everything.sort().values, torch.arange(num_data))
    assert all(len(b) <= block_size for b in data.blocks)
    for b, block in enumerate(data.blocks):
        counts = torch.bincount(data.labels[block], minlength=num_components)
        assert int(counts.argmax()) == b % num_components
        assert abs(float(counts.max()) / len(block) - purity) <= 0.5 / len(block) + 1e-12


def test_make_biased_gmm_is_reproducible_and_checks_arguments():
    first = make_biased_gmm(100, 2, 2, 10, 0.9, seed=3)
    second = make_biased_gmm(100, 2, 2, 10, 0.9, seed=3)
    assert torch.equal(first.data, second.data)
    assert all(torch.equal(a, b) for a, b in itertools.zip_longest(first.blocks, second.blocks))
    with pytest.raises(ValueError, match="purity"):
        make_biased_gmm(100, 2, 2, 10, 1.5)


def test_prior_from_data_with_true_labels_recovers_the_truth():
    data = make_biased_gmm(20000, 4, 3, 1000, 1.0, seed=11, separation=2.0)
    prior = prior_from_data(data.data, 4, labels=data.labels)
    assert torch.equal(prior.xi, data.data.mean(0))
    assert torch.allclose(prior.sigma0_sq, torch.ones(3), rtol=0.05)
    empirical = prior_from_data(data.data, 4)  # k-means labels
    assert empirical.num_components == 4 and bool((empirical.sigma1_sq > 0).all())


def test_prior_checks_shapes():
    with pytest.raises(ValueError, match="sigma0_sq"):
        GMMPrior(torch.zeros(2), torch.ones(3), torch.ones(2), 2)
    with pytest.raises(ValueError, match="positive"):
        GMMPrior(torch.zeros(2), torch.ones(2), torch.zeros(2), 2)
