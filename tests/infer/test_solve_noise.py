"""``PDVI.solve_noise``: the Monte Carlo noise the block solves leave in the consensus."""

import math
import warnings

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
    """The fallback's warning names the particles the solves tried (64 here)."""
    x = torch.randn(40, 3)

    def model(idx):
        w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        with pyro.plate("data", 40, subsample=idx):
            pyro.sample("y", dist.Normal(x[idx] @ w, 1.0), obs=torch.zeros(len(idx)))

    guide = AutoNormal(model, create_plates=lambda idx: pyro.plate("data", 40, subsample=idx))
    blocks = list(torch.arange(40).chunk(4))
    pdvi = PDVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO(), blocks=blocks)
    with pytest.warns(UserWarning, match="could not be evaluated over 64 vectorized particles"):
        pdvi.step(blocks[0])
    # They draw 8 in a loop instead, in antithetic pairs.
    loss = pdvi.solve_loss.loss
    assert pdvi.solve_loss.owned and pdvi.solve_loss.antithetic
    assert loss.num_particles == 8 and not loss.vectorize_particles


GROUPS = 4
GROUP_SIZE = 20
GROUP_OF = torch.arange(GROUPS).repeat_interleave(GROUP_SIZE)
GROUP_DATA = (
    1.0
    + torch.tensor([0.5, -0.3, 0.8, -0.6])[GROUP_OF]
    + torch.linspace(-1.5, 1.5, GROUP_SIZE).repeat(GROUPS)
)
GROUP_BLOCKS = list(torch.arange(GROUPS * GROUP_SIZE).chunk(GROUPS))


def counted_per_particle(idx):
    """``y ~ N(m + e[group], 1)`` written for one draw: under vectorized particles ``e`` (a
    ``to_event`` vector) indexed by the data puts its particles left of the data plate, and the
    observation broadcasts them against ``m``'s, so the data count once per particle."""
    m = pyro.sample("m", dist.Normal(0.0, 10.0))
    e = pyro.sample("e", dist.Normal(0.0, 1.0).expand([GROUPS]).to_event(1))
    with pyro.plate("data", len(GROUP_DATA), subsample=idx) as i:
        pyro.sample("y", dist.Normal(m[..., None] + e[..., GROUP_OF[i]], 1.0), obs=GROUP_DATA[i])


def written_for_particles(idx):
    """The same model with the group effects in a plate: it broadcasts over particles."""
    m = pyro.sample("m", dist.Normal(0.0, 10.0))
    with pyro.plate("groups", GROUPS):
        e = pyro.sample("e", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(GROUP_DATA), subsample=idx) as i:
        pyro.sample("y", dist.Normal(m + e[..., GROUP_OF[i]], 1.0), obs=GROUP_DATA[i])


def _group_pdvi(model, loss):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    return PDVI(model, AutoNormal(model), pyro.optim.Adam({"lr": 0.01}), loss, blocks=GROUP_BLOCKS)


def _group_posterior() -> tuple[torch.Tensor, torch.Tensor]:
    """The exact posterior means of ``(m, e)`` and their mean-field sds ``1 / sqrt(precision_ii)``
    (the model is linear-Gaussian, so the mean-field optimum has the posterior's means)."""
    design = torch.cat([torch.ones(len(GROUP_DATA), 1), torch.nn.functional.one_hot(GROUP_OF)], 1).double()
    precision = design.T @ design + torch.diag(torch.tensor([10.0**-2] + [1.0] * GROUPS)).double()
    return torch.linalg.solve(precision, design.T @ GROUP_DATA.double()), precision.diag().rsqrt()


def test_a_model_that_counts_the_data_once_per_particle_is_solved_with_looped_particles():
    """Under PDVI's 64 vectorized particles the model's first block loss is 64 times its data
    term: PDVI finds it at the warm-up and draws 8 particles in a loop, in antithetic pairs. Its
    optimum is then the user's: with the vectorized particles the sd of q(m) was 8x too small."""
    pdvi = _group_pdvi(counted_per_particle, Trace_ELBO())
    with pytest.warns(UserWarning, match="broadcasts against the particle dimension") as record:
        _epochs(pdvi, GROUP_BLOCKS, 1)
    assert any("draw 8 particle(s) in a loop" in str(w.message) for w in record)
    loss = pdvi.solve_loss.loss
    assert pdvi.solve_loss.owned and pdvi.solve_loss.antithetic
    assert loss.num_particles == 8 and not loss.vectorize_particles
    _epochs(pdvi, GROUP_BLOCKS, 14)
    means, sds = _group_posterior()
    fitted_means = torch.cat([pyro.param("AutoNormal.locs.m").reshape(1), pyro.param("AutoNormal.locs.e")])
    fitted_sds = torch.cat([pyro.param("AutoNormal.scales.m").reshape(1), pyro.param("AutoNormal.scales.e")])
    assert ((fitted_means.double() - means) / sds).abs().max() < 0.1
    assert ((fitted_sds.double() / sds) - 1).abs().max() < 0.15


def test_the_same_model_written_for_particles_keeps_them_vectorized(recwarn):
    pdvi = _group_pdvi(written_for_particles, Trace_ELBO())
    pdvi.step(GROUP_BLOCKS[0])
    assert not any("particle dimension" in str(w.message) for w in recwarn)
    assert pdvi.solve_loss.loss.vectorize_particles and pdvi.solve_loss.loss.num_particles > 8


def test_the_users_own_particles_that_count_the_data_twice_are_reported():
    """Where the particles are the user's, PDVI says so and keeps them: Pyro's SVI with that
    loss minimises the same."""
    user_loss = Trace_ELBO(num_particles=4, vectorize_particles=True)
    pdvi = _group_pdvi(counted_per_particle, user_loss)
    with pytest.warns(UserWarning, match="Pyro's SVI with this loss counts the same"):
        pdvi.step(GROUP_BLOCKS[0])
    assert pdvi.solve_loss.loss is user_loss


def test_a_resumed_looped_run_continues_as_the_uninterrupted_one():
    """The looped particles are chosen again at the resumed run's first step: the same params
    to the last digit."""

    def run(split: bool) -> torch.Tensor:
        pdvi = _group_pdvi(counted_per_particle, Trace_ELBO())
        with pytest.warns(UserWarning):
            _epochs(pdvi, GROUP_BLOCKS, 2)
        if split:
            state, params = pdvi.state_dict(), pyro.get_param_store().get_state()
            pyro.clear_param_store()
            pyro.get_param_store().set_state(params)
            model = counted_per_particle
            pdvi = PDVI(
                model, AutoNormal(model), pyro.optim.Adam({"lr": 0.01}), Trace_ELBO(), blocks=GROUP_BLOCKS
            )
            pdvi.load_state_dict(state)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _epochs(pdvi, GROUP_BLOCKS, 1)
        assert not pdvi.solve_loss.loss.vectorize_particles
        return torch.cat([pyro.param("AutoNormal.locs.e"), pyro.param("AutoNormal.scales.e")]).detach()

    assert torch.equal(run(split=False), run(split=True))
