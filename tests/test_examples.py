"""Every example runs end to end at a tiny size, and its --help explains every option."""

import os
import re
import subprocess
import sys

import pytest

from tests.distributed.test_distributed import free_port
from tests.scripts import EXAMPLES, ROOT, load_script, undocumented_options

SCRIPTS = sorted(EXAMPLES.glob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_every_option_has_help(path, monkeypatch):
    assert undocumented_options(load_script(path), monkeypatch) == []


def test_svi_to_pdvi_reaches_the_exact_means():
    module = load_script(EXAMPLES / "svi_to_pdvi.py")
    args = ["--num-data", "40", "--num-blocks", "2", "--epochs", "10", "--particles", "4"]
    results = module.main(module.parse_args(args))
    for site, (mean, _) in results["exact"].items():
        assert results["pdvi"][site][0] == pytest.approx(mean, abs=0.05)
        # SVI, one sorted block per step, ends where the last blocks pull it.
        assert abs(results["svi"][site][0] - mean) > abs(results["pdvi"][site][0] - mean)


def test_gmm_closed_form_approaches_cavi():
    module = load_script(EXAMPLES / "gmm_closed_form.py")
    args = ["--num-data", "300", "--num-components", "3", "--dim", "2", "--block-size", "50", "--epochs", "6"]
    history = module.main(module.parse_args(args))
    assert [row["epoch"] for row in history] == list(range(1, 7))
    assert history[-1]["gap"] < history[0]["gap"] and history[-1]["gap"] < 1e-2


def test_spatial_domains_example_tiny(tmp_path):
    pytest.importorskip("anndata")
    pytest.importorskip("matplotlib")
    module = load_script(EXAMPLES / "spatial_domains.py")
    args = ["--num-spots", "600", "--num-domains", "3", "--dim", "4", "--epochs", "2", "--num-patches", "4"]
    aris = module.main(module.parse_args(args + ["--out", str(tmp_path)]))
    assert set(aris) == {"spatial_domain", "plain_mixture"}
    assert all(-1 <= ari <= 1 for ari in aris.values())
    assert (tmp_path / "spatial_domains.png").stat().st_size > 0


def torchrun(*args):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    command += [f"--master-port={free_port()}", str(EXAMPLES / "distributed_gmm.py")]
    command += ["--num-data=400", "--block-size=50", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stderr
    return re.findall(r"epoch +(\d+) +relative -ELBO gap (\S+)", result.stdout)


def test_distributed_example_runs_and_resumes(tmp_path):
    gaps = torchrun("--epochs=2", f"--checkpoint={tmp_path}")
    assert [epoch for epoch, _ in gaps] == ["1", "2"]
    assert (tmp_path / "rank0.pt").exists() and (tmp_path / "rank1.pt").exists()
    resumed = torchrun("--epochs=4", f"--checkpoint={tmp_path}", "--resume")
    assert [epoch for epoch, _ in resumed] == ["3", "4"]  # epochs 3 and 4 only
    assert float(resumed[-1][1]) < float(gaps[0][1])
