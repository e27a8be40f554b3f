"""The generic suite (benchmarks/suite.py): a smoke run of main() at tiny
size, and exact tests of every reference the suite measures against (float64)."""

import json
import math

import pyro
import pytest
import torch
from pyro.infer import Trace_ELBO
from torch.distributions import biject_to

pytest.importorskip("sklearn")
scipy = pytest.importorskip("scipy")

from benchmarks import suite as suite  # noqa: E402
from benchmarks.generic_suite import models, references, report  # noqa: E402
from benchmarks.generic_suite.baselines import Fitter, Method, summarise_saddle_checks  # noqa: E402
from benchmarks.generic_suite.metrics import (  # noqa: E402
    Scorer,
    align_columns,
    late_geometric_mean,
    procrustes_rotation,
)
from benchmarks.generic_suite.runner import RunResult, run_method  # noqa: E402

F64 = torch.float64

#: Small versions of each model with a closed form (the MC test needs few data for a small error).
SMALL = {
    "logreg": lambda: models.LogisticRegression(F64, num_data=12, num_blocks=3),
    "ppca": lambda: models.PPCA(F64, num_data=6, num_blocks=2),
    "mixed": lambda: models.MixedEffects(F64, num_groups=2),
    "hier": lambda: models.HierarchicalNormal(F64, num_data=6, num_blocks=2),
    "scale": lambda: models.NormalScale(F64, num_data=12, num_blocks=3),
    "odlogit": lambda: models.OverdispersedLogistic(F64, num_data=12, num_blocks=3),
    "biglogreg": lambda: models.LargeLogisticRegression(F64, num_data=12, num_blocks=3),
    "ppca_cancer": lambda: models.PPCA(F64, num_data=8, num_blocks=2, dataset="breast_cancer"),
    "robust": lambda: models.RobustRegression(F64, num_data=12, num_blocks=3),
    "poisson": lambda: models.PoissonRandomIntercept(F64, num_data=12, num_sites=3, num_blocks=3),
    "negbin": lambda: models.NegativeBinomialRandomIntercept(F64, num_sites=3, rows_per_site=4),
    "poisson_slopes": lambda: models.PoissonRandomSlopes(F64, num_data=12, num_sites=3, num_blocks=3),
    "poisson_crossed": lambda: models.PoissonCrossedIntercepts(
        F64, num_data=12, num_sites=3, num_periods=4, num_blocks=3
    ),
    "poisson_nested": lambda: models.PoissonNestedIntercepts(
        F64, num_data=12, num_sites=4, num_regions=2, num_blocks=3
    ),
    "poisson_nested100": lambda: models.PoissonNestedIntercepts(
        F64, num_data=12, num_sites=4, num_regions=3, num_blocks=3, name="poisson_nested100"
    ),
    "poisson_crossed200": lambda: models.PoissonCrossedIntercepts(
        F64, num_data=12, num_sites=3, num_periods=6, num_blocks=3, name="poisson_crossed200"
    ),
    "poisson_nested_slopes": lambda: models.PoissonNestedSlopes(
        F64, num_data=12, num_sites=4, num_regions=2, num_blocks=3
    ),
    "poisson_three_levels": lambda: models.PoissonThreeLevels(
        F64, num_data=12, num_sites=4, num_regions=3, num_countries=2, num_blocks=3
    ),
}


def set_params(values: dict[str, torch.Tensor]) -> None:
    """Write constrained ``values`` into the param store (through each param's constraint)."""
    store = pyro.get_param_store()
    constraints = store.get_state()["constraints"]
    params = dict(store.named_parameters())
    with torch.no_grad():
        for name, value in values.items():
            params[name].copy_(biject_to(constraints[name]).inv(value))


def random_params(problem) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    out = {}
    for name, value in references.initial_params(problem).items():
        if references.is_scale(name):
            out[name] = 0.05 + 0.5 * torch.rand(value.shape, generator=generator, dtype=F64)
        else:
            out[name] = value + 0.5 * torch.randn(value.shape, generator=generator, dtype=F64)
    return out


# --------------------------------------------------------------------------- (a) smoke


def test_main_tiny(tmp_path):
    argv = ["--models", "logreg,scale", "--seeds", "0", "--budget-seconds", "0.3", "--checkpoints", "0.1",
            "--svi-lrs", "0.1", "--pdvi-configs", "defaults", "--eta-grid", "eta1",
            "--evals-per-budget", "6"]  # fmt: skip
    out = suite.main(suite.parse_args([*argv, "--out", str(tmp_path)]))
    labels = {(r.model, r.label) for r in out["results"]}
    assert labels == {
        (m, label)
        for m in ("logreg", "scale")
        for label in ("SVI Adam lr=0.1", "SVI Adam lr=0.1/(1+epoch/10)", "PDVI defaults", "PDVI eta1")
    }
    for r in out["results"]:
        assert r.history[0]["epoch"] == 0 and r.history[0]["seconds"] == 0
        # Only the steps (and the decaying schedule's scheduler steps) are on the clock.
        assert r.step_seconds and 0 <= r.seconds - sum(r.step_seconds) < 0.05
        # Every method starts from the same params: the same metrics at epoch 0.
        first = next(s for s in out["results"] if s.model == r.model).history[0]
        assert r.history[0] == first
    for name in ("report.md", "history.csv", "runs.csv", "accuracy.csv", "cost.csv", "eta.csv"):
        assert (tmp_path / name).exists()
    assert "best SVI" in (tmp_path / "report.md").read_text()
    # eta="auto" against the grid, at the end and over the last half of the budget.
    for row in out["eta"]:
        assert set(row["fixed_late"]) == {1.0} and row["best_fixed_eta_late"] == 1.0
        assert row["auto_late"] > 0 and row["best_fixed_error_late"] > 0
    # The report made again from the CSVs has the same numbers.
    again = suite.main(
        suite.parse_args([*argv, "--report-from", str(tmp_path), "--out", str(tmp_path / "again")])
    )
    # README's standing: defaults over the best SVI, per metric and checkpoint, and the report's table.
    for row in out["standing"]:
        assert row["metrics"] == ("rmse_mean", "sd_error", "elbo_gap") and list(row["ratios"]) == [0.1, 0.3]
        groups = {r.label: [r] for r in out["results"] if r.model == row["model"]}
        best = min(report.mean_at(groups[k], "sd_error", seconds=0.3) for k in groups if k.startswith("SVI"))
        defaults = report.mean_at(groups["PDVI defaults"], "sd_error", seconds=0.3)
        assert row["ratios"][0.3][1] == pytest.approx(defaults / best)
    assert "## Where it stands" in (tmp_path / "report.md").read_text()
    for key in (
        "accuracy",
        "cost",
        "eta",
        "standing",
    ):  # (NaN set-ups of one-step runs compare equal as JSON)
        assert json.dumps(again[key]) == json.dumps(out[key]), key
    # PDVI's saddle escape does not apply to these models (no latent per datum), and says why.
    for r, r_again in zip(out["results"], again["results"]):
        expected = "no local rows that the solves fit" if r.family == "PDVI" else []
        assert r.saddle_checks == r_again.saddle_checks == expected
    pytest.importorskip("matplotlib")
    assert (tmp_path / "logreg.png").exists() and (tmp_path / "scale.png").exists()
    assert torch.get_default_dtype() == F64  # main restores the default dtype


def test_the_late_level_is_the_geometric_mean_of_the_budgets_last_half():
    """Records from half the budget on, up to the budget: their geometric mean, one noisy record
    counting as one of many; a NaN or a zero is left out; none there gives the record in force
    over the last half (the last one before it); a metric no record has gives ``None``."""
    history = [{"seconds": float(s), "error": 1.0} for s in range(5)]
    history += [{"seconds": 5.0 + s, "error": 1e-8 if s % 2 else 1e-6} for s in range(6)]  # 5 .. 10
    history += [{"seconds": 7.5, "error": math.nan}, {"seconds": 8.5, "error": 0.0}]
    history += [{"seconds": 11.0, "error": 1.0}]  # past the budget
    assert late_geometric_mean(history, "error", 10.0) == pytest.approx(1e-7, rel=1e-12)
    assert late_geometric_mean(history, "error", 10.0, share=0.02) == pytest.approx(1e-8)
    assert late_geometric_mean(history, "other", 10.0) is None
    # Steps longer than the last half (a slow machine's first epochs): the record in force over it.
    slow = [{"seconds": 0.0, "error": 1.0}, {"seconds": 0.14, "error": 0.5}, {"seconds": 0.31, "error": 0.1}]
    assert late_geometric_mean(slow, "error", 0.3) == 0.5
    assert late_geometric_mean(slow[:1], "error", 0.3) == 1.0


def test_ppca_names_its_data_sets():
    """``ppca_cancer`` is the same PPCA on breast_cancer, each feature standardised; another
    data set is refused by name."""
    problem = models.make_problem("ppca_cancer", dtype=F64)
    assert problem.name == "ppca_cancer" and tuple(problem.x.shape) == (569, 30) and len(problem.blocks) == 20
    assert torch.allclose(problem.x.std(0), torch.ones(30, dtype=F64))
    assert float(problem.x.mean(0).abs().max()) < 1e-12
    with pytest.raises(ValueError, match="'digits' or 'breast_cancer', not 'iris'"):
        models.PPCA(F64, dataset="iris")


def test_the_saddle_checks_are_summarised_for_runs_csv_and_the_report():
    """``diagnostics["saddle_escape"]``'s checks as plain numbers (JSON both ways), and the
    report's cell per run."""
    from pyro_pdvi.infer.saddle_escape import EscapeRound

    checks = [
        {
            "epoch": 20,
            "rounds": [EscapeRound(2, -0.0123, [1.1, 0.0]), EscapeRound(0, 0.003)],
            "seconds": 7.0512,
        },
        {"epoch": 40, "rounds": [], "failed": "RuntimeError: no double backward", "seconds": 0.1},
    ]
    summary = summarise_saddle_checks(checks)
    assert summary == [
        {"epoch": 20, "seconds": 7.051, "rounds": [[2, -0.0123, True], [0, 0.003, False]]},
        {"epoch": 40, "seconds": 0.1, "rounds": [], "failed": "RuntimeError: no double backward"},
    ]
    assert json.loads(json.dumps(summary)) == summary
    assert summarise_saddle_checks("off (PDVI.escape_saddles)") == "off (PDVI.escape_saddles)"
    run = RunResult("ppca", "PDVI", "defaults", 0, saddle_checks=summary)
    other = RunResult("ppca", "PDVI", "no_escape", 0, saddle_checks="off (PDVI.escape_saddles)")
    table = report.saddle_checks_table([run, other]).splitlines()
    assert len(table) == 3 and "no_escape" not in table[2]
    assert table[2] == (
        "| ppca | PDVI defaults | 0 | 20 (7.05 s): 2, -0.012, moved; 0, 0.003 / "
        "40 (0.10 s): - failed: RuntimeError: no double backward |"
    )


class Recorder:
    """A stand-in algorithm that records the blocks it is stepped on."""

    def __init__(self, problem) -> None:
        self.problem, self.seen = problem, []

    def step(self, idx) -> float:
        self.seen.append(next(b for b, block in enumerate(self.problem.blocks) if torch.equal(block, idx)))
        return 0.0


def test_every_method_sees_the_same_block_order():
    problem = SMALL["logreg"]()
    scorer = Scorer(problem, references.compute_reference(problem))
    recorders = []

    def build(problem, guide):
        recorders.append(Recorder(problem))
        return Fitter(recorders[-1])

    for config in ("a", "b"):
        run_method(problem, Method("SVI", config, build), scorer, 3, math.inf, 4, math.inf)
    first, second = (r.seen for r in recorders)
    assert first == second and len(first) == 4 * len(problem.blocks)
    epochs = [first[i : i + 3] for i in range(0, 12, 3)]
    assert all(sorted(e) == [0, 1, 2] for e in epochs) and len({tuple(e) for e in epochs}) > 1


def test_svi_run_is_reproducible():
    problem = SMALL["hier"]()
    scorer = Scorer(problem, references.compute_reference(problem))
    method = suite.svi_adam(0.05)
    runs = [run_method(problem, method, scorer, 0, math.inf, 3, math.inf) for _ in range(2)]
    strip = [[{k: v for k, v in row.items() if k != "seconds"} for row in r.history] for r in runs]
    assert strip[0] == strip[1] and len(strip[0]) == 4


def test_run_records_a_raising_step():
    problem = SMALL["logreg"]()
    scorer = Scorer(problem, references.compute_reference(problem))

    class Failing:
        def step(self, idx):
            raise RuntimeError("boom")

    result = run_method(problem, Method("PDVI", "x", lambda p, g: Fitter(Failing())), scorer, 0, 1.0, 2, 1.0)
    assert result.status.startswith("raised RuntimeError at step 1: boom")


# --------------------------------------------------------------------------- (b) the closed forms


@pytest.mark.filterwarnings("ignore:The occurrence of roundoff error")  # scipy's quad; the bound holds
@pytest.mark.parametrize("mean, variance", [(0.5, 0.01), (2.0, 1.0), (-3.0, 6.0), (5.0, 25.0), (0.0, 100.0)])
def test_expected_log_sigmoid_matches_adaptive_quadrature(mean, variance):
    from scipy.integrate import quad
    from scipy.special import log_expit

    sd = math.sqrt(variance)
    exact = quad(
        lambda u: log_expit(mean + sd * u) * math.exp(-0.5 * u * u) / math.sqrt(2 * math.pi),
        -40,
        40,
        points=[-mean / sd],
        epsabs=1e-14,
        epsrel=1e-14,
        limit=500,
    )[0]
    value = references.expected_log_sigmoid(torch.tensor(mean, dtype=F64), torch.tensor(variance, dtype=F64))
    assert float(value) == pytest.approx(exact, abs=1e-11)


@pytest.mark.parametrize("prior", ["lognormal", "halfnormal"])
def test_lognormal_site_terms_match_quadrature(prior):
    """``E_q log p(tau) + H(q(tau))`` of a LogNormal q, against direct integration over log tau."""
    from scipy.integrate import quad
    from scipy.stats import halfnorm, lognorm, norm

    loc, scale, prior_scale = 0.3, 0.4, 1.5
    log_p = {
        "lognormal": lambda tau: lognorm.logpdf(tau, prior_scale),
        "halfnormal": lambda tau: halfnorm.logpdf(tau, scale=prior_scale),
    }[prior]

    def integrand(u):  # over u = log tau; q(tau) = N(u; loc, scale) / tau
        tau = math.exp(u)
        return norm.pdf(u, loc, scale) * (log_p(tau) - (norm.logpdf(u, loc, scale) - u))

    exact = quad(integrand, loc - 12 * scale, loc + 12 * scale, epsabs=1e-13, epsrel=1e-13)[0]
    value = references.lognormal_site_terms(
        torch.tensor([loc], dtype=F64), torch.tensor([scale], dtype=F64), prior, prior_scale
    )
    assert float(value) == pytest.approx(exact, abs=1e-10)


@pytest.mark.parametrize("name", list(SMALL))
def test_closed_form_matches_monte_carlo_of_trace_elbo(name):
    """The closed form is the expectation of Pyro's ``Trace_ELBO`` loss (full data) at random
    params: they agree within 5 standard errors of the Monte Carlo mean (the error estimated
    from 10 independent batches). The small data sets keep that error at ~0.1% of the value."""
    problem = SMALL[name]()
    guide = problem.make_guide()
    problem.initialise(guide, problem.blocks[0])
    params = random_params(problem)
    set_params(params)
    closed = float(references.neg_elbo(problem, params))
    particles = 2000 if name.startswith("ppca") else 50_000
    loss = Trace_ELBO(num_particles=particles, vectorize_particles=True, max_plate_nesting=1)
    batches = torch.tensor([loss.loss(problem.model, guide, None) for _ in range(10)])
    error = float(batches.std()) / math.sqrt(len(batches))
    assert error < 2e-3 * abs(closed)
    assert abs(closed - float(batches.mean())) < 5 * error


# --------------------------------------------------------------------------- (b) the reference solvers


@pytest.mark.parametrize("name", list(SMALL))
def test_reference_is_stationary_and_scores_zero(name):
    problem = SMALL[name]()
    reference = references.compute_reference(problem)
    objective = references.Unconstrained(problem, reference.params)
    _, grad = objective.value_and_grad(objective.flatten(reference.params))
    assert float(grad.norm()) < 1e-8 and reference.grad_norm < 1e-8
    init = references.initial_params(problem)
    assert reference.neg_elbo < float(references.neg_elbo(problem, init))
    # The scorer gives zero error at the reference itself.
    problem.initialise(problem.make_guide(), problem.blocks[0])
    set_params(reference.params)
    metrics = Scorer(problem, reference)()
    for key in ("rmse_mean", "rmse_mean_rotated", "sd_error", "elbo_gap", "elbo_gap_resolved", "mu_error"):
        if key in metrics:
            assert abs(metrics[key]) < 1e-9, key
    assert metrics["min_sd_ratio"] == pytest.approx(1.0, abs=1e-9) == metrics["max_sd_ratio"]


def test_hierarchical_reference_is_the_exact_mean_field_optimum():
    problem = models.HierarchicalNormal(F64, num_data=40, num_blocks=4)
    reference = references.compute_reference(problem).params
    x, n = problem.data["x"], problem.num_data
    noise_var = problem.noise_scale**2
    # Gaussian target: mean-field means are the exact posterior means, sds the inverse root
    # of the joint precision's diagonal.
    precision_mu = 1 / problem.prior_scale**2 + n
    exact_mean = float(x.sum() / (1 + noise_var) / (1 / problem.prior_scale**2 + n / (1 + noise_var)))
    assert float(reference["AutoNormal.locs.mu"]) == pytest.approx(exact_mean, abs=1e-10)
    assert float(reference["AutoNormal.scales.mu"]) == pytest.approx(precision_mu**-0.5, rel=1e-10)
    theta_sd = (1 + 1 / noise_var) ** -0.5
    assert torch.allclose(reference["AutoNormal.scales.theta"], torch.full_like(x, theta_sd), rtol=1e-10)
    theta_mean = (x / noise_var + exact_mean) / (1 / noise_var + 1)
    assert torch.allclose(reference["AutoNormal.locs.theta"], theta_mean, atol=1e-10)


def test_ppca_cavi_fixed_point_is_the_lbfgs_optimum():
    """CAVI + Newton (the reference) and plain L-BFGS on the joint closed form, from the same
    start, reach the same point; one CAVI sweep leaves the reference where it is."""
    problem = models.PPCA(F64, num_data=40, num_blocks=4)
    reference = references.compute_reference(problem)
    swept, _ = references.ppca_cavi(problem, reference.params, max_sweeps=1)
    for key, value in swept.items():
        assert torch.allclose(value, reference.params[key], atol=1e-9), key
    objective = references.Unconstrained(problem, reference.params)
    joint = objective.unflatten(
        references.lbfgs(objective, objective.flatten(references.initial_params(problem)))
    )
    assert float(references.neg_elbo(problem, joint)) == pytest.approx(reference.neg_elbo, rel=1e-10)
    # The same optimum up to the order and signs of the components, which the ELBO does not see.
    # Joint L-BFGS stops (its line search at float64 round-off) ~1e-4 off along the flattest
    # direction, which changes the -ELBO by ~1e-9 only: hence the looser tolerance.
    order, signs = align_columns(joint["W_loc"], reference.params["W_loc"])
    assert torch.allclose(joint["W_loc"][:, order] * signs, reference.params["W_loc"], atol=1e-3)
    assert torch.allclose(joint["W_scale"][:, order], reference.params["W_scale"], atol=1e-3)
    assert torch.allclose(joint["z_loc"][:, order] * signs, reference.params["z_loc"], atol=1e-3)


def test_procrustes_undoes_a_rotation_and_never_exceeds_the_column_match():
    generator = torch.Generator().manual_seed(0)
    reference = torch.randn(64, 5, generator=generator, dtype=F64)
    rotation, _ = torch.linalg.qr(torch.randn(5, 5, generator=generator, dtype=F64))
    rotated = reference @ rotation.T
    assert torch.allclose(rotated @ procrustes_rotation(rotated, reference), reference, atol=1e-12)
    # A permutation with signs is one orthogonal matrix among all: the rotated error is at most
    # the column-matched one, and strictly less for a rotation that is not such a matrix.
    noisy = rotated + 0.1 * torch.randn(64, 5, generator=generator, dtype=F64)
    order, signs = align_columns(noisy, reference)
    matched = (noisy[:, order] * signs - reference).norm()
    assert (noisy @ procrustes_rotation(noisy, reference) - reference).norm() < matched


def test_gmm_reference_scores_zero():
    problem = models.GMM(F64, num_data=600, block_size=100)
    reference = references.compute_reference(problem)
    assert "not converged" not in reference.method
    problem.initialise(problem.make_guide(), problem.blocks[0])
    set_params(reference.params)
    metrics = Scorer(problem, reference)()
    assert metrics["w2_ratio"] == pytest.approx(1.0, abs=1e-12)
    assert metrics["min_sd_ratio"] == pytest.approx(1.0, abs=1e-12) == metrics["max_sd_ratio"]
    assert abs(metrics["elbo_gap"]) < 1e-12 and abs(metrics["elbo_gap_resolved"]) < 1e-9


def test_gmm_user_particles_set_the_users_elbo():
    """``--gmm-user-particles``: one is Pyro's default ELBO (not vectorized), more are vectorized;
    the other settings stay."""
    problem = models.GMM(F64, num_data=600, block_size=100)
    problem.set_user_particles(1)
    loss = problem.make_loss()
    assert loss.num_particles == 1 and not loss.vectorize_particles and loss.max_plate_nesting == 1
    problem.set_user_particles(4)
    loss = problem.make_loss()
    assert loss.num_particles == 4 and loss.vectorize_particles
    assert "num_particles=4" in problem.loss_name
    with pytest.raises(ValueError, match="particles"):
        problem.set_user_particles(0)
    args = suite.parse_args([])
    assert args.gmm_user_particles == 16 and args.user_particles is None


def test_large_logistic_regression_is_a_sorted_synthetic_data_set():
    problem = models.make_problem("biglogreg", quick=True, dtype=F64)
    assert problem.num_data == 10_000 and len(problem.blocks) == 10 and problem.x.shape == (10_000, 21)
    assert torch.equal(torch.cat(problem.blocks).sort().values, torch.arange(10_000))
    labels = [set(problem.y[block].tolist()) for block in problem.blocks]
    assert labels[0] == {0.0} and labels[-1] == {1.0}  # sorted by label: non-i.i.d. blocks
    assert 0.2 < float(problem.y.mean()) < 0.8
    again = models.make_problem("biglogreg", quick=True, dtype=F64)
    assert torch.equal(again.x, problem.x) and torch.equal(again.y, problem.y)  # its own seed
