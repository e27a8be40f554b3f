"""The methods: Pyro's SVI+Adam over a learning-rate grid and with a decaying schedule, and
PDVI in named configurations.

Every PDVI configuration is a named dict of keyword options of ``PDVI(...)`` in
:data:`PDVI_CONFIGS`, the one place to edit when options are renamed. The one key that is
not a PDVI option, :data:`PARTICLES`, replaces the user's ELBO by the same ELBO class with
that many vectorized particles (its other arguments kept); without it PDVI runs with the
user's ELBO unchanged, as issue 13 asks. The others, :data:`COUPLING`, :data:`ROUND_SITES`
and :data:`ESCAPE`, set PDVI's ``couple_concentrated``, ``scale_round_sites`` and
``escape_saddles`` (class attributes, not options). Only PDVI's public, common-case API is used:
``PDVI(model, guide, optim, loss, blocks=blocks, **options)``, ``step``, ``step_sizes``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import pyro
import pyro.optim
import torch
from pyro.infer import SVI

from pyro_pdvi import PDVI, AutoStepSize, GenericSolver
from pyro_pdvi.infer.problem import BlockProblem, BlockSolution

from .models import Problem


class ExtraCallSolver(GenericSolver):
    """The default solve, without handing on the gradient in the held scale coordinates: PDVI then
    reads each block's share of the scales' precisions from one more model call, as in 13i (for a
    before/after inside one run, 13j)."""

    def solve(self, problem: BlockProblem) -> BlockSolution:
        return replace(super().solve(problem), held_gradients=None)


#: Suite-level key of a PDVI configuration: the user's ELBO with this many vectorized particles.
PARTICLES = "particles"
#: Suite-level key of a PDVI configuration: ``PDVI.couple_concentrated`` (default True).
COUPLING = "couple_concentrated"
#: Suite-level key of a PDVI configuration: ``PDVI.scale_round_sites`` (default True).
ROUND_SITES = "scale_round_sites"
#: Suite-level key of a PDVI configuration: ``PDVI.escape_saddles`` (default True).
ESCAPE = "escape_saddles"

PDVI_CONFIGS: dict[str, dict] = {
    # The number issue 13 is about: the user's ELBO unchanged, every option at its default.
    "defaults": {},
    # The defaults before issue 13 (curvature rule for eta, 20 L-BFGS evaluations, the
    # user's particles), for a before/after inside one run.
    "old_defaults": {
        "eta": AutoStepSize(rule="curvature"),
        "solver": GenericSolver(inner_steps=20),
        "particles": None,
    },
    # The paper's global update for five epochs, the default before 13d (its runaway on the
    # GMM and PPCA), for a before/after inside one run.
    "warmup5": {"warmup_epochs": 5.0},
    # No paper-rule warm-up: the weighted rule from the first step, its mean over the blocks
    # visited so far (13e).
    "warmup0": {"warmup_epochs": 0.0},
    # The L-BFGS solve without the trust box of the default short solve (13f), for a before/after.
    "no_trust": {"solver": GenericSolver(trust=None)},
    # Blocks that own concentrated coordinates solved with the same three evaluations as the
    # others, the default before 13m, for a before/after inside one run.
    "short_concentrated": {"solver": GenericSolver(concentrated_steps=3)},
    # Seven evaluations for them instead of five (13m).
    "concentrated7": {"solver": GenericSolver(concentrated_steps=7)},
    # The scales of Gaussian global sites moved by the primal-dual iteration, the default before
    # their fixed point (13i), for a before/after inside one run.
    "scale_pd": {"scale_update": "primal_dual"},
    # The concentrated coordinates left uncoupled from the shared ones, the default before 13l.
    "uncoupled": {COUPLING: False},
    # The scales' fixed point from one more model call per step, 13i's engine (13j).
    "extra_call": {"solver": ExtraCallSolver()},
    # The paper's global update after the warm-up too (13j: level with the defaults on the
    # random-effects model once its group effects are concentrated; worse per epoch on the GMM).
    "paper": {"global_update": "paper"},
    # P2D-VI: one automatic step size per global site, by the curvature rule.
    "per_site": {"groups": "per_site", "eta": AutoStepSize(rule="curvature")},
    # The natural rule's constant below its default 1 (13n: PPCA's first seconds gain, the
    # scale and logistic regressions' means lose; not the default).
    "natural0.5": {"eta": AutoStepSize(scale=0.5)},
    # The rule's constant 1 where the defaults take NATURAL_SCALE_WITH_LOCALS (a latent per datum).
    "natural1": {"eta": AutoStepSize(scale=1.0)},
    "natural0.25": {"eta": AutoStepSize(scale=0.25)},
    "natural0.125": {"eta": AutoStepSize(scale=0.125)},
    # ... and above it (13zb: what the quadratic model of benchmarks/consensus_rate.py predicts).
    "natural2": {"eta": AutoStepSize(scale=2.0)},
    "natural4": {"eta": AutoStepSize(scale=4.0)},
    # The paper's global update with a quarter of the natural constant (13zb: logreg then follows
    # the quadratic model of benchmarks/consensus_rate.py, which the weighted rule hides).
    "paper_natural0.25": {"global_update": "paper", "eta": AutoStepSize(scale=0.25)},
    # No dense penalty on the small sites, the default before 13zc, for a before/after.
    "unwhitened": {"eta": AutoStepSize(whiten=False)},
    # The round sites at the natural rule's constant 1, not the dense penalty's, the default
    # before 13zd.
    "round1": {ROUND_SITES: False},
    # No check for saddles of the reduced objective, the default before 13zk.
    "no_escape": {ESCAPE: False},
    # Two fixed step sizes with and without it (13zm: a check before a fixed 0.1 is near its
    # fixed point).
    "eta0.01_no_escape": {"eta": 0.01, ESCAPE: False},
    "eta0.1_no_escape": {"eta": 0.1, ESCAPE: False},
    # Ten times the default short solve's evaluations (13zb: the solve's accuracy is not what sets
    # the logistic regression's rate per epoch).
    "inner30": {"solver": GenericSolver(inner_steps=30)},
    # Both of the two that shortened biglogreg's first epochs (13z): no paper-rule warm-up and the
    # natural rule's constant at a quarter.
    "warmup0_natural0.25": {"warmup_epochs": 0.0, "eta": AutoStepSize(scale=0.25)},
    # The best hand setting on the logistic regression.
    "eta1_inner3_p16": {"eta": 1.0, "solver": GenericSolver(inner_steps=3), PARTICLES: 16},
    # The best hand setting on PPCA (with the user's 8 particles there).
    "eta0.1_inner3": {"eta": 0.1, "solver": GenericSolver(inner_steps=3)},
    # Every evaluation of a block through Pyro, the default before graph replay (13q).
    "no_replay": {"graph_replay": False},
    # The user's ELBO with one particle (Pyro's default), so that particles="auto" picks the
    # solve's particles, and the solve's particles set by hand (item 5 of issue 13's notes).
    "user1": {PARTICLES: 1},
    "p2": {"particles": 2},
    "p4": {"particles": 4},
    "p8": {"particles": 8},
    "p16": {"particles": 16},
    # biglogreg's count at set-up, kept throughout: the defaults before the review of 13y.
    "p20": {"particles": 20},
    "p64": {"particles": 64},
    # No per-coordinate step decay by the stationarity test (13c), for a before/after (13zh: on
    # PPCA it halves the step sizes of hundreds of coordinates from epoch 12 on).
    "no_step_decay": {"step_decay": False},
    # The fixed-eta grid that eta="auto" is compared with (everything else at its default).
    "eta0.001": {"eta": 0.001},
    "eta0.01": {"eta": 0.01},
    "eta0.1": {"eta": 0.1},
    "eta1": {"eta": 1.0},
    "eta10": {"eta": 10.0},
}

#: Configurations run on every seed, and the fixed-eta grid (first seed only).
MAIN_PDVI_CONFIGS = ("defaults", "old_defaults", "per_site", "eta1_inner3_p16", "eta0.1_inner3")
ETA_GRID_CONFIGS = ("eta0.001", "eta0.01", "eta0.1", "eta1", "eta10")

#: PDVI's ``optim`` argument (it drives the primal solve only with ``inner_solver="optim"``).
PDVI_OPTIM_LR = 0.01


class Fitter:
    """One method's stepper: ``step(*args)`` as SVI's, and ``end_epoch()`` (the decaying
    schedule's scheduler step; nothing for the others)."""

    def __init__(self, algo, scheduler=None) -> None:
        self.algo = algo
        self.scheduler = scheduler

    def step(self, *args) -> float:
        return self.algo.step(*args)

    def end_epoch(self) -> None:
        if self.scheduler is not None:
            self.scheduler.step()

    @property
    def step_sizes(self) -> dict[str, float]:
        """PDVI's step size per group (empty for SVI)."""
        return dict(getattr(self.algo, "step_sizes", {}))

    @property
    def saddle_checks(self) -> list[dict] | str:
        """PDVI's saddle checks (:func:`summarise_saddle_checks`; empty for SVI)."""
        diagnostics = getattr(self.algo, "diagnostics", {})
        return summarise_saddle_checks(diagnostics.get("saddle_escape", []))


def summarise_saddle_checks(checks: list[dict] | str) -> list[dict] | str:
    """``diagnostics["saddle_escape"]`` as plain numbers for runs.csv: per check its epoch, its
    wall-clock seconds, and per round the number of negative Ritz values, the smallest, and
    whether it moved the state (or why the check failed); or the reason the escape does not
    apply, as it is."""
    if isinstance(checks, str):
        return checks
    summary = []
    for check in checks:
        entry = {"epoch": check["epoch"], "seconds": round(check["seconds"], 3)}
        entry["rounds"] = [[r.negative, r.smallest, r.moved] for r in check["rounds"]]
        if "failed" in check:
            entry["failed"] = check["failed"]
        summary.append(entry)
    return summary


@dataclass(frozen=True)
class Method:
    """A method to run: ``family`` ("SVI" or "PDVI"), ``config`` (its name in the tables) and
    ``build(problem, guide) -> Fitter``."""

    family: str
    config: str
    build: Callable[[Problem, Callable], Fitter]

    @property
    def label(self) -> str:
        return f"{self.family} {self.config}"


def svi_adam(lr: float) -> Method:
    def build(problem: Problem, guide: Callable) -> Fitter:
        return Fitter(SVI(problem.model, guide, pyro.optim.Adam({"lr": lr}), problem.make_loss()))

    return Method("SVI", f"Adam lr={lr:g}", build)


def svi_decaying(lr: float, epochs: float) -> Method:
    """Adam with the Robbins-Monro-type schedule ``lr / (1 + epoch / epochs)`` (Pyro's
    ``LambdaLR``, stepped once per epoch)."""

    def build(problem: Problem, guide: Callable) -> Fitter:
        scheduler = pyro.optim.LambdaLR(
            {
                "optimizer": torch.optim.Adam,
                "optim_args": {"lr": lr},
                "lr_lambda": lambda epoch: 1.0 / (1.0 + epoch / epochs),
            }
        )
        return Fitter(SVI(problem.model, guide, scheduler, problem.make_loss()), scheduler)

    return Method("SVI", f"Adam lr={lr:g}/(1+epoch/{epochs:g})", build)


def pdvi(config: str) -> Method:
    if config not in PDVI_CONFIGS:
        raise ValueError(f"Unknown PDVI configuration {config!r}; use one of {sorted(PDVI_CONFIGS)}")
    options = dict(PDVI_CONFIGS[config])
    particles = options.pop(PARTICLES, None)
    coupling = options.pop(COUPLING, True)
    round_sites = options.pop(ROUND_SITES, True)
    escape = options.pop(ESCAPE, True)

    def build(problem: Problem, guide: Callable) -> Fitter:
        pdvi = PDVI(
            problem.model,
            guide,
            pyro.optim.Adam({"lr": PDVI_OPTIM_LR}),
            problem.make_loss(particles),
            blocks=problem.blocks,
            **options,
        )
        pdvi.couple_concentrated = coupling
        pdvi.scale_round_sites = round_sites
        pdvi.escape_saddles = escape
        return Fitter(pdvi)

    return Method("PDVI", config, build)


def svi_methods(lrs: list[float], decay_lr: float | None, decay_epochs: float) -> list[Method]:
    methods = [svi_adam(lr) for lr in lrs]
    if decay_lr is not None:
        methods.append(svi_decaying(decay_lr, decay_epochs))
    return methods
