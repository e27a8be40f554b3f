"""examples/gpu_benchmark.py runs end to end on the CPU at a tiny size."""

import csv
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "gpu_benchmark.py"


@pytest.fixture(scope="module")
def benchmark():
    spec = importlib.util.spec_from_file_location("gpu_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_benchmark_tiny_on_cpu(benchmark, tmp_path):
    args = benchmark.parse_args(
        [
            "--device", "cpu", "--points", "400", "--blocks", "4", "--dim", "2", "--components", "3",
            "--sweeps", "2", "--blocks-per-step", "1,2,all", "--inner-steps", "2", "--repeats", "1",
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    rows = benchmark.main(args)
    assert not [row for row in rows if row["method"] in ("FAILED", "skipped")]
    assert {row["section"] for row in rows} == {
        "cavi",
        "closed-form",
        "engine",
        "generic",
        "generic-vmap",
        "svi",
        "floor",
    }
    epochs = [row for row in rows if row["section"] == "closed-form"]
    assert [row["blocks_per_step"] for row in epochs] == [1, 2, 4, 1, 2, 4]
    assert all(row["ms"] > 0 for row in epochs)
    with open(tmp_path / "gpu_benchmark.csv") as f:
        written = list(csv.DictReader(f))
    assert [row["method"] for row in written] == [row["method"] for row in rows]


def test_gpu_benchmark_reports_a_failing_section_and_goes_on(benchmark, tmp_path, monkeypatch):
    def broken(bench, setup):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(benchmark, "run_cavi", broken)
    args = benchmark.parse_args(
        ["--device", "cpu", "--points", "40", "--blocks", "2", "--dim", "2", "--components", "2",
         "--sections", "cavi,floor", "--repeats", "1", "--out", str(tmp_path)]
    )  # fmt: skip
    rows = benchmark.main(args)
    assert rows[0]["section"] == "cavi" and rows[0]["method"] == "FAILED"
    assert "no such kernel" in rows[0]["note"]
    assert {row["section"] for row in rows[1:]} == {"floor"}


def test_gpu_benchmark_checks_its_arguments(benchmark, tmp_path):
    args = benchmark.parse_args(
        ["--device", "cpu", "--points", "41", "--blocks", "2", "--out", str(tmp_path)]
    )
    with pytest.raises(ValueError, match="--points 41 must be a multiple of --blocks 2"):
        benchmark.main(args)


def fake_wheel(folder, name):
    """A minimal pure-Python wheel holding the module ``name``."""
    import zipfile

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
def test_install_wheels_installs_what_is_missing(benchmark, tmp_path, monkeypatch, pip_works):
    import subprocess
    import sys

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    name = f"pdvi_fake_{'pip' if pip_works else 'unpack'}"
    fake_wheel(wheels, name)
    fake_wheel(wheels, "torch")  # installed already: skipped
    if not pip_works:
        monkeypatch.setattr(
            benchmark.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "no pip")
        )
    monkeypatch.setattr(sys, "path", list(sys.path))
    site = tmp_path / "site"
    installed = benchmark.install_wheels(str(wheels), str(site))
    assert installed == [f"{name}-1.0-py3-none-any.whl"]
    assert sys.path[-1] == str(site)
    module = __import__(name)
    assert module.VALUE == 42
    assert not (site / "torch").exists()
