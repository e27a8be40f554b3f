"""scheme="gaussian": the closed-form JKO step of diagonal Gaussian factors, exact for Gaussian targets."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide.initialization import init_to_value
from scipy.optimize import minimize

from pyro_pdvi.mfwgf import MFWGF
from pyro_pdvi.mfwgf.gaussian import gaussian_jko_step, moment_matched_normals
from pyro_pdvi.models import GMMModel, cavi, kmeans, make_biased_gmm


def gaussian_model(mean, covariance):
    """N(m, Lambda^-1); its mean-field optimum is N(m_j, 1 / Lambda_jj) in every coordinate
    [seed 001, Bishop 10.1.2]."""
    precision = torch.linalg.inv(covariance)

    def model():
        pyro.sample("theta", dist.MultivariateNormal(mean, precision_matrix=precision))

    return model, precision


def random_gaussian(dim, seed=1):
    generator = torch.Generator().manual_seed(seed)
    factor = torch.randn(dim, dim, generator=generator)
    mean = torch.randn(dim, generator=generator)
    return mean, factor @ factor.T + 0.5 * torch.eye(dim)


#: Correlation 0.9: the mean-field variances are 1 - 0.9^2 = 0.19 of the posterior's.
MEAN_2D = torch.tensor([1.0, -2.0], dtype=torch.float64)
COVARIANCE_2D = torch.tensor([[1.0, 0.9 * 0.7], [0.9 * 0.7, 0.49]], dtype=torch.float64)


def test_moment_matched_normals_have_exact_first_and_second_moments():
    generator = torch.Generator().manual_seed(0)
    full = moment_matched_normals(40, 6, generator, torch.float64, torch.device("cpu"))
    assert full.shape == (40, 6)
    assert torch.allclose(full.mean(0), torch.zeros(6), atol=1e-15)
    assert torch.allclose(full.T @ full / 40, torch.eye(6), atol=1e-13)
    few = moment_matched_normals(8, 6, generator, torch.float64, torch.device("cpu"))  # n/2 < D
    assert torch.allclose(few.mean(0), torch.zeros(6), atol=1e-15)
    assert torch.allclose(few.square().mean(0), torch.ones(6), atol=1e-13)


@pytest.mark.parametrize("grad, curvature, step", [(0.7, 2.0, 0.3), (-1.5, 0.2, 5.0), (0.0, 10.0, 0.01)])
def test_closed_form_jko_step_minimises_the_jko_objective(grad, curvature, step):
    """min over N(mu, s^2) of E_q[g (x - mu0) + a (x - mu0)^2 / 2] - log s + W2^2 / (2 tau)."""
    loc0, scale0 = 0.4, 0.8

    def objective(params):
        mu, s = params
        energy = grad * (mu - loc0) + curvature * ((mu - loc0) ** 2 + s**2) / 2
        return energy - math.log(s) + ((mu - loc0) ** 2 + (s - scale0) ** 2) / (2 * step)

    numeric = minimize(objective, [loc0, scale0], bounds=[(None, None), (1e-9, None)], tol=1e-14).x
    as_tensor = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    loc, scale = gaussian_jko_step(
        as_tensor(loc0), as_tensor(scale0), as_tensor(grad), as_tensor(curvature), as_tensor(step)
    )
    assert float(loc) == pytest.approx(numeric[0], abs=1e-6)
    assert float(scale) == pytest.approx(numeric[1], abs=1e-6)


def test_unbounded_subproblem_gives_nan():
    one = torch.ones(1, dtype=torch.float64)
    loc, scale = gaussian_jko_step(one, one, one, -2 * one, one)  # a + 1/tau = -1 < 0
    assert torch.isnan(loc).all() and torch.isnan(scale).all()


@pytest.mark.parametrize("step_size", [0.1, 1.0, 10.0, "auto"])
def test_fixed_point_is_the_exact_mean_field_optimum_for_every_step(step_size):
    """Means m and variances 1/Lambda_jj (not Sigma_jj): no bias from the time step [1, Sec. 3.2]."""
    model, precision = gaussian_model(MEAN_2D, COVARIANCE_2D)
    mf = MFWGF(model, num_particles=8, scheme="gaussian", step_size=step_size)
    for _ in range(400):
        mf.step()
    loc, scale = mf.gaussian_factors()["theta"]
    assert torch.allclose(loc, MEAN_2D, atol=1e-10)
    assert torch.allclose(scale.square(), 1 / precision.diagonal(), rtol=1e-12)
    assert torch.allclose(scale.square(), 0.19 * COVARIANCE_2D.diagonal(), rtol=1e-12)


def test_auto_step_reaches_the_optimum_in_four_dimensions():
    mean, covariance = random_gaussian(4)
    model, precision = gaussian_model(mean, covariance)
    mf = MFWGF(model, num_particles=16, scheme="gaussian")
    for _ in range(300):
        mf.step()
    loc, scale = mf.gaussian_factors()["theta"]
    assert torch.allclose(loc, mean, atol=1e-10)
    assert torch.allclose(scale.square(), 1 / precision.diagonal(), rtol=1e-12)


def test_mean_error_contracts_by_the_update_matrix():
    """mu_{k+1} - m = M (mu_k - m) with M = I - diag(tau / (1 + tau Lambda_jj)) Lambda, so the
    error shrinks at the rate of M's spectral radius."""
    mean, covariance = random_gaussian(4)
    model, precision = gaussian_model(mean, covariance)
    tau = 0.3
    mf = MFWGF(model, num_particles=16, scheme="gaussian", step_size=tau)
    errors = []
    for _ in range(60):
        mf.step()
        errors.append(mf.gaussian_factors()["theta"][0] - mean)
    update = torch.eye(4) - torch.diag(tau / (1 + tau * precision.diagonal())) @ precision
    for before, after in zip(errors[:-1], errors[1:]):
        assert torch.allclose(after, update @ before, atol=1e-13)
    radius = float(torch.linalg.eigvals(update).abs().max())
    assert 0.5 < radius < 1  # slow enough that the rate is visible
    assert float(errors[-1].norm() / errors[-2].norm()) == pytest.approx(radius, rel=1e-6)


def test_gmm_fixed_point_is_cavis():
    """The E-step of eq. 18 and the Gaussian JKO step on the centres: its fixed point is a CAVI
    fixed point (one more CAVI sweep from it changes nothing) [1, eqs. 17-20]."""
    data = make_biased_gmm(120, 3, 2, 40, 0.6, seed=0, separation=3.0)
    gmm = GMMModel(data.data, data.prior, collapsed=True)
    centres, _ = kmeans(data.data, 3)
    start = init_to_value(values={"c": centres})
    mf = MFWGF(gmm.model, num_particles=16, scheme="gaussian", init_loc_fn=start)
    for _ in range(150):
        mf.step()
    loc, scale = mf.gaussian_factors()["c"]
    sweep = cavi(data.data, data.prior, m=loc, rho=2 * scale.log(), num_iterations=1)
    assert torch.allclose(sweep.m, loc, atol=1e-10)
    assert torch.allclose(sweep.rho, 2 * scale.log(), atol=1e-10)
    assert torch.allclose(mf.local_posteriors()["z"], sweep.alpha.exp(), atol=1e-10)
    assert (loc - centres).abs().max() > 1e-3  # it moved from the k-means start
