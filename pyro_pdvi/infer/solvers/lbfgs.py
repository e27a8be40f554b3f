"""Per-block L-BFGS over ``m`` separable problems in one batched pass, without host syncs:
the one L-BFGS of the package (a single problem is a batch of one).

A step over ``m`` blocks minimises ``m`` independent augmented Lagrangians [1, Alg. 1].
:func:`batched_lbfgs` runs one L-BFGS [2, Alg. 7.5] per block on a stacked ``(m, p)``
variable: every block keeps its own curvature pairs (a ring buffer ``(m, H, p)`` with a
per-block count of valid pairs; the two-loop recursion [2, Alg. 7.4] runs over all
blocks at once and masks the pairs a block does not have), its own trial step length
and its own acceptance. So block ``b``'s iterates are those of the same algorithm run on
block ``b`` alone: one block's rejected step or non-finite value changes no other block.

The objective returns the ``m`` values ``f_b(x_b)``; since they are separable, the
gradient of ``sum_b f_b`` in ``x`` is every block's own gradient, row by row.

Line search without host synchronisation. A backtracking search [2, Alg. 3.1] asks a
question of the values (``f_new <= ...?``) before it chooses the next trial, which on a
GPU is a device-to-host copy per trial. Here each iteration makes exactly one evaluation,
at every block's current trial step ``x_b + t_b d_b``, and decides per block with
``torch.where``:

* accept where the step is finite and satisfies Armijo's condition
  ``f_new <= f + c1 <g_b, x_new - x_b>`` (``x_new - x_b = t_b d_b`` unless a box clips
  it) [2, eq. 3.4], or where ``f_new`` did not rise
  beyond the rounding of ``f`` and the gradient norm fell: an Armijo test on function
  values cannot resolve steps once ``f - f*`` is below the rounding of ``f``
  (``~ eps |f|``), which would cap the solve at ``|grad| ~ sqrt(eps)``; then store the
  pair ``(s, y)`` if ``<s, y> > 0`` (relative to ``|s| |y|``) and reset ``t_b`` to 1;
* otherwise keep ``x_b`` and shorten ``t_b`` by the factor that quadratic interpolation of
  ``f`` along the rejected step gives, kept within ``[0.1, 0.5]`` (a half where the
  quadratic has no minimiser or the value is not finite) [2, Sec. 3.5], so the next
  iteration tries the next backtracking point of the same direction (the direction depends
  only on ``g_b`` and the history, neither of which changed). After ``max_backtracks``
  rejections in a row the block stops.

This is backtracking Armijo line search spread over iterations: every accepted step
satisfies the same sufficient-decrease test as in a nested search, so the usual descent
argument holds block by block; an iteration only costs one evaluation, and a rejection
costs that block one iteration (not every block, as in a joint line search over the sum).
Blocks that converged (``max |grad| <= tolerance_grad``), whose value or gradient at the
start is not finite, or that gave up, are frozen: they are evaluated at their current
point (the batch is evaluated as a whole) and nothing of theirs changes.

The loop runs ``max_iter`` iterations, none of which reads a tensor value on the host
(no ``.item()``, ``bool()``, ``float()``, Python ``if`` on a tensor). ``check_every=k``
asks once every ``k`` iterations whether any block is still running and stops if none
is; frozen blocks never change, so this changes the cost and not the result.

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
[2] Nocedal, Wright (2006), "Numerical Optimization", 2nd ed., Springer: Alg. 7.4
    (two-loop recursion), Alg. 7.5 (L-BFGS), eq. 7.20 (initial Hessian scaling),
    Alg. 3.1 and eq. 3.4 (backtracking, Armijo condition), Sec. 3.5 (interpolation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...checks import check_positive_int

#: Armijo's sufficient-decrease constant ``c1`` [2, eq. 3.4].
ARMIJO = 1e-4

#: A rejected step is shortened by the factor that interpolation gives, within these bounds
#: [2, Sec. 3.5]: one rejection, not several halvings, where a quasi-Newton step overshoots by
#: 8x (measured: the first Barzilai-Borwein step of a block with per-datum latents,
#: ``docs/benchmarks.md`` 13n).
BACKTRACK_BOUNDS = (0.1, 0.5)


@dataclass
class BatchedLBFGSResult:
    """What :func:`batched_lbfgs` returns (all tensors on the device of ``x0``).

    :param x: the last accepted point of each block, shape ``(m, p)``.
    :param value: ``f_b`` there, shape ``(m,)``.
    :param grad: the gradient there, shape ``(m, p)``.
    :param converged: whether ``max |grad_b| <= tolerance_grad`` (finite), shape ``(m,)``.
    :param accepted_steps: accepted steps per block, shape ``(m,)``.
    :param evaluations: calls of the objective (each evaluates all ``m`` blocks).
    """

    x: torch.Tensor
    value: torch.Tensor
    grad: torch.Tensor
    converged: torch.Tensor
    accepted_steps: torch.Tensor
    evaluations: int


def _two_loop_direction(
    grad: torch.Tensor,
    steps: torch.Tensor,
    grad_changes: torch.Tensor,
    curvatures: torch.Tensor,
    head: torch.Tensor,
    count: torch.Tensor,
    max_pairs: int,
) -> torch.Tensor:
    """``-H_b g_b`` for every block by the two-loop recursion [2, Alg. 7.4], each block
    with its own ``count[b]`` newest pairs; with no pair, ``-g_b / max(1, |g_b|_1)``.

    :param grad: ``(m, p)``.
    :param steps: ring buffer of ``s`` pairs, ``(m, H, p)``.
    :param grad_changes: ring buffer of ``y`` pairs, ``(m, H, p)``.
    :param curvatures: ``<s, y>`` of each slot, ``(m, H)``.
    :param head: each block's next slot to write, ``(m,)``.
    :param count: each block's number of valid pairs, ``(m,)``.
    :param max_pairs: a bound on ``count`` known on the host (at most one pair is stored
        per iteration); the pairs beyond it would all be masked out.
    """
    m, history, p = steps.shape
    q = -grad
    unscaled_norm = grad.abs().sum(1).clamp(min=1.0)[:, None]
    if max_pairs == 0:
        return q / unscaled_norm
    # Slots of each block's max_pairs newest pairs, newest first. Indexing by long tensors
    # copies whole rows of p (faster than an element-wise gather) and reads no value on the host.
    order = (head[:, None] - 1 - torch.arange(max_pairs, device=grad.device)) % history
    blocks = torch.arange(m, device=grad.device)[:, None]
    s_ordered = steps[blocks, order]
    y_ordered = grad_changes[blocks, order]
    sy_ordered = curvatures[blocks, order]
    # rho = 1 / s'y, and 0 for the pairs a block does not have: their alpha and beta are
    # then 0 and leave q exactly as it is.
    valid = torch.arange(max_pairs, device=grad.device)[None, :] < count[:, None]
    rho = torch.where(valid, 1.0 / sy_ordered, grad.new_zeros(()))
    alphas = []
    for k in range(max_pairs):
        alpha = torch.linalg.vecdot(s_ordered[:, k], q) * rho[:, k]
        q = torch.addcmul(q, alpha[:, None], y_ordered[:, k], value=-1)
        alphas.append(alpha)
    y_newest = y_ordered[:, 0]
    scaled = q * (sy_ordered[:, 0] / torch.linalg.vecdot(y_newest, y_newest))[:, None]  # [2, eq. 7.20]
    q = torch.where((count > 0)[:, None], scaled, q / unscaled_norm)
    for k in reversed(range(max_pairs)):
        beta = torch.linalg.vecdot(y_ordered[:, k], q) * rho[:, k]
        q = torch.addcmul(q, (alphas[k] - beta)[:, None], s_ordered[:, k])
    return q


def _backtracking_factor(value: torch.Tensor, trial_value: torch.Tensor, slope: torch.Tensor) -> torch.Tensor:
    """The factor by which each rejected block shortens its step: the minimiser of the quadratic
    through ``f(x)``, the slope ``<g, s>`` and ``f(x + s)`` along the rejected step ``s``
    [2, Sec. 3.5, quadratic interpolation], kept within :data:`BACKTRACK_BOUNDS`; half the
    step where that quadratic has no minimiser in front (or the trial value is not finite).

    :param value: ``f`` at each block's point, ``(m,)``.
    :param trial_value: ``f`` at its rejected trial point, ``(m,)``.
    :param slope: ``<g, trial - x>``, ``(m,)``.
    """
    curvature = trial_value - value - slope
    factor = -slope / (2 * curvature)
    usable = torch.isfinite(trial_value) & torch.isfinite(factor) & (curvature > 0) & (slope < 0)
    low, high = BACKTRACK_BOUNDS
    return torch.where(usable, factor, torch.full_like(factor, high)).clamp(low, high)


def batched_lbfgs(
    objective: Callable[[torch.Tensor], torch.Tensor],
    x0: torch.Tensor,
    max_iter: int,
    history_size: int = 20,
    tolerance_grad: float = 1e-11,
    max_backtracks: int = 30,
    check_every: int | None = None,
    box: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> BatchedLBFGSResult:
    """Minimise ``m`` separable objectives at once, one L-BFGS per block (module docstring).

    :param objective: ``objective(x)`` for ``x`` of shape ``(m, p)`` returns the ``m``
        values ``f_b(x_b)``, shape ``(m,)``, differentiable in ``x``; block ``b``'s value
        may depend on row ``b`` only. It should return non-finite values (not raise) at a
        point outside the domain: a ``ValueError`` (e.g. Pyro's argument validation) at a
        trial point cannot be told apart by block, so it counts as a rejection for every
        running block.
    :param x0: the start, shape ``(m, p)``.
    :param max_iter: iterations; each is one evaluation of the objective.
    :param history_size: curvature pairs kept per block (``H``).
    :param tolerance_grad: a block stops when ``max |grad_b| <= tolerance_grad``.
    :param max_backtracks: a block stops after this many rejected trial steps in a row.
    :param check_every: if set, stop early, once every ``check_every`` iterations, when no
        block is running (one host synchronisation per check; the result is the same).
        ``None`` (default): never read a value on the host.
    :param box: ``box(g0) -> w``, half-widths ``(m, p)`` (``inf`` or NaN: unbounded) of a
        box ``|x - x0| <= w`` around the start, from the gradient there: every trial point is
        clipped into it, and Armijo's test uses the clipped step.
    :returns: the :class:`BatchedLBFGSResult`.
    """
    if x0.dim() != 2:
        raise ValueError(f"Invalid x0: expected shape (m, p), got {tuple(x0.shape)}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 0:
        raise ValueError(f"Invalid max_iter: {max_iter!r}; use a non-negative int")
    check_positive_int(history_size, "history_size")
    check_positive_int(max_backtracks, "max_backtracks")
    if check_every is not None:
        check_positive_int(check_every, "check_every")
    m, p = x0.shape

    def evaluate(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            value = objective(leaf)
            if value.shape != (m,):
                raise ValueError(
                    f"Invalid objective: it must return one value per block, shape ({m},), "
                    f"got {tuple(value.shape)}"
                )
            (grad,) = torch.autograd.grad(value.sum(), leaf, allow_unused=True)
        return value.detach(), grad if grad is not None else torch.zeros_like(leaf)

    x = x0.detach().clone()
    value, grad = evaluate(x)
    evaluations = 1
    device, dtype = x.device, x.dtype
    steps = x.new_zeros(m, history_size, p)
    grad_changes = x.new_zeros(m, history_size, p)
    curvatures = x.new_ones(m, history_size)
    head = torch.zeros(m, dtype=torch.long, device=device)
    count = torch.zeros(m, dtype=torch.long, device=device)
    step_length = x.new_ones(m)
    rejections = torch.zeros(m, dtype=torch.long, device=device)
    accepted_steps = torch.zeros(m, dtype=torch.long, device=device)
    stopped = ~(torch.isfinite(value) & torch.isfinite(grad).all(1))
    if box is not None:
        # A block whose start gradient is not finite is frozen: no box, whose NaN bounds would
        # make its trial points NaN (an objective that validates its input raises for all).
        width = box(grad).nan_to_num(nan=torch.inf)
        lower, upper = x - width, x + width
    roundoff = 16 * torch.finfo(dtype).eps

    def running() -> torch.Tensor:
        return ~stopped & ~(grad.abs().amax(1) <= tolerance_grad)

    for iteration in range(max_iter):
        active = running()
        direction = _two_loop_direction(
            grad, steps, grad_changes, curvatures, head, count, min(iteration, history_size)
        )
        # Not a descent direction: restart that block from scaled steepest descent.
        restart = ~((grad * direction).sum(1) < 0)
        count = torch.where(restart, 0, count)
        steepest = -grad / grad.abs().sum(1).clamp(min=1.0)[:, None]
        direction = torch.where(restart[:, None], steepest, direction)

        trial = torch.where(active[:, None], x + step_length[:, None] * direction, x)
        if box is not None:
            trial = torch.minimum(torch.maximum(trial, lower), upper)
        try:
            trial_value, trial_grad = evaluate(trial)
        except ValueError:
            # Outside the support somewhere, and the batch cannot say where: reject all.
            trial_value, trial_grad = torch.full_like(value, torch.inf), grad
        evaluations += 1

        finite = torch.isfinite(trial_value) & torch.isfinite(trial_grad).all(1)
        # A clipped step may not be a descent step: then it must not rise at all.
        slope = (grad * (trial - x)).sum(1)
        armijo = trial_value <= value + ARMIJO * slope.clamp(max=0)
        rounding = (trial_value <= value + roundoff * (1 + value.abs())) & (
            trial_grad.norm(dim=1) < grad.norm(dim=1)
        )
        accept = active & finite & (armijo | rounding)
        reject = active & ~accept

        s = trial - x
        y = trial_grad - grad
        sy = (s * y).sum(1)
        store = accept & (sy > 1e-12 * s.norm(dim=1) * y.norm(dim=1))
        # Write slot head[b] of the blocks that store a pair (gather/scatter: no host reads).
        slot = head[:, None, None].expand(m, 1, p)
        steps.scatter_(1, slot, torch.where(store[:, None, None], s[:, None], steps.gather(1, slot)))
        grad_changes.scatter_(
            1, slot, torch.where(store[:, None, None], y[:, None], grad_changes.gather(1, slot))
        )
        curvatures.scatter_(
            1, head[:, None], torch.where(store[:, None], sy[:, None], curvatures.gather(1, head[:, None]))
        )
        head = torch.where(store, (head + 1) % history_size, head)
        count = torch.where(store, (count + 1).clamp(max=history_size), count)

        shorter = _backtracking_factor(value, trial_value, slope) * step_length
        x = torch.where(accept[:, None], trial, x)
        value = torch.where(accept, trial_value, value)
        grad = torch.where(accept[:, None], trial_grad, grad)
        step_length = torch.where(accept, 1.0, torch.where(reject, shorter, step_length))
        rejections = torch.where(accept, 0, rejections + reject.long())
        accepted_steps = accepted_steps + accept.long()
        stopped = stopped | (rejections >= max_backtracks)
        if check_every is not None and (iteration + 1) % check_every == 0 and not bool(running().any()):
            break

    converged = torch.isfinite(grad).all(1) & (grad.abs().amax(1) <= tolerance_grad)
    return BatchedLBFGSResult(x, value, grad, converged, accepted_steps, evaluations)
