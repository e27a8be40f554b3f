"""The epoch loop every method runs: the same start, the same block order, only the steps timed.

One run: clear the param store, seed torch and Pyro with the run's seed, build a fresh guide
and create its params (:meth:`Problem.initialise`: the same values for every method), build
the method, then epochs of one step per block, the blocks in a fresh random order each epoch
from a generator seeded with the run's seed (so every method sees the same orders). The
clock counts ``step`` calls (and the decaying schedule's scheduler step) only; the metrics
are evaluated between steps, off the clock: after every epoch, and also whenever
``eval_interval`` seconds of fitting have passed since the last record (for methods whose
epoch is long). The run stops once ``budget`` seconds of fitting or ``max_epochs`` epochs
are spent, or at the first step that raises or returns a non-finite loss; that is recorded
as the run's ``status`` with the error text, not hidden.
"""

from __future__ import annotations

import math
import os
import statistics
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, field

import pyro
import torch

from .baselines import Method
from .metrics import Scorer
from .models import Problem


@dataclass
class RunResult:
    """One method on one model and seed.

    :param history: records ``{"epoch", "seconds", <metrics>}``; epoch 0 is the start;
        ``epoch`` is fractional for records inside an epoch.
    :param step_seconds: every step's CPU seconds, in order (the first includes PDVI's set-up);
        summarised, for the report and runs.csv, by ``num_steps``, ``first_step`` and
        ``median_step`` (the median over all steps but the first); ``first_calls`` and
        ``median_calls`` count the model's calls the same way (a cost measure that the
        machine's load does not move: one per ELBO evaluation with vectorized particles).
    :param status: ``"ok"``, or what stopped the run early.
    :param warnings: distinct warnings raised during the steps.
    :param step_sizes: PDVI's step size per group after the run (empty for SVI).
    :param saddle_checks: PDVI's saddle checks
        (:func:`~benchmarks.generic_suite.baselines.summarise_saddle_checks`), or why there are
        none; empty for SVI.
    """

    model: str
    family: str
    config: str
    seed: int
    history: list[dict] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    status: str = "ok"
    warnings: list[str] = field(default_factory=list)
    step_sizes: dict[str, float] = field(default_factory=dict)
    saddle_checks: list[dict] | str = field(default_factory=list)
    load: tuple[float, float] = (math.nan, math.nan)
    wall_seconds: float = 0.0
    fit_wall_seconds: float = 0.0
    num_steps: int = 0
    first_step: float = math.nan
    median_step: float = math.nan
    first_calls: float = math.nan
    median_calls: float = math.nan

    @property
    def label(self) -> str:
        return f"{self.family} {self.config}"

    @property
    def epochs(self) -> float:
        return self.history[-1]["epoch"] if self.history else 0.0

    @property
    def seconds(self) -> float:
        return self.history[-1]["seconds"] if self.history else 0.0

    @property
    def setup_seconds(self) -> float:
        """The first step's seconds beyond a typical step: PDVI's set-up (``eta="auto"``);
        NaN if the run took one step only."""
        return self.first_step - self.median_step


def _warning_text(caught: warnings.WarningMessage) -> str:
    return f"{caught.category.__name__}: {str(caught.message).splitlines()[0][:200]}"


def common_start(problem: Problem, seed: int) -> tuple:
    """The start every method shares: a cleared param store seeded with ``seed``, a fresh guide
    with its params created on the first block of the first epoch, and the generator of the block
    orders.

    :returns: ``(guide, order, first_epoch)``: the guide, the generator that draws each later
        epoch's order, and the first epoch's order of block indices.
    """
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    order = torch.Generator().manual_seed(seed)
    first_epoch = torch.randperm(len(problem.blocks), generator=order).tolist()
    guide = problem.make_guide()
    problem.initialise(guide, problem.blocks[first_epoch[0]])
    return guide, order, first_epoch


def run_method(
    problem: Problem,
    method: Method,
    scorer: Scorer,
    seed: int,
    budget: float,
    max_epochs: int,
    eval_interval: float,
) -> RunResult:
    """Fit ``problem`` with ``method`` from the common start; see the module docstring."""
    result = RunResult(problem.name, method.family, method.config, seed, load=(os.getloadavg()[0], math.nan))
    wall_start = time.perf_counter()
    guide, order, first_epoch = common_start(problem, seed)
    num_blocks = len(problem.blocks)
    fitter = None
    seconds, visits, last_record = 0.0, 0, 0.0
    step_calls: list[int] = []

    def record() -> bool:
        """Append the metrics now; False if the params are no longer finite."""
        nonlocal last_record
        metrics = scorer()
        result.history.append({"epoch": visits / num_blocks, "seconds": seconds, **metrics})
        last_record = seconds
        return "non_finite" not in metrics

    record()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fitter = method.build(problem, guide)
            stop = False
            for epoch in range(max_epochs):
                blocks = first_epoch if epoch == 0 else torch.randperm(num_blocks, generator=order).tolist()
                for b in blocks:
                    calls, wall, start = problem.model_calls, time.perf_counter(), time.process_time()
                    loss = fitter.step(problem.blocks[b])
                    elapsed = time.process_time() - start
                    step_calls.append(problem.model_calls - calls)
                    result.fit_wall_seconds += time.perf_counter() - wall
                    result.step_seconds.append(elapsed)
                    seconds += elapsed
                    visits += 1
                    if not math.isfinite(loss):
                        result.status = f"non-finite loss ({loss}) at step {visits}"
                        stop = True
                    elif seconds >= budget:
                        stop = True
                    elif seconds - last_record >= eval_interval and visits % num_blocks:
                        if not record():
                            result.status = f"non-finite params at step {visits}"
                            return _finish(result, fitter, caught, wall_start, step_calls)
                    if stop:
                        break
                if not stop:
                    start = time.process_time()
                    fitter.end_epoch()
                    seconds += time.process_time() - start
                if not record():
                    result.status = f"non-finite params at step {visits}"
                    break
                if stop:
                    break
        except Exception as error:  # recorded as the "before" state, not worked around
            result.status = f"raised {type(error).__name__} at step {visits + 1}: {error}"
            result.warnings.append(traceback.format_exc(limit=3).splitlines()[-1][:300])
            if not result.history or result.history[-1]["seconds"] != seconds:
                record()
        return _finish(result, fitter, caught, wall_start, step_calls)


def _finish(result: RunResult, fitter, caught, wall_start: float, step_calls: list[int]) -> RunResult:
    counts = Counter(_warning_text(w) for w in caught)
    result.warnings = [f"{text} (x{n})" for text, n in counts.most_common()] + result.warnings
    result.step_sizes = fitter.step_sizes if fitter is not None else {}
    result.saddle_checks = fitter.saddle_checks if fitter is not None else []
    result.load = (result.load[0], os.getloadavg()[0])
    result.wall_seconds = time.perf_counter() - wall_start
    result.num_steps = len(result.step_seconds)
    if result.step_seconds:
        result.first_step = result.step_seconds[0]
    if len(result.step_seconds) > 1:
        result.median_step = statistics.median(result.step_seconds[1:])
    if step_calls:
        result.first_calls = float(step_calls[0])
    if len(step_calls) > 1:
        result.median_calls = float(statistics.median(step_calls[1:]))
    return result
