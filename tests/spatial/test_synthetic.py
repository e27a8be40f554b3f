import itertools
import math

import pytest
import scipy.sparse
import torch

from pyro_pdvi.models.potts import SpatialGraph
from pyro_pdvi.spatial import knn_graph
from pyro_pdvi.spatial.synthetic import (
    critical_beta,
    gibbs_sweeps,
    lattice_graph,
    make_irregular_data,
    make_potts_data,
)


def test_gibbs_sweeps_sample_the_exact_potts_law():
    """30000 independent triangles (one block-diagonal graph) against the enumerated law."""
    num_triangles, num_states, beta = 30000, 3, 0.8
    weights = torch.tensor([[0.0, 1.0, 0.5], [1.0, 0.0, 2.0], [0.5, 2.0, 0.0]], dtype=torch.float64)
    block = scipy.sparse.csr_matrix(weights.numpy())
    graph = SpatialGraph.from_scipy(
        scipy.sparse.kron(scipy.sparse.identity(num_triangles), block), dtype=torch.float64
    )
    generator = torch.Generator().manual_seed(0)
    start = torch.randint(num_states, (3 * num_triangles,), generator=generator)
    labels = gibbs_sweeps(graph, start, num_states, beta, 25, generator).view(num_triangles, 3)

    states = list(itertools.product(range(num_states), repeat=3))
    energy = torch.tensor(
        [sum(weights[i, j] * (s[i] == s[j]) for i in range(3) for j in range(i + 1, 3)) for s in states]
    )
    exact = torch.softmax(beta * energy, 0)
    codes = labels[:, 0] * 9 + labels[:, 1] * 3 + labels[:, 2]
    empirical = torch.bincount(codes, minlength=27).double() / num_triangles
    standard_error = (exact * (1 - exact) / num_triangles).sqrt()
    assert bool(((empirical - exact).abs() < 4.5 * standard_error).all())


def test_lattice_graph_degrees():
    graph = lattice_graph(4, 3)
    degrees = graph.degrees().view(4, 3)
    assert degrees[0, 0] == 2 and degrees[1, 1] == 4 and degrees[0, 1] == 3
    assert graph.num_edges == 4 * 2 + 3 * 3
    assert critical_beta(2) == pytest.approx(math.log(1 + math.sqrt(2)))


@pytest.mark.parametrize("layout", ["scattered", "lattice"])
def test_make_potts_data_truth_and_features(layout):
    data = make_potts_data(4000, 6, 5, layout=layout, separation=3.0, seed=3)
    again = make_potts_data(4000, 6, 5, layout=layout, separation=3.0, seed=3)
    assert torch.equal(data.data, again.data) and torch.equal(data.labels, again.labels)
    assert data.coords.shape == (4000, 2) and data.data.shape == (4000, 5)
    assert data.labels.min() >= 0 and data.labels.max() < 6
    assert len(data.labels.unique()) >= 4
    graph = knn_graph(data.coords, 6)
    same = (data.labels[graph.row_of_entry] == data.labels[graph.indices]).double().mean()
    assert same > 0.8  # spatially coherent domains (independent labels would give about 1/6)
    residual = data.data - data.centers[data.labels]
    # x_i - c_{zeta_i} ~ N(0, I): mean within 5 standard errors, variance within 5 of its errors
    assert residual.mean(0).abs().max() < 5 / math.sqrt(4000)
    assert (residual.var(0) - 1).abs().max() < 5 * math.sqrt(2 / 4000)
    assert torch.equal(data.prior.sigma1_sq, torch.full((5,), 9.0))


def test_make_potts_data_errors():
    with pytest.raises(ValueError, match="num_domains"):
        make_potts_data(100, 0, 2)
    with pytest.raises(ValueError, match="layout"):
        make_potts_data(100, 2, 2, layout="hexagonal")
    with pytest.raises(ValueError, match="beta"):
        make_potts_data(100, 2, 2, beta=-1.0)


@pytest.mark.parametrize("kind", ["voronoi", "layers"])
def test_make_irregular_data_domains_and_features(kind):
    data = make_irregular_data(4000, 6, 5, kind=kind, separation=3.0, seed=3)
    again = make_irregular_data(4000, 6, 5, kind=kind, separation=3.0, seed=3)
    assert torch.equal(data.data, again.data) and torch.equal(data.labels, again.labels)
    assert data.coords.shape == (4000, 2) and data.coords.min() >= 0 and data.coords.max() <= math.sqrt(4000)
    assert torch.bincount(data.labels, minlength=6).min() > 0
    graph = knn_graph(data.coords, 6)
    same = (data.labels[graph.row_of_entry] == data.labels[graph.indices]).double().mean()
    assert same > 0.85
    residual = data.data - data.centers[data.labels]
    assert residual.mean(0).abs().max() < 5 / math.sqrt(4000)
    assert (residual.var(0) - 1).abs().max() < 5 * math.sqrt(2 / 4000)
    if kind == "layers":  # bands: the domain never falls as the bent height grows
        side = math.sqrt(4000)
        height = data.coords[:, 1] + 0.08 * side * torch.sin(3 * math.pi * data.coords[:, 0] / side)
        assert bool((data.labels[height.argsort()].diff() >= 0).all())


def test_make_irregular_data_errors():
    with pytest.raises(ValueError, match="kind"):
        make_irregular_data(100, 2, 2, kind="hexagons")
    with pytest.raises(ValueError, match="cells_per_domain"):
        make_irregular_data(100, 2, 2, cells_per_domain=0)
