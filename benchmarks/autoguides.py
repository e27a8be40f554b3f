"""The guide a Pyro user picks: the generic suite's models whose latents are all global, fitted
under ``AutoNormal`` and under ``AutoDiagonalNormal``, PDVI at its defaults against SVI+Adam.

Both guides are the same mean-field Gaussian family (``AutoDiagonalNormal`` packs every site's
unconstrained location and scale into one vector), so both are scored against the suite's one
reference optimum: ``AutoDiagonalNormal``'s params are unpacked site by site into
``AutoNormal``'s names and scored by :class:`~benchmarks.generic_suite.metrics.Scorer`. Both start
from the same point (``init_to_feasible`` and ``init_scale=0.1``, ``AutoNormal``'s defaults) and
visit the blocks in the same orders (``benchmarks/generic_suite/runner.py``), timed in CPU
seconds of the process at one thread.

Why (``docs/benchmarks.md`` 13zh): ``AutoDiagonalNormal.loc`` is a plain ``nn.Parameter``, which
its ``PyroModule`` reads from itself, so until session 33 PDVI's Fisher information missed it and
the locations fell back to one step size for their group, unwhitened. Printed: the rms error of
the means and of the sds' ratios at each checkpoint, mean over the seeds, per guide and method,
and the best SVI per guide::

    python benchmarks/autoguides.py --models logreg,scale --seeds 0,1,2 --budget-seconds 10
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: import this checkout's benchmarks and pyro_pdvi, not an installed copy.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyro  # noqa: E402
import torch  # noqa: E402
from pyro.infer.autoguide import AutoDiagonalNormal  # noqa: E402
from pyro.infer.autoguide.initialization import init_to_feasible  # noqa: E402

from benchmarks.common import as_a_user_runs, floats, ints, names  # noqa: E402
from benchmarks.generic_suite.baselines import pdvi, svi_methods  # noqa: E402
from benchmarks.generic_suite.metrics import Scorer, at_seconds  # noqa: E402
from benchmarks.generic_suite.models import Problem, make_problem  # noqa: E402
from benchmarks.generic_suite.references import compute_reference  # noqa: E402
from benchmarks.generic_suite.runner import run_method  # noqa: E402

#: The suite's models whose latents are all global (``AutoDiagonalNormal`` cannot subsample).
MODELS = ("logreg", "scale", "biglogreg")
GUIDES = ("AutoNormal", "AutoDiagonalNormal")
METRICS = ("rmse_mean", "sd_error")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", type=names, default="logreg,scale", help=f"comma list from {MODELS}")
    parser.add_argument("--seeds", type=ints, default="0,1,2", help="comma list of seeds")
    parser.add_argument("--budget-seconds", type=float, default=10.0, help="fitting CPU seconds per run")
    parser.add_argument(
        "--checkpoints", type=floats, default="1,2.5,5,10", help="comma list of CPU seconds to report"
    )
    parser.add_argument(
        "--svi-lrs", type=floats, default="0.01,0.03,0.1", help="comma list of SVI+Adam rates"
    )
    parser.add_argument("--decay-lr", type=float, default=0.1, help="SVI+Adam lr/(1+epoch/10); 0: none")
    parser.add_argument("--quick", action="store_true", help="the suite's quick sizes")
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; use names from {MODELS}")
    return args


def diagonal_variant(problem: Problem) -> Problem:
    """``problem`` with ``AutoDiagonalNormal`` as its guide, started where ``AutoNormal`` starts."""
    variant = copy.copy(problem)
    variant.make_guide = lambda: AutoDiagonalNormal(
        problem.model, init_loc_fn=init_to_feasible, init_scale=0.1
    )
    return variant


class PackedScorer(Scorer):
    """:class:`Scorer` for ``AutoDiagonalNormal``: its ``loc`` and ``scale`` unpacked site by site
    into ``AutoNormal``'s names (``template``: a guide of the same model, set up)."""

    def __init__(self, problem: Problem, reference, template: AutoDiagonalNormal) -> None:
        super().__init__(problem, reference)
        self.template = template

    def __call__(self) -> dict[str, float]:
        store = pyro.get_param_store()
        params = {}
        for kind, name in (("locs", "AutoDiagonalNormal.loc"), ("scales", "AutoDiagonalNormal.scale")):
            packed = store[name].detach().to("cpu", torch.float64)
            for site, value in self.template._unpack_latent(packed):
                params[f"AutoNormal.{kind}.{site['name']}"] = value
        if not all(bool(torch.isfinite(v).all()) for v in params.values()):
            return {"non_finite": 1.0}
        with torch.no_grad():
            return self._auto_normal(params)


def template_guide(problem: Problem) -> AutoDiagonalNormal:
    """A set-up ``AutoDiagonalNormal`` of ``problem`` (its unpacking), the param store kept."""
    store = pyro.get_param_store()
    saved = store.get_state()
    store.clear()
    try:
        guide = diagonal_variant(problem).make_guide()
        problem.initialise(guide, problem.blocks[0])
        return guide
    finally:
        store.set_state(saved)


def main(args: argparse.Namespace) -> list[dict]:
    """Every model, guide and method (module docstring); the rows as printed. Runs in float32 at
    one thread, the caller's default dtype and warning filters put back after."""
    with as_a_user_runs(torch.float32):
        return _run(args)


def _run(args: argparse.Namespace) -> list[dict]:
    rows = []
    for name in args.models:
        problem = make_problem(name, args.quick, torch.float32, "cpu")
        reference = compute_reference(problem)
        scorers = {
            "AutoNormal": (problem, Scorer(problem, reference)),
            "AutoDiagonalNormal": (
                diagonal_variant(problem),
                PackedScorer(problem, reference, template_guide(problem)),
            ),
        }
        methods = svi_methods(args.svi_lrs, args.decay_lr or None, 10.0) + [pdvi("defaults")]
        print(f"\n## {name}: {problem.title}\n", flush=True)
        print(
            "| guide | method | "
            + " | ".join(f"{t:g} s: means / sds" for t in args.checkpoints)
            + " | epochs |"
        )
        print("|---|---|" + "---|" * (len(args.checkpoints) + 1))
        for variant, scorer in scorers.values():
            # The first steps in a process pay one-off costs (lazy imports): not on anyone's clock.
            for method in methods[:1] + methods[-1:]:
                run_method(variant, method, scorer, args.seeds[0], 0.0, 1, float("inf"))
        for guide_name, (variant, scorer) in scorers.items():
            for method in methods:
                runs = [
                    run_method(variant, method, scorer, s, args.budget_seconds, 10**6, 0.25)
                    for s in args.seeds
                ]
                row = {"model": name, "guide": guide_name, "method": method.label}
                for t in args.checkpoints:
                    records = [at_seconds(run.history, t) for run in runs]
                    for metric in METRICS:
                        row[f"{metric}@{t:g}"] = sum(r.get(metric, float("nan")) for r in records) / len(
                            records
                        )
                row["epochs"] = sum(run.epochs for run in runs) / len(runs)
                rows.append(row)
                cells = [" / ".join(f"{row[f'{m}@{t:g}']:.3g}" for m in METRICS) for t in args.checkpoints]
                print(
                    f"| {guide_name} | {method.label} | " + " | ".join(cells) + f" | {row['epochs']:.0f} |",
                    flush=True,
                )
    return rows


if __name__ == "__main__":
    main(parse_args())
