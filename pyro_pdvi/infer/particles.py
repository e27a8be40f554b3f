"""The Monte Carlo of the primal solve: PDVI decides how many particles a block solve draws.

A primal solve holds its block's noise fixed and minimises that sample-average objective
(:class:`~pyro_pdvi.infer.handlers.FixedNoise`). With one particle, Pyro's default, the
surrogate is degenerate for a location-scale guide: the solved scale follows the one draw,
and can collapse (measured on the hierarchical model with ``TraceMeanField_ELBO()``: sd of
q(mu) 5e-26). So with ``particles="auto"`` PDVI solves with its own copy of the user's ELBO
(same class and settings) drawing vectorized particles in antithetic pairs; the user's ELBO
itself is untouched (``PDVI.evaluate_loss`` uses it).

Where the model cannot take vectorized particles, the solves draw :data:`LOOPED_PARTICLES` in
a loop, with a warning: where it raises under them, and where it counts a term once per
particle. A model written for one draw may broadcast one draw's particle dimension against
another's (``m[..., None] + e[..., idx]`` with ``e`` a ``to_event`` vector), which Pyro's shape
checks let pass; so at its first step PDVI evaluates the first block with every particle at
the same central draw (:class:`CentralDraws`) and compares the loss with one particle's
(:func:`particles_agree`; ``docs/benchmarks.md`` 13zf).

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
from pyro.poutine.messenger import Messenger
from pyro.poutine.runtime import Message
from torch.distributions import Independent, MultivariateNormal, Normal, TransformedDistribution
from torch.utils._python_dispatch import TorchDispatchMode

from ..checks import check_positive_int
from .antithetic import antithetic_loss, check_antithetic_loss, has_particle_pairs, reparameterized
from .handlers import is_subsample_site
from .objective import loss_function

#: Most particles of a block solve with ``particles="auto"`` when the user's ELBO does not vectorize any.
AUTO_PARTICLES = 64

#: Particles of a block solve with ``particles="auto"`` where the model cannot take vectorized
#: ones: drawn in a loop, so each costs an evaluation (``docs/benchmarks.md`` 13zf).
LOOPED_PARTICLES = 8

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


def with_particles(loss: Any, num_particles: int, vectorize: bool = True) -> Any | None:
    """The same ELBO (class and settings) with ``num_particles`` particles, vectorized or drawn
    in a loop, or ``None`` if ``loss`` is not one of :data:`REBUILDABLE`."""
    if type(loss) not in REBUILDABLE:
        return None
    max_plate_nesting = loss.max_plate_nesting
    if loss.vectorize_particles and loss.num_particles > 1:
        max_plate_nesting -= 1  # the constructor adds the particle plate again
    return type(loss)(
        num_particles=num_particles,
        max_plate_nesting=max_plate_nesting,
        vectorize_particles=vectorize,
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

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # As the recorder's (recording.Recorder): torch would import torch._dynamo at the first
        # operation counted, 0.75-1.45 CPU s of the suite's first step where PDVI chooses the
        # particles (docs/benchmarks.md 13zf); nothing here is compiled.
        return False

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
    user_loss: Any,
    particles: int | str | None,
    antithetic: bool | str,
    monte_carlo: bool,
    looped: bool = False,
) -> SolveLoss:
    """The loss of the primal solves (module docstring).

    :param user_loss: the user's ELBO or loss callable.
    :param particles: ``"auto"``, ``None`` or a number of particles.
    :param antithetic: ``"auto"`` (pairs whenever the solve's ELBO vectorizes an even number of
        particles), ``True`` or ``False``.
    :param monte_carlo: whether the guide has Monte Carlo sites (else particles do nothing).
    :param looped: for a model that cannot take vectorized particles: PDVI's particles
        (:data:`LOOPED_PARTICLES` for ``"auto"``) are drawn in a loop, in antithetic pairs
        (:class:`~pyro_pdvi.infer.antithetic.LoopedAntitheticNoise`) unless ``antithetic=False``.
    :raises ValueError: for ``antithetic=True`` with an ELBO that cannot pair its particles.
    """
    loss, owned = user_loss, False
    if monte_carlo and particles is not None:
        if looped:
            count = LOOPED_PARTICLES if particles == "auto" else particles
            loss = with_particles(user_loss, count, vectorize=False) or user_loss
        elif particles != "auto":
            loss = with_particles(user_loss, particles) or user_loss
        elif not (getattr(user_loss, "vectorize_particles", False) and user_loss.num_particles > 1):
            loss = with_particles(user_loss, AUTO_PARTICLES) or user_loss
        owned = loss is not user_loss
    fn = loss_function(loss)
    if owned and looped:
        paired = antithetic is not False and loss.num_particles % 2 == 0
        looped_fn = antithetic_loss(fn, match_second_moment=True, looped_particles=loss.num_particles)
        return SolveLoss(loss, looped_fn if paired else fn, paired, owned)
    if antithetic == "auto":
        antithetic = has_particle_pairs(loss)
    elif antithetic:
        check_antithetic_loss(loss)
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


#: Relative difference, in units of the dtype's machine epsilon, beyond which a loss at identical
#: vectorized particles differs from the same ELBO's loss at one particle
#: (:func:`particles_agree`). A sum of ``n`` rounded terms is off by about ``sqrt(n)`` epsilons
#: of its magnitude: 1,000 allows for a block of a million terms (float32: 1.2e-4 of the loss); a
#: model that broadcasts the particles against themselves counts a term twice or more.
AGREEMENT_EPSILONS = 1000


class Uncentred(Exception):
    """A guide site that :class:`CentralDraws` cannot set to a central value."""


class CentralDraws(Messenger):
    """Every guide draw at a central value of its distribution, the same for every particle.

    A Gaussian site (``Normal``, ``MultivariateNormal``, and ``Independent`` or
    ``TransformedDistribution`` wrappers of them: the autoguides' sites) takes its draw at
    zero noise, its location pushed through its transforms; another site its mean, where that
    is finite and in its support. Sites whose value is set already (the model's latent sites,
    replayed from the guide; enumerated ones) and observed ones are left alone. Where the
    guide's distributions do not depend on the particle (its params are shared), every particle
    then draws the same value, so a vectorized ELBO must equal the same ELBO with one particle
    (:meth:`PDVI._check_particle_broadcasting <pyro_pdvi.PDVI._check_particle_broadcasting>`).

    :raises Uncentred: at a site with no such value (a discrete guide site, a mean outside
        the support).
    """

    def _process_message(self, msg: Message) -> None:
        if msg["type"] != "sample" or msg["is_observed"] or msg["value"] is not None:
            return
        if msg["infer"].get("enumerate") or is_subsample_site(msg):
            return
        fn = msg["fn"]
        value = None
        innermost = fn
        while isinstance(innermost, (Independent, TransformedDistribution)):
            innermost = innermost.base_dist
        if isinstance(innermost, (Normal, MultivariateNormal)):
            base = fn.base_dist if isinstance(fn, TransformedDistribution) else fn
            value = reparameterized(fn, innermost.loc.new_zeros(base.batch_shape + base.event_shape))
        if value is None:
            try:
                value = fn.mean
            except NotImplementedError:
                raise Uncentred(msg["name"]) from None
            if not bool(torch.isfinite(value).all()) or not bool(fn.support.check(value).all()):
                raise Uncentred(msg["name"])
        msg["value"] = value


def one_particle(loss: Any) -> Any | None:
    """The same ELBO (class and settings) drawing one particle, not vectorized, or ``None`` if
    ``loss`` is not one of :data:`REBUILDABLE`."""
    return with_particles(loss, 1, vectorize=False)


def particles_agree(vectorized: torch.Tensor, single: torch.Tensor) -> bool:
    """Whether a loss at identical vectorized particles (:class:`CentralDraws`) equals the same
    ELBO's loss at one particle, within :data:`AGREEMENT_EPSILONS` of rounding."""
    vectorized, single = vectorized.detach(), single.detach()
    tolerance = AGREEMENT_EPSILONS * torch.finfo(vectorized.dtype).eps
    scale = max(float(vectorized.abs()), float(single.abs()), 1.0)
    return abs(float(vectorized) - float(single)) <= tolerance * scale
