"""The Cholesky factor of a full-covariance Gaussian global guide site by the fixed point."""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.distributions import constraints
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoMultivariateNormal

from pyro_pdvi import PDVI
from pyro_pdvi.infer.cholesky_maps import CholeskyMap, symmetric_from_lower_product
from pyro_pdvi.infer.handlers import trace_guide_at
from pyro_pdvi.infer.params import ParamStoreView
from pyro_pdvi.infer.scales import ScaleFixedPoint, find_scale_maps
from pyro_pdvi.infer.sites import GlobalLayout, find_sites

NUM_DATA = 16
DIM = 3
NOISE = 0.5
COVARIATES = torch.randn(NUM_DATA, DIM, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
COVARIATES[:, 1] += COVARIATES[:, 0]  # correlated: the posterior's correlations matter
RESPONSES = COVARIATES @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.3
ORDER = COVARIATES[:, 0].argsort()  # blocks sorted by the first covariate
COVARIATES, RESPONSES = COVARIATES[ORDER], RESPONSES[ORDER]
BLOCKS = list(torch.arange(NUM_DATA).chunk(4))


def regression(idx=None):
    """``w ~ N(0, I)``, ``y_i ~ N(x_i w, NOISE^2)``: the posterior is Gaussian, and so the optimum of
    a full-covariance Gaussian guide."""
    w = pyro.sample("w", dist.Normal(torch.zeros(DIM, dtype=torch.float64), 1.0).to_event(1))
    with pyro.plate("data", NUM_DATA, subsample=idx) as i:
        pyro.sample("y", dist.Normal((COVARIATES[i] * w).sum(-1), NOISE), obs=RESPONSES[i])


def precision_of(rows: torch.Tensor, prior_share: float = 1.0) -> torch.Tensor:
    """``-grad^2 log p`` of the rows' likelihood plus ``prior_share`` of the prior's."""
    x = COVARIATES[rows]
    return x.T @ x / NOISE**2 + prior_share * torch.eye(DIM, dtype=torch.float64)


def exact_posterior() -> tuple[torch.Tensor, torch.Tensor]:
    precision = precision_of(torch.arange(NUM_DATA))
    covariance = torch.linalg.inv(precision)
    return covariance @ COVARIATES.T @ RESPONSES / NOISE**2, covariance


def test_the_triangular_system_gives_the_symmetric_matrix_exactly():
    """``tril(H L) = R`` recovers ``H``, batched."""
    generator = torch.Generator().manual_seed(1)
    square = torch.randn(2, 5, 5, generator=generator, dtype=torch.float64)
    symmetric = square @ square.mT + torch.eye(5, dtype=torch.float64)
    other = torch.randn(2, 5, 5, generator=generator, dtype=torch.float64)
    cholesky = torch.linalg.cholesky(other @ other.mT + torch.eye(5, dtype=torch.float64))
    recovered = symmetric_from_lower_product((symmetric @ cholesky).tril(), cholesky)
    assert torch.allclose(recovered, symmetric, rtol=0, atol=1e-12)


def test_the_triangular_system_is_solved_at_a_larger_ill_conditioned_site():
    """The closed form at 40 dimensions, the Cholesky factor of a covariance whose eigenvalues span
    1e-4 to 1e4, one ``L`` broadcast over three ``R`` whose upper triangles hold large values that
    must be ignored: ``H`` to 1e-12 relative (measured: 2.5e-14; the column-by-column solve that the
    closed form replaced, 6.3e-15), exactly symmetric."""
    generator = torch.Generator().manual_seed(2)
    square = torch.randn(3, 40, 40, generator=generator, dtype=torch.float64)
    symmetric = square @ square.mT
    rotation, _ = torch.linalg.qr(torch.randn(40, 40, generator=generator, dtype=torch.float64))
    spectrum = torch.logspace(-4, 4, 40, dtype=torch.float64)
    cholesky = torch.linalg.cholesky(rotation @ torch.diag(spectrum) @ rotation.T)
    ignored = 1e6 * torch.randn(3, 40, 40, generator=generator, dtype=torch.float64).triu(1)
    recovered = symmetric_from_lower_product((symmetric @ cholesky).tril() + ignored, cholesky)
    assert torch.equal(recovered, recovered.mT)
    assert float((recovered - symmetric).norm() / symmetric.norm()) < 1e-12


def _set_up(guide):
    """The guide's map, layout and ``lambda_0`` on the first block (its params moved off the start)."""
    guide(BLOCKS[0])
    found = find_sites(regression, guide, (BLOCKS[0],), {}, NUM_DATA, None)
    layout = GlobalLayout(found.global_sites)
    point = ParamStoreView(layout, found.local_sites).consensus().detach()
    (scale_map,) = find_scale_maps(guide, found.plate, layout, point, BLOCKS[0], (), {})
    return scale_map, layout, point, found.plate


def _exact_block_gradient(guide, layout, point, plate, block, share):
    """``grad_lambda f_b`` of the terms of ``f_b`` that depend on the covariance, in closed form:
    ``tr(Lambda_b Sigma) / 2 - s_b log det L``."""
    constraints_ = {site.name: site.constraint for site in layout.sites}
    leaf = point.clone().requires_grad_()
    trace = trace_guide_at(guide, layout.unflatten(leaf), constraints_, plate.name, block, (), {})
    posterior = next(site["fn"] for name, site in trace.nodes.items() if name.endswith("_latent"))
    cholesky = posterior.scale_tril
    objective = 0.5 * (precision_of(block, share) * (cholesky @ cholesky.T)).sum()
    objective = objective - share * cholesky.diagonal().log().sum()
    (gradient,) = torch.autograd.grad(objective, leaf)
    return gradient


def _moved_automultivariatenormal():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMultivariateNormal(regression, init_scale=0.3)
    guide(BLOCKS[0])
    with torch.no_grad():
        for _, param in guide.named_parameters():
            param.add_(0.2 * torch.randn_like(param))
    return guide


def test_automultivariatenormal_maps_its_scale_and_unit_cholesky_factor_both_ways():
    """The block information from the closed-form gradient is ``Lambda_b`` (the lower triangle),
    and the values from ``sum_b Lambda_b`` put ``L`` at the posterior's Cholesky factor."""
    guide = _moved_automultivariatenormal()
    scale_map, layout, point, plate = _set_up(guide)
    assert isinstance(scale_map, CholeskyMap) and scale_map.unit
    assert scale_map.params == "AutoMultivariateNormal.scale, AutoMultivariateNormal.scale_tril"
    assert len(scale_map.coordinates) == DIM * (DIM + 1) // 2
    rows, columns = torch.tril_indices(DIM, DIM)
    share = len(BLOCKS[1]) / NUM_DATA
    gradient = _exact_block_gradient(guide, layout, point, plate, BLOCKS[1], share)
    information = scale_map.information(gradient[None], torch.tensor([share]), point)
    assert torch.allclose(
        information[0], precision_of(BLOCKS[1], share)[rows, columns], rtol=1e-12, atol=1e-12
    )
    values, usable = scale_map.values(precision_of(torch.arange(NUM_DATA))[rows, columns], point)
    moved = point.clone()
    moved[scale_map.coordinates] = values
    assert bool(usable)
    assert torch.allclose(
        scale_map.cholesky_at(moved), torch.linalg.cholesky(exact_posterior()[1]), atol=1e-14
    )
    not_definite = -precision_of(torch.arange(NUM_DATA))[rows, columns]
    values, usable = scale_map.values(not_definite, point)
    assert not bool(usable) and torch.equal(values, point[scale_map.coordinates].to(values))


def test_a_lower_cholesky_param_is_mapped_and_one_a_location_uses_is_not():
    """A hand-written guide's ``lower_cholesky`` param qualifies; the same param also moving the
    location does not (the fixed point would move the mean)."""

    def guide(idx=None, share_with_location=False):
        cholesky = pyro.param(
            "L", torch.eye(DIM, dtype=torch.float64) * 0.3, constraint=constraints.lower_cholesky
        )
        loc = pyro.param("m", torch.zeros(DIM, dtype=torch.float64))
        if share_with_location:
            loc = loc + cholesky.sum(-1)
        pyro.sample("w", dist.MultivariateNormal(loc, scale_tril=cholesky))
        with pyro.plate("data", NUM_DATA, subsample=idx):
            pass

    pyro.clear_param_store()
    scale_map, *_ = _set_up(guide)
    assert isinstance(scale_map, CholeskyMap) and not scale_map.unit and scale_map.params == "L"
    pyro.clear_param_store()
    shared = lambda idx=None: guide(idx, share_with_location=True)  # noqa: E731
    shared(BLOCKS[0])
    found = find_sites(regression, shared, (BLOCKS[0],), {}, NUM_DATA, None)
    layout = GlobalLayout(found.global_sites)
    point = ParamStoreView(layout, found.local_sites).consensus().detach()
    assert find_scale_maps(shared, found.plate, layout, point, BLOCKS[0], (), {}) == []


@pytest.mark.parametrize("loss", [Trace_ELBO(), Trace_ELBO(num_particles=8, vectorize_particles=True)])
def test_the_covariance_is_exact_after_one_epoch_and_the_run_reaches_the_posterior(loss):
    """With antithetic particles whitened jointly (``antithetic.matched_second_moment``) the block
    information of a Gaussian target is exact, so once every block has been seen the covariance
    is the posterior's (float64); the primal-dual iteration then takes the mean there. Left to
    the primal-dual iteration (``scale_update="primal_dual"``, the only way before) it is far off
    after that epoch."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMultivariateNormal(regression, init_scale=0.3)
    pdvi = PDVI(regression, guide, pyro.optim.Adam({"lr": 0.01}), loss, blocks=BLOCKS)
    mean, covariance = exact_posterior()
    for epoch in range(40):
        for block in BLOCKS:
            pdvi.step(block)
        if epoch == 0:
            first = guide.get_posterior().covariance_matrix.detach()
            assert torch.allclose(first, covariance, rtol=1e-10, atol=1e-14)
    assert pdvi.diagnostics["scale_fixed_point"]["params"] == [
        "AutoMultivariateNormal.scale, AutoMultivariateNormal.scale_tril"
    ]
    posterior = guide.get_posterior()
    assert torch.allclose(posterior.covariance_matrix.detach(), covariance, rtol=1e-10, atol=1e-14)
    assert torch.allclose(posterior.loc.detach(), mean, atol=1e-6)

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMultivariateNormal(regression, init_scale=0.3)
    pdvi = PDVI(
        regression, guide, pyro.optim.Adam({"lr": 0.01}), loss, blocks=BLOCKS, scale_update="primal_dual"
    )
    for block in BLOCKS:
        pdvi.step(block)
    error = (guide.get_posterior().covariance_matrix.detach() - covariance).norm() / covariance.norm()
    assert error > 0.05


def test_the_first_epoch_reports_a_covariance_from_the_blocks_seen():
    """From the fourth block of the first epoch the param store reports the covariance of the
    blocks' ``H_b`` seen so far (those not yet seen counted as the median seen one): closer to the
    posterior's than the guide's start, which the solves keep until every block has been seen."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMultivariateNormal(regression, init_scale=0.3)
    blocks = list(torch.arange(NUM_DATA).chunk(8))
    pdvi = PDVI(regression, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO(), blocks=blocks)
    _, covariance = exact_posterior()
    start = 0.3**2 * torch.eye(DIM, dtype=torch.float64)
    for block in blocks[:5]:
        pdvi.step(block)
    reported = guide.get_posterior().covariance_matrix.detach()
    assert (reported - covariance).norm() < 0.5 * (start - covariance).norm()
    (cholesky_map,) = pdvi._scales.maps
    held = cholesky_map.cholesky_at(pdvi._consensus_params)
    assert torch.allclose(held @ held.T, start, rtol=1e-12)


def test_one_block_s_share_of_a_correlation_does_not_hold_back_the_first_epoch_s_estimate():
    """Whether one seen block holds a site (a group's random effect, which the first epoch's
    estimate leaves at its start) is read off the precisions on ``H_b``'s diagonal: an
    off-diagonal entry, positive in one block and negative in the others, does not count."""
    guide = _moved_automultivariatenormal()
    scale_map, _, point, _ = _set_up(guide)
    fixed = ScaleFixedPoint([scale_map], 8, point)
    rows, columns = torch.tril_indices(DIM, DIM)
    for b in range(5):
        precision = torch.eye(DIM, dtype=torch.float64) * 10.0
        precision[1, 0] = precision[0, 1] = 5.0 if b == 0 else -1.0
        fixed.information[b] = precision[rows, columns]
        fixed.visits[b] = 1
    values = fixed.early_scales_at(point)
    assert not torch.allclose(values, point[scale_map.coordinates])
    moved = point.clone()
    moved[scale_map.coordinates] = values
    estimate = scale_map.cholesky_at(moved)
    expected = torch.eye(DIM, dtype=torch.float64) * 80.0
    expected[1, 0] = expected[0, 1] = 5.0 - 4.0 - 3.0  # the seen blocks, and 3 more at the median
    assert torch.allclose(estimate @ estimate.T, torch.linalg.inv(expected), rtol=1e-10)


@pytest.mark.parametrize(
    "particles, antithetic, fixed_point", [(4, "auto", False), (6, "auto", True), ("auto", False, False)]
)
def test_the_fixed_point_needs_as_many_particle_pairs_as_dimensions(particles, antithetic, fixed_point):
    """With fewer antithetic pairs than dimensions the draws cannot be whitened and ``H_b`` is not
    exact (measured: 27 pairs in 48 dimensions left the covariance 330x off): the site stays with
    the primal-dual iteration, and a warning says how many particles would do; so does a site whose
    particles are not paired. With as many pairs as dimensions it takes the fixed point."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMultivariateNormal(regression, init_scale=0.3)
    pdvi = PDVI(
        regression,
        guide,
        pyro.optim.Adam({"lr": 0.01}),
        Trace_ELBO(),
        blocks=BLOCKS,
        particles=particles,
        antithetic=antithetic,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for block in BLOCKS:
            pdvi.step(block)
    fix = "particles=6 (or more)" if antithetic == "auto" else "antithetic=True and particles=6"
    advice = [w for w in caught if fix in str(w.message)]
    assert len(advice) == (0 if fixed_point else 1)
    if advice:
        assert '"_AutoMultivariateNormal_latent" (3 dimensions)' in str(advice[0].message)
    assert ("scale_fixed_point" in pdvi.diagnostics) == fixed_point
    error = (guide.get_posterior().covariance_matrix.detach() - exact_posterior()[1]).norm()
    assert (error < 1e-10) == fixed_point


def test_pdvi_draws_two_particles_per_dimension_for_a_large_site():
    """Where PDVI draws the particles itself, a site of more dimensions than the cost rule's pairs
    (40 here, against 32 pairs at 64 particles) gets two particles per dimension, and with them the
    fixed point: the covariance is the posterior's after one epoch, without a warning."""
    size, num_data = 40, 120
    generator = torch.Generator().manual_seed(2)
    covariates = torch.randn(num_data, size, generator=generator, dtype=torch.float64)
    responses = covariates.sum(-1) + torch.randn(num_data, generator=generator, dtype=torch.float64)
    blocks = list(torch.arange(num_data).chunk(4))

    def model(idx=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(size, dtype=torch.float64), 1.0).to_event(1))
        with pyro.plate("data", num_data, subsample=idx) as i:
            pyro.sample("y", dist.Normal((covariates[i] * w).sum(-1), 1.0), obs=responses[i])

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMultivariateNormal(model, init_scale=0.3)
    pdvi = PDVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO(), blocks=blocks)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for block in blocks:
            pdvi.step(block)
    assert pdvi.solve_loss.loss.num_particles == 2 * size
    covariance = torch.linalg.inv(covariates.T @ covariates + torch.eye(size, dtype=torch.float64))
    fitted = guide.get_posterior().covariance_matrix.detach()
    assert torch.allclose(fitted, covariance, rtol=1e-9, atol=1e-13)
