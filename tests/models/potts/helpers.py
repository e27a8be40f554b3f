"""A small Potts mixture on random spots, and the objective written out term by term."""

import math

import torch

from pyro_pdvi.models.gmm import prior_from_data
from pyro_pdvi.spatial import grid_patches, knn_graph


def small_problem(num_spots=120, num_components=3, dim=2, num_patches=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    coords = torch.rand(num_spots, 2, generator=generator)
    labels = (coords[:, 0] > 0.5).long() + (coords[:, 1] > 0.6).long()
    centres = 2.0 * torch.randn(num_components, dim, generator=generator)
    data = centres[labels % num_components] + torch.randn(num_spots, dim, generator=generator)
    prior = prior_from_data(data, num_components)
    patches = grid_patches(coords, num_patches)
    graph = knn_graph(coords, num_neighbors=5, weight=0.7, bandwidth=0.3).restrict(patches)
    return data, prior, graph, patches, labels


def direct_negative_elbo(data, prior, graph, m, rho, alpha):
    """App. C.1 term by term with explicit loops over spots, components, coordinates and edges."""
    phi = torch.softmax(alpha, -1)
    n, d = data.shape
    k_count = m.shape[0]
    s2 = rho.exp()
    total = 0.0
    for i in range(n):
        for k in range(k_count):
            a = sum(
                0.5
                * (
                    math.log(2 * math.pi * prior.sigma0_sq[j])
                    + ((data[i, j] - m[k, j]) ** 2 + s2[k, j]) / prior.sigma0_sq[j]
                )
                for j in range(d)
            )
            total += phi[i, k] * (a + math.log(phi[i, k]) + math.log(k_count))  # (A), (D), -E log(1/K)
    for k in range(k_count):
        for j in range(d):
            total += 0.5 * (
                math.log(2 * math.pi * prior.sigma1_sq[j])
                + ((m[k, j] - prior.xi[j]) ** 2 + s2[k, j]) / prior.sigma1_sq[j]
            )  # (B)
            total += -0.5 * math.log(2 * math.pi * s2[k, j]) - 0.5  # (E)
    dense = graph.to_scipy().toarray()
    for i in range(n):
        for j in range(i + 1, n):
            if dense[i, j] != 0:
                total -= dense[i, j] * float(phi[i] @ phi[j])  # (C) without log Z
    return float(total)


def random_state(prior, num_spots, seed=1):
    generator = torch.Generator().manual_seed(seed)
    k, d = prior.num_components, prior.dim
    return (
        torch.randn(k, d, generator=generator),
        torch.randn(k, d, generator=generator) - 1.0,
        torch.randn(num_spots, k, generator=generator),
    )
