"""How much Monte Carlo noise reaches the consensus, by global-update rule and particles.

Model: mu ~ N(0, 10^2), theta_i ~ N(mu, 1), x_i ~ N(theta_i, 0.5^2), data sorted
into fixed blocks, AutoNormal guide, TraceMeanField_ELBO. The target is Gaussian,
so the mean-field optimum's mean of q(mu) is the exact posterior mean, known in
closed form, and its sd is the inverse square root of the precision's mu-mu entry.
Each PDVI run takes one block per step; after each of the last epochs it records
the errors of q(mu)'s mean and sd. Printed: their RMS over those epochs and seeds,
for each ``--rules`` entry (the paper's rule, lambda_0 = gamma + h with gamma the
step's block copy; the consensus rule, gamma the mean of every block's latest copy;
"auto", the paper's rule for ``--warmup-epochs`` then the consensus rule), and for
Pyro's SVI+Adam on the same blocks. With ``--antithetic on`` (or ``both``) the runs
draw their particles in antithetic pairs (``PDVI(antithetic=True)``; SVI steps under
``pyro_pdvi.AntitheticNoise``). ``--frozen`` adds the exact optimum of the fixed-noise
objective that PDVI converges to when every block keeps one noise draw for the whole run.

Example::

    python examples/benchmark_global_update_noise.py --particles 8,64,256 --seeds 3
"""

from __future__ import annotations

import argparse
import time

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_pdvi import PDVI, AntitheticNoise
from pyro_pdvi.infer.antithetic import antithetic_loss
from pyro_pdvi.infer.handlers import FixedNoise
from pyro_pdvi.infer.primal import lbfgs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-data", type=int, default=100, help="N")
    parser.add_argument("--num-blocks", type=int, default=10, help="fixed blocks, sorted by x")
    parser.add_argument("--particles", default="8,64,256", help="vectorized ELBO particles to compare")
    parser.add_argument("--epochs", type=int, default=15, help="passes over the data")
    parser.add_argument(
        "--last", type=int, default=5, help="epochs at the end over which the error is measured"
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--eta-scale", type=float, default=2.0, help="PDVI eta_scale")
    parser.add_argument(
        "--remeasure-epochs",
        type=lambda text: tuple(float(v) for v in text.split(",") if v),
        default=(),
        help="PDVI remeasure_epochs, a comma list of epochs (default: none)",
    )
    parser.add_argument(
        "--rules", default="auto,paper,consensus", help="PDVI global_update rules (comma list)"
    )
    parser.add_argument("--warmup-epochs", type=float, default=5.0, help="PDVI warmup_epochs (rule 'auto')")
    parser.add_argument("--svi-lr", type=float, default=0.05, help="Adam learning rate of the SVI reference")
    parser.add_argument(
        "--antithetic", choices=("off", "on", "both"), default="both", help="antithetic particle pairs"
    )
    parser.add_argument(
        "--frozen",
        action="store_true",
        help="also solve the fixed-noise objective (one noise draw per block) exactly",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return parser.parse_args(argv)


class SortedHierarchy:
    def __init__(self, num_data: int, num_blocks: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.sort(torch.randn(num_data, generator=g) * 2 + 1).values
        self.N = num_data
        self.blocks = list(torch.arange(num_data).chunk(num_blocks))
        var = 1.0 + 0.25
        self.exact_mean = float((self.x.sum() / var) / (1 / 100 + num_data / var))
        # Mean-field optimum of a Gaussian target: 1 / (the joint precision's mu-mu entry).
        self.exact_scale = (1 / 100 + num_data / 1.0) ** -0.5

    def model(self, idx):
        mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        with pyro.plate("data", self.N, subsample=idx) as ind:
            theta = pyro.sample("theta", dist.Normal(mu, 1.0))
            pyro.sample("x", dist.Normal(theta, 0.5), obs=self.x[ind])

    def guide(self):
        return AutoNormal(self.model, create_plates=lambda idx: pyro.plate("data", self.N, subsample=idx))


class AntitheticSVI(SVI):
    """SVI whose steps draw the guide's particles in antithetic pairs."""

    def step(self, *args, **kwargs):
        with AntitheticNoise():
            return super().step(*args, **kwargs)


class FrozenNoiseOptimum:
    """The exact minimiser of sum_b f_b with every block's noise fixed to one draw: what
    PDVI converges to if each block kept its noise for the whole run. ``step`` solves it
    (the first call; later calls do nothing), so ``errors`` reads the same point each epoch.
    """

    def __init__(self, problem: SortedHierarchy, loss, antithetic: bool) -> None:
        self.problem = problem
        self.guide = problem.guide()
        self.loss_fn = loss.differentiable_loss
        if antithetic:
            self.loss_fn = antithetic_loss(self.loss_fn)
        self.solved = False

    def objective(self, noises: list[FixedNoise]) -> torch.Tensor:
        total = 0.0
        for noise, block in zip(noises, self.problem.blocks):
            with noise():
                total = (
                    total + self.loss_fn(self.problem.model, self.guide, block) * len(block) / self.problem.N
                )
        return total

    def step(self, block) -> None:
        if self.solved:
            return
        seeds = torch.randint(0, 2**62, (len(self.problem.blocks),)).tolist()
        noises = [FixedNoise(seed, torch.device("cpu")) for seed in seeds]
        self.objective(noises)  # creates the params
        params = [p for _, p in pyro.get_param_store().named_parameters()]
        lbfgs(lambda: self.objective(noises), params, max_iter=500)
        self.solved = True


def errors(problem, make_algo, args, seed):
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    algo = make_algo()
    out = []
    for epoch in range(args.epochs):
        for b in torch.randperm(len(problem.blocks)).tolist():
            algo.step(problem.blocks[b])
        if epoch >= args.epochs - args.last:
            mean_error = float(pyro.param("AutoNormal.locs.mu").detach()) - problem.exact_mean
            scale_error = float(pyro.param("AutoNormal.scales.mu").detach()) / problem.exact_scale - 1
            out.append((mean_error, scale_error))
    return out


def main(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(args.threads)
    torch.set_default_dtype(torch.float64)
    problem = SortedHierarchy(args.num_data, args.num_blocks)
    rows = []
    print(
        f"N={args.num_data}, {args.num_blocks} sorted blocks, {args.epochs} epochs, error over the last "
        f"{args.last}, {args.seeds} seeds, threads={torch.get_num_threads()}"
    )
    print(
        "\n| particles | method | RMS error of E_q[mu] | RMS relative error of sd_q[mu] | seconds/epoch |"
        "\n|---|---|---|---|---|"
    )
    for particles in [int(p) for p in args.particles.split(",")]:

        def loss(particles=particles):
            return TraceMeanField_ELBO(num_particles=particles, vectorize_particles=True)

        settings = {"off": [False], "on": [True], "both": [False, True]}[args.antithetic]
        methods = {}
        for antithetic in settings:
            tag = ", antithetic" if antithetic else ""
            for rule in args.rules.split(","):
                methods[f"PDVI {rule}{tag}"] = lambda rule=rule, antithetic=antithetic: PDVI(
                    problem.model,
                    problem.guide(),
                    pyro.optim.Adam({"lr": 0.01}),
                    loss(),
                    blocks=problem.blocks,
                    global_update=rule,
                    warmup_epochs=args.warmup_epochs,
                    eta_scale=args.eta_scale,
                    inner_steps=10,
                    antithetic=antithetic,
                    remeasure_epochs=args.remeasure_epochs,
                )
            svi_class = AntitheticSVI if antithetic else SVI
            methods[f"SVI+Adam lr={args.svi_lr:g}{tag}"] = lambda svi_class=svi_class: svi_class(
                problem.model, problem.guide(), pyro.optim.Adam({"lr": args.svi_lr}), loss()
            )
            if args.frozen:
                methods[f"fixed-noise optimum{tag}"] = lambda antithetic=antithetic: FrozenNoiseOptimum(
                    problem, loss(), antithetic
                )
        for name, make_algo in methods.items():
            start = time.perf_counter()
            errs = torch.tensor(
                [e for seed in range(args.seeds) for e in errors(problem, make_algo, args, seed)]
            )
            seconds = (time.perf_counter() - start) / (args.seeds * args.epochs)
            rms, rms_scale = errs.square().mean(0).sqrt().tolist()
            rows.append(
                {
                    "particles": particles,
                    "method": name,
                    "rms_error": rms,
                    "rms_scale_error": rms_scale,
                    "seconds_per_epoch": seconds,
                }
            )
            print(f"| {particles} | {name} | {rms:.4f} | {rms_scale:.4f} | {seconds:.2f} |")
    return rows


if __name__ == "__main__":
    main(parse_args())
