"""MFWGF's contract: results in constrained space, Predictive, state round trips,
refused non-finite steps, and errors that name the site or argument."""

import io

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Predictive
from pyro.infer.autoguide.initialization import init_to_value

from pyro_pdvi.errors import NonFiniteStepError
from pyro_pdvi.mfwgf import MFWGF
from pyro_pdvi.models import GMMModel, make_biased_gmm


def constrained_model(data):
    """A Dirichlet (simplex, 3 -> 2 unconstrained), a LogNormal scale and a plated Gamma."""
    weights = pyro.sample("weights", dist.Dirichlet(torch.ones(3)))
    scale = pyro.sample("scale", dist.LogNormal(0.0, 1.0))
    with pyro.plate("groups", 4):
        rate = pyro.sample("rate", dist.Gamma(2.0, 2.0))
    loc = weights[..., 0] + rate.sum(-1, keepdim=True)
    with pyro.plate("data", data.shape[0]):
        pyro.sample("obs", dist.Normal(loc, scale), obs=data)


def regression(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pyro.plate("data", x.shape[0]):
        return pyro.sample("y", dist.Normal(w[..., 0] + w[..., 1] * x, sigma), obs=y)


def regression_data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(30, generator=generator, dtype=torch.float64)
    return x, 0.5 + 2 * x + 0.3 * torch.randn(30, generator=generator, dtype=torch.float64)


@pytest.mark.parametrize("scheme", ["langevin", "ula", "gaussian"])
def test_samples_are_constrained_with_site_shapes(scheme):
    data = torch.randn(10, dtype=torch.float64)
    mf = MFWGF(constrained_model, num_particles=50, scheme=scheme)
    losses = mf.run(5, data, progress_bar=False)
    assert len(losses) == 5 and all(isinstance(loss, float) for loss in losses)
    assert mf.num_steps == 5
    samples = mf.get_samples()
    assert {name: tuple(v.shape) for name, v in samples.items()} == {
        "weights": (50, 3),
        "scale": (50,),
        "rate": (50, 4),
    }
    assert torch.allclose(samples["weights"].sum(-1), torch.ones(50))
    assert (samples["weights"] > 0).all() and (samples["scale"] > 0).all() and (samples["rate"] > 0).all()
    assert {name: tuple(v.shape) for name, v in mf.step_sizes.items()} == {
        "weights": (2,),
        "scale": (),
        "rate": (4,),
    }


def test_predictive_runs_with_the_samples():
    x, y = regression_data()
    mf = MFWGF(regression, num_particles=100)
    for _ in range(50):
        mf.step(x, y)
    samples = mf.get_samples()
    predictive = Predictive(regression, posterior_samples=samples, return_sites=["w", "sigma", "y"])(x)
    assert predictive["y"].shape == (100, 30)
    assert torch.equal(predictive["w"].reshape(samples["w"].shape), samples["w"])
    residual = (predictive["y"] - y).mean(0)  # the fit predicts the data
    assert residual.abs().mean() < 0.3


def test_step_returns_the_exact_negative_elbo_of_the_gaussian_scheme():
    """For a Gaussian target the moment-matched energy is exact, so at the optimum the loss is
    KL(q* || p) = (sum_j log Lambda_jj - log det Lambda) / 2."""
    covariance = torch.tensor([[1.0, 0.5], [0.5, 2.0]], dtype=torch.float64)
    precision = torch.linalg.inv(covariance)

    def model():
        pyro.sample("theta", dist.MultivariateNormal(torch.zeros(2), covariance))

    mf = MFWGF(model, num_particles=8, scheme="gaussian")
    for _ in range(200):
        loss = mf.step()
    exact = 0.5 * (precision.diagonal().log().sum() - torch.logdet(precision))
    assert loss == pytest.approx(float(exact), abs=1e-12)


def run_and_record(mf, steps, *args):
    for _ in range(steps):
        mf.step(*args)
    return torch.cat([v.reshape(mf.num_particles, -1) for v in mf.get_samples().values()], -1)


@pytest.mark.parametrize("scheme", ["langevin", "ula", "gaussian"])
def test_state_dict_resumes_the_same_trajectory(scheme):
    x, y = regression_data()
    original = MFWGF(regression, num_particles=40, scheme=scheme)
    run_and_record(original, 5, x, y)
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    pyro.set_rng_seed(123)  # the global RNG does not drive the trajectory
    torch.manual_seed(7)
    expected = run_and_record(original, 5, x, y)

    resumed = MFWGF(regression, num_particles=40, scheme=scheme)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer))  # before the first step: waits for it
    pyro.set_rng_seed(99)
    torch.manual_seed(99)
    if scheme == "gaussian":  # its samples are fresh draws: compare the factors
        run_and_record(resumed, 5, x, y)
        for name, (loc, scale) in original.gaussian_factors().items():
            assert torch.allclose(resumed.gaussian_factors()[name][0], loc, atol=1e-10, rtol=0)
            assert torch.allclose(resumed.gaussian_factors()[name][1], scale, atol=1e-10, rtol=0)
    else:
        assert torch.allclose(run_and_record(resumed, 5, x, y), expected, atol=1e-10, rtol=0)
    assert resumed.num_steps == original.num_steps == 10


def test_load_state_dict_rewinds_a_running_engine():
    x, y = regression_data()
    mf = MFWGF(regression, num_particles=40)
    run_and_record(mf, 3, x, y)
    state = mf.state_dict()
    first = run_and_record(mf, 4, x, y)
    mf.load_state_dict(state)
    assert torch.allclose(run_and_record(mf, 4, x, y), first, atol=1e-10, rtol=0)


@pytest.mark.filterwarnings("ignore:Encountered NaN")
def test_a_non_finite_step_is_refused_and_changes_nothing():
    def model(shift):
        x = pyro.sample("x", dist.Normal(0.0, 1.0))
        pyro.factor("shift", shift * x)

    mf = MFWGF(model, num_particles=20)
    twin = MFWGF(model, num_particles=20)
    pyro.set_rng_seed(0)
    mf.step(torch.tensor(0.5))
    pyro.set_rng_seed(0)
    twin.step(torch.tensor(0.5))
    before = mf.get_samples()["x"].clone()
    with pytest.raises(NonFiniteStepError, match="nothing was changed"):
        mf.step(torch.tensor(float("inf")))  # infinite log-density: the step is not finite
    with pytest.raises(ValueError, match="log_factor"):
        mf.step(torch.tensor(float("nan")))  # Pyro's own argument check inside the model
    assert torch.equal(mf.get_samples()["x"], before) and mf.num_steps == 1
    mf.step(torch.tensor(0.5))
    twin.step(torch.tensor(0.5))  # the refused step did not advance the generator either
    assert torch.equal(mf.get_samples()["x"], twin.get_samples()["x"])


def test_discrete_site_without_enumeration_is_named():
    data = make_biased_gmm(30, 2, 2, 10, 0.5, seed=0)
    gmm = GMMModel(data.data, data.prior)  # z sampled, not enumerated, in the model
    mf = MFWGF(gmm.model, num_particles=10)
    with pytest.raises(ValueError, match='site "z" is discrete.*enumerate'):
        mf.step()


def test_model_without_latent_site_is_refused():
    def model():
        pyro.sample("obs", dist.Normal(0.0, 1.0), obs=torch.tensor(0.3))

    with pytest.raises(ValueError, match="no continuous latent sample site.*obs"):
        MFWGF(model, num_particles=10).step()


def test_model_that_does_not_broadcast_over_particles_is_named():
    def model(x):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with pyro.plate("data", 3):
            pyro.sample("y", dist.Normal(w[..., :1] * x, 1.0), obs=x)

    with pytest.raises(ValueError, match='site "y".*particle'):
        MFWGF(model, num_particles=10).step(torch.ones(3))


def test_too_small_max_plate_nesting_is_refused():
    x, y = regression_data()
    with pytest.raises(ValueError, match="max_plate_nesting=0 is below the 1"):
        MFWGF(regression, num_particles=10, max_plate_nesting=0).step(x, y)
    mf = MFWGF(regression, num_particles=10, max_plate_nesting=2)  # more is allowed
    mf.step(x, y)
    assert mf.get_samples()["w"].shape == (10, 2)


def test_coupled_discrete_sites_are_refused():
    def model():
        loc = pyro.sample("loc", dist.Normal(0.0, 1.0))
        a = pyro.sample("a", dist.Bernoulli(0.5), infer={"enumerate": "parallel"})
        b = pyro.sample("b", dist.Bernoulli(0.5), infer={"enumerate": "parallel"})
        pyro.sample("obs", dist.Normal(loc + a + b, 1.0), obs=torch.tensor(1.0))

    with pytest.raises(ValueError, match=r"depends on the enumerated sites \['a', 'b'\]"):
        MFWGF(model, num_particles=10).step()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_particles": 0}, "num_particles"),
        ({"num_particles": 1}, "num_particles"),
        ({"num_particles": 2.5}, "num_particles"),
        ({"num_particles": True}, "num_particles"),
        ({"num_particles": 7, "scheme": "gaussian"}, "even"),
        ({"step_size": -1.0}, "step_size"),
        ({"step_size": 0}, "step_size"),
        ({"step_size": float("inf")}, "step_size"),
        ({"step_size": "fast"}, "step_size"),
        ({"scheme": "svgd"}, "scheme"),
        ({"factors": "blocks"}, "factors"),
        ({"num_draws": 0}, "num_draws"),
        ({"step_fraction": 2.5}, "step_fraction"),
        ({"init_scale": 0.0}, "init_scale"),
        ({"max_plate_nesting": -1}, "max_plate_nesting"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MFWGF(regression, **kwargs)


@pytest.mark.parametrize(
    "factors, message",
    [
        (["w", "nope"], '"nope", which is not a continuous latent site'),
        ([["w"], ["w", "sigma"]], 'site "w" is in factors'),
    ],
)
def test_bad_factors_are_named_at_the_first_step(factors, message):
    x, y = regression_data()
    mf = MFWGF(regression, num_particles=10, factors=factors)
    with pytest.raises(ValueError, match=message):
        mf.step(x, y)
    with pytest.raises(RuntimeError, match="call step"):
        mf.get_samples()


def test_factor_layouts():
    x, y = regression_data()
    layouts = {}
    for factors in ["coordinate", "site", [["w", "sigma"]], ["w"]]:
        mf = MFWGF(regression, num_particles=10, factors=factors)
        mf.step(x, y)
        layouts[str(factors)] = mf.factor_layout.names
    assert layouts == {
        "coordinate": ("w[0]", "w[1]", "sigma"),
        "site": ("w", "sigma"),
        "[['w', 'sigma']]": ("w+sigma",),
        "['w']": ("w", "sigma"),
    }


def test_state_of_another_scheme_is_refused():
    x, y = regression_data()
    mf = MFWGF(regression, num_particles=10)
    mf.step(x, y)
    other = MFWGF(regression, num_particles=10, scheme="ula")
    other.step(x, y)
    with pytest.raises(ValueError, match='scheme "langevin"'):
        other.load_state_dict(mf.state_dict())
    with pytest.raises(ValueError, match="gaussian"):
        mf.gaussian_factors()


def test_auto_step_sizes_are_measured_again_as_the_factor_moves():
    """A Gamma(2, 3) site in log space has curvature 3 exp(u): started at u = log 20 it is 60,
    at the mode u = log(2/3) it is 2. The step follows at steps 8, 16, ... and not between."""

    def model():
        pyro.sample("rate", dist.Gamma(2.0, 3.0))

    start = init_to_value(values={"rate": torch.tensor(20.0, dtype=torch.float64)})
    mf = MFWGF(model, num_particles=200, init_loc_fn=start, init_scale=0.01)
    mf.step()
    first = float(mf.step_sizes["rate"])
    assert first == pytest.approx(0.25 / 60, rel=0.05)
    for _ in range(7):
        mf.step()
    assert float(mf.step_sizes["rate"]) == first  # steps 1-7 keep it
    for _ in range(100):
        mf.step()
    assert float(mf.step_sizes["rate"]) > 10 * first  # near the mode the factor is 30x less curved
    fixed = MFWGF(model, num_particles=200, init_loc_fn=start, init_scale=0.01, remeasure=False)
    for _ in range(20):
        fixed.step()
    assert float(fixed.step_sizes["rate"]) == pytest.approx(first, rel=0.05)
