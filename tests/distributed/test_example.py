"""The torchrun example runs on two gloo processes and resumes from its checkpoint."""

import re
import subprocess
import sys
from pathlib import Path

from .test_distributed import free_port

EXAMPLE = Path(__file__).parents[2] / "examples" / "distributed_gmm.py"


def torchrun(*args):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    command += [f"--master-port={free_port()}", str(EXAMPLE), "--num-data=400", "--block-size=50", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    return re.findall(r"relative -ELBO gap (\S+)", result.stdout)


def test_distributed_example_runs_and_resumes(tmp_path):
    gaps = torchrun("--epochs=2", f"--checkpoint={tmp_path}")
    assert len(gaps) == 2 and (tmp_path / "rank0.pt").exists() and (tmp_path / "rank1.pt").exists()
    resumed = torchrun("--epochs=4", f"--checkpoint={tmp_path}", "--resume")
    assert len(resumed) == 2  # epochs 3 and 4 only
    assert float(resumed[-1]) < float(gaps[0])
