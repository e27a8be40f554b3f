"""PDVI through Pyro's own machinery: drop-in use, exact optima, checkpoints, errors."""

import copy
import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO, TraceGraph_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoDelta

import pyro_pdvi.infer.step_sizes as step_sizes
from pyro_pdvi import PDVI, AutoStepSize, GenericSolver, NonFiniteStepError
from pyro_pdvi.infer.pdvi import REFUSED_STEP_RETRIES

from ..toy_models import Hierarchical


@pytest.mark.parametrize("use_autoguide", [False, True], ids=["hand_written", "AutoNormal"])
@pytest.mark.parametrize("inference", [SVI, PDVI])
def test_same_training_loop_runs_with_svi_and_pdvi(inference, use_autoguide):
    problem = Hierarchical(num_data=20, num_blocks=4)
    guide = problem.auto_guide() if use_autoguide else problem.guide
    kwargs = {"blocks": problem.blocks, "solver": GenericSolver(inner_steps=5)} if inference is PDVI else {}
    loss = TraceMeanField_ELBO(num_particles=8, vectorize_particles=True)
    algo = inference(problem.model, guide, pyro.optim.Adam({"lr": 0.05}), loss, **kwargs)
    assert algo.model == problem.model and algo.guide == guide
    losses = []
    for _ in range(2):
        for b in torch.randperm(len(problem.blocks)).tolist():
            loss = algo.step(problem.blocks[b])
            assert isinstance(loss, float)
            losses.append(loss)
    assert isinstance(algo.evaluate_loss(problem.blocks[0]), float)
    names = set(pyro.get_param_store().keys())
    assert ("AutoNormal.locs.mu" in names) if use_autoguide else ("mu_loc" in names)
    if inference is PDVI:
        loc = "AutoNormal.locs.mu" if use_autoguide else "mu_loc"
        local = "AutoNormal.locs.theta" if use_autoguide else "theta_loc"
        assert loc in algo.layout.names and local in [s.name for s in algo.local_sites]
        mu_offset = algo.layout.slices[loc].start
        # After two epochs the store holds the estimate from every block's copy (no coupling here).
        assert float(pyro.param(loc)) == pytest.approx(float(algo.state.estimate()[mu_offset]), abs=0)


def test_map_linear_gaussian_autodelta_reaches_exact_optimum():
    """MAP of y_i = x_i'w + u_i + noise with a local u_i per datum, against one linear solve."""
    N, d, sigma = 30, 3, 0.5
    g = torch.Generator().manual_seed(1)
    X = torch.randn(N, d, generator=g)
    # Non-i.i.d. blocks: the response drifts along the data order.
    y = (
        X @ torch.tensor([1.0, -2.0, 0.5])
        + 0.3 * torch.randn(N, generator=g)
        + 2.0 * torch.linspace(-1, 1, N)
    )

    def model(idx):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([d]).to_event(1))
        with pyro.plate("data", N, subsample=idx) as ind:
            u = pyro.sample("u", dist.Normal(0.0, 1.0))
            pyro.sample("y", dist.Normal(X[ind] @ w + u, sigma), obs=y[ind])

    guide = AutoDelta(model, create_plates=lambda idx: pyro.plate("data", N, subsample=idx))
    blocks = list(torch.arange(N).chunk(3))
    pdvi = PDVI(
        model,
        guide,
        pyro.optim.Adam({"lr": 0.01}),
        Trace_ELBO(),
        blocks=blocks,
        solver=GenericSolver(inner_steps=30),
    )

    # Normal equations of -log p(w, u, y) in (w, u).
    A = torch.cat([X, torch.eye(N)], 1)
    H = A.T @ A / sigma**2 + torch.eye(d + N)
    exact = torch.linalg.solve(H, A.T @ y / sigma**2)
    for _ in range(120):
        for b in torch.randperm(len(blocks)).tolist():
            pdvi.step(blocks[b])
        w = pyro.param("AutoDelta.w").detach()
        if (w - exact[:d]).norm() / exact[:d].norm() < 1e-9:
            break
    assert (w - exact[:d]).norm() / exact[:d].norm() <= 1e-8
    u = pyro.param("AutoDelta.u").detach()
    assert (u - exact[d:]).norm() / exact[d:].norm() <= 1e-8


def test_hierarchical_mean_matches_mean_field_optimum_where_svi_is_off():
    """Sorted blocks, AutoNormal, TraceMeanField_ELBO with 256 vectorized particles."""
    problem = Hierarchical()
    exact = problem.posterior_mean_mu()
    loss = TraceMeanField_ELBO(num_particles=256, vectorize_particles=True)
    num_epochs = 12

    pdvi = PDVI(
        problem.model,
        problem.auto_guide(),
        pyro.optim.Adam({"lr": 0.05}),
        loss,
        blocks=problem.blocks,
        solver=GenericSolver(inner_steps=10),
    )
    for _ in range(num_epochs):
        for b in range(len(problem.blocks)):
            pdvi.step(problem.blocks[b])
    assert abs(float(pyro.param("AutoNormal.locs.mu")) - exact) < 1e-2

    pyro.clear_param_store()
    svi = SVI(problem.model, problem.auto_guide(), pyro.optim.Adam({"lr": 0.05}), loss)
    for _ in range(num_epochs):
        for b in range(len(problem.blocks)):
            svi.step(problem.blocks[b])
    assert abs(float(pyro.param("AutoNormal.locs.mu")) - exact) > 0.1


def _run(pdvi, blocks, schedule):
    trajectory = []
    for b in schedule:
        pdvi.step(blocks[b])
        trajectory.append(pdvi.state.consensus.clone())
    return torch.stack(trajectory)


REMEASURE = dict(
    eta=AutoStepSize(rule="curvature", curvature_blocks=1, curvature_iterations=2, remeasure_epochs=(1, 2))
)


@pytest.mark.parametrize(
    "options, saved_after, remeasures",
    # remeasure_epochs=(1, 2): after steps 4 and 8, one before the save and one after.
    [({}, 4, 0), (REMEASURE, 6, 2)],
    ids=["plain", "across_a_remeasure"],
)
def test_checkpoint_round_trip_continues_the_same_trajectory(options, saved_after, remeasures):
    problem = Hierarchical(num_data=24, num_blocks=4)
    schedule = [0, 2, 1, 3, 3, 0, 1, 2, 0, 3]

    def fresh():
        guide = problem.auto_guide()
        pdvi = PDVI(
            problem.model,
            guide,
            pyro.optim.Adam({"lr": 0.05}),
            # A fresh ELBO too: its lazy set-up (max_plate_nesting) must not shift the noise.
            TraceMeanField_ELBO(num_particles=4, vectorize_particles=True),
            blocks=problem.blocks,
            groups="per_site",
            solver=GenericSolver(inner_steps=8),
            **options,
        )
        return guide, pdvi

    _, pdvi = fresh()
    _run(pdvi, problem.blocks, schedule[:saved_after])
    saved_pdvi = copy.deepcopy(pdvi.state_dict())
    saved_store = copy.deepcopy(pyro.get_param_store().get_state())
    uninterrupted = _run(pdvi, problem.blocks, schedule[saved_after:])
    uninterrupted_store = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}

    pyro.clear_param_store()
    pyro.set_rng_seed(123)  # a different RNG history until the state is restored
    guide, resumed_pdvi = fresh()
    pyro.get_param_store().set_state(saved_store)
    guide(problem.blocks[0])  # autoguides build themselves on their first call
    # PDVI's noise comes from its own generator, saved in the state: torch's RNG history
    # (different here) does not matter.
    resumed_pdvi.load_state_dict(saved_pdvi)
    resumed = _run(resumed_pdvi, problem.blocks, schedule[saved_after:])

    assert resumed_pdvi.num_steps == pdvi.num_steps == len(schedule)
    assert resumed_pdvi.step_sizes == pdvi.step_sizes
    assert resumed_pdvi.curvatures == pdvi.curvatures
    assert resumed_pdvi.state_dict()["step_sizes"]["remeasured"] == remeasures
    assert pdvi.state_dict()["step_sizes"]["remeasured"] == remeasures
    assert torch.allclose(resumed, uninterrupted, rtol=0, atol=1e-10)
    for name, value in pyro.get_param_store().items():
        assert torch.allclose(value.detach(), uninterrupted_store[name], rtol=0, atol=1e-10), name


def test_non_finite_step_is_refused_and_changes_nothing():
    problem = Hierarchical(num_data=20, num_blocks=4)
    poisoned = problem.blocks[2][3]
    elbo = TraceMeanField_ELBO(num_particles=8, vectorize_particles=True)

    def loss(model, guide, idx):
        value = elbo.differentiable_loss(model, guide, idx)
        # Stands in for any numerical failure of a model on one block.
        return value * (float("nan") if poisoned in idx else 1.0)

    pdvi = PDVI(problem.model, problem.guide, pyro.optim.Adam({"lr": 0.05}), loss, blocks=problem.blocks)
    pdvi.step(problem.blocks[0])
    before_state = copy.deepcopy(pdvi.state_dict())
    before_store = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    with pytest.warns(UserWarning, match="solved again with every step size halved, now 0.125"):
        with pytest.raises(NonFiniteStepError, match="block 2 produced a non-finite") as error:
            pdvi.step(problem.blocks[2])
    assert f"eta=AutoStepSize(scale={pdvi.auto_step_size.scale / 2:g})" in str(error.value)
    assert f"tried {REFUSED_STEP_RETRIES + 1} times" in str(error.value)
    after_state = pdvi.state_dict()
    assert after_state["num_steps"] == before_state["num_steps"]
    assert after_state["step_sizes"]["damping"] == after_state["guard"]["damping"] == 1.0
    for key, value in before_state["consensus_state"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(after_state["consensus_state"][key], value), key
    for name, value in pyro.get_param_store().items():
        assert torch.equal(value.detach(), before_store[name]), name
    pdvi.step(problem.blocks[1])  # other blocks still step
    assert pdvi.num_steps == 2


def test_refused_step_is_solved_again_with_halved_step_sizes(monkeypatch):
    """A block that fails while the step sizes are too large for it costs retries at halved
    step sizes, not the run: the step is taken at a quarter, the halving stays and is reported.
    (The first epoch's bound by the mean measured curvature, which each new block moves, is off:
    the step sizes are then compared with those of the step before.)"""
    monkeypatch.setattr(step_sizes, "START_CURVATURE_FLOOR", False)
    problem = Hierarchical(num_data=20, num_blocks=4)
    elbo = TraceMeanField_ELBO(num_particles=8, vectorize_particles=True)

    def loss(model, guide, idx):
        # Block 2 fails until the step sizes are at most 0.3 of their rule's.
        value = elbo.differentiable_loss(model, guide, idx)
        too_large = pdvi.diagnostics.get("damping", 1.0) > 0.3
        return value * float("nan") if bool((idx == problem.blocks[2][0]).any()) and too_large else value

    pdvi = PDVI(problem.model, problem.guide, pyro.optim.Adam({"lr": 0.05}), loss, blocks=problem.blocks)
    pdvi.step(problem.blocks[0])
    etas = pdvi.step_sizes
    with pytest.warns(UserWarning, match="block 2 produced a non-finite loss") as caught:
        loss_value = pdvi.step(problem.blocks[2])
    halvings = [str(w.message) for w in caught if "solved again" in str(w.message)]
    assert [m.split("now ")[1].split(" of")[0] for m in halvings] == ["0.5", "0.25"]
    assert math.isfinite(loss_value) and pdvi.num_steps == 2
    assert pdvi.diagnostics["damping"] == 0.25
    assert pdvi.state_dict()["step_sizes"]["damping"] == 0.25
    for group, eta in pdvi.step_sizes.items():
        assert eta == pytest.approx(etas[group] / 4, rel=1e-6), group
    assert torch.isfinite(pdvi.state.consensus).all()


def _pdvi(problem, **kwargs):
    kwargs.setdefault("blocks", problem.blocks)
    optim = kwargs.pop("optim", pyro.optim.Adam({"lr": 0.05}))
    loss = kwargs.pop("loss", TraceMeanField_ELBO(num_particles=8, vectorize_particles=True))
    return PDVI(problem.model, problem.guide, optim, loss, **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"optim": torch.optim.Adam}, "pyro.optim.PyroOptim"),
        ({"loss": TraceGraph_ELBO()}, "TraceGraph_ELBO has no differentiable_loss"),
        ({"blocks": [torch.arange(5), torch.arange(4, 20)]}, "blocks 0 and 1 share the indices"),
        ({"eta": -1.0}, "Invalid step size eta"),
        ({"eta": "fast"}, "Invalid step size eta"),
        ({"solver": lambda problem: None}, "solver must have a method solve"),
        ({"global_update": "mean"}, "Invalid global_update"),
    ],
)
def test_constructor_errors(kwargs, match):
    problem = Hierarchical(num_data=20, num_blocks=4)
    with pytest.raises(ValueError, match=match):
        _pdvi(problem, **kwargs)


@pytest.mark.parametrize(
    "groups, match",
    [
        ([{"sites": ["mu_loc"]}, {"sites": r"mu_.*"}], 'site "mu_loc" is in two preconditioner groups'),
        ([{"sites": ["nope"]}], "names sites that are not global params"),
        ([{"sites": r"zzz.*"}], "matches no global site"),
        ([{"sites": ["mu_loc"], "lr": 1}], "unknown keys"),
    ],
)
def test_group_errors_name_the_site(groups, match):
    problem = Hierarchical(num_data=20, num_blocks=4)
    pdvi = _pdvi(problem, groups=groups)
    with pytest.raises(ValueError, match=match):
        pdvi.step(problem.blocks[0])


def test_foreign_indices_are_named():
    problem = Hierarchical(num_data=20, num_blocks=4)
    pdvi = _pdvi(problem, solver=GenericSolver(inner_steps=3))
    with pytest.raises(ValueError, match="not a union of whole blocks: it holds 3 indices of block 1"):
        pdvi.step(torch.cat([problem.blocks[0], problem.blocks[1][:3]]))
    assert pdvi.num_steps == 0


def test_missing_data_plate_says_what_to_add():
    N = 10

    def model(idx):
        pyro.sample("x", dist.Normal(pyro.param("loc", torch.tensor(0.0)), 1.0), obs=torch.tensor(1.0))

    def guide(idx):
        pass

    pdvi = PDVI(
        model, guide, pyro.optim.Adam({"lr": 0.1}), Trace_ELBO(), blocks=list(torch.arange(N).chunk(2))
    )
    with pytest.raises(
        ValueError, match=r'no subsampled pyro.plate.*pyro.plate\("data", 10, subsample=idx\)'
    ):
        pdvi.step(torch.arange(5))


def test_per_datum_blocks_small_global_dimension():
    """Each datum its own block (the paper's per-sample variant)."""
    problem = Hierarchical(num_data=12, num_blocks=12, spread=1.0)
    loss = TraceMeanField_ELBO(num_particles=64, vectorize_particles=True)
    pdvi = _pdvi(problem, loss=loss, solver=GenericSolver(inner_steps=10))
    for _ in range(15):
        for b in torch.randperm(len(problem.blocks)).tolist():
            pdvi.step(problem.blocks[b])
    assert pdvi.state.duals.shape == (12, 2)
    assert abs(float(pyro.param("mu_loc")) - problem.posterior_mean_mu()) < 5e-2


def test_one_particle_monte_carlo_solve_warns():
    """particles=None solves with the user's one-particle ELBO: PDVI says what that does."""
    problem = Hierarchical(num_data=20, num_blocks=4)
    pdvi = _pdvi(problem, loss=Trace_ELBO(), particles=None, solver=GenericSolver(inner_steps=2), eta=0.1)
    with pytest.warns(UserWarning, match=r"the solve's loss draws one particle.*particles='auto'"):
        pdvi.step(problem.blocks[0])


def test_auto_eta_refuses_a_group_the_objective_ignores():
    problem = Hierarchical(num_data=20, num_blocks=4)

    def guide(idx):
        pyro.param("unused", torch.zeros(2))
        return problem.guide(idx)

    pdvi = PDVI(
        problem.model,
        guide,
        pyro.optim.Adam({"lr": 0.05}),
        TraceMeanField_ELBO(num_particles=4, vectorize_particles=True),
        blocks=problem.blocks,
        groups="per_site",
        solver=GenericSolver(inner_steps=2),
        eta=AutoStepSize(curvature_blocks=1, curvature_iterations=2),
    )
    with pytest.raises(ValueError, match=r"curvature of 0.0 for group 'unused'"):
        pdvi.step(problem.blocks[0])


def test_auto_global_update_warms_up_with_the_paper_rule_then_weighs_the_blocks():
    problem = Hierarchical(num_data=20, num_blocks=4)
    pdvi = PDVI(
        problem.model,
        problem.guide,
        pyro.optim.Adam({"lr": 0.05}),
        TraceMeanField_ELBO(num_particles=4, vectorize_particles=True),
        blocks=problem.blocks,
        solver=GenericSolver(inner_steps=3),
        warmup_epochs=1.5,
    )
    rules = []
    for b in [0, 1, 2, 3, 0, 1, 2, 3]:
        pdvi.step(problem.blocks[b])
        rules.append(pdvi.diagnostics["global_update"])
    # 1.5 epochs of 4 blocks: the first 6 block visits use the paper rule.
    assert rules == ["paper"] * 6 + ["weighted"] * 2
    # Every block was measured at its first visit, for the weighted rule's shares.
    assert bool((pdvi.state.information.sum(1) > 0).all())
    assert pdvi.state_dict()["block_visits"] == 8


def test_auto_global_update_keeps_the_paper_rule_for_a_deterministic_solve():
    problem = Hierarchical(num_data=20, num_blocks=4)
    guide = AutoDelta(problem.model, create_plates=lambda idx: pyro.plate("data", problem.N, subsample=idx))
    pdvi = PDVI(
        problem.model,
        guide,
        pyro.optim.Adam({"lr": 0.05}),
        Trace_ELBO(),
        blocks=problem.blocks,
        solver=GenericSolver(inner_steps=3),
        warmup_epochs=0,
    )
    for b in [0, 1, 2, 3]:
        pdvi.step(problem.blocks[b])
        assert pdvi.diagnostics["global_update"] == "paper"
    with pytest.raises(ValueError, match="warmup_epochs"):
        PDVI(problem.model, guide, pyro.optim.Adam({}), Trace_ELBO(), blocks=problem.blocks, warmup_epochs=-1)
