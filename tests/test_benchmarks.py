"""Every benchmark runs end to end at a tiny size, and its --help explains every option."""

import csv
import json
import math
import re
import subprocess
import sys
import zipfile

import pytest
import torch

from tests.scripts import BENCHMARKS, ROOT, load_script, undocumented_options

#: The benchmark scripts of this file (``benchmark_*.py`` have tests of their own).
SCRIPTS = sorted(
    p for p in BENCHMARKS.glob("*.py") if p.stem != "common" and not p.stem.startswith("benchmark_")
)


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_every_option_has_help(path, monkeypatch):
    assert undocumented_options(load_script(path), monkeypatch) == []


def test_epoch_loop_gives_every_method_the_same_block_orders():
    common = load_script(BENCHMARKS / "common.py")

    class Recorder:
        def __init__(self):
            self.seen = []

        def step(self, block):
            self.seen.append(int(block[0]))

    blocks = [torch.tensor([b]) for b in range(6)]
    first, rows = common.run_epochs(Recorder, blocks, 3, seed=1, evaluate=lambda epoch: {"x": epoch})
    second, _ = common.run_epochs(Recorder, blocks, 3, seed=1)
    other, _ = common.run_epochs(Recorder, blocks, 3, seed=2)
    assert first.seen == second.seen != other.seen
    assert [sorted(first.seen[i : i + 6]) for i in (0, 6, 12)] == [list(range(6))] * 3
    assert [row["x"] for row in rows] == [1, 2, 3] and rows[0]["seconds"] <= rows[-1]["seconds"]
    stopped, rows = common.run_epochs(Recorder, blocks, 3, seed=1, callback=lambda row: row["epoch"] == 2)
    assert len(rows) == 2 and len(stopped.seen) == 12


# --------------------------------------------------------------------------- the GMM benchmarks

FLAGSHIP_TINY = [
    "--num-data", "120", "--num-components", "3", "--dim", "2", "--block-size", "40", "--purities", "0.95",
    "--seeds", "0,1", "--epochs", "2", "--particles", "2", "--adam-lrs", "0.05", "--rmsprop-lrs", "0.05",
    "--sgd-lrs", "0.5", "--ng-decaying", "1:0.7", "--ng-constant", "0.1,0.3", "--generic-num-data", "80",
    "--generic-epochs", "1", "--inner-steps", "2", "--curvature-blocks", "1", "--curvature-iterations", "2",
    "--sweeps", "2", "--quiet",
]  # fmt: skip


def test_gmm_biased_batches_tiny(tmp_path):
    module = load_script(BENCHMARKS / "gmm_biased_batches.py")
    table = module.main(module.parse_args(FLAGSHIP_TINY + ["--out", str(tmp_path)]))
    assert [row["method"] for row in table] == list(module.METHODS)
    with open(tmp_path / "gmm_biased_batches_table.csv") as f:
        assert [row["method"] for row in csv.DictReader(f)] == list(module.METHODS)
    with open(tmp_path / "gmm_biased_batches.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["purity", "seed", "num_data", "method", "setting", "epoch", "seconds"] + [
        "w2", "w2_ratio", "gap", "gap_own", "ari", "cavi_w2"
    ]  # fmt: skip
    # Two seeds x 2 epochs for every run on the main data; the generic runs only on seed 0.
    assert len([r for r in rows if r["method"] == "NG-SVI constant"]) == 2 * 2 * 2
    assert {r["seed"] for r in rows if r["method"] == "PD-VI generic"} == {"0"}
    assert all(math.isfinite(float(r["gap"])) for r in rows)
    best = next(row for row in table if row["method"] == "NG-SVI constant")
    assert best["grid_size"] == 2 and best["seeds"] == 2
    with open(tmp_path / "gmm_biased_batches_progress.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)  # every epoch, as it came
    pytest.importorskip("matplotlib")
    assert (tmp_path / "gmm_biased_batches.png").stat().st_size > 0

    # Re-reading the per-epoch CSV (how parallel parts of one run are merged) gives the same table.
    merged = module.main(
        module.parse_args(
            ["--from-csv", str(tmp_path / "gmm_biased_batches.csv"), "--out", str(tmp_path / "m")]
        )
    )
    assert [row["method"] for row in merged] == [row["method"] for row in table]
    for old, new in zip(table, merged):
        assert new["final_w2"] == pytest.approx(old["final_w2"], rel=1e-12)
        assert new["epochs_to_1.1x_cavi_w2"] == old["epochs_to_1.1x_cavi_w2"]


def test_gmm_biased_batches_refuses_an_unknown_method(tmp_path):
    module = load_script(BENCHMARKS / "gmm_biased_batches.py")
    with pytest.raises(ValueError, match="--methods"):
        module.main(module.parse_args(["--methods", "SVI+Adamm", "--out", str(tmp_path)]))


@pytest.mark.parametrize("closed_form", [False, True], ids=["lbfgs", "closed_form"])
def test_gmm_generic_tiny(tmp_path, closed_form):
    module = load_script(BENCHMARKS / "gmm_generic.py")
    args = ["--num-data", "120", "--num-components", "3", "--dim", "2", "--block-size", "40", "--epochs", "2"]
    args += ["--svi-epochs", "2", "--lrs", "0.05", "--particles", "4", "--inner-steps", "3", "--quiet"]
    args += ["--curvature-blocks", "1", "--curvature-iterations", "2"]
    rows = module.main(
        module.parse_args(args + ["--out", str(tmp_path)] + (["--closed-form"] if closed_form else []))
    )
    assert [(row["method"], row["epoch"]) for row in rows if row["epoch"] == 2] == [
        ("PD-VI", 2), ("PD-VI", 2), ("PD-VI", 2), ("P2D-VI", 2), ("SVI+Adam", 2)
    ]  # fmt: skip
    with open(tmp_path / "gmm_generic.csv") as f:
        assert list(next(csv.DictReader(f))) == ["method", "setting", "epoch", "seconds", "gap", "w2_ratio"]
    pytest.importorskip("matplotlib")
    assert (tmp_path / "gmm_generic.png").exists()


def test_eta_auto_tiny():
    module = load_script(BENCHMARKS / "eta_auto.py")
    args = [
        "--num-data",
        "60",
        "--num-components",
        "2",
        "--block-size",
        "30",
        "--epochs",
        "2",
        "--etas",
        "0.01",
    ]
    results = module.main(module.parse_args(args + ["--remeasure", "1", "--curvatures", "--quiet"]))
    assert [r["label"] for r in results] == ["PD-VI auto, remeasure 1", "PD-VI eta=0.01"]
    assert all(len(r["history"]) == 2 for r in results)
    assert results[1]["etas"][-1] == {"default": 0.01}


def test_global_update_noise_tiny():
    module = load_script(BENCHMARKS / "global_update_noise.py")
    args = ["--num-data", "12", "--num-blocks", "3", "--particles", "4", "--epochs", "2", "--last", "1"]
    args += [
        "--seeds",
        "1",
        "--frozen",
        "--inner-steps",
        "5",
        "--curvature-blocks",
        "1",
        "--curvature-iterations",
        "2",
    ]
    rows = module.main(module.parse_args(args))
    methods = ["PDVI auto", "PDVI paper", "PDVI consensus", "SVI+Adam lr=0.05", "fixed-noise optimum"]
    assert [row["method"] for row in rows] == methods + [f"{m}, antithetic" for m in methods]
    # The fixed-noise optimum of a Gaussian target with antithetic pairs has the exact mean.
    assert rows[-1]["rms_error"] < 1e-8
    assert all(row["rms_error"] >= 0 and row["rms_scale_error"] >= 0 for row in rows)


def test_random_effects_consensus_tiny(tmp_path):
    """Exact block solves on the random-effects model's mean part: the paper's rule reaches the
    optimum (measured rms 0.010 after 40 epochs); the weighted rule lags it, 3.8x (0.038) since it
    follows the step's copy in the group effects (concentrated coordinates), 11x (0.11) before.
    Coupled with the intercept and slope after the first epoch (13l), both go far further:
    measured 3.6e-06 and 9.8e-05 after 40 epochs."""
    module = load_script(BENCHMARKS / "random_effects_consensus.py")
    args = ["--epochs", "40", "--layouts", "per_group", "--rules", "paper,weighted", "--bounds", "8"]
    args += ["--couplings", "none,measured"]
    rows = module.main(module.parse_args(args + ["--report-epochs", "40", "--out", str(tmp_path)]))
    last = {row["rule"]: row["rms_error"] for row in rows if row["epoch"] == 40}
    assert last["paper"] < 0.02
    assert last["paper"] < last["weighted"] < 0.05
    assert last["paper, coupled"] < 1e-4 and last["weighted, coupled"] < 1e-3
    assert (tmp_path / "random_effects_consensus.csv").exists()
    assert (tmp_path / "random_effects_consensus.png").exists()


def test_quadratic_tiny():
    module = load_script(BENCHMARKS / "quadratic.py")
    rows = module.main(
        module.parse_args(
            [
                "--eta-scales",
                "2",
                "--epochs",
                "12",
                "--tolerance",
                "1e-3",
                "--num-data",
                "8",
                "--num-blocks",
                "2",
            ]
        )
    )
    reached = {(row["scale_b"], row["groups"]): row["epochs"] for row in rows}
    assert reached[(1.0, None)] is not None and reached[(10.0, "per_site")] is not None
    assert reached[(10.0, None)] is None  # one step size for 100x-apart curvatures


def test_vectorized_blocks_tiny(tmp_path):
    module = load_script(BENCHMARKS / "vectorized_blocks.py")
    args = ["--configs", "2x20", "4x1", "--particles", "2", "--inner-steps", "2", "--eval-repeats", "1"]
    rows = module.main(module.parse_args(args + ["--out", str(tmp_path)]))
    assert [(r["blocks"], r["block_size"]) for r in rows] == [(2, 20), (4, 1)]
    assert all(row[key] > 0 for row in rows for key in module.COLUMNS)
    with open(tmp_path / "vectorized_blocks.csv") as handle:
        assert [row["blocks"] for row in csv.DictReader(handle)] == ["2", "4"]


def test_vectorized_blocks_lbfgs_comparison_tiny(tmp_path):
    module = load_script(BENCHMARKS / "vectorized_blocks.py")
    args = ["--compare-lbfgs", "--configs", "2x5", "--particles", "2", "--inner-steps", "3"]
    rows = module.main(
        module.parse_args(args + ["--reference-steps", "5", "--solve-repeats", "1", "--out", str(tmp_path)])
    )
    assert [r["solver"] for r in rows] == ["joint", "per-block"]
    # Per-block L-BFGS: the start and one evaluation per iteration; the joint one adds the final f_b.
    assert [r["evaluations_per_solve"] for r in rows] == [3 + 2, 3 + 1]
    for row in rows:
        assert row["s_per_solve"] > 0 and row["s_per_step"] > 0
        assert math.isfinite(row["max_abs_gap"]) and math.isfinite(row["max_lagrangian_gap"])
    with open(tmp_path / "vectorized_lbfgs.csv") as handle:
        assert [row["solver"] for row in csv.DictReader(handle)] == ["joint", "per-block"]


# --------------------------------------------------------------------------- the GPU benchmark


def test_gpu_benchmark_tiny_on_cpu(tmp_path):
    module = load_script(BENCHMARKS / "gpu.py")
    args = module.parse_args(
        [
            "--device", "cpu", "--points", "400", "--blocks", "4", "--dim", "2", "--components", "3",
            "--sweeps", "2", "--blocks-per-step", "1,2,all", "--inner-steps", "2", "--repeats", "1",
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    rows = module.main(args)
    assert not [row for row in rows if row["method"] in ("FAILED", "skipped")]
    sections = {
        "cavi",
        "closed-form",
        "engine",
        "generic",
        "generic-vmap",
        "generic-particles",
        "svi",
        "floor",
    }
    assert {row["section"] for row in rows} == sections
    by_particles = [row for row in rows if row["section"] == "generic-particles"]
    assert [row["note"].split(", ")[-1] for row in by_particles] == [
        "2 particles",
        "8 particles",
        "32 particles",
        "64 particles",
    ]
    # Blocks of 100 data on the CPU: "auto" counts what particles cost and draws fewer than 64.
    (generic,) = [row["note"].split(", ")[-1] for row in rows if row["section"] == "generic"]
    drawn = int(generic.split()[0])
    assert 2 <= drawn < 64 and drawn % 2 == 0
    epochs = [row for row in rows if row["section"] == "closed-form"]
    assert [row["blocks_per_step"] for row in epochs] == [1, 2, 4, 1, 2, 4]
    assert all(row["ms"] > 0 for row in epochs)
    with open(tmp_path / "gpu_benchmark.csv") as f:
        assert [row["method"] for row in csv.DictReader(f)] == [row["method"] for row in rows]


def test_gpu_benchmark_reports_a_failing_section_and_goes_on(tmp_path, monkeypatch):
    module = load_script(BENCHMARKS / "gpu.py")

    def broken(bench, setup):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(module, "run_cavi", broken)
    args = module.parse_args(
        ["--device", "cpu", "--points", "40", "--blocks", "2", "--dim", "2", "--components", "2",
         "--sections", "cavi,floor", "--repeats", "1", "--out", str(tmp_path)]
    )  # fmt: skip
    rows = module.main(args)
    assert rows[0]["section"] == "cavi" and rows[0]["method"] == "FAILED"
    assert "no such kernel" in rows[0]["note"]
    assert {row["section"] for row in rows[1:]} == {"floor"}


def test_gpu_benchmark_checks_its_arguments(tmp_path):
    module = load_script(BENCHMARKS / "gpu.py")
    # Without a GPU the default device is the CPU.
    assert module.parse_args([]).device == ("cuda" if torch.cuda.is_available() else "cpu")
    args = module.parse_args(["--device", "cpu", "--points", "41", "--blocks", "2", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--points 41 must be a multiple of --blocks 2"):
        module.main(args)


def fake_wheel(folder, name):
    """A minimal pure-Python wheel holding the module ``name``."""
    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    files = {
        f"{name}/__init__.py": "VALUE = 42\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{k},,\n" for k in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)
    return path


@pytest.mark.parametrize("pip_works", [True, False], ids=["pip", "unpack"])
def test_gpu_benchmark_installs_the_missing_wheels(tmp_path, monkeypatch, pip_works):
    module = load_script(BENCHMARKS / "gpu.py")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    name = f"pdvi_fake_{'pip' if pip_works else 'unpack'}"
    fake_wheel(wheels, name)
    fake_wheel(wheels, "torch")  # installed already: skipped
    if not pip_works:
        monkeypatch.setattr(
            module.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "no pip")
        )
    monkeypatch.setattr(sys, "path", list(sys.path))
    site = tmp_path / "site"
    assert module.install_wheels(str(wheels), str(site)) == [f"{name}-1.0-py3-none-any.whl"]
    assert sys.path[-1] == str(site)
    assert __import__(name).VALUE == 42
    assert not (site / "torch").exists()


def test_device_checks_script_runs_files_that_exist():
    script = BENCHMARKS / "device_checks.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    paths = set(re.findall(r"\b((?:benchmarks|tests)/[\w/]+\.py)\b", script.read_text()))
    assert {"benchmarks/gpu.py", "benchmarks/spatial_domains.py", "tests/test_cuda.py"} <= paths
    assert [p for p in sorted(paths) if not (ROOT / p).exists()] == []


# --------------------------------------------------------------------------- spatial


def test_spatial_domains_benchmark_tiny(tmp_path, capsys):
    module = load_script(BENCHMARKS / "spatial_domains.py")
    args = ["--num-spots", "800", "--num-domains", "3", "--dim", "4", "--epochs", "2", "--num-patches", "4"]
    results = module.main(module.parse_args(args + ["--quiet", "--out", str(tmp_path)]))
    methods = results[0]["methods"]
    assert set(methods) == set(module.METHODS)
    for row in methods.values():
        assert len(row["history"]["objective"]) == 3 and 0 <= row["final_ari"] <= 1
    assert "| 800 | P2D-VI |" in capsys.readouterr().out
    for name in ("spatial_convergence_800.png", "spatial_domains_800.png", "spatial_table.md"):
        assert (tmp_path / name).stat().st_size > 0
    assert json.loads((tmp_path / "spatial_results.json").read_text())[0]["num_spots"] == 800


# --------------------------------------------------------------------------- the PDVI trace


def test_trace_pdvi_records_every_epoch_and_the_first_epochs_capped_growth(tmp_path):
    """On the logistic regression the locations' step sizes grow at the first epoch's last step,
    by at most FISHER_STEP_GROWTH (docs/benchmarks.md 13o); the trace records it there, a row per
    epoch (per step with --every-step) and the CSV. The steps before it may record smaller changes:
    the first epoch's bound by the mean measured curvature moves with each block measured (13za).
    Unwhitened: a whitening (13zc) changes the state's step sizes at that step too."""
    from pyro_pdvi.infer.step_sizes import FISHER_STEP_GROWTH

    trace = load_script(BENCHMARKS / "trace_pdvi.py")
    out = tmp_path / "trace.csv"
    config = ["--pdvi-config", "unwhitened"]
    rows = trace.main(trace.parse_args(["--model", "logreg", "--epochs", "1", "--out", str(out), *config]))
    assert [r["epoch"] for r in rows] == [0.0, 1.0]
    *first_steps, event = rows[1]["step_size_changes"].split("; ")
    assert all(not e.startswith("step 20:") for e in first_steps)
    match = re.match(r"step 20: \d+ coords x([0-9.e+-]+)-([0-9.e+-]+), lambda_0 moved", event)
    assert match and 1.0 < float(match.group(2)) <= FISHER_STEP_GROWTH * (1 + 1e-3)
    assert rows[1]["rmse_mean"] < rows[0]["rmse_mean"] and rows[1]["h_norm"] > 0
    with open(out) as handle:
        assert len(list(csv.DictReader(handle))) == 2
    stepwise = trace.main(trace.parse_args(["--model", "logreg", "--epochs", "1", "--every-step", *config]))
    assert len(stepwise) == 21 and stepwise[-1]["rmse_mean"] == rows[-1]["rmse_mean"]


def test_solve_noise_tiny(tmp_path, capsys):
    """The hierarchical normal: its means' noise vanishes (a quadratic log joint), its scale's falls
    with the particles; one row per particles, in the printed table and the CSV."""
    module = load_script(BENCHMARKS / "solve_noise.py")
    out = tmp_path / "noise.csv"
    rows = module.main(module.parse_args(["--models", "hier", "--particles", "2,16", "--out", str(out)]))
    assert [row["particles"] for row in rows] == [2, 16]
    assert all(row["sites"]["AutoNormal.locs.mu"] < 1e-5 for row in rows)
    assert rows[0]["sites"]["AutoNormal.scales.mu"] > 2 * rows[1]["sites"]["AutoNormal.scales.mu"]
    assert capsys.readouterr().out.count("particles  noise") == 2
    with open(out) as file:
        written = list(csv.DictReader(file))
    assert [r["particles"] for r in written if r["site"] == "all"] == ["2", "16"]


def test_consensus_rate_hessians_and_iteration():
    """The blocks' Hessians of the logistic regression sum to the Hessian of its negative log joint
    (autograd, at the reference means); on random SPD blocks the iteration reaches the quadratic's
    minimiser, ``(sum_b H_b)^-1 sum_b H_b a_b``, at the rate it reports; and the table's rows."""
    module = load_script(BENCHMARKS / "consensus_rate.py")
    from benchmarks.generic_suite.models import make_problem
    from benchmarks.generic_suite.references import compute_reference

    problem = make_problem("logreg", quick=False)
    params = compute_reference(problem).params
    hessians = module.block_hessians(problem, params)
    x, y = problem.x.to(torch.float64), problem.y.to(torch.float64)

    def negative_log_joint(w):
        logits = x @ w
        likelihood = torch.distributions.Bernoulli(logits=logits).log_prob(y).sum()
        return -(likelihood + torch.distributions.Normal(0.0, problem.prior_scale).log_prob(w).sum())

    means = params["AutoNormal.locs.w"].to(torch.float64)
    exact = torch.autograd.functional.hessian(negative_log_joint, means)
    assert torch.allclose(hessians.sum(0), exact, rtol=1e-10, atol=1e-10)
    assert module.diagonal_condition(hessians) > 1.0

    generator = torch.Generator().manual_seed(1)
    factors = torch.randn(4, 3, 3, generator=generator, dtype=torch.float64)
    spd = factors @ factors.transpose(-1, -2) + torch.eye(3, dtype=torch.float64)
    errors = module.consensus_errors(spd, 0.25, epochs=200, seed=0)
    assert errors[4] < 1 and errors[-1] < 1e-12
    rate, after5 = module.epoch_rate(spd, 0.25, epochs=40, seed=0)
    assert after5 == errors[4] and 0 < rate < 0.9

    rows = module.main(module.parse_args(["--models", "logreg", "--constants", "0.25,1", "--epochs", "12",
                                          "--seeds", "1"]))  # fmt: skip
    assert [r["constant"] for r in rows] == [0.25, 1.0] and all(0 < r["rate"] < 1 for r in rows)


def test_consensus_rate_synthetic_round_sites_want_a_stiffer_constant_with_more_blocks():
    """On the synthetic round sites the best constant of the grid falls as the blocks grow, as
    ``round_site_scale`` (``1.2 / sqrt(n)``) does: 0.5 for 6 blocks, 0.125 for 100."""
    module = load_script(BENCHMARKS / "consensus_rate.py")
    assert module.synthetic_hessians("logreg") is None
    assert module.synthetic_hessians("uneven20").shape == (20, 4, 4)
    rows = module.main(module.parse_args(["--models", "round6,round100", "--constants", "0.125,0.5,1",
                                          "--epochs", "25", "--seeds", "2"]))  # fmt: skip
    best = {}
    for row in rows:
        if row["model"] not in best or row["rate"] < best[row["model"]]["rate"]:
            best[row["model"]] = row
    assert best["round6"]["constant"] == 0.5 and best["round100"]["constant"] == 0.125
    assert best["round6"]["condition"] < 2


def test_particle_broadcasting_tiny(capsys):
    """Written for one draw, the model is flagged under PDVI's particles (then looped) and the
    user's (kept); written with a plate, PDVI keeps its vectorized particles."""
    module = load_script(BENCHMARKS / "particle_broadcasting.py")
    common = ["--groups", "3", "--group-size", "8", "--epochs", "2", "--svi-epochs", "3"]
    common += ["--report-epochs", "1,2", "--svi-lrs", "0.1"]
    results = {r["method"]: r for r in module.main(module.parse_args(common))}
    assert results["pdvi"]["flagged"] and results["pdvi"]["particles"] == "8 looped"
    assert (
        results["pdvi-vectorized"]["flagged"] and results["pdvi-vectorized"]["particles"] == "64 vectorized"
    )
    assert not results["svi-0.1"]["flagged"] and len(results["svi-0.1"]["rows"]) == 3
    results = {r["method"]: r for r in module.main(module.parse_args([*common, "--written", "plate"]))}
    assert not results["pdvi"]["flagged"] and results["pdvi"]["particles"].endswith("vectorized")
    assert "| pdvi | 0 |" in capsys.readouterr().out


def test_growing_guard_grows_while_the_objective_falls_and_stops_at_its_first_halving():
    module = load_script(BENCHMARKS / "growing_step_sizes.py")
    args = module.parse_args(["--factor", "2", "--after", "1", "--start", "2", "--cap", "4", "--", "--quick"])
    assert args.suite_args == ["--quick"]
    module.GrowingGuard.factor, module.GrowingGuard.after = args.factor, args.after
    module.GrowingGuard.start, module.GrowingGuard.cap = args.start, args.cap
    guard = module.GrowingGuard()

    def epoch(total: float) -> bool:
        guard.add(torch.tensor([total]), torch.tensor([1.0]))
        return guard.end_epoch()

    assert [epoch(t) for t in (10.0, 9.0, 8.0, 7.0)] == [False, True, True, False]  # capped at 4
    assert guard.damping == 4.0
    assert [epoch(t) for t in (8.0, 9.0)] == [False, True]  # two rises: halved, and no more growth
    assert guard.damping == 2.0
    assert [epoch(t) for t in (8.0, 7.0, 6.0)] == [False, False, False] and guard.damping == 2.0


def test_autoguides_scores_a_packed_guide_at_the_reference_as_zero():
    """``benchmarks/autoguides.py`` unpacks ``AutoDiagonalNormal``'s vectors site by site into
    ``AutoNormal``'s names: at the reference optimum, packed, every error is zero."""
    pytest.importorskip("sklearn")
    import pyro

    from benchmarks.generic_suite import models, references

    module = load_script(BENCHMARKS / "autoguides.py")
    problem = models.NormalScale(torch.float64, num_data=12, num_blocks=3)  # sites w (vector) and sigma
    reference = references.compute_reference(problem)
    template = module.template_guide(problem)
    sites = [site["name"] for site, _ in template._unpack_latent(torch.zeros(template.latent_dim))]
    assert sites == ["w", "sigma"]
    pyro.clear_param_store()
    problem.initialise(module.diagonal_variant(problem).make_guide(), problem.blocks[0])
    store = pyro.get_param_store()
    for kind, name in (("locs", "AutoDiagonalNormal.loc"), ("scales", "AutoDiagonalNormal.scale")):
        store[name] = torch.cat([reference.params[f"AutoNormal.{kind}.{s}"].reshape(-1) for s in sites])
    metrics = module.PackedScorer(problem, reference, template)()
    assert metrics["rmse_mean"] < 1e-12 and metrics["sd_error"] < 1e-12 and abs(metrics["elbo_gap"]) < 1e-12


def test_autoguides_tiny(capsys):
    """Both guides, every method, on the quick logistic regression: a row each, finite errors."""
    pytest.importorskip("sklearn")
    module = load_script(BENCHMARKS / "autoguides.py")
    args = [
        "--quick",
        "--models",
        "logreg",
        "--seeds",
        "0",
        "--budget-seconds",
        "0.3",
        "--checkpoints",
        "0.3",
    ]
    rows = module.main(module.parse_args([*args, "--svi-lrs", "0.03", "--decay-lr", "0"]))
    assert [(r["guide"], r["method"]) for r in rows] == [
        (guide, method) for guide in module.GUIDES for method in ("SVI Adam lr=0.03", "PDVI defaults")
    ]
    assert all(math.isfinite(r["rmse_mean@0.3"]) and math.isfinite(r["sd_error@0.3"]) for r in rows)
    assert "| AutoDiagonalNormal | PDVI defaults |" in capsys.readouterr().out
    assert torch.get_default_dtype() == torch.float64  # the tests' dtype is put back


@pytest.mark.parametrize(
    "guide_name", ["AutoDiagonalNormal", "AutoMultivariateNormal", "AutoLowRankMultivariateNormal"]
)
def test_full_covariance_scores_each_family_optimum_as_zero(guide_name):
    """``benchmarks/full_covariance.py``: the guide's params set to its family's optimum (the exact
    posterior, its mean-field diagonal, or the L-BFGS low-rank optimum, checked by its first-order
    conditions) score zero; the exact posterior's KL is zero."""
    pytest.importorskip("sklearn")
    import pyro

    module = load_script(BENCHMARKS / "full_covariance.py")
    problem = module.ConjugateRegression(guide_name, torch.float64, num_data=40, num_blocks=4)
    scorer = module.GaussianScorer(problem)
    pyro.clear_param_store()
    problem.initialise(problem.make_guide(), problem.blocks[0])
    store = pyro.get_param_store()
    store[f"{guide_name}.loc"] = scorer.posterior_mean
    if guide_name == "AutoDiagonalNormal":
        store[f"{guide_name}.scale"] = scorer.optimum.diagonal().sqrt()
    elif guide_name == "AutoMultivariateNormal":
        tril = torch.linalg.cholesky(scorer.optimum)
        store[f"{guide_name}.scale"] = tril.diagonal()
        store[f"{guide_name}.scale_tril"] = tril / tril.diagonal()[:, None]
        assert abs(scorer.optimum_kl) < 1e-10
    else:
        factor, diagonal = module.low_rank_optimum(scorer.precision)
        store[f"{guide_name}.scale"] = diagonal.sqrt()
        store[f"{guide_name}.cov_factor"] = factor / diagonal.sqrt()[:, None]
        # No closed form: the L-BFGS optimum meets the first-order conditions (W free, d >= 0).
        leaves = [factor.clone().requires_grad_(), diagonal.clone().requires_grad_()]
        grad_factor, grad_diagonal = torch.autograd.grad(
            module.low_rank_objective(*leaves, scorer.precision), leaves
        )
        assert float(grad_factor.abs().max()) < 1e-5
        assert float((grad_diagonal * diagonal).abs().max()) < 1e-6 and float(grad_diagonal.min()) > -1e-4
    metrics = scorer()
    assert metrics["mean_error"] < 1e-12 and metrics["cov_error"] < 1e-10 and abs(metrics["elbo_gap"]) < 1e-10


def test_full_covariance_tiny(capsys):
    """Every guide and method on 40 rows: a row each, finite errors, the ratios printed."""
    pytest.importorskip("sklearn")
    module = load_script(BENCHMARKS / "full_covariance.py")
    args = ["--num-data", "40", "--seeds", "0", "--budget-seconds", "0.3", "--checkpoints", "0.3"]
    rows = module.main(module.parse_args([*args, "--svi-lrs", "0.03", "--decay-lr", "0"]))
    assert [(r["guide"], r["method"]) for r in rows] == [
        (guide, method) for guide in module.GUIDES for method in ("SVI Adam lr=0.03", "PDVI defaults")
    ]
    assert all(math.isfinite(r[f"{m}@0.3"]) for r in rows for m in module.METRICS)
    assert "| PDVI / best SVI |" in capsys.readouterr().out
    assert torch.get_default_dtype() == torch.float64


def test_full_covariance_logistic_elbo_agrees_with_pyro():
    """``--logreg``'s scorer (likelihood from fixed draws, prior and entropy in closed form) agrees
    with Pyro's Monte Carlo negative ELBO of the same guide within its noise."""
    pytest.importorskip("sklearn")
    import pyro
    from pyro.infer import Trace_ELBO
    from pyro.infer.autoguide import AutoMultivariateNormal
    from pyro.infer.autoguide.initialization import init_to_feasible

    from benchmarks.generic_suite.models import make_problem

    module = load_script(BENCHMARKS / "full_covariance.py")
    problem = make_problem("logreg", True, torch.float64, "cpu")
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMultivariateNormal(problem.model, init_loc_fn=init_to_feasible, init_scale=0.1)
    problem.initialise(guide, problem.blocks[0])
    ours = module.LogisticElboScorer(problem)()["neg_elbo"]
    with torch.no_grad():
        pyros = Trace_ELBO(num_particles=20000, vectorize_particles=True).loss(problem.model, guide, None)
    # Both are Monte Carlo estimates (Pyro's at 20,000 draws ranged 470.7-471.5 over three seeds
    # here); a wrong prior or entropy term is off by tens of nats.
    assert ours == pytest.approx(pyros, abs=2.0)


def test_full_covariance_logreg_tiny():
    """``--logreg``: a row per method, finite negative ELBOs."""
    pytest.importorskip("sklearn")
    module = load_script(BENCHMARKS / "full_covariance.py")
    args = ["--logreg", "--seeds", "0", "--budget-seconds", "0.3", "--checkpoints", "0.3"]
    rows = module.main(module.parse_args([*args, "--svi-lrs", "0.03", "--decay-lr", "0"]))
    assert [r["method"] for r in rows] == ["SVI Adam lr=0.03", "PDVI defaults", "PDVI scale_pd"]
    assert all(math.isfinite(r["neg_elbo@0.3"]) for r in rows)


def test_reduced_hessian_tiny():
    """The experiment on the suite's quick PPCA: rows separable by datum, and a Lanczos run on all
    the blocks for as many iterations as coordinates finds the full estimate's eigenvalues."""
    experiment = load_script(BENCHMARKS / "reduced_hessian.py")
    options = ["--quick", "--epochs", "1", "--coordinates", "6", "--lanczos-iterations", "6"]
    result = experiment.main(experiment.parse_args([*options, "--lanczos-blocks", "10"]))
    assert result["eigenvalues"].shape == result["exact_eigenvalues"].shape == (6,)
    assert bool(torch.isfinite(result["eigenvalues"]).all()) and result["separability"] < 1e-5
    (row,) = result["lanczos"]
    assert torch.allclose(row["values"], result["eigenvalues"][:3], rtol=1e-4, atol=1e-6)


def test_saddle_escape_tiny():
    """The escape on the suite's quick PPCA after 3 epochs: the reduced Hessian has negative
    directions there, the line search takes a step, and the ELBO gap falls with it."""
    experiment = load_script(BENCHMARKS / "saddle_escape.py")
    options = ["--quick", "--epochs-before", "3", "--epochs-after", "1", "--hessian", "lanczos"]
    options += ["--lanczos-iterations", "10", "--steps", "0.1,1", "--rounds", "1", "--inner-steps", "3"]
    rows = experiment.main(experiment.parse_args(options))
    before, escape, after = (next(r for r in rows if r["stage"] == s) for s in ("before", "escape", "after"))
    assert escape["elbo_gap"] < 0.8 * before["elbo_gap"] and math.isfinite(after["elbo_gap"])


def test_saddle_escape_from_the_drift_counts_its_seconds():
    """Lanczos started from lambda_0's drift over the last two epochs also finds a direction that
    lowers the ELBO gap; the clock holds PDVI's epochs and the escape, in order."""
    experiment = load_script(BENCHMARKS / "saddle_escape.py")
    options = ["--quick", "--epochs-before", "3", "--epochs-after", "1", "--hessian", "lanczos"]
    options += ["--lanczos-iterations", "10", "--steps", "1", "--rounds", "1", "--inner-steps", "3"]
    options += ["--lanczos-start", "drift", "--drift-lag", "2"]
    rows = experiment.main(experiment.parse_args(options))
    before, escape, after = (next(r for r in rows if r["stage"] == s) for s in ("before", "escape", "after"))
    assert escape["elbo_gap"] < before["elbo_gap"]
    assert 0 < before["cpu_seconds"] < before["cpu_seconds"] + escape["seconds"] < after["cpu_seconds"]


def test_saddle_escape_refuses_a_drift_it_cannot_use():
    """A drift longer than the epochs before the escape, or with the full Hessian (no Lanczos)."""
    experiment = load_script(BENCHMARKS / "saddle_escape.py")
    drift = ["--lanczos-start", "drift", "--drift-lag", "4"]
    with pytest.raises(SystemExit):
        experiment.parse_args(["--epochs-before", "3", "--hessian", "lanczos", *drift])
    with pytest.raises(SystemExit):
        experiment.parse_args(["--epochs-before", "5", "--hessian", "full", *drift])
    experiment.parse_args(["--epochs-before", "5", "--hessian", "lanczos", *drift])


def quick_ppca_after_a_check(config: str) -> tuple[float, object, int | None]:
    """The suite's quick PPCA after 5 epochs of PDVI in ``config``, its check after 3 (the drift
    over 2): the ELBO gap, ``diagnostics["saddle_escape"]`` and the epoch of the next check."""
    from benchmarks.generic_suite.baselines import pdvi
    from benchmarks.generic_suite.metrics import Scorer
    from benchmarks.generic_suite.models import make_problem
    from benchmarks.generic_suite.references import compute_reference
    from benchmarks.generic_suite.runner import common_start

    problem = make_problem("ppca", True)
    scorer = Scorer(problem, compute_reference(problem))
    guide, order, first = common_start(problem, 0)
    algo = pdvi(config).build(problem, guide).algo
    for epoch in range(5):
        for b in first if epoch == 0 else torch.randperm(len(problem.blocks), generator=order).tolist():
            algo.step(problem.blocks[b])
    return scorer()["elbo_gap"], algo.diagnostics["saddle_escape"], algo._saddle.next_check


@pytest.fixture
def early_check(monkeypatch):
    from pyro_pdvi.infer import saddle_escape

    monkeypatch.setattr(saddle_escape, "FIRST_CHECK_EPOCH", 3)
    monkeypatch.setattr(saddle_escape, "DRIFT_EPOCHS", 2)
    return saddle_escape


def test_pdvi_escapes_the_quick_ppca_saddle_by_itself(early_check):
    """PDVI's own check on the suite's quick PPCA finds negative curvature, takes a step that
    lowers the blocks' objective at their noise and at fresh noise, and two epochs later the ELBO
    gap is below that of the same run without the escape."""
    gap, checks, _ = quick_ppca_after_a_check("defaults")
    gap_alone, checks_alone, _ = quick_ppca_after_a_check("no_escape")
    (check,) = checks
    assert check["epoch"] == 3 and check["rounds"][0].negative >= 1 and check["rounds"][0].moved
    assert any(step != 0 for r in check["rounds"] for step in r.steps)
    assert all(r.objective_change <= 0 for r in check["rounds"])
    assert checks_alone == "off (PDVI.escape_saddles)"
    assert gap < gap_alone


def test_pdvi_puts_off_a_check_whose_curvature_is_too_steep_for_a_saddle(early_check, monkeypatch):
    """The same check with every negative curvature called too steep for a saddle near a fixed
    point: no step is tried, the state stays as it was (the run ends where the run without the
    escape does, to the bit), and the check is due again at twice its epoch."""
    monkeypatch.setattr(early_check, "STEEPEST_SADDLE", 0.0)
    gap, checks, next_check = quick_ppca_after_a_check("defaults")
    gap_alone, _, _ = quick_ppca_after_a_check("no_escape")
    (check,) = checks
    (only_round,) = check["rounds"]
    assert only_round.negative >= 1 and only_round.too_steep and only_round.steps == []
    assert next_check == 6 and gap == gap_alone
