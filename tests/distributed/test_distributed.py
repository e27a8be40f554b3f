"""DistributedPDVI on two gloo processes on localhost against one process with two
blocks per step; failure of a rank; resuming from saved state."""

import importlib.util
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyro
import pytest
import torch

from pyro_pdvi import PDVI, AutoStepSize

WORKER = Path(__file__).with_name("worker.py")
spec = importlib.util.spec_from_file_location("distributed_worker", WORKER)
worker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(worker)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out, extra, timeout=120):
    """Run both ranks; return their (returncode, stderr) and the wall time."""
    import os

    port = free_port()
    # The workers import this checkout's pyro_pdvi, whatever is installed.
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), "2", str(port), str(out), *extra.get(rank, ())],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    start = time.monotonic()
    results = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("a rank hung") from None
        results.append((p.returncode, err))
    return results, time.monotonic() - start


def single_process_reference():
    """The same schedule in one process, both blocks of a step in one PDVI.step."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    problem = worker.Hierarchical()
    pdvi = worker.make(PDVI, problem)
    steps = []
    for a, b in worker.SCHEDULE:
        loss = pdvi.step(torch.cat([problem.blocks[a], problem.blocks[b]]))
        store = pyro.get_param_store()
        steps.append({k: store[k].detach().clone() for k in ("mu_loc", "mu_scale", "theta_loc")})
        steps[-1]["loss"] = loss
    return problem, steps


def load(out, rank, step):
    return torch.load(out / f"rank{rank}_step{step}.pt", weights_only=False)


def test_two_processes_equal_one_process_with_two_blocks_per_step(tmp_path):
    results, _ = launch(tmp_path, extra={})
    for code, err in results:
        assert code == 0, err
    problem, reference = single_process_reference()
    for s, (a, b) in enumerate(worker.SCHEDULE):
        for rank, block in ((0, a), (1, b)):
            saved = load(tmp_path, rank, s)
            assert saved["loss"] == pytest.approx(reference[s]["loss"], rel=1e-10)
            for name in ("mu_loc", "mu_scale"):
                torch.testing.assert_close(saved[name], reference[s][name], rtol=0, atol=1e-10)
            rows = problem.blocks[block]
            torch.testing.assert_close(
                saved["theta_loc"][rows], reference[s]["theta_loc"][rows], rtol=0, atol=1e-10
            )


def test_failing_rank_stops_both_without_applying_and_the_run_resumes(tmp_path):
    results, _ = launch(tmp_path, extra={1: ("--fail-at", "3")})
    (code0, err0), (code1, err1) = results
    assert code0 != 0 and code1 != 0
    assert "another rank" in err0 or "another process" in err0, err0
    assert "rank 1" in err1 and "step 4" in err1, err1
    assert not (tmp_path / "rank0_step3.pt").exists()
    # Resume both ranks from step 2's saved state: the end equals the uninterrupted run.
    results, _ = launch(tmp_path, extra={0: ("--resume-from", "2"), 1: ("--resume-from", "2")})
    for code, err in results:
        assert code == 0, err
    _, reference = single_process_reference()
    last = len(worker.SCHEDULE) - 1
    for name in ("mu_loc", "mu_scale"):
        torch.testing.assert_close(load(tmp_path, 0, last)[name], reference[last][name], rtol=0, atol=1e-10)


def test_dead_rank_makes_the_other_fail_fast(tmp_path):
    results, elapsed = launch(tmp_path, extra={1: ("--die-at", "2", "--timeout", "20")}, timeout=60)
    (code0, err0), (code1, _) = results
    assert code1 == 3
    assert code0 != 0 and "DistributedStepError" in err0 and "Restart every rank" in err0, err0
    assert elapsed < 45


def test_needs_an_initialised_process_group():
    from pyro_pdvi.distributed import DistributedPDVI

    problem = worker.Hierarchical()
    with pytest.raises(ValueError, match="init_process_group"):
        worker.make(DistributedPDVI, problem)


def test_remeasure_epochs_is_refused():
    import torch.distributed as torch_dist

    from pyro_pdvi.distributed import DistributedPDVI

    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        problem = worker.Hierarchical()
        with pytest.raises(
            ValueError, match=r"DistributedPDVI does not support AutoStepSize\(remeasure_epochs"
        ):
            worker.make(DistributedPDVI, problem, eta=AutoStepSize(remeasure_epochs=(1,)))
        worker.make(DistributedPDVI, problem)  # the default () is fine
    finally:
        torch_dist.destroy_process_group()


def test_run_on_two_processes_equals_one_process_with_two_blocks_per_step(tmp_path):
    """``DistributedPDVI.run`` (cyclic order, one owned block per rank per step) is the
    one-process run that steps over blocks {0, 1}, then {2, 3}, each epoch."""
    epochs = 3
    results, _ = launch(tmp_path, extra={0: ("--run", str(epochs)), 1: ("--run", str(epochs))})
    for code, err in results:
        assert code == 0, err
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    problem = worker.Hierarchical()
    pdvi = worker.make(PDVI, problem)
    losses = []
    for _ in range(epochs):
        pair_losses = [
            pdvi.step(torch.cat([problem.blocks[a], problem.blocks[b]])) for a, b in ((0, 1), (2, 3))
        ]
        losses.append(sum(pair_losses) / 2)
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}_run.pt", weights_only=False)
        torch.testing.assert_close(saved["losses"], torch.tensor(losses), rtol=1e-10, atol=0)
        for name in ("mu_loc", "mu_scale"):
            torch.testing.assert_close(saved[name], pyro.param(name).detach(), rtol=0, atol=1e-10)
