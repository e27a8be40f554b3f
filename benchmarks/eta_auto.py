"""How good is ``eta="auto"``'s step size on a GMM, against a grid of fixed ones?

Closed-form path (``GMMBlockSolver``), cluster-sorted blocks (``make_biased_gmm``),
float64, one block per step in a fresh random order each epoch, the global update the
default ``"auto"`` picks (the paper's rule, the solve being deterministic). After each
epoch: the relative gap of the exact negative ELBO to the full-batch CAVI optimum (q(z)
re-solved in closed form) and W2 to the true mixture as a ratio to the CAVI optimum's.

It also prints the curvature ``L_j`` that ``eta="auto"`` measures (the reduced block
objective ``min_phi f_b``, max over ``--curvature-blocks`` blocks), per group, at the
initial point and at the CAVI optimum, for one group (PD-VI) and one per site (P2D-VI).

Example (the well-separated case: d = 2, separation 3)::

    python examples/benchmark_eta_auto.py --dim 2 --separation 3 --etas 1e-3,3e-3,1e-2,3e-2
"""

from __future__ import annotations

import argparse
import time

import pyro
import torch
from pyro.infer import TraceEnum_ELBO

from pyro_pdvi import PDVI
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
    parser.add_argument("--num-data", type=int, default=2000, help="N")
    parser.add_argument("--num-components", type=int, default=5, help="K")
    parser.add_argument("--dim", type=int, default=2, help="d")
    parser.add_argument("--block-size", type=int, default=200, help="points per fixed block")
    parser.add_argument("--purity", type=float, default=0.95, help="share of a block's dominant cluster")
    parser.add_argument("--separation", type=float, default=3.0, help="prior sd of the true centres")
    parser.add_argument("--seeds", default="0", help="data/start seeds (comma list)")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--etas", default="", help="fixed step sizes to compare (comma list)")
    parser.add_argument(
        "--remeasure",
        default="none,1",
        help="remeasure_epochs of the eta='auto' runs, comma list of '+'-joined epochs ('none': ())",
    )
    parser.add_argument("--groups", default="none", help="'none' (PD-VI), 'per_site' (P2D-VI), or both")
    parser.add_argument("--curvatures", action="store_true", help="print L_j at the start and optimum")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quiet", action="store_true", help="no per-epoch lines")
    return parser.parse_args(argv)


class Problem:
    def __init__(self, args: argparse.Namespace, seed: int) -> None:
        synthetic = make_biased_gmm(
            args.num_data,
            args.num_components,
            args.dim,
            args.block_size,
            args.purity,
            seed=seed,
            separation=args.separation,
        )
        self.data, self.prior, self.blocks = synthetic.data, synthetic.prior, synthetic.blocks
        self.centers, self.seed = synthetic.centers, seed
        self.gmm = GMMModel(self.data, self.prior, seed=seed)
        self.optimum = cavi(
            self.data,
            self.prior,
            m=self.gmm.init_means.clone(),
            rho=self.gmm.init_log_variances.clone(),
            num_iterations=5000,
        )
        self.cavi_loss, self.cavi_w2 = self.raw(self.optimum.m, self.optimum.rho)

    def raw(self, m: torch.Tensor, rho: torch.Tensor) -> tuple[float, float]:
        alpha = torch.log_softmax(expected_log_likelihood(self.data, self.prior, m, rho), -1)
        loss = float(negative_elbo(self.data, self.prior, m, rho, alpha))
        true_var = self.prior.sigma0_sq.expand_as(self.centers)
        return loss, wasserstein_gmm(self.centers, true_var, *predictive_components(self.prior, m, rho))

    def score(self) -> tuple[float, float]:
        loss, w2 = self.raw(pyro.param("m").detach(), pyro.param("rho").detach())
        return (loss - self.cavi_loss) / abs(self.cavi_loss), w2 / self.cavi_w2

    def pdvi(self, eta: float | str, groups: str | None, **options) -> PDVI:
        return PDVI(
            self.gmm.model,
            self.gmm.guide,
            pyro.optim.Adam({"lr": 0.01}),
            TraceEnum_ELBO(max_plate_nesting=1),
            blocks=self.blocks,
            eta=eta,
            groups=groups,
            local_solver=GMMBlockSolver(self.data, self.prior),
            **options,
        )

    def run(self, eta, groups, epochs, quiet, label, **options) -> dict:
        pyro.clear_param_store()
        pyro.set_rng_seed(self.seed)
        algo = self.pdvi(eta, groups, **options)
        order = torch.Generator().manual_seed(self.seed)
        history, elapsed, etas = [], 0.0, []
        for epoch in range(1, epochs + 1):
            start = time.perf_counter()
            for b in torch.randperm(len(self.blocks), generator=order).tolist():
                algo.step(self.blocks[b])
            elapsed += time.perf_counter() - start
            gap, w2 = self.score()
            history.append((gap, w2))
            etas.append(dict(algo.step_sizes))
            if not quiet:
                steps = " ".join(f"{k}={v:.3g}" for k, v in algo.step_sizes.items())
                print(f"  {label:34s} epoch {epoch:3d} gap {gap:9.2e} W2/W2* {w2:7.3f}  {steps}")
        return {"label": label, "history": history, "seconds": elapsed, "etas": etas}

    def curvatures(self, groups: str | None) -> dict[str, list[float]]:
        """``L_j`` as ``eta="auto"`` measures it, at the start and at the CAVI optimum."""
        pyro.clear_param_store()
        pyro.set_rng_seed(self.seed)
        algo = self.pdvi("auto", groups, eta_scale=1.0)
        algo.step(self.blocks[0])  # set-up (measures at the start)
        out = {"start": list(algo.step_sizes.values())}
        algo._state.consensus = algo.layout.flatten({"m": self.optimum.m, "rho": self.optimum.rho})
        pyro.param("alpha").data.copy_(self.optimum.alpha)
        out["optimum"] = (1.0 / algo._estimate_curvatures((), {})).tolist()
        names = list(algo.step_sizes)
        return {name: [1.0 / out["start"][j], 1.0 / out["optimum"][j]] for j, name in enumerate(names)}


def first(history: list[tuple[float, float]], which: int, threshold: float) -> int | None:
    return next((e + 1 for e, row in enumerate(history) if row[which] <= threshold), None)


def main(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(args.threads)
    torch.set_default_dtype(torch.float64)
    groups_list = [None if g == "none" else g for g in args.groups.split(",")]
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        problem = Problem(args, seed)
        print(
            f"seed {seed}: N={args.num_data} K={args.num_components} d={args.dim} "
            f"blocks={len(problem.blocks)}x{args.block_size} purity={args.purity} "
            f"separation={args.separation}; CAVI -ELBO {problem.cavi_loss:.4f} W2* {problem.cavi_w2:.4f} "
            f"({len(problem.optimum.losses)} sweeps)"
        )
        for groups in groups_list:
            kind = "P2D-VI" if groups else "PD-VI"
            if args.curvatures:
                for name, (start, optimum) in problem.curvatures(groups).items():
                    print(
                        f"  {kind} curvature L[{name}]: start {start:.4g}, CAVI optimum {optimum:.4g} "
                        f"(ratio {optimum / start:.3g})"
                    )
            for setting in args.remeasure.split(","):
                epochs = () if setting == "none" else tuple(float(e) for e in setting.split("+"))
                label = f"{kind} auto, remeasure {setting}"
                run = problem.run("auto", groups, args.epochs, args.quiet, label, remeasure_epochs=epochs)
                results.append({"seed": seed, **run})
            for eta in [float(v) for v in args.etas.split(",") if v]:
                label = f"{kind} eta={eta:g}"
                results.append({"seed": seed, **problem.run(eta, groups, args.epochs, args.quiet, label)})

    print(
        "\n| seed | run | eta (start -> end) | epochs to gap<1e-3 | epochs to W2<=1.1xW2* | "
        "final gap | final W2/W2* | s |"
    )
    print("|" + "---|" * 8)
    for r in results:
        history = r["history"]
        start = ",".join(f"{v:.3g}" for v in r["etas"][0].values())
        end = ",".join(f"{v:.3g}" for v in r["etas"][-1].values())
        etas = start if start == end else f"{start} -> {end}"
        print(
            f"| {r['seed']} | {r['label']} | {etas} | {first(history, 0, 1e-3)} | {first(history, 1, 1.1)} | "
            f"{history[-1][0]:.2e} | {history[-1][1]:.3f} | {r['seconds']:.1f} |"
        )
    return results


if __name__ == "__main__":
    main(parse_args())
