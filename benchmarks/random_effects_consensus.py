"""Why PDVI is slow on the generic suite's random-effects model: the consensus rules with exact
block solves on that model's mean part, where nothing is Monte Carlo.

At fixed noise sd and group-effect sds, the suite's random intercept + slope model
(``benchmarks/generic_suite/models.py``, ``MixedEffects``: 30 groups, one block per group) is a
quadratic in its means ``(alpha, beta, a_1..a_G, b_1..b_G)``. Each block's ``f_b`` is its
least-squares term plus ``|b|/N`` of the Gaussian prior; its primal solve is one linear solve
(``(A_b + D) x = c_b - mu_b + D lambda_0``), and the dual and global updates are PDVI's own
(:class:`~pyro_pdvi.infer.consensus.ConsensusState`), with the step sizes of the natural rule of
``eta="auto"`` (``eta_j = n / F_j``, ``F_j`` the total curvature, bounded by
``BLOCK_CURVATURE_BOUND / max_b c_bj``; :mod:`~pyro_pdvi.infer.step_sizes`). The table is the rms
error of ``lambda_0`` against the exact optimum (one linear solve) after some epochs (one block
per step, a fresh random order each epoch), for each global rule, block layout and bound.

The data determine ``alpha + a_g`` (and ``beta + b_g``) tightly and the split between them only
through the priors, so the full objective is ill-conditioned along ``alpha + c, a_g - c``. With
exact solves the paper's rule follows that direction and the weighted rule (PDVI's default after
its first epoch), which averages a coordinate over the blocks where the step's block barely
informs it, lags it (``docs/benchmarks.md``, section 13h, with what happened when the engine
tried the paper's rule there through its inexact Monte Carlo solves).

``--couplings none,measured`` also runs each rule with the concentrated coordinates coupled to
the shared ones after the first epoch, as PDVI does (:mod:`~pyro_pdvi.infer.coupling`, with
:func:`~pyro_pdvi.infer.coupling.measure_coupling` on the exact Hessians): the state moves to the
coordinates ``lambda~ = T lambda`` and each solve is the same quadratic in them (section 13l).

Example::

    python benchmarks/random_effects_consensus.py --epochs 60
    python benchmarks/random_effects_consensus.py --layouts per_group --rules weighted \
        --couplings none,measured --epochs 20
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: import this checkout's benchmarks and pyro_pdvi, not an installed copy.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    floats,
    ints,
    markdown_table,
    names,
    pyplot,
    save_figure,
    script_parser,
    setup_torch,
    write_csv,
)
from benchmarks.generic_suite.models import MixedEffects  # noqa: E402
from pyro_pdvi.infer.consensus import GLOBAL_UPDATES, ConsensusState  # noqa: E402
from pyro_pdvi.infer.coupling import Coupling, measure_coupling  # noqa: E402
from pyro_pdvi.infer.step_sizes import BLOCK_CURVATURE_BOUND  # noqa: E402

LAYOUTS = ("per_group", "three_groups", "iid")
COUPLINGS = ("none", "measured")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--epochs", type=int, default=60, help="passes over the blocks")
    parser.add_argument(
        "--rules", default="paper,weighted,consensus", help=f"global rules, of {GLOBAL_UPDATES}"
    )
    parser.add_argument(
        "--layouts",
        default=",".join(LAYOUTS),
        help="blocks: one per group (the suite's), three groups each, or 30 random (i.i.d.) blocks",
    )
    parser.add_argument(
        "--bounds",
        default=f"{BLOCK_CURVATURE_BOUND:g},inf",
        help="the natural rule's bound eta_j <= bound / max_b c_bj (inf: none)",
    )
    parser.add_argument(
        "--couplings",
        default="none",
        help=f"of {COUPLINGS}: the diagonal preconditioner only, or coupled after the first epoch",
    )
    parser.add_argument("--report-epochs", default="1,5,10,20,40,60", help="epochs shown in the table")
    parser.add_argument("--seed", type=int, default=1, help="seed of the block orders")
    parser.add_argument("--out", default=None, help="folder for a CSV of every epoch and a plot")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return parser.parse_args(argv)


class MeanPart:
    """The suite's random-effects model at fixed scales, as a quadratic in its means.

    :param data: the suite's problem, for its data, groups and fixed-effect prior.
    :param blocks: the blocks' data indices.
    :param noise_sd: sd of y given the means.
    :param intercept_sd: prior sd of the group intercepts ``a_g``.
    :param slope_sd: prior sd of the group slopes ``b_g``.
    """

    def __init__(
        self,
        data: MixedEffects,
        blocks: list[torch.Tensor],
        noise_sd: float = 0.5,
        intercept_sd: float = 1.0,
        slope_sd: float = 0.5,
    ) -> None:
        groups, num_data = data.num_groups, data.num_data
        x, y, group = data.x.double(), data.y.double(), data.group
        design = torch.zeros(num_data, 2 + 2 * groups, dtype=torch.float64)
        rows = torch.arange(num_data)
        design[:, 0], design[:, 1] = 1.0, x
        design[rows, 2 + group], design[rows, 2 + groups + group] = 1.0, x
        fixed_precision = data.fixed_prior_scale**-2
        prior = torch.cat(
            [
                torch.full((2,), fixed_precision),
                torch.full((groups,), intercept_sd**-2),
                torch.full((groups,), slope_sd**-2),
            ]
        ).double()
        self.curvatures = torch.stack(
            [design[i].T @ design[i] / noise_sd**2 + len(i) / num_data * torch.diag(prior) for i in blocks]
        )
        self.linear = torch.stack([design[i].T @ y[i] / noise_sd**2 for i in blocks])
        self.optimum = torch.linalg.solve(self.curvatures.sum(0), self.linear.sum(0))

    def solve(
        self,
        block: int,
        dual: torch.Tensor,
        consensus: torch.Tensor,
        step_sizes: torch.Tensor,
        coupling: Coupling | None = None,
    ):
        """``argmin_x f_b(x) + <mu_b, x - lambda_0> + 1/2 ||x - lambda_0||^2_D``, exactly: in the
        coupled coordinates ``x~ = T x`` if a coupling is given (``f_b(T^{-1} x~)``, whose
        curvature is ``T^{-T} A_b T^{-1}``; dual, consensus and step sizes are then ``x~``'s).

        :param block: ``b``.
        :param dual: ``mu_b``, shape ``(P,)``.
        :param consensus: ``lambda_0``, shape ``(P,)``.
        :param step_sizes: ``eta`` per coordinate (``D = diag(1 / eta)``), shape ``(P,)``.
        :param coupling: the map ``T``, or ``None`` for the params' coordinates.
        """
        curvature, linear = self.curvatures[block], self.linear[block]
        if coupling is not None:
            back = coupling.inverse(torch.eye(len(linear), dtype=linear.dtype)).T  # T^{-1}
            curvature, linear = back.T @ curvature @ back, back.T @ linear
        penalty = 1.0 / step_sizes
        return torch.linalg.solve(curvature + torch.diag(penalty), linear - dual + penalty * consensus)


def layout_blocks(data: MixedEffects, layout: str) -> list[torch.Tensor]:
    """The blocks of a layout (see ``--layouts``)."""
    per_group = [torch.nonzero(data.group == g).reshape(-1) for g in range(data.num_groups)]
    if layout == "per_group":
        return per_group
    if layout == "three_groups":
        return [torch.cat(per_group[k : k + 3]) for k in range(0, len(per_group), 3)]
    if layout == "iid":
        order = torch.randperm(data.num_data, generator=torch.Generator().manual_seed(0))
        return list(order.chunk(data.num_groups))
    raise ValueError(f"Unknown layout {layout!r}; use one of {LAYOUTS}")


def natural_step_sizes(curvatures: torch.Tensor, bound: float) -> torch.Tensor:
    """The natural rule's ``eta_j = n / F_j`` (``F_j`` the total curvature, the Fisher
    information at the optimum), at most ``bound / max_b c_bj``."""
    diagonal = torch.diagonal(curvatures, dim1=1, dim2=2)
    etas = len(curvatures) / diagonal.sum(0)
    return torch.minimum(etas, bound / diagonal.amax(0)) if math.isfinite(bound) else etas


def run(
    problem: MeanPart, rule: str, bound: float, epochs: int, seed: int, coupling: str = "none"
) -> list[float]:
    """rms error of ``lambda_0`` (in the params' coordinates) after every epoch.

    :param problem: the quadratic.
    :param rule: a global update rule of :class:`~pyro_pdvi.infer.consensus.ConsensusState`.
    :param bound: the natural rule's bound (``inf``: none).
    :param epochs: passes over the blocks.
    :param seed: seed of the block orders.
    :param coupling: ``"measured"``: couple the concentrated coordinates after the first epoch.
    """
    num_blocks, size = problem.linear.shape
    step_sizes = natural_step_sizes(problem.curvatures, bound)
    state = ConsensusState(torch.zeros(size, dtype=torch.float64), num_blocks, step_sizes, rule)
    state.set_information(torch.arange(num_blocks), torch.diagonal(problem.curvatures, dim1=1, dim2=2))
    order = torch.Generator().manual_seed(seed)
    errors, coupled = [], None
    for _ in range(epochs):
        for b in torch.randperm(num_blocks, generator=order).tolist():
            copy = problem.solve(b, state.duals[b], state.consensus, state.step_sizes, coupled)
            state.apply(state.propose(torch.tensor([b]), copy[None]))
        if coupling == "measured" and coupled is None and bool(state.concentrated.any()):
            owner = state.information.argmax(0)
            owned = [(state.concentrated & (owner == b)).nonzero().reshape(-1) for b in range(num_blocks)]
            shared = ~state.concentrated & (state.information_total > 0)
            coupled = measure_coupling(
                lambda b, v: v @ problem.curvatures[b], owned, shared, state.information
            )
            if coupled is not None:
                state.change_coordinates(
                    coupled.forward, coupled.dual_forward, step_sizes * coupled.step_growth
                )
        params = state.consensus if coupled is None else coupled.inverse(state.consensus)
        errors.append(float((params - problem.optimum).square().mean().sqrt()))
    return errors


def main(args: argparse.Namespace) -> list[dict]:
    setup_torch(args.threads)
    data = MixedEffects(torch.float64)
    shown = [e for e in ints(args.report_epochs) if e <= args.epochs]
    rows, lines = [], []
    for layout in names(args.layouts):
        problem = MeanPart(data, layout_blocks(data, layout))
        for bound in floats(args.bounds):
            for rule in names(args.rules):
                for coupling in names(args.couplings):
                    errors = run(problem, rule, bound, args.epochs, args.seed, coupling)
                    label = rule if coupling == "none" else f"{rule}, coupled"
                    rows += [
                        {"layout": layout, "bound": bound, "rule": label, "epoch": e + 1, "rms_error": err}
                        for e, err in enumerate(errors)
                    ]
                    lines.append([layout, f"{bound:g}", label, *(f"{errors[e - 1]:.2g}" for e in shown)])
    print("rms error of lambda_0 against the exact optimum (exact block solves, no Monte Carlo)\n")
    print(markdown_table(["blocks", "bound", "rule", *(f"epoch {e}" for e in shown)], lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_csv(rows, out / "random_effects_consensus.csv")
        plot(rows, out / "random_effects_consensus.png")
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """Error against epochs, one panel per layout."""
    plt = pyplot()
    layouts = list(dict.fromkeys(row["layout"] for row in rows))
    fig, axes = plt.subplots(1, len(layouts), figsize=(4.5 * len(layouts), 3.5), squeeze=False)
    for ax, layout in zip(axes[0], layouts):
        runs = dict.fromkeys((row["bound"], row["rule"]) for row in rows if row["layout"] == layout)
        for bound, rule in runs:
            curve = [r for r in rows if (r["layout"], r["bound"], r["rule"]) == (layout, bound, rule)]
            epochs, errors = [r["epoch"] for r in curve], [r["rms_error"] for r in curve]
            ax.semilogy(epochs, errors, label=f"{rule}, bound {bound:g}")
        ax.set(title=f"blocks: {layout}", xlabel="epoch", ylabel="rms error of lambda_0")
        ax.legend(fontsize=7)
    save_figure(fig, path)


if __name__ == "__main__":
    main(parse_args())
