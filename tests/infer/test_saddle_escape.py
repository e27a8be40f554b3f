"""The saddle escape's trigger, the state's translation, the reduced Hessian's Lanczos, and the
check inside PDVI where it does and does not apply."""

import pyro
import pyro.distributions as dist
import pyro.optim
import pytest
import torch
from pyro.distributions import constraints
from pyro.infer import Trace_ELBO

from pyro_pdvi import PDVI
from pyro_pdvi.infer import saddle_escape
from pyro_pdvi.infer.consensus import ConsensusState
from pyro_pdvi.infer.reduced_hessian import lanczos
from pyro_pdvi.infer.saddle_escape import EscapeRound, SaddleEscape
from tests.toy_models import Hierarchical

NUM_DATA = 24
DATA = torch.linspace(-2.0, 3.0, NUM_DATA)


def test_the_first_check_waits_for_its_epoch_and_the_drift():
    """Due at :data:`FIRST_CHECK_EPOCH` with :data:`DRIFT_EPOCHS` + 1 epochs of history; after a
    check that moved the state, at twice its epoch; after one that did not, never."""
    escape = SaddleEscape()
    due = [
        escape.end_epoch(e, torch.full((3,), float(e))) for e in range(1, saddle_escape.FIRST_CHECK_EPOCH + 1)
    ]
    assert due == [False] * (saddle_escape.FIRST_CHECK_EPOCH - 1) + [True]
    lag = saddle_escape.DRIFT_EPOCHS
    assert torch.equal(escape.drift(), torch.full((3,), float(lag)))
    escape.checked(20, [EscapeRound(negative=1, smallest=-0.1, steps=[0.5])])
    assert escape.next_check == 40 and escape.history == []
    escape.checked(40, [EscapeRound(negative=0, smallest=0.2)])
    assert escape.next_check is None
    assert not any(escape.end_epoch(e, torch.zeros(3)) for e in range(41, 200))
    assert [c["epoch"] for c in escape.checks] == [20, 40]
    steep = SaddleEscape()
    steep.checked(20, [EscapeRound(negative=4, smallest=-2 * saddle_escape.STEEPEST_SADDLE)])
    assert steep.next_check == 40 and not steep.checks[0]["rounds"][0].moved


def test_translate_moves_consensus_copies_means_and_duals():
    state = ConsensusState(torch.tensor([1.0, 2.0]), 3, torch.ones(2))
    state.duals = torch.randn(3, 2)
    state.dual_mean = state.duals.mean(0)
    state.copies = torch.randn(3, 2)
    state.visited_sum, state.num_visited = state.copies.sum(0), torch.tensor(3.0)
    state.information, state.information_total = torch.ones(3, 2), torch.full((2,), 3.0)
    before = (state.consensus.clone(), state.copies.clone(), state.duals.clone(), state.estimate())
    move = torch.tensor([0.5, -1.0])
    state.translate(move)
    assert torch.equal(state.consensus, before[0] + move)
    assert torch.equal(state.copies, before[1] + move)
    assert torch.equal(state.duals, before[2])
    assert torch.allclose(state.estimate(), before[3] + move, atol=1e-15)
    assert torch.allclose(state.visited_sum / state.num_visited, (before[1] + move).mean(0), atol=1e-15)
    shift = torch.randn(3, 2)
    shift -= shift.mean(0)
    state.translate(torch.zeros(2), shift)
    assert torch.equal(state.duals, before[2] + shift)
    assert torch.allclose(state.estimate(), before[3] + move, atol=1e-15)  # h = H mean(mu) kept


def test_the_duals_follow_the_blocks_gradients_across_a_jump():
    """The hierarchical toy's gradient in mu's mean is linear in the means (antithetic pairs cancel
    the scales' terms): a jump of mu's mean by v, the rows solved there, changes block b's gradient
    by ``|b| v (1/tau^2 + 1/(N s0^2)) - sum_{i in b} dtheta_i / tau^2``, and its dual must move by
    minus that, less its mean over the blocks; by nothing on the coordinates the jump leaves."""
    problem = Hierarchical(num_data=30, num_blocks=3)
    algo = PDVI(
        problem.model, problem.guide, pyro.optim.Adam({"lr": 0.1}), Trace_ELBO(), blocks=problem.blocks
    )
    for block in problem.blocks:
        algo.step(block)
    block_args = {b: ((block,), {}) for b, block in enumerate(problem.blocks)}
    seeds = [11, 12, 13]
    schurs = [algo._block_schur(b, seeds[b], *block_args[b]) for b in range(3)]
    score = saddle_escape.TrialScorer(algo, schurs, block_args, seeds)
    mu_loc = algo.layout.slices["mu_loc"]
    best, v = score.point.clone(), 0.7
    best[mu_loc] += v
    _, solved = score(best)
    coordinates = torch.arange(algo.layout.size)[mu_loc]
    shift = score.dual_shift(best, solved, coordinates)

    theta = pyro.param("theta_loc").detach()
    moved_theta = torch.stack(
        [(rows["theta_loc"].reshape(-1) - theta[idx.reshape(-1)]).sum() for idx, rows in solved]
    )
    assert bool((moved_theta.abs() > 1e-3).all())  # the rows did follow
    size = len(problem.blocks[0])
    change = size * v * (1 / problem.tau**2 + 1 / (problem.N * problem.s0**2)) - moved_theta / problem.tau**2
    expected = -(change - change.mean())
    assert torch.allclose(shift[:, mu_loc].reshape(-1), expected, rtol=1e-9, atol=1e-12)
    others = torch.ones(algo.layout.size, dtype=torch.bool)
    others[mu_loc] = False
    assert torch.equal(shift[:, others], torch.zeros_like(shift[:, others]))


def test_lanczos_finds_the_most_negative_eigenvalues():
    """On a symmetric matrix with three negative eigenvalues well apart from the rest, 25
    iterations in 60 dimensions give them to 1e-8 and their eigenvectors (cosines above 1 - 1e-8);
    started in their span, three iterations give them to 1e-10, and from a random start they do
    not."""
    rotation, _ = torch.linalg.qr(torch.randn(60, 60, generator=torch.Generator().manual_seed(0)))
    spectrum = torch.cat([torch.tensor([-3.0, -2.0, -1.0]), torch.linspace(1, 2, 57)])
    matrix = rotation @ torch.diag(spectrum) @ rotation.T
    values, vectors = lanczos(lambda v: matrix @ v, 60, 25, seed=1)
    assert torch.allclose(values[:3], spectrum[:3], atol=1e-8)
    assert bool((torch.linalg.svdvals(vectors[:, :3].T @ rotation[:, :3]) > 1 - 1e-8).all())
    start = rotation[:, :3] @ torch.tensor([1.0, 2.0, 3.0])
    values, _ = lanczos(lambda v: matrix @ v, 60, 3, seed=1, start=start)
    assert torch.allclose(values, spectrum[:3], atol=1e-10)
    values, _ = lanczos(lambda v: matrix @ v, 60, 3, seed=1)
    assert not torch.allclose(values, spectrum[:3], atol=1e-2)
    values, _ = lanczos(lambda v: matrix @ v, 60, 25, seed=1, start=torch.zeros(60))  # zero: random
    assert torch.allclose(values[:3], spectrum[:3], atol=1e-8)
    calls = []
    values, vectors = lanczos(lambda v: calls.append(1) or matrix @ v, 60, 25, seed=1, stop_below=-1.5)
    assert len(calls) < 25 and len(values) == len(calls) == vectors.shape[1]  # stopped early
    assert values[0] < -1.5 and values[0] >= spectrum[0] - 1e-12  # a Ritz value bounds the spectrum


def test_reduced_hessian_of_a_quadratic_model_is_its_schur_complement():
    """The hierarchical toy (mu global, theta_i a latent per datum) is quadratic in the means, so
    at any point and noise (antithetic pairs cancel the means' cross terms with the local scales)
    the Hessian in mu's mean with every theta_i's mean at its optimum is N / (tau^2 + sigma^2) +
    1 / s0^2, and with them held N / tau^2 + 1 / s0^2: what the block-by-block Schur complement
    must sum to, whatever rows the epoch left."""
    problem = Hierarchical(num_data=30, num_blocks=3)
    optim = pyro.optim.Adam({"lr": 0.1})
    algo = PDVI(problem.model, problem.guide, optim, Trace_ELBO(), blocks=problem.blocks)
    for block in problem.blocks:
        algo.step(block)
    coordinate = torch.arange(algo.layout.size)[algo.layout.slices["mu_loc"]]
    schurs = [algo._block_schur(b, b, (problem.blocks[b],), {}) for b in range(len(problem.blocks))]
    reduced, fixed = (sum(parts) for parts in zip(*(s.reduced(torch.eye(1), coordinate) for s in schurs)))
    prior = 1 / problem.s0**2
    assert float(reduced) == pytest.approx(problem.N / (problem.tau**2 + problem.sigma**2) + prior, rel=1e-9)
    assert float(fixed) == pytest.approx(problem.N / problem.tau**2 + prior, rel=1e-9)
    assert max(s.separability for s in schurs) < 1e-12


def normal_means_model(idx):
    """A shared mean and a latent per datum: ``mu ~ N(0, 3)``, ``z_i ~ N(mu, 1)``, ``x_i ~ N(z_i,
    1/2)``; its reduced objective is a convex quadratic in the mean's loc."""
    mu = pyro.sample("mu", dist.Normal(0.0, 3.0))
    with pyro.plate("data", NUM_DATA, subsample=idx):
        z = pyro.sample("z", dist.Normal(mu, 1.0))
        pyro.sample("x", dist.Normal(z, 0.5), obs=DATA[idx])


def normal_means_guide(idx):
    loc = pyro.param("mu_loc", torch.tensor(0.0))
    scale = pyro.param("mu_scale", torch.tensor(1.0), constraint=constraints.positive)
    pyro.sample("mu", dist.Normal(loc, scale))
    with pyro.plate("data", NUM_DATA, subsample=idx):
        z_loc = pyro.param("z_loc", torch.zeros(NUM_DATA), event_dim=0)
        z_scale = pyro.param("z_scale", torch.ones(NUM_DATA), constraint=constraints.positive, event_dim=0)
        pyro.sample("z", dist.Normal(z_loc, z_scale))


def fit_normal_means(escape: bool, epochs: int) -> PDVI:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    blocks = list(torch.arange(NUM_DATA).split(6))
    pdvi = PDVI(
        normal_means_model, normal_means_guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO(), blocks=blocks
    )
    pdvi.escape_saddles = escape
    for _ in range(epochs):
        for block in blocks:
            pdvi.step(block)
    return pdvi


def test_a_convex_model_is_checked_once_and_left_as_it_was(monkeypatch):
    """Where the reduced objective is convex the check finds no negative curvature, moves nothing
    and is not repeated (the blocks' step arguments are no longer kept): every param equals that
    of the same run without the escape."""
    monkeypatch.setattr(saddle_escape, "FIRST_CHECK_EPOCH", 3)
    monkeypatch.setattr(saddle_escape, "DRIFT_EPOCHS", 2)
    pdvi = fit_normal_means(True, 8)
    (check,) = pdvi.diagnostics["saddle_escape"]
    assert check["epoch"] == 3 and check["rounds"][0].negative == 0 and check["rounds"][0].smallest > 0
    assert check["seconds"] > 0
    assert pdvi._saddle.next_check is None and pdvi._step_args == {}
    with_check = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    fit_normal_means(False, 8)
    for name, value in pyro.get_param_store().items():
        assert torch.equal(value.detach(), with_check[name]), name


def test_the_escape_names_why_it_does_not_apply():
    pdvi = fit_normal_means(False, 1)
    assert pdvi.diagnostics["saddle_escape"] == "off (PDVI.escape_saddles)"

    def global_model(idx):
        mu = pyro.sample("mu", dist.Normal(0.0, 3.0))
        with pyro.plate("data", NUM_DATA, subsample=idx):
            pyro.sample("x", dist.Normal(mu, 1.0), obs=DATA[idx])

    def global_guide(idx):
        pyro.sample("mu", dist.Normal(pyro.param("loc", torch.tensor(0.0)), 1.0))

    blocks = list(torch.arange(NUM_DATA).split(6))
    pdvi = PDVI(global_model, global_guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO(), blocks=blocks)
    pdvi.step(blocks[0])
    assert pdvi.diagnostics["saddle_escape"] == "no local rows that the solves fit"
    assert pdvi._step_args == {}


def test_the_escape_state_is_saved_and_restored(monkeypatch):
    monkeypatch.setattr(saddle_escape, "FIRST_CHECK_EPOCH", 3)
    monkeypatch.setattr(saddle_escape, "DRIFT_EPOCHS", 2)
    pdvi = fit_normal_means(True, 2)
    saved = pdvi.state_dict()
    assert len(saved["saddle_escape"]["history"]) == 2 and saved["saddle_escape"]["next_check"] == 3
    other = fit_normal_means(True, 1)
    other.load_state_dict(saved)
    assert other._saddle.next_check == 3
    assert all(torch.equal(a, b) for a, b in zip(other._saddle.history, pdvi._saddle.history))


def test_a_check_that_raises_is_recorded_and_not_repeated(monkeypatch):
    """A model without second derivatives (here: a check made to raise) leaves the run as it was,
    its reason in the diagnostics, and no check after it."""
    from pyro_pdvi.infer import pdvi as pdvi_module

    def no_second_derivative(*args, **kwargs):
        raise RuntimeError("derivative for an op is not implemented")

    monkeypatch.setattr(saddle_escape, "FIRST_CHECK_EPOCH", 3)
    monkeypatch.setattr(saddle_escape, "DRIFT_EPOCHS", 2)
    monkeypatch.setattr(pdvi_module, "run_check", no_second_derivative)
    pdvi = fit_normal_means(True, 8)
    (check,) = pdvi.diagnostics["saddle_escape"]
    assert check["epoch"] == 3 and "not implemented" in check["failed"]
    assert pdvi._saddle.next_check is None
    with_check = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    fit_normal_means(False, 8)
    for name, value in pyro.get_param_store().items():
        assert torch.equal(value.detach(), with_check[name]), name
