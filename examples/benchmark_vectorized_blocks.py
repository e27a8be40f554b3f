"""Loop vs vectorized multi-block steps on PDVI's generic path (``vectorize_blocks``).

A PDVI step over ``m`` blocks solves ``m`` augmented Lagrangians. The generic path loops
over the blocks, one Pyro loss per evaluation; with ``vectorize_blocks=True`` one
``torch.func.vmap`` pass evaluates all ``m`` (see ``pyro_pdvi.infer.vectorized``). This
script times both on the Bayesian GMM of ``pyro_pdvi.models.gmm`` (``GMMModel``,
enumerated ``z``, ``TraceEnum_ELBO`` with vectorized particles) for several ``m`` and
block sizes, including the per-datum variant (blocks of one datum), and reports

* seconds per PDVI step (L-BFGS primal solve, at most ``--inner-steps`` iterations;
  the joint solve of the vectorized path need not take the same number of evaluations
  as the loop's per-block solves), and
* seconds per evaluation of all ``m`` block objectives and their gradients (the same
  work on both paths, so this ratio is the pure vectorization gain).

Run with one torch thread on a quiet machine; compare the two columns of one row.

Example::

    python examples/benchmark_vectorized_blocks.py --configs 2x1000 8x1000 32x1000 64x1 --out results
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import pyro
import torch
from pyro.infer import TraceEnum_ELBO

from pyro_pdvi import PDVI
from pyro_pdvi.infer.handlers import FixedNoise
from pyro_pdvi.infer.objective import BlockObjective
from pyro_pdvi.infer.vectorized import BatchedBlockObjective
from pyro_pdvi.models.gmm import GMMModel, make_biased_gmm

COLUMNS = [
    "blocks",
    "block_size",
    "loop_s_per_step",
    "vectorized_s_per_step",
    "step_speedup",
    "loop_s_per_eval",
    "vectorized_s_per_eval",
    "eval_speedup",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["2x1000", "8x1000", "32x1000", "64x1"],
        help="MxS: m blocks of S data each per step (N = M*S, one step covers all blocks)",
    )
    parser.add_argument("--num-components", type=int, default=3, help="K")
    parser.add_argument("--dim", type=int, default=2, help="d")
    parser.add_argument("--particles", type=int, default=16, help="vectorized particles of the ELBO")
    parser.add_argument("--inner-steps", type=int, default=10, help="L-BFGS iterations per step")
    parser.add_argument("--eta", type=float, default=1e-3, help="fixed PD-VI step size")
    parser.add_argument("--repeats", type=int, default=1, help="timed steps after one warm-up step")
    parser.add_argument("--eval-repeats", type=int, default=3, help="timed evaluations")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="folder for vectorized_blocks.csv")
    return parser.parse_args(argv)


def make_pdvi(gmm: GMMModel, blocks: list[torch.Tensor], args: argparse.Namespace, vectorize: bool) -> PDVI:
    elbo = TraceEnum_ELBO(max_plate_nesting=1, num_particles=args.particles, vectorize_particles=True)
    return PDVI(
        gmm.model,
        gmm.guide,
        pyro.optim.Adam({"lr": 0.01}),
        elbo,
        blocks=blocks,
        eta=args.eta,
        inner_steps=args.inner_steps,
        vectorize_blocks=vectorize,
    )


def seconds_per_step(gmm, blocks, args, vectorize: bool) -> tuple[float, PDVI]:
    pyro.clear_param_store()
    pyro.set_rng_seed(args.seed)
    pdvi = make_pdvi(gmm, blocks, args, vectorize)
    subsample = torch.cat(blocks)
    pdvi.step(subsample)  # warm-up: setup, the ELBO's first-call checks
    start = time.perf_counter()
    for _ in range(args.repeats):
        pdvi.step(subsample)
    return (time.perf_counter() - start) / args.repeats, pdvi


def seconds_per_evaluation(
    pdvi: PDVI, blocks: list[torch.Tensor], args: argparse.Namespace
) -> tuple[float, float]:
    """One loss + gradient of all m block objectives: the loop of BlockObjective vs one vmap pass."""
    store = dict(pyro.get_param_store().named_parameters())
    indices = torch.stack(blocks)
    subsample = indices.reshape(-1)
    consensus = {name: store[name].detach() for name in pdvi.layout.names}
    local_full = {s.name: store[s.name].detach() for s in pdvi.local_sites}
    loss_fn = pdvi.loss.differentiable_loss
    loop = BlockObjective(pdvi.model, pdvi.guide, loss_fn, pdvi.plate, pdvi.layout, pdvi.local_sites)
    batched = BatchedBlockObjective(
        pdvi.model, pdvi.guide, loss_fn, pdvi.plate, pdvi.layout, pdvi.local_sites
    )
    noise = FixedNoise(args.seed, torch.device("cpu"))

    def run_loop() -> None:
        for block in indices:
            copies = {k: v.clone().requires_grad_() for k, v in consensus.items()}
            rows = {
                s.name: local_full[s.name].index_select(s.axis, block).clone().requires_grad_()
                for s in pdvi.local_sites
            }
            with noise():
                loss = loop(block, copies, rows, local_full, (subsample,), {})
            torch.autograd.grad(loss, [*copies.values(), *rows.values()])

    def run_vectorized() -> None:
        m = len(indices)
        copies = {k: v.expand(m, *v.shape).clone().requires_grad_() for k, v in consensus.items()}
        rows = {
            s.name: local_full[s.name]
            .index_select(s.axis, subsample)
            .unflatten(s.axis, indices.shape)
            .movedim(s.axis - 1, 0)
            .clone()
            .requires_grad_()
            for s in pdvi.local_sites
        }
        with noise():
            losses = batched(indices, copies, rows, (subsample,), {})
        torch.autograd.grad(losses.sum(), [*copies.values(), *rows.values()])

    timings = []
    for run in (run_loop, run_vectorized):
        run()  # warm-up
        start = time.perf_counter()
        for _ in range(args.eval_repeats):
            run()
        timings.append((time.perf_counter() - start) / args.eval_repeats)
    return timings[0], timings[1]


def benchmark(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(args.threads)
    torch.set_default_dtype(torch.float64)
    rows = []
    for config in args.configs:
        num_blocks, block_size = (int(x) for x in config.lower().split("x"))
        data = make_biased_gmm(
            num_blocks * block_size,
            args.num_components,
            args.dim,
            block_size,
            0.9,
            seed=args.seed,
            separation=3.0,
        )
        gmm = GMMModel(data.data, data.prior, seed=args.seed)
        loop_step, _ = seconds_per_step(gmm, data.blocks, args, vectorize=False)
        vectorized_step, pdvi = seconds_per_step(gmm, data.blocks, args, vectorize=True)
        loop_eval, vectorized_eval = seconds_per_evaluation(pdvi, data.blocks, args)
        rows.append(
            {
                "blocks": num_blocks,
                "block_size": block_size,
                "loop_s_per_step": loop_step,
                "vectorized_s_per_step": vectorized_step,
                "step_speedup": loop_step / vectorized_step,
                "loop_s_per_eval": loop_eval,
                "vectorized_s_per_eval": vectorized_eval,
                "eval_speedup": loop_eval / vectorized_eval,
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [
        "| m blocks | block size | loop s/step | vectorized s/step | step speedup "
        "| loop s/eval | vectorized s/eval | eval speedup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['blocks']} | {row['block_size']} | {row['loop_s_per_step']:.3f} "
            f"| {row['vectorized_s_per_step']:.3f} | {row['step_speedup']:.2f}x "
            f"| {row['loop_s_per_eval']:.4f} | {row['vectorized_s_per_eval']:.4f} "
            f"| {row['eval_speedup']:.2f}x |"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> list[dict]:
    rows = benchmark(args)
    print(
        f"GMM K={args.num_components} d={args.dim}, TraceEnum_ELBO({args.particles} vectorized particles), "
        f"L-BFGS <= {args.inner_steps} iterations, {args.threads} thread(s), "
        f"torch {torch.__version__}, pyro {pyro.__version__}"
    )
    print(format_table(rows))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "vectorized_blocks.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
    return rows


if __name__ == "__main__":
    main(parse_args())
