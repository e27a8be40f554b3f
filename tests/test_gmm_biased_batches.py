"""The flagship benchmark (examples/gmm_biased_batches.py) end to end at a tiny size."""

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gmm_biased_batches.py"


def load():
    spec = importlib.util.spec_from_file_location("gmm_biased_batches", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_gmm_biased_batches_tiny(tmp_path):
    module = load()
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
            "--purities",
            "0.95",
            "--seeds",
            "0,1",
            "--epochs",
            "2",
            "--particles",
            "2",
            "--adam-lrs",
            "0.05",
            "--rmsprop-lrs",
            "0.05",
            "--sgd-lrs",
            "0.5",
            "--ng-decaying",
            "1:0.7",
            "--ng-constant",
            "0.1,0.3",
            "--generic-num-data",
            "80",
            "--generic-epochs",
            "1",
            "--inner-steps",
            "2",
            "--curvature-blocks",
            "1",
            "--curvature-iterations",
            "2",
            "--sweeps",
            "2",
            "--quiet",
            "--out",
            str(tmp_path),
        ]
    )
    table = module.main(args)
    assert [row["method"] for row in table] == list(module.METHODS)
    with open(tmp_path / "gmm_biased_batches_table.csv") as f:
        saved = list(csv.DictReader(f))
    assert [row["method"] for row in saved] == list(module.METHODS)
    with open(tmp_path / "gmm_biased_batches.csv") as f:
        rows = list(csv.DictReader(f))
    # Two seeds x 2 epochs for every run on the main data; the generic runs only on seed 0.
    ng_constant = [r for r in rows if r["method"] == "NG-SVI constant"]
    assert len(ng_constant) == 2 * 2 * 2
    assert {r["seed"] for r in rows if r["method"] == "PD-VI generic"} == {"0"}
    best = next(row for row in table if row["method"] == "NG-SVI constant")
    assert best["grid_size"] == 2 and best["seeds"] == 2
    pytest.importorskip("matplotlib")
    assert (tmp_path / "gmm_biased_batches.png").stat().st_size > 0

    # Re-reading the per-epoch CSV (how parallel parts of one run are merged) gives the same table.
    merged = module.main(
        module.parse_args(
            ["--from-csv", str(tmp_path / "gmm_biased_batches.csv"), "--out", str(tmp_path / "merged")]
        )
    )
    assert [row["method"] for row in merged] == [row["method"] for row in table]
    for old, new in zip(table, merged):
        assert new["final_w2"] == pytest.approx(old["final_w2"], rel=1e-12)
        assert new["epochs_to_1.1x_cavi_w2"] == old["epochs_to_1.1x_cavi_w2"]


def test_help_explains_every_option(capsys):
    module = load()
    with pytest.raises(SystemExit):
        module.parse_args(["--help"])
    text = capsys.readouterr().out
    for option in (
        "--num-data",
        "--purities",
        "--seeds",
        "--quiet",
        "--out",
        "--global-update",
        "--generic-num-data",
    ):
        assert option in text


def test_unknown_method_is_refused(tmp_path):
    module = load()
    with pytest.raises(ValueError, match="--methods"):
        module.main(module.parse_args(["--methods", "SVI+Adamm", "--out", str(tmp_path)]))
