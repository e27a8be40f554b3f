"""The vectorized-blocks benchmark runs end to end at a tiny size."""

import csv
import math

from tests.test_examples import load


def test_vectorized_blocks_benchmark_tiny(tmp_path):
    module = load("benchmark_vectorized_blocks")
    args = module.parse_args(
        [
            "--configs",
            "2x20",
            "4x1",
            "--particles",
            "2",
            "--inner-steps",
            "2",
            "--eval-repeats",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    rows = module.main(args)
    assert [(r["blocks"], r["block_size"]) for r in rows] == [(2, 20), (4, 1)]
    for row in rows:
        assert all(row[key] > 0 for key in module.COLUMNS)
    with open(tmp_path / "vectorized_blocks.csv") as handle:
        assert [row["blocks"] for row in csv.DictReader(handle)] == ["2", "4"]


def test_lbfgs_comparison_tiny(tmp_path):
    module = load("benchmark_vectorized_blocks")
    args = module.parse_args(
        ["--compare-lbfgs", "--configs", "2x5", "--particles", "1", "--inner-steps", "3"]
        + ["--reference-steps", "5", "--solve-repeats", "1", "--out", str(tmp_path)]
    )
    rows = module.main(args)
    assert [r["solver"] for r in rows] == ["joint", "per-block"]
    # Per-block L-BFGS: one evaluation per iteration, plus the start and the final f_b.
    assert rows[1]["evaluations_per_solve"] <= 3 + 2
    for row in rows:
        assert row["s_per_solve"] > 0 and row["s_per_step"] > 0
        assert math.isfinite(row["max_abs_gap"]) and math.isfinite(row["max_lagrangian_gap"])
    with open(tmp_path / "vectorized_lbfgs.csv") as handle:
        assert [row["solver"] for row in csv.DictReader(handle)] == ["joint", "per-block"]
