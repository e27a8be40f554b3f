"""Every example runs end to end at a tiny size."""

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("closed_form", [False, True], ids=["lbfgs", "closed_form"])
def test_gmm_generic_benchmark_tiny(tmp_path, closed_form):
    module = load("benchmark_gmm_generic")
    args = module.parse_args(
        [
            "--num-data",
            "120",
            "--num-components",
            "3",
            "--dim",
            "2",
            "--block-size",
            "40",
            "--epochs",
            "2",
            "--svi-epochs",
            "2",
            "--lrs",
            "0.05",
            "--particles",
            "4",
            "--inner-steps",
            "3",
            "--quiet",
            "--out",
            str(tmp_path),
        ]
        + (["--closed-form"] if closed_form else [])
    )
    rows = module.main(args)
    assert {row["method"] for row in rows} == {"PD-VI", "P2D-VI", "SVI+Adam"}
    assert (tmp_path / "gmm_generic.csv").exists()
    pytest.importorskip("matplotlib")
    assert (tmp_path / "gmm_generic.png").exists()


def test_global_update_noise_benchmark_tiny():
    module = load("benchmark_global_update_noise")
    args = module.parse_args(
        [
            "--num-data",
            "12",
            "--num-blocks",
            "3",
            "--particles",
            "4",
            "--epochs",
            "2",
            "--last",
            "1",
            "--seeds",
            "1",
            "--frozen",
        ]
    )
    rows = module.main(args)
    methods = ["PDVI auto", "PDVI paper", "PDVI consensus", "SVI+Adam lr=0.05", "fixed-noise optimum"]
    assert [row["method"] for row in rows] == methods + [f"{m}, antithetic" for m in methods]
    # The fixed-noise optimum of a Gaussian target with antithetic pairs has the exact mean.
    assert rows[-1]["rms_error"] < 1e-8
    assert all(row["rms_error"] >= 0 and row["rms_scale_error"] >= 0 for row in rows)


def test_quadratic_benchmark_tiny():
    module = load("benchmark_quadratic")
    rows = module.main(module.parse_args(["--eta-scales", "2", "--epochs", "40", "--tolerance", "1e-3"]))
    reached = {(row["scale_b"], row["groups"]): row["epochs"] for row in rows}
    assert reached[(1.0, None)] is not None and reached[(10.0, "per_site")] is not None
    assert reached[(10.0, None)] is None  # one step size for 100x-apart curvatures


def test_eta_auto_benchmark_tiny():
    module = load("benchmark_eta_auto")
    args = module.parse_args(
        [
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
            "--remeasure",
            "1",
            "--curvatures",
            "--quiet",
        ]
    )
    results = module.main(args)
    assert [r["label"] for r in results] == ["PD-VI auto, remeasure 1", "PD-VI eta=0.01"]
    assert all(len(r["history"]) == 2 for r in results)
