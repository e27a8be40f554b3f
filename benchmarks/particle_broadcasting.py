"""A model written for one draw, under vectorized particles: what PDVI and SVI then fit.

Model: ``y ~ N(m + e[group], 1)``, ``m ~ N(0, 10^2)``, ``e ~ N(0, I)``, one block per group
(sorted by group), AutoNormal guide, ``Trace_ELBO()``. Written as many users write it, ``e`` a
``to_event`` vector indexed by the data (``m[..., None] + e[..., group]``), it runs with one draw;
under vectorized particles every draw gains a leading particle dimension and the observation
broadcasts ``e``'s particles against ``m``'s, so the data count once per particle. Written with
the effects in a plate (``--written plate``), it takes particles. The model is linear-Gaussian:
the mean-field optimum has the posterior's means and the sds ``1 / sqrt(precision_ii)``, in
closed form.

Runs, each from the same start and block orders:

* ``pdvi``: PDVI at its defaults (``particles="auto"``). On the model written for one draw it
  finds the broadcast at its warm-up and draws its particles in a loop
  (``PDVI._check_particle_broadcasting``, ``docs/benchmarks.md`` 13zf);
* ``pdvi-vectorized``: PDVI with the user's ``Trace_ELBO(num_particles=64,
  vectorize_particles=True)``, the particles it drew before that check;
* ``svi-LR``: Pyro's SVI+Adam with ``Trace_ELBO()`` (one draw) at each learning rate.

Printed: after the given epochs and at the given seconds (steps only; CPU, one thread; SVI runs
``--svi-epochs``, more than PDVI's, so that it has the same seconds), the
largest error of the means in posterior sds and the largest relative error of the sds, over
``m`` and every ``e``.

Example::

    python benchmarks/particle_broadcasting.py --epochs 20 --seconds 1,2,5
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: import this checkout's benchmarks and pyro_pdvi, not an installed copy.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyro  # noqa: E402
import pyro.distributions as dist  # noqa: E402
import torch  # noqa: E402
from pyro.infer import SVI, Trace_ELBO  # noqa: E402
from pyro.infer.autoguide import AutoNormal  # noqa: E402

from benchmarks.common import floats, ints, markdown_table, run_epochs, script_parser, setup_torch  # noqa: E402
from pyro_pdvi import PDVI  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--groups", type=int, default=8, help="groups, one block each")
    parser.add_argument("--group-size", type=int, default=50, help="data per group")
    parser.add_argument(
        "--written", choices=("one-draw", "plate"), default="one-draw", help="how the model is written"
    )
    parser.add_argument("--epochs", type=int, default=20, help="PDVI's passes over the blocks")
    parser.add_argument("--svi-epochs", type=int, default=200, help="SVI's passes (its epochs cost less)")
    parser.add_argument("--report-epochs", type=ints, default=[5, 20], help="epochs of the table")
    parser.add_argument("--seconds", type=floats, default=[1.0, 2.0, 5.0], help="step seconds of the table")
    parser.add_argument("--svi-lrs", type=floats, default=[0.01, 0.03, 0.1], help="SVI+Adam learning rates")
    parser.add_argument("--seeds", type=ints, default=[0], help="run seeds (block orders, noise)")
    return parser.parse_args(argv)


class GroupEffects:
    """The data and the two writings of the model; the exact mean-field optimum."""

    def __init__(self, groups: int, group_size: int, data_seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(data_seed)
        self.groups = groups
        self.group_of = torch.arange(groups).repeat_interleave(group_size)
        effects = 0.5 * torch.randn(groups, generator=generator)
        self.y = 1.0 + effects[self.group_of] + torch.randn(len(self.group_of), generator=generator)
        self.blocks = list(torch.arange(len(self.y)).chunk(groups))

    def one_draw(self, idx: torch.Tensor | None = None) -> None:
        m = pyro.sample("m", dist.Normal(0.0, 10.0))
        e = pyro.sample("e", dist.Normal(0.0, 1.0).expand([self.groups]).to_event(1))
        with pyro.plate("data", len(self.y), subsample=idx) as i:
            pyro.sample("y", dist.Normal(m[..., None] + e[..., self.group_of[i]], 1.0), obs=self.y[i])

    def plate(self, idx: torch.Tensor | None = None) -> None:
        m = pyro.sample("m", dist.Normal(0.0, 10.0))
        with pyro.plate("groups", self.groups):
            e = pyro.sample("e", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(self.y), subsample=idx) as i:
            pyro.sample("y", dist.Normal(m + e[..., self.group_of[i]], 1.0), obs=self.y[i])

    def optimum(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The means of ``(m, e)`` and their mean-field sds."""
        design = torch.cat(
            [torch.ones(len(self.y), 1), torch.nn.functional.one_hot(self.group_of)], 1
        ).double()
        precision = design.T @ design + torch.diag(torch.tensor([10.0**-2] + [1.0] * self.groups)).double()
        return torch.linalg.solve(precision, design.T @ self.y.double()), precision.diag().rsqrt()


def errors(means: torch.Tensor, sds: torch.Tensor) -> dict:
    """The fitted guide's largest errors: of the means in sds, of the sds relative."""
    fitted_means = torch.cat([pyro.param("AutoNormal.locs.m").reshape(1), pyro.param("AutoNormal.locs.e")])
    fitted_sds = torch.cat([pyro.param("AutoNormal.scales.m").reshape(1), pyro.param("AutoNormal.scales.e")])
    return {
        "mean_error": float(((fitted_means.detach().double() - means) / sds).abs().max()),
        "sd_error": float((fitted_sds.detach().double() / sds - 1).abs().max()),
    }


def at_seconds(rows: list[dict], budget: float) -> dict | None:
    """The last epoch's row within ``budget`` step seconds."""
    within = [row for row in rows if row["seconds"] <= budget]
    return within[-1] if within else None


def main(args: argparse.Namespace) -> list[dict]:
    setup_torch(1, torch.float32)
    problem = GroupEffects(args.groups, args.group_size)
    model = problem.one_draw if args.written == "one-draw" else problem.plate
    means, sds = problem.optimum()
    methods = {
        "pdvi": lambda: PDVI(
            model, AutoNormal(model), pyro.optim.Adam({"lr": 0.01}), Trace_ELBO(), blocks=problem.blocks
        )
    }
    methods["pdvi-vectorized"] = lambda: PDVI(
        model, AutoNormal(model), pyro.optim.Adam({"lr": 0.01}),
        Trace_ELBO(num_particles=64, vectorize_particles=True), blocks=problem.blocks,
    )  # fmt: skip
    for lr in args.svi_lrs:
        methods[f"svi-{lr:g}"] = lambda lr=lr: SVI(
            model, AutoNormal(model), pyro.optim.Adam({"lr": lr}), Trace_ELBO()
        )
    results = []
    for seed in args.seeds:
        for name, make in methods.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                epochs = args.svi_epochs if name.startswith("svi") else args.epochs
                stepper, rows = run_epochs(
                    make, problem.blocks, epochs, seed, lambda epoch: errors(means, sds)
                )
            solve = getattr(stepper, "solve_loss", None)
            particles = (
                f"{solve.loss.num_particles} {'vectorized' if solve.loss.vectorize_particles else 'looped'}"
                if solve
                else "1"
            )
            flagged = any("particle dimension" in str(w.message) for w in caught)
            results.append(
                {"method": name, "seed": seed, "particles": particles, "flagged": flagged, "rows": rows}
            )
    print(f"model written {args.written}; {args.groups} groups of {args.group_size}; float32, 1 thread")
    header = ["method", "seed", "solve particles", "warned"]
    header += [f"epoch {e} mean / sd err" for e in args.report_epochs]
    header += [f"{s:g} s mean / sd err" for s in args.seconds] + ["s / epoch"]
    lines = []
    for result in results:
        rows = result["rows"]
        cells = [result["method"], result["seed"], result["particles"], "yes" if result["flagged"] else "no"]
        for epoch in args.report_epochs:
            row = rows[min(epoch, len(rows)) - 1]
            cells.append(f"{row['mean_error']:.3f} / {row['sd_error']:.3f}")
        for budget in args.seconds:
            row = at_seconds(rows, budget)
            cells.append("-" if row is None else f"{row['mean_error']:.3f} / {row['sd_error']:.3f}")
        cells.append(f"{rows[-1]['seconds'] / len(rows):.3f}")
        lines.append(cells)
    print(markdown_table(header, lines))
    return results


if __name__ == "__main__":
    main(parse_args())
