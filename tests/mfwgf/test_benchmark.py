"""benchmarks/mfwgf.py runs end to end at a tiny size, and its grid reference
uses the same log-density as its Pyro model."""

import importlib.util
from pathlib import Path

import pyro
import pytest
import torch
from pyro import poutine

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "mfwgf.py"


@pytest.fixture(scope="module")
def benchmark():
    spec = importlib.util.spec_from_file_location("mfwgf", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grid_log_joint_is_the_models_log_density(benchmark):
    y, x = benchmark.bimodal_skewed_data(0, torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    for theta1, theta2, log_sigma in torch.randn(5, 3, generator=generator, dtype=torch.float64):
        values = {"theta1": theta1, "theta2": theta2, "sigma": log_sigma.exp()}
        trace = poutine.trace(poutine.condition(benchmark.bimodal_skewed, data=values)).get_trace(y, x)
        expected = trace.log_prob_sum() + log_sigma  # log |d sigma / d log sigma|
        assert float(benchmark.bimodal_skewed_log_joint(theta1, theta2, log_sigma, y, x)) == pytest.approx(
            float(expected), rel=1e-12
        )


def test_benchmark_runs_tiny(benchmark, tmp_path):
    tiny = (
        "--particles 100 --steps 20 --svi-steps 20 --svi-lrs 0.05 --svi-particles 1,4 --bias-fractions 0.5 "
        "--bias-snapshots 3 --grid 21 --gmm-data 30 --gmm-particles 20 --gmm-steps 5 "
        "--scaling-particles 20 --scaling-dims 2 --scaling-steps 2 --quiet"
    )
    args = benchmark.parse_args(["--out", str(tmp_path), *tiny.split()])
    dtype = torch.get_default_dtype()
    try:
        results = benchmark.main(args)
    finally:
        torch.set_default_dtype(dtype)
        torch.set_num_threads(1)
        pyro.clear_param_store()
    assert set(results) == {"bias", "accuracy", "gmm", "scaling"}
    methods = {row["method"] for row in results["accuracy"]}
    assert {"MF-WGF langevin, 100 particles", "MF-WGF gaussian, 32 configurations"} <= methods
    assert results["gmm"][0]["max |mean err|/sd"] == 0.0  # CAVI is its own reference
    for name in ("bias", "accuracy", "accuracy_factors", "gmm", "scaling"):
        assert (tmp_path / f"{name}.csv").exists()
    for name in ("bias", "accuracy", "scaling"):
        assert (tmp_path / f"{name}.png").exists()
