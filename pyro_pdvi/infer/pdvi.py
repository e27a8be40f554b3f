"""PDVI: preconditioned primal-dual variational inference as a drop-in for SVI.

PD-VI [1] keeps, for each fixed data block ``b``, a copy ``lambda_b`` of the global
variational parameters and a dual ``mu_b``. A step over the blocks of its subsample

1. finds the step's blocks (:mod:`~pyro_pdvi.infer.blocks`),
2. solves their augmented Lagrangians for ``(phi_b, lambda_b)`` (:mod:`~pyro_pdvi.infer.problem`,
   :mod:`~pyro_pdvi.infer.solvers`),
3. moves the duals, ``mu_b += D (lambda_b - lambda_0)``, and the consensus ``lambda_0``
   (:mod:`~pyro_pdvi.infer.consensus`),
4. sets the scales of Gaussian global guide sites to their mean-field fixed point, which the
   solves hold (:mod:`~pyro_pdvi.infer.scales`; ``scale_update``),
5. writes ``lambda_0`` (from the third epoch on an estimate from every block's copy:
   ``PDVI.estimate_after_epochs``; in the second already where ``lambda_0`` swings,
   :mod:`~pyro_pdvi.infer.swing`) and the blocks' rows to the param store
   (:mod:`~pyro_pdvi.infer.params`),

as written out in ``shared/docs/algorithm.md``. P2D-VI is the same with ``D = blkdiag(I/eta_j)``
over groups of sites (:mod:`~pyro_pdvi.infer.step_sizes`).

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import pyro
import torch
from pyro.infer import ELBO, TraceEnum_ELBO
from pyro.optim import PyroOptim

from ..checks import check_choice, check_non_negative, check_positive_int
from ..errors import NonFiniteStepError, warn_user
from .blocks import BlockPartition
from .cholesky_maps import CholeskyMap
from .consensus import GLOBAL_UPDATES, ConsensusState, ConsensusUpdate, find_non_finite
from .coupling import CoupledLosses, Coupling
from .handlers import plate_entry
from .local_cavi import categorical_rows, exact_rows
from .objective import BlockObjective, loss_function
from .params import ParamStoreView
from .particles import (
    NOISE_DRAWS,
    CentralDraws,
    SolveLoss,
    affordable_particles,
    check_particles,
    consensus_noise,
    evaluation_size,
    one_particle,
    particles_agree,
    solve_loss,
)
from .problem import BlockProblem
from .reduced_hessian import BlockSchurComplement
from .run import RunResult, run_epochs
from .saddle_escape import SaddleEscape, run_check
from .safeguard import RisingObjectiveGuard
from .scales import ScaleFixedPoint, find_scale_maps
from .sites import FoundSites, GlobalLayout, find_sites, missing_subsample_message
from .solvers import BlockSolver, GenericSolver
from .stationarity import StationarityTest
from .step_sizes import (
    SHORT_SOLVE_STEPS,
    AutoStepSize,
    StepSizes,
    check_eta,
    diagonal_curvature,
    resolve_groups,
)
from .swing import SwingMeter
from .upkeep import StepSizeUpkeep
from .whitening import SiteWhitening

#: The most particles PDVI draws to whiten a full-covariance site's draws (two per dimension):
#: a larger site keeps the cost rule's particles and the primal-dual iteration, with a warning.
MAX_WHITENED_PARTICLES = 256

#: Values of ``PDVI(scale_update=...)``.
SCALE_UPDATES = ("auto", "fixed_point", "primal_dual")

#: ``diagnostics["hessian_products"]``: how the blocks' Hessian products are taken
#: (``StepSizeUpkeep._second_order``: not yet checked, by double backward, or by central differences).
HESSIAN_PRODUCTS = {None: None, True: "double_backward", False: "central_differences"}

#: A step refused for a non-finite value is solved again (fresh noise) up to this many times,
#: every step size halved before each try; if all fail it raises, the state as before the step.
REFUSED_STEP_RETRIES = 3


class StepSolution(NamedTuple):
    """The primal solutions of one step's blocks, before the dual and global update.

    :param block_ids: the step's blocks, in the order solved, shape ``(m,)``.
    :param copies: their new ``lambda_b``, flat, shape ``(m, P)``.
    :param losses: ``f_b`` at the solutions, shape ``(m,)``.
    :param parts: per group of equal-size blocks, their data indices ``(m_g, s_g)`` and
        new local rows ``(m_g, *rows_shape)``.
    :param seeds: the blocks' noise seeds, in the order of ``block_ids``.
    :param held_gradients: the gradient of ``f_b`` in the held coordinates at the solutions, flat,
        shape ``(m, P)`` (zero elsewhere), where every solve of the step returned it
        (:attr:`~pyro_pdvi.infer.problem.BlockSolution.held_gradients`), else ``None``.
    """

    block_ids: torch.Tensor
    copies: torch.Tensor
    losses: torch.Tensor
    parts: list[tuple[torch.Tensor, dict[str, torch.Tensor]]]
    seeds: list[int]
    held_gradients: torch.Tensor | None = None


#: How to write a model that takes vectorized particles (the warnings of PDVI's particle checks).
PARTICLE_SHAPES_FIX = (
    "Write the model so that it broadcasts over a leading particle dimension (index from the "
    "right and put per-group sites in a plate, as Pyro's tensor shapes tutorial does)"
)


class PDVI(StepSizeUpkeep):
    """Primal-dual mean-field VI over fixed data blocks, with the interface of
    :class:`pyro.infer.SVI`.

    Replace ``SVI(model, guide, optim, loss)`` by ``PDVI(model, guide, optim, loss,
    blocks=blocks)`` and pass one block's indices (or a union of whole blocks) as the
    subsample of the data plate in each step, or let :meth:`run` do the epochs::

        pdvi = PDVI(model, guide, pyro.optim.Adam({"lr": 0.01}),
                    TraceMeanField_ELBO(num_particles=16, vectorize_particles=True), blocks=blocks)
        for epoch in range(num_epochs):
            for b in torch.randperm(len(blocks)).tolist():
                loss = pdvi.step(data, blocks[b])

    The model and guide must wrap their per-datum sites in a ``pyro.plate`` of size ``N``
    with ``subsample=`` and index the data with the plate's indices. Params created inside
    that plate with ``event_dim`` set are local (their rows are the block's ``phi_b``); all
    others are global. After each step the param store holds the latest local rows and,
    for the globals, the consensus ``lambda_0`` in the first two epochs and then the estimate of
    :meth:`~pyro_pdvi.infer.consensus.ConsensusState.estimate` (``estimate_after_epochs``; in
    the second epoch already where ``lambda_0`` swings, :mod:`~pyro_pdvi.infer.swing`;
    ``PDVI.state.consensus`` is ``lambda_0``).

    :param model: the Pyro model.
    :param guide: the Pyro guide (hand-written, or an autoguide such as
        ``AutoNormal``/``AutoDelta`` built with ``create_plates``).
    :param optim: a :class:`pyro.optim.PyroOptim`; it drives the primal solve of a
        ``GenericSolver(method="optim")``.
    :param loss: a Pyro ELBO with ``differentiable_loss`` (``Trace_ELBO``,
        ``TraceMeanField_ELBO``, ``TraceEnum_ELBO``, ...) or a callable
        ``loss(model, guide, *args, **kwargs)`` returning a differentiable scalar.
    :param blocks: 1-D LongTensors that partition ``range(N)``: the fixed blocks.
    :param eta: step size of the default group: a positive float, ``"auto"`` for
        ``2 / L`` with ``L`` the measured curvature of the block objective in that group's
        params [1, Thm. 4.7], or an :class:`~pyro_pdvi.infer.step_sizes.AutoStepSize` that
        says how ``"auto"`` groups are measured.
    :param groups: preconditioner groups (P2D-VI): ``None`` for one group (PD-VI),
        ``"per_site"`` for one group per global site, or a list of dicts like torch.optim
        param groups keyed by site names (:mod:`~pyro_pdvi.infer.step_sizes`); a group of one
        site may give a tensor ``eta`` shaped like the site (a step size per coordinate).
    :param solver: the primal solver (:class:`~pyro_pdvi.infer.solvers.BlockSolver`):
        default :class:`~pyro_pdvi.infer.solvers.GenericSolver` (any model, through the
        loss), or a model's closed-form solver such as
        :class:`~pyro_pdvi.models.gmm.GMMBlockSolver`.
    :param global_update: how ``lambda_0`` moves (:mod:`~pyro_pdvi.infer.consensus`; same fixed
        point for all): ``"paper"`` (the mean of this step's copies, as in [1]), ``"consensus"``
        (the mean of every block's latest copy, which averages the solves' Monte Carlo noise
        over the blocks), ``"weighted"`` (per coordinate, by how much the step's blocks inform
        it, measured once per block: the paper's rule where they hold at least a fifth of an
        average block's information, else their copy weighed by their share, so that a
        coordinate they barely inform is averaged over the blocks; a coordinate that about one
        block informs, such as a group's random effect, takes the paper's rule whichever block
        steps: ``docs/benchmarks.md`` 13j) or ``"auto"`` (default): the
        paper's rule for a deterministic solve (a solver other than
        :class:`~pyro_pdvi.infer.solvers.GenericSolver`, or a guide without Monte Carlo sites),
        else the paper's rule for ``warmup_epochs`` epochs and the weighted rule after
        (``docs/benchmarks.md``, sections 1, 2 and 13e).
    :param warmup_epochs: epochs (block visits / n) of the paper's rule before ``"auto"``
        switches to the weighted rule for a Monte Carlo solve. The default is one: under the
        paper's rule a dual that an inexact solve left in a coordinate its blocks barely
        inform moves ``lambda_0`` by ``h`` at every step, which drove a scale to underflow on
        the generic suite's full-size GMM (epoch 2.4) and on PPCA (2 of 7 starts, epoch 3)
        with five (``docs/benchmarks.md`` 13d).
    :param particles: Monte Carlo particles of a block solve (:mod:`~pyro_pdvi.infer.particles`):
        ``"auto"`` (default) solves with a copy of the user's ELBO that draws vectorized
        particles when the user's ELBO does not vectorize several (Pyro's default draws one):
        as many as cost little, between 2 and 64, counted at set-up
        (:func:`~pyro_pdvi.infer.particles.affordable_particles`), and at least two per dimension
        of a full-covariance site whose covariance the fixed point sets (up to
        :data:`MAX_WHITENED_PARTICLES`; ``scale_update``); else with the user's ELBO.
        An even number sets them; ``None`` solves with the user's ELBO as it is. Where the
        model cannot take vectorized particles (it raises, or counts a term once per particle:
        checked at the first step), they are drawn in a loop, 8 for ``"auto"``, with a warning.
    :param antithetic: draw every Gaussian guide site's noise in antithetic pairs over the
        solve's vectorized particles (:mod:`~pyro_pdvi.infer.antithetic`), which removes the
        term linear in the noise from a fixed-noise block solve. ``"auto"`` (default): on
        when the solve's ELBO vectorizes an even number of particles.
    :param step_decay: halve a coordinate's step size once it only wanders in the solves'
        Monte Carlo noise (Pflug's test, :mod:`~pyro_pdvi.infer.stationarity`), so that the
        consensus converges instead of ending in a noise cloud whose width grows with the
        step size (``docs/benchmarks.md`` 13c: standard deviations 4-6x closer on three models
        of the generic suite). ``"auto"`` (default): on for a Monte Carlo solve (the
        :class:`~pyro_pdvi.infer.solvers.GenericSolver` with Monte Carlo guide sites), off for a
        deterministic one; ``True`` or ``False`` force it.
    :param scale_update: how the scales of Gaussian global guide sites move
        (:mod:`~pyro_pdvi.infer.scales`): ``"fixed_point"`` sets them after every step to the
        mean-field fixed point ``sigma_i^-2 = sum_b h_bi`` (Price's theorem: each block's share
        from the gradient of its ``f_b``, averaged over its visits), the solves holding them at
        ``lambda_0``; ``"primal_dual"`` moves them as any other param. ``"auto"`` (default):
        the fixed point for the :class:`~pyro_pdvi.infer.solvers.GenericSolver` with a Pyro ELBO
        and at least one site whose scale entries are each one param coordinate's
        (``AutoNormal``'s, a ``positive`` or log-scale param's) or a ``MultivariateNormal`` site
        whose Cholesky factor is a ``lower_cholesky`` param or ``AutoMultivariateNormal``'s
        ``scale`` and ``scale_tril`` (``Sigma^-1 = sum_b H_b``:
        :mod:`~pyro_pdvi.infer.cholesky_maps`; of at most half as many dimensions as the solves'
        antithetic particles, which PDVI's own vectorized particles are raised to, up to
        :data:`MAX_WHITENED_PARTICLES`), else the primal-dual iteration
        (``docs/benchmarks.md`` 13i: standard deviations 3-43x closer on the five small models of
        the generic suite; each block's share comes from the gradient at its solution, which the
        solver hands on, so it costs no model call: 13j).
        The loss must be a negative ELBO for the fixed point to be the optimum's.
    :param graph_replay: evaluate the blocks' objective by replaying a recorded graph of its
        torch operations instead of running the model, guide and ELBO through Pyro each time
        (:mod:`~pyro_pdvi.infer.graphs`): the same values and gradients, each graph checked
        against Pyro before it is trusted, for a fraction of the Python (``docs/benchmarks.md``
        13q). A model whose Python branches on tensor values stays with Pyro; one whose Python
        decides something a graph cannot follow is caught by the check (a warning, and Pyro
        from then on). ``False``: never record.
    :param plate_name: name of the data plate, if several plates have size N.
    """

    def __init__(
        self,
        model: Callable,
        guide: Callable,
        optim: PyroOptim,
        loss: ELBO | Callable[..., torch.Tensor],
        *,
        blocks: Sequence[torch.Tensor],
        eta: float | str | AutoStepSize = "auto",
        groups: list[dict] | str | None = None,
        solver: BlockSolver | None = None,
        global_update: str = "auto",
        warmup_epochs: float = 1.0,
        particles: int | str | None = "auto",
        antithetic: bool | str = "auto",
        step_decay: bool | str = "auto",
        scale_update: str = "auto",
        graph_replay: bool = True,
        plate_name: str | None = None,
    ) -> None:
        if not isinstance(optim, PyroOptim):
            raise ValueError(
                "optim must be a pyro.optim.PyroOptim such as pyro.optim.Adam({'lr': 0.01}), got "
                + (
                    f"the class {optim.__module__}.{optim.__name__}"
                    if isinstance(optim, type)
                    else f"a {type(optim).__name__}"
                )
            )
        loss_function(loss)  # checks it
        check_choice(global_update, ("auto", *GLOBAL_UPDATES), "global_update")
        if solver is None:
            solver = GenericSolver()
        elif not callable(getattr(solver, "solve", None)):
            raise ValueError(
                f"solver must have a method solve(problem: BlockProblem) -> BlockSolution, got "
                f"{type(solver).__name__}; use e.g. GenericSolver() or GMMBlockSolver(data, prior)"
            )
        if antithetic != "auto" and not isinstance(antithetic, bool):
            raise ValueError(f'Invalid antithetic: {antithetic!r}; use True, False or "auto"')
        if step_decay != "auto" and not isinstance(step_decay, bool):
            raise ValueError(f'Invalid step_decay: {step_decay!r}; use True, False or "auto"')
        self.particles = check_particles(particles)
        check_choice(scale_update, SCALE_UPDATES, "scale_update")
        if scale_update == "fixed_point" and not isinstance(solver, GenericSolver):
            raise ValueError(
                f"scale_update='fixed_point' needs the GenericSolver: {type(solver).__name__} solves "
                "every global param itself; use scale_update='primal_dual' (or 'auto')"
            )
        self.scale_update = scale_update
        if not isinstance(graph_replay, bool):
            raise ValueError(f"Invalid graph_replay: {graph_replay!r}; use True or False")
        self.graph_replay = graph_replay

        self.model = model
        self.guide = guide
        self.optim = optim
        self.loss = loss
        self.partition = BlockPartition(blocks)
        self.auto_step_size = eta if isinstance(eta, AutoStepSize) else AutoStepSize()
        if isinstance(eta, torch.Tensor):
            raise ValueError(
                "Invalid eta: a tensor of step sizes; a step size per coordinate goes in a group of "
                "one site: groups=[{'sites': ['<site>'], 'eta': <tensor shaped like it>}]"
            )
        self.eta = "auto" if isinstance(eta, AutoStepSize) else check_eta(eta, "eta")
        self.groups = groups
        self.solver = solver
        self.global_update = global_update
        self.warmup_epochs = check_non_negative(warmup_epochs, "warmup_epochs")
        self.antithetic = antithetic
        self.step_decay = step_decay
        self.plate_name = plate_name
        self.num_steps = 0
        self.diagnostics: dict[str, Any] = {}
        self._block_visits = 0
        # Blocks whose diagonal curvature was measured (at their first visit; the state_dict
        # key is still "bounded_blocks", as in checkpoints before the weighted rule).
        self._measured_blocks: set[int] = set()
        # Each block's arguments at its first step, for the pass over every block once all are
        # measured (the concentrated coordinates' confirmation and coupling; held until then).
        self._first_step_args: dict[int, tuple[tuple, dict]] = {}
        self._guard = RisingObjectiveGuard()
        self._stationarity = StationarityTest()
        self._saddle = SaddleEscape()
        # Every block's latest step arguments, for the saddle escape's checks (where it applies).
        self._step_args: dict[int, tuple[tuple, dict]] = {}
        self._state: ConsensusState | None = None
        self._scales: ScaleFixedPoint | None = None
        self._held: dict[str, torch.Tensor] = {}
        # The coordinates lambda~ = T lambda of the state, once concentrated coordinates are
        # coupled with shared ones (:mod:`~pyro_pdvi.infer.coupling`) or, where none are, once
        # small sites are whitened (:mod:`~pyro_pdvi.infer.whitening`); None: the params'.
        self._coupling: Coupling | SiteWhitening | None = None
        # Whether the sites' whitening was decided (once, when every block is measured).
        self._whitening_tried = False
        # The blocks that own concentrated coordinates the solve moves, (n,) on the CPU; None
        # while there is no such coordinate.
        self._owns_concentrated: torch.Tensor | None = None
        self._pending_state: dict | None = None
        # Local sites whose rows the solves set in closed form (found at the set-up).
        self._categorical_rows: tuple[str, ...] = ()
        # PDVI's own randomness (noise seeds, curvature probes, run's block order) comes from
        # this generator, seeded from torch's at the first step: it does not depend on how
        # much the traces draw, so a run split over processes draws the same seeds.
        self._rng: torch.Generator | None = None

    # ------------------------------------------------------------------ set-up

    def _setup(self, args: tuple, kwargs: dict, first_blocks: torch.Tensor | None = None) -> None:
        """Find the data plate and the sites, lay out the state, measure ``"auto"`` steps. If
        anything fails, the params this created are removed again and the PDVI stays unset."""
        store = pyro.get_param_store()
        existing = set(store.keys())
        try:
            self._set_up(args, kwargs, first_blocks)
        except BaseException:
            self._state = None
            for name in set(store.keys()) - existing:
                del store[name]
            raise

    def _set_up(self, args: tuple, kwargs: dict, first_blocks: torch.Tensor | None) -> None:
        """:meth:`_setup`; ``first_blocks``: the first step's blocks, ``None`` to read them from
        the data plate's subsample in ``args, kwargs`` (which checks it)."""
        if self._rng is None:
            self._seed_generator()
        found = find_sites(self.model, self.guide, args, kwargs, self.partition.num_data, self.plate_name)
        self.plate, self.local_sites, global_sites = found.plate, found.local_sites, found.global_sites
        self._plate_in_guide = found.plate_in_guide
        self.partition.check_covers(self.plate.size, self.plate.name)
        if first_blocks is None:
            first_blocks = self.partition.blocks_in(self._step_subsample(args, kwargs))
        self._noisy_solve = isinstance(self.solver, GenericSolver) and bool(found.monte_carlo_sites)
        self._solve_loss = solve_loss(self.loss, self.particles, self.antithetic, self._noisy_solve)
        self._guard.monte_carlo = self._noisy_solve
        self.layout = GlobalLayout(global_sites)
        self._params = ParamStoreView(self.layout, self.local_sites)
        self._objective = BlockObjective(
            self.model,
            self.guide,
            self._solve_loss.fn,
            self.plate,
            self.layout,
            self.local_sites,
            graph_replay=self.graph_replay,
            num_blocks=len(self.partition),
        )
        groups = resolve_groups(self.groups, self.layout.names, self.eta)
        consensus = self._params.consensus()
        self.device = consensus.device
        self._state = ConsensusState(consensus, len(self.partition), torch.ones_like(consensus))
        # One evaluation before any solve: an ELBO's lazy set-up (Pyro guesses
        # max_plate_nesting by tracing, which draws) must not shift the fixed noise of
        # the first solve, nor differ between a fresh and a resumed run.
        self._warm_up(args, kwargs)
        self._categorical_rows = ()  # none while the check below builds its problem
        self._categorical_rows = self._find_categorical_rows(found, args, kwargs)
        generic = isinstance(self.solver, GenericSolver)
        fits_rows = any(site.name not in self._categorical_rows for site in self.local_sites)
        short = generic and self.solver.inner_steps <= SHORT_SOLVE_STEPS
        self.auto_step_size = self.auto_step_size.resolved(generic, short and fits_rows)
        self._step_sizes = StepSizes(groups, self.layout, self.auto_step_size, len(self.partition))
        self._scales = self._find_scales(first_blocks, args, kwargs)
        self._held = self._held_coordinates()
        held_scales = None if self._scales is None else self._scales.coordinates
        self._swing = SwingMeter(len(self.partition), held_scales)
        self._swing.add(self._consensus_params)
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)
            return
        if self._step_sizes.natural:
            self._step_sizes.set_fisher(self._measure_fisher(first_blocks, args, kwargs))
        if self._step_sizes.needs_curvature():
            self._step_sizes.set_curvatures(self._measure_curvatures(args, kwargs))
        self._state.set_step_sizes(self._step_sizes.per_coordinate(consensus))
        self._after_setup()

    def _warm_up(self, args: tuple, kwargs: dict) -> None:
        """One evaluation of the first block before any solve: an ELBO's lazy set-up (Pyro
        guesses max_plate_nesting by tracing, which draws) must not shift the fixed noise of the
        first solve, nor differ between a fresh and a resumed run. Where PDVI draws the solves'
        particles (``particles="auto"``), it chooses how many first (:meth:`_choose_particles`).
        If the model cannot take them vectorized (it raises, or it counts a term once per
        particle: :meth:`_check_particle_broadcasting`), the solves draw them in a loop
        (:meth:`_loop_particles`)."""
        first = self.partition.stacked(torch.tensor([0]), self.device)
        rows = self._params.rows(first)
        # Through Pyro, not recorded: the ELBO's set-up runs in it, and a graph must hold only
        # what every evaluation does.
        with self._objective.one_off():
            if self.particles == "auto" and self._solve_loss.owned:
                self._choose_particles(first, rows, args, kwargs)
            try:
                self._objective.bind(first, [0], args, kwargs)(self._copies(self._state.consensus, 1), rows)
            except Exception as error:
                if not self._solve_loss.owned:
                    raise
                self._loop_particles(
                    f"the model could not be evaluated over {self._solve_loss.loss.num_particles} "
                    f"vectorized particles ({type(error).__name__}: {error})"
                )
            else:
                self._check_particle_broadcasting(first, rows, args, kwargs)
            if self._solve_loss.owned and not getattr(self._solve_loss.loss, "vectorize_particles", True):
                # The looped ELBO's own lazy set-up, here and not in the first solve.
                self._objective.bind(first, [0], args, kwargs)(self._copies(self._state.consensus, 1), rows)
        if self._noisy_solve and getattr(self._solve_loss.loss, "num_particles", 2) == 1:
            warn_user(
                "PDVI holds the Monte Carlo noise fixed within each primal solve, and the solve's loss "
                "draws one particle: it then minimises a one-sample surrogate whose optimum can be far "
                "off (scales drift). Use particles='auto' or a Trace_ELBO, TraceMeanField_ELBO or "
                "TraceEnum_ELBO, which PDVI can give more particles.",
            )

    def _check_particle_broadcasting(
        self, first: torch.Tensor, rows: dict, args: tuple, kwargs: dict
    ) -> None:
        """Whether the solves' vectorized particles compute the user's loss. With every guide draw
        at a central value, the same for each particle
        (:class:`~pyro_pdvi.infer.particles.CentralDraws`), the solve's ELBO on the first block
        must equal the same ELBO at one particle. Under vectorized particles a global draw has a
        leading particle dimension, and a model written for one draw may broadcast it against
        the particles of another tensor: ``m[..., None] + e[..., idx]`` with ``m`` scalar and
        ``e`` a vector counts the data once per particle (measured: sd of ``q(m)`` 0.0066
        against the exact 0.050, ``docs/benchmarks.md`` 13zf). Where PDVI drew the particles,
        the solves then draw them in a loop (:meth:`_loop_particles`); where they are the user's, a
        warning says so (Pyro's SVI with that loss counts the same). Guides with a site of no
        central value (a discrete one) and models that run only vectorized are not checked."""
        loss = self._solve_loss.loss
        single = one_particle(loss) if getattr(loss, "vectorize_particles", False) else None
        if single is None:
            return
        copies = self._copies(self._state.consensus, 1)

        def central_loss(fn: Callable) -> torch.Tensor:
            self._objective.loss_fn = fn
            with CentralDraws():
                return self._objective.bind(first, [0], args, kwargs)(copies, rows).detach()

        try:
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                vectorized = central_loss(loss_function(loss))  # not under antithetic noise
                single = central_loss(loss_function(single))
        except Exception:  # a guide site of no central value (Uncentred), a model run only vectorized
            return
        finally:
            self._objective.loss_fn = self._solve_loss.fn
        if particles_agree(vectorized, single):
            return
        if not self._solve_loss.owned:
            warn_user(
                f"The loss's {loss.num_particles} vectorized particles do not compute one particle's "
                f"loss: {self._broadcast_finding(vectorized, single)}. Pyro's SVI with this loss "
                f"counts the same. {PARTICLE_SHAPES_FIX}, or use vectorize_particles=False.",
            )
            return
        self._loop_particles(
            f"at {loss.num_particles} vectorized particles " + self._broadcast_finding(vectorized, single)
        )

    @staticmethod
    def _broadcast_finding(vectorized: torch.Tensor, single: torch.Tensor) -> str:
        return (
            f"with every particle at the same draw the first block's loss is {float(vectorized):.6g}, "
            f"and {float(single):.6g} at one particle: some site broadcasts against the particle "
            "dimension (each draw gains a leading particle dimension, and an expression written "
            "for one draw, such as m[..., None] + e[..., idx] with e a to_event vector, can "
            "broadcast it against another draw's)"
        )

    def _loop_particles(self, reason: str) -> None:
        """The solves draw PDVI's particles in a loop, in antithetic pairs, where the model cannot
        take vectorized ones; a warning says why (``reason``) and what it costs."""
        self._solve_loss = solve_loss(
            self.loss, self.particles, self.antithetic, self._noisy_solve, looped=True
        )
        self._objective.loss_fn = self._solve_loss.fn
        particles = getattr(self._solve_loss.loss, "num_particles", 1)
        warn_user(
            f"PDVI's block solves cannot draw vectorized particles in this model: {reason}. They "
            f"draw {particles} particle(s) in a loop instead, each an evaluation of the model (8 "
            "cost an epoch 2.5-3x a vectorized one in docs/benchmarks.md 13zf). "
            f"{PARTICLE_SHAPES_FIX}, or pass particles=None to solve with the loss as given.",
        )

    def _choose_particles(self, first: torch.Tensor, rows: dict, args: tuple, kwargs: dict) -> None:
        """Draw as many particles in the solves as cost little
        (:func:`~pyro_pdvi.infer.particles.affordable_particles`): the first block evaluated with
        2 and with 4, its operations and elements counted. The choice depends on shapes only, so
        a resumed run makes the same; where the model cannot take 2 or 4 particles, the solve's
        loss is left as it was (the warm-up then draws them in a loop, with a warning).
        Counted on one block: a vectorized solve over several blocks at once
        (``GenericSolver(vectorize=True)``) makes as many times the elements per operation, so
        there the particles cost more than this count allows for."""

        def evaluate() -> None:
            self._objective.bind(first, [0], args, kwargs)(self._copies(self._state.consensus, 1), rows)

        sizes = []
        try:
            for particles in (2, 4):
                self._objective.loss_fn = solve_loss(self.loss, particles, self.antithetic, True).fn
                sizes.append(evaluation_size(evaluate, self.device))
        except Exception:  # the warm-up's fallback says what is wrong
            self._objective.loss_fn = self._solve_loss.fn
            return
        chosen = affordable_particles(sizes[0], sizes[1], self.device)
        self._solve_loss = solve_loss(self.loss, chosen, self.antithetic, self._noisy_solve)
        self._objective.loss_fn = self._solve_loss.fn

    def _find_categorical_rows(self, found: FoundSites, args: tuple, kwargs: dict) -> tuple[str, ...]:
        """The local sites whose rows a solve may set by their closed-form update
        (:mod:`~pyro_pdvi.infer.local_cavi`): the logits of enumerated categorical factors under
        a ``TraceEnum_ELBO``, where the update is exact on the first block; none unless the
        solver is a :class:`~pyro_pdvi.infer.solvers.GenericSolver` that uses them."""
        uses_them = isinstance(self.solver, GenericSolver) and self.solver.local_cavi
        if not uses_them or not isinstance(self._solve_loss.loss, TraceEnum_ELBO):
            return ()
        names = categorical_rows(found.guide_trace, self.local_sites, self.plate)
        if not names:
            return ()
        problem = self._problem(torch.tensor([0]), [0], args, kwargs)
        return tuple(exact_rows(problem, names))

    def _find_scales(self, first_blocks: torch.Tensor, args: tuple, kwargs: dict) -> ScaleFixedPoint | None:
        """The scales set by their fixed point (``scale_update``), found on the first block."""
        if self.scale_update == "primal_dual":
            return None
        if self.scale_update == "auto" and not (
            isinstance(self.loss, ELBO) and isinstance(self.solver, GenericSolver)
        ):
            return None
        indices = self.partition.block(int(first_blocks[0]), self.device)
        point = self._state.consensus
        maps = find_scale_maps(
            self.guide, self.plate, self.layout, point, indices, args, kwargs, self._side_seed(-2)
        )
        # A full-covariance site's block information is exact at fixed noise only where its draws
        # can be whitened: at least as many antithetic pairs as dimensions (docs/benchmarks.md 13zi).
        pairs = getattr(self._solve_loss.loss, "num_particles", 1) // 2 if self._solve_loss.antithetic else 0
        too_large = [m for m in maps if isinstance(m, CholeskyMap) and m.size > pairs]
        if too_large and self._draw_particles_for(max(m.size for m in too_large), args, kwargs):
            too_large = []
        if too_large:
            sites = ", ".join(f'"{m.site}" ({m.size} dimensions)' for m in too_large)
            needed = 2 * max(m.size for m in too_large)
            fix = (
                f"the solves draw {2 * pairs} paired particles. Pass particles={needed} (or more)"
                if self._solve_loss.antithetic
                else f"the solves' particles are not paired. Pass antithetic=True and particles={needed}"
            )
            warn_user(
                f"PDVI sets the covariance of {sites} by the primal-dual iteration, which converges "
                f"slowly there: its fixed point (docs/benchmarks.md 13zi) needs at least as many "
                f"antithetic particle pairs as dimensions, and {fix} to PDVI to set it by the fixed "
                "point."
            )
            maps = [m for m in maps if m not in too_large]
        if not maps:
            if self.scale_update == "fixed_point":
                raise ValueError(
                    "scale_update='fixed_point': no global guide site is a Normal (behind Independent or "
                    "a parameter-free transform) whose scale entries are each one param coordinate's "
                    "own function (a positive or softplus_positive param, or exp of an unconstrained "
                    "one) that no location uses, nor a MultivariateNormal whose scale_tril is a "
                    "lower_cholesky param (or a positive one times a unit_lower_cholesky one) with "
                    "at least twice as many antithetic particles as dimensions (particles=...); use "
                    "scale_update='primal_dual'"
                )
            return None
        return ScaleFixedPoint(maps, len(self.partition), point)

    def _draw_particles_for(self, dimensions: int, args: tuple, kwargs: dict) -> bool:
        """Where PDVI draws the solves' vectorized particles itself (``particles="auto"``), raise
        them to two per dimension of a full-covariance site, up to :data:`MAX_WHITENED_PARTICLES`,
        so that its draws can be whitened and its covariance set by the fixed point
        (``docs/benchmarks.md`` 13zi: at 48 dimensions 96 particles cost an epoch 1.3x the 54 that
        the cost rule chose, and gave the exact covariance after one epoch, where the primal-dual
        iteration was 0.28 off after 40). Before any solve: the new ELBO's lazy set-up runs here,
        not recorded, as in :meth:`_warm_up`.

        :returns: whether the particles now suffice.
        """
        needed = 2 * dimensions
        owned_vectorized = self._solve_loss.owned and getattr(
            self._solve_loss.loss, "vectorize_particles", False
        )
        paired = self.antithetic is not False
        if self.particles != "auto" or not (owned_vectorized and paired) or needed > MAX_WHITENED_PARTICLES:
            return False
        self._solve_loss = solve_loss(self.loss, needed, self.antithetic, self._noisy_solve)
        self._objective.loss_fn = self._solve_loss.fn
        first = self.partition.stacked(torch.tensor([0]), self.device)
        with self._objective.one_off():
            self._objective.bind(first, [0], args, kwargs)(
                self._copies(self._state.consensus, 1), self._params.rows(first)
            )
        return True

    def _copies(self, flat: torch.Tensor, num_blocks: int, requires_grad: bool = True) -> dict:
        """``lambda`` (a flat vector) as every global site's value for ``num_blocks`` blocks."""
        flat = flat.detach().requires_grad_(requires_grad)
        return {k: v.expand(num_blocks, *v.shape) for k, v in self.layout.unflatten(flat).items()}

    def _after_setup(self) -> None:
        """Hook at the end of a fresh set-up (:class:`~pyro_pdvi.distributed.DistributedPDVI`
        makes every process start from the same ``lambda_0`` and step sizes)."""

    def _seed_generator(self) -> None:
        self._rng = torch.Generator().manual_seed(int(torch.randint(0, 2**62, ())))

    # ---------------------------------------------------------------- the step

    def step(self, *args: Any, **kwargs: Any) -> float:
        """Take one PD-VI step on the block(s) whose indices the data plate subsamples.

        :returns: the loss of the step's subsample at the new block solutions, scaled to
            the full data as ``SVI.step``'s is.
        :rtype: float
        :raises NonFiniteStepError: if the loss or the update is not finite, also after
            :data:`REFUSED_STEP_RETRIES` tries with halved step sizes; then no param, dual,
            copy or step size has changed.
        """
        if self._state is None:
            self._setup(args, kwargs)
        return self._step(self.partition.blocks_in(self._step_subsample(args, kwargs)), args, kwargs)

    def _step(self, block_ids: torch.Tensor, args: tuple, kwargs: dict) -> float:
        """The algorithm's loop for the step's blocks: solve, move duals and consensus, write;
        then adapt the step sizes for the next steps."""
        epoch = self._block_visits // len(self.partition)
        before = None
        held = None if self._scales is None else self._state.consensus[self._scales.coordinates].clone()
        for retry in range(REFUSED_STEP_RETRIES + 1):
            solved = self._solve_everywhere(block_ids, args, kwargs)
            try:
                loss = self._commit(solved)
                break
            except NonFiniteStepError as error:
                if before is None:  # nothing has changed yet
                    before = (self._state.consensus, self._state.step_sizes, self._guard.damping)
                if retry == REFUSED_STEP_RETRIES:
                    self._restore_step_sizes(*before)
                    raise NonFiniteStepError(
                        f"{error} (The step was tried {retry + 1} times, every step size halved "
                        "before each retry, and the step sizes are back as they were.)"
                    ) from None
                self._halve_after_refusal(error)
        self._update_scales(solved, held, args, kwargs)
        self._adapt_step_sizes(block_ids, epoch, args, kwargs)
        self._escape_saddle_if_due(block_ids, args, kwargs)
        return loss

    #: Check for saddles of the reduced objective where a model has a latent per datum, and
    #: leave them (:mod:`~pyro_pdvi.infer.saddle_escape`); ``False`` turns it off.
    escape_saddles = True

    def _saddle_escape_blocker(self) -> str | None:
        """Why the saddle escape does not apply to this run (``None``: it does)."""
        if not self.escape_saddles:
            return "off (PDVI.escape_saddles)"
        if not any(site.name not in self._categorical_rows for site in self.local_sites):
            return "no local rows that the solves fit"
        if not isinstance(self.solver, GenericSolver) or not self._noisy_solve:
            return "not the GenericSolver's Monte Carlo solve"
        if self._shares_steps:
            return "steps shared between processes"
        if self._coupling is not None:
            return "coupled or whitened coordinates"
        if self._second_order is False:
            return "no second derivatives through the model"
        return None

    def _escape_saddle_if_due(self, block_ids: torch.Tensor, args: tuple, kwargs: dict) -> None:
        """Keep the step's arguments and, at the end of an epoch where a check is due, run it
        (:func:`~pyro_pdvi.infer.saddle_escape.run_check`) and record it in
        ``diagnostics["saddle_escape"]``."""
        blocker = self._saddle_escape_blocker()
        if blocker is not None:
            self._step_args.clear()
            self.diagnostics["saddle_escape"] = blocker
            return
        if self._saddle.next_check is None:  # no check follows: the arguments are not kept
            self._step_args.clear()
            self.diagnostics["saddle_escape"] = self._saddle.checks
            return
        for b in block_ids.tolist():
            self._step_args[b] = (args, kwargs)
        num_blocks = len(self.partition)
        epochs = self._block_visits // num_blocks
        if (self._block_visits - len(block_ids)) // num_blocks < epochs:  # an epoch ended
            if self._saddle.end_epoch(epochs, self._consensus_params) and len(self._step_args) == num_blocks:
                started = time.perf_counter()
                try:
                    with self._objective.one_off():
                        rounds = run_check(self, self._saddle, self._step_args, self._side_seed(-4 - epochs))
                except RuntimeError as error:
                    # No usable second derivative through the model, or a non-finite Hessian: a
                    # round moves the state only once it is done, so the state is consistent.
                    reason = f"{type(error).__name__}: {error}"
                    self._saddle.failed(epochs, reason, time.perf_counter() - started)
                else:
                    self._saddle.checked(epochs, rounds, time.perf_counter() - started)
        self.diagnostics["saddle_escape"] = self._saddle.checks

    def _block_schur(self, b: int, seed: int, args: tuple, kwargs: dict) -> BlockSchurComplement:
        """Block ``b``'s Hessian at ``lambda_0`` and its current rows, the locals eliminated, at
        the noise of ``seed`` (:class:`~pyro_pdvi.infer.reduced_hessian.BlockSchurComplement`)."""
        indices = self.partition.stacked(torch.tensor([b]), self.device)
        losses = self._objective.bind(indices, [seed], args, kwargs)
        return BlockSchurComplement(
            losses, self.layout, self._consensus_params.detach(), self._params.rows(indices)
        )

    def _translate(
        self,
        move: torch.Tensor,
        solved: list[tuple[torch.Tensor, dict]],
        dual_shift: torch.Tensor | None = None,
    ) -> None:
        """Move ``lambda_0`` and every copy by ``move`` (params' coordinates, which are the
        state's here), the duals by ``dual_shift`` (zero mean over the blocks; ``None``: kept),
        set the blocks' rows to ``solved``. The stationarity test's last ``lambda_0`` moves with
        it: the jump is not a step of the iteration."""
        self._state.translate(move, dual_shift)
        if self._stationarity.previous is not None:
            self._stationarity.previous += move.to(self._stationarity.previous)
        for indices, rows in solved:
            self._params.write_rows(indices, rows)
        self._write_consensus()

    def _update_scales(
        self, solved: StepSolution, held: torch.Tensor | None, args: tuple, kwargs: dict
    ) -> None:
        """After an accepted step, the scales set by their fixed point (:mod:`~pyro_pdvi.infer.scales`):
        put back their values from before the step (the global update moved them with stale
        copies), record the step's blocks' ``h_b`` at their solutions (the gradient the solver
        handed on: the block's new ``lambda_b`` and rows, the step's noise, the scales held at
        ``lambda_0``) and set the scales to the fixed point of every block's."""
        fixed = self._scales
        if fixed is None:
            return
        state = self._state
        state.consensus[fixed.coordinates] = held
        point = state.consensus.detach()
        gradients = solved.held_gradients
        if gradients is None:
            gradients = self._gradients_at(point, solved, args, kwargs)
        shares = self.partition.sizes[solved.block_ids].to(point) / self.partition.num_data
        information = fixed.block_information(gradients, shares, point)
        change, first = fixed.record(solved.block_ids, information)
        summed = self._all_reduce(torch.cat([change, first.reshape(1).to(change)]))
        fixed.add(summed[:-1], summed[-1])
        state.consensus[fixed.coordinates] = fixed.scales_at(point)
        self._write_consensus()
        self.diagnostics["scale_fixed_point"] = {
            "params": fixed.param_names,
            "non_positive": fixed.non_positive,
            "non_finite": fixed.non_finite,
        }

    @property
    def _consensus_params(self) -> torch.Tensor:
        """``lambda_0`` in the params' coordinates (the state's may be coupled ones)."""
        consensus = self._state.consensus
        return consensus if self._coupling is None else self._coupling.inverse(consensus)

    _estimate_after_epochs: float | None = 2

    @property
    def estimate_after_epochs(self) -> float | None:
        """The param store holds the estimate of :meth:`ConsensusState.estimate` (the blocks'
        copies weighted by their measured information, plus ``h``) once this many epochs have
        passed (default 2), and ``lambda_0`` before, but where ``lambda_0`` swings after the
        first epoch (:mod:`~pyro_pdvi.infer.swing`); ``None``: ``lambda_0`` throughout. The
        iteration is the same either way. Measured on the issue-13 suite (``docs/benchmarks.md``
        13t, four seeds, the same steps, so per epoch): from the end of the second epoch on, the
        estimate's ELBO gap was 0.33-0.95x ``lambda_0``'s (geometric mean over the epochs) on all
        six models and its means 0.51-1.00x, but for the scale regression's 1.02x; during the
        second epoch the first epoch's copies, made far from the optimum, left the logistic
        regression's means 1.1-1.45x further."""
        return self._estimate_after_epochs

    @estimate_after_epochs.setter
    def estimate_after_epochs(self, epochs: float | None) -> None:
        number = isinstance(epochs, (int, float)) and not isinstance(epochs, bool)
        if epochs is not None and not (number and 0 <= epochs < float("inf")):
            raise ValueError(
                f"Invalid estimate_after_epochs: {epochs!r}; use a non-negative number of epochs, or "
                "None to keep lambda_0 in the param store"
            )
        self._estimate_after_epochs = epochs
        if self._state is not None:
            self._write_consensus()

    def _write_consensus(self) -> None:
        """Write ``lambda_0``, or the estimate (``estimate_after_epochs``), into the param store."""
        self._params.write_consensus(self._reported_params())

    def _reported_params(self) -> torch.Tensor:
        """What the param store holds of the globals: ``lambda_0`` in the params' coordinates, or
        the estimate (:meth:`_estimate_params`) once ``estimate_after_epochs`` passed, and from
        the first epoch's end before that where ``lambda_0`` swings (:mod:`~pyro_pdvi.infer.swing`);
        both in one process only (across processes each holds its own blocks' copies). In the
        first epoch (one process), the scales that their fixed point sets are estimated from the
        blocks seen so far (:meth:`~pyro_pdvi.infer.scales.ScaleFixedPoint.early_scales_at`),
        which the solves do not use: they hold the scales until every block has been seen."""
        after = self.estimate_after_epochs
        visits, num_blocks = self._block_visits, len(self.partition)
        reported = self._consensus_params
        if after is not None and not self._shares_steps and visits >= min(after, 1) * num_blocks:
            estimate = self._estimate_params()
            if visits >= after * num_blocks:
                reported = estimate
            else:
                reported = torch.where(self._swing.swinging().to(estimate.device), estimate, reported)
        if self._scales is not None and not self._shares_steps and visits < num_blocks:
            reported = reported.clone()
            reported[self._scales.coordinates] = self._scales.early_scales_at(reported)
        return reported

    def _estimate_params(self) -> torch.Tensor:
        """:meth:`~pyro_pdvi.infer.consensus.ConsensusState.estimate` in the params' coordinates,
        with the scales that their fixed point sets at ``lambda_0``'s (they are not copies'
        averages)."""
        estimate = self._state.estimate()
        if self._coupling is not None:
            estimate = self._coupling.inverse(estimate)
        if self._scales is not None:
            estimate[self._scales.coordinates] = self._consensus_params[self._scales.coordinates]
        return estimate

    def _gradients_at(
        self, point: torch.Tensor, solved: StepSolution, args: tuple, kwargs: dict
    ) -> torch.Tensor:
        """``grad_lambda f_b`` of the step's blocks at ``point`` and their new rows, with the step's
        noise, shape ``(m, P)``: one more evaluation, for a solver that did not hand it on."""
        gradients, start = [], 0
        if self._coupling is not None:
            point = self._coupling.inverse(point)
        for indices, rows in solved.parts:
            copies = point.expand(len(indices), -1).clone().requires_grad_()
            losses = self._objective.bind(indices, solved.seeds[start : start + len(indices)], args, kwargs)
            f = losses(self.layout.unflatten(copies), rows)
            gradients.append(torch.autograd.grad(f.sum(), copies)[0])
            start += len(indices)
        gradients = torch.cat(gradients)
        return gradients if self._coupling is None else self._coupling.dual_forward(gradients)

    def _halve_after_refusal(self, error: NonFiniteStepError) -> None:
        """Halve every step size for the retry of a refused step (``lambda_0`` moves with
        ``h = H mean(mu)``, as for any change of ``H``; the fixed point is kept).

        A block whose solve leaves the model's domain with the step sizes in use may solve
        with smaller ones (the restart the error message advises, without losing the run);
        the halving stays for the rest of the run, as the
        :mod:`~pyro_pdvi.infer.safeguard`'s does. It cannot repair a coordinate of
        ``lambda_0`` that has already collapsed (``docs/benchmarks.md``, section 13f)."""
        self._step_sizes.damping = self._guard.halve()
        self._apply_step_sizes()
        self.diagnostics["damping"] = self._guard.damping
        warn_user(
            f"{str(error).split(';')[0]}; the step was refused and is solved again with every step "
            f"size halved, now {self._guard.damping:g} of its rule's (diagnostics['damping'])",
        )

    def _restore_step_sizes(self, consensus: torch.Tensor, step_sizes: torch.Tensor, damping: float) -> None:
        """Put back ``lambda_0``, ``H`` and the damping as they were before a refused step."""
        self._state.consensus, self._state.step_sizes = consensus, step_sizes
        self._step_sizes.damping = self._guard.damping = damping
        self._write_consensus()
        self.diagnostics["damping"] = damping
        self.diagnostics["step_sizes"] = self.step_sizes

    def _solve_everywhere(self, block_ids: torch.Tensor, args: tuple, kwargs: dict) -> StepSolution:
        """Solve the step's blocks (:class:`~pyro_pdvi.distributed.DistributedPDVI` also tells
        the other processes whether it could)."""
        return self._solve(block_ids, self._block_seeds(block_ids), args, kwargs)

    def _solve(self, block_ids: torch.Tensor, seeds: list[int], args: tuple, kwargs: dict) -> StepSolution:
        """Primal solutions of the step's blocks: one problem per group of equal-size blocks."""
        sizes = self.partition.sizes[block_ids]
        solved_ids, copies, losses, parts, solved_seeds, held_gradients = [], [], [], [], [], []
        for size in sizes.unique().tolist():
            chosen = (sizes == size).nonzero().reshape(-1)
            ids = block_ids[chosen]
            solved_seeds += [seeds[i] for i in chosen.tolist()]
            problem = self._problem(ids, solved_seeds[-len(ids) :], args, kwargs)
            solution = self.solver.solve(problem)
            loss = solution.loss
            if loss is None:
                loss = problem.losses(self._copies_of(solution.globals), solution.local)
            solved_ids.append(ids)
            copies.append(self.layout.flatten(solution.globals, batch_dims=1))
            losses.append(loss.detach().reshape(-1))
            parts.append((problem.indices, solution.local))
            if solution.held_gradients is not None:
                every_site = {k: torch.zeros_like(v) for k, v in solution.globals.items()}
                every_site.update(solution.held_gradients)
                held_gradients.append(self.layout.flatten(every_site, batch_dims=1))
        return StepSolution(
            torch.cat(solved_ids),
            torch.cat(copies),
            torch.cat(losses),
            parts,
            solved_seeds,
            torch.cat(held_gradients) if len(held_gradients) == len(parts) else None,
        )

    @staticmethod
    def _copies_of(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # TraceEnum_ELBO refuses to evaluate a loss that nothing requires the gradient of.
        return {k: v.detach().requires_grad_() for k, v in values.items()}

    def _problem(
        self, block_ids: torch.Tensor, seeds: list[int], args: tuple, kwargs: dict, consensus=None
    ) -> BlockProblem:
        """The subproblems of equal-size blocks at the current state (or at ``consensus``,
        a flat vector, with zero duals and vanishing step sizes: ``phi*(lambda)``)."""
        state = self._state
        indices = self.partition.stacked(block_ids, self.device)
        losses = self._objective.bind(indices, seeds, args, kwargs)
        owns_concentrated = None
        if consensus is None:
            consensus, duals, step_sizes = state.consensus, state.duals[block_ids], state.step_sizes
            if self._owns_concentrated is not None:
                owns_concentrated = self._owns_concentrated[block_ids.cpu()]
            if self._coupling is not None:
                losses = CoupledLosses(losses, self._coupling, self.layout)
        else:
            duals = consensus.new_zeros(len(block_ids), consensus.numel())
            step_sizes = torch.full_like(consensus, 1e-12)
        return BlockProblem(
            blocks=block_ids,
            indices=indices,
            consensus=self.layout.unflatten(consensus),
            dual=self.layout.unflatten(duals),
            step_sizes=self.layout.unflatten(step_sizes),
            local=self._params.rows(indices),
            num_blocks=len(self.partition),
            num_data=self.partition.num_data,
            losses=losses,
            optim=self.optim,
            args=args,
            kwargs=kwargs,
            categorical_rows=self._categorical_rows,
            held=self._held,
            owns_concentrated=owns_concentrated,
        )

    def _held_coordinates(self) -> dict[str, torch.Tensor]:
        """The solves' held coordinates (the scales set by their fixed point), per site."""
        if self._scales is None:
            return {}
        mask = torch.zeros_like(self._state.consensus, dtype=torch.bool)
        mask[self._scales.coordinates] = True
        held_sites = {self.layout.site_of(j) for j in self._scales.coordinates.tolist()}
        return {k: v for k, v in self.layout.unflatten(mask).items() if k in held_sites}

    def _draw_seed(self) -> int:
        return int(torch.randint(0, 2**62, (), generator=self._rng))

    def _side_seed(self, salt: int) -> int:
        """A seed of the step-size measurements that draws nothing from PDVI's generator (the
        solves' noise does not depend on whether they run), from its first seed and ``salt``."""
        return (self._rng.initial_seed() * 0x9E3779B97F4A7C15 + salt * 1000003) % 2**62

    def _block_seeds(self, block_ids: torch.Tensor) -> list[int]:
        """One noise seed per block of the step, from one draw: block ``b``'s seed depends on
        the draw and on ``b`` only, not on which other blocks share the step."""
        base = self._draw_seed()
        return [(base + (b + 1) * 0x9E3779B97F4A7C15) % 2**63 for b in block_ids.tolist()]

    def _step_subsample(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """The data plate's subsample in this call, from the guide (or, if the plate is only in
        the model, the model) run up to the plate.

        :raises ValueError: when the plate gets no subsample (a full plate, or one that draws
            its own minibatch), saying what to write instead.
        """
        where = "guide" if self._plate_in_guide else "model"
        site = plate_entry(self.guide if self._plate_in_guide else self.model, self.plate.name, args, kwargs)
        if site is None:
            raise ValueError(
                f"this step's {where} never entered the data plate {self.plate.name!r}, so PDVI "
                "cannot tell which block it is; pass the block's indices as the plate's subsample"
            )
        if site["value"] is None:
            raise ValueError(missing_subsample_message(site, where, self.guide))
        return site["value"]

    def _rule_for_step(self) -> str:
        """The global-update rule of the coming step (see ``global_update``)."""
        if self.global_update != "auto":
            return self.global_update
        warm = self._block_visits < self.warmup_epochs * len(self.partition)
        return "paper" if warm or not self._noisy_solve else "weighted"

    #: Whether each step is shared with other processes (which must then act in step).
    _shares_steps = False

    def _all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum (or ``op="max"``) over the processes that share a step: the identity in one
        process (:class:`~pyro_pdvi.distributed.DistributedPDVI` overrides it)."""
        return tensor

    def _commit(self, solved: StepSolution) -> float:
        """Dual and global update from the step's primal solutions; write the param store.

        One synchronisation with the host (and, across processes, one all-reduce) reads the
        step's loss and whether anything is not finite together.

        :returns: the step's loss as :meth:`step` returns it.
        """
        state = self._state
        state.global_update = self._rule_for_step()
        update = state.propose(solved.block_ids, solved.copies, self._all_reduce)
        rows = [r for _, part in solved.parts for r in part.values()]
        tensors = [solved.losses, update.copies, update.duals, update.consensus, *rows]
        finite = torch.stack([torch.isfinite(t).all() for t in tensors]).all()
        counts = [float(self.partition.sizes[solved.block_ids].sum()), float(len(solved.block_ids))]
        summary = torch.cat(
            [
                (~finite).to(solved.losses.dtype).reshape(1),
                solved.losses.sum().reshape(1),
                solved.losses.new_tensor(counts),
            ]
        )
        # In a step spread over processes, every process refuses if any one must.
        failed, loss, num_indices, num_blocks = self._all_reduce(summary).tolist()
        if failed:
            self._refuse(solved, update, bool(finite))
        old_consensus, old_duals = state.consensus, state.duals[update.block_ids]
        state.apply(update)
        self.num_steps += 1
        self._block_visits += int(num_blocks)
        if not self._shares_steps:
            self._swing.add(self._consensus_params)
        if self._scales is None:  # else _update_scales writes, once the scales are set
            self._write_consensus()
        for indices, local in solved.parts:
            self._params.write_rows(indices, local)
        moves = solved.copies - old_consensus
        # f_b at lambda_0 to first order (mu_b = -grad f_b(lambda_b) at an exact solve).
        self._guard.add(solved.losses + (update.duals * moves).sum(1), moves.norm(dim=1))
        self.diagnostics = {
            "step": self.num_steps,
            "blocks": solved.block_ids,
            "block_loss": solved.losses,
            "consensus_residual": moves.norm(dim=1),
            "dual_change": (update.duals - old_duals).norm(dim=1),
            "step_sizes": self.step_sizes,
            "curvatures": self.curvatures,
            "global_update": state.global_update,
            "damping": self._guard.damping,
            "step_decay": self._step_sizes.decay,
            "hessian_products": HESSIAN_PRODUCTS[self._second_order],
            "graph_replay": None if self._objective.graphs is None else self._objective.graphs.stats,
        }
        return loss * (self.partition.num_data / num_indices)

    def _refuse(self, solved: StepSolution, update: ConsensusUpdate, finite_here: bool) -> None:
        """Raise :class:`NonFiniteStepError` naming the block and quantity (nothing applied yet)."""
        if finite_here:
            raise NonFiniteStepError(
                f"PDVI step {self.num_steps + 1}: a block of another process produced a non-finite "
                "value; the step was refused in every process and no param, dual or copy changed."
            )
        rows = [
            {k: v[i] for k, v in part.items()} for indices, part in solved.parts for i in range(len(indices))
        ]
        b, culprit = find_non_finite(solved.block_ids, solved.losses, rows, update, self.layout)
        if self.eta == "auto":
            smaller = f"eta=AutoStepSize(scale={self.auto_step_size.scale / 2:g}), half the scale in use"
        else:
            smaller = f"eta={float(self.eta) / 2:g}, half the eta in use"
        raise NonFiniteStepError(
            f"PDVI step {self.num_steps + 1}: block {b} produced a non-finite {culprit}; the step "
            "was refused and no param, dual or copy changed. Check the model on this block; if "
            f"it is fine there, the step sizes {self.step_sizes} are too large for this model "
            f"here: restart with smaller ones ({smaller})."
        )

    # ---------------------------------------------------------------- epochs

    def run(
        self,
        num_epochs: int,
        *args: Any,
        order: str = "shuffle",
        progress_bar: bool = True,
        callback: Callable[[int, float], bool | None] | None = None,
        subsample_arg: str | None = None,
        check_convergence: bool = True,
        **kwargs: Any,
    ) -> RunResult:
        """Run ``num_epochs`` epochs, each one step per block (as NumPyro's ``SVI.run`` runs steps).

        Every step solves one block. By default PDVI makes the data plate subsample that
        block itself, so model and guide are called with ``*args, **kwargs`` as given (pass
        the full data; they must index it with the plate's indices); with
        ``subsample_arg="idx"`` the block's indices are passed as the keyword ``idx`` instead.

        :param num_epochs: passes over the blocks.
        :param args: positional arguments of model and guide.
        :param order: ``"shuffle"`` (a new random order of the blocks each epoch, drawn
            from PDVI's own generator, so it is saved in :meth:`state_dict`) or ``"cyclic"``.
        :param progress_bar: show a tqdm bar with the epoch's loss.
        :param callback: called after every epoch as ``callback(epoch, loss)``; if it
            returns ``True`` the run stops there.
        :param subsample_arg: the keyword argument that takes the step's block indices.
        :param check_convergence: record the full gradient norm ``||grad_lambda f||`` (after
            every epoch when that costs at most a quarter of an epoch, else after the first,
            middle and last) and warn at the end if the run has stalled away from the optimum
            (:mod:`~pyro_pdvi.infer.convergence`). Each measurement costs about one SVI epoch.
        :param kwargs: keyword arguments of model and guide.
        :returns: the per-epoch losses and gradient norms.
        :rtype: RunResult
        """
        return run_epochs(
            self, num_epochs, args, kwargs, order, progress_bar, callback, subsample_arg, check_convergence
        )

    def _epoch_blocks(self) -> list[int]:
        """The blocks this process steps on in an epoch."""
        return list(range(len(self.partition)))

    def _with_block(self, kwargs: dict, block: int, subsample_arg: str | None) -> dict:
        if subsample_arg is None:
            return kwargs
        device = self.device if self._state is not None else "cpu"
        return {**kwargs, subsample_arg: self.partition.block(block, device)}

    # ------------------------------------------------------------ inspection

    @property
    def step_sizes(self) -> dict[str, float]:
        """The step size ``eta_j`` of each preconditioner group (empty before the first step)."""
        return {} if self._state is None else self._step_sizes.as_dict()

    @property
    def curvatures(self) -> dict[str, float]:
        """The largest curvature ``L_j`` measured so far for each ``"auto"`` group."""
        return {} if self._state is None else self._step_sizes.curvatures_as_dict()

    @property
    def solve_loss(self) -> SolveLoss | None:
        """The loss of the primal solves (:mod:`~pyro_pdvi.infer.particles`): its ELBO, whether
        its particles are antithetic pairs, whether PDVI built it (``None`` before the first step)."""
        return None if self._state is None else self._solve_loss

    @property
    def concentrated_sites(self) -> dict[str, int]:
        """The global sites with coordinates that about one block informs (at most
        :data:`~pyro_pdvi.infer.consensus.CONCENTRATED_BLOCKS` blocks by the effective number of
        informing blocks, known once every block has had a step; a group's random effect with one
        block per group) and that the solves move, and how many each has. Empty before every
        block was measured, or with no such coordinate. A scale set by its fixed point
        (:mod:`~pyro_pdvi.infer.scales`) is not listed: no solve moves it, and the blocks measure
        its curvature at the scales of their first visits (the first epoch's, then the fixed
        point's), which can make one block look like its only source."""
        if self._state is None:
            return {}
        concentrated = self._not_held(self._state.concentrated)
        counts = {name: int(concentrated[span].sum()) for name, span in self.layout.slices.items()}
        return {name: count for name, count in counts.items() if count}

    @property
    def coupled_sites(self) -> dict[str, list[str]]:
        """For each global site with coordinates that the preconditioner couples with
        concentrated ones (:mod:`~pyro_pdvi.infer.coupling`: an intercept with its groups'
        effects), the sites of those concentrated coordinates. Empty before they are found, or
        where none is coupled."""
        if not isinstance(self._coupling, Coupling):
            return {}
        pairs: dict[str, set[str]] = {}
        for j, s in zip(self._coupling.rows.tolist(), self._coupling.cols.tolist()):
            pairs.setdefault(self.layout.site_of(s), set()).add(self.layout.site_of(j))
        return {name: sorted(sites) for name, sites in sorted(pairs.items())}

    @property
    def whitened_sites(self) -> list[str]:
        """The global sites that have a dense penalty (:mod:`~pyro_pdvi.infer.whitening`; sites
        whitened as one group, :func:`~pyro_pdvi.infer.whitening.joint_group`, each named): empty
        before every block is measured, or where none is whitened."""
        if not isinstance(self._coupling, SiteWhitening):
            return []
        sites = (self.layout.site_of(int(j)) for index in self._coupling.coordinates for j in index)
        return list(dict.fromkeys(sites))

    @property
    def round_sites(self) -> dict[str, float]:
        """The global sites that a diagonal penalty leaves round and that take a stiffer natural
        constant than the run's (:meth:`~pyro_pdvi.infer.upkeep.StepSizeUpkeep._set_round_sites_scale`),
        with that constant: empty before the first blocks are measured, or where none does."""
        scales = None if self._state is None else self._step_sizes.site_scales
        if scales is None:
            return {}
        changed = (scales != self.auto_step_size.scale).nonzero().reshape(-1).tolist()
        return {self.layout.site_of(j): float(scales[j]) for j in changed}

    @property
    def state(self) -> ConsensusState | None:
        """Duals, block copies and consensus (``None`` before the first step); once coordinates
        are coupled (:attr:`coupled_sites`) or sites whitened (:attr:`whitened_sites`), in those
        coordinates ``lambda~ = T lambda``."""
        return self._state

    def evaluate_loss(self, *args: Any, **kwargs: Any) -> float:
        """Estimate of the loss at the current params (the consensus), as ``SVI.evaluate_loss``.

        :rtype: float
        """
        with torch.no_grad():
            if isinstance(self.loss, ELBO):
                return float(self.loss.loss(self.model, self.guide, *args, **kwargs))
            return float(loss_function(self.loss)(self.model, self.guide, *args, **kwargs))

    def global_gradient_norm(self, *args: Any, **kwargs: Any) -> float:
        """``||grad_lambda f(phi, lambda_0)||`` over all blocks: the paper's Fig. 4 metric.

        Evaluates every block's ``f_b`` at the consensus and its current local rows (one
        Monte Carlo draw each, from torch's generator, so PDVI's own draws are untouched),
        and sums the gradients.

        :rtype: float
        """
        if self._state is None:
            raise RuntimeError("call step() at least once before global_gradient_norm()")
        return float(self._gradient_sum(self._epoch_blocks(), args, kwargs).norm())

    def solve_noise(self, *args: Any, num_blocks: int = 8, **kwargs: Any) -> dict[str, float | None]:
        """The Monte Carlo noise that the block solves leave in ``lambda_0``, in posterior standard
        deviations, per global site (rms over its coordinates;
        :func:`~pyro_pdvi.infer.particles.consensus_noise`): whether the solves' particles
        (:attr:`solve_loss`) are enough. Measured at ``lambda_0`` and the current rows on
        ``num_blocks`` blocks spread over the partition: each block's gradient over
        :data:`~pyro_pdvi.infer.particles.NOISE_DRAWS` noise draws and its diagonal curvature
        (:func:`~pyro_pdvi.infer.step_sizes.diagonal_curvature`). Take it after an epoch or two:
        at the initial params an antithetic pair can integrate a gradient exactly (a logistic
        regression's at zero means) and the noise measures near zero (``docs/benchmarks.md`` 13x).
        Its draws come from seeds of their own, so the run's steps are as without it. Below 0.05
        the noise costs less than 1.3e-3 nats of ELBO a coordinate (``0.5 * noise^2``); for a scale
        set by its fixed point (:mod:`~pyro_pdvi.infer.scales`) the scale is off by about
        ``noise / sqrt(2)`` of itself. Measured on the generic suite in ``docs/benchmarks.md`` 13y.
        A solve without Monte Carlo (a model's closed-form solver, a guide without Monte Carlo
        sites) leaves none, whatever this measures of the loss.

        :param args: positional arguments of model and guide, as in a step (each block measured
            takes its own indices as the data plate's subsample, whatever ``args`` hold).
        :param num_blocks: how many blocks are measured (each costs about
            ``NOISE_DRAWS + 1`` evaluations of its block and a few backward passes).
        :param kwargs: keyword arguments of model and guide.
        :returns: ``{site: noise}``; ``None`` for a site without a positive measured curvature.
        :raises RuntimeError: before the first step.
        """
        if self._state is None:
            raise RuntimeError("call step() at least once before solve_noise()")
        check_positive_int(num_blocks, "num_blocks")
        count = min(num_blocks, len(self.partition))
        blocks = torch.linspace(0, len(self.partition) - 1, count).round().long().unique().tolist()
        variance = torch.zeros_like(self._state.consensus)
        curvature = torch.zeros_like(self._state.consensus)
        # Signatures first seen here need not recur: not recorded.
        with self._objective.one_off():
            for b in blocks:
                block_variance, block_curvature = self._gradient_noise_and_curvature(b, args, kwargs)
                variance += block_variance
                curvature += block_curvature
        return {
            name: consensus_noise(variance[span], curvature[span])
            for name, span in self.layout.slices.items()
        }

    def _gradient_noise_and_curvature(
        self, b: int, args: tuple, kwargs: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``b``'s gradient in the globals at ``lambda_0`` and its rows: its variance across
        :data:`~pyro_pdvi.infer.particles.NOISE_DRAWS` noise draws of the solves' loss, and its
        diagonal curvature, each ``(P,)`` in the params' coordinates."""
        seed = self._side_seed(-4 - b)
        gradients = [self._block_gradient(b, seed + draw, args, kwargs) for draw in range(NOISE_DRAWS)]
        products = self._block_hessian_products(b, args, kwargs, seed)
        point = self._consensus_params.detach()
        curvature = diagonal_curvature(products, point, self.auto_step_size.curvature_probes)
        return torch.stack(gradients).var(0), curvature

    def _block_gradient(self, b: int, seed: int, args: tuple, kwargs: dict) -> torch.Tensor:
        """``grad_lambda f_b(phi_b, lambda_0)`` of block ``b`` at the noise of ``seed``, ``(P,)`` in
        the params' coordinates."""
        indices = self.partition.stacked(torch.tensor([b]), self.device)
        point = self._consensus_params.detach().requires_grad_()
        copies = {k: v.unsqueeze(0) for k, v in self.layout.unflatten(point).items()}
        f = self._objective.bind(indices, [seed], args, kwargs)(copies, self._params.rows(indices))
        return torch.autograd.grad(f.sum(), point)[0]

    def _gradient_sum(
        self, blocks: list[int], args: tuple, kwargs: dict, subsample_arg: str | None = None
    ) -> torch.Tensor:
        """``sum_b grad_lambda f_b(phi_b, lambda_0)`` over ``blocks``."""
        total = torch.zeros_like(self._state.consensus)
        for b in blocks:
            seed = int(torch.randint(0, 2**62, ()))
            total += self._block_gradient(b, seed, args, self._with_block(kwargs, b, subsample_arg))
        return total

    # ----------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Everything PDVI owns: duals, copies, consensus, step sizes, step count and its
        noise generator. Params live in Pyro's param store; save it alongside
        (``pyro.get_param_store().get_state()``)."""
        if self._state is None:
            return {"num_steps": self.num_steps}
        return {
            "num_steps": self.num_steps,
            "block_visits": self._block_visits,
            "num_data": self.partition.num_data,
            "global_sites": self.layout.names,
            "step_sizes": self._step_sizes.state_dict(),
            "consensus_state": self._state.state_dict(),
            "rng_state": self._rng.get_state(),
            "bounded_blocks": sorted(self._measured_blocks),
            "guard": self._guard.state_dict(),
            "swing": self._swing.state_dict(),
            "stationarity": self._stationarity.state_dict(),
            "scales": None if self._scales is None else self._scales.state_dict(),
            "coupling": self._coupling.state_dict() if isinstance(self._coupling, Coupling) else None,
            "whitening": self._coupling.state_dict() if isinstance(self._coupling, SiteWhitening) else None,
            "whitening_tried": self._whitening_tried,
            "saddle_escape": self._saddle.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`. Before the first step the state waits until the
        first step has found the sites, then is checked and applied."""
        self.num_steps = state["num_steps"]
        self._block_visits = state.get("block_visits", 0)
        if "consensus_state" not in state:
            return
        if self._state is None:
            self._pending_state = state
            return
        if state["num_data"] != self.partition.num_data or state["global_sites"] != self.layout.names:
            raise ValueError(
                f"saved PDVI state is for global sites {state['global_sites']} over "
                f"{state['num_data']} data, but this PDVI has {self.layout.names} over "
                f"{self.partition.num_data}"
            )
        self._step_sizes.load_state_dict(state["step_sizes"])
        self._measured_blocks = set(state["bounded_blocks"])
        self._guard.load_state_dict(state["guard"])
        if "swing" in state:  # absent from checkpoints before the swing meter: it counts from here
            self._swing.load_state_dict(state["swing"])
        if "stationarity" in state:  # absent from checkpoints before the stationarity test
            self._stationarity.load_state_dict(state["stationarity"])
        self._state.load_state_dict(state["consensus_state"])
        coupling, whitening = state.get("coupling"), state.get("whitening")  # absent from older ones
        if coupling is not None:
            self._coupling = Coupling.from_state_dict(coupling).to(self._state.consensus)
        elif whitening is not None:
            self._coupling = SiteWhitening.from_state_dict(whitening).to(self._state.consensus)
        else:
            self._coupling = None
        # A checkpoint from before the whitening, past the first epoch, is not whitened later.
        every_block_measured = len(self._measured_blocks) == len(self.partition)
        self._whitening_tried = state.get("whitening_tried", every_block_measured)
        self._rng.set_state(state["rng_state"])
        if "saddle_escape" in state:  # absent from checkpoints before the escape: it starts afresh
            self._saddle.load_state_dict(state["saddle_escape"], self.device)
        # Absent from checkpoints before the scales' fixed point: it then starts afresh.
        if "scales" in state:
            if (state["scales"] is None) != (self._scales is None):
                raise ValueError(
                    "saved PDVI state and this PDVI disagree on scale_update: one sets scales by their "
                    "fixed point, the other does not; build it with the same guide and scale_update"
                )
            if self._scales is not None:
                self._scales.load_state_dict(state["scales"])
        self._find_owners_of_concentrated()
