"""The start of a spatial fit: neighbour averaging, Ward merging, the mixture labels and the
pseudo-likelihood Potts weight, each against a direct computation."""

import math

import numpy as np
import pytest
import torch

from pyro_pdvi.metrics import adjusted_rand_index
from pyro_pdvi.spatial import knn_graph, mixture_labels, nearest_neighbours, neighbour_average
from pyro_pdvi.spatial.init import MAX_POTTS_WEIGHT, DiagonalMixture, pseudo_likelihood_weight, ward_merge


def test_neighbour_average_is_the_mean_over_spot_and_neighbours():
    generator = torch.Generator().manual_seed(0)
    coords = torch.rand(200, 2, generator=generator, dtype=torch.float64)
    features = torch.randn(200, 3, generator=generator, dtype=torch.float64)
    neighbours = torch.from_numpy(nearest_neighbours(coords, 4)[1])
    distance = torch.cdist(coords, coords).fill_diagonal_(math.inf)
    assert torch.equal(neighbours.sort(1).values, distance.topk(4, largest=False).indices.sort(1).values)
    expected = torch.stack([features[[i, *neighbours[i].tolist()]].mean(0) for i in range(200)])
    assert torch.allclose(neighbour_average(features, neighbours), expected, rtol=0, atol=1e-14)


def test_ward_merge_equals_scipy_ward_for_single_points():
    from scipy.cluster.hierarchy import fcluster, linkage

    points = torch.randn(40, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for groups in (2, 5, 11):
        ours = ward_merge(points, torch.ones(40), groups)
        theirs = fcluster(linkage(points.numpy(), method="ward"), groups, criterion="maxclust")
        assert len(ours.unique()) == groups
        assert adjusted_rand_index(ours, torch.from_numpy(theirs)) == 1.0


def test_ward_merge_weighs_clusters_by_size_and_absorbs_empty_ones():
    centers = torch.tensor([[0.0], [1.0], [10.0], [5.0]], dtype=torch.float64)
    # Cost n_a n_b / (n_a + n_b) d^2: the empty cluster 3 goes first (cost 0), then 0 and 1
    # (1000 * 1 / 1001 * 1 < 1 * 1 / 2 * 81 ...) although 2 is a single spot.
    groups = ward_merge(centers, torch.tensor([1000.0, 1.0, 1.0, 0.0]), 2)
    assert groups[0] == groups[1] and groups[0] != groups[2]
    groups = ward_merge(centers, torch.tensor([1000.0, 1.0, 1.0, 0.0]), 3)
    assert len({int(groups[0]), int(groups[1]), int(groups[2])}) == 3


def test_diagonal_mixture_log_joint_equals_normal_log_density():
    generator = torch.Generator().manual_seed(2)
    data = torch.randn(50, 4, generator=generator, dtype=torch.float64)
    mixture = DiagonalMixture(
        torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64),
        torch.randn(3, 4, generator=generator, dtype=torch.float64),
        torch.rand(3, 4, generator=generator, dtype=torch.float64) + 0.5,
    )
    direct = (
        torch.distributions.Normal(mixture.means, mixture.variances.sqrt()).log_prob(data[:, None]).sum(-1)
    )
    assert torch.allclose(mixture.log_joint(data), direct + mixture.weights.log(), rtol=1e-13, atol=1e-12)


@pytest.mark.parametrize("sample_size", [20000, 300])
def test_mixture_labels_recover_separated_domains_of_unequal_size(sample_size):
    generator = torch.Generator().manual_seed(3)
    sizes = [1500, 300, 60, 40]
    centers = 12.0 * torch.randn(4, 5, generator=generator, dtype=torch.float64)
    truth = torch.repeat_interleave(torch.arange(4), torch.tensor(sizes))
    data = centers[truth] + torch.randn(len(truth), 5, generator=generator, dtype=torch.float64)
    labels = mixture_labels(data, 4, sample_size=sample_size)
    assert adjusted_rand_index(truth, labels) == 1.0
    assert torch.equal(labels, mixture_labels(data, 4, sample_size=sample_size))  # seeded
    # Numbered by first spot: the same labels whichever restart won, on every device.
    assert torch.equal(labels.unique_consecutive(), torch.arange(4))


def test_labels_are_numbered_by_their_first_spot():
    from pyro_pdvi.spatial.init import _numbered_by_first_spot

    labels = torch.tensor([2, 2, 0, 3, 0, 2])  # label 1 is carried by no spot: it comes last
    assert torch.equal(_numbered_by_first_spot(labels, 4), torch.tensor([0, 0, 1, 2, 1, 0]))


def pseudo_log_likelihood(beta, counts, own):
    return float((beta * own - torch.logsumexp(beta * counts, -1)).sum())


def test_pseudo_likelihood_weight_is_the_maximiser():
    generator = torch.Generator().manual_seed(4)
    coords = torch.rand(2000, 2, generator=generator, dtype=torch.float64)
    graph = knn_graph(coords, 6, dtype=torch.float64)
    labels = (coords[:, 0] * 3).long() % 3  # bands, with 10% of the labels redrawn
    noisy = torch.rand(2000, generator=generator) < 0.1
    labels[noisy] = torch.randint(3, (int(noisy.sum()),), generator=generator)
    beta = pseudo_likelihood_weight(graph, labels, 3)
    assert 0 < beta < MAX_POTTS_WEIGHT
    one_hot = torch.nn.functional.one_hot(labels, 3).double()
    counts = graph.neighbour_sum(one_hot)
    own = (counts * one_hot).sum(-1)
    probs = torch.softmax(beta * counts, -1)
    gradient = float((own - (probs * counts).sum(-1)).sum())
    assert abs(gradient) < 1e-8 * float(own.sum())
    best = pseudo_log_likelihood(beta, counts, own)
    for other in (beta - 1e-3, beta + 1e-3, 0.5 * beta, 2.0 * beta):
        assert pseudo_log_likelihood(other, counts, own) < best


def test_pseudo_likelihood_weight_of_unanimous_labels_is_the_cap():
    coords = torch.rand(300, 2, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    graph = knn_graph(coords, 6, dtype=torch.float64)
    labels = (coords[:, 0] > 2.0).long()  # all 0: every neighbour agrees
    assert pseudo_likelihood_weight(graph, labels, 2) == pytest.approx(MAX_POTTS_WEIGHT, abs=1e-5)
    assert np.isfinite(pseudo_likelihood_weight(graph, labels, 2, sample_size=50))
