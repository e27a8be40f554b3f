import math

import pyro
import pytest
import torch

from pyro_pdvi import PDVI, BlockProblem
from pyro_pdvi.models.gmm import GMMPrior, kmeans, prior_from_data
from pyro_pdvi.spatial import (
    PottsBlockSolver,
    PottsGMMModel,
    block_negative_elbo,
    coordinate_ascent,
    grid_patches,
    knn_graph,
    negative_elbo,
)


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


def test_negative_elbo_equals_direct_double_sum():
    data, prior, graph, patches, _ = small_problem(num_spots=40, num_patches=1)
    m, rho, alpha = random_state(prior, 40)
    assert float(negative_elbo(data, prior, graph, m, rho, alpha)) == pytest.approx(
        direct_negative_elbo(data, prior, graph, m, rho, alpha), rel=1e-13
    )


def test_block_objectives_add_up_to_patch_restricted_objective():
    data, prior, graph, patches, _ = small_problem()
    m, rho, alpha = random_state(prior, 120)
    blocks = sum(
        block_negative_elbo(data[p], prior, graph.subgraph(p), m, rho, alpha[p], 120) for p in patches
    )
    assert float(blocks) == pytest.approx(float(negative_elbo(data, prior, graph, m, rho, alpha)), rel=1e-13)


def make_problem(data, prior, graph, patches, block=1, seed=2):
    generator = torch.Generator().manual_seed(seed)
    k, d = prior.num_components, prior.dim
    indices = patches[block]
    return BlockProblem(
        block=block,
        indices=indices,
        consensus={
            "m": torch.randn(k, d, generator=generator),
            "rho": torch.randn(k, d, generator=generator) - 2,
        },
        dual={
            "m": 0.1 * torch.randn(k, d, generator=generator),
            "rho": 0.01 * torch.randn(k, d, generator=generator),
        },
        step_sizes={"m": torch.full((k, d), 0.05), "rho": torch.full((k, d), 0.5)},
        local={"alpha": torch.randn(len(indices), k, generator=generator)},
        num_blocks=len(patches),
        num_data=data.shape[0],
    )


@pytest.mark.parametrize("temperature", [1.0, 2.5], ids=["exact", "annealed"])
def test_solver_reaches_stationary_point_of_augmented_lagrangian(temperature):
    data, prior, graph, patches, _ = small_problem()
    problem = make_problem(data, prior, graph, patches)
    solver = PottsBlockSolver(data, prior, graph, num_sweeps=400, newton_steps=20, temperature=temperature)
    solution = solver(problem)
    params = [
        solution.globals["m"].clone().requires_grad_(),
        solution.globals["rho"].clone().requires_grad_(),
    ]
    alpha = solution.local["alpha"].clone().requires_grad_()
    value = solver.augmented_lagrangian(problem, *params, alpha)
    grads = torch.autograd.grad(value, [*params, alpha])
    assert float(torch.cat([g.flatten() for g in grads]).norm()) < 1e-8
    f_b = block_negative_elbo(
        data[problem.indices], prior, graph.subgraph(problem.indices), *params, alpha, 120
    )
    assert float(solution.loss.detach()) == pytest.approx(float(f_b.detach()), rel=1e-14)


def test_solver_sweeps_do_not_increase_augmented_lagrangian():
    data, prior, graph, patches, _ = small_problem()
    problem = make_problem(data, prior, graph, patches, block=2)
    values = []
    for sweeps in range(1, 16):
        solution = PottsBlockSolver(data, prior, graph, num_sweeps=sweeps)(problem)
        values.append(
            float(
                PottsBlockSolver(data, prior, graph).augmented_lagrangian(
                    problem, solution.globals["m"], solution.globals["rho"], solution.local["alpha"]
                )
            )
        )
    start = float(
        PottsBlockSolver(data, prior, graph).augmented_lagrangian(
            problem, problem.consensus["m"], problem.consensus["rho"], problem.local["alpha"]
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
        global_update="paper",
        local_solver=PottsBlockSolver(data, prior, graph, num_sweeps=15, newton_steps=10),
    )
    for _ in range(45):
        for b in range(len(patches)):
            pdvi.step(patches[b])
    store = pyro.get_param_store()
    m, rho, alpha = store["m"].detach(), store["rho"].detach(), store["alpha"].detach()
    assert torch.allclose(m, reference.m, atol=1e-10)
    assert torch.allclose(rho, reference.rho, atol=1e-10)
    assert torch.allclose(torch.softmax(alpha, -1), reference.alpha.exp(), atol=1e-10)
    objective = float(negative_elbo(data, prior, graph, m, rho, alpha))
    assert objective == pytest.approx(float(reference.losses[-1]), rel=1e-10)


def test_loss_callable_is_scaled_block_objective():
    data, prior, graph, patches, _ = small_problem()
    m, rho, alpha = random_state(prior, 120)
    model = PottsGMMModel(data, prior, graph, init_means=m, init_log_variances=rho, init_logits=alpha)
    full = model.loss(model.model, model.guide, None)
    assert float(full.detach()) == pytest.approx(
        float(negative_elbo(data, prior, graph, m, rho, alpha)), rel=1e-13
    )
    # differentiable in the param store's values, with the exact gradient
    store = pyro.get_param_store()
    grads = torch.autograd.grad(full, [store["m"], store["alpha"]])
    leaves = [m.clone().requires_grad_(), alpha.clone().requires_grad_()]
    expected = torch.autograd.grad(negative_elbo(data, prior, graph, leaves[0], rho, leaves[1]), leaves)
    for got, want in zip(grads, expected):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    p = patches[2]
    scaled = model.loss(model.model, model.guide, p).detach()
    f_b = block_negative_elbo(data[p], prior, graph.subgraph(p), m, rho, alpha[p], 120)
    assert float(scaled) == pytest.approx(float(f_b) * 120 / len(p), rel=1e-13)


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
        PottsBlockSolver(data, prior, graph)(problem)
    assert isinstance(prior, GMMPrior)
