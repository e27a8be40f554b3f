import numpy as np
import pytest
import torch

from pyro_pdvi.models.potts import SpatialGraph, scatter_available
from pyro_pdvi.spatial import default_num_patches, grid_patches, knn_graph, nearest_neighbours


def brute_force_edges(coords, k, mutual):
    distance = torch.cdist(coords, coords)
    distance.fill_diagonal_(float("inf"))
    nearest = distance.topk(k, largest=False).indices
    directed = torch.zeros(len(coords), len(coords), dtype=torch.bool)
    directed[torch.arange(len(coords))[:, None], nearest] = True
    return directed & directed.T if mutual else directed | directed.T


@pytest.fixture
def coords():
    return torch.rand(300, 2, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("mutual", [True, False])
def test_knn_graph_edges_match_brute_force(coords, mutual):
    graph = knn_graph(coords, num_neighbors=5, mutual=mutual)
    dense = torch.from_numpy(graph.to_scipy().toarray())
    assert torch.equal(dense > 0, brute_force_edges(coords, 5, mutual))
    assert torch.equal(dense, dense.T)
    assert graph.num_edges == int((dense > 0).sum()) // 2


def test_knn_graph_distance_weights(coords):
    graph = knn_graph(coords, num_neighbors=4, weight=2.0, bandwidth=0.05)
    rows = graph.row_of_entry
    expected = 2.0 * torch.exp(-(coords[rows] - coords[graph.indices]).square().sum(-1) / (2 * 0.05**2))
    assert torch.allclose(graph.weights, expected, rtol=1e-12, atol=0)


def test_knn_graph_repeated_coordinates_exclude_self():
    coords = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    graph = knn_graph(coords, num_neighbors=2)
    assert not bool((graph.row_of_entry == graph.indices).any())


@pytest.mark.parametrize("backend", ["sparse", "index_add"])
def test_neighbour_sum_equals_dense_matmul(coords, backend):
    graph = knn_graph(coords, num_neighbors=6, bandwidth=0.1, backend=backend)
    values = torch.randn(300, 4)
    dense = torch.from_numpy(graph.to_scipy().toarray())
    assert torch.allclose(graph.neighbour_sum(values), dense @ values, rtol=0, atol=1e-12)


@pytest.mark.skipif(not scatter_available(), reason="torch-scatter is not installed (pip install .[scatter])")
def test_scatter_backend_agrees_with_native(coords):
    graph = knn_graph(coords, num_neighbors=6, bandwidth=0.1)
    values = torch.randn(300, 4)
    native = graph.neighbour_sum(values, backend="sparse")
    assert torch.allclose(graph.neighbour_sum(values, backend="scatter"), native, rtol=0, atol=1e-12)


def test_rows_subgraph_restrict_match_dense(coords):
    graph = knn_graph(coords, num_neighbors=6)
    dense = torch.from_numpy(graph.to_scipy().toarray())
    nodes = torch.randperm(300, generator=torch.Generator().manual_seed(2))[:70]
    values = torch.randn(300, 3)
    assert torch.allclose(graph.rows(nodes).neighbour_sum(values), (dense @ values)[nodes], atol=1e-12)
    sub = graph.subgraph(nodes)
    assert torch.equal(torch.from_numpy(sub.to_scipy().toarray()), dense[nodes][:, nodes])
    patches = grid_patches(coords, 6)
    label = torch.empty(300, dtype=torch.long)
    for b, patch in enumerate(patches):
        label[patch] = b
    restricted = torch.from_numpy(graph.restrict(patches).to_scipy().toarray())
    assert torch.equal(restricted, dense * (label[:, None] == label[None, :]))


def test_colour_classes_are_independent_and_partition(coords):
    graph = knn_graph(coords, num_neighbors=8, mutual=False)
    classes = graph.colour_classes(seed=3)
    assert torch.equal(torch.cat(classes).sort().values, torch.arange(300))
    dense = torch.from_numpy(graph.to_scipy().toarray())
    for nodes in classes:
        assert not bool((dense[nodes][:, nodes] > 0).any())


def test_grid_patches_partition_near_equal():
    coords = torch.rand(1003, 2, generator=torch.Generator().manual_seed(0)) * torch.tensor([3.0, 1.0])
    patches = grid_patches(coords, 12)
    assert torch.equal(torch.cat(patches).sort().values, torch.arange(1003))
    sizes = [len(p) for p in patches]
    assert max(sizes) - min(sizes) <= 2
    # wide tissue: more columns than rows (6 x 2 for aspect 3)
    xs = torch.stack([coords[p, 0].mean() for p in patches])
    assert len(set(xs.round(decimals=1).tolist())) >= 5


def test_graph_errors(coords):
    with pytest.raises(ValueError, match="num_neighbors"):
        knn_graph(coords, num_neighbors=0)
    with pytest.raises(ValueError, match="backend"):
        knn_graph(coords, backend="cuda-magic")
    with pytest.raises(ValueError, match="num_patches"):
        grid_patches(coords, 0)
    graph = knn_graph(coords, 3)
    with pytest.raises(ValueError, match="values must have shape"):
        graph.neighbour_sum(torch.zeros(5, 2))
    with pytest.raises(ValueError, match="cover every node"):
        graph.restrict([torch.arange(10)])
    if not scatter_available():
        with pytest.raises(ValueError, match="torch-scatter"):
            SpatialGraph(graph.indptr, graph.indices, graph.weights, 300, backend="scatter")
    assert isinstance(np.asarray(graph.to_scipy().toarray()), np.ndarray)


def test_nearest_neighbours_and_graph_from_them(coords):
    distance, neighbour = nearest_neighbours(coords, 5)
    brute = torch.cdist(coords, coords).fill_diagonal_(float("inf")).topk(5, largest=False)
    assert np.allclose(distance, brute.values.numpy(), atol=1e-12)
    assert np.array_equal(np.sort(neighbour, 1), np.sort(brute.indices.numpy(), 1))
    again = knn_graph(coords, 5, neighbours=(distance, neighbour))
    assert torch.equal(again.indices, knn_graph(coords, 5).indices)


def test_default_number_of_patches():
    assert [default_num_patches(n) for n in (600, 14999, 15000, 50000, 150000, 10**7)] == [1, 1, 2, 5, 15, 25]
