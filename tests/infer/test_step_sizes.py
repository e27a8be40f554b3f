"""Preconditioner groups and their step sizes: fixed, measured at set-up (``eta="auto"``) and
re-measured during the run (``AutoStepSize.remeasure_epochs``), against exact values."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal
from torch.distributions import constraints

import pyro_pdvi.infer.step_sizes as step_sizes
import pyro_pdvi.infer.upkeep as upkeep
from pyro_pdvi import PDVI, AutoStepSize, GenericSolver
from pyro_pdvi.infer.sites import GlobalLayout, GlobalSite
from pyro_pdvi.infer.step_sizes import (
    BLOCK_CURVATURE_BOUND,
    FISHER_TOLERANCE,
    NATURAL_SCALE_WITH_LOCALS,
    SHORT_SOLVE_STEPS,
    coordinate_groups,
    diagonal_curvature,
    estimate_curvatures,
    resolve_groups,
)
from pyro_pdvi.models.quadratic import Quadratic

from ..toy_models import Hierarchical, intercepts_and_slopes

NAMES = ["AutoNormal.locs.w", "AutoNormal.scales.w", "bias"]


def test_groups_by_names_regex_and_callable_rest_in_default():
    groups = resolve_groups(
        [
            {"sites": r"AutoNormal\.locs\..*", "name": "locs"},
            {"sites": lambda name: name.endswith("scales.w"), "eta": 1e-3},
        ],
        NAMES,
        "auto",
    )
    assert [(g.name, g.sites, g.eta) for g in groups] == [
        ("locs", ["AutoNormal.locs.w"], "auto"),
        ("group1", ["AutoNormal.scales.w"], 1e-3),
        ("default", ["bias"], "auto"),
    ]
    assert [g.sites for g in resolve_groups("per_site", NAMES, 0.1)] == [[n] for n in NAMES]
    assert [g.sites for g in resolve_groups(None, NAMES, 0.1)] == [NAMES]


@pytest.mark.parametrize("eta", [0.0, float("inf"), True, "1e-3"])
def test_invalid_step_sizes(eta):
    with pytest.raises(ValueError, match="Invalid step size"):
        resolve_groups([{"sites": ["bias"], "eta": eta}], NAMES, 0.1)


def test_power_iteration_finds_each_groups_largest_curvature():
    sites = [
        GlobalSite("a", torch.Size([3]), constraints.real),
        GlobalSite("b", torch.Size([2]), constraints.real),
    ]
    layout = GlobalLayout(sites)
    groups = resolve_groups("per_site", layout.names, "auto")
    group_of = coordinate_groups(groups, layout)
    root = torch.randn(5, 5, generator=torch.Generator().manual_seed(0))
    hessian = root @ root.T + torch.diag(torch.tensor([1.0, 2.0, 3.0, 100.0, 300.0]))

    def gradient(point):
        return hessian @ point + 1.0

    curvatures = estimate_curvatures(gradient, torch.randn(5), group_of, 2, num_iterations=50)
    expected = [torch.linalg.eigvalsh(hessian[:3, :3]).max(), torch.linalg.eigvalsh(hessian[3:, 3:]).max()]
    assert torch.allclose(curvatures, torch.stack(expected), rtol=1e-6)


def _quadratic_pdvi(problem, **kwargs):
    return PDVI(
        problem.model,
        problem.guide,
        pyro.optim.Adam({"lr": 0.1}),
        problem.loss,
        blocks=problem.blocks,
        solver=GenericSolver(inner_steps=30),
        **kwargs,
    )


def _exact_reduced_curvatures(problem):
    """Per block, the largest eigenvalue of each group's block of the reduced Hessian
    ``sum_i (Q_ll - Q_lp Q_pp^-1 Q_pl) + (|b|/N) r I`` of ``min_phi f_b``."""
    p, qa = problem.p, problem.qa
    out = []
    for block in problem.blocks:
        q = problem.Q[block]
        schur = q[:, p:, p:] - q[:, p:, :p] @ torch.linalg.solve(q[:, :p, :p], q[:, :p, p:])
        reduced = schur.sum(0) + len(block) / problem.N * problem.reg * torch.eye(schur.shape[-1])
        out.append(
            [torch.linalg.eigvalsh(reduced[:qa, :qa]).max(), torch.linalg.eigvalsh(reduced[qa:, qa:]).max()]
        )
    return torch.tensor(out)


def test_auto_eta_is_exact_on_the_quadratic_at_set_up_and_after_a_remeasure():
    problem = Quadratic(num_data=12, num_blocks=4, dim_a=1, dim_b=1, scale_b=3.0)
    exact = _exact_reduced_curvatures(problem).amax(0)
    pdvi = _quadratic_pdvi(
        problem,
        groups="per_site",
        eta=AutoStepSize(rule="curvature", curvature_blocks=4, curvature_iterations=1, remeasure_epochs=(1,)),
    )
    for step, b in enumerate([0, 1, 2, 3]):
        pdvi.step(problem.blocks[b])
        # The reduced curvature of a quadratic is the same everywhere: a re-measure finds it again.
        curvatures = torch.tensor(list(pdvi.curvatures.values()))
        assert torch.allclose(curvatures, exact, rtol=1e-6), step
        etas = torch.tensor(list(pdvi.step_sizes.values()))
        assert torch.allclose(etas, pdvi.auto_step_size.scale / curvatures, rtol=1e-12)
        assert pdvi.diagnostics["curvatures"] == pdvi.curvatures


def _record_measurements(pdvi):
    measured = []
    original = pdvi._measure_curvatures

    def recording(args, kwargs):
        value = original(args, kwargs)
        measured.append((pdvi.num_steps, value.clone()))
        return value

    pdvi._measure_curvatures = recording
    return measured


def test_remeasure_keeps_the_largest_curvature_and_leaves_fixed_steps_alone():
    problem = Quadratic(num_data=24, num_blocks=6, scale_b=3.0)
    fixed_b = 0.002
    pdvi = _quadratic_pdvi(
        problem,
        groups=[{"sites": ["a"], "name": "a"}, {"sites": ["b"], "eta": fixed_b, "name": "b"}],
        eta=AutoStepSize(
            rule="curvature", curvature_blocks=1, curvature_iterations=2, remeasure_epochs=(2, 0.5, 1)
        ),  # sorted: after 3, 6 and 12 block visits
    )
    measured = _record_measurements(pdvi)
    blocks = [0, 1, 2, 3, 4, 5] * 2
    for b in blocks:
        pdvi.step(problem.blocks[b])
    # Set-up (before step 1), then after steps 3, 6 and 12.
    assert [when for when, _ in measured] == [0, 3, 6, 12]
    largest = torch.stack([value for _, value in measured]).amax(0)
    assert pdvi.curvatures == {"a": float(largest[0]), "b": float(largest[1])}
    assert pdvi.step_sizes == {"a": pdvi.auto_step_size.scale / float(largest[0]), "b": fixed_b}
    assert pdvi.diagnostics["step_sizes"] == pdvi.step_sizes
    # lambda_0 moved with h = H mean(mu); the param store holds it.
    store = torch.cat([pyro.param("a").detach(), pyro.param("b").detach()])
    assert torch.equal(store, pdvi.state.consensus)
    # Different single blocks were measured, with different curvatures: the max moved.
    assert len({float(value[0]) for _, value in measured}) > 1


def test_changing_eta_mid_run_keeps_the_exact_fixed_point():
    problem = Quadratic(num_data=12, num_blocks=4, scale_b=1.0)
    phi_opt, lam_opt = problem.optimum()
    pyro.set_rng_seed(1)  # set-up measures a block that is not the stiffest: eta shrinks at epoch 2
    pdvi = _quadratic_pdvi(
        problem,
        eta=AutoStepSize(
            rule="curvature", curvature_blocks=1, curvature_iterations=2, remeasure_epochs=(1, 2, 3, 4)
        ),
    )
    etas = []
    for _ in range(80):
        for b in torch.randperm(len(problem.blocks)).tolist():
            pdvi.step(problem.blocks[b])
        etas.append(pdvi.step_sizes["default"])
        lam = torch.cat([pyro.param("a").detach(), pyro.param("b").detach()])
        error = float((lam - lam_opt).norm() / lam_opt.norm())
        if error < 1e-9:
            break
    assert len(set(etas)) > 1  # the step size did change during the run
    assert error <= 1e-8
    # After an exact enough solve mu_b = -grad f_b, whatever eta was when it was taken.
    phi = pyro.param("phi").detach()
    for b, block in enumerate(problem.blocks):
        gradient = problem.block_gradient(block, phi[block], pdvi.state.copies[b])
        assert torch.allclose(pdvi.state.duals[b], -gradient, rtol=0, atol=1e-6 * gradient.abs().max())


# The checkpoint round trip across a re-measure: tests/infer/test_pdvi.py.


def _normal_mean_run(noise: float, spread: float = 1.0, num_data: int = 20) -> tuple[PDVI, list, float]:
    """PDVI on a normal mean ``w ~ N(0, 1)``, ``y_i ~ N(w, noise)``, in 4 blocks, with its posterior
    sd (exact: the model is conjugate)."""
    y = spread * torch.randn(num_data, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 1.0

    def model(idx):
        w = pyro.sample("w", dist.Normal(y.new_zeros(()), 1.0))
        with pyro.plate("data", num_data, subsample=idx):
            pyro.sample("y", dist.Normal(w, noise), obs=y[idx])

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    blocks = list(torch.arange(num_data).chunk(4))
    pdvi = PDVI(
        model, AutoNormal(model), pyro.optim.Adam({}), TraceMeanField_ELBO(), blocks=blocks, groups="per_site"
    )
    # The site is round: keep the rule's constant 1 on it (tests/infer/test_whitening.py tests the
    # round sites' own constant).
    pdvi.scale_round_sites = False
    return pdvi, blocks, (1 + num_data / noise**2) ** -0.5


def test_a_natural_step_size_grows_at_most_fourfold_an_epoch_and_shrinks_at_once():
    """AutoNormal's scales start at 0.1 and are held there for the first epoch; the posterior sd
    of ``w`` is 0.91, so the Fisher information of its location falls 83x when the fixed point
    sets the scale. The location's step size follows it 4x an epoch (its duals were gathered
    under the smaller one) until it is within ``FISHER_TOLERANCE`` of the rule's value; where the
    Fisher information rises again, the step size shrinks at once."""
    pdvi, blocks, posterior_sd = _normal_mean_run(noise=10.0, spread=3.0)
    etas = []
    for _ in range(5):
        for block in blocks:
            pdvi.step(block)
        etas.append(pdvi.step_sizes["AutoNormal.locs.w"])
    assert float(pyro.param("AutoNormal.scales.w").detach()) == pytest.approx(posterior_sd, rel=1e-3)
    start = len(blocks) * 0.1**2  # the natural rule, scale 1: eta = n sigma^2
    natural = len(blocks) * posterior_sd**2
    assert etas[:3] == pytest.approx([start * 4, start * 16, start * 64], rel=1e-4)
    assert natural / FISHER_TOLERANCE <= etas[-1] <= natural
    # A Fisher information 83x larger (the scale back at 0.1): the step size falls as much at once.
    pdvi._step_sizes.set_fisher(pdvi._step_sizes.fisher * natural / start)
    pdvi._apply_step_sizes()
    assert pdvi.step_sizes["AutoNormal.locs.w"] == pytest.approx(etas[-1] * start / natural, rel=1e-4)


@pytest.mark.parametrize("floor", [True, False])
def test_in_the_first_epoch_the_measured_curvature_bounds_a_natural_step_size(monkeypatch, floor):
    """A posterior sd of 0.0089, 11x narrower than AutoNormal's start. While the scales are held at
    AutoNormal's 0.1, the start's Fisher information (100) would give the location a step size 127x
    the natural rule's at the optimum (``n sigma^2``, sigma the posterior sd). The blocks' measured
    curvature, ``1 / sigma^2`` shared among them (the model is Gaussian: it is exact), bounds it by
    ``scale / mean_b h_b``, which is the rule's value; without that bound the one of
    ``8 / max_b h_b`` leaves it 8x larger. Once the Fisher information is measured again at the
    epoch's end the start's bound is dropped: the scale's fixed point gives the same value."""
    monkeypatch.setattr(step_sizes, "START_CURVATURE_FLOOR", floor)
    pdvi, blocks, posterior_sd = _normal_mean_run(noise=0.04)
    natural = len(blocks) * posterior_sd**2
    pdvi.step(blocks[0])
    expected = natural if floor else BLOCK_CURVATURE_BOUND * natural
    assert pdvi.step_sizes["AutoNormal.locs.w"] == pytest.approx(expected, rel=1e-3)
    assert pdvi._step_sizes.fisher_at_start
    for block in blocks[1:]:
        pdvi.step(block)
    assert not pdvi._step_sizes.fisher_at_start
    assert float(pyro.param("AutoNormal.scales.w").detach()) == pytest.approx(posterior_sd, rel=1e-3)
    assert pdvi.step_sizes["AutoNormal.locs.w"] == pytest.approx(natural, rel=1e-3)


def test_a_checkpoint_keeps_the_first_epochs_curvature_bound():
    """A run resumed within its first epoch takes the same step sizes as the one it came from."""
    pdvi, blocks, _ = _normal_mean_run(noise=0.04)
    pdvi.step(blocks[0])
    state = pdvi.state_dict()
    etas = dict(pdvi.step_sizes)
    resumed, _, _ = _normal_mean_run(noise=0.04)
    resumed.load_state_dict(state)
    pdvi.step(blocks[1])
    resumed.step(blocks[1])
    assert resumed._step_sizes.fisher_at_start
    assert resumed.step_sizes == pytest.approx(pdvi.step_sizes, rel=1e-6)
    assert pdvi.step_sizes["AutoNormal.locs.w"] == pytest.approx(etas["AutoNormal.locs.w"], rel=0.01)


@pytest.mark.parametrize(
    "value", ["1", 1, (0,), (-1.0,), (float("nan"),), (float("inf"),), (True,), ("1",)], ids=repr
)
def test_remeasure_epochs_validation(value):
    with pytest.raises(ValueError, match="Invalid remeasure_epochs"):
        AutoStepSize(remeasure_epochs=value)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"scale": 0}, "Invalid scale"),
        ({"scale": True}, "Invalid scale"),
        ({"curvature_blocks": 0}, "Invalid curvature_blocks"),
        ({"curvature_iterations": 1.5}, "Invalid curvature_iterations"),
    ],
)
def test_auto_step_size_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AutoStepSize(**kwargs)


def test_a_tensor_eta_sets_one_step_size_per_coordinate_and_keeps_the_exact_optimum():
    """A one-site group with a tensor eta (P2D-VI with a step size per coordinate): the state
    takes them as given, the report is their geometric mean, and the run reaches the optimum."""
    problem = Quadratic(num_data=12, num_blocks=4, scale_b=1.0)
    _, lam_opt = problem.optimum()
    eta_a = torch.linspace(0.02, 0.08, problem.qa, dtype=torch.float64)
    pdvi = _quadratic_pdvi(problem, eta=0.05, groups=[{"sites": ["a"], "eta": eta_a, "name": "a"}])
    pdvi.step(problem.blocks[0])
    assert torch.equal(pdvi.state.step_sizes[: problem.qa], eta_a)
    assert torch.all(pdvi.state.step_sizes[problem.qa :] == 0.05)
    assert pdvi.step_sizes == {"a": pytest.approx(float(eta_a.log().mean().exp())), "default": 0.05}
    for _ in range(150):
        for block in problem.blocks:
            pdvi.step(block)
    lam = torch.cat([pyro.param("a").detach(), pyro.param("b").detach()])
    assert float((lam - lam_opt).norm() / lam_opt.norm()) <= 1e-8


def test_tensor_eta_errors_name_the_group_and_the_fix():
    problem = Quadratic(num_data=12, num_blocks=4, scale_b=1.0)
    eta_a = torch.full((problem.qa,), 0.05, dtype=torch.float64)
    with pytest.raises(ValueError, match="a step size per coordinate needs a group of one site"):
        resolve_groups([{"sites": ["a", "b"], "eta": eta_a}], ["a", "b"], 0.1)
    with pytest.raises(ValueError, match="every entry must be a positive finite float"):
        resolve_groups([{"sites": ["a"], "eta": torch.tensor([0.1, -1.0])}], ["a", "b"], 0.1)
    with pytest.raises(ValueError, match="goes in a group of one site"):
        _quadratic_pdvi(problem, eta=eta_a)
    wrong = _quadratic_pdvi(problem, eta=0.05, groups=[{"sites": ["a"], "eta": eta_a[:-1], "name": "a"}])
    with pytest.raises(ValueError, match=r'group \'a\': its eta has shape .* site "a" has shape'):
        wrong.step(problem.blocks[0])


def test_a_measurement_that_is_not_finite_leaves_every_step_size_finite(monkeypatch):
    """A finite-difference probe or a Fisher draw that left the model's domain measures nothing
    (found on the generic suite's GMM: a NaN block curvature became a NaN step size, which moved
    lambda_0 to NaN outside any step): the coordinate counts as uninformed."""

    def half_nan(measure):
        def measured(*args, **kwargs):
            value = measure(*args, **kwargs).clone()
            value[::2] = float("nan")
            return value

        return measured

    monkeypatch.setattr(upkeep, "diagonal_curvature", half_nan(upkeep.diagonal_curvature))
    monkeypatch.setattr(upkeep, "fisher_diagonal", half_nan(upkeep.fisher_diagonal))
    problem = Hierarchical(num_data=20, num_blocks=4)
    pdvi = PDVI(
        problem.model,
        problem.guide,
        pyro.optim.Adam({}),
        TraceMeanField_ELBO(num_particles=4, vectorize_particles=True),
        blocks=problem.blocks,
    )
    for _ in range(3):
        for b in range(4):
            pdvi.step(problem.blocks[b])
            assert bool(torch.isfinite(pdvi.state.step_sizes).all())
            assert bool(torch.isfinite(pdvi.state.consensus).all())
    assert bool(torch.isfinite(pdvi.state.information).all())
    assert pdvi._step_sizes.fisher.isfinite().all() and (pdvi._step_sizes.fisher[::2] == 0).all()


def test_diagonal_curvature_is_exact_for_a_diagonal_hessian():
    """One Rademacher probe gives a diagonal Hessian's diagonal exactly, from one product per
    probe; with off-diagonal terms the probes' mean tends to the diagonal."""
    g = torch.Generator().manual_seed(0)
    diagonal = torch.rand(7, generator=g, dtype=torch.float64) * 10 + 0.1
    point = torch.randn(7, generator=g, dtype=torch.float64)
    products = []

    def diagonal_products(directions):
        products.append(len(directions))
        return directions * diagonal

    for probes in (1, 3):
        products.clear()
        curvature = diagonal_curvature(diagonal_products, point, probes)
        assert products == [probes]
        assert torch.allclose(curvature, diagonal, rtol=1e-12)
    coupled = torch.diag(diagonal) + 0.3 * torch.ones(7, 7, dtype=torch.float64)
    curvature = diagonal_curvature(lambda directions: directions @ coupled, point, 4000)
    assert torch.allclose(curvature, torch.diagonal(coupled), rtol=0.03)


def test_diagonal_curvature_of_few_coordinates_is_exact():
    """At most twice as many coordinates as probes: one product per unit vector, the diagonal
    exactly, however stiff the coordinates it is tied to."""
    g = torch.Generator().manual_seed(1)
    root = torch.randn(6, 6, generator=g, dtype=torch.float64)
    hessian = root @ root.T + torch.diag(torch.tensor([1e-3, 1.0, 60.0, 0.1, 5.0, 2.0], dtype=torch.float64))
    products = []

    def coupled_products(directions):
        products.append(len(directions))
        return directions @ hessian

    point = torch.zeros(6, dtype=torch.float64)
    curvature = diagonal_curvature(coupled_products, point, 3)
    assert products == [6]
    torch.testing.assert_close(curvature, torch.diagonal(hessian), rtol=1e-12, atol=0.0)
    products.clear()
    diagonal_curvature(coupled_products, point, 2)  # 6 > 2 * 2: Rademacher probes
    assert products == [2]


class _OnceDifferentiableIdentity(torch.autograd.Function):
    """The identity, whose backward has no derivative of its own."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return grad


def test_blocks_are_measured_by_finite_differences_where_the_graph_has_no_second_derivative():
    """The blocks' curvature comes from Hessian products by double backward. Through an op whose
    backward is not differentiable (a ``once_differentiable`` Function, as in some Pyro
    distributions) double backward silently drops that op's share of the products; the check of
    the first products against central differences of the gradient catches it, and the blocks
    are measured by central differences instead: the same information, to their truncation
    error (float64). Through Pyro (``graph_replay=False``): a replayed graph holds the Function's
    forward operations, which autograd differentiates twice; with replay, by either path, the
    same information."""
    problem = Hierarchical(num_data=20, num_blocks=4)

    def once_differentiable_model(idx):
        mu = _OnceDifferentiableIdentity.apply(pyro.sample("mu", pyro.distributions.Normal(0.0, problem.s0)))
        with pyro.plate("data", problem.N, subsample=idx) as ind:
            theta = pyro.sample("theta", pyro.distributions.Normal(mu, problem.tau))
            pyro.sample("x", pyro.distributions.Normal(theta, problem.sigma), obs=problem.x[ind])

    def measured(model, graph_replay):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        pdvi = PDVI(
            model,
            problem.guide,
            pyro.optim.Adam({}),
            TraceMeanField_ELBO(num_particles=4, vectorize_particles=True),
            blocks=problem.blocks,
            graph_replay=graph_replay,
        )
        for block in problem.blocks:
            pdvi.step(block)
        return pdvi

    information = []
    for second_order, model in ((True, problem.model), (False, once_differentiable_model)):
        pdvi = measured(model, graph_replay=False)
        information.append(pdvi.state.information)
        assert pdvi._second_order == second_order
        expected = "double_backward" if second_order else "central_differences"
        assert pdvi.diagnostics["hessian_products"] == expected
    assert information[0].abs().sum() > 0
    assert torch.allclose(information[0], information[1], rtol=1e-6)
    replayed = measured(once_differentiable_model, graph_replay=True).state.information
    assert torch.allclose(information[0], replayed, rtol=1e-6)


def test_auto_takes_a_stiffer_natural_constant_where_the_solves_fit_local_rows():
    assert AutoStepSize().resolved(True, short_solves_fit_locals=True) == AutoStepSize(
        rule="natural", scale=NATURAL_SCALE_WITH_LOCALS
    )
    assert AutoStepSize().resolved(True, short_solves_fit_locals=False) == AutoStepSize(
        rule="natural", scale=1.0
    )
    # A closed-form solver takes the curvature rule, locals or not.
    assert AutoStepSize().resolved(False, short_solves_fit_locals=True) == AutoStepSize(rule="curvature")
    # A constant or a rule the user gave is kept.
    assert AutoStepSize(scale=0.5).resolved(True, short_solves_fit_locals=True).scale == 0.5
    assert AutoStepSize(rule="natural").resolved(True, short_solves_fit_locals=True).scale == 1.0


def test_pdvi_sets_the_natural_constant_by_the_local_rows_its_solves_fit():
    """A per-datum Gaussian latent (the hierarchical model's theta) makes the constant 1/4: each
    step size is a quarter of the rule's with 1; global latents only, or discrete rows set by
    their closed-form update, leave it at 1; the same rows left to the L-BFGS solve count."""
    from .test_local_cavi import Mixture, make_pdvi

    toy = Hierarchical()
    etas = {}
    for eta in ("auto", AutoStepSize(rule="natural")):
        pyro.clear_param_store()
        pdvi = PDVI(
            toy.model,
            toy.auto_guide(),
            pyro.optim.Adam({}),
            TraceMeanField_ELBO(),
            blocks=toy.blocks,
            eta=eta,
        )
        pdvi._setup((toy.blocks[0],), {})
        etas[pdvi.auto_step_size.scale] = pdvi.state.step_sizes
    assert set(etas) == {NATURAL_SCALE_WITH_LOCALS, 1.0}
    assert torch.allclose(etas[NATURAL_SCALE_WITH_LOCALS], NATURAL_SCALE_WITH_LOCALS * etas[1.0], rtol=1e-6)

    model, blocks, _ = intercepts_and_slopes()
    pyro.clear_param_store()
    pdvi = PDVI(model, AutoNormal(model), pyro.optim.Adam({}), TraceMeanField_ELBO(), blocks=blocks)
    pdvi._setup((blocks[0],), {})
    assert pdvi.auto_step_size == AutoStepSize(rule="natural", scale=1.0)

    for local_cavi, expected in ((True, 1.0), (False, NATURAL_SCALE_WITH_LOCALS)):
        pdvi = make_pdvi(Mixture(), solver=GenericSolver(local_cavi=local_cavi))
        pdvi._setup((Mixture().blocks[0],), {})
        assert pdvi.auto_step_size.scale == expected

    # Long solves keep the constant 1.
    for inner_steps, expected in (
        (SHORT_SOLVE_STEPS, NATURAL_SCALE_WITH_LOCALS),
        (SHORT_SOLVE_STEPS + 1, 1.0),
    ):
        pyro.clear_param_store()
        pdvi = PDVI(
            toy.model, toy.auto_guide(), pyro.optim.Adam({}), TraceMeanField_ELBO(), blocks=toy.blocks,
            solver=GenericSolver(inner_steps=inner_steps),
        )  # fmt: skip
        pdvi._setup((toy.blocks[0],), {})
        assert pdvi.auto_step_size.scale == expected


def _first_visit_information(model, step_args, monkeypatch, rows):
    """The loc coordinate of the first block's measured curvature, and the subsample sizes the
    model saw, with ``CURVATURE_ROWS = rows``."""
    monkeypatch.setattr(upkeep, "CURVATURE_ROWS", rows)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    blocks = list(torch.arange(40).chunk(2))
    loss = TraceMeanField_ELBO(num_particles=4, vectorize_particles=True)
    pdvi = PDVI(model, AutoNormal(model), pyro.optim.Adam({}), loss, blocks=blocks, graph_replay=False)
    sizes = model.sizes = []
    pdvi.step(*step_args(blocks[0]))
    loc = pdvi.layout.slices["AutoNormal.locs.z"].start
    return float(pdvi.state.information[0, loc]), set(sizes)


def test_a_block_of_more_data_is_measured_on_a_subset_of_them(monkeypatch):
    """A block of more than ``CURVATURE_ROWS`` data has its first curvature measured on that
    many, drawn at random, the data term scaled up: for a normal mean with one noise sd every
    datum adds the same curvature, so the estimate is exact (``20 / 0.5^2 + 1 / 2``: the
    block's data and its half of the prior's). A model that takes the block's data in its step
    arguments cannot take a subset (Pyro's plate refuses the shapes): it is measured on all."""
    data = torch.linspace(-1.0, 1.0, 40)

    def by_index(idx):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        with pyro.plate("data", 40, subsample=idx) as i:
            by_index.sizes.append(len(i))
            pyro.sample("x", dist.Normal(z, 0.5), obs=data[i])

    def by_argument(idx, block_data):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        with pyro.plate("data", 40, subsample=idx) as i:
            by_argument.sizes.append(len(i))
            pyro.sample("x", dist.Normal(z, 0.5), obs=block_data)

    exact = 20 / 0.5**2 + 1 / 2
    whole, sizes = _first_visit_information(by_index, lambda b: (b,), monkeypatch, rows=1000)
    assert whole == pytest.approx(exact, rel=1e-9) and 8 not in sizes
    subset, sizes = _first_visit_information(by_index, lambda b: (b,), monkeypatch, rows=8)
    assert subset == pytest.approx(exact, rel=1e-9) and 8 in sizes
    passed, sizes = _first_visit_information(by_argument, lambda b: (b, data[b]), monkeypatch, rows=8)
    assert passed == pytest.approx(exact, rel=1e-9) and sizes == {8, 20}  # tried, then all
