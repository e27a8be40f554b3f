import itertools

import numpy as np
import pyro
import pytest
import torch
from pyro.infer import TraceEnum_ELBO

from pyro_pdvi import PDVI, BlockProblem
from pyro_pdvi.models.gmm import (
    GMMBlockSolver,
    GMMModel,
    GMMPrior,
    adjusted_rand_index,
    block_negative_elbo,
    cavi,
    gaussian_w2_squared,
    make_biased_gmm,
    negative_elbo,
    predictive_components,
    prior_from_data,
    wasserstein_gmm,
)


@pytest.fixture(autouse=True)
def float64_one_thread_seeded():
    # One intra-op thread: these tensors are tiny, and on a loaded machine torch's
    # thread pool makes each small op wait for a time slice.
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    yield
    pyro.clear_param_store()
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)


def small_problem(num_data=60, num_components=3, dim=2, block_size=20, seed=1):
    data = make_biased_gmm(num_data, num_components, dim, block_size, 0.9, seed=seed, separation=3.0)
    generator = torch.Generator().manual_seed(seed)
    m = 2.0 * torch.randn(num_components, dim, generator=generator)
    rho = -2.0 + 0.3 * torch.randn(num_components, dim, generator=generator)
    alpha = torch.randn(num_data, num_components, generator=generator)
    return data, m, rho, alpha


def monte_carlo_loss(gmm, *args, batches=10, particles=1000):
    """Mean and standard error of TraceEnum_ELBO's loss over batches of vectorized particles."""
    elbo = TraceEnum_ELBO(max_plate_nesting=1, num_particles=particles, vectorize_particles=True)
    values = torch.tensor([elbo.loss(gmm.model, gmm.guide, *args) for _ in range(batches)])
    return values.mean(), values.std() / batches**0.5


def gradient_norm(fn, *tensors):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    grads = torch.autograd.grad(fn(*leaves), leaves)
    return torch.cat([g.reshape(-1) for g in grads]).norm()


# ----------------------------------------------------------------------------- exact ELBO


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


# ----------------------------------------------------------------------------- CAVI


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


# ----------------------------------------------------------------------------- block solver


def block_problem(data, seed, eta_m, eta_rho, block=1):
    generator = torch.Generator().manual_seed(seed)
    num_components, dim = data.centers.shape
    indices = data.blocks[block]

    def draw(scale=1.0, shift=0.0):
        return shift + scale * torch.randn(num_components, dim, generator=generator)

    return BlockProblem(
        block=block,
        indices=indices,
        consensus={"m": draw(2.0), "rho": draw(0.5, -1.0)},
        dual={"m": draw(), "rho": draw(0.1)},
        step_sizes={
            "m": torch.full((num_components, dim), eta_m),
            "rho": torch.full((num_components, dim), eta_rho),
        },
        local={"alpha": torch.randn(len(indices), num_components, generator=generator)},
        num_blocks=len(data.blocks),
        num_data=len(data.data),
    )


@pytest.mark.parametrize("eta_m, eta_rho", [(1e-2, 1e-1), (1.0, 1.0), (100.0, 100.0), (1e-4, 1e3)])
def test_block_solver_reaches_a_stationary_point_of_the_augmented_lagrangian(eta_m, eta_rho):
    data, _, _, _ = small_problem()
    problem = block_problem(data, seed=3, eta_m=eta_m, eta_rho=eta_rho)
    solver = GMMBlockSolver(data.data, data.prior, num_sweeps=300)
    solution = solver(problem)
    m, rho, alpha = solution.globals["m"], solution.globals["rho"], solution.local["alpha"]
    assert m.shape == rho.shape == problem.consensus["m"].shape
    assert alpha.shape == problem.local["alpha"].shape
    grad = gradient_norm(lambda *p: solver.augmented_lagrangian(problem, *p), m, rho, alpha)
    assert grad < 1e-8
    block = problem.indices
    f_b = block_negative_elbo(data.data[block], data.prior, m, rho, alpha, problem.num_data)
    assert torch.equal(solution.loss, f_b)


def test_block_solver_sweeps_never_increase_the_augmented_lagrangian():
    data, _, _, _ = small_problem()
    problem = block_problem(data, seed=4, eta_m=1.0, eta_rho=1.0)
    values = []
    for sweeps in range(1, 12):
        solution = GMMBlockSolver(data.data, data.prior, num_sweeps=sweeps)(problem)
        values.append(
            GMMBlockSolver(data.data, data.prior).augmented_lagrangian(
                problem, solution.globals["m"], solution.globals["rho"], solution.local["alpha"]
            )
        )
    assert torch.stack(values).diff().max() <= 1e-10


def test_block_solver_names_missing_sites():
    data, _, _, _ = small_problem()
    problem = block_problem(data, seed=0, eta_m=1.0, eta_rho=1.0)
    problem.local = {}
    with pytest.raises(ValueError, match='local param site "alpha"'):
        GMMBlockSolver(data.data, data.prior)(problem)
    with pytest.raises(ValueError, match="num_sweeps"):
        GMMBlockSolver(data.data, data.prior, num_sweeps=0)


def test_pdvi_with_block_solver_reaches_the_cavi_optimum():
    data = make_biased_gmm(200, 3, 2, 50, 0.95, seed=2, separation=3.0)
    reference = cavi(data.data, data.prior, tol=1e-12)
    gmm = GMMModel(data.data, data.prior)
    pdvi = PDVI(
        gmm.model,
        gmm.guide,
        pyro.optim.Adam({"lr": 0.01}),
        TraceEnum_ELBO(max_plate_nesting=1),
        blocks=data.blocks,
        eta=1e-2,
        groups=[{"sites": ["rho"], "eta": 1e-1}],
        local_solver=GMMBlockSolver(data.data, data.prior),
    )
    for _ in range(40):
        for b in torch.randperm(len(data.blocks)).tolist():
            pdvi.step(data.blocks[b])
    store = pyro.get_param_store()
    reached = negative_elbo(data.data, data.prior, store["m"], store["rho"], store["alpha"]).detach()
    gap = float(reached - reference.losses[-1])
    assert -1e-6 < gap < 1e-3 * abs(float(reference.losses[-1])), gap


# ----------------------------------------------------------------------------- metrics


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


# ----------------------------------------------------------------------------- data


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
