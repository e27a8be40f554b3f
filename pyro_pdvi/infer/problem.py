"""The primal subproblems of one step: each block's augmented Lagrangian [1, Alg. 1-3]

    L_b(phi_b, lambda_b) = f_b(phi_b, lambda_b) + <mu_b, lambda_b - lambda_0>
                           + 1/2 ||lambda_b - lambda_0||^2_D,

for the ``m >= 1`` blocks ``b`` of a step, stacked along a leading block axis: one block
is a batch of one. A :class:`~pyro_pdvi.infer.solvers.BlockSolver` takes a
:class:`BlockProblem` and returns a :class:`BlockSolution`. The blocks' subproblems are
independent given ``lambda_0`` [1, Alg. 1], so a solver may solve them in one vectorized
pass or one by one (:meth:`BlockProblem.block`); the result must be the same.

All values are in Pyro's unconstrained space, as dicts keyed by param site name. Global
sites (``lambda``) are shaped ``(m, *site_shape)`` in the dual and the solution and
``site_shape`` (shared) in ``consensus`` and ``step_sizes``; a local site's rows
(``phi_b``) are shaped ``(m, *rows_shape)``, ``rows_shape`` the site's shape with the
block's ``s`` rows along its plate axis.

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from pyro.optim import PyroOptim

if TYPE_CHECKING:
    from .objective import BlockLosses


@dataclass
class BlockProblem:
    """The augmented Lagrangians of ``m`` equal-size blocks of one step.

    :param blocks: the block ids, shape ``(m,)``.
    :param indices: their data indices, shape ``(m, s)``.
    :param consensus: ``lambda_0`` for each global site (shared by the blocks).
    :param dual: ``mu_b`` for each global site, shape ``(m, *site_shape)``.
    :param step_sizes: ``eta`` per coordinate, shaped like each global site
        (``D = diag(1 / eta)``).
    :param local: warm starts ``phi_b`` for each local site, ``(m, *rows_shape)``.
    :param num_blocks: n.
    :param num_data: N.
    :param losses: the blocks' ``f_b`` through the Pyro model, guide and loss at this
        step's fixed Monte Carlo noise (what a generic solver minimises; a closed-form
        solver does not need it).
    :param optim: the user's :class:`pyro.optim.PyroOptim`, for a solver that steps with it.
    :param args: the positional arguments of the step.
    :param kwargs: the keyword arguments of the step.
    :param categorical_rows: local sites whose rows are the logits of an enumerated
        categorical guide factor, whose exact update is closed form
        (:mod:`~pyro_pdvi.infer.local_cavi`), checked on the first block.
    :param held: for some global sites, a boolean mask shaped like the site of the coordinates
        that the solve must hold at ``lambda_0`` (their copies equal ``lambda_0``: a scale set by
        :mod:`~pyro_pdvi.infer.scales`); a generic solver respects it, a closed-form solver is
        never given one.
    :param owns_concentrated: for each block, whether it informs some coordinate that no other
        block informs (``ConsensusState.concentrated``, such as its group's random effect): that
        coordinate moves only when the block steps, so a solver may solve such a block more
        exactly. ``None``: not known (before every block was measured, or at vanishing step sizes).
    """

    blocks: torch.Tensor
    indices: torch.Tensor
    consensus: dict[str, torch.Tensor]
    dual: dict[str, torch.Tensor]
    step_sizes: dict[str, torch.Tensor]
    local: dict[str, torch.Tensor]
    num_blocks: int
    num_data: int
    losses: BlockLosses | None = None
    optim: PyroOptim | None = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    categorical_rows: tuple[str, ...] = ()
    held: dict[str, torch.Tensor] = field(default_factory=dict)
    owns_concentrated: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.indices.shape[0]

    def block(self, i: int) -> BlockProblem:
        """The ``i``-th block as a problem of its own (a batch of one; views, no copies)."""
        keep = slice(i, i + 1)
        return replace(
            self,
            blocks=self.blocks[keep],
            indices=self.indices[keep],
            dual={k: v[keep] for k, v in self.dual.items()},
            local={k: v[keep] for k, v in self.local.items()},
            losses=None if self.losses is None else self.losses.select(i),
            owns_concentrated=None if self.owns_concentrated is None else self.owns_concentrated[keep],
        )

    def penalty(self, copies: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each block's ``<mu_b, lambda_b - lambda_0> + 1/2 ||lambda_b - lambda_0||^2_D``,
        shape ``(m,)``, for copies shaped ``(m, *site_shape)``."""
        total = 0.0
        for name, value in copies.items():
            diff = value - self.consensus[name]
            terms = self.dual[name] * diff + 0.5 * diff.square() / self.step_sizes[name]
            total = total + terms.reshape(len(terms), -1).sum(1)
        return total

    def whitened_copies(self, whitened: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``lambda_b = lambda_0 + sqrt(eta) * z_b`` for whitened ``z_b`` of shape
        ``(m, *site_shape)``: in ``z`` the penalty's quadratic is ``1/2 ||z_b||^2``, so the
        subproblem stays well conditioned whatever the step sizes are. Held coordinates stay at
        ``lambda_0`` (their ``z`` has no effect and gets a zero gradient)."""
        return {
            k: self.consensus[k]
            + self.step_sizes[k].sqrt() * (z.masked_fill(self.held[k], 0.0) if k in self.held else z)
            for k, z in whitened.items()
        }

    def hold(self, copies: dict[str, torch.Tensor]) -> None:
        """Put the held coordinates of ``copies`` (``(m, *site_shape)``) back at ``lambda_0``, in place."""
        with torch.no_grad():
            for k, mask in self.held.items():
                copies[k].copy_(torch.where(mask, self.consensus[k], copies[k]))


class SiteViews(dict):
    """Per-site views of one flat tensor ``(m, P)`` of global copies, which they keep
    (:attr:`flat`): a consumer that needs the flat form (the coupling's map,
    :class:`~pyro_pdvi.infer.coupling.CoupledLosses`) takes it instead of concatenating the views
    again.

    :param flat: the copies, ``(m, P)``, sites in the order of the views.
    :param views: ``{site: (m, *site_shape)}`` views of ``flat``.
    """

    def __init__(self, flat: torch.Tensor, views: dict[str, torch.Tensor]) -> None:
        super().__init__(views)
        self.flat = flat


class WhitenedGlobals:
    """A problem's global copies in the flat whitened coordinates of a solve,
    ``lambda_b = lambda_0 + sqrt(eta) z_b`` with the held coordinates at ``lambda_0``, and the
    penalty ``<mu_b, lambda_b - lambda_0> + 1/2 ||lambda_b - lambda_0||^2_D``, which in ``z_b`` is
    ``<sqrt(eta) mu_b, z_b> + 1/2 ||z_b||^2``: the same values as
    :meth:`BlockProblem.whitened_copies` and :meth:`BlockProblem.penalty`, in a few operations on
    ``(m, P)`` tensors instead of several per site. An L-BFGS solve evaluates them, forward and
    backward, at every evaluation: on the suite's random-effects model (14 sites) the per-site form
    took about 200 operations against the model graph's 345 (``docs/benchmarks.md`` 13v).

    :param problem: the step's subproblems.
    """

    def __init__(self, problem: BlockProblem) -> None:
        num_blocks = len(problem)
        self.shapes = {k: v.shape for k, v in problem.consensus.items()}
        self.sizes = [shape.numel() for shape in self.shapes.values()]

        like = next(iter({**problem.consensus, **problem.local}.values()))

        def flat(values: dict[str, torch.Tensor]) -> torch.Tensor:
            parts = [torch.broadcast_to(values[k], shape).reshape(-1) for k, shape in self.shapes.items()]
            return torch.cat(parts) if parts else like.new_zeros(0)

        self.consensus = flat(problem.consensus).detach()
        self.root_eta = flat(problem.step_sizes).detach().sqrt()
        #: ``1`` where the solve moves a coordinate, ``0`` where it holds it; ``None``: none held.
        self.free = None
        if problem.held:
            device = self.consensus.device
            held = flat({k: torch.as_tensor(problem.held.get(k, False), device=device) for k in self.shapes})
            self.free = (~held).to(self.consensus.dtype)
        duals = [problem.dual[k].reshape(num_blocks, -1) for k in self.shapes]
        duals = torch.cat(duals, dim=1) if duals else like.new_zeros(num_blocks, 0)
        self.scaled_duals = (duals * self.root_eta).detach()

    @property
    def size(self) -> int:
        """``P``, the number of global coordinates."""
        return sum(self.sizes)

    def copies(self, whitened: torch.Tensor) -> tuple[SiteViews, torch.Tensor]:
        """The copies and each block's penalty at whitened ``z_b``.

        :param whitened: ``(m, P)``.
        :returns: ``lambda_b`` as :class:`SiteViews` of a flat ``(m, P)`` tensor, and the penalty,
            ``(m,)``.
        """
        if self.free is not None:
            whitened = whitened * self.free
        flat = self.consensus + self.root_eta * whitened
        penalty = (self.scaled_duals * whitened).sum(1) + 0.5 * whitened.square().sum(1)
        return self.views(flat), penalty

    def views(self, flat: torch.Tensor) -> SiteViews:
        """Per-site views of ``flat`` (``(m, P)``)."""
        parts = flat.split(self.sizes, dim=1)
        views = {k: part.reshape(len(flat), *shape) for (k, shape), part in zip(self.shapes.items(), parts)}
        return SiteViews(flat, views)


@dataclass
class BlockSolution:
    """What a solver returns for a :class:`BlockProblem`.

    :param globals: ``lambda_b`` for each global site, shape ``(m, *site_shape)``.
    :param local: the new ``phi_b`` for each local site, shaped like ``problem.local``.
    :param loss: ``f_b`` at each solution, shape ``(m,)``, if the solver knows it (else
        PDVI evaluates it).
    :param held_gradients: for the sites of ``problem.held``, the gradient of ``f_b`` in the held
        coordinates at each solution, shape ``(m, *site_shape)`` (zero elsewhere), if the solver
        knows it (else PDVI evaluates it for :mod:`~pyro_pdvi.infer.scales`); a block's entries
        are NaN where the solver lost track of it.
    """

    globals: dict[str, torch.Tensor]
    local: dict[str, torch.Tensor]
    loss: torch.Tensor | None = None
    held_gradients: dict[str, torch.Tensor] | None = None
