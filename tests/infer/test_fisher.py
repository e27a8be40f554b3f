"""The guide's Fisher diagonal: closed form for Gaussian sites, Monte Carlo for the others."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide import (
    AutoDiagonalNormal,
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
)

from pyro_pdvi.infer import fisher as fisher_module
from pyro_pdvi.infer.fisher import fisher_diagonal, gaussian_parameters
from pyro_pdvi.infer.handlers import trace_guide_at
from pyro_pdvi.infer.params import ParamStoreView
from pyro_pdvi.infer.sites import GlobalLayout, find_sites

NUM_DATA = 12


def _fisher(model, guide, num_samples=16, seed=0):
    """``fisher_diagonal`` at the param store's values, on one block of four, by site."""
    block = torch.arange(4)
    found = find_sites(model, guide, (block,), {}, NUM_DATA, None)
    layout = GlobalLayout(found.global_sites)
    point = ParamStoreView(layout, found.local_sites).consensus()
    fisher = fisher_diagonal(guide, found.plate, layout, point, [block], (), {}, num_samples, seed)
    return layout.unflatten(fisher)


def _data_model(latents):
    data = torch.linspace(-1.0, 1.0, NUM_DATA, dtype=torch.float64)

    def model(idx=None):
        mean = latents()
        with pyro.plate("data", NUM_DATA, subsample=idx) as i:
            pyro.sample("y", dist.Normal(mean, 1.0), obs=data[i])

    return model


def test_autonormal_sites_are_exact_in_locations_and_scales():
    """``1 / sigma^2`` in a location; ``2 (dsigma/du)^2 / sigma^2`` in a scale's unconstrained
    coordinate ``u`` (AutoNormal's scales are softplus-positive), also for a positive latent,
    whose guide site is a Normal behind a transform."""

    def latents():
        a = pyro.sample("a", dist.Normal(torch.zeros(3, dtype=torch.float64), 1.0).to_event(1))
        t = pyro.sample("t", dist.LogNormal(torch.tensor(0.0, dtype=torch.float64), 1.0))
        return a.sum() * t

    pyro.clear_param_store()
    model = _data_model(latents)
    guide = AutoNormal(model, init_scale=0.3)
    guide(torch.arange(4))
    with torch.no_grad():
        pyro.get_param_store()["AutoNormal.scales.a"] = torch.tensor([0.1, 0.5, 2.0], dtype=torch.float64)
    fisher = _fisher(model, guide)
    for site in ("a", "t"):
        sigma = pyro.param(f"AutoNormal.scales.{site}").detach()
        softplus_slope = torch.sigmoid(pyro.param(f"AutoNormal.scales.{site}").unconstrained().detach())
        assert torch.allclose(fisher[f"AutoNormal.locs.{site}"], sigma.pow(-2), rtol=1e-12)
        expected = 2 * softplus_slope.square() / sigma.square()
        assert torch.allclose(fisher[f"AutoNormal.scales.{site}"], expected, rtol=1e-12)


def _autoguide_of_a_vector(guide_class, size, init_scale):
    """A model whose one latent is a vector ``a`` of ``size`` (the data's mean its sum), and
    ``guide_class`` over it, set up in a cleared param store."""

    def latents():
        return pyro.sample("a", dist.Normal(torch.zeros(size, dtype=torch.float64), 1.0).to_event(1)).sum()

    pyro.clear_param_store()
    model = _data_model(latents)
    guide = guide_class(model, init_scale=init_scale)
    guide(torch.arange(4))
    return model, guide


def test_autodiagonalnormal_is_exact_in_its_loc_too():
    """``AutoDiagonalNormal.loc`` is a plain ``nn.Parameter`` that the guide reads from itself
    (``pyro.param``'s value is ignored): the Fisher must see it through the block's values all
    the same, ``1 / sigma^2`` (it was 0, and the loc fell back to one step size for its group)."""
    model, guide = _autoguide_of_a_vector(AutoDiagonalNormal, 3, init_scale=0.3)
    with torch.no_grad():
        pyro.get_param_store()["AutoDiagonalNormal.scale"] = torch.tensor(
            [0.1, 0.5, 2.0], dtype=torch.float64
        )
    fisher = _fisher(model, guide)
    sigma = pyro.param("AutoDiagonalNormal.scale").detach()
    softplus_slope = torch.sigmoid(pyro.param("AutoDiagonalNormal.scale").unconstrained().detach())
    assert torch.allclose(fisher["AutoDiagonalNormal.loc"], sigma.pow(-2), rtol=1e-12)
    expected = 2 * softplus_slope.square() / sigma.square()
    assert torch.allclose(fisher["AutoDiagonalNormal.scale"], expected, rtol=1e-12)


def _perturbed_full_covariance_guide(guide_class):
    """``guide_class`` over a vector ``a`` of 3 and a positive ``b`` (the data's mean
    ``sum(a) * b``), its params moved off their initial values."""

    def latents():
        a = pyro.sample("a", dist.Normal(torch.zeros(3, dtype=torch.float64), 1.0).to_event(1))
        return a.sum() * pyro.sample("b", dist.LogNormal(torch.tensor(0.0, dtype=torch.float64), 1.0))

    pyro.clear_param_store()
    pyro.set_rng_seed(1)
    model = _data_model(latents)
    guide = guide_class(model, init_scale=0.5)
    guide(torch.arange(4))
    with torch.no_grad():
        for _, param in guide.named_parameters():
            param.add_(0.3 * torch.randn_like(param))
    return model, guide


def _kl_hessian_diagonal(model, guide):
    """The exact Fisher diagonal in the flat params: the Hessian of ``lambda -> KL(q_0 || q_lambda)``
    at ``lambda_0``, with the guide's latent site's distribution built from the flat params."""
    block = torch.arange(4)
    found = find_sites(model, guide, (block,), {}, NUM_DATA, None)
    layout = GlobalLayout(found.global_sites)
    point = ParamStoreView(layout, found.local_sites).consensus().detach()
    constraints_ = {site.name: site.constraint for site in layout.sites}

    def posterior(flat):
        trace = trace_guide_at(guide, layout.unflatten(flat), constraints_, found.plate.name, block, (), {})
        return next(site["fn"] for name, site in trace.nodes.items() if name.endswith("_latent"))

    fixed = posterior(point)
    hessian = torch.autograd.functional.hessian(
        lambda flat: torch.distributions.kl_divergence(fixed, posterior(flat)), point
    )
    return layout.unflatten(hessian.diagonal())


FULL_COVARIANCE_GUIDES = [
    AutoMultivariateNormal,
    lambda model, **kwargs: AutoLowRankMultivariateNormal(model, rank=2, **kwargs),
]


@pytest.mark.parametrize("guide_class", FULL_COVARIANCE_GUIDES, ids=["full", "low_rank"])
def test_full_covariance_sites_are_exact(guide_class):
    """``Sigma^-1`` in the location and ``tr(Sigma^-1 dSigma Sigma^-1 dSigma) / 2`` in the
    covariance's params (an ``AutoMultivariateNormal``'s scale and unit Cholesky factor, a
    low-rank guide's factor and diagonal), exact against the Hessian of the KL divergence.
    The Monte Carlo estimate from 16 draws moved the loc's step sizes by up to 2.6x an epoch."""
    model, guide = _perturbed_full_covariance_guide(guide_class)
    fisher = _fisher(model, guide)
    expected = _kl_hessian_diagonal(model, guide)
    for name, value in expected.items():
        assert torch.allclose(fisher[name], value, rtol=1e-10, atol=1e-12), name


def test_full_covariance_sites_of_many_outputs_take_unbiased_probes(monkeypatch):
    """Above ``EXACT_OUTPUTS`` whitened outputs, Rademacher probes: their mean over seeds
    approaches the exact diagonal."""
    model, guide = _perturbed_full_covariance_guide(AutoMultivariateNormal)
    expected = _kl_hessian_diagonal(model, guide)
    monkeypatch.setattr(fisher_module, "EXACT_OUTPUTS", 0)
    estimates = [_fisher(model, guide, seed=seed) for seed in range(100)]
    for name, value in expected.items():
        mean = torch.stack([estimate[name] for estimate in estimates]).mean(0)
        assert torch.allclose(mean, value, rtol=0.05, atol=1e-12), name
        assert not torch.allclose(estimates[0][name], value, rtol=1e-6, atol=1e-12), name


def test_a_large_full_covariance_site_takes_the_monte_carlo_estimate(monkeypatch):
    """Beyond ``DENSE_DIMENSIONS`` (no dense covariance) the score of the loc estimates
    ``diag(Sigma^-1)``."""
    monkeypatch.setattr(fisher_module, "DENSE_DIMENSIONS", 1)
    model, guide = _autoguide_of_a_vector(AutoMultivariateNormal, 2, init_scale=0.5)
    fisher = _fisher(model, guide, num_samples=2000)
    expected = torch.linalg.inv(guide.get_posterior().covariance_matrix.detach()).diagonal()
    assert torch.allclose(fisher["AutoMultivariateNormal.loc"], expected, rtol=0.1)
    assert not torch.allclose(fisher["AutoMultivariateNormal.loc"], expected, rtol=1e-3)


def test_a_log_variance_param_is_exact():
    """The GMM guide's ``q = N(m, exp(rho))``: ``exp(-rho)`` in ``m`` and exactly 1/2 in ``rho``,
    where the Monte Carlo estimate from 16 draws is off by tens of percent."""

    def latents():
        return pyro.sample("c", dist.Normal(torch.zeros(2, 2, dtype=torch.float64), 1.0).to_event(2)).sum()

    def guide(idx=None):
        m = pyro.param("m", torch.tensor([[0.0, 1.0], [2.0, -1.0]], dtype=torch.float64))
        rho = pyro.param("rho", torch.tensor([[-1.0, 0.0], [0.5, 2.0]], dtype=torch.float64))
        pyro.sample("c", dist.Normal(m, (0.5 * rho).exp()).to_event(2))
        with pyro.plate("data", NUM_DATA, subsample=idx):
            pass

    pyro.clear_param_store()
    model = _data_model(latents)
    fisher = _fisher(model, guide)
    rho = pyro.param("rho").detach()
    assert torch.allclose(fisher["m"], (-rho).exp(), rtol=1e-12)
    assert torch.allclose(fisher["rho"], torch.full_like(rho, 0.5), rtol=1e-12)


def test_other_sites_take_the_monte_carlo_estimate():
    """A Gamma guide site has no closed form here: its Fisher in (log concentration, log rate)
    is estimated, and over many draws it approaches ``alpha^2 trigamma(alpha)`` and ``alpha``."""

    def latents():
        return pyro.sample("s", dist.Gamma(torch.tensor(2.0, dtype=torch.float64), 1.0))

    def guide(idx=None):
        log_alpha = pyro.param("log_alpha", torch.tensor(0.7, dtype=torch.float64))
        log_beta = pyro.param("log_beta", torch.tensor(-0.2, dtype=torch.float64))
        pyro.sample("s", dist.Gamma(log_alpha.exp(), log_beta.exp()))
        with pyro.plate("data", NUM_DATA, subsample=idx):
            pass

    pyro.clear_param_store()
    model = _data_model(latents)
    guide()
    assert gaussian_parameters(dist.Gamma(2.0, 1.0)) is None
    fisher = _fisher(model, guide, num_samples=4000)
    alpha = pyro.param("log_alpha").detach().exp()
    assert float(fisher["log_alpha"]) == pytest.approx(float(alpha**2 * torch.polygamma(1, alpha)), rel=0.1)
    assert float(fisher["log_beta"]) == pytest.approx(float(alpha), rel=0.1)


def test_gaussian_parameters_looks_through_wrappers_without_parameters():
    loc, scale = torch.zeros(2), torch.ones(2)
    assert gaussian_parameters(dist.Normal(loc, scale).to_event(1))[0] is loc
    assert gaussian_parameters(dist.LogNormal(loc, scale))[1] is scale
    affine = dist.TransformedDistribution(
        dist.Normal(loc, scale), [torch.distributions.AffineTransform(torch.ones(2), 2.0)]
    )
    assert gaussian_parameters(affine) is None  # its loc may be a param: Monte Carlo
    folded = dist.FoldedDistribution(dist.Normal(loc, scale))
    assert gaussian_parameters(folded) is None  # not a bijection of the Normal
