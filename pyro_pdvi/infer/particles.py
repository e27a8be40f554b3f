"""The Monte Carlo of the primal solve: PDVI decides how many particles a block solve draws.

A primal solve holds its block's noise fixed and minimises that sample-average objective
(:class:`~pyro_pdvi.infer.handlers.FixedNoise`). With one particle, Pyro's default, the
surrogate is degenerate for a location-scale guide: the solved scale follows the one draw,
and can collapse (measured on the hierarchical model with ``TraceMeanField_ELBO()``: sd of
q(mu) 5e-26). So with ``particles="auto"`` PDVI solves with its own copy of the user's ELBO
(same class and settings) drawing vectorized particles in antithetic pairs; the user's ELBO
itself is untouched (``PDVI.evaluate_loss`` uses it). Where the model cannot be vectorized
over particles, the solve falls back to the user's ELBO, with a warning.

How many: as many as cost little (:func:`affordable_particles`). Each operation of an
evaluation costs a fixed overhead (dispatch, autograd's node) plus a time per element it
makes, and the particles multiply the elements of the model's particle-dependent part. PDVI
counts both at set-up (:func:`evaluation_size`: one evaluation of the first block with 2 and
one with 4 particles) and draws the most particles, even, at least 2 and at most
:data:`AUTO_PARTICLES`, whose elements stay within :data:`ELEMENTS_PER_OPERATION` per
operation. Measured on the generic suite (CPU, one thread; ``docs/benchmarks.md`` 13w):

* small blocks (the logistic regressions, 29 data a block): 64 particles cost a step 7% more
  than 2, and give means 2-5x closer at equal seconds: 64 are chosen;
* the GMM, blocks of 1,000: a step 0.021 s with 2 particles, 0.028 with 4, 0.078 with 16, and
  the same error after every epoch to three digits (its data term is quadratic in the means,
  which antithetic pairs matched in second moment integrate exactly): 2 are chosen;
* PPCA (64 pixels a datum, blocks of 45): 64 particles gave 15.5 epochs in 20 s against 38 with
  8, and an ELBO gap 4-27x larger at 2.5-10 s: 10 are chosen.

What they buy, :meth:`PDVI.solve_noise <pyro_pdvi.PDVI.solve_noise>` measures: the spread of
a few blocks' gradients across noise draws against their curvature gives the Monte Carlo noise
that the solves leave in the consensus, in posterior standard deviations
(:func:`consensus_noise`). Measured on the generic suite after two epochs with the particles
chosen above, or the user's (``docs/benchmarks.md`` 13y), it is 0.026-0.18 on every model but the
GMM (2e-7), most of it in the scales (the hierarchical normal with 2 particles: 0.26 in the scale
of ``mu``, whose sd is then 16% off): the counts above are not more than the noise asks for.

Whenever a solve's particles come in antithetic pairs, the user's or PDVI's, their second
moment is matched too (:class:`~pyro_pdvi.infer.antithetic.AntitheticNoise`): at fixed noise
a scale then sees the noise's exact variance, not its draws' mean square. Measured on the
random-effects model of ``examples/svi_to_pdvi.py`` (the user's 16 particles, seeds 0 and 1):
the worst mean error after 20 epochs fell from 0.08 sd (seed 0: a scale collapsed, and the run
stopped on a non-finite step) to 0.005 sd.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from pyro.infer import Trace_ELBO, TraceEnum_ELBO, TraceMeanField_ELBO
from torch.utils._python_dispatch import TorchDispatchMode

from ..checks import check_positive_int
from .antithetic import antithetic_loss, check_antithetic_loss, has_particle_pairs
from .objective import loss_function

#: Most particles of a block solve with ``particles="auto"`` when the user's ELBO does not vectorize any.
AUTO_PARTICLES = 64

#: Elements per operation of an evaluation that its particles may add and still cost little, by
#: device type. CPU: an operation's fixed cost is that of about 5,500-15,000 elements (fitted to
#: the suite's step costs against their particles), so the particles chosen add at most about
#: three quarters of it (PPCA: 10, where its costs break even at about 14). CUDA: derived, not
#: yet measured (an H200 streams about 10^6 elements of a float32 operation in a kernel launch's
#: 5 us); ``benchmarks/gpu.py``'s ``generic-particles`` section measures it.
ELEMENTS_PER_OPERATION = {"cpu": 4096, "cuda": 1 << 20}

#: Noise draws of each block's gradient in :meth:`PDVI.solve_noise <pyro_pdvi.PDVI.solve_noise>`.
NOISE_DRAWS = 4

#: ELBOs that PDVI can rebuild with other particles (same constructor arguments).
REBUILDABLE = (Trace_ELBO, TraceMeanField_ELBO, TraceEnum_ELBO)


def with_particles(loss: Any, num_particles: int) -> Any | None:
    """The same ELBO (class and settings) with ``num_particles`` vectorized particles, or
    ``None`` if ``loss`` is not one of :data:`REBUILDABLE`."""
    if type(loss) not in REBUILDABLE:
        return None
    max_plate_nesting = loss.max_plate_nesting
    if loss.vectorize_particles and loss.num_particles > 1:
        max_plate_nesting -= 1  # the constructor adds the particle plate again
    return type(loss)(
        num_particles=num_particles,
        max_plate_nesting=max_plate_nesting,
        vectorize_particles=True,
        strict_enumeration_warning=loss.strict_enumeration_warning,
        ignore_jit_warnings=loss.ignore_jit_warnings,
        retain_graph=loss.retain_graph,
    )


class _OperationCount(TorchDispatchMode):
    """Counts the ATen operations run inside its ``with`` block and the elements they make."""

    def __init__(self) -> None:
        super().__init__()
        self.operations = 0
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.operations += 1
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                self.elements += value.numel()
        return out


def evaluation_size(evaluate: Callable[[], Any], device: torch.device) -> tuple[int, int]:
    """``(operations, elements)`` of one call of ``evaluate`` (its forward pass), after one call
    not counted (an ELBO's lazy set-up traces the model once); the random generators' states are
    put back afterwards, so that nothing drawn here shifts a later draw."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        evaluate()
        with _OperationCount() as count:
            evaluate()
    return count.operations, count.elements


def affordable_particles(at_two: tuple[int, int], at_four: tuple[int, int], device: torch.device) -> int:
    """The particles of ``particles="auto"`` (module docstring): the most, even, between 2 and
    :data:`AUTO_PARTICLES`, whose elements stay within :data:`ELEMENTS_PER_OPERATION` per
    operation.

    :param at_two: :func:`evaluation_size` of a block's evaluation with 2 particles.
    :param at_four: the same with 4 (the difference is the elements of 2 particles).
    :param device: where the evaluations run.
    """
    operations, elements = at_two
    per_particle = max((at_four[1] - elements) / 2, 1.0)
    budget = ELEMENTS_PER_OPERATION.get(device.type, ELEMENTS_PER_OPERATION["cpu"]) * operations
    return min(AUTO_PARTICLES, 2 * max(int(budget / per_particle) // 2, 1))


def check_particles(particles: int | str | None) -> int | str | None:
    """``"auto"``, ``None`` (the user's ELBO as it is) or a positive even int."""
    if particles in ("auto", None):
        return particles
    check_positive_int(particles, "particles")
    if particles % 2:
        raise ValueError(
            f"Invalid particles: {particles}; use an even number (antithetic pairs), 'auto' or None"
        )
    return particles


class SolveLoss(NamedTuple):
    """The loss a block solve minimises.

    :param loss: the ELBO (or callable) it comes from.
    :param fn: ``fn(model, guide, *args, **kwargs)``, differentiable.
    :param antithetic: whether its particles are antithetic pairs.
    :param owned: whether PDVI built it (else it is the user's).
    """

    loss: Any
    fn: Callable
    antithetic: bool
    owned: bool


def solve_loss(
    user_loss: Any, particles: int | str | None, antithetic: bool | str, monte_carlo: bool
) -> SolveLoss:
    """The loss of the primal solves (module docstring).

    :param user_loss: the user's ELBO or loss callable.
    :param particles: ``"auto"``, ``None`` or a number of particles.
    :param antithetic: ``"auto"`` (pairs whenever the solve's ELBO vectorizes an even number of
        particles), ``True`` or ``False``.
    :param monte_carlo: whether the guide has Monte Carlo sites (else particles do nothing).
    :raises ValueError: for ``antithetic=True`` with an ELBO that cannot pair its particles.
    """
    loss, owned = user_loss, False
    if monte_carlo and particles is not None:
        if particles != "auto":
            loss = with_particles(user_loss, particles) or user_loss
        elif not (getattr(user_loss, "vectorize_particles", False) and user_loss.num_particles > 1):
            loss = with_particles(user_loss, AUTO_PARTICLES) or user_loss
        owned = loss is not user_loss
    if antithetic == "auto":
        antithetic = has_particle_pairs(loss)
    elif antithetic:
        check_antithetic_loss(loss)
    fn = loss_function(loss)
    paired = antithetic_loss(fn, match_second_moment=True) if antithetic else fn
    return SolveLoss(loss, paired, bool(antithetic), owned)


def consensus_noise(gradient_variance: torch.Tensor, curvature: torch.Tensor) -> float | None:
    """The Monte Carlo noise that the solves leave in the consensus, in posterior standard
    deviations, rms over the coordinates: ``sqrt(mean_j V_j / H_j)``.

    At the fixed point the blocks' gradients sum to zero, so noise ``e_b`` in block ``b``'s
    gradient moves coordinate ``j`` by about ``sum_b e_bj / H_j`` with ``H_j = sum_b H_bj``, whose
    variance is ``V_j / H_j^2`` with ``V_j = sum_b Var(e_bj)``; the posterior's variance is about
    ``1 / H_j``. Both sums may be over a sample of the blocks (their ratio is what counts).
    For a scale set by its fixed point (:mod:`~pyro_pdvi.infer.scales`: its precision a sum of
    the blocks' shares, read from their gradients in it) the same ratio in its coordinate is the
    precision's relative noise over ``sqrt(2)``, so the scale is off by about ``noise / sqrt(2)``
    of itself. It is the noise of one visit of every block: the iteration averages it further
    (``docs/benchmarks.md`` 13y). Coordinates without a positive finite curvature or a finite
    variance are left out.

    :param gradient_variance: ``V``, the blocks' gradient variances across noise draws, summed, ``(P,)``.
    :param curvature: ``H``, their diagonal curvatures, summed, ``(P,)``.
    :returns: the noise, or ``None`` where no coordinate is usable.
    """
    usable = torch.isfinite(curvature) & (curvature > 0) & torch.isfinite(gradient_variance)
    if not bool(usable.any()):
        return None
    return float((gradient_variance[usable] / curvature[usable]).mean().sqrt())
