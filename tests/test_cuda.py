"""On a GPU: the batched closed-form solver gives the CPU result, queues without host
synchronisation, and a PDVI step keeps all of its state on the device. Skipped without CUDA."""

import pyro
import pytest
import torch
from pyro.distributions import constraints
from pyro.infer import Trace_ELBO, TraceEnum_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_pdvi import PDVI, BlockProblem
from pyro_pdvi.infer import upkeep
from pyro_pdvi.models.gmm import GMMBlockSolver, GMMModel, make_biased_gmm

from .infer.test_solve_noise import GROUP_BLOCKS, GROUP_DATA, GROUP_OF, GROUPS, _group_posterior
from .infer.test_whitening import CorrelatedRegression, SiteIntercepts, SiteSlopes, error, fit
from .toy_models import intercepts_and_slopes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")


def to_cuda(value):
    if isinstance(value, dict):
        return {k: to_cuda(v) for k, v in value.items()}
    return value.to(CUDA)


def block_batch(data, block_ids, seed):
    generator = torch.Generator().manual_seed(seed)
    num_components, dim = data.centers.shape
    indices = torch.stack([data.blocks[b] for b in block_ids])
    count = len(block_ids)
    return BlockProblem(
        blocks=torch.tensor(block_ids),
        indices=indices,
        consensus={
            "m": 2.0 * torch.randn(num_components, dim, generator=generator),
            "rho": torch.randn(num_components, dim, generator=generator) - 1.0,
        },
        dual={
            "m": torch.randn(count, num_components, dim, generator=generator),
            "rho": 0.1 * torch.randn(count, num_components, dim, generator=generator),
        },
        step_sizes={
            "m": torch.full((num_components, dim), 0.1),
            "rho": torch.full((num_components, dim), 1.0),
        },
        local={"alpha": torch.randn(count, indices.shape[1], num_components, generator=generator)},
        num_blocks=len(data.blocks),
        num_data=len(data.data),
    )


@pytest.mark.parametrize("tol", [0.0, 1e-7])
def test_closed_form_solve_on_cuda_equals_cpu(tol):
    data = make_biased_gmm(4000, 4, 5, 500, 0.9, seed=1, separation=3.0)
    batch = block_batch(data, [0, 2, 3, 5, 7], seed=2)
    cpu = GMMBlockSolver(data.data, data.prior, num_sweeps=20, tol=tol).solve(batch)
    cuda_batch = BlockProblem(
        blocks=batch.blocks,
        indices=batch.indices.to(CUDA),
        consensus=to_cuda(batch.consensus),
        dual=to_cuda(batch.dual),
        step_sizes=to_cuda(batch.step_sizes),
        local=to_cuda(batch.local),
        num_blocks=batch.num_blocks,
        num_data=batch.num_data,
    )
    solver = GMMBlockSolver(data.data.to(CUDA), data.prior, num_sweeps=20, tol=tol)
    gpu = solver.solve(cuda_batch)
    for name in ("m", "rho"):
        assert gpu.globals[name].device.type == "cuda"
        torch.testing.assert_close(gpu.globals[name].cpu(), cpu.globals[name], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gpu.local["alpha"].cpu(), cpu.local["alpha"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gpu.loss.cpu(), cpu.loss, rtol=1e-12, atol=0)


def test_closed_form_solve_on_cuda_does_not_synchronise():
    data = make_biased_gmm(2000, 3, 4, 500, 0.9, seed=3)
    batch = block_batch(data, [0, 1, 2, 3], seed=4)
    cuda_batch = BlockProblem(
        blocks=batch.blocks,
        indices=batch.indices.to(CUDA),
        consensus=to_cuda(batch.consensus),
        dual=to_cuda(batch.dual),
        step_sizes=to_cuda(batch.step_sizes),
        local=to_cuda(batch.local),
        num_blocks=batch.num_blocks,
        num_data=batch.num_data,
    )
    solver = GMMBlockSolver(data.data.to(CUDA), data.prior)
    solver.solve(cuda_batch)  # caches the prior on the device
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        solution = solver.solve(cuda_batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(solution.loss.cpu()).all()


@pytest.mark.parametrize("blocks_per_step", [1, 3])
def test_pdvi_step_keeps_its_state_on_cuda(blocks_per_step):
    data = make_biased_gmm(600, 3, 2, 100, 0.9, seed=3, separation=3.0)
    on_cuda = data.data.to(CUDA)
    prior = data.prior.to(torch.float64, CUDA)
    blocks = [b.to(CUDA) for b in data.blocks]
    gmm = GMMModel(on_cuda, prior)
    pdvi = PDVI(
        gmm.model,
        gmm.guide,
        pyro.optim.Adam({"lr": 0.01}),
        TraceEnum_ELBO(max_plate_nesting=1),
        blocks=blocks,
        eta=1e-2,
        groups=[{"sites": ["rho"], "eta": 1e-1}],
        solver=GMMBlockSolver(on_cuda, prior),
        global_update="paper",
    )
    for start in range(0, len(blocks), blocks_per_step):
        loss = pdvi.step(torch.cat(blocks[start : start + blocks_per_step]))
        assert isinstance(loss, float)
    state = pdvi.state
    for name in ("duals", "copies", "consensus", "step_sizes", "dual_mean", "copy_mean"):
        assert getattr(state, name).device.type == "cuda", name
    for name, value in pyro.get_param_store().named_parameters():
        assert value.device.type == "cuda", name
    for name, value in pdvi.diagnostics.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            assert value.device.type == "cuda", name


def test_generic_step_with_the_categorical_update_keeps_its_state_on_cuda():
    """The default generic solve of the mixture, with the closed-form update of q(z)'s logits
    (pyro_pdvi.infer.local_cavi) and the scales' fixed point, runs on the device and leaves its
    state there."""
    data = make_biased_gmm(600, 3, 2, 100, 0.9, seed=3, separation=3.0)
    on_cuda = data.data.to(CUDA)
    gmm = GMMModel(on_cuda, data.prior.to(torch.float64, CUDA))
    blocks = [b.to(CUDA) for b in data.blocks]
    loss = TraceEnum_ELBO(max_plate_nesting=1, num_particles=4, vectorize_particles=True)
    pdvi = PDVI(gmm.model, gmm.guide, pyro.optim.Adam({"lr": 0.01}), loss, blocks=blocks)
    for block in blocks:
        assert isinstance(pdvi.step(block), float)
    assert pdvi._categorical_rows == ("alpha",)
    # Every block seen: the log-variances were set by their fixed point (pyro_pdvi.infer.scales).
    assert pdvi.diagnostics["scale_fixed_point"]["params"] == ["rho"]
    assert pdvi.state_dict()["scales"]["information"].device.type == "cuda"
    assert pdvi.state.consensus.device.type == "cuda"
    for name, value in pyro.get_param_store().named_parameters():
        assert value.device.type == "cuda", name


def test_batched_lbfgs_on_cuda_equals_cpu_without_synchronising():
    """Per-block L-BFGS of separable quadratics: no host read inside the loop on CUDA, and
    the CPU's iterates (same algorithm, same float64 arithmetic up to rounding)."""
    from pyro_pdvi.infer import batched_lbfgs

    generator = torch.Generator().manual_seed(0)
    num_blocks, size = 6, 12
    factors = torch.randn(num_blocks, size, size, generator=generator, dtype=torch.float64)
    hessians = factors @ factors.mT + torch.eye(size, dtype=torch.float64)
    targets = torch.randn(num_blocks, size, generator=generator, dtype=torch.float64)

    def run(a, t):
        def objective(x):
            d = x - t
            return 0.5 * (d.unsqueeze(1) @ a @ d.unsqueeze(-1)).reshape(-1)

        return batched_lbfgs(objective, torch.zeros_like(t), 60)

    cpu = run(hessians, targets)
    # The copies to the device synchronise: made before the check, which covers the loop.
    on_device = hessians.to(CUDA), targets.to(CUDA)
    run(*on_device)  # warm-up: kernels and allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = run(*on_device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(result.x.cpu(), targets, rtol=0, atol=1e-8)
    torch.testing.assert_close(result.x.cpu(), cpu.x, rtol=0, atol=1e-10)


def test_coupled_random_effects_keep_their_state_on_cuda():
    """The coupling (``docs/benchmarks.md`` 13l) is measured and applied on the device: the map,
    the state and the params stay there, and five epochs bring the means as close to the exact
    posterior's as on the CPU (rms 0.12 there over six starts; loose bound, other noise draws)."""
    model, blocks, mean = intercepts_and_slopes(device=CUDA)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    pdvi = PDVI(model, AutoNormal(model), pyro.optim.Adam({}), TraceMeanField_ELBO(), blocks=blocks)
    for _ in range(5):
        for block in blocks:
            pdvi.step(block)
    assert pdvi.coupled_sites == {
        "AutoNormal.locs.alpha": ["AutoNormal.locs.a", "AutoNormal.locs.b"],
        "AutoNormal.locs.beta": ["AutoNormal.locs.a", "AutoNormal.locs.b"],
    }
    assert pdvi._coupling.values.device.type == "cuda"
    assert pdvi.state.duals.device.type == "cuda" and pdvi.state.consensus.device.type == "cuda"
    names = ("alpha", "beta", "a", "b")
    fitted = torch.cat([pyro.param(f"AutoNormal.locs.{n}").detach().reshape(-1) for n in names])
    assert fitted.device.type == "cuda"
    assert float((fitted.cpu() - mean).pow(2).mean().sqrt()) < 0.3


def test_graph_replay_on_cuda_takes_the_steps_through_pyro_takes():
    """The random-effects model on the GPU, with and without graph replay: the same params."""
    results = {}
    for replay in (False, True):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        model, blocks, _ = intercepts_and_slopes(device="cuda")
        pdvi = PDVI(
            model,
            AutoNormal(model),
            pyro.optim.Adam({"lr": 0.01}),
            TraceMeanField_ELBO(),
            blocks=blocks,
            graph_replay=replay,
        )
        for _ in range(3):
            for block in blocks:
                pdvi.step(block)
        results[replay] = {k: v.detach().cpu() for k, v in pyro.get_param_store().items()}
    stats = pdvi.diagnostics["graph_replay"]
    assert stats.recorded >= 1 and stats.replayed > 0 and stats.disabled is None, stats
    for name, value in results[True].items():
        torch.testing.assert_close(value, results[False][name], rtol=1e-8, atol=1e-8)


def test_batched_hessian_products_on_cuda_equal_the_cpu_and_the_loop():
    """The one batched backward pass runs on the device (called directly: ``hessian_products``
    would hide its failure behind the loop): its products equal the per-direction loop's there
    and the CPU's, in float64."""
    from pyro_pdvi.infer import hessian_products as module

    def products(device, batched=True):
        point = torch.linspace(-1.0, 1.0, 9, dtype=torch.float64, device=device).requires_grad_()
        value = (point.sin() * point.cos().sum()).sum() + 0.5 * (point**4).sum()
        (gradient,) = torch.autograd.grad(value, point, create_graph=True)
        directions = torch.eye(9, dtype=torch.float64, device=device)[:4] + 0.5
        backward = module._batched_backward if batched else module._one_at_a_time
        return backward(gradient, point, directions)

    on_device = products(CUDA)
    assert on_device.device.type == "cuda"
    torch.testing.assert_close(on_device, products(CUDA, batched=False), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(on_device.cpu(), products("cpu"), rtol=1e-12, atol=1e-12)


def test_whitened_site_keeps_its_state_on_cuda_and_reaches_the_exact_means():
    """The whitening (``docs/benchmarks.md`` 13zc) is measured and applied on the device: the map,
    the state and the params stay there, and the means reach the exact posterior means as on
    the CPU (``tests/infer/test_whitening.py``: below 1e-6 after 40 epochs)."""
    problem = CorrelatedRegression(device="cuda")
    pdvi = fit(problem, 40, whiten=True)
    assert pdvi.whitened_sites == ["AutoNormal.locs.w"]
    assert pdvi._coupling.factors[0].device.type == "cuda"
    assert pdvi.state.duals.device.type == "cuda" and pdvi.state.consensus.device.type == "cuda"
    assert pyro.param("AutoNormal.locs.w").device.type == "cuda"
    assert error(problem) < 1e-6


def test_sites_probed_and_whitened_together_on_cuda():
    """A joint group whose large site is measured by probes (``docs/benchmarks.md`` 13zo) on the
    device: the map and the state stay there, and the means reach the exact posterior means as on
    the CPU (``tests/infer/test_whitening.py``: below 1e-6 after 40 epochs)."""
    problem = SiteIntercepts(num_data=1000, num_sites=20, device="cuda")
    pdvi = problem.fit(40)
    assert pdvi.whitened_sites == ["AutoNormal.locs.a", "AutoNormal.locs.w"]
    assert pdvi._coupling.factors[0].device.type == "cuda" and pdvi.state.consensus.device.type == "cuda"
    assert problem.error() < 1e-6


def test_random_slopes_whitened_by_units_on_cuda():
    """A random intercept and slope per site whitened with each site's pair as one unit
    (``docs/benchmarks.md`` 13zq) on the device: the units' factors and the state stay there, and
    the means reach the exact posterior means as on the CPU (``tests/infer/test_whitening.py``:
    below 1e-6 after 40 epochs)."""
    problem = SiteSlopes(device="cuda")
    pdvi = problem.fit(40)
    assert sorted(pdvi.whitened_sites) == ["AutoNormal.locs.a", "AutoNormal.locs.b", "AutoNormal.locs.w"]
    assert pdvi._coupling.unit_factors[0].device.type == "cuda" and pdvi.state.consensus.device.type == "cuda"
    assert problem.error() < 1e-6


def test_nested_intercepts_and_slopes_whitened_by_units_on_cuda():
    """160 sites' intercepts and slopes nested in 80 regions, found by the nested probes and
    whitened by units of a region and its sites (``docs/benchmarks.md`` 13zw) on the device: the
    units' factors and the state stay there, and the means reach the exact posterior means as on
    the CPU (``tests/infer/test_whitening.py``: 6.9e-9 after 40 epochs)."""
    problem = SiteIntercepts(num_data=2400, num_sites=160, regions=80, slopes=True, device="cuda")
    pdvi = problem.fit(40)
    whitened = ["AutoNormal.locs.a", "AutoNormal.locs.b", "AutoNormal.locs.c", "AutoNormal.locs.w"]
    assert sorted(pdvi.whitened_sites) == whitened
    assert pdvi._coupling.unit_factors[0].device.type == "cuda" and pdvi.state.consensus.device.type == "cuda"
    assert problem.error() < 1e-6


def test_sampled_blocks_measured_again_on_cuda(monkeypatch):
    """Concentration measured again on every row where blocks were sampled (``docs/benchmarks.md``
    13zp) on the device: 40 sites' effects spread over 6 blocks of 100, first measured on 16 rows
    of each, are not concentrated, as on the CPU (``tests/infer/test_whitening.py``)."""
    monkeypatch.setattr(upkeep, "CURVATURE_ROWS", 16)
    problem = SiteIntercepts(num_data=600, num_sites=40, device="cuda")
    pdvi = problem.fit(2)
    assert pdvi.concentrated_sites == {} and pdvi.state.information.device.type == "cuda"


def test_a_model_written_for_one_draw_is_found_and_looped_on_cuda():
    """The particle check (``docs/benchmarks.md`` 13zf) on the device: the group model written
    for one draw (``tests/infer/test_solve_noise.py``) is flagged, its solves loop 8 antithetic
    particles, its state stays on the device, and after 15 epochs its means are within 0.1
    posterior sd of the optimum and its sds within 15%, as on the CPU."""
    group_of, data = GROUP_OF.to(CUDA), GROUP_DATA.to(CUDA)
    blocks = [block.to(CUDA) for block in GROUP_BLOCKS]

    def model(idx):
        m = pyro.sample("m", pyro.distributions.Normal(torch.zeros((), device=CUDA), 10.0))
        e = pyro.sample("e", pyro.distributions.Normal(torch.zeros(GROUPS, device=CUDA), 1.0).to_event(1))
        with pyro.plate("data", len(data), subsample=idx) as i:
            pyro.sample("y", pyro.distributions.Normal(m[..., None] + e[..., group_of[i]], 1.0), obs=data[i])

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    pdvi = PDVI(model, AutoNormal(model), pyro.optim.Adam({"lr": 0.01}), Trace_ELBO(), blocks=blocks)
    with pytest.warns(UserWarning, match="broadcasts against the particle dimension"):
        for block in blocks:
            pdvi.step(block)
    assert pdvi.solve_loss.loss.num_particles == 8 and not pdvi.solve_loss.loss.vectorize_particles
    for _ in range(14):
        for block in blocks:
            pdvi.step(block)
    assert pdvi.state.consensus.device.type == "cuda"
    means, sds = _group_posterior()
    fitted_means = torch.cat([pyro.param("AutoNormal.locs.m").reshape(1), pyro.param("AutoNormal.locs.e")])
    fitted_sds = torch.cat([pyro.param("AutoNormal.scales.m").reshape(1), pyro.param("AutoNormal.scales.e")])
    assert ((fitted_means.detach().cpu().double() - means) / sds).abs().max() < 0.1
    assert ((fitted_sds.detach().cpu().double() / sds) - 1).abs().max() < 0.15


def test_a_full_covariance_site_takes_its_fixed_point_on_cuda():
    """The Cholesky factor's fixed point (``docs/benchmarks.md`` 13zi) on the device: after one
    epoch of the conjugate regression of ``tests/infer/test_cholesky_maps.py`` the covariance is
    the posterior's, as on the CPU, and the state stays on the device."""
    from pyro.infer.autoguide import AutoMultivariateNormal

    from .infer.test_cholesky_maps import BLOCKS, COVARIATES, DIM, NOISE, NUM_DATA, RESPONSES, exact_posterior

    covariates, responses = COVARIATES.to(CUDA), RESPONSES.to(CUDA)

    def model(idx=None):
        w = pyro.sample(
            "w",
            pyro.distributions.Normal(torch.zeros(DIM, device=CUDA, dtype=torch.float64), 1.0).to_event(1),
        )
        with pyro.plate("data", NUM_DATA, subsample=idx) as i:
            pyro.sample("y", pyro.distributions.Normal((covariates[i] * w).sum(-1), NOISE), obs=responses[i])

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMultivariateNormal(model, init_scale=0.3)
    blocks = [block.to(CUDA) for block in BLOCKS]
    pdvi = PDVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO(), blocks=blocks)
    for block in blocks:
        pdvi.step(block)
    assert pdvi.diagnostics["scale_fixed_point"]["params"] == [
        "AutoMultivariateNormal.scale, AutoMultivariateNormal.scale_tril"
    ]
    assert pdvi.state.consensus.device.type == "cuda"
    covariance = guide.get_posterior().covariance_matrix.detach()
    assert covariance.device.type == "cuda"
    torch.testing.assert_close(covariance.cpu(), exact_posterior()[1], rtol=1e-10, atol=1e-14)


def test_the_saddle_escape_check_runs_on_cuda(monkeypatch):
    """The saddle escape's check (``docs/benchmarks.md`` 13zl-13zm) on the device: on a model with
    a latent per datum and a convex reduced objective it runs (the Hessian products on the device,
    Lanczos on the host), finds no negative curvature, and the state stays on the device."""
    from pyro_pdvi.infer import saddle_escape

    monkeypatch.setattr(saddle_escape, "FIRST_CHECK_EPOCH", 3)
    monkeypatch.setattr(saddle_escape, "DRIFT_EPOCHS", 2)
    data = torch.linspace(-2.0, 3.0, 24, device=CUDA)
    blocks = list(torch.arange(24, device=CUDA).split(6))

    def model(idx):
        mu = pyro.sample("mu", pyro.distributions.Normal(torch.zeros((), device=CUDA), 3.0))
        with pyro.plate("data", 24, subsample=idx):
            z = pyro.sample("z", pyro.distributions.Normal(mu, 1.0))
            pyro.sample("x", pyro.distributions.Normal(z, 0.5), obs=data[idx])

    def guide(idx):
        loc = pyro.param("mu_loc", torch.zeros((), device=CUDA))
        scale = pyro.param("mu_scale", torch.ones((), device=CUDA), constraint=constraints.positive)
        pyro.sample("mu", pyro.distributions.Normal(loc, scale))
        with pyro.plate("data", 24, subsample=idx):
            z_loc = pyro.param("z_loc", torch.zeros(24, device=CUDA), event_dim=0)
            z_scale = pyro.param(
                "z_scale", torch.ones(24, device=CUDA), constraint=constraints.positive, event_dim=0
            )
            pyro.sample("z", pyro.distributions.Normal(z_loc, z_scale))

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    pdvi = PDVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO(), blocks=blocks)
    for _ in range(5):
        for block in blocks:
            pdvi.step(block)
    (check,) = pdvi.diagnostics["saddle_escape"]
    assert "failed" not in check and check["epoch"] == 3
    assert check["rounds"][0].negative == 0 and check["rounds"][0].smallest > 0
    assert pdvi.state.consensus.device.type == "cuda" and pdvi.state.duals.device.type == "cuda"
    assert pyro.param("z_loc").device.type == "cuda"
