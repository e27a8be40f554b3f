"""Loop vs vectorized multi-block steps on PDVI's generic path (``GenericSolver(vectorize=...)``).

A PDVI step over ``m`` blocks solves ``m`` augmented Lagrangians. ``GenericSolver`` evaluates
the ``m`` block objectives by a loop, one Pyro loss per block, or with ``vectorize=True`` by
one ``torch.func.vmap`` pass (the two kernels of ``pyro_pdvi.infer.objective.BlockObjective``).
This script times both on the Bayesian GMM of ``pyro_pdvi.models.gmm`` (``GMMModel``,
enumerated ``z``, ``TraceEnum_ELBO`` with vectorized particles) for several ``m`` and block
sizes, including the per-datum variant (blocks of one datum), and reports

* seconds per PDVI step (each block its own L-BFGS, ``--inner-steps`` evaluations of the
  block objectives per solve on both paths), and
* seconds per evaluation of all ``m`` block objectives and their gradients (the same
  work on both paths, so this ratio is the pure vectorization gain).

Run with one torch thread on a quiet machine; compare the two columns of one row.

``--compare-lbfgs`` instead compares the vectorized path's L-BFGS solves: each block its
own L-BFGS (``pyro_pdvi.infer.solvers.batched_lbfgs`` over the ``m`` blocks, the solver's
default) against a joint solve (one L-BFGS over the sum of the ``m`` augmented Lagrangians,
a joint line search and curvature pairs that mix the blocks: :class:`JointLBFGSSolver` here),
on one step's subproblems at fixed Monte Carlo noise: objective evaluations and seconds per
solve, seconds per PDVI step, and the gap to each block's optimum after ``--inner-steps``
evaluations: of the augmented Lagrangian ``L_b`` and of the block's copy ``lambda_b``, to the
better (per block) of a per-block and a joint solve of ``--reference-steps`` evaluations.

Example::

    python benchmarks/vectorized_blocks.py --configs 2x1000 8x1000 32x1000 64x1 --out results
    python benchmarks/vectorized_blocks.py --compare-lbfgs --configs 2x1000 4x1000 8x1000
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: import this checkout's benchmarks and pyro_pdvi, not an installed copy.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyro  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import gmm_pdvi, markdown_table, script_parser, setup_torch, write_csv  # noqa: E402
from pyro_pdvi import PDVI, BlockProblem, BlockSolution, GenericSolver  # noqa: E402
from pyro_pdvi.infer.solvers import batched_lbfgs  # noqa: E402
from pyro_pdvi.models.gmm import GMMModel, make_biased_gmm  # noqa: E402

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
    parser = script_parser(__doc__)
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["2x1000", "8x1000", "32x1000", "64x1"],
        help="MxS: m blocks of S data each per step (N = M*S, one step covers all blocks)",
    )
    parser.add_argument("--num-components", type=int, default=3, help="K")
    parser.add_argument("--dim", type=int, default=2, help="d")
    parser.add_argument("--particles", type=int, default=16, help="vectorized particles of the ELBO")
    parser.add_argument(
        "--inner-steps", type=int, default=10, help="GenericSolver(inner_steps=...): evaluations per solve"
    )
    parser.add_argument("--eta", type=float, default=1e-3, help="fixed PD-VI step size")
    parser.add_argument("--repeats", type=int, default=1, help="timed steps after one warm-up step")
    parser.add_argument("--eval-repeats", type=int, default=3, help="timed evaluations")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--seed", type=int, default=0, help="data, start and noise seed")
    parser.add_argument("--out", type=Path, default=None, help="folder for vectorized_blocks.csv")
    parser.add_argument(
        "--compare-lbfgs",
        action="store_true",
        help="compare per-block L-BFGS with a joint L-BFGS solve (see above)",
    )
    parser.add_argument(
        "--solve-repeats", type=int, default=3, help="timed solves of each (the fastest is reported)"
    )
    parser.add_argument(
        "--reference-steps", type=int, default=300, help="L-BFGS evaluations of the two reference solves"
    )
    return parser.parse_args(argv)


def make_data(config: str, args: argparse.Namespace) -> tuple[GMMModel, list[torch.Tensor]]:
    """``MxS``: the GMM on ``M`` blocks of ``S`` data."""
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
    return GMMModel(data.data, data.prior, seed=args.seed), data.blocks


def make_pdvi(gmm: GMMModel, blocks: list[torch.Tensor], args: argparse.Namespace, solver) -> PDVI:
    pyro.clear_param_store()
    pyro.set_rng_seed(args.seed)
    return gmm_pdvi(gmm, blocks, args.particles, eta=args.eta, solver=solver)


def seconds_per_step(gmm, blocks, args, vectorize: bool) -> tuple[float, PDVI]:
    solver = GenericSolver(args.inner_steps, concentrated_steps=args.inner_steps, vectorize=vectorize)
    pdvi = make_pdvi(gmm, blocks, args, solver)
    subsample = torch.cat(blocks)
    pdvi.step(subsample)  # warm-up: set-up, the ELBO's first-call checks
    start = time.perf_counter()
    for _ in range(args.repeats):
        pdvi.step(subsample)
    return (time.perf_counter() - start) / args.repeats, pdvi


def step_problem(pdvi: PDVI, blocks: list[torch.Tensor], seed: int) -> BlockProblem:
    """The subproblems of a step over every block at the current state, at the noise of ``seed``."""
    block_ids = torch.arange(len(blocks))
    return pdvi._problem(block_ids, [seed] * len(blocks), (torch.cat(blocks),), {})


def seconds_per_evaluation(
    pdvi: PDVI, blocks: list[torch.Tensor], args: argparse.Namespace
) -> tuple[float, float]:
    """One loss + gradient of all m block objectives: the loop kernel vs the vectorized one."""
    problem = step_problem(pdvi, blocks, args.seed)
    m = len(problem)
    copies = {k: v.expand(m, *v.shape).clone().requires_grad_() for k, v in problem.consensus.items()}
    rows = {k: v.clone().requires_grad_() for k, v in problem.local.items()}

    def evaluate(vectorize: bool) -> None:
        losses = problem.losses(copies, rows, vectorize)
        torch.autograd.grad(losses.sum(), [*copies.values(), *rows.values()])

    timings = []
    for vectorize in (False, True):
        evaluate(vectorize)  # warm-up
        start = time.perf_counter()
        for _ in range(args.eval_repeats):
            evaluate(vectorize)
        timings.append((time.perf_counter() - start) / args.eval_repeats)
    return timings[0], timings[1]


def benchmark(args: argparse.Namespace) -> list[dict]:
    rows = []
    for config in args.configs:
        gmm, blocks = make_data(config, args)
        loop_step, _ = seconds_per_step(gmm, blocks, args, vectorize=False)
        vectorized_step, pdvi = seconds_per_step(gmm, blocks, args, vectorize=True)
        loop_eval, vectorized_eval = seconds_per_evaluation(pdvi, blocks, args)
        rows.append(
            {
                "blocks": len(blocks),
                "block_size": len(blocks[0]),
                "loop_s_per_step": loop_step,
                "vectorized_s_per_step": vectorized_step,
                "step_speedup": loop_step / vectorized_step,
                "loop_s_per_eval": loop_eval,
                "vectorized_s_per_eval": vectorized_eval,
                "eval_speedup": loop_eval / vectorized_eval,
            }
        )
    return rows


class JointLBFGSSolver:
    """One L-BFGS (a batch of one) over all blocks' variables minimising ``sum_b L_b``: a joint
    line search, and curvature pairs that mix the blocks; the blocks' objectives by the
    vectorized kernel. The variables are :class:`GenericSolver`'s: whitened copies and rows.

    :param inner_steps: evaluations of the objective per solve.
    """

    def __init__(self, inner_steps: int) -> None:
        self.inner_steps = inner_steps

    def solve(self, problem: BlockProblem) -> BlockSolution:
        m = len(problem)
        start = {k: v.new_zeros(m, *v.shape) for k, v in problem.consensus.items()}
        start.update({k: v.detach() for k, v in problem.local.items()})
        shapes = {k: v.shape for k, v in start.items()}

        def unpack(x: torch.Tensor) -> tuple[dict, dict]:
            parts = x[0].split([shape.numel() for shape in shapes.values()])
            values = {k: part.view(shape) for (k, shape), part in zip(shapes.items(), parts)}
            copies = problem.whitened_copies({k: values[k] for k in problem.consensus})
            return copies, {k: values[k] for k in problem.local}

        def total(x: torch.Tensor) -> torch.Tensor:
            copies, rows = unpack(x)
            return (problem.losses(copies, rows, True) + problem.penalty(copies)).sum().reshape(1)

        flat = torch.cat([v.reshape(-1) for v in start.values()]).unsqueeze(0)
        result = batched_lbfgs(total, flat, self.inner_steps, check_every=1)
        copies, rows = unpack(result.x)
        copies = {k: v.detach().requires_grad_() for k, v in copies.items()}
        losses = problem.losses(copies, rows, True).detach()
        return BlockSolution({k: v.detach() for k, v in copies.items()}, rows, losses)


class CountingLosses:
    """A problem's block objective that counts its calls."""

    def __init__(self, losses) -> None:
        self.losses = losses
        self.calls = 0

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        self.calls += 1
        return self.losses(*args, **kwargs)


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


def solve_once(solver, problem: BlockProblem) -> tuple[BlockSolution, int, float]:
    """One solve of the problem: its solution, evaluations and seconds."""
    counting = CountingLosses(problem.losses)
    start = time.perf_counter()
    solution = solver.solve(dataclasses.replace(problem, losses=counting))
    return solution, counting.calls, time.perf_counter() - start


def lagrangians(solution: BlockSolution, problem: BlockProblem) -> torch.Tensor:
    """Each block's augmented Lagrangian ``L_b`` at a solution."""
    return solution.loss + problem.penalty(solution.globals)


def max_abs_gap(solution: BlockSolution, reference: BlockSolution) -> float:
    """The largest gap of any block copy's unconstrained coordinate to the reference's.

    Only the copies ``lambda_b``: the GMM's local logits have a flat direction (a constant
    added to a row of logits changes nothing), so their argmin is not a point."""
    return float(
        torch.stack(
            [(solution.globals[k] - reference.globals[k]).abs().max() for k in reference.globals]
        ).max()
    )


def best_reference(problem: BlockProblem, steps: int) -> BlockSolution:
    """Per block, the lower of the per-block and the joint solve with ``steps`` evaluations.

    The GMM's block objective (Monte Carlo at fixed noise, enumerated z) is not convex, and
    the two solvers may end in different local minima; the gap is to the better one."""
    first, second = (
        solve_once(solver, problem)[0]
        for solver in (
            GenericSolver(steps, concentrated_steps=steps, vectorize=True),
            JointLBFGSSolver(steps),
        )
    )
    first_is_lower = lagrangians(first, problem) <= lagrangians(second, problem)

    def pick(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.where(first_is_lower.reshape(-1, *(1,) * (a.dim() - 1)), a, b)

    return BlockSolution(
        {k: pick(first.globals[k], second.globals[k]) for k in first.globals},
        {k: pick(first.local[k], second.local[k]) for k in first.local},
        pick(first.loss, second.loss),
    )


def compare_lbfgs(args: argparse.Namespace) -> list[dict]:
    """Per-block vs joint L-BFGS on each config (see the module docstring)."""
    results = []
    for config in args.configs:
        gmm, blocks = make_data(config, args)
        subsample = torch.cat(blocks)
        solvers = {
            "joint": JointLBFGSSolver(args.inner_steps),
            "per-block": GenericSolver(args.inner_steps, concentrated_steps=args.inner_steps, vectorize=True),
        }
        step_seconds = {}
        for name, solver in solvers.items():
            warm_up = GenericSolver(args.inner_steps, concentrated_steps=args.inner_steps, vectorize=True)
            pdvi = make_pdvi(gmm, blocks, args, warm_up)
            pdvi.step(subsample)  # warm-up with the default solver: both timed runs start alike
            pdvi.solver = solver
            start = time.perf_counter()
            for _ in range(args.repeats):
                pdvi.step(subsample)
            step_seconds[name] = (time.perf_counter() - start) / args.repeats
        # One step's subproblems (the state after the last timed steps), at fixed noise.
        problem = step_problem(pdvi, blocks, 1)
        reference = best_reference(problem, args.reference_steps)
        solutions = {name: solve_once(solver, problem) for name, solver in solvers.items()}  # warm-up
        seconds = {name: float("inf") for name in solvers}
        for _ in range(args.solve_repeats):  # interleaved, the fastest of each: a shared machine
            for name, solver in solvers.items():
                solutions[name] = solve_once(solver, problem)
                seconds[name] = min(seconds[name], solutions[name][2])
        for name, (solution, evaluations, _) in solutions.items():
            results.append(
                {
                    "blocks": len(blocks),
                    "block_size": len(blocks[0]),
                    "solver": name,
                    "evaluations_per_solve": evaluations,
                    "s_per_solve": seconds[name],
                    "s_per_step": step_seconds[name],
                    "max_abs_gap": max_abs_gap(solution, reference),
                    "max_lagrangian_gap": float(
                        (lagrangians(solution, problem) - lagrangians(reference, problem)).max()
                    ),
                }
            )
    return results


def format_lbfgs_table(rows: list[dict]) -> str:
    header = ["m blocks", "block size", "L-BFGS", "evaluations/solve", "s/solve", "s/step"]
    header += ["max abs gap of lambda_b", "max L_b - L_b*"]
    lines = [
        [
            row["blocks"],
            row["block_size"],
            row["solver"],
            row["evaluations_per_solve"],
            f"{row['s_per_solve']:.3f}",
            f"{row['s_per_step']:.3f}",
            f"{row['max_abs_gap']:.2e}",
            f"{row['max_lagrangian_gap']:.2e}",
        ]
        for row in rows
    ]
    return markdown_table(header, lines)


def format_table(rows: list[dict]) -> str:
    header = ["m blocks", "block size", "loop s/step", "vectorized s/step", "step speedup"]
    header += ["loop s/eval", "vectorized s/eval", "eval speedup"]
    lines = [
        [
            row["blocks"],
            row["block_size"],
            f"{row['loop_s_per_step']:.3f}",
            f"{row['vectorized_s_per_step']:.3f}",
            f"{row['step_speedup']:.2f}x",
            f"{row['loop_s_per_eval']:.4f}",
            f"{row['vectorized_s_per_eval']:.4f}",
            f"{row['eval_speedup']:.2f}x",
        ]
        for row in rows
    ]
    return markdown_table(header, lines)


def main(args: argparse.Namespace) -> list[dict]:
    setup_torch(args.threads)
    rows = compare_lbfgs(args) if args.compare_lbfgs else benchmark(args)
    print(
        f"GMM K={args.num_components} d={args.dim}, TraceEnum_ELBO({args.particles} vectorized particles), "
        f"L-BFGS <= {args.inner_steps} evaluations, {args.threads} thread(s), "
        f"torch {torch.__version__}, pyro {pyro.__version__}"
    )
    print(format_lbfgs_table(rows) if args.compare_lbfgs else format_table(rows))
    if args.out is not None:
        name = "vectorized_lbfgs.csv" if args.compare_lbfgs else "vectorized_blocks.csv"
        write_csv(rows, args.out / name, LBFGS_COLUMNS if args.compare_lbfgs else COLUMNS)
    return rows


if __name__ == "__main__":
    main(parse_args())
