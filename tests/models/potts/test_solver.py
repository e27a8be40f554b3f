"""The Potts mixture's closed-form patch solver: stationary points of the augmented
Lagrangian, monotone sweeps, and PDVI with it at the coordinate-ascent fixed point."""

import pyro
import pytest
import torch

from pyro_pdvi import PDVI, BlockProblem
from pyro_pdvi.models.gmm import GMMPrior, kmeans
from pyro_pdvi.models.potts import (
    PottsBlockSolver,
    PottsGMMModel,
    coordinate_ascent,
    potts_block_negative_elbo,
    potts_negative_elbo,
)
from pyro_pdvi.models.potts.coordinate_ascent import ColourOrder
from pyro_pdvi.spatial import knn_graph

from .helpers import small_problem


def make_problem(data, prior, graph, patches, block=1, seed=2):
    generator = torch.Generator().manual_seed(seed)
    k, d = prior.num_components, prior.dim
    indices = patches[block]
    return BlockProblem(
        blocks=torch.tensor([block]),
        indices=indices[None],
        consensus={
            "m": torch.randn(k, d, generator=generator),
            "rho": torch.randn(k, d, generator=generator) - 2,
        },
        dual={
            "m": 0.1 * torch.randn(1, k, d, generator=generator),
            "rho": 0.01 * torch.randn(1, k, d, generator=generator),
        },
        step_sizes={"m": torch.full((k, d), 0.05), "rho": torch.full((k, d), 0.5)},
        local={"alpha": torch.randn(1, len(indices), k, generator=generator)},
        num_blocks=len(patches),
        num_data=data.shape[0],
    )


@pytest.mark.parametrize("temperature", [1.0, 2.5], ids=["exact", "annealed"])
def test_solver_reaches_stationary_point_of_augmented_lagrangian(temperature):
    data, prior, graph, patches, _ = small_problem()
    problem = make_problem(data, prior, graph, patches)
    solver = PottsBlockSolver(data, prior, graph, num_sweeps=400, newton_steps=20, temperature=temperature)
    solution = solver.solve(problem)
    params = [
        solution.globals["m"].clone().requires_grad_(),
        solution.globals["rho"].clone().requires_grad_(),
    ]
    alpha = solution.local["alpha"].clone().requires_grad_()
    value = solver.augmented_lagrangian(problem, *params, alpha)
    grads = torch.autograd.grad(value.sum(), [*params, alpha])
    assert float(torch.cat([g.flatten() for g in grads]).norm()) < 1e-8
    indices = problem.indices[0]
    f_b = potts_block_negative_elbo(
        data[indices], prior, graph.subgraph(indices), params[0][0], params[1][0], alpha[0], 120
    )
    assert float(solution.loss.detach()) == pytest.approx(float(f_b.detach()), rel=1e-14)


def test_solver_sweeps_do_not_increase_augmented_lagrangian():
    data, prior, graph, patches, _ = small_problem()
    problem = make_problem(data, prior, graph, patches, block=2)
    values = []
    for sweeps in range(1, 16):
        solution = PottsBlockSolver(data, prior, graph, num_sweeps=sweeps).solve(problem)
        values.append(
            float(
                PottsBlockSolver(data, prior, graph).augmented_lagrangian(
                    problem, solution.globals["m"], solution.globals["rho"], solution.local["alpha"]
                )
            )
        )
    start = float(
        PottsBlockSolver(data, prior, graph).augmented_lagrangian(
            problem, problem.consensus["m"][None], problem.consensus["rho"][None], problem.local["alpha"]
        )
    )
    values = [start, *values]
    for before, after in zip(values, values[1:]):
        assert after <= before + 1e-12 * abs(before)
    assert values[-1] < values[0]


def test_pdvi_with_solver_reaches_coordinate_ascent_fixed_point():
    data, prior, graph, patches, _ = small_problem()
    centres, labels = kmeans(data, 3)
    init_alpha = torch.log_softmax(5.0 * torch.nn.functional.one_hot(labels, 3).double(), -1)
    reference = coordinate_ascent(data, prior, graph, init_alpha, num_iterations=5000, tol=1e-13)
    assert reference.converged
    assert bool((reference.losses.diff() <= 1e-10).all())  # coordinate ascent never goes up

    model = PottsGMMModel(data, prior, graph, init_means=centres, init_logits=init_alpha)
    pdvi = PDVI(
        model.model,
        model.guide,
        pyro.optim.Adam({"lr": 0.01}),
        model.loss,
        blocks=patches,
        eta=0.1,
        groups=[{"sites": ["rho"], "eta": 5.0}],
        solver=PottsBlockSolver(data, prior, graph, num_sweeps=15, newton_steps=10),
    )
    for _ in range(45):
        for b in range(len(patches)):
            pdvi.step(patches[b])
    store = pyro.get_param_store()
    m, rho, alpha = store["m"].detach(), store["rho"].detach(), store["alpha"].detach()
    assert torch.allclose(m, reference.m, atol=1e-10)
    assert torch.allclose(rho, reference.rho, atol=1e-10)
    assert torch.allclose(torch.softmax(alpha, -1), reference.alpha.exp(), atol=1e-10)
    objective = float(potts_negative_elbo(data, prior, graph, m, rho, alpha))
    assert objective == pytest.approx(float(reference.losses[-1]), rel=1e-10)


def test_solver_errors():
    data, prior, graph, patches, _ = small_problem()
    with pytest.raises(ValueError, match="num_sweeps"):
        PottsBlockSolver(data, prior, graph, num_sweeps=0)
    with pytest.raises(ValueError, match="temperature"):
        PottsBlockSolver(data, prior, graph, temperature=0.0)
    with pytest.raises(ValueError, match="square over the N = 10"):
        PottsBlockSolver(data[:10], prior, graph)
    problem = make_problem(data, prior, graph, patches)
    problem.local = {"logits": problem.local["alpha"]}
    with pytest.raises(ValueError, match='local param site "alpha"'):
        PottsBlockSolver(data, prior, graph).solve(problem)
    assert isinstance(prior, GMMPrior)


def test_colour_order_is_a_permutation_into_independent_contiguous_classes():
    _, _, graph, patches, _ = small_problem(num_spots=300, num_patches=1)
    colours = ColourOrder.of(graph)
    assert torch.equal(colours.order[colours.inverse], torch.arange(300))
    dense = torch.from_numpy(graph.to_scipy().toarray())
    assert torch.equal(
        torch.from_numpy(colours.graph.to_scipy().toarray()), dense[colours.order][:, colours.order]
    )
    assert [start for start, _, _ in colours.classes] == [0] + [end for _, end, _ in colours.classes[:-1]]
    permuted = dense[colours.order][:, colours.order]
    for start, end, rows in colours.classes:
        assert not bool((permuted[start:end, start:end] != 0).any())
        assert torch.equal(torch.from_numpy(rows.to_scipy().toarray()), permuted[start:end])


def test_greedy_colouring_needs_at_most_max_degree_plus_one_colours():
    coords = torch.rand(3000, 2, generator=torch.Generator().manual_seed(0))
    graph = knn_graph(coords, 8, mutual=False)
    greedy = graph.colour_classes(strategy="greedy")
    rounds = graph.colour_classes(strategy="rounds")
    dense = graph.to_scipy().tocsr()
    for classes in (greedy, rounds):
        assert torch.equal(torch.cat(classes).sort().values, torch.arange(3000))
        for nodes in classes:
            assert dense[nodes.numpy()][:, nodes.numpy()].nnz == 0
    assert len(greedy) <= int(graph.indptr.diff().max()) + 1 < len(rounds)
    with pytest.raises(ValueError, match="strategy"):
        graph.colour_classes(strategy="dsatur")
