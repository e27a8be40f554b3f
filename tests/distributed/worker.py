"""One rank of the two-process PDVI tests (run by tests/distributed/test_distributed.py).

``python worker.py RANK WORLD PORT OUT [--fail-at STEP] [--die-at STEP] [--resume-from STEP] [--run EPOCHS]``

Runs the hierarchical model below with DistributedPDVI (gloo, float64), one block
per rank per step on the schedule SCHEDULE, and saves after every step what the
test compares: the consensus, this rank's local rows, the step's loss, and the
rank's state_dict and param store (for resuming).
"""

import argparse
import os
import sys
from datetime import timedelta

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import TraceMeanField_ELBO

from pyro_pdvi import GenericSolver

NUM_DATA, NUM_BLOCKS = 40, 4
# Step s solves SCHEDULE[s][0] on rank 0 and SCHEDULE[s][1] on rank 1 (round-robin owners).
SCHEDULE = [(0, 1), (2, 3), (0, 3), (2, 1), (0, 1), (2, 3)]


class Hierarchical:
    """mu ~ N(0, 10^2); theta_i ~ N(mu, 1); x_i ~ N(theta_i, 0.5^2); blocks sorted by x."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.sort(torch.randn(NUM_DATA, generator=g, dtype=torch.float64) * 2 + 1).values
        self.blocks = list(torch.arange(NUM_DATA).chunk(NUM_BLOCKS))

    def model(self, idx):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0), 10.0))
        with pyro.plate("data", NUM_DATA, subsample=idx) as ind:
            theta = pyro.sample("theta", dist.Normal(mu, 1.0))
            pyro.sample("x", dist.Normal(theta, 0.5), obs=self.x[ind])

    def guide(self, idx):
        loc = pyro.param("mu_loc", torch.tensor(0.0))
        scale = pyro.param("mu_scale", torch.tensor(1.0), constraint=dist.constraints.positive)
        pyro.sample("mu", dist.Normal(loc, scale))
        with pyro.plate("data", NUM_DATA, subsample=idx):
            theta_loc = pyro.param("theta_loc", torch.zeros(NUM_DATA), event_dim=0)
            theta_scale = pyro.param(
                "theta_scale", torch.ones(NUM_DATA), constraint=dist.constraints.positive, event_dim=0
            )
            pyro.sample("theta", dist.Normal(theta_loc, theta_scale))


def make(cls, problem, **kwargs):
    pdvi = cls(
        problem.model,
        problem.guide,
        pyro.optim.Adam({"lr": 0.05}),
        TraceMeanField_ELBO(num_particles=8, vectorize_particles=True),
        blocks=problem.blocks,
        solver=GenericSolver(inner_steps=10),
        **kwargs,
    )
    # Across processes the param store holds lambda_0 (each process holds its own blocks' copies
    # only); the one-process reference does the same.
    pdvi.estimate_after_epochs = None
    return pdvi


def main():
    from pyro_pdvi.distributed import DistributedPDVI

    parser = argparse.ArgumentParser()
    for name in ("rank", "world", "port"):
        parser.add_argument(name, type=int)
    parser.add_argument("out")
    parser.add_argument("--fail-at", type=int, default=-1)
    parser.add_argument("--die-at", type=int, default=-1)
    parser.add_argument("--resume-from", type=int, default=-1)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--run", type=int, default=0, help="DistributedPDVI.run this many cyclic epochs")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.distributed.init_process_group(
        "gloo", rank=args.rank, world_size=args.world, timeout=timedelta(seconds=args.timeout)
    )
    pyro.set_rng_seed(0)
    problem = Hierarchical()
    pdvi = make(DistributedPDVI, problem)
    if args.run:
        result = pdvi.run(args.run, order="cyclic", progress_bar=False, subsample_arg="idx")
        store = pyro.get_param_store()
        torch.save(
            {
                "losses": result.losses,
                "mu_loc": store["mu_loc"].detach(),
                "mu_scale": store["mu_scale"].detach(),
            },
            f"{args.out}/rank{args.rank}_run.pt",
        )
        torch.distributed.destroy_process_group()
        return 0
    start = 0
    if args.resume_from >= 0:
        saved = torch.load(f"{args.out}/rank{args.rank}_step{args.resume_from}.pt", weights_only=False)
        pyro.get_param_store().set_state(saved["param_store"])
        pdvi.load_state_dict(saved["pdvi"])
        start = args.resume_from + 1
    for s in range(start, len(SCHEDULE)):
        block = SCHEDULE[s][args.rank]
        if s == args.die_at:
            os._exit(3)
        if s == args.fail_at:
            # In place: a replayed graph (graph_replay) reads the data tensor the model read when
            # it was recorded, which an attribute replaced by a new tensor is not.
            problem.x[problem.blocks[block][0]] = float("nan")
        loss = pdvi.step(problem.blocks[block])
        store = pyro.get_param_store()
        torch.save(
            {
                "loss": loss,
                "mu_loc": store["mu_loc"].detach().clone(),
                "mu_scale": store["mu_scale"].detach().clone(),
                "theta_loc": store["theta_loc"].detach().clone(),
                "pdvi": pdvi.state_dict(),
                "param_store": store.get_state(),
            },
            f"{args.out}/rank{args.rank}_step{s}.pt",
        )
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
