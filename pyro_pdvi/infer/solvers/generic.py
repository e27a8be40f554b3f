"""The primal solve for any Pyro model: each block's augmented Lagrangian through the model,
guide and loss (:class:`~pyro_pdvi.infer.objective.BlockObjective`), with the step's Monte
Carlo noise held fixed, so that a quasi-Newton method sees a deterministic objective.

:class:`GenericSolver` is PDVI's default solver. With ``method="lbfgs"`` every block runs
its own L-BFGS (:func:`~pyro_pdvi.infer.solvers.lbfgs.batched_lbfgs`: own history, step
length and acceptance) on its whitened globals ``z_b`` (``lambda_b = lambda_0 + sqrt(eta)
z_b``, :class:`~pyro_pdvi.infer.problem.WhitenedGlobals`) and its rows, all
blocks in one batched pass; the blocks' objectives come from the loop kernel or, with
``vectorize=True``, from one ``vmap``-ped evaluation. With ``method="optim"`` the user's
:class:`pyro.optim.PyroOptim` takes ``inner_steps`` steps on every block's variables (its
torch optimizer is coordinate-wise, so the blocks do not interact).
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from math import inf

import torch
from pyro.optim import PyroOptim
from pyro.params.param_store import (
    module_from_param_with_module_name,
    normalize_param_name,
    user_param_name,
)

from ...checks import check_positive_int
from ..local_cavi import categorical_update
from ..problem import BlockProblem, BlockSolution, SiteViews, WhitenedGlobals
from .lbfgs import batched_lbfgs

METHODS = ("lbfgs", "optim")

#: Whitened move every global coordinate may make in one L-BFGS solve beyond ``trust * |g_j|``.
TRUST_FLOOR = 1e-3

#: ``trust="auto"``: this box for solves of at most :data:`AUTO_TRUST_MAX_STEPS` evaluations.
AUTO_TRUST = 2.0
AUTO_TRUST_MAX_STEPS = 5


class GenericSolver:
    """Minimise each block's augmented Lagrangian through the Pyro model (module docstring).

    :param inner_steps: with ``"lbfgs"``, evaluations of the block objectives per solve
        (one per L-BFGS iteration, rejected trial steps included); with ``"optim"``,
        optimizer steps. The default 3 is an inexact, warm-started solve (the dual update keeps
        the fixed point): at an equal 20 CPU-s on the label-sorted logistic regression it beat 5
        evaluations, and 20 (the earlier default) cost 5x as much per epoch
        (``docs/benchmarks.md``, section 13). Exact solves, which the tests of exact optima use,
        need more.
    :param concentrated_steps: the evaluations (or optimizer steps) of a solve in which some
        block owns concentrated coordinates (``problem.owns_concentrated``: coordinates that only
        this block informs, such as its group's random intercept and slope), if more than
        ``inner_steps`` (with the trust box that ``inner_steps`` sets). Such a coordinate moves
        only when its block steps, so there the short
        solve is no longer corrected by the other blocks' steps: on the suite's random-effects
        model, whose groups each see their own range of x (an intercept and slope that the data
        tie together), three evaluations left the rms error of the means at 0.14 after 14
        epochs and five brought it to 0.045 (``docs/benchmarks.md``, 13m).
    :param vectorize: evaluate a problem of several blocks in one ``torch.func.vmap`` pass
        instead of a loop (:mod:`~pyro_pdvi.infer.objective`; one block is always a plain
        evaluation). Faster for many small blocks, slower for large ones
        (``docs/benchmarks.md``, section 6); a model that ``vmap`` cannot map raises
        :class:`~pyro_pdvi.errors.VectorizationError` on the first such step.
    :param trust: with ``"lbfgs"``, a box around the start for the block's globals: in the
        whitened coordinates ``z_b`` (where the penalty's curvature is 1) coordinate ``j``
        moves at most ``trust * |g_j| + 1e-3`` in one solve, ``g`` the augmented Lagrangian's
        gradient at the start. An exact solve of an objective that is convex and separable
        in the globals moves at most ``|g_j|``: the box is there for the moves that a few
        L-BFGS iterations make along a coordinate the block barely informs, carried by a
        direction the other coordinates set (measured on the full-size generic GMM: a
        log-variance moved by 87 in one 3-evaluation solve, and the run collapsed a scale;
        ``docs/benchmarks.md``, section 13f). It also binds on sound solves: it made the
        logistic regression, PPCA and the hierarchical model of the suite 1.3-1.8x less
        accurate at equal CPU s, the scale regression 3.4x more (13f). ``None``: no box.
        ``"auto"`` (default): a box of :data:`AUTO_TRUST` for inexact solves
        (``inner_steps <= 5``), none for longer ones, which are left to their line search:
        where locals couple to the globals the start's gradient does not bound the exact
        solve's move (measured: the exact-solve tests on the quadratic of App. C.3 miss their
        1e-8 tolerance with a box of 2).
    :param local_cavi: before the solve, set the rows of every enumerated categorical local
        factor (``problem.categorical_rows``) to their exact mean-field update at ``lambda_0``
        (:mod:`~pyro_pdvi.infer.local_cavi`; one evaluation per such site). Measured on the
        suite's full-size generic GMM: W2/W2* 1.0 after 240 CPU s, against 70 without it and
        2.1 for the best SVI+Adam (``docs/benchmarks.md``, section 13g). ``False``: those rows
        are solved with the rest.
    """

    def __init__(
        self,
        inner_steps: int = 3,
        concentrated_steps: int = 5,
        method: str = "lbfgs",
        vectorize: bool = False,
        trust: float | str | None = "auto",
        local_cavi: bool = True,
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"Invalid method: {method!r}; use one of {METHODS}")
        if not isinstance(vectorize, bool):
            raise ValueError(f"Invalid vectorize: {vectorize!r}; use True or False")
        if not isinstance(local_cavi, bool):
            raise ValueError(f"Invalid local_cavi: {local_cavi!r}; use True or False")
        self.local_cavi = local_cavi
        self.inner_steps = check_positive_int(inner_steps, "inner_steps")
        self.concentrated_steps = check_positive_int(concentrated_steps, "concentrated_steps")
        self.method = method
        self.vectorize = vectorize
        if trust == "auto":
            trust = AUTO_TRUST if self.inner_steps <= AUTO_TRUST_MAX_STEPS else None
        finite_positive = isinstance(trust, (int, float)) and not isinstance(trust, bool) and 0 < trust < inf
        if trust is not None and not finite_positive:
            raise ValueError(f'Invalid trust: {trust!r}; use a positive float, "auto" or None')
        self.trust = None if trust is None else float(trust)

    def __repr__(self) -> str:
        return (
            f"GenericSolver(inner_steps={self.inner_steps}, concentrated_steps={self.concentrated_steps}, "
            f"method={self.method!r}, vectorize={self.vectorize}, trust={self.trust}, "
            f"local_cavi={self.local_cavi})"
        )

    def solve(self, problem: BlockProblem) -> BlockSolution:
        """Solve the problem's blocks through ``problem.losses``.

        :param problem: the step's subproblems, with their objective bound.
        :returns: ``lambda_b``, ``phi_b`` and ``f_b`` of every block.
        :rtype: BlockSolution
        """
        if problem.losses is None:
            raise ValueError("GenericSolver needs problem.losses, the blocks' objective through the model")
        vectorize = self.vectorize and len(problem) > 1
        if self.local_cavi and problem.categorical_rows:
            problem = replace(problem, local=categorical_update(problem, problem.categorical_rows, vectorize))
        steps = self.steps_for(problem)
        if self.method == "lbfgs":
            return self._solve_by_lbfgs(problem, vectorize, steps)
        return self._solve_by_optim(problem, vectorize, steps)

    def steps_for(self, problem: BlockProblem) -> int:
        """The evaluations (or optimizer steps) of this problem's solve: ``concentrated_steps``
        where some block owns concentrated coordinates, if more than ``inner_steps``."""
        owns = problem.owns_concentrated
        if owns is not None and bool(owns.any()):
            return max(self.inner_steps, self.concentrated_steps)
        return self.inner_steps

    def _solve_by_lbfgs(self, problem: BlockProblem, vectorize: bool, steps: int) -> BlockSolution:
        num_blocks = len(problem)
        whitened = WhitenedGlobals(problem)
        num_globals = whitened.size
        row_shapes = [(k, v.shape[1:]) for k, v in problem.local.items()]
        row_sizes = [shape.numel() for _, shape in row_shapes]
        start = torch.cat(
            [whitened.consensus.new_zeros(num_blocks, num_globals)]
            + [v.detach().reshape(num_blocks, -1) for v in problem.local.values()],
            dim=1,
        )

        def unpack(x: torch.Tensor) -> tuple[SiteViews, dict[str, torch.Tensor], torch.Tensor]:
            """The copies, the rows and the penalty at ``x`` (whitened globals, then rows)."""
            copies, penalty = whitened.copies(x[:, :num_globals])
            parts = x[:, num_globals:].split(row_sizes, dim=1)
            rows = {k: part.reshape(num_blocks, *shape) for (k, shape), part in zip(row_shapes, parts)}
            return copies, rows, penalty

        tape = HeldGradientTape(problem.held, whitened)

        def augmented_lagrangians(x: torch.Tensor) -> torch.Tensor:
            copies, rows, penalty = unpack(x)
            tape.watch(x, copies.flat)
            return problem.losses(copies, rows, vectorize) + penalty

        # On a CPU a host read costs nothing: stop as soon as every block has stopped.
        check_every = 1 if start.device.type == "cpu" else None
        num_globals = sum(v.numel() for v in problem.consensus.values())

        def box(grad: torch.Tensor) -> torch.Tensor:
            """Half-widths of the trust box: the globals' (``trust``), none for the rows."""
            width = torch.full_like(grad, float("inf"))
            width[:, :num_globals] = self.trust * grad[:, :num_globals].abs() + TRUST_FLOOR
            return width

        # Trial points outside the model's domain belong to the line search, which rejects them
        # (and a start that is not finite fails the step with a message that names the block):
        # Pyro's "Encountered NaN" warnings from their evaluation would only alarm the user.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Encountered NaN", category=UserWarning)
            result = batched_lbfgs(
                augmented_lagrangians,
                start,
                steps,
                check_every=check_every,
                box=None if self.trust is None else box,
            )
        with torch.no_grad():
            copies, rows, penalty = unpack(result.x)
            losses = result.value - penalty
        return BlockSolution(dict(copies), rows, losses, tape.at(result.x))

    def _solve_by_optim(self, problem: BlockProblem, vectorize: bool, steps: int) -> BlockSolution:
        optim = problem.optim
        if not isinstance(optim, PyroOptim):
            raise ValueError('GenericSolver(method="optim") needs the PDVI\'s optim, a pyro.optim.PyroOptim')
        num_blocks = len(problem)
        copies = {
            k: v.detach().expand(num_blocks, *v.shape).clone().requires_grad_()
            for k, v in problem.consensus.items()
        }
        rows = {k: v.detach().clone().requires_grad_() for k, v in problem.local.items()}
        variables = {**copies, **rows}
        inner = optim.pt_optim_constructor(
            [{"params": [p], **_optim_args(optim, name)} for name, p in variables.items()]
        )
        for _ in range(steps):
            inner.zero_grad()
            (problem.losses(copies, rows, vectorize) + problem.penalty(copies)).sum().backward()
            inner.step()
            problem.hold(copies)
        losses = problem.losses(copies, rows, vectorize)
        held_gradients = None
        if problem.held:
            held = list(problem.held)
            gradients = torch.autograd.grad(losses.sum(), [copies[k] for k in held], allow_unused=True)
            held_gradients = {
                k: torch.zeros_like(copies[k]) if g is None else g.masked_fill(~problem.held[k], 0.0)
                for k, g in zip(held, gradients)
            }
        return BlockSolution(
            {k: v.detach() for k, v in copies.items()},
            {k: v.detach() for k, v in rows.items()},
            losses.detach(),
            held_gradients,
        )


class HeldGradientTape:
    """The gradient of the blocks' objective in the held coordinates (``problem.held``) at each
    evaluation of an L-BFGS solve, kept with the point evaluated, so that the one at every block's
    solution can be handed on: the scales' fixed point (:mod:`~pyro_pdvi.infer.scales`) reads the
    blocks' ``h_b`` from it without another model call. The solve itself sees a zero gradient
    there (the coordinates stay at ``lambda_0``); the penalty adds the held duals, which are zero.

    :param held: the problem's held masks, per global site.
    :param whitened: the solve's flat globals (their layout and which coordinates are held).
    """

    def __init__(self, held: dict[str, torch.Tensor], whitened: WhitenedGlobals) -> None:
        self.held = held
        self.whitened = whitened
        self._held_mask = None if whitened.free is None else whitened.free == 0
        self.points: list[torch.Tensor] = []
        #: The held part of the gradient at each point, ``None`` until its backward pass ran.
        self.gradients: list[torch.Tensor | None] = []

    def watch(self, x: torch.Tensor, copies: torch.Tensor) -> None:
        """Record, when the gradient of this evaluation at ``x`` is taken, its held part.

        :param copies: the flat copies ``(m, P)`` evaluated at ``x``.
        """
        if not self.held:
            return
        index = len(self.points)
        self.points.append(x.detach())
        self.gradients.append(None)
        held = self._held_mask

        def keep(grad: torch.Tensor) -> None:
            self.gradients[index] = grad.detach().masked_fill(~held, 0.0)

        copies.register_hook(keep)

    def at(self, x: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The recorded gradients at each block's row of ``x`` (an evaluated point), NaN for a
        block whose point was not evaluated with a gradient; ``None`` with nothing held."""
        complete = [e for e, gradient in enumerate(self.gradients) if gradient is not None]
        if not self.held or not complete:
            return None
        match = torch.stack([(self.points[e] == x).all(1) for e in complete])  # (E, m)
        order = torch.arange(1, len(complete) + 1, device=x.device)[:, None]
        latest = (match * order).argmax(0)  # the last evaluation at each block's point
        blocks = torch.arange(x.shape[0], device=x.device)
        stacked = torch.stack([self.gradients[e] for e in complete])[latest, blocks]
        chosen = torch.where(match.any(0)[:, None], stacked, torch.nan)
        return {k: v for k, v in self.whitened.views(chosen).items() if k in self.held}


def _optim_args(optim: PyroOptim, site: str) -> dict:
    """The PyroOptim's arguments for one site, including per-param callables."""
    args = optim.pt_optim_args
    if not callable(args):
        return dict(args)
    if optim.pt_optim_args_argc == 1:
        return args(normalize_param_name(site))
    return args(module_from_param_with_module_name(site), user_param_name(site))
