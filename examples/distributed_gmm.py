"""PD-VI on several processes: the biased-block Gaussian mixture with DistributedPDVI.

Launch one process per rank with torchrun (gloo on CPU; ``--backend nccl`` with
one GPU per rank)::

    torchrun --nproc_per_node=2 examples/distributed_gmm.py --epochs 10

Every rank builds the same data and model, owns the blocks ``rank, rank + R, ...``
(``R`` ranks) and, in each step of ``DistributedPDVI.run``, solves one of its blocks with
the closed-form ``GMMBlockSolver``; the global update is one all-reduce, so all ranks hold
the same ``lambda_0`` after every step. Rank 0 prints, after each epoch, the exact
negative-ELBO gap to the full-batch CAVI optimum and the W2 distance between true and
fitted mixtures, and ``--checkpoint DIR`` makes every rank save its state and param store
after each epoch (``--resume`` goes on from them: the block order is part of the state).
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import pyro
import torch
import torch.distributed as dist
from pyro.infer import TraceEnum_ELBO

from pyro_pdvi.distributed import DistributedPDVI
from pyro_pdvi.models.gmm import (
    GMMBlockSolver,
    GMMModel,
    cavi,
    fitted_w2,
    make_biased_gmm,
    negative_elbo,
    optimal_logits,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-data", type=int, default=20000, help="N, data points")
    parser.add_argument("--num-components", type=int, default=5, help="K, mixture components")
    parser.add_argument("--dim", type=int, default=10, help="d, data dimension")
    parser.add_argument("--block-size", type=int, default=1000, help="points per fixed block")
    parser.add_argument("--purity", type=float, default=0.95, help="share of a block's dominant cluster")
    parser.add_argument(
        "--epochs", type=int, default=10, help="passes over the data (in all, resumed ones too)"
    )
    parser.add_argument(
        "--backend", default="gloo", help="torch.distributed backend: gloo (CPU) or nccl (GPU)"
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a collective gives up")
    parser.add_argument(
        "--checkpoint", type=Path, default=None, help="save every rank's state here each epoch"
    )
    parser.add_argument("--resume", action="store_true", help="start from the checkpoint in --checkpoint")
    parser.add_argument("--seed", type=int, default=0, help="data and initialisation seed")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> None:
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.backend == "nccl" else "cpu"
    if args.backend == "nccl":
        torch.cuda.set_device(device)
    torch.set_default_dtype(torch.float64)
    pyro.set_rng_seed(args.seed)  # PDVI's own generator is broadcast from rank 0

    data = make_biased_gmm(
        args.num_data, args.num_components, args.dim, args.block_size, args.purity, seed=args.seed
    )
    x, prior, centers = data.data.to(device), data.prior.to(device=device), data.centers.to(device)
    gmm = GMMModel(x, prior, seed=args.seed)
    pdvi = DistributedPDVI(
        gmm.model,
        gmm.guide,
        pyro.optim.Adam({"lr": 0.01}),
        TraceEnum_ELBO(max_plate_nesting=1),
        blocks=[b.to(device) for b in data.blocks],
        groups="per_site",
        solver=GMMBlockSolver(x, prior),
    )
    state_file = None if args.checkpoint is None else args.checkpoint / f"rank{rank}.pt"
    done = 0
    if args.resume and state_file is not None:
        saved = torch.load(state_file, weights_only=False)
        pyro.get_param_store().set_state(saved["param_store"])
        pdvi.load_state_dict(saved["pdvi"])  # applied at the first step
        done = saved["epoch"]
    optimum = float(cavi(x, prior, num_iterations=5000).losses[-1]) if rank == 0 else None
    start = time.perf_counter()

    def after_epoch(epoch: int, loss: float) -> None:
        nonlocal start
        seconds, epoch = time.perf_counter() - start, done + epoch
        if state_file is not None:
            state_file.parent.mkdir(parents=True, exist_ok=True)
            store = pyro.get_param_store().get_state()
            torch.save({"epoch": epoch, "pdvi": pdvi.state_dict(), "param_store": store}, state_file)
        if rank == 0:
            with torch.no_grad():  # judge the globals alone: q(z) re-solved in closed form
                m, rho = pyro.param("m"), pyro.param("rho")
                gap = (
                    float(negative_elbo(x, prior, m, rho, optimal_logits(x, prior, m, rho))) - optimum
                ) / abs(optimum)
                w2 = fitted_w2(prior, centers, m, rho)
            print(f"epoch {epoch:3d}  relative -ELBO gap {gap:.2e}  W2 {w2:.4f}  {seconds:.2f} s", flush=True)
        start = time.perf_counter()

    if args.epochs > done:
        pdvi.run(args.epochs - done, callback=after_epoch, progress_bar=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
