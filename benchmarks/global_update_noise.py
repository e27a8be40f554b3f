"""How much Monte Carlo noise reaches the consensus, by global-update rule and particles.

Model: mu ~ N(0, 10^2), theta_i ~ N(mu, 1), x_i ~ N(theta_i, 0.5^2), data sorted
into fixed blocks, AutoNormal guide, TraceMeanField_ELBO. The target is Gaussian,
so the mean-field optimum's mean of q(mu) is the exact posterior mean, known in
closed form, and its sd is the inverse square root of the precision's mu-mu entry.
Each PDVI run takes one block per step (``GenericSolver``: L-BFGS at fixed noise); after
each of the last epochs it records the errors of q(mu)'s mean and sd. Printed: their RMS
over those epochs and seeds, for each ``--rules`` entry (the paper's rule, lambda_0 =
gamma + h with gamma the step's block copy; the consensus rule, gamma the mean of every
block's latest copy; "auto", the paper's rule for ``--warmup-epochs`` then the consensus
rule), and for Pyro's SVI+Adam on the same blocks in the same order. With ``--antithetic
on`` (or ``both``) the runs draw their particles in antithetic pairs
(``PDVI(antithetic=True)``; SVI steps under ``pyro_pdvi.AntitheticNoise``). ``--frozen``
adds the exact optimum of the fixed-noise objective that PDVI converges to when every
block keeps one noise draw for the whole run. Seconds per epoch count the steps only.

Example::

    python benchmarks/global_update_noise.py --particles 8,64,256 --seeds 3
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: import this checkout's benchmarks and pyro_pdvi, not an installed copy.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyro  # noqa: E402
import pyro.distributions as dist  # noqa: E402
import torch  # noqa: E402
from pyro.infer import SVI, TraceMeanField_ELBO  # noqa: E402
from pyro.infer.autoguide import AutoNormal  # noqa: E402

from benchmarks.common import (  # noqa: E402
    add_step_size_arguments,
    auto_step_size,
    ints,
    markdown_table,
    names,
    run_epochs,
    script_parser,
    setup_torch,
)
from pyro_pdvi import PDVI, AntitheticNoise, GenericSolver  # noqa: E402
from pyro_pdvi.infer.antithetic import antithetic_loss  # noqa: E402
from pyro_pdvi.infer.handlers import FixedNoise, ParamOverride  # noqa: E402
from pyro_pdvi.infer.solvers import batched_lbfgs  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--num-data", type=int, default=100, help="N")
    parser.add_argument("--num-blocks", type=int, default=10, help="fixed blocks, sorted by x")
    parser.add_argument("--particles", default="8,64,256", help="vectorized ELBO particles to compare")
    parser.add_argument("--epochs", type=int, default=15, help="passes over the data")
    parser.add_argument(
        "--last", type=int, default=5, help="epochs at the end over which the error is measured"
    )
    parser.add_argument("--seeds", type=int, default=3, help="runs per method, seeds 0, 1, ...")
    add_step_size_arguments(parser)
    parser.add_argument(
        "--inner-steps",
        type=int,
        default=10,
        help="GenericSolver(inner_steps=...) of PDVI: evaluations of the block objective per solve",
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
    """The model, its data sorted into blocks, and the exact mean-field optimum of q(mu)."""

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

    def errors(self) -> dict:
        """The error of q(mu)'s mean and the relative error of its sd."""
        return {
            "mean_error": float(pyro.param("AutoNormal.locs.mu").detach()) - self.exact_mean,
            "scale_error": float(pyro.param("AutoNormal.scales.mu").detach()) / self.exact_scale - 1,
        }


class AntitheticSVI(SVI):
    """SVI whose steps draw the guide's particles in antithetic pairs."""

    def step(self, *args, **kwargs):
        with AntitheticNoise():
            return super().step(*args, **kwargs)


class FrozenNoiseOptimum:
    """The exact minimiser of sum_b f_b with every block's noise fixed to one draw: what
    PDVI converges to if each block kept its noise for the whole run. ``step`` solves it
    (the first call, by L-BFGS on all params, a batch of one; later calls do nothing), so
    the errors read the same point each epoch.
    """

    def __init__(self, problem: SortedHierarchy, loss, antithetic: bool, max_iter: int = 500) -> None:
        self.problem = problem
        self.guide = problem.guide()
        self.loss_fn = loss.differentiable_loss
        if antithetic:
            self.loss_fn = antithetic_loss(self.loss_fn)
        self.max_iter = max_iter
        self.solved = False

    def objective(self, noises: list[FixedNoise], values: dict | None = None) -> torch.Tensor:
        """``sum_b f_b`` at the params' current values, or at the unconstrained ``values``."""
        model, guide = self.problem.model, self.guide
        if values is not None:
            constraints = pyro.get_param_store().get_state()["constraints"]
            model, guide = (
                ParamOverride(values, constraints)(model),
                ParamOverride(values, constraints)(guide),
            )
        total = 0.0
        for noise, block in zip(noises, self.problem.blocks):
            with noise():
                total = total + self.loss_fn(model, guide, block) * len(block) / self.problem.N
        return total

    def step(self, block) -> None:
        if self.solved:
            return
        seeds = torch.randint(0, 2**62, (len(self.problem.blocks),)).tolist()
        noises = [FixedNoise(seed, torch.device("cpu")) for seed in seeds]
        self.objective(noises)  # creates the params
        params = dict(pyro.get_param_store().named_parameters())
        sizes = [p.numel() for p in params.values()]

        def values_of(x: torch.Tensor) -> dict:
            return {name: part.view_as(p) for (name, p), part in zip(params.items(), x[0].split(sizes))}

        start = torch.cat([p.detach().reshape(-1) for p in params.values()]).unsqueeze(0)
        result = batched_lbfgs(
            lambda x: self.objective(noises, values_of(x)).reshape(1), start, self.max_iter, check_every=1
        )
        with torch.no_grad():
            for name, value in values_of(result.x).items():
                params[name].copy_(value)
        self.solved = True


def main(args: argparse.Namespace) -> list[dict]:
    setup_torch(args.threads)
    problem = SortedHierarchy(args.num_data, args.num_blocks)
    print(
        f"N={args.num_data}, {args.num_blocks} sorted blocks, {args.epochs} epochs, error over the last "
        f"{args.last}, {args.seeds} seeds, threads={torch.get_num_threads()}"
    )
    first_scored = args.epochs - args.last + 1

    def evaluate(epoch: int) -> dict:
        return problem.errors() if epoch >= first_scored else {}

    def loss(particles: int) -> TraceMeanField_ELBO:
        # A new one for every run: its first use guesses max_plate_nesting by tracing, which draws.
        return TraceMeanField_ELBO(num_particles=particles, vectorize_particles=True)

    def pdvi(particles: int, rule: str, antithetic: bool) -> PDVI:
        return PDVI(
            problem.model,
            problem.guide(),
            pyro.optim.Adam({"lr": 0.01}),
            loss(particles),
            blocks=problem.blocks,
            eta=auto_step_size(args),
            solver=GenericSolver(inner_steps=args.inner_steps),
            global_update=rule,
            warmup_epochs=args.warmup_epochs,
            antithetic=antithetic,
        )

    def svi(particles: int, svi_class: type) -> SVI:
        return svi_class(
            problem.model, problem.guide(), pyro.optim.Adam({"lr": args.svi_lr}), loss(particles)
        )

    def frozen(particles: int, antithetic: bool) -> FrozenNoiseOptimum:
        return FrozenNoiseOptimum(problem, loss(particles), antithetic)

    rows, lines = [], []
    for particles in ints(args.particles):
        methods = {}
        for antithetic in {"off": [False], "on": [True], "both": [False, True]}[args.antithetic]:
            tag = ", antithetic" if antithetic else ""
            for rule in names(args.rules):
                methods[f"PDVI {rule}{tag}"] = partial(pdvi, particles, rule, antithetic)
            methods[f"SVI+Adam lr={args.svi_lr:g}{tag}"] = partial(
                svi, particles, AntitheticSVI if antithetic else SVI
            )
            if args.frozen:
                methods[f"fixed-noise optimum{tag}"] = partial(frozen, particles, antithetic)
        for name, make_algo in methods.items():
            errors, seconds = [], 0.0
            for seed in range(args.seeds):
                _, history = run_epochs(make_algo, problem.blocks, args.epochs, seed, evaluate, label=name)
                errors += [(row["mean_error"], row["scale_error"]) for row in history if "mean_error" in row]
                seconds += history[-1]["seconds"]
            rms, rms_scale = torch.tensor(errors).square().mean(0).sqrt().tolist()
            row = {
                "particles": particles,
                "method": name,
                "rms_error": rms,
                "rms_scale_error": rms_scale,
                "seconds_per_epoch": seconds / (args.seeds * args.epochs),
            }
            rows.append(row)
            lines.append(
                [particles, name, f"{rms:.4f}", f"{rms_scale:.4f}", f"{row['seconds_per_epoch']:.2f}"]
            )
            print(f"  {particles} particles, {name}: done", flush=True)
    header = [
        "particles",
        "method",
        "RMS error of E_q[mu]",
        "RMS relative error of sd_q[mu]",
        "seconds/epoch",
    ]
    print("\n" + markdown_table(header, lines))
    return rows


if __name__ == "__main__":
    main(parse_args())
