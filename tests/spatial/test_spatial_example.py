"""examples/spatial_domains.py end to end at a tiny size."""

import importlib.util
import json
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "spatial_domains.py"


def test_spatial_domains_example_tiny(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("spatial_domains", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse_args(
        ["--num-spots", "800", "--num-domains", "3", "--dim", "4", "--epochs", "2", "--num-patches", "4"]
        + ["--quiet", "--out", str(tmp_path)]
    )
    results = module.main(args)
    methods = results[0]["methods"]
    assert set(methods) == set(module.METHODS)
    for row in methods.values():
        assert len(row["history"]["objective"]) == 3 and 0 <= row["final_ari"] <= 1
    assert "| 800 | P2D-VI |" in capsys.readouterr().out
    for name in ("spatial_convergence_800.png", "spatial_domains_800.png", "spatial_table.md"):
        assert (tmp_path / name).stat().st_size > 0
    assert json.loads((tmp_path / "spatial_results.json").read_text())[0]["num_spots"] == 800
