"""How :class:`~pyro_pdvi.PDVI` keeps its step sizes up to date during a run (a mixin of it).

After every accepted step (never inside one, so a refused step changes nothing):

* the blocks solved for the first time have their diagonal curvature measured, which bounds
  the step sizes of the natural rule and weighs the blocks in the global update's
  ``"weighted"`` rule (:mod:`~pyro_pdvi.infer.consensus`); once every block is measured, the
  coordinates that about one block informs (less those that most blocks inform where their
  owners are measured again at one ``lambda_0``:
  :meth:`~pyro_pdvi.infer.consensus.ConsensusState.release_shared`) are coupled with the
  shared coordinates their blocks' data tie them to (:mod:`~pyro_pdvi.infer.coupling`: the state
  moves to coordinates in which an intercept and its groups' effects are preconditioned
  together), and a one-time warning names their sites (there PD-VI can trail SVI early on:
  ``docs/benchmarks.md`` 13k-13m; the generic solver solves the blocks that own them with more
  evaluations, 13m);
* under the natural rule (:mod:`~pyro_pdvi.infer.fisher`), once an epoch the guide's Fisher
  information is measured again at ``lambda_0`` (a step size follows it down at once, up by at
  most :data:`~pyro_pdvi.infer.step_sizes.FISHER_STEP_GROWTH` an epoch);
* under the curvature rule, the curvatures are measured again when
  ``AutoStepSize.remeasure_epochs`` say so;
* at the end of an epoch the rising-objective safeguard (:mod:`~pyro_pdvi.infer.safeguard`)
  may halve every step size, and the stationarity test (:mod:`~pyro_pdvi.infer.stationarity`)
  those of the coordinates that only wander in the Monte Carlo noise.

A change of step sizes moves ``lambda_0`` with ``h = H mean(mu)`` and keeps the fixed point.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from ..errors import warn_user
from .consensus import EARLY_CONCENTRATED_SHARE
from .coupling import measure_coupling, unit_vectors
from .fisher import fisher_diagonal
from .hessian_products import hessian_products
from .safeguard import RISES
from .solvers import GenericSolver
from .step_sizes import DEFAULT_SCALES, diagonal_curvature, round_site_scale
from .whitening import (
    FIRST_BLOCKS,
    MAX_UNIT_VECTOR_SITE,
    MAX_WHITENED_COORDINATES,
    GroupHessians,
    SiteWhitening,
    joint_group,
    measure_whitening,
    nested_positions,
    probed_block_hessians,
    probed_order,
    probes_apply,
    site_hessians,
    unit_vector_sites,
    unit_vectors_measured,
    without_indefinite,
)

#: Where the model's graph has no usable second derivative, the coupling's Hessian products are
#: central differences of the gradient with this step, relative to ``1 + max|lambda_0|``: large
#: enough that a reduced curvature, a small difference of large ones, is not lost in rounding (a
#: smooth objective is nearly quadratic over it; forward differences with it in 13l).
COUPLING_RELATIVE_STEP = 1e-2


#: The first block's Hessian products by double backward are kept where they are within this
#: relative distance of central differences of the gradient.
SECOND_ORDER_TOLERANCE = 0.05


#: A block's diagonal curvature at its first visit is estimated from this many of its data
#: (:meth:`StepSizeUpkeep._measure_new_blocks`): on the suite's logistic regression of 100,000
#: rows in blocks of 1,000 that took a third of the first epoch; from 256 rows, its first three
#: epochs took 0.3-0.4 CPU s less, their errors the same to two digits (``docs/benchmarks.md`` 13zf).
CURVATURE_ROWS = 256

#: A block skips the unit vector of a coordinate that it informs less than this share of the most
#: any block does, where the whitening's group measures a refused large site by unit vectors
#: (:meth:`StepSizeUpkeep._skipped_unit_vectors`).
SKIPPED_SHARE = 0.01

#: The whitening's Hessian of a block of more data is estimated from this many of them
#: (:meth:`StepSizeUpkeep._whiten_sites`): its cost then does not grow with the block.
WHITENING_ROWS = 64


class KeptBlockHessians:
    """Every block's Hessian products in the globals at one point and noise, for a one-time pass
    over the blocks: each block's products are made on first use and kept (one model evaluation
    per block, then one backward pass per direction), and so is each unit column.

    :param block_products: ``b -> (V -> V H_b)`` (``PDVI._block_hessian_products``).
    :param like: a tensor whose last size is ``P`` and whose dtype and device the unit vectors take.
    """

    def __init__(
        self, block_products: Callable[[int], Callable[[torch.Tensor], torch.Tensor]], like: torch.Tensor
    ) -> None:
        self._block_products = block_products
        self._like = like
        self._products: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}
        self._columns: dict[tuple[int, int], torch.Tensor] = {}

    def products(self, b: int, directions: torch.Tensor) -> torch.Tensor:
        """``V H_b`` for directions ``V`` of shape ``(k, P)``."""
        if b not in self._products:
            self._products[b] = self._block_products(b)
        return self._products[b](directions)

    def columns(self, b: int, coordinates: torch.Tensor) -> torch.Tensor:
        """``H_b[J, :]`` for the coordinates ``J`` (``(k,)``), shape ``(k, P)``."""
        wanted = coordinates.tolist()
        missing = [j for j in wanted if (b, j) not in self._columns]
        if missing:
            found = self.products(b, unit_vectors(self._like, torch.tensor(missing)))
            self._columns.update({(b, j): column for j, column in zip(missing, found)})
        if not wanted:
            return self._like.new_zeros(0, self._like.shape[-1])
        return torch.stack([self._columns[(b, j)] for j in wanted])

    def diagonal(self, b: int, coordinates: torch.Tensor) -> torch.Tensor:
        """``H_b[j, j]`` for the coordinates ``J`` (``(k,)``)."""
        return self.columns(b, coordinates).gather(1, coordinates.reshape(-1, 1).to(self._like.device))[:, 0]


class StepSizeUpkeep:
    """The step-size methods of :class:`~pyro_pdvi.PDVI` (see the module docstring)."""

    #: Whether concentrated coordinates are coupled with shared ones once found.
    couple_concentrated = True
    #: Whether the sites that a diagonal penalty leaves round take the dense penalty's constant
    #: once measured (:meth:`_set_round_sites_scale`).
    scale_round_sites = True
    #: Whether the model's graph has a usable second derivative (Hessian products by double
    #: backward): ``None`` until the first products were checked against finite differences of
    #: the gradient, ``False`` where they disagreed or double backward failed (the products are
    #: then finite differences).
    _second_order: bool | None = None

    def _adapt_step_sizes(self, block_ids: torch.Tensor, epoch: int, args: tuple, kwargs: dict) -> None:
        """After an accepted step: measure the blocks solved for the first time (the natural
        rule's bound, the weighted global update's weights); under the natural rule, follow the
        guide's Fisher information once an epoch; under the curvature rule, re-measure when
        ``remeasure_epochs`` say so."""
        changed = False
        epoch_ended = self._block_visits // len(self.partition) > epoch
        if self._step_sizes.natural or self._weighs_blocks():
            changed = self._measure_new_blocks(block_ids, args, kwargs)
        if self._step_sizes.natural and epoch_ended:
            changed |= self._step_sizes.set_fisher(self._measure_fisher(block_ids, args, kwargs))
        if epoch_ended and self._guard.end_epoch():
            self._step_sizes.damping = self._guard.damping
            changed = True
            warn_user(
                f"PDVI step {self.num_steps}: the objective rose in {RISES} epochs in a row; every "
                f"step size is now {self._guard.damping:g} of its rule's (diagnostics['damping'])",
            )
        if epoch_ended and self._decays_steps() and self._stationarity.end_epoch(self._state.consensus):
            self._step_sizes.decay = self._stationarity.decay
            changed = True
        if changed:
            self._apply_step_sizes()
        if self._step_sizes.remeasure_due(self._block_visits, len(self.partition)):
            self._remeasure(args, kwargs)

    def _decays_steps(self) -> bool:
        """Whether the stationarity test runs (``step_decay``; ``"auto"``: a Monte Carlo solve)."""
        return self._noisy_solve if self.step_decay == "auto" else self.step_decay

    def _measure_fisher(self, block_ids: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        """The guide's Fisher diagonal at ``lambda_0`` (:mod:`~pyro_pdvi.infer.fisher`), on the
        given blocks (those of the step, whose arguments these are)."""
        auto = self.auto_step_size
        seed = self._side_seed(self._block_visits)
        fisher = torch.zeros_like(self._state.consensus)
        # One estimate per block, added in block order: processes that share steps (one block
        # each, usually) add theirs in the all-reduce to the same number.
        for b in block_ids.tolist()[: auto.fisher_blocks]:
            block = [self.partition.block(b, self.device)]
            fisher += fisher_diagonal(
                self.guide, self.plate, self.layout, self._consensus_params, block, args, kwargs,
                auto.fisher_samples, seed + b,
            )  # fmt: skip
        count = torch.tensor([float(min(len(block_ids), auto.fisher_blocks))], dtype=fisher.dtype)
        return self._all_reduce(fisher) / self._all_reduce(count.to(fisher.device))

    def _weighs_blocks(self) -> bool:
        """Whether the global update may take the ``"weighted"`` rule, which needs every block's
        diagonal curvature."""
        return self.global_update == "weighted" or (self.global_update == "auto" and self._noisy_solve)

    def _measure_new_blocks(self, block_ids: torch.Tensor, args: tuple, kwargs: dict) -> bool:
        """Measure the diagonal curvature ``c_b`` of the blocks just solved for the first time, at
        the new ``lambda_0``: the weights of the ``"weighted"`` global update
        (:meth:`~pyro_pdvi.infer.consensus.ConsensusState.set_information`) and, under the
        natural rule, the bound ``eta_j <= 8 / max_b c_bj`` over the blocks seen so far. A block
        of more data is measured on :data:`CURVATURE_ROWS` of them (:meth:`_subsampled_products`).
        Processes that share steps measure their own blocks and add up the rows.

        :returns: whether a bound of the natural rule grew.
        """
        new = [b for b in block_ids.tolist() if b not in self._measured_blocks]
        if self._shares_steps:
            if not float(self._all_reduce(torch.tensor([float(len(new))], dtype=torch.float64))):
                return False
        elif not new:
            return False
        measured = torch.zeros_like(self._state.information)
        probes = self.auto_step_size.curvature_probes
        seed = self._side_seed(-1)
        for b in new:
            products = partial(self._subsampled_products, b, args, kwargs, seed + b, CURVATURE_ROWS)
            # A probe that left the model's domain (a product that is not finite) measures
            # nothing: such a coordinate counts as uninformed, never as a step size of NaN.
            curvature = diagonal_curvature(products, self._consensus_params, probes)
            measured[b] = torch.where(torch.isfinite(curvature), curvature, 0.0)
            self._measured_blocks.add(b)
            if not self._shares_steps:
                self._first_step_args[b] = (args, kwargs)
        # Each process measured its own new blocks: the sum over processes gives every row.
        measured = self._all_reduce(measured)
        ids = measured.sum(1).nonzero().reshape(-1)
        found_before = bool(self._state.concentrated.any())
        self._state.set_information(ids, measured[ids])
        if not found_before and bool(self._state.concentrated.any()):
            self._pass_over_every_block(args, kwargs)
        self._find_owners_of_concentrated()
        measured_now = len(self._measured_blocks)
        if measured_now - len(new) < FIRST_BLOCKS <= measured_now < len(self.partition):
            self._scale_round_sites_early(args, kwargs)
        if measured_now == len(self.partition):
            self._whiten_sites(args, kwargs)
            self._first_step_args.clear()
        if not self._step_sizes.natural or not len(ids):
            return False
        return self._step_sizes.bound_block_curvature(measured[ids])

    def _not_held(self, mask: torch.Tensor) -> torch.Tensor:
        """``mask`` without the coordinates that the solves hold (scales set by their fixed point)."""
        mask = mask.clone()
        if self._scales is not None:
            mask[self._scales.coordinates] = False
        return mask

    def _find_owners_of_concentrated(self) -> None:
        """The blocks that inform most some concentrated coordinate that their solve moves (not a
        scale held at its fixed point): the generic solver gives them its longer solve
        (``GenericSolver.concentrated_steps``). ``None`` while there is none (every block not yet
        measured, or no such coordinate)."""
        moved = self._not_held(self._state.concentrated)
        self._owns_concentrated = self._state.owners(moved) if bool(moved.any()) else None

    def _warn_of_concentrated_coordinates(self) -> None:
        """Tell the user, once, that some coordinates are informed by about one block each, whether
        they were coupled (or whitened with the sites they are tied to), and what that measured to
        cost against SVI (``docs/benchmarks.md`` 13j-13m)."""
        listed = ", ".join(f"{name!r} ({count})" for name, count in self.concentrated_sites.items())
        if isinstance(self._coupling, SiteWhitening):
            whitened = ", ".join(repr(name) for name in self.whitened_sites)
            remedy = (
                f"PDVI whitens them with the sites they are tied to, {whitened} (PDVI.whitened_sites): "
                "one dense penalty sees that split."
            )
        elif self._coupling is None:
            remedy = (
                "They are not coupled with such a site (PDVI.coupled_sites is empty), so a split "
                "that only the priors fix converges slowly here."
            )
        else:
            coupled = ", ".join(repr(name) for name in self.coupled_sites)
            remedy = (
                f"PDVI preconditions {coupled} together with them (PDVI.coupled_sites), which "
                "speeds up that split."
            )
        warn_user(
            f"PDVI: coordinates of {listed} are informed by about one block each (such as a group's "
            "random effect with one block per group). Each moves only when its block steps, and where "
            "the data fix only its sum with a site that every block informs (an intercept plus every "
            f"group's effect) the split is left to the priors. {remedy} On the random-effects model "
            "of docs/benchmarks.md (13m, 13n), coupled, PDVI's posterior means trailed the best-tuned "
            "SVI+Adam's for the first 5-10 CPU seconds and were 1.3-2x closer to the optimum "
            "after 20. "
            "PDVI.concentrated_sites lists these sites.",
        )

    def _pass_over_every_block(self, args: tuple, kwargs: dict) -> None:
        """Once every block is measured and some coordinates look concentrated: measure their
        owners again at the one ``lambda_0`` of now and release those that most blocks inform
        there (:meth:`ConsensusState.release_shared`; not where processes share the steps, each
        of which holds its own blocks' arguments only), couple those that remain
        (:meth:`_couple`) unless the whitening's probed group will take them
        (:meth:`_whitening_candidates`), and warn of them once.

        Both take every block's Hessian products at that point and noise, each block's graph
        built once and kept until the pass ends (on the suite's random-effects model half of the
        coupling's cost was a second model call per block), and each unit column once: the
        coupling's first pass reads the confirmation's. Once per run, then, the graphs of every
        block (the whole data's, double-backward buffers included) are held at once."""
        hessians = self._kept_block_hessians(args, kwargs)
        # Evaluations at signatures that need not recur (this step's arguments for blocks not
        # kept in _first_step_args) are not recorded.
        with self._objective.one_off():
            if not self._shares_steps:
                self._measure_sampled_blocks_again(hessians)
            if not self._shares_steps and bool(self._state.concentrated.any()):
                self._state.release_shared(hessians.diagonal, self._not_held(self._state.concentrated))
            group_takes = self._group_takes_concentrated()
            if bool(self._state.concentrated.any()) and not group_takes:
                self._couple(hessians)
        if self.concentrated_sites and not group_takes:  # else warned once the group is measured
            self._warn_of_concentrated_coordinates()

    def _kept_block_hessians(self, args: tuple, kwargs: dict) -> KeptBlockHessians:
        """Every block's Hessian products at ``lambda_0`` and one noise, each block's graph kept
        (:class:`KeptBlockHessians`), on every row of the block."""
        seed = self._side_seed(-3)

        def block_products(b: int) -> Callable[[torch.Tensor], torch.Tensor]:
            # The block's own step arguments (data a model takes per step are the block's); this
            # step's where they are not kept (a run resumed within its first epoch).
            block_args, block_kwargs = self._first_step_args.get(b, (args, kwargs))
            return self._block_hessian_products(b, block_args, block_kwargs, seed + b, COUPLING_RELATIVE_STEP)

        return KeptBlockHessians(block_products, self._state.information)

    def _measure_sampled_blocks_again(self, hessians: KeptBlockHessians) -> None:
        """Measure again the concentrated coordinates' information in each block first measured
        on a subset of its rows (more than :data:`CURVATURE_ROWS`), on every row, by Rademacher
        probes on those coordinates only (Hutchinson's estimate of the diagonal of ``H_b`` there:
        exact where their own Hessian is diagonal, a random effect's; the first measurement's
        probes also carried the noise of their ties to every other coordinate), and decide again
        which are concentrated.

        Why: a subset sees few of a random effect's sites in a block, each counted with the weight
        that scales the subset up to the block, so a site that every block informs a little looks
        informed by the one or two blocks whose subset drew its rows. Measured on the suite's
        Poisson model of 1,000 sites (``docs/benchmarks.md`` 13zp; each site's 20 rows spread over
        20 blocks of 1,000 by time), 115 sites' effects looked concentrated; they were then left
        out of the whitening, whose group lost the ties that make it worth one.

        :param hessians: every block's Hessian products at the pass's point, on every row.
        """
        sampled = (self.partition.sizes > CURVATURE_ROWS).nonzero().reshape(-1)
        coordinates = self._not_held(self._state.concentrated).nonzero().reshape(-1)
        if not len(sampled) or not len(coordinates):
            return
        like = self._state.consensus
        generator = torch.Generator().manual_seed(self._side_seed(-8))
        shape = (self.auto_step_size.curvature_probes, len(coordinates))
        signs = 2 * torch.randint(0, 2, shape, generator=generator) - 1
        probes = like.new_zeros(len(signs), like.numel())
        probes[:, coordinates] = signs.to(probes)
        rows = self._state.information[sampled.to(like.device)].clone()
        for i, b in enumerate(sampled.tolist()):
            values = (probes * hessians.products(b, probes)).mean(0).abs()[coordinates]
            rows[i, coordinates] = torch.where(torch.isfinite(values), values, rows[i, coordinates])
        self._state.set_information(sampled, rows)

    def _may_couple(self) -> bool:
        """Whether concentrated coordinates would be coupled once found (:meth:`_couple`)."""
        return self.couple_concentrated and not self._shares_steps and isinstance(self.solver, GenericSolver)

    def _couple(self, hessians: KeptBlockHessians) -> None:
        """Couple the concentrated coordinates with the shared ones that their blocks' data tie
        them to and carry the state into the coupled coordinates (:mod:`~pyro_pdvi.infer.coupling`),
        measured from ``hessians`` (every block's rows at one ``lambda_0``). Only for the generic
        solver in one process (a closed-form solver works in the params' coordinates), and only
        coordinates under the natural rule."""
        if not self._may_couple():
            return
        state = self._state
        # The growth of a coupled step size presumes step sizes in proportion to each coordinate's
        # curvature (the natural rule's): a fixed eta, or a group's one curvature-rule step (a
        # Delta guide's coordinates have no Fisher information), stays uncoupled.
        eligible = self._not_held(self._step_sizes.natural_coordinates().to(state.concentrated.device))
        concentrated = state.concentrated & eligible
        owner = state.information.argmax(0)
        owned = [(concentrated & (owner == b)).nonzero().reshape(-1) for b in range(len(self.partition))]
        shared = ~state.concentrated & eligible & (state.information_total > 0)
        sites = torch.empty(state.consensus.numel(), dtype=torch.long, device=state.consensus.device)
        for number, span in enumerate(self.layout.slices.values()):
            sites[span] = number
        coupling = measure_coupling(
            hessians.products, owned, shared, state.information, sites, owner_columns=hessians.columns
        )
        if coupling is None:
            return
        self._coupling = coupling.to(state.consensus)
        state.change_coordinates(self._coupling.forward, self._coupling.dual_forward, self._rule_step_sizes())
        self._stationarity.change_coordinates(coupling.to(torch.zeros((), dtype=torch.float64)).forward)
        self._write_consensus()

    def _may_whiten(self) -> bool:
        """Whether the small sites would be whitened once every block is measured
        (:meth:`_whiten_sites`)."""
        return (
            self.auto_step_size.whiten
            and self._step_sizes.natural
            and self._coupling is None
            and not self._shares_steps
            and isinstance(self.solver, GenericSolver)
        )

    def _whitening_candidates(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Each global site's coordinates that the whitening may take (:meth:`_whiten_sites`):
        under the natural rule, moved by the solves (not a held scale) and informed; and of those,
        the concentrated coordinates it takes too. A concentrated coordinate is otherwise left to
        the coupling (:meth:`_couple`); here, where the shared coordinates' sites form a probed
        group (:func:`~pyro_pdvi.infer.whitening.probes_apply`: a random effect that every block
        informs), the group takes every concentrated one: a random slope that only the blocks at
        the ends of time inform, beside the slopes that every block does (``docs/benchmarks.md``
        13zq), or a random effect per period of time, each period's inside one block (13zs). The
        coupling and the whitening exclude each other, and the group's one dense penalty sees the
        ties the coupling would.

        :returns: the candidate sites' coordinates, and a mask of the concentrated ones among them.
        """
        state = self._state
        eligible = self._not_held(self._step_sizes.natural_coordinates().to(state.concentrated.device))
        eligible &= state.information_total > 0
        shared = eligible & ~state.concentrated
        concentrated = eligible & state.concentrated
        shared_sites = self._site_coordinates(shared, 1, shared.numel())
        if bool(concentrated.any()) and probes_apply(shared_sites, len(self.partition)):
            sites = self._site_coordinates(shared | concentrated, 1, shared.numel())
            if probes_apply(sites, len(self.partition)):
                return sites, concentrated
        return shared_sites, torch.zeros_like(concentrated)

    def _group_takes_concentrated(self) -> bool:
        """Whether the whitening's probed group would take the concentrated coordinates
        (:meth:`_whitening_candidates`), which are then not coupled."""
        return self._may_whiten() and bool(self._whitening_candidates()[1].any())

    def _site_positions(self, sites: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each coordinate's place in its site (its index into the site's flattened value)."""
        starts = torch.zeros(self._state.consensus.numel(), dtype=torch.long)
        for span in self.layout.slices.values():
            starts[span] = span.start
        return [c - starts[c] for c in sites]

    def _site_coordinates(
        self, eligible: torch.Tensor, smallest: int, largest: int = MAX_WHITENED_COORDINATES
    ) -> list[torch.Tensor]:
        """Each global site's ``eligible`` coordinates (a flat mask), for the sites that have
        ``smallest`` to ``largest`` of them."""
        every_coordinate = torch.arange(eligible.numel())
        eligible = eligible.cpu()
        coordinates = [every_coordinate[span][eligible[span]] for span in self.layout.slices.values()]
        return [c for c in coordinates if smallest <= len(c) <= largest]

    def _site_products(
        self, args: tuple, kwargs: dict, seed: int, max_rows: int | None
    ) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """``(b, V) -> V H_b`` at ``lambda_0``, block ``b``'s Hessian estimated on at most
        ``max_rows`` of its data (on all of them where the model does not take a subset, or
        ``max_rows`` is ``None``), at the noise of ``seed + b``: what
        :func:`~pyro_pdvi.infer.whitening.site_hessians` takes."""

        def products(b: int, directions: torch.Tensor) -> torch.Tensor:
            block_args, block_kwargs = self._first_step_args.get(b, (args, kwargs))
            return self._subsampled_products(b, block_args, block_kwargs, seed + b, max_rows, directions)

        return products

    def _subsampled_products(
        self, b: int, args: tuple, kwargs: dict, seed: int, max_rows: int, directions: torch.Tensor
    ) -> torch.Tensor:
        """``V H_b`` (:meth:`_block_hessian_products`), estimated on at most ``max_rows`` of the
        block's data, on all of them where the model does not take a subset (it raises: data
        that the step passes in its arguments are the whole block's)."""
        try:
            return self._block_hessian_products(b, args, kwargs, seed, max_rows=max_rows)(directions)
        except (RuntimeError, ValueError):
            return self._block_hessian_products(b, args, kwargs, seed)(directions)

    def _whiten_sites(self, args: tuple, kwargs: dict) -> None:
        """Once, when every block is measured: give each small site a dense penalty
        (:mod:`~pyro_pdvi.infer.whitening`) and carry the state into its coordinates. Only the
        generic solver's, in one process, where no coordinates are coupled, and only coordinates
        under the natural rule that the solves move (not a held scale), that many blocks inform
        (not a concentrated one, but where a probed group takes them: :meth:`_whitening_candidates`):
        a site of 2 to ``MAX_WHITENED_COORDINATES`` of them, or all the sites as one group where
        they have that many together (:func:`~pyro_pdvi.infer.whitening.joint_group`), or with
        larger sites whose own Hessians are diagonal or tied to each other position by position,
        measured by probes (:func:`~pyro_pdvi.infer.whitening.probed_block_hessians`, the places
        from :meth:`_site_positions`). Each block's Hessian is
        measured at ``lambda_0``, on at most :data:`WHITENING_ROWS` of its data (all of them where
        the model does not take a subset, or where the group is probed).

        A site that a diagonal penalty already leaves round (a site of one such coordinate
        included) is not mapped, but may take a stiffer constant (:meth:`_set_round_sites_scale`),
        decided here again where :meth:`_scale_round_sites_early` guessed."""
        if self._whitening_tried:
            return
        self._whitening_tried = True
        guessed = self._step_sizes.site_scales is not None
        self._step_sizes.site_scales = None
        if not self._may_whiten():
            if guessed:
                self._apply_step_sizes()
            return
        state = self._state
        sites, taken = self._whitening_candidates()
        products = self._site_products(args, kwargs, self._side_seed(-6), WHITENING_ROWS)
        hessians, natural, nested = None, None, False
        if probes_apply(sites, len(self.partition)):
            # Where the group was to take concentrated coordinates, their warning tells the user.
            probed, small, nested = self._probe_group(args, kwargs, sites, warn=not bool(taken.any()))
            if probed is not None:
                hessians = [probed]
            elif bool(taken.any()):
                # The group cannot take the concentrated coordinates: they are coupled, as where no
                # group would have (then nothing is whitened).
                self._couple_after_all(args, kwargs)
                self._apply_step_sizes()
                return
        if hessians is not None:
            order = probed_order(sites, small)
            if nested:
                probed, order = without_indefinite(probed, order)
            hessians, coordinates, round_sites = [probed], [order], []
            # The large sites keep the natural rule's constant: docs/benchmarks.md 13zo.
            natural = torch.cat([c for c, is_small in zip(sites, small) if not is_small])
        else:
            coordinates = joint_group(sites)
            round_sites = [c for c in coordinates if len(c) == 1]
            coordinates = [c for c in coordinates if len(c) >= 2]
            if coordinates:
                with self._objective.one_off():
                    coordinates, measured, found_round = site_hessians(
                        products, len(self.partition), coordinates, state.consensus
                    )
                hessians = GroupHessians.of_sites(measured, coordinates)
                round_sites += found_round
        whitening = None
        if coordinates and hessians is not None and all(map(GroupHessians.is_finite, hessians)):
            auto = self.auto_step_size
            size = state.consensus.numel()
            whitening, found_round = measure_whitening(
                hessians, coordinates, size, auto.whitened_scale / auto.scale, natural
            )
            round_sites += found_round
        self._set_round_sites_scale(round_sites)
        if whitening is None:
            if bool(taken.any()):
                self._couple_after_all(args, kwargs)
            self._apply_step_sizes()
            return
        self._coupling = whitening.to(state.consensus)
        state.change_coordinates(self._coupling.forward, self._coupling.dual_forward, self._rule_step_sizes())
        self._stationarity.change_coordinates(whitening.to(torch.zeros((), dtype=torch.float64)).forward)
        # The weighted update's block weights, in the new coordinates.
        whitened = whitening.coordinates
        kept = [h for c, h in zip(coordinates, hessians) if any(torch.equal(c, w) for w in whitened)]
        curvature = whitening.curvature_diagonal(kept).abs()
        state.set_coordinate_information(whitening.whitened, curvature)
        self._write_consensus()
        if bool(taken.any()):
            # The group's dense penalty sees the concentrated coordinates' ties: their owners no
            # longer take the longer solve (docs/benchmarks.md 13zt).
            self._owns_concentrated = None
            self._warn_of_concentrated_coordinates()

    def _probe_group(
        self, args: tuple, kwargs: dict, sites: list[torch.Tensor], warn: bool = True
    ) -> tuple[GroupHessians | None, list[bool], bool]:
        """Every block's Hessian on the probed group of ``sites``
        (:func:`~pyro_pdvi.infer.whitening.probed_block_hessians`), on every row of a block: a few
        products each, and a subset would see few of a random effect's sites, each with a weight
        that overstates it (``docs/benchmarks.md`` 13zp). Where the probes refuse the group, the
        large site cheapest to measure by its unit vectors (:meth:`_cheapest_to_demote`) is measured
        so instead, and the probes tried again, as long as a block measures at most
        :data:`~pyro_pdvi.infer.whitening.MAX_WHITENED_COORDINATES` unit vectors: a random effect per
        region of the sites, tied to each of its sites' effects (not position by position), is then
        measured exactly (13zr), and so is a random effect per period of time, each period inside one
        block, which the others skip (13zs, 13zu). Where none is accepted, a large site nested in
        another (each site's effect in its region's, more regions than unit vectors take) is found
        by two probes a site (:func:`~pyro_pdvi.infer.whitening.nested_positions`) and measured by
        units of a region and its sites (13zv; a site's intercept and slope both nested in its
        region, tied to each other at their own place, 13zw), on each split the probes applied to in
        turn (the regions nested in few enough countries, measured by their unit vectors: 13zx).
        Where every try is refused and a site is too large to be whitened by its unit vectors, the
        user is told (where ``warn``).

        :returns: the group's Hessians (``None`` where refused), which sites were measured by
            their unit vectors, and whether by nested units.
        """
        every_row = self._site_products(args, kwargs, self._side_seed(-6), max_rows=None)
        positions = self._site_positions(sites)
        small = unit_vector_sites(sites)
        splits = []  # each split the probes apply to, with the unit vectors its blocks skip
        while True:
            skipped = self._skipped_unit_vectors(sites, small)
            measured = unit_vectors_measured(sites, small, skipped)
            if not probes_apply(sites, len(self.partition), small, measured):
                break
            splits.append((small, skipped))
            with self._objective.one_off():
                probed = probed_block_hessians(
                    every_row, len(self.partition), sites, self._state.consensus, positions,
                    small=small, curvature=self._state.information, skipped=skipped,
                )  # fmt: skip
            if probed is not None:
                return probed, small, False
            small = list(small)
            small[self._cheapest_to_demote(sites, small)] = True
        # Last, a large site nested in another (a site's effect in its region's): units of a region
        # and its sites (13zv), on each split in turn (a third level, small enough, measured by its
        # unit vectors: 13zx).
        num_blocks, like = len(self.partition), self._state.consensus
        for split, split_skipped in splits:
            with self._objective.one_off():
                places = nested_positions(every_row, num_blocks, sites, like, split, positions)
                if places is None:
                    continue
                probed = probed_block_hessians(
                    every_row, num_blocks, sites, like, places, small=split, skipped=split_skipped,
                    curvature=self._state.information, own_positions=positions,
                )  # fmt: skip
            if probed is not None:
                return probed, split, True
        # Sites of at most MAX_WHITENED_COORDINATES may still be whitened by unit vectors
        # (joint_group); larger ones keep a diagonal penalty.
        left = [self.layout.site_of(int(c[0])) for c in sites if len(c) > MAX_WHITENED_COORDINATES]
        if left and warn:
            warn_user(
                f"PDVI could not measure how the coordinates of {', '.join(map(repr, left))} are tied "
                "to the other global sites: their probes found a Hessian that is neither diagonal on "
                "each site with more than 16 coordinates (a random effect's) nor tied between two such "
                "sites coordinate to coordinate at the same place (a random intercept and a random "
                "slope of the same sites), with at most "
                f"{MAX_WHITENED_COORDINATES} coordinates of the others a block to measure one by one. "
                "They keep a diagonal penalty, and a split between them and the shared sites that only "
                "the priors fix (an intercept plus every group's effect) converges slowly: on the "
                "suite's random-effects models that left PDVI's means 2-4x behind the best-tuned "
                "SVI+Adam's (docs/benchmarks.md 13zo, 13zp). PDVI.whitened_sites lists the sites "
                "preconditioned together."
            )
        return None, small, False

    def _informed(self, coordinates: torch.Tensor) -> torch.Tensor:
        """``(n, k)``: where each block informs each of ``coordinates`` by more than its prior's
        share, at least :data:`SKIPPED_SHARE` of the most any block does."""
        information = self._state.information[:, coordinates.to(self._state.information.device)]
        return (information >= SKIPPED_SHARE * information.amax(0)).cpu()

    def _cheapest_to_demote(self, sites: list[torch.Tensor], small: list[bool]) -> int:
        """The large site (not ``small``) whose unit vectors a block would measure fewest of, the
        ones it informs (:meth:`_informed`; a period's effect, each period inside one block, before
        a site's effect that every block informs), the smaller site where equal."""
        large = [j for j, is_small in enumerate(small) if not is_small]
        return min(large, key=lambda j: (int(self._informed(sites[j]).sum(1).max()), len(sites[j])))

    def _skipped_unit_vectors(self, sites: list[torch.Tensor], small: list[bool]) -> torch.Tensor:
        """``(n, P)``: the coordinates of the sites measured by unit vectors after the probes refused
        them (``small`` but of more than :data:`~pyro_pdvi.infer.whitening.MAX_UNIT_VECTOR_SITE`
        coordinates) that a block informs less than :data:`SKIPPED_SHARE` of the most any block
        does (a period's effect, in the blocks other than its own, by its prior's share): the
        group's measurement skips their unit vectors there (``docs/benchmarks.md`` 13zs: a block
        informs 2 of the 40 periods)."""
        information = self._state.information
        skipped = torch.zeros(information.shape, dtype=torch.bool)
        for c, is_small in zip(sites, small):
            if is_small and len(c) > MAX_UNIT_VECTOR_SITE:
                skipped[:, c] = ~self._informed(c)
        return skipped.to(information.device)

    def _couple_after_all(self, args: tuple, kwargs: dict) -> None:
        """Couple the concentrated coordinates that the whitening's group was to take
        (:meth:`_whitening_candidates`) where its probes refused it or it was not whitened, and
        warn of them."""
        with self._objective.one_off():
            self._couple(self._kept_block_hessians(args, kwargs))
        self._warn_of_concentrated_coordinates()

    def _may_scale_round_sites(self) -> bool:
        """Whether round sites would take :func:`~pyro_pdvi.infer.step_sizes.round_site_scale`
        (:meth:`_set_round_sites_scale`)."""
        return (
            self.scale_round_sites
            and not self.local_sites
            and self.auto_step_size.scale == DEFAULT_SCALES["natural"]
            and self._may_whiten()
        )

    def _scale_round_sites_early(self, args: tuple, kwargs: dict) -> None:
        """Once the first :data:`~pyro_pdvi.infer.whitening.FIRST_BLOCKS` blocks are measured, in
        the first epoch: give the sites of 2 or more coordinates whose Hessian summed over those
        blocks is round the stiffer constant (:meth:`_set_round_sites_scale`) for the rest of the
        epoch, whose end decides again (:meth:`_whiten_sites`). Measured on the logistic
        regression of 100,000 rows (``docs/benchmarks.md`` 13zd): its means 0.056 off after the
        first epoch, against 0.50 where the constant waited for the epoch's end.

        Not where one of those blocks holds nearly all of some coordinate's measured information
        (:data:`EARLY_CONCENTRATED_SHARE`; a group's random effect, which its block alone informs):
        a site of effects that the first blocks barely inform looks round there, and the
        random-effects model of the suite was 1.3x further after 3 epochs with its effects'
        constant stiffer in the first. A site of one coordinate waits for the epoch's end: alone
        it says nothing of its ties."""
        if not self._may_scale_round_sites():
            return
        state = self._state
        eligible = self._not_held(self._step_sizes.natural_coordinates().to(state.concentrated.device))
        eligible &= state.information_total > 0
        measured = sorted(self._measured_blocks)[:FIRST_BLOCKS]
        information = state.information[torch.tensor(measured, device=state.information.device)]
        held_by_one = information.max(0).values > EARLY_CONCENTRATED_SHARE * information.sum(0)
        if bool((held_by_one & eligible).any()):
            return
        coordinates = self._site_coordinates(eligible, smallest=2)
        if not coordinates:
            return
        products = self._site_products(args, kwargs, self._side_seed(-7), WHITENING_ROWS)
        with self._objective.one_off():
            _, _, round_sites = site_hessians(
                lambda i, directions: products(measured[i], directions), len(measured), coordinates,
                state.consensus,
            )  # fmt: skip
        if round_sites:
            self._set_round_sites_scale(round_sites)
            self._apply_step_sizes()

    def _set_round_sites_scale(self, round_sites: list[torch.Tensor]) -> None:
        """Give the sites that a diagonal penalty leaves round the natural constant
        :func:`~pyro_pdvi.infer.step_sizes.round_site_scale` (``1.2 / sqrt(n)``, at most 1): a
        stiffer penalty, as the quadratic model of the consensus iteration wants where the
        curvature is round (``docs/benchmarks.md`` 13zd).

        Only where the run's natural constant is the default 1 of a model without local sites
        (:data:`~pyro_pdvi.infer.step_sizes.DEFAULT_SCALES`; :meth:`_may_scale_round_sites`): a
        constant other than 1 that the user gave is kept (``AutoStepSize(scale=1.0)`` counts as
        the default), one whose short solves fit local rows takes a stiffer
        constant everywhere already (:data:`~pyro_pdvi.infer.step_sizes.NATURAL_SCALE_WITH_LOCALS`),
        and the GMM's cluster means, set with discrete rows, were slower with a quarter of it
        (13zc)."""
        if round_sites and self._may_scale_round_sites():
            self._step_sizes.set_site_scale(torch.cat(round_sites), round_site_scale(len(self.partition)))

    def _block_hessian_products(
        self,
        b: int,
        args: tuple,
        kwargs: dict,
        seed: int,
        relative_step: float | None = None,
        max_rows: int | None = None,
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """``V -> V H_b``, block ``b``'s Hessian in the globals at ``lambda_0`` times each row of
        ``V`` (``(k, P)``), at the noise of ``seed`` and the block's rows: by double backward
        through one evaluation, made on the first call and kept by the returned function (a call
        costs one batched backward pass, not a model call:
        :func:`~pyro_pdvi.infer.hessian_products.hessian_products`; drop the function to free the
        graph), or where the model's graph has no second derivative by central differences of the
        gradient, their step ``relative_step`` times ``1 + max|lambda_0|`` (default ``sqrt(eps)``).
        With ``max_rows``, a block of more data is estimated from that many of them, drawn at
        random (by ``seed``), their data term scaled up to the block's (an unbiased estimate)."""
        indices = self.partition.stacked(torch.tensor([b]), self.device)
        weight = 1.0
        if max_rows is not None and indices.shape[-1] > max_rows:
            chosen = torch.randperm(indices.shape[-1], generator=torch.Generator().manual_seed(seed))
            weight = indices.shape[-1] / max_rows
            indices = indices[:, chosen[:max_rows].sort().values.to(indices.device)]
        losses = self._objective.bind(indices, [seed], args, kwargs)
        rows = self._params.rows(indices)
        consensus = self._consensus_params.detach()

        def gradient_at(point: torch.Tensor, create_graph: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
            point = point.detach().requires_grad_()
            copies = {k: v.unsqueeze(0) for k, v in self.layout.unflatten(point).items()}
            loss = weight * losses(copies, rows).sum()
            (gradient,) = torch.autograd.grad(loss, point, create_graph=create_graph)
            return point, gradient

        graph: list[torch.Tensor] = []  # the point and its gradient, built on the first call

        def by_double_backward(directions: torch.Tensor) -> torch.Tensor:
            if not graph:
                graph.extend(gradient_at(consensus, create_graph=True))
            point, gradient = graph
            return hessian_products(gradient, point, directions)

        def by_differences(directions: torch.Tensor) -> torch.Tensor:
            step = (relative_step or float(torch.finfo(consensus.dtype).eps) ** 0.5) * (
                1.0 + float(consensus.abs().max())
            )
            return torch.stack(
                [(gradient_at(consensus + step * v)[1] - gradient_at(consensus - step * v)[1]) / (2 * step)
                 for v in directions]
            )  # fmt: skip

        def products(directions: torch.Tensor) -> torch.Tensor:
            if self._second_order is not False:
                try:
                    exact = by_double_backward(directions)
                except RuntimeError:  # an op without a double backward
                    self._second_order = False
                else:
                    if self._second_order:
                        return exact
                    # Checked once: an op whose backward is not differentiable (a custom
                    # autograd.Function marked once_differentiable, as in some Pyro
                    # distributions) drops its share of the products silently.
                    differenced = by_differences(directions)
                    if not bool(torch.isfinite(exact).all() and torch.isfinite(differenced).all()):
                        return differenced
                    error = float((exact - differenced).norm())
                    self._second_order = error <= SECOND_ORDER_TOLERANCE * float(differenced.norm())
                    return exact if self._second_order else differenced
            return by_differences(directions)

        return products

    def _rule_step_sizes(self) -> torch.Tensor:
        """The step sizes of the rule in the state's coordinates: a coupled coordinate's grow
        with its reduced curvature (:mod:`~pyro_pdvi.infer.coupling`)."""
        etas = self._step_sizes.per_coordinate(self._state.consensus)
        return etas if self._coupling is None else etas * self._coupling.step_growth

    def _apply_step_sizes(self) -> None:
        """Take the current step sizes; ``lambda_0`` moves with ``h = H mean(mu)``."""
        self._state.set_step_sizes(self._rule_step_sizes())
        self._write_consensus()
        self.diagnostics["step_sizes"] = self.step_sizes

    def _measure_curvatures(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """Each group's curvature ``L_j`` at ``lambda_0``, max over a few random blocks
        (:meth:`~pyro_pdvi.infer.step_sizes.StepSizes.measure`)."""
        chosen = torch.randperm(len(self.partition), generator=self._rng)[
            : self.auto_step_size.curvature_blocks
        ]
        gradients = [self._reduced_gradient(b, args, kwargs) for b in chosen.tolist()]
        # phi*(lambda) is solved to ~1e-9 (float64): keep finite-difference errors far below the step.
        return self._step_sizes.measure(gradients, self._consensus_params, 1e-3 if self.local_sites else None)

    def _reduced_gradient(self, b: int, args: tuple, kwargs: dict) -> Callable[[torch.Tensor], torch.Tensor]:
        """``lambda -> grad g_b(lambda)`` with ``g_b = min_phi f_b``, at one fixed noise; the
        locals ``phi_b*(lambda)`` come from the solver at a vanishing step size, where the
        augmented Lagrangian pins ``lambda_b`` to ``lambda``."""
        block = torch.tensor([b])
        problem = self._problem(block, [self._draw_seed()], args, kwargs, consensus=self._consensus_params)

        def solve_rows(point: torch.Tensor) -> dict[str, torch.Tensor]:
            if not self.local_sites:
                return {}
            problem.consensus = self.layout.unflatten(point.detach())
            return self.solver.solve(problem).local

        # Finite-difference probes around lambda_0 start from phi*(lambda_0), a short way off.
        problem.local = solve_rows(self._consensus_params)

        def gradient(point: torch.Tensor) -> torch.Tensor:
            rows = solve_rows(point)
            point = point.detach().requires_grad_()
            copies = {k: v.unsqueeze(0) for k, v in self.layout.unflatten(point).items()}
            return torch.autograd.grad(problem.losses(copies, rows).sum(), point)[0]

        return gradient

    def _remeasure(self, args: tuple, kwargs: dict) -> None:
        """Measure the ``"auto"`` groups' curvatures again (``AutoStepSize.remeasure_epochs``)
        and keep the largest so far; ``lambda_0`` moves with ``h = H mean(mu)``."""
        unusable = self._step_sizes.update_curvatures(self._measure_curvatures(args, kwargs))
        if unusable:
            warn_user(
                f"PDVI step {self.num_steps}: re-measured curvature of groups {unusable} is not a "
                "positive finite number; their step sizes are kept",
            )
        self._apply_step_sizes()
        self.diagnostics["curvatures"] = self.curvatures
