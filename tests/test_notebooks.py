"""Every notebooks/*.ipynb runs without error at smoke-test size (PYRO_PDVI_SMOKE=1).

The kernel is this interpreter (``sys.executable``) through a kernelspec written to a
temporary Jupyter path, so the notebooks import the same pyro_pdvi (this checkout) and
packages as the tests, whatever kernels the machine has installed.
"""

import json
import os
import sys
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "pyro-pdvi-tests"


@pytest.fixture
def kernel_name(tmp_path, monkeypatch):
    spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "pyro-pdvi tests",
        "language": "python",
        "env": {
            "PYRO_PDVI_SMOKE": "1",
            "OMP_NUM_THREADS": "1",
            "MPLBACKEND": "Agg",
            "PYTHONPATH": python_path,
        },
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    return KERNEL


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks/*.ipynb found"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, kernel_name):
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        kernel_name=kernel_name,
        timeout=300,
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()  # raises CellExecutionError naming the cell that failed


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_outputs_are_stripped(path):
    notebook = nbformat.read(path, as_version=4)
    dirty = [
        i
        for i, cell in enumerate(notebook.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count)
    ]
    assert not dirty, f"{path.name}: cells {dirty} have outputs; strip them before committing"
