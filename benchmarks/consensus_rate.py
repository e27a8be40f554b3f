"""How fast the consensus iteration of PD-VI contracts per epoch on a quadratic model of a suite
model, for each constant ``c`` of the natural step-size rule (``AutoStepSize(scale=c)``).

The model: block ``b``'s share of the objective in the regression coefficients is
``0.5 (x - a_b)' H_b (x - a_b)``, with ``H_b`` the block's Hessian of the negative log joint at
the reference means (the data's term and a ``1/n`` share of the prior's; for the scale regression
at the reference's ``E_q[1/sigma^2]``, its noise scale held there) and ``a_b`` random targets.
The iteration is the paper's global rule [1, Alg. 1] with exact block solves, one block per step,
the blocks in a fresh random order each epoch (as the suite runs them), and per coordinate
``eta_j = c n / F_j``, ``F_j = sum_b (H_b)_jj``: the natural rule at the optimum. No Monte Carlo
noise, no inexact solves, no step-size upkeep: what remains is how the blocks' curvatures,
their directions included, set the rate. Printed per model: the condition number of the
diagonally scaled Hessian ``S^-1/2 F S^-1/2`` (``F = sum_b H_b``, ``S = diag(F)``) and, per
constant, the error's geometric rate per epoch (epochs 10 to ``--epochs``) and its size after 5
epochs relative to the optimum's norm. ``--dense`` adds the same with a dense penalty
``D = F / (c n)``: the engine's on a site that it whitens (:mod:`pyro_pdvi.infer.whitening`,
since 13zc). With ``--out``, a CSV and a plot of the rate against the constant.
``docs/benchmarks.md`` 13zb compares these with the engine's traces.

Also synthetic round sites, ``round<n>`` and ``uneven<n>`` (:func:`synthetic_hessians`), where the
best constant moves with the number of blocks ``n`` (13zd).

Examples::

    python benchmarks/consensus_rate.py --models logreg,scale,biglogreg --constants 0.125,0.25,1,4
    python benchmarks/consensus_rate.py --models round6,round20,round100,uneven6,uneven20,uneven100

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import floats, names, script_parser, setup_torch  # noqa: E402
from benchmarks.generic_suite.models import LogisticRegression, NormalScale, Problem, make_problem  # noqa: E402
from benchmarks.generic_suite.references import compute_reference  # noqa: E402
from pyro_pdvi.infer.whitening import diagonal_condition as site_condition  # noqa: E402

#: The suite models whose means have a closed-form Hessian here.
SUPPORTED = ("logreg", "biglogreg", "scale")
#: Synthetic round sites, ``round<n>`` or ``uneven<n>`` (:func:`synthetic_hessians`).
SYNTHETIC = ("round", "uneven")


def parse_args(argv: list[str] | None = None):
    parser = script_parser(__doc__)
    parser.add_argument("--models", type=names, default=list(SUPPORTED), help=f"comma list of {SUPPORTED}")
    parser.add_argument(
        "--constants", type=floats, default=[0.0625, 0.125, 0.25, 0.5, 1.0, 2.0, 4.0], help="values of c"
    )
    parser.add_argument("--epochs", type=int, default=40, help="epochs per run (rate fit from epoch 10)")
    parser.add_argument("--seeds", type=int, default=3, help="block orders per constant (geometric mean)")
    parser.add_argument(
        "--dense",
        action="store_true",
        help="also the dense preconditioner D = F / (c n), F the whole Hessian",
    )
    parser.add_argument("--out", default=None, help="CSV file to write; the plot goes beside it (.png)")
    return parser.parse_args(argv)


def block_hessians(problem: Problem, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each block's Hessian of the negative log joint in the coefficients ``w`` at the reference
    means ``params``, shape ``(n, P, P)``.

    :param problem: a suite logistic or scale regression.
    :param params: the reference's AutoNormal parameters.
    """
    x = problem.x.to(torch.float64)
    num_blocks, size = len(problem.blocks), x.shape[1]
    prior_share = torch.eye(size, dtype=torch.float64) / (num_blocks * problem.prior_scale**2)
    if isinstance(problem, NormalScale):
        loc, scale = params["AutoNormal.locs.sigma"], params["AutoNormal.scales.sigma"]
        weights = torch.exp(-2 * loc + 2 * scale**2).expand(len(x))  # E_q[1/sigma^2], sigma ~ LogNormal
    elif isinstance(problem, LogisticRegression) and problem.name in ("logreg", "biglogreg"):
        probability = torch.sigmoid(x @ params["AutoNormal.locs.w"].to(torch.float64))
        weights = probability * (1 - probability)
    else:
        raise ValueError(f"consensus_rate: model {problem.name!r} is not one of {SUPPORTED}")
    return torch.stack([(x[i] * weights[i, None]).T @ x[i] + prior_share for i in problem.blocks])


def synthetic_hessians(name: str) -> torch.Tensor | None:
    """The blocks' Hessians of a synthetic site of 4 coordinates that a diagonal penalty leaves
    round, for ``round<n>`` (every block about alike: ``1 + 0.3 u``) or ``uneven<n>`` (blocks that
    inform a coordinate from 0.01 to 1.01x: ``u^3 + 0.01``), ``u`` uniform, diagonal, ``(n, 4, 4)``;
    ``None`` for other names. Where the best constant of a round site moves with ``n``
    (``docs/benchmarks.md`` 13zd, :func:`pyro_pdvi.infer.step_sizes.round_site_scale`)."""
    for kind in SYNTHETIC:
        if name.startswith(kind) and name[len(kind) :].isdigit():
            num_blocks = int(name[len(kind) :])
            u = torch.rand(num_blocks, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
            return torch.diag_embed(1 + 0.3 * u if kind == "round" else u**3 + 0.01)
    return None


def diagonal_condition(hessians: torch.Tensor) -> float:
    """The condition number of ``S^-1/2 F S^-1/2``, ``F`` the blocks' sum and ``S`` its diagonal
    (what decides whether PDVI whitens a site: :mod:`pyro_pdvi.infer.whitening`)."""
    return site_condition(hessians.sum(0))


def consensus_errors(
    hessians: torch.Tensor, constant: float, epochs: int, seed: int, dense: bool = False
) -> list[float]:
    """Run the paper's consensus iteration on the quadratic model (module docstring).

    :param hessians: the blocks' Hessians, ``(n, P, P)``.
    :param constant: ``c`` in ``eta_j = c n / F_j``.
    :param epochs: epochs to run.
    :param seed: seed of the block orders (the targets' draw is fixed).
    :param dense: the penalty ``D = F / (c n)`` with ``F = sum_b H_b`` the whole matrix, not its
        diagonal (a dense natural preconditioner, the engine's on a whitened site).
    :returns: after each epoch, the consensus's distance to the minimiser
        ``(sum_b H_b)^-1 sum_b H_b a_b`` over the minimiser's norm.
    """
    num_blocks, size, _ = hessians.shape
    total = hessians.sum(0)
    penalty = (total if dense else torch.diag(total.diagonal())) / (constant * num_blocks)  # the penalty D
    targets = torch.randn(num_blocks, size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    pulls = torch.einsum("bij,bj->bi", hessians, targets)
    optimum = torch.linalg.solve(hessians.sum(0), pulls.sum(0))
    solves = torch.linalg.inv(hessians + penalty)
    duals = torch.zeros(num_blocks, size, dtype=torch.float64)
    consensus, h = torch.zeros(size, dtype=torch.float64), torch.zeros(size, dtype=torch.float64)
    order = torch.Generator().manual_seed(seed)
    errors = []
    for _ in range(epochs):
        for b in torch.randperm(num_blocks, generator=order).tolist():
            copy = solves[b] @ (pulls[b] - duals[b] + penalty @ consensus)  # the exact block solve
            move = copy - consensus
            duals[b] += penalty @ move
            h += move / num_blocks
            consensus = copy + h
        errors.append(max(float((consensus - optimum).norm() / optimum.norm()), 1e-300))
    return errors


def epoch_rate(
    hessians: torch.Tensor, constant: float, epochs: int, seed: int, dense: bool = False
) -> tuple[float, float]:
    """:func:`consensus_errors`' geometric rate per epoch over epochs 10 to ``epochs`` (more than
    10), and the error after 5 epochs."""
    errors = consensus_errors(hessians, constant, epochs, seed, dense)
    return math.exp((math.log(errors[-1]) - math.log(errors[9])) / (epochs - 10)), errors[4]


def main(args) -> list[dict]:
    setup_torch(1, torch.float64)
    rows = []
    for name in args.models:
        hessians = synthetic_hessians(name)
        if hessians is None:
            if name not in SUPPORTED:
                raise SystemExit(
                    f"consensus_rate: --models takes {SUPPORTED} or round<n> / uneven<n>, not {name!r}"
                )
            problem = make_problem(name, quick=False)
            hessians = block_hessians(problem, compute_reference(problem).params)
        condition = diagonal_condition(hessians)
        for preconditioner in ("diagonal", "dense") if args.dense else ("diagonal",):
            cells = []
            for constant in args.constants:
                runs = [
                    epoch_rate(hessians, constant, args.epochs, seed, dense=preconditioner == "dense")
                    for seed in range(args.seeds)
                ]
                rate = math.exp(sum(math.log(r) for r, _ in runs) / len(runs))
                after5 = math.exp(sum(math.log(e) for _, e in runs) / len(runs))
                rows.append({"model": name, "blocks": len(hessians), "condition": condition,
                             "preconditioner": preconditioner, "constant": constant, "rate": rate,
                             "error_after_5": after5})  # fmt: skip
                cells.append(f"c={constant:g}: {rate:.3f} ({after5:.2g})")
            head = f"{name:10s} {len(hessians):4d} blocks  kappa {condition:7.1f}  {preconditioner:8s}  "
            print(head + "  ".join(cells), flush=True)
    if args.out:
        _write(rows, Path(args.out))
    return rows


def _write(rows: list[dict], out: Path) -> None:
    """The rows as CSV, and the rate against the constant per model as a plot beside it."""
    with open(out, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5, 3.5))
    for name, preconditioner in dict.fromkeys((r["model"], r["preconditioner"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["preconditioner"]) == (name, preconditioner)]
        label = f"{name} (kappa {mine[0]['condition']:.0f}), {preconditioner}"
        style = "-" if preconditioner == "diagonal" else "--"
        axis.plot([r["constant"] for r in mine], [r["rate"] for r in mine], style, marker="o", label=label)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("natural rule's constant c")
    axis.set_ylabel("error's rate per epoch")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main(parse_args())
