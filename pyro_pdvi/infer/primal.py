"""The primal step: approximately minimise one block's augmented Lagrangian

    L_b(phi_b, lambda_b) = f_b(phi_b, lambda_b) + <mu_b, lambda_b - lambda_0>
                           + 1/2 ||lambda_b - lambda_0||^2_D        [1, Alg. 2-3]

The dual update assumes a good argmin, so the default is L-BFGS (:func:`lbfgs`)
on the block objective, the Monte Carlo noise held fixed
within one solve (see :class:`~pyro_pdvi.infer.handlers.FixedNoise`). A model
with a closed-form or coordinate-descent solve (the paper's recommendation)
plugs it in as a :data:`LocalSolver`: a callable from :class:`BlockProblem`
to :class:`BlockSolution`.

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from pyro.optim import PyroOptim
from pyro.params.param_store import (
    module_from_param_with_module_name,
    normalize_param_name,
    user_param_name,
)

INNER_SOLVERS = ("lbfgs", "optim")


@dataclass
class BlockProblem:
    """One block's augmented-Lagrangian subproblem, handed to a local solver.

    All values are in Pyro's unconstrained space, as dicts keyed by site name.

    :param block: the block id ``b``.
    :param indices: the block's data indices.
    :param consensus: ``lambda_0`` for each global site.
    :param dual: ``mu_b`` for each global site.
    :param step_sizes: ``eta`` for each coordinate, shaped like each global
        site (``D = diag(1/eta)``).
    :param local: warm start ``phi_b``: the block's rows of each local site,
        taken with ``index_select`` along the site's plate axis (the axis stays where it is).
    :param num_blocks: n.
    :param num_data: N.
    :param args: the positional arguments of the step.
    :param kwargs: the keyword arguments of the step.
    """

    block: int
    indices: torch.Tensor
    consensus: dict[str, torch.Tensor]
    dual: dict[str, torch.Tensor]
    step_sizes: dict[str, torch.Tensor]
    local: dict[str, torch.Tensor]
    num_blocks: int
    num_data: int
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def penalty(self, copies: dict[str, torch.Tensor]) -> torch.Tensor:
        """``<mu_b, lambda_b - lambda_0> + 1/2 ||lambda_b - lambda_0||^2_D``."""
        total = 0.0
        for name, value in copies.items():
            diff = value - self.consensus[name]
            total = (
                total + (self.dual[name] * diff).sum() + 0.5 * (diff.square() / self.step_sizes[name]).sum()
            )
        return total


@dataclass
class BlockSolution:
    """What a local solver returns.

    :param globals: the block copy ``lambda_b`` for each global site.
    :param local: the new ``phi_b`` rows for each local site, shaped like ``problem.local``.
    :param loss: ``f_b`` at the solution (a scalar tensor), if the solver knows it.
    """

    globals: dict[str, torch.Tensor]
    local: dict[str, torch.Tensor]
    loss: torch.Tensor | None = None


LocalSolver = Callable[[BlockProblem], BlockSolution]


@dataclass
class BlockBatch:
    """The subproblems of ``m`` equal-size blocks of one step, stacked along a new
    leading axis, for a local solver that solves them in one vectorized pass.

    A local solver that has a method ``solve_batch(batch: BlockBatch) ->
    BlockBatchSolution`` gets one call per step over several equal-size blocks
    instead of ``m`` calls of ``__call__``; the blocks' subproblems are independent
    given ``lambda_0`` [1, Alg. 1], so the result must equal the loop over
    :meth:`problem`.

    :param blocks: the block ids, shape ``(m,)``.
    :param indices: their data indices, shape ``(m, s)``.
    :param consensus: ``lambda_0`` for each global site (shared, no batch axis).
    :param dual: ``mu_b`` for each global site, shape ``(m, *site_shape)``.
    :param step_sizes: ``eta`` for each coordinate, shaped like each global site.
    :param local: warm starts ``phi_b`` for each local site, shape ``(m, *rows_shape)``
        where ``rows_shape`` is the site's shape with ``s`` rows along its plate axis.
    :param num_blocks: n.
    :param num_data: N.
    :param args: the positional arguments of the step.
    :param kwargs: the keyword arguments of the step.
    """

    blocks: torch.Tensor
    indices: torch.Tensor
    consensus: dict[str, torch.Tensor]
    dual: dict[str, torch.Tensor]
    step_sizes: dict[str, torch.Tensor]
    local: dict[str, torch.Tensor]
    num_blocks: int
    num_data: int
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return self.indices.shape[0]

    def problem(self, i: int) -> BlockProblem:
        """The ``i``-th block's :class:`BlockProblem` (views, no copies)."""
        return BlockProblem(
            block=int(self.blocks[i]),
            indices=self.indices[i],
            consensus=self.consensus,
            dual={k: v[i] for k, v in self.dual.items()},
            step_sizes=self.step_sizes,
            local={k: v[i] for k, v in self.local.items()},
            num_blocks=self.num_blocks,
            num_data=self.num_data,
            args=self.args,
            kwargs=self.kwargs,
        )

    def penalty(self, copies: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each block's ``<mu_b, lambda_b - lambda_0> + 1/2 ||lambda_b - lambda_0||^2_D``,
        shape ``(m,)``, for copies of shape ``(m, *site_shape)``."""
        total = 0.0
        for name, value in copies.items():
            diff = value - self.consensus[name]
            terms = self.dual[name] * diff + 0.5 * diff.square() / self.step_sizes[name]
            total = total + terms.reshape(len(terms), -1).sum(1)
        return total


@dataclass
class BlockBatchSolution:
    """What ``solve_batch`` returns: :class:`BlockSolution` fields stacked over the batch.

    :param globals: ``lambda_b`` for each global site, shape ``(m, *site_shape)``.
    :param local: the new ``phi_b`` for each local site, shaped like ``batch.local``.
    :param loss: ``f_b`` at each solution, shape ``(m,)``, if the solver knows it.
    """

    globals: dict[str, torch.Tensor]
    local: dict[str, torch.Tensor]
    loss: torch.Tensor | None = None


def lbfgs(
    objective: Callable[[], torch.Tensor],
    params: list[torch.Tensor],
    max_iter: int,
    history_size: int = 20,
    tolerance_grad: float = 1e-11,
) -> None:
    """L-BFGS with a backtracking line search that stays exact near the optimum.

    An Armijo test on function values cannot resolve steps once ``f - f*`` is
    below the rounding of ``f`` (``~ eps |f|``), which caps a function-value
    line search (torch's strong Wolfe included) at ``|grad| ~ sqrt(eps)``. A
    step is therefore also accepted when ``f`` did not rise beyond its rounding
    and the gradient norm fell, so the solve can go on to ``tolerance_grad``.

    :param objective: closure returning the scalar objective (no side effects
        besides reading ``params``).
    :param params: leaf tensors, updated in place.
    :param max_iter: iterations (each one or more evaluations).
    :param history_size: number of curvature pairs kept.
    :param tolerance_grad: stop when ``max |grad| <= tolerance_grad``.
    """

    def evaluate(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            offset = 0
            for p in params:
                p.copy_(x[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        with torch.enable_grad():
            value = objective()
            grads = torch.autograd.grad(value, params, allow_unused=True)
        flat = torch.cat(
            [(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)]
        )
        return value.detach(), flat

    x = torch.cat([p.detach().reshape(-1) for p in params])
    f, g = evaluate(x)
    roundoff = 16 * torch.finfo(x.dtype).eps
    s_hist: list[torch.Tensor] = []
    y_hist: list[torch.Tensor] = []
    for _ in range(max_iter):
        if not bool(torch.isfinite(g).all()) or float(g.abs().max()) <= tolerance_grad:
            break
        # Two-loop recursion for d = -H g.
        q = -g
        alphas = []
        for s_k, y_k in zip(reversed(s_hist), reversed(y_hist)):
            a = (s_k @ q) / (y_k @ s_k)
            q = q - a * y_k
            alphas.append(a)
        if s_hist:
            q = q * ((s_hist[-1] @ y_hist[-1]) / (y_hist[-1] @ y_hist[-1]))
        else:
            q = q / max(1.0, float(g.abs().sum()))
        for (s_k, y_k), a in zip(zip(s_hist, y_hist), reversed(alphas)):
            q = q + (a - (y_k @ q) / (y_k @ s_k)) * s_k
        direction = q
        slope = g @ direction
        if not slope < 0:  # not a descent direction: restart from steepest descent
            s_hist.clear()
            y_hist.clear()
            direction = -g / max(1.0, float(g.abs().sum()))
            slope = g @ direction
        step, accepted = 1.0, False
        for _ in range(30):
            x_new = x + step * direction
            try:
                f_new, g_new = evaluate(x_new)
            except ValueError:
                # A trial point outside the model's support (Pyro's argument validation, e.g.
                # a scale that overflowed) counts as f = +inf: backtrack.
                step *= 0.5
                continue
            if bool(torch.isfinite(f_new)) and (
                f_new <= f + 1e-4 * step * slope
                or (f_new <= f + roundoff * (1 + f.abs()) and g_new.norm() < g.norm())
            ):
                accepted = True
                break
            step *= 0.5
        if not accepted:
            evaluate(x)  # leave params at the last accepted point
            break
        s_k, y_k = x_new - x, g_new - g
        if (s_k @ y_k) > 1e-12 * s_k.norm() * y_k.norm():
            s_hist.append(s_k)
            y_hist.append(y_k)
            if len(s_hist) > history_size:
                s_hist.pop(0)
                y_hist.pop(0)
        x, f, g = x_new, f_new, g_new


def minimize(
    objective: Callable[[], torch.Tensor],
    leaves: dict[str, torch.Tensor],
    solver: str,
    num_steps: int,
    optim: PyroOptim | None = None,
) -> None:
    """Minimise ``objective()`` over ``leaves`` in place.

    :param objective: closure returning the scalar to minimise.
    :param leaves: site name -> leaf tensor with ``requires_grad``.
    :param solver: ``"lbfgs"`` (:func:`lbfgs`, ``num_steps`` iterations at most)
        or ``"optim"`` (``num_steps`` steps of a fresh torch optimizer built from
        the PyroOptim's constructor and arguments).
    :param num_steps: iterations.
    :param optim: the PyroOptim for ``solver="optim"``.
    """
    params = list(leaves.values())
    if not params:
        return
    if solver == "lbfgs":
        lbfgs(objective, params, num_steps)
        return
    param_groups = [{"params": [p], **_optim_args(optim, name)} for name, p in leaves.items()]
    inner = optim.pt_optim_constructor(param_groups)
    for _ in range(num_steps):
        inner.zero_grad()
        objective().backward()
        inner.step()
    for p in params:
        p.grad = None


def _optim_args(optim: PyroOptim, site: str) -> dict:
    """The PyroOptim's arguments for one site, including per-param callables."""
    args = optim.pt_optim_args
    if not callable(args):
        return dict(args)
    if optim.pt_optim_args_argc == 1:
        return args(normalize_param_name(site))
    return args(module_from_param_with_module_name(site), user_param_name(site))
