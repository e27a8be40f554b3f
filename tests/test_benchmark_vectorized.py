"""The vectorized-blocks benchmark runs end to end at a tiny size."""

import csv

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
