"""PD-VI on several processes: the biased-block Gaussian mixture with DistributedPDVI.

Launch one process per rank with torchrun (gloo on CPU; ``--backend nccl`` with
one GPU per rank)::

    torchrun --nproc_per_node=2 examples/distributed_gmm.py --epochs 10

Every rank builds the same data and model, owns the blocks ``rank, rank + R, ...``
(``R`` ranks) and, in each step, solves one of its blocks with the closed-form
:class:`~pyro_pdvi.models.GMMBlockSolver`; the global update is one all-reduce,
so all ranks hold the same ``lambda_0`` after every step. Rank 0 prints, after
each epoch, the exact negative-ELBO gap to the full-batch CAVI optimum and the
W2 distance between true and fitted mixtures, and ``--checkpoint DIR`` makes
every rank save its state and param store after each epoch (``--resume`` loads
them).
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
from pyro_pdvi.models import (
    GMMBlockSolver,
    GMMModel,
    cavi,
    make_biased_gmm,
    negative_elbo,
    predictive_components,
    wasserstein_gmm,
)
from pyro_pdvi.models.gmm import expected_log_likelihood


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-data", type=int, default=20000, help="N, data points")
    parser.add_argument("--num-components", type=int, default=5, help="K, mixture components")
    parser.add_argument("--dim", type=int, default=10, help="d, data dimension")
    parser.add_argument("--block-size", type=int, default=1000, help="points per fixed block")
    parser.add_argument("--purity", type=float, default=0.95, help="share of a block's dominant cluster")
    parser.add_argument("--epochs", type=int, default=10, help="passes over the data")
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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.backend == "nccl" else "cpu"
    if args.backend == "nccl":
        torch.cuda.set_device(device)
    torch.set_default_dtype(torch.float64)
    pyro.set_rng_seed(args.seed)

    data = make_biased_gmm(
        args.num_data, args.num_components, args.dim, args.block_size, args.purity, seed=args.seed
    )
    if len(data.blocks) % world:
        raise SystemExit(f"{len(data.blocks)} blocks do not split evenly over {world} ranks")
    x, prior = data.data.to(device), data.prior.to(device=device)
    gmm = GMMModel(x, prior, seed=args.seed)
    pdvi = DistributedPDVI(
        gmm.model,
        gmm.guide,
        pyro.optim.Adam({"lr": 0.01}),
        TraceEnum_ELBO(max_plate_nesting=1),
        blocks=data.blocks,
        groups="per_site",
        local_solver=GMMBlockSolver(x, prior),
        global_update="paper",
    )
    state_file = None if args.checkpoint is None else args.checkpoint / f"rank{rank}.pt"
    first_epoch = 0
    if args.resume and state_file is not None:
        saved = torch.load(state_file, weights_only=False)
        pyro.get_param_store().set_state(saved["param_store"])
        pdvi.load_state_dict(saved["pdvi"])
        first_epoch = saved["epoch"] + 1
    optimum = cavi(x, prior, num_iterations=5000).losses[-1] if rank == 0 else None

    order = torch.Generator().manual_seed(args.seed + rank)
    for epoch in range(first_epoch, args.epochs):
        start = time.perf_counter()
        owned = torch.tensor(pdvi.owned_blocks)
        for b in owned[torch.randperm(len(owned), generator=order)].tolist():
            pdvi.step(data.blocks[b].to(device))
        seconds = time.perf_counter() - start
        if state_file is not None:
            state_file.parent.mkdir(parents=True, exist_ok=True)
            store = pyro.get_param_store().get_state()
            torch.save({"epoch": epoch, "pdvi": pdvi.state_dict(), "param_store": store}, state_file)
        if rank == 0:
            m, rho = pyro.param("m").detach(), pyro.param("rho").detach()
            # Judge the globals alone: locals re-solved in closed form for every datum.
            alpha = torch.log_softmax(expected_log_likelihood(x, prior, m, rho), -1)
            gap = float(negative_elbo(x, prior, m, rho, alpha) - optimum) / abs(float(optimum))
            w2 = wasserstein_gmm(
                data.centers.cpu(), prior.sigma0_sq.cpu(), *predictive_components(prior, m, rho)
            )
            print(f"epoch {epoch + 1:3d}  relative -ELBO gap {gap:.2e}  W2 {float(w2):.4f}  {seconds:.2f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
