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

``--compare-lbfgs`` instead compares the vectorized path's L-BFGS solves: each block its
own L-BFGS (``pyro_pdvi.infer.lbfgs.batched_lbfgs``, the solver's default) against the
earlier joint solve (one ``primal.lbfgs`` over the sum of the ``m`` augmented
Lagrangians, :class:`JointLBFGSSolver` here), on one step's batch of subproblems at fixed
Monte Carlo noise: objective evaluations and seconds per solve, seconds per PDVI step,
and the gap to each block's optimum after ``--inner-steps`` iterations: of the augmented
Lagrangian ``L_b`` and of the block's copy ``lambda_b``, to the better (per block) of a
per-block and a joint solve of ``--reference-steps`` iterations.

Example::

    python examples/benchmark_vectorized_blocks.py --configs 2x1000 8x1000 32x1000 64x1 --out results
    python examples/benchmark_vectorized_blocks.py --compare-lbfgs --configs 2x1000 4x1000 8x1000
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
from pyro_pdvi.infer.primal import BlockBatch, BlockBatchSolution, lbfgs
from pyro_pdvi.infer.vectorized import BatchedBlockObjective, VectorizedBlockSolver
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
    parser.add_argument(
        "--compare-lbfgs",
        action="store_true",
        help="compare per-block L-BFGS with the earlier joint L-BFGS solve (see above)",
    )
    parser.add_argument(
        "--solve-repeats", type=int, default=3, help="timed solves of each (the fastest is reported)"
    )
    parser.add_argument(
        "--reference-steps", type=int, default=300, help="L-BFGS iterations of the two reference solves"
    )
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


class JointLBFGSSolver(VectorizedBlockSolver):
    """The vectorized solve before per-block L-BFGS: one :func:`~pyro_pdvi.infer.primal.lbfgs`
    over all blocks' variables minimising ``sum_b L_b`` (a joint line search, and curvature
    pairs that mix the blocks)."""

    def _solve_by_lbfgs(self, batch, consensus, block_losses):
        root = {k: v.sqrt() for k, v in batch.step_sizes.items()}
        free = {k: torch.zeros_like(v, requires_grad=True) for k, v in consensus.items()}
        rows = {k: v.detach().clone().requires_grad_() for k, v in batch.local.items()}

        def copies() -> dict[str, torch.Tensor]:
            return {k: consensus[k] + root[k] * z for k, z in free.items()}

        def total() -> torch.Tensor:
            current = copies()
            return (block_losses(current, rows) + batch.penalty(current)).sum()

        lbfgs(total, [*free.values(), *rows.values()], self.inner_steps)
        with torch.no_grad():
            return copies(), {k: v.detach() for k, v in rows.items()}


class CountingObjective:
    """A batched block objective that counts its calls."""

    def __init__(self, objective: BatchedBlockObjective) -> None:
        self.objective = objective
        self.calls = 0

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        self.calls += 1
        return self.objective(*args, **kwargs)


LBFGS_COLUMNS = [
    "blocks",
    "block_size",
    "solver",
    "evaluations_per_solve",
    "s_per_solve",
    "s_per_step",
    "max_abs_gap",
    "max_lagrangian_gap",
]


def solve_once(
    solver: VectorizedBlockSolver, batch: BlockBatch, seed: int
) -> tuple[BlockBatchSolution, int, float]:
    """One solve of the batch at the noise of ``seed``: its solution, evaluations and seconds."""
    counting = CountingObjective(solver.objective)
    solver.objective = counting
    try:
        start = time.perf_counter()
        solution = solver.solve_batch(batch, FixedNoise(seed, torch.device("cpu")))
        seconds = time.perf_counter() - start
    finally:
        solver.objective = counting.objective
    return solution, counting.calls, seconds


def lagrangians(solution: BlockBatchSolution, batch: BlockBatch) -> torch.Tensor:
    """Each block's augmented Lagrangian ``L_b`` at a solution."""
    return solution.loss + batch.penalty(solution.globals)


def max_abs_gap(solution: BlockBatchSolution, reference: BlockBatchSolution) -> float:
    """The largest gap of any block copy's unconstrained coordinate to the reference's.

    Only the copies ``lambda_b``: the GMM's local logits have a flat direction (a constant
    added to a row of logits changes nothing), so their argmin is not a point."""
    return float(
        torch.stack(
            [(solution.globals[k] - reference.globals[k]).abs().max() for k in reference.globals]
        ).max()
    )


def best_reference(objective: BatchedBlockObjective, batch: BlockBatch, steps: int) -> BlockBatchSolution:
    """Per block, the lower of the per-block and the joint solve with ``steps`` iterations.

    The GMM's block objective (Monte Carlo at fixed noise, enumerated z) is not convex, and
    the two solvers may end in different local minima; the gap is to the better one."""
    solutions = [
        solve_once(cls(objective, "lbfgs", steps), batch, 1)[0]
        for cls in (VectorizedBlockSolver, JointLBFGSSolver)
    ]
    first_is_lower = lagrangians(solutions[0], batch) <= lagrangians(solutions[1], batch)

    def pick(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.where(first_is_lower.reshape(-1, *(1,) * (a.dim() - 1)), a, b)

    first, second = solutions
    return BlockBatchSolution(
        {k: pick(first.globals[k], second.globals[k]) for k in first.globals},
        {k: pick(first.local[k], second.local[k]) for k in first.local},
        pick(first.loss, second.loss),
    )


def compare_lbfgs(args: argparse.Namespace) -> list[dict]:
    """Per-block vs joint L-BFGS on each config (see the module docstring)."""
    torch.set_num_threads(args.threads)
    torch.set_default_dtype(torch.float64)
    results = []
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
        subsample = torch.cat(data.blocks)
        step_seconds = {}
        for name, solver_class in (("joint", JointLBFGSSolver), ("per-block", VectorizedBlockSolver)):
            pyro.clear_param_store()
            pyro.set_rng_seed(args.seed)
            pdvi = make_pdvi(gmm, data.blocks, args, vectorize=True)
            pdvi.step(subsample)  # warm-up with the default solver: both timed runs start alike
            default = pdvi._vectorized_solver
            pdvi._vectorized_solver = solver_class(default.objective, "lbfgs", args.inner_steps)
            start = time.perf_counter()
            for _ in range(args.repeats):
                pdvi.step(subsample)
            step_seconds[name] = (time.perf_counter() - start) / args.repeats
        # One step's batch of subproblems (the state after the last timed steps).
        batch = pdvi._block_batch(torch.arange(num_blocks), (subsample,), {})
        objective = pdvi._vectorized_solver.objective
        reference = best_reference(objective, batch, args.reference_steps)
        solvers = {
            "joint": JointLBFGSSolver(objective, "lbfgs", args.inner_steps),
            "per-block": VectorizedBlockSolver(objective, "lbfgs", args.inner_steps),
        }
        solutions = {name: solve_once(solver, batch, 1) for name, solver in solvers.items()}  # warm-up
        seconds = {name: float("inf") for name in solvers}
        for _ in range(args.solve_repeats):  # interleaved, the fastest of each: a shared machine
            for name, solver in solvers.items():
                solutions[name] = solve_once(solver, batch, 1)
                seconds[name] = min(seconds[name], solutions[name][2])
        for name, (solution, evaluations, _) in solutions.items():
            results.append(
                {
                    "blocks": num_blocks,
                    "block_size": block_size,
                    "solver": name,
                    "evaluations_per_solve": evaluations,
                    "s_per_solve": seconds[name],
                    "s_per_step": step_seconds[name],
                    "max_abs_gap": max_abs_gap(solution, reference),
                    "max_lagrangian_gap": float(
                        (lagrangians(solution, batch) - lagrangians(reference, batch)).max()
                    ),
                }
            )
    return results


def format_lbfgs_table(rows: list[dict]) -> str:
    lines = [
        "| m blocks | block size | L-BFGS | evaluations/solve | s/solve | s/step "
        "| max abs gap of lambda_b | max L_b - L_b* |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['blocks']} | {row['block_size']} | {row['solver']} | {row['evaluations_per_solve']} "
            f"| {row['s_per_solve']:.3f} | {row['s_per_step']:.3f} | {row['max_abs_gap']:.2e} "
            f"| {row['max_lagrangian_gap']:.2e} |"
        )
    return "\n".join(lines)


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
    rows = compare_lbfgs(args) if args.compare_lbfgs else benchmark(args)
    print(
        f"GMM K={args.num_components} d={args.dim}, TraceEnum_ELBO({args.particles} vectorized particles), "
        f"L-BFGS <= {args.inner_steps} iterations, {args.threads} thread(s), "
        f"torch {torch.__version__}, pyro {pyro.__version__}"
    )
    print(format_lbfgs_table(rows) if args.compare_lbfgs else format_table(rows))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "vectorized_lbfgs.csv" if args.compare_lbfgs else "vectorized_blocks.csv"
        with open(args.out / name, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=LBFGS_COLUMNS if args.compare_lbfgs else COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
    return rows


if __name__ == "__main__":
    main(parse_args())
