"""``PDVI.solve_noise``: the Monte Carlo noise the block solves leave in the consensus."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_pdvi import PDVI
from pyro_pdvi.infer.particles import consensus_noise

from ..toy_models import Hierarchical


def test_consensus_noise_is_the_rms_of_the_gradient_variance_over_the_curvature():
    variance = torch.tensor([4.0, 1.0, 0.0, float("nan"), 3.0])
    curvature = torch.tensor([1.0, 4.0, -1.0, 2.0, float("inf")])
    # Usable: the first two (a non-positive or infinite curvature, a NaN variance are left out).
    assert consensus_noise(variance, curvature) == pytest.approx(math.sqrt((4.0 + 0.25) / 2))
    assert consensus_noise(torch.ones(2), torch.zeros(2)) is None


def _epochs(pdvi, blocks, num_epochs):
    for _ in range(num_epochs):
        for block in blocks:
            pdvi.step(block)


def _hierarchical_run(particles, epochs=2):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    toy = Hierarchical(num_data=40, num_blocks=4)
    pdvi = PDVI(
        toy.model, toy.auto_guide(), pyro.optim.Adam({"lr": 0.01}), TraceMeanField_ELBO(), blocks=toy.blocks,
        particles=particles,
    )  # fmt: skip
    _epochs(pdvi, toy.blocks, epochs)
    return toy, pdvi


def test_the_noise_of_the_hierarchical_normal_is_in_the_scale_of_mu_and_falls_with_the_particles():
    """Its log joint is quadratic in the latents, and antithetic pairs matched in second moment
    integrate every term of one site exactly: the gradient in the means has no noise. But the
    terms ``(theta_i - mu)^2`` hold the product of mu's and theta_i's noise, the same in both
    particles of a pair: the scale of mu (set by its fixed point from that gradient) sees noise,
    which falls as 1 / sqrt(particles)."""
    noise = {}
    for particles in (2, 32):
        toy, pdvi = _hierarchical_run(particles)
        noise[particles] = pdvi.solve_noise(toy.blocks[0], num_blocks=4)
        assert noise[particles]["AutoNormal.locs.mu"] < 1e-6
    assert noise[2]["AutoNormal.scales.mu"] > 0.1
    ratio = noise[2]["AutoNormal.scales.mu"] / noise[32]["AutoNormal.scales.mu"]
    # 1 / sqrt(particles) would be 4x (measured: 8x; four draws on four blocks estimate it, and at
    # 2 particles the curvature has noise of its own).
    assert 2.5 < ratio < 16


def test_solve_noise_leaves_the_run_as_it_was():
    toy, pdvi = _hierarchical_run(8)
    generator, torch_generator = pdvi.state_dict()["rng_state"], torch.get_rng_state()
    pdvi.solve_noise(toy.blocks[0])
    # Neither PDVI's own generator nor torch's moved.
    assert pdvi.state_dict()["rng_state"].equal(generator)
    assert torch.get_rng_state().equal(torch_generator)
    _epochs(pdvi, toy.blocks, 1)
    measured = pyro.param("AutoNormal.locs.mu").detach().clone()
    toy, pdvi = _hierarchical_run(8)
    _epochs(pdvi, toy.blocks, 1)
    assert torch.equal(pyro.param("AutoNormal.locs.mu").detach(), measured)


def test_solve_noise_needs_a_step_and_a_positive_number_of_blocks():
    toy = Hierarchical(num_data=40, num_blocks=4)
    pdvi = PDVI(toy.model, toy.auto_guide(), pyro.optim.Adam({"lr": 0.01}), Trace_ELBO(), blocks=toy.blocks)
    with pytest.raises(RuntimeError, match=r"call step\(\) at least once before solve_noise\(\)"):
        pdvi.solve_noise(toy.blocks[0])
    pdvi.step(toy.blocks[0])
    with pytest.raises(ValueError, match="num_blocks"):
        pdvi.solve_noise(toy.blocks[0], num_blocks=0)


def test_a_model_that_cannot_take_particles_says_how_many_it_was_given():
    """The fallback's warning names the particles the solves tried (64 here), not the one of the
    user's ELBO they fall back to."""
    x = torch.randn(40, 3)

    def model(idx):
        w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        with pyro.plate("data", 40, subsample=idx):
            pyro.sample("y", dist.Normal(x[idx] @ w, 1.0), obs=torch.zeros(len(idx)))

    guide = AutoNormal(model, create_plates=lambda idx: pyro.plate("data", 40, subsample=idx))
    blocks = list(torch.arange(40).chunk(4))
    pdvi = PDVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO(), blocks=blocks)
    with pytest.warns(UserWarning, match="could not vectorize the model over 64 particles"):
        pdvi.step(blocks[0])
    assert not pdvi.solve_loss.owned and pdvi.solve_loss.loss.num_particles == 1
