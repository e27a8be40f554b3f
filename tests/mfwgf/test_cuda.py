"""On a GPU: MF-WGF runs the same code with every tensor on the device, and the Gaussian
scheme reaches the same exact optimum. Skipped without CUDA."""

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_pdvi.mfwgf import MFWGF

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")


def correlated_model():
    mean = torch.tensor([1.0, -2.0], device=CUDA)
    covariance = torch.tensor([[1.0, 0.9], [0.9, 1.0]], device=CUDA)
    pyro.sample("theta", dist.MultivariateNormal(mean, covariance))


def test_gaussian_scheme_on_cuda_is_exact():
    mf = MFWGF(correlated_model, num_particles=8, scheme="gaussian")
    # Correlation 0.9: the mean's error contracts about 30x per 100 steps (on the CPU, 2e-5
    # after 300 steps, 8e-13 after 800).
    for _ in range(800):
        mf.step()
    loc, scale = mf.gaussian_factors()["theta"]
    assert loc.device.type == "cuda"
    assert torch.allclose(loc.cpu(), torch.tensor([1.0, -2.0]), atol=1e-10)
    assert torch.allclose(scale.square().cpu(), torch.full((2,), 0.19), rtol=1e-12)


def test_langevin_on_cuda_keeps_state_on_device_and_resumes():
    mf = MFWGF(correlated_model, num_particles=1000)
    for _ in range(200):
        mf.step()
    samples = mf.get_samples()["theta"]
    assert samples.device.type == "cuda" and samples.shape == (1000, 2)
    variances = []
    for _ in range(100):  # time-averaged: standard error about 1.5%
        mf.step()
        variances.append(mf.get_samples()["theta"].var(0))
    assert torch.allclose(torch.stack(variances).mean(0).cpu(), torch.full((2,), 0.19), rtol=0.06)
    state = mf.state_dict()
    expected = [mf.step() for _ in range(3)]
    resumed = MFWGF(correlated_model, num_particles=1000)
    resumed.load_state_dict(state)
    assert [resumed.step() for _ in range(3)] == pytest.approx(expected, abs=1e-10)
