"""PDVI: preconditioned primal-dual variational inference as a drop-in for SVI.

PD-VI [1] keeps, for each fixed data block ``b``, a copy ``lambda_b`` of the
global variational parameters and a dual ``mu_b``. A step over the blocks
``S`` of its subsample

1. solves each block's augmented Lagrangian (primal step) for ``(phi_b, lambda_b)``,
2. moves each dual, ``mu_b += D (lambda_b - lambda_0)``,
3. moves the consensus ``lambda_0``, which is what the param store then holds.

P2D-VI is the same with ``D = blkdiag(I/eta_j)`` over groups of sites. The
update equations are written out in ``shared/docs/algorithm.md`` and in the
modules :mod:`~pyro_pdvi.infer.primal` and :mod:`~pyro_pdvi.infer.consensus`.

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer import ELBO
from pyro.optim import PyroOptim
from pyro.poutine.runtime import NonlocalExit

from ..checks import check_positive_int
from ..errors import NonFiniteStepError
from .antithetic import antithetic_loss, check_antithetic_loss, has_particle_pairs
from .blocks import BlockPartition
from .consensus import GLOBAL_UPDATES, ConsensusState, ConsensusUpdate
from .handlers import FixedNoise, is_subsample_site
from .objective import BlockObjective
from .preconditioner import (
    Group,
    check_eta,
    coordinate_groups,
    estimate_curvatures,
    resolve_groups,
)
from .primal import (
    INNER_SOLVERS,
    BlockBatch,
    BlockBatchSolution,
    BlockProblem,
    BlockSolution,
    LocalSolver,
    minimize,
)
from .sites import DataPlate, GlobalLayout, find_data_plate, split_param_sites
from .vectorized import BatchedBlockObjective, VectorizedBlockSolver


def _check_epochs(epochs: Sequence[float], name: str) -> tuple[float, ...]:
    """A sequence of positive finite numbers, returned sorted."""
    if isinstance(epochs, (str, bytes)) or not isinstance(epochs, Sequence):
        raise ValueError(
            f"Invalid {name}: {epochs!r}; use a sequence of positive numbers of epochs, e.g. (1,)"
        )
    for value in epochs:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(
                f"Invalid {name}: {epochs!r}; every entry must be a positive finite number of epochs"
            )
    return tuple(sorted(float(value) for value in epochs))


class StepSolution(NamedTuple):
    """The primal solutions of one step's blocks, before the dual and global update.

    :param block_ids: the step's blocks, shape ``(m,)``.
    :param copies: their new ``lambda_b``, flat, shape ``(m, P)``.
    :param losses: ``f_b`` at the solutions, shape ``(m,)``.
    :param indices: the blocks' data indices, concatenated in block order.
    :param local: each local site's new rows for ``indices``, concatenated along the
        site's plate axis.
    """

    block_ids: torch.Tensor
    copies: torch.Tensor
    losses: torch.Tensor
    indices: torch.Tensor
    local: dict[str, torch.Tensor]


class PDVI:
    """Primal-dual mean-field VI over fixed data blocks, with the interface of
    :class:`pyro.infer.SVI`.

    Replace ``SVI(model, guide, optim, loss)`` by ``PDVI(model, guide, optim,
    loss, blocks=blocks)`` and pass one block's indices (or a union of whole
    blocks) as the subsample of the data plate in each step::

        pdvi = PDVI(model, guide, pyro.optim.Adam({"lr": 0.01}),
                    TraceMeanField_ELBO(), blocks=blocks)
        for epoch in range(num_epochs):
            for b in torch.randperm(len(blocks)).tolist():
                loss = pdvi.step(data, blocks[b])

    The model and guide must wrap their per-datum sites in a ``pyro.plate`` of
    size ``N`` with ``subsample=`` and index the data with the plate's indices.
    Params created inside that plate with ``event_dim`` set are local (their
    rows are the block's ``phi_b``); all others are global. After each step the
    param store holds the consensus ``lambda_0`` and the latest local rows.

    :param model: the Pyro model.
    :param guide: the Pyro guide (hand-written, or an autoguide such as
        ``AutoNormal``/``AutoDelta`` built with ``create_plates``).
    :param optim: a :class:`pyro.optim.PyroOptim`; it drives the primal solve
        when ``inner_solver="optim"``.
    :param loss: a Pyro ELBO with ``differentiable_loss`` (``Trace_ELBO``,
        ``TraceMeanField_ELBO``, ``TraceEnum_ELBO``, ...) or a callable
        ``loss(model, guide, *args, **kwargs)`` returning a differentiable scalar.
    :param blocks: 1-D LongTensors that partition ``range(N)``: the fixed blocks.
    :param eta: step size of the default group: a positive float, or
        ``"auto"`` for ``eta_scale / L`` with ``L`` the measured curvature of
        the block objective in that group's params [1, Thm. 4.7]: the largest
        ``|eigenvalue|`` of the reduced objective's Hessian block (power iteration, see
        :func:`~pyro_pdvi.infer.preconditioner.estimate_curvatures`), max over
        ``curvature_blocks`` blocks (and over the measurements of ``remeasure_epochs``).
    :param groups: preconditioner groups (P2D-VI): ``None`` for one group
        (PD-VI), ``"per_site"`` for one group per global site, or a list of
        dicts like torch.optim param groups keyed by site names; see
        :mod:`~pyro_pdvi.infer.preconditioner`.
    :param eta_scale: the constant in ``eta_j = eta_scale / L_j``. The default 2 is a
        compromise measured in ``docs/benchmarks.md``: of 1, 2 and 4 it was best on the
        AutoDelta MAP test and for PD-VI on the quadratic, 1 was best for P2D-VI on the
        quadratic and 4 for the consensus rule on the GMM.
    :param global_update: how ``lambda_0`` moves (same fixed point for all; see
        :mod:`~pyro_pdvi.infer.consensus`): ``"paper"`` (``gamma`` = mean of this step's
        copies, as in [1]), ``"consensus"`` (mean of every block's latest copy, the exact
        minimiser of the augmented Lagrangian in ``lambda_0``), or ``"auto"`` (default):
        the paper's rule when the block solve is deterministic (a ``local_solver``, or a
        guide with no Monte Carlo site: Delta or enumerated sites only), else the
        paper's rule for the first ``warmup_epochs`` epochs of block visits and the
        consensus rule after. With one block per step the paper's rule moves
        ``lambda_0`` about n times further per epoch, but hands each solve's Monte Carlo
        noise to ``lambda_0`` in full; the consensus rule averages it over the blocks
        (measured in ``docs/benchmarks.md``).
    :param warmup_epochs: epochs (block visits / n) of the paper's rule before
        ``"auto"`` switches to the consensus rule for a Monte Carlo solve.
    :param inner_solver: ``"lbfgs"`` (default) or ``"optim"``.
    :param inner_steps: iterations of the primal solve (with ``vectorize_blocks`` and
        L-BFGS, each block's evaluations, rejected trial steps included: see
        :func:`~pyro_pdvi.infer.lbfgs.batched_lbfgs`).
    :param local_solver: optional callable :class:`BlockProblem` ->
        :class:`BlockSolution` that replaces the generic primal solve, e.g. a
        model's closed-form coordinate descent.
    :param plate_name: name of the data plate, if several plates have size N.
    :param curvature_blocks: how many blocks ``eta="auto"`` measures (the max is used).
    :param curvature_iterations: power iterations per group and block.
    :param vectorize_blocks: solve a step's blocks, when there are several of equal size,
        in one pass of ``torch.func.vmap`` over stacked block copies instead of a loop (the
        generic path only; see :mod:`~pyro_pdvi.infer.vectorized`). Each block then draws
        its own Monte Carlo noise from the step's one seed. A model that ``vmap`` cannot
        map raises :class:`~pyro_pdvi.infer.vectorized.VectorizationError` on the first
        such step.
    :param antithetic: draw every Gaussian guide site's noise in antithetic pairs over the
        ELBO's vectorized particles (:mod:`~pyro_pdvi.infer.antithetic`; needs
        ``vectorize_particles=True`` and an even ``num_particles``). A fixed-noise block
        solve then has no term linear in the noise, a term that otherwise moves the
        solved means and scales with the noise's sample mean. ``"auto"`` (default): on
        when the loss is such an ELBO, else off. Measured on the hierarchical model of
        docs/benchmarks.md, section 2 (sorted blocks, 8 particles): error of E_q[mu]
        0.0553 -> 0.0003, of sd_q[mu] 53% -> 4%; on the GMM of section 1 no change.
    :param remeasure_epochs: epochs (block visits / n) after which every ``"auto"`` group
        measures its curvature again, at the current ``lambda_0`` and local rows, and takes
        ``eta_j = eta_scale / L_j`` with ``L_j`` the largest curvature measured so far
        (set-up included): each measurement is a lower bound of the Lipschitz constant
        that [1, Thm. 4.7] asks for, so a step size only ever shrinks. The reduced
        curvature can grow during a run (on a GMM it rises as the responsibilities
        harden; measured in ``docs/benchmarks.md``). The duals are kept (after an exact
        solve ``mu_b = -grad f_b``, whatever ``eta``) and ``lambda_0`` moves with
        ``h = H mean(mu)`` (written to the param store), so the fixed point is unchanged.
        Each measurement costs what the set-up's does (on the 1b GMM, about 9 epochs of
        closed-form steps). Default ``()``: measure at set-up only. ``(1, 2)`` fixed a
        step 2x too large on well-separated GMM clusters and changed nothing on the other
        benchmarks but the time (``docs/benchmarks.md``, section 9).
        :class:`~pyro_pdvi.distributed.DistributedPDVI` does not support it.
    """

    def __init__(
        self,
        model: Callable,
        guide: Callable,
        optim: PyroOptim,
        loss: ELBO | Callable[..., torch.Tensor],
        *,
        blocks: Sequence[torch.Tensor],
        eta: float | str = "auto",
        groups: list[dict] | str | None = None,
        eta_scale: float = 2.0,
        global_update: str = "auto",
        warmup_epochs: float = 5.0,
        inner_solver: str = "lbfgs",
        inner_steps: int = 20,
        local_solver: LocalSolver | None = None,
        plate_name: str | None = None,
        curvature_blocks: int = 4,
        curvature_iterations: int = 6,
        vectorize_blocks: bool = False,
        antithetic: bool | str = "auto",
        remeasure_epochs: Sequence[float] = (),
    ) -> None:
        if not isinstance(optim, PyroOptim):
            raise ValueError(
                f"optim must be a pyro.optim.PyroOptim such as pyro.optim.Adam({{'lr': 0.01}}), "
                f"got {type(optim).__name__}"
            )
        if isinstance(loss, ELBO) or hasattr(loss, "differentiable_loss"):
            loss_fn = getattr(loss, "differentiable_loss", None)
            if loss_fn is None:
                raise ValueError(
                    f"{type(loss).__name__} has no differentiable_loss, which PDVI needs for "
                    "its primal solve; use Trace_ELBO, TraceMeanField_ELBO or TraceEnum_ELBO"
                )
        elif callable(loss):
            loss_fn = loss
        else:
            raise ValueError(f"loss must be a Pyro ELBO or a callable, got {type(loss).__name__}")
        if global_update not in ("auto", *GLOBAL_UPDATES):
            raise ValueError(
                f"Invalid global_update: {global_update!r}; use 'auto' or one of {GLOBAL_UPDATES}"
            )
        if isinstance(warmup_epochs, bool) or not (
            isinstance(warmup_epochs, (int, float)) and warmup_epochs >= 0
        ):
            raise ValueError(f"Invalid warmup_epochs: {warmup_epochs!r}; use a non-negative number")
        if inner_solver not in INNER_SOLVERS:
            raise ValueError(f"Invalid inner_solver: {inner_solver!r}; use one of {INNER_SOLVERS}")
        if not (isinstance(eta_scale, (int, float)) and eta_scale > 0):
            raise ValueError(f"Invalid eta_scale: {eta_scale!r}; use a positive float")
        if local_solver is not None and not callable(local_solver):
            raise ValueError("local_solver must be a callable BlockProblem -> BlockSolution")
        check_eta(eta, "eta")
        if antithetic == "auto":
            antithetic = has_particle_pairs(loss)
        elif not isinstance(antithetic, bool):
            raise ValueError(f'Invalid antithetic: {antithetic!r}; use True, False or "auto"')
        elif antithetic:
            check_antithetic_loss(loss)
            loss_fn = antithetic_loss(loss_fn)
        if not isinstance(vectorize_blocks, bool):
            raise ValueError(f"Invalid vectorize_blocks: {vectorize_blocks!r}; use True or False")
        if vectorize_blocks and local_solver is not None:
            raise ValueError(
                "vectorize_blocks=True vectorizes the generic primal solve, but a local_solver "
                "replaces it; give the local solver a solve_batch method to batch its blocks"
            )

        self.model = model
        self.guide = guide
        self.optim = optim
        self.loss = loss
        self.partition = BlockPartition(blocks)
        self.eta = eta
        self.groups = groups
        self.eta_scale = float(eta_scale)
        self.global_update = global_update
        self.warmup_epochs = float(warmup_epochs)
        self._block_visits = 0
        self.inner_solver = inner_solver
        self.inner_steps = check_positive_int(inner_steps, "inner_steps")
        self.local_solver = local_solver
        self.plate_name = plate_name
        self.curvature_blocks = check_positive_int(curvature_blocks, "curvature_blocks")
        self.curvature_iterations = check_positive_int(curvature_iterations, "curvature_iterations")
        self.vectorize_blocks = vectorize_blocks
        self.antithetic = antithetic
        self.remeasure_epochs = _check_epochs(remeasure_epochs, "remeasure_epochs")
        self._remeasured = 0
        self._curvatures: torch.Tensor | None = None
        self.num_steps = 0
        self.diagnostics: dict[str, Any] = {}
        self._loss_fn = loss_fn
        self._state: ConsensusState | None = None
        self._pending_state: dict | None = None
        # PDVI's own randomness (noise seeds, curvature probes) comes from this generator,
        # seeded from torch's at the first step: it does not depend on how much the traces
        # draw, so a run split over processes draws the same seeds (pyro_pdvi.distributed).
        self._rng: torch.Generator | None = None

    # ------------------------------------------------------------------ setup

    def _trace(self, args: tuple, kwargs: dict) -> list:
        """Guide and model traces of one call (creates params on first use)."""
        with torch.no_grad(), poutine.block():
            guide_trace = poutine.trace(self.guide).get_trace(*args, **kwargs)
            model_trace = poutine.trace(poutine.replay(self.model, trace=guide_trace)).get_trace(
                *args, **kwargs
            )
        return [guide_trace, model_trace]

    def _setup(self, traces: list, args: tuple, kwargs: dict) -> None:
        store = pyro.get_param_store()
        unconstrained = dict(store.named_parameters())
        site_constraints = store.get_state()["constraints"]
        self.plate: DataPlate = find_data_plate(traces, self.partition.num_data, self.plate_name)
        self._plate_in_guide = self.plate.name in traces[0].nodes
        self._noisy_solve = self.local_solver is None and bool(self._sampled_sites(traces[0]))
        global_sites, self.local_sites = split_param_sites(
            traces, self.plate, site_constraints, unconstrained
        )
        if not global_sites:
            raise ValueError(
                "the model and guide have no global params (params outside the data plate); "
                "PD-VI has nothing to couple across blocks. Use pyro.infer.SVI."
            )
        self._warn_single_particle(traces[0])
        self.layout = GlobalLayout(global_sites)
        self.group_list: list[Group] = resolve_groups(self.groups, self.layout.names, self.eta)
        self._group_of = coordinate_groups(self.group_list, self.layout)
        first = unconstrained[global_sites[0].name]
        self.device = first.device
        consensus = self.layout.flatten({s.name: unconstrained[s.name].detach() for s in global_sites})
        self._objective = BlockObjective(
            self.model, self.guide, self._loss_fn, self.plate, self.layout, self.local_sites
        )
        if self.vectorize_blocks:
            self._vectorized_solver = VectorizedBlockSolver(
                BatchedBlockObjective(
                    self.model, self.guide, self._loss_fn, self.plate, self.layout, self.local_sites
                ),
                self.inner_solver,
                self.inner_steps,
                self.optim,
            )
        self._state = ConsensusState(
            consensus, len(self.partition), torch.ones_like(consensus), self._rule_for_step()
        )
        # One evaluation before any solve: an ELBO's lazy set-up (Pyro guesses
        # max_plate_nesting by tracing, which draws) must not shift the fixed noise of
        # the first solve, nor differ between a fresh and a resumed run.
        self._block_loss(
            0,
            0,
            self.layout.unflatten(consensus),
            self._block_rows(self.partition.block(0, self.device)),
            args,
            kwargs,
        )
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)
            return
        etas = [group.eta for group in self.group_list]
        if "auto" in etas:
            curvatures = self._estimate_curvatures(args, kwargs).tolist()
            for group, eta, curvature in zip(self.group_list, etas, curvatures):
                if eta == "auto" and not 0 < curvature < float("inf"):
                    raise ValueError(
                        f"eta='auto' measured a curvature of {curvature} for group {group.name!r} "
                        f"(sites {group.sites}): the block objective does not change with them. Give "
                        "that group a fixed eta, or check that the sites are used by the model."
                    )
            etas = [self.eta_scale / c if eta == "auto" else eta for eta, c in zip(etas, curvatures)]
            self._curvatures = torch.tensor(curvatures, dtype=consensus.dtype)
        self._set_group_step_sizes(torch.tensor(etas, dtype=consensus.dtype))

    @staticmethod
    def _sampled_sites(guide_trace) -> list[str]:
        """Guide sites that the loss estimates by Monte Carlo (not Delta, not enumerated)."""
        return [
            name
            for name, site in guide_trace.nodes.items()
            if site["type"] == "sample"
            and not is_subsample_site(site)
            and not isinstance(site["fn"], dist.Delta)
            and site["infer"].get("enumerate") is None
        ]

    def _warn_single_particle(self, guide_trace) -> None:
        """One fixed Monte Carlo draw makes the primal solve minimise a sample-average
        surrogate that a location-scale guide can drive to a degenerate optimum."""
        if self.local_solver is not None or getattr(self.loss, "num_particles", 2) > 1:
            return
        sampled = self._sampled_sites(guide_trace)
        if sampled:
            warnings.warn(
                f"PDVI holds the Monte Carlo noise fixed within each primal solve, and the loss "
                f"draws one particle for the sampled guide sites {sampled}: the solve then "
                "minimises a one-sample surrogate whose optimum can be far off (scales drift). "
                "Use e.g. TraceMeanField_ELBO(num_particles=16, vectorize_particles=True).",
                stacklevel=3,
            )

    def _set_group_step_sizes(self, group_step_sizes: torch.Tensor) -> None:
        self._group_step_sizes = group_step_sizes.detach().cpu().clone()
        per_coordinate = self._group_step_sizes.to(self.device)[self._group_of.to(self.device)]
        self._state.set_step_sizes(per_coordinate)

    def _estimate_curvatures(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """Max over a few blocks of each group's curvature ``L_j`` at ``lambda_0``.

        The curvature is that of the reduced block objective
        ``g_b(lambda) = min_phi f_b(phi, lambda)``, the function whose gradient the
        dual tracks (``mu_b = -grad g_b`` after an exact primal solve). Where the
        locals are strongly coupled to the globals it is much smaller than the
        ``lambda``-block of the Hessian of ``f_b`` (5x on the linear-Gaussian test),
        and a step size from the latter is needlessly small.
        """
        chosen = torch.randperm(len(self.partition), generator=self._rng)[: self.curvature_blocks].tolist()
        curvatures = [
            estimate_curvatures(
                self._reduced_gradient(b, args, kwargs),
                self._state.consensus,
                self._group_of,
                len(self.group_list),
                self.curvature_iterations,
                # phi*(lambda) is solved to ~1e-9 (float64): keep FD errors far below the step.
                relative_step=1e-3 if self.local_sites else None,
            )
            for b in chosen
        ]
        return torch.stack(curvatures).amax(0).cpu()

    def _reduced_gradient(self, b: int, args: tuple, kwargs: dict) -> Callable[[torch.Tensor], torch.Tensor]:
        """``lambda -> grad g_b(lambda)`` with ``g_b = min_phi f_b``, at fixed noise."""
        noise = FixedNoise(self._draw_seed(), self.device)
        indices = self.partition.block(b, self.device)
        warm = self._block_rows(indices)

        def solve_rows(point: torch.Tensor, iterations: int = 10) -> dict[str, torch.Tensor]:
            if self.local_solver is not None:
                return self._solver_rows(b, point, warm, args, kwargs)
            rows = {k: v.clone().requires_grad_() for k, v in warm.items()}
            values = self.layout.unflatten(point.detach())

            def block_loss() -> torch.Tensor:
                with noise():
                    return self._objective(indices, values, rows, self._local_params(), args, kwargs)

            minimize(block_loss, rows, "lbfgs", iterations)
            return {k: v.detach() for k, v in rows.items()}

        # Finite-difference probes around lambda_0 start from phi*(lambda_0), a short way off.
        warm = solve_rows(self._state.consensus, iterations=30)

        def gradient(point: torch.Tensor) -> torch.Tensor:
            return self._block_gradient(b, point, args, kwargs, noise, solve_rows(point))

        return gradient

    def _solver_rows(
        self, b: int, point: torch.Tensor, warm: dict[str, torch.Tensor], args: tuple, kwargs: dict
    ) -> dict[str, torch.Tensor]:
        """``phi_b*(lambda)`` from the local solver: as the step size vanishes, the
        augmented Lagrangian pins ``lambda_b`` to ``lambda`` and its minimiser in
        ``phi_b`` is ``argmin_phi f_b(phi, lambda)``. A closed-form solver gives it in a
        few sweeps, where the generic path needs an L-BFGS solve per probe."""
        consensus = self.layout.unflatten(point.detach())
        problem = BlockProblem(
            block=b,
            indices=self.partition.block(b, self.device),
            consensus=consensus,
            dual={k: torch.zeros_like(v) for k, v in consensus.items()},
            step_sizes={k: torch.full_like(v, 1e-12) for k, v in consensus.items()},
            local=warm,
            num_blocks=len(self.partition),
            num_data=self.partition.num_data,
            args=args,
            kwargs=kwargs,
        )
        return {k: v.detach() for k, v in self.local_solver(problem).local.items()}

    def _block_rows(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        """The block's current rows of each local site (detached)."""
        local_full = self._local_params()
        return {s.name: local_full[s.name].detach().index_select(s.axis, indices) for s in self.local_sites}

    def _block_gradient(
        self,
        b: int,
        point: torch.Tensor,
        args: tuple,
        kwargs: dict,
        noise: FixedNoise | None = None,
        rows: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``grad_lambda f_b(phi_b, lambda)`` at the flat global vector ``point``,
        with the given local rows (default: the block's current ones)."""
        indices = self.partition.block(b, self.device)
        rows = self._block_rows(indices) if rows is None else rows
        point = point.detach().requires_grad_()
        with noise() if noise is not None else contextlib.nullcontext():
            f = self._objective(
                indices, self.layout.unflatten(point), rows, self._local_params(), args, kwargs
            )
        return torch.autograd.grad(f, point)[0]

    # ------------------------------------------------------------- the step

    def _draw_seed(self) -> int:
        return int(torch.randint(0, 2**62, (), generator=self._rng))

    def _block_seeds(self, block_ids: torch.Tensor) -> list[int]:
        """One noise seed per block of the step, from one draw: block ``b``'s seed depends
        on the draw and on ``b`` only, not on which other blocks share the step."""
        base = self._draw_seed()
        return [(base + (b + 1) * 0x9E3779B97F4A7C15) % 2**63 for b in block_ids.tolist()]

    def _local_params(self) -> dict[str, torch.Tensor]:
        params = dict(pyro.get_param_store().named_parameters())
        return {s.name: params[s.name] for s in self.local_sites}

    def _step_subsample(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """The data plate's subsample in this call: the guide (or, if the plate is only in
        the model, the model) runs up to the plate and stops there, without sampling
        the rest (the whole trace cost more than the solve on large blocks)."""
        fn = self.guide if self._plate_in_guide else self.model

        def at_data_plate(msg: dict) -> bool:
            return msg["name"] == self.plate.name and is_subsample_site(msg)

        try:
            with torch.no_grad(), poutine.block():
                poutine.escape(fn, escape_fn=at_data_plate)(*args, **kwargs)
        except NonlocalExit as exit_:
            exit_.reset_stack()
            return exit_.site["value"]
        where = "guide" if self._plate_in_guide else "model"
        raise ValueError(
            f"this step's {where} never entered the data plate {self.plate.name!r}, so PDVI cannot "
            "tell which block it is; pass the block's indices as the plate's subsample"
        )

    def _block_problem(self, b: int, args: tuple, kwargs: dict) -> BlockProblem:
        state = self._state
        indices = self.partition.block(b, self.device)
        return BlockProblem(
            block=b,
            indices=indices,
            consensus=self.layout.unflatten(state.consensus),
            dual=self.layout.unflatten(state.duals[b]),
            step_sizes=self.layout.unflatten(state.step_sizes),
            local=self._block_rows(indices),
            num_blocks=len(self.partition),
            num_data=self.partition.num_data,
            args=args,
            kwargs=kwargs,
        )

    def _solve_block(self, b: int, seed: int, args: tuple, kwargs: dict) -> BlockSolution:
        """Primal step for block ``b`` [1, Alg. 2-3], with the Monte Carlo noise of ``seed``."""
        problem = self._block_problem(b, args, kwargs)
        noise = FixedNoise(seed, self.device)
        local_full = self._local_params()

        def block_loss(copies: dict[str, torch.Tensor], rows: dict[str, torch.Tensor]) -> torch.Tensor:
            with noise():
                return self._objective(problem.indices, copies, rows, local_full, args, kwargs)

        if self.local_solver is not None:
            solution = self.local_solver(problem)
        else:
            if self.inner_solver == "lbfgs":
                # Whitened globals, lambda_b = lambda_0 + sqrt(eta) * z: the penalty becomes
                # 1/2 ||z||^2 and the subproblem stays well conditioned whatever the eta_j are.
                root = {k: v.sqrt() for k, v in problem.step_sizes.items()}
                free = {k: torch.zeros_like(v, requires_grad=True) for k, v in problem.consensus.items()}

                def current_copies() -> dict[str, torch.Tensor]:
                    return {k: problem.consensus[k] + root[k] * z for k, z in free.items()}

            else:
                free = {k: v.detach().clone().requires_grad_() for k, v in problem.consensus.items()}

                def current_copies() -> dict[str, torch.Tensor]:
                    return free

            rows = {k: v.detach().clone().requires_grad_() for k, v in problem.local.items()}

            def augmented_lagrangian() -> torch.Tensor:
                copies = current_copies()
                return block_loss(copies, rows) + problem.penalty(copies)

            minimize(augmented_lagrangian, {**free, **rows}, self.inner_solver, self.inner_steps, self.optim)
            with torch.no_grad():
                copies = {k: v.detach() for k, v in current_copies().items()}
            solution = BlockSolution(copies, {k: v.detach() for k, v in rows.items()})
        if solution.loss is None:
            solution.loss = self._block_loss(b, seed, solution.globals, solution.local, args, kwargs)
        return solution

    def _block_loss(
        self,
        b: int,
        seed: int,
        copies: dict[str, torch.Tensor],
        rows: dict[str, torch.Tensor],
        args: tuple,
        kwargs: dict,
    ) -> torch.Tensor:
        """``f_b`` at a solution, with the noise of ``seed`` (detached)."""
        # TraceEnum_ELBO's differentiable_loss refuses a loss that nothing requires grad of.
        copies = {k: v.detach().requires_grad_() for k, v in copies.items()}
        indices = self.partition.block(b, self.device)
        with FixedNoise(seed, self.device)():
            loss = self._objective(indices, copies, rows, self._local_params(), args, kwargs)
        return loss.detach()

    def _block_batch(self, block_ids: torch.Tensor, args: tuple, kwargs: dict) -> BlockBatch:
        """The stacked subproblems of equal-size blocks (see :class:`BlockBatch`)."""
        state = self._state
        indices = self.partition.stacked(block_ids, self.device)
        flat = indices.reshape(-1)
        local_full = self._local_params()
        local = {
            s.name: local_full[s.name]
            .detach()
            .index_select(s.axis, flat)
            .unflatten(s.axis, indices.shape)
            .movedim(s.axis - 1, 0)
            for s in self.local_sites
        }
        return BlockBatch(
            blocks=block_ids,
            indices=indices,
            consensus=self.layout.unflatten(state.consensus),
            dual=self.layout.unflatten(state.duals[block_ids.to(state.duals.device)]),
            step_sizes=self.layout.unflatten(state.step_sizes),
            local=local,
            num_blocks=len(self.partition),
            num_data=self.partition.num_data,
            args=args,
            kwargs=kwargs,
        )

    def _can_batch(self, block_ids: torch.Tensor) -> bool:
        sizes = self.partition.sizes[block_ids]
        return (
            len(block_ids) > 1
            and (hasattr(self.local_solver, "solve_batch") or self.vectorize_blocks)
            and bool((sizes == sizes[0]).all())
        )

    def _solve_step(
        self, block_ids: torch.Tensor, seeds: list[int], args: tuple, kwargs: dict
    ) -> StepSolution:
        """Primal solutions of the step's blocks: one vectorized call where the local
        solver has ``solve_batch`` (or ``vectorize_blocks`` is set) and the blocks have
        equal sizes, else a loop."""
        if self._can_batch(block_ids):
            batch = self._block_batch(block_ids, args, kwargs)
            if self.vectorize_blocks:
                noise = FixedNoise(seeds[0], self.device)
                solution: BlockBatchSolution = self._vectorized_solver.solve_batch(batch, noise)
            else:
                solution = self.local_solver.solve_batch(batch)
            copies = self.layout.flatten(solution.globals, batch_dims=1)
            losses = solution.loss
            if losses is None:
                losses = torch.stack(
                    [
                        self._block_loss(
                            b,
                            seed,
                            {k: v[i] for k, v in solution.globals.items()},
                            {k: v[i] for k, v in solution.local.items()},
                            args,
                            kwargs,
                        )
                        for i, (b, seed) in enumerate(zip(block_ids.tolist(), seeds))
                    ]
                )
            local = {
                s.name: solution.local[s.name].movedim(0, s.axis - 1).flatten(s.axis - 1, s.axis)
                for s in self.local_sites
            }
            return StepSolution(
                block_ids, copies, losses.detach().reshape(-1), batch.indices.reshape(-1), local
            )
        solutions = [self._solve_block(b, seed, args, kwargs) for b, seed in zip(block_ids.tolist(), seeds)]
        return StepSolution(
            block_ids,
            torch.stack([self.layout.flatten(s.globals) for s in solutions]),
            torch.stack([s.loss.detach().reshape(()) for s in solutions]),
            torch.cat([self.partition.block(b, self.device) for b in block_ids.tolist()]),
            {
                site.name: torch.cat([s.local[site.name] for s in solutions], dim=site.axis)
                for site in self.local_sites
            },
        )

    def step(self, *args: Any, **kwargs: Any) -> float:
        """Take one PD-VI step on the block(s) whose indices the data plate subsamples.

        :returns: the loss of the step's subsample at the new block solutions,
            scaled to the full data as ``SVI.step``'s is.
        :rtype: float
        :raises NonFiniteStepError: if the loss or the update is not finite; then
            no param, dual or copy has changed.
        """
        if self._state is None:
            self._seed_generator()
            traces = self._trace(args, kwargs)
            self._setup(traces, args, kwargs)
        block_ids = self.partition.blocks_in(self._step_subsample(args, kwargs))
        solved = self._solve_step(block_ids, self._block_seeds(block_ids), args, kwargs)
        loss = self._commit(solved)
        self._remeasure_if_due(args, kwargs)
        return loss

    def _remeasure_if_due(self, args: tuple, kwargs: dict) -> None:
        """Re-measure the ``"auto"`` groups' curvatures once the run has passed the next of
        ``remeasure_epochs`` (one measurement however many it passed in this step), and
        take ``eta_j = eta_scale / max(L_j measured so far)``."""
        passed = sum(1 for e in self.remeasure_epochs if self._block_visits >= e * len(self.partition))
        if passed <= self._remeasured or self._curvatures is None:
            return
        self._remeasured = passed
        measured = self._estimate_curvatures(args, kwargs).to(self._curvatures)
        usable = torch.isfinite(measured) & (measured > 0)
        if not usable.all():
            bad = [g.name for g, ok in zip(self.group_list, usable.tolist()) if not ok]
            warnings.warn(
                f"PDVI step {self.num_steps}: re-measured curvature of groups {bad} is not a positive "
                "finite number; their step sizes are kept",
                stacklevel=3,
            )
        self._curvatures = torch.where(usable, torch.maximum(self._curvatures, measured), self._curvatures)
        auto = torch.tensor([g.eta == "auto" for g in self.group_list])
        etas = torch.where(auto, self.eta_scale / self._curvatures, self._group_step_sizes)
        self._set_group_step_sizes(etas)  # moves lambda_0 with h = H mean(mu)
        params = dict(pyro.get_param_store().named_parameters())
        with torch.no_grad():
            for name, value in self.layout.unflatten(self._state.consensus).items():
                params[name].copy_(value)
        self.diagnostics["step_sizes"] = self.step_sizes
        self.diagnostics["curvatures"] = self.curvatures

    def _seed_generator(self) -> None:
        if self._rng is None:
            self._rng = torch.Generator().manual_seed(int(torch.randint(0, 2**62, ())))

    def _rule_for_step(self) -> str:
        """The global-update rule of the coming step (see ``global_update``)."""
        if self.global_update != "auto":
            return self.global_update
        if not self._noisy_solve:
            return "paper"
        warm = self._block_visits < self.warmup_epochs * len(self.partition)
        return "paper" if warm else "consensus"

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the processes that share a step: the identity in one process
        (:class:`~pyro_pdvi.distributed.DistributedPDVI` overrides it)."""
        return tensor

    def _commit(self, solved: StepSolution) -> float:
        """Dual and global update from the step's primal solutions; write the param store.

        One synchronisation with the host (and, across processes, one all-reduce) reads
        the step's loss and whether anything is not finite together.

        :returns: the step's loss as :meth:`step` returns it.
        """
        all_reduce = None if type(self)._all_reduce is PDVI._all_reduce else self._all_reduce
        self._state.global_update = self._rule_for_step()
        update = self._state.propose(solved.block_ids, solved.copies, all_reduce)
        tensors = [solved.losses, update.copies, update.duals, update.consensus, *solved.local.values()]
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
        old_consensus = self._state.consensus
        old_duals = self._state.duals[update.block_ids]
        self._state.apply(update)
        self._write_param_store(solved)
        self.num_steps += 1
        self._block_visits += int(num_blocks)
        self.diagnostics = {
            "step": self.num_steps,
            "blocks": solved.block_ids,
            "block_loss": solved.losses,
            "consensus_residual": (solved.copies - old_consensus).norm(dim=1),
            "dual_change": (update.duals - old_duals).norm(dim=1),
            "step_sizes": self.step_sizes,
            "curvatures": self.curvatures,
            "global_update": self._state.global_update,
        }
        return loss * (self.partition.num_data / num_indices)

    def _refuse(self, solved: StepSolution, update: ConsensusUpdate, finite_here: bool) -> None:
        """Raise :class:`NonFiniteStepError` naming the block and quantity (nothing applied yet)."""
        if finite_here:
            raise NonFiniteStepError(
                f"PDVI step {self.num_steps + 1}: a block of another process produced a non-finite "
                "value; the step was refused in every process and no param, dual or copy changed."
            )
        b, culprit = self._find_non_finite(solved, update)
        raise NonFiniteStepError(
            f"PDVI step {self.num_steps + 1}: block {b} produced a non-finite {culprit}; the step "
            "was refused and no param, dual or copy changed. Check the model on this block, "
            "or lower eta / eta_scale."
        )

    def _find_non_finite(self, solved: StepSolution, update: ConsensusUpdate) -> tuple[int, str]:
        """The first block and quantity that is not finite (the slow path of a refused step)."""
        block_ids = solved.block_ids.tolist()
        sizes = self.partition.sizes[solved.block_ids].tolist()
        local_rows = {
            site.name: solved.local[site.name].split(sizes, dim=site.axis) for site in self.local_sites
        }
        for i, b in enumerate(block_ids):
            if not torch.isfinite(solved.losses[i]):
                return b, "loss f_b"
            values = {**self.layout.unflatten(solved.copies[i]), **{k: v[i] for k, v in local_rows.items()}}
            for name, value in values.items():
                if not torch.isfinite(value).all():
                    return b, f'value of site "{name}"'
        for b, dual in zip(block_ids, update.duals):
            if not torch.isfinite(dual).all():
                bad = int((~torch.isfinite(dual)).nonzero()[0])
                return b, f'dual of site "{self.layout.site_of(bad)}"'
        bad = int((~torch.isfinite(update.consensus)).nonzero()[0])
        return block_ids[0], f'consensus of site "{self.layout.site_of(bad)}"'

    def _write_param_store(self, solved: StepSolution) -> None:
        params = dict(pyro.get_param_store().named_parameters())
        with torch.no_grad():
            for name, value in self.layout.unflatten(self._state.consensus).items():
                params[name].copy_(value)
            for site in self.local_sites:
                params[site.name].index_copy_(site.axis, solved.indices, solved.local[site.name])

    # ---------------------------------------------------------- inspection

    @property
    def step_sizes(self) -> dict[str, float]:
        """The step size ``eta_j`` of each preconditioner group."""
        if self._state is None:
            return {}
        return {g.name: float(eta) for g, eta in zip(self.group_list, self._group_step_sizes)}

    @property
    def curvatures(self) -> dict[str, float]:
        """The largest curvature ``L_j`` measured so far for each group (``eta="auto"``
        only; see ``remeasure_epochs``): ``eta_j = eta_scale / L_j`` for ``"auto"`` groups."""
        if self._curvatures is None:
            return {}
        return {g.name: float(c) for g, c in zip(self.group_list, self._curvatures)}

    @property
    def state(self) -> ConsensusState | None:
        """Duals, block copies and consensus (``None`` before the first step)."""
        return self._state

    def evaluate_loss(self, *args: Any, **kwargs: Any) -> float:
        """Estimate of the loss at the current params (the consensus), as ``SVI.evaluate_loss``.

        :rtype: float
        """
        with torch.no_grad():
            if isinstance(self.loss, ELBO):
                return float(self.loss.loss(self.model, self.guide, *args, **kwargs))
            return float(self._loss_fn(self.model, self.guide, *args, **kwargs))

    def global_gradient_norm(self, *args: Any, **kwargs: Any) -> float:
        """``||grad_lambda f(phi, lambda_0)||`` over all blocks: the paper's Fig. 4 metric.

        Evaluates every block's ``f_b`` at the consensus and its current local
        rows (one Monte Carlo draw each), and sums the gradients.

        :rtype: float
        """
        if self._state is None:
            raise RuntimeError("call step() at least once before global_gradient_norm()")
        total = sum(
            self._block_gradient(b, self._state.consensus, args, kwargs) for b in range(len(self.partition))
        )
        return float(total.norm())

    # ------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Everything PDVI owns: duals, copies, consensus, step sizes, step count.

        Params live in Pyro's param store; save it alongside
        (``pyro.get_param_store().get_state()``).
        """
        if self._state is None:
            return {"num_steps": self.num_steps}
        return {
            "num_steps": self.num_steps,
            "block_visits": self._block_visits,
            "num_data": self.partition.num_data,
            "global_sites": self.layout.names,
            "groups": [g.name for g in self.group_list],
            "group_step_sizes": self._group_step_sizes.clone(),
            "consensus_state": self._state.state_dict(),
            "rng_state": self._rng.get_state(),
            "remeasured": self._remeasured,
            "curvatures": None if self._curvatures is None else self._curvatures.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`. Before the first step the state waits
        until the first step has found the sites, then is checked and applied."""
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
        if state["groups"] != [g.name for g in self.group_list]:
            raise ValueError(
                f"saved PDVI state has groups {state['groups']}, this PDVI has "
                f"{[g.name for g in self.group_list]}"
            )
        self._state.load_state_dict(state["consensus_state"])
        if "rng_state" in state:
            self._rng.set_state(state["rng_state"])
        self._group_step_sizes = state["group_step_sizes"].clone()
        self._remeasured = state.get("remeasured", 0)
        curvatures = state.get("curvatures")
        self._curvatures = None if curvatures is None else curvatures.clone()
