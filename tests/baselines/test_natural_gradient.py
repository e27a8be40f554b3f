import pytest
import torch

from pyro_pdvi.baselines import GMMNaturalGradientSVI
from pyro_pdvi.models.gmm import cavi, conjugate_update, expected_log_likelihood, make_biased_gmm


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def problem(num_data=60, num_components=3, dim=2, block_size=20, separation=3.0, seed=1):
    synthetic = make_biased_gmm(
        num_data, num_components, dim, block_size, 0.9, seed=seed, separation=separation
    )
    generator = torch.Generator().manual_seed(seed)
    m = synthetic.centers + 0.5 * torch.randn(num_components, dim, generator=generator)
    rho = -2.0 + 0.3 * torch.randn(num_components, dim, generator=generator)
    return synthetic, m, rho


@pytest.mark.parametrize("schedule", [{"step_size": 1.0}, {"tau": 1.0, "kappa": 0.7}], ids=["constant", "rm"])
def test_full_batch_unit_step_is_one_cavi_sweep(schedule):
    synthetic, m, rho = problem()
    svi = GMMNaturalGradientSVI(synthetic.data, synthetic.prior, m, rho, **schedule)
    assert svi.current_step_size() == 1.0
    svi.step(torch.arange(synthetic.data.shape[0]))
    sweep = cavi(synthetic.data, synthetic.prior, m=m, rho=rho, num_iterations=1)
    torch.testing.assert_close(svi.m, sweep.m, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(svi.rho, sweep.rho, rtol=1e-13, atol=1e-13)


def test_block_step_replicates_the_block():
    # lambda_hat is the conjugate update of the block repeated N/|b| times; a step of
    # size s is the convex combination of natural parameters (precision, precision*(m - xi)).
    synthetic, m, rho = problem()
    data, prior, block = synthetic.data, synthetic.prior, synthetic.blocks[1]
    step = 0.3
    svi = GMMNaturalGradientSVI(data, prior, m, rho, step_size=step)
    svi.step(block)

    replicas = data.shape[0] // block.numel()
    phi = torch.softmax(expected_log_likelihood(data[block], prior, m, rho), -1)
    m_hat, rho_hat = conjugate_update(data[block].repeat(replicas, 1), prior, phi.repeat(replicas, 1))
    precision = (1 - step) * (-rho).exp() + step * (-rho_hat).exp()
    shift = (1 - step) * (-rho).exp() * (m - prior.xi) + step * (-rho_hat).exp() * (m_hat - prior.xi)
    torch.testing.assert_close(svi.rho, -precision.log(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(svi.m, prior.xi + shift / precision, rtol=1e-12, atol=1e-12)


def test_robbins_monro_schedule():
    synthetic, m, rho = problem()
    svi = GMMNaturalGradientSVI(synthetic.data, synthetic.prior, m, rho, tau=2.0, kappa=0.6)
    for t in range(4):
        assert svi.current_step_size() == pytest.approx((t + 2.0) ** -0.6, rel=1e-15)
        svi.step(synthetic.blocks[t % len(synthetic.blocks)])
    assert svi.num_steps == 4


def test_cavi_optimum_is_a_fixed_point_of_every_full_batch_step():
    synthetic, m, rho = problem()
    optimum = cavi(synthetic.data, synthetic.prior, m=m, rho=rho, num_iterations=5000, tol=1e-14)
    assert optimum.converged
    for step_size in (0.1, 0.5, 1.0):
        svi = GMMNaturalGradientSVI(
            synthetic.data, synthetic.prior, optimum.m, optimum.rho, step_size=step_size
        )
        svi.step(torch.arange(synthetic.data.shape[0]))
        torch.testing.assert_close(svi.m, optimum.m, rtol=0, atol=1e-12)
        torch.testing.assert_close(svi.rho, optimum.rho, rtol=0, atol=1e-12)


def test_constant_step_full_batch_converges_to_the_cavi_fixed_point():
    # Damped CAVI: same fixed points, reached here from the same start.
    synthetic, m, rho = problem()
    everything = torch.arange(synthetic.data.shape[0])
    optimum = cavi(synthetic.data, synthetic.prior, m=m, rho=rho, num_iterations=5000, tol=1e-14)
    svi = GMMNaturalGradientSVI(synthetic.data, synthetic.prior, m, rho, step_size=0.5)
    for _ in range(200):
        svi.step(everything)
    torch.testing.assert_close(svi.m, optimum.m, rtol=0, atol=1e-10)
    torch.testing.assert_close(svi.rho, optimum.rho, rtol=0, atol=1e-10)


def test_step_returns_the_scaled_block_loss():
    from pyro_pdvi.models.gmm import negative_elbo

    synthetic, m, rho = problem()
    everything = torch.arange(synthetic.data.shape[0])
    svi = GMMNaturalGradientSVI(synthetic.data, synthetic.prior, m, rho, step_size=0.5)
    alpha = torch.log_softmax(expected_log_likelihood(synthetic.data, synthetic.prior, m, rho), -1)
    expected = float(negative_elbo(synthetic.data, synthetic.prior, m, rho, alpha))
    assert svi.step(everything) == pytest.approx(expected, rel=1e-13)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"step_size": 0.0}, "step_size"),
        ({"step_size": 1.5}, "step_size"),
        ({"tau": 0.5}, "tau"),
        ({"kappa": 0.5}, "kappa"),
        ({"kappa": 1.2}, "kappa"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    synthetic, m, rho = problem()
    with pytest.raises(ValueError, match=match):
        GMMNaturalGradientSVI(synthetic.data, synthetic.prior, m, rho, **kwargs)


def test_bad_shapes_and_indices():
    synthetic, m, rho = problem()
    data, prior = synthetic.data, synthetic.prior
    with pytest.raises(ValueError, match="m must have shape"):
        GMMNaturalGradientSVI(data, prior, m[:2], rho)
    with pytest.raises(ValueError, match="rho must have shape"):
        GMMNaturalGradientSVI(data, prior, m, rho[:, :1])
    with pytest.raises(ValueError, match="data must have shape"):
        GMMNaturalGradientSVI(data[:, :1], prior, m, rho)
    svi = GMMNaturalGradientSVI(data, prior, m, rho)
    with pytest.raises(ValueError, match="range"):
        svi.step(torch.tensor([0, data.shape[0]]))
    with pytest.raises(ValueError, match="LongTensor"):
        svi.step(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="LongTensor"):
        svi.step(torch.tensor([], dtype=torch.long))
