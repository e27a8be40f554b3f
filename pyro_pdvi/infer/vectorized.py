"""Several blocks' primal steps in one vectorized pass, by :func:`torch.func.vmap`.

A step over ``m`` blocks solves ``m`` independent augmented Lagrangians [1, Alg. 1]:
given ``lambda_0`` they share nothing. The generic path solves them in a Python loop,
one Pyro loss per evaluation; here the ``m`` blocks' copies ``lambda_b`` and rows
``phi_b`` are stacked along a new leading axis and the Pyro loss is mapped over that
axis by ``torch.func.vmap``, so one evaluation of the model and guide gives all ``m``
block objectives ``f_b`` (:class:`BatchedBlockObjective`).

The blocks' problems are independent, so :class:`VectorizedBlockSolver` solves each as
its own: with L-BFGS, one L-BFGS per block, all in one batched pass without host
synchronisation (:func:`~pyro_pdvi.infer.lbfgs.batched_lbfgs`: its own history, step
length and acceptance per block); with the PyroOptim (coordinate-wise, so identical to
the loop) by one optimizer over all blocks' variables. It returns a
:class:`~pyro_pdvi.infer.primal.BlockBatchSolution`.

Pyro 1.9's ELBOs do a few things inside the loss that ``vmap`` refuses (measured with
pyro-ppl 1.9.2, torch 2.13): validation checks that branch on tensor values;
``torch_item`` (``.item()``) and ``warn_if_nan`` (a backward hook) on the loss;
``pyro.ops.special``'s safe-log ``autograd.Function`` of the old style;
``EnumMessenger`` reading ``value.data``; ``Dice.compute_expectation`` branching on
``(prob > 0).all()`` and calling ``masked_select``; torch's normal samplers filling an
unbatched tensor in place, which ``randomness="different"`` refuses; and
``TraceEnum_ELBO`` checking ``loss.requires_grad``, which is false inside ``vmap`` (so
the gradient is taken inside, by ``torch.func.grad_and_value``).
:func:`vmap_compatible_pyro` swaps the first six, for the duration of a ``with`` block
only, for versions that behave the same outside ``vmap`` and batch inside it. And
``pyro.plate`` slices a local param by the subsample indices itself, which would need
every block's copy of the full ``(N, ...)`` param: :class:`BlockRowsOverride` serves
the block's rows already sliced instead.

Measured on CPU (``docs/benchmarks.md``), the gain is Python overhead: large where a
block's objective is cheap (small blocks, the per-datum variant), none where the
arithmetic of each block dominates.

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pyro
import pyro.infer.trace_elbo
import pyro.infer.trace_mean_field_elbo
import pyro.infer.traceenum_elbo
import pyro.infer.tracegraph_elbo
import pyro.infer.util
import pyro.ops.special
import pyro.poutine.enum_messenger
import torch
import torch.distributions.lowrank_multivariate_normal
import torch.distributions.multivariate_normal
import torch.distributions.normal
import torch.distributions.studentT
from pyro.optim import PyroOptim
from pyro.poutine.messenger import Messenger
from pyro.poutine.runtime import Message
from torch.distributions import constraints, transform_to
from torch.overrides import TorchFunctionMode

from ..errors import VectorizationError
from .handlers import BlockSubsample, FixedNoise, ParamOverride
from .lbfgs import batched_lbfgs
from .primal import INNER_SOLVERS, BlockBatch, BlockBatchSolution, minimize
from .sites import DataPlate, GlobalLayout, LocalSite

#: ``randomness=`` values of :func:`torch.func.vmap` that PDVI accepts.
RANDOMNESS = ("different", "same")


def _is_vmapped(value: Any) -> bool:
    """Whether ``value`` is a tensor of a ``torch.func`` transform (batched or grad-tracking)."""
    return isinstance(value, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(value)


def _unwrapped(value: torch.Tensor) -> torch.Tensor:
    """The plain tensor under all ``torch.func`` wrappers (for a batched one, with its batch dim)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(value):
        value = torch._C._functorch.get_unwrapped(value)
    return value


def _make_torch_item(original: Callable) -> Callable:
    def torch_item(x):
        # Inside vmap the loss is a batched tensor with no single value; ELBOs use the
        # item only as a constant (``surrogate - item(surrogate)``), which detach() is.
        return x.detach() if _is_vmapped(x) else original(x)

    return torch_item


def _make_warn_if_nan(original: Callable) -> Callable:
    def warn_if_nan(value, msg="", **kwargs):
        # A backward hook on a batched tensor is refused; the engine checks f_b itself.
        return value if _is_vmapped(value) else original(value, msg, **kwargs)

    return warn_if_nan


class _SafeLog(torch.autograd.Function):
    """``log`` whose gradient is clamped at ``1/eps`` (as ``pyro.ops.special.safe_log``),
    written with ``setup_context`` so that ``vmap`` can batch it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.log()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad / x.clamp(min=torch.finfo(x.dtype).eps)


class _DataView:
    """A tensor seen through an object whose ``.data`` is the tensor itself.

    ``EnumMessenger._pyro_post_sample`` reads ``value.data.shape``, which ``vmap``
    forbids on a batched tensor; the shape of ``.data`` is the tensor's own shape.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self.data = tensor

    def __getattr__(self, name: str) -> Any:
        return getattr(self.data, name)


def _standard_normal(shape, dtype, device) -> torch.Tensor:
    # torch's version fills an unbatched tensor in place (``empty(shape).normal_()``),
    # which vmap refuses with randomness="different"; randn draws the same numbers.
    return torch.randn(shape, dtype=dtype, device=device)


#: torch.distributions modules that draw their noise with ``_standard_normal``.
_NORMAL_MODULES: tuple[ModuleType, ...] = (
    torch.distributions.normal,
    torch.distributions.multivariate_normal,
    torch.distributions.lowrank_multivariate_normal,
    torch.distributions.studentT,
)


def _make_enum_post_sample(original: Callable) -> Callable:
    def _pyro_post_sample(self, msg: Message) -> None:
        value = msg["value"]
        if not _is_vmapped(value):
            return original(self, msg)
        msg["value"] = _DataView(value)
        try:
            return original(self, msg)
        finally:
            msg["value"] = value

    return _pyro_post_sample


class _MaskFreeExpectation(TorchFunctionMode):
    """Inside ``Dice.compute_expectation`` (TraceEnum_ELBO with enumerated guide sites):

    * ``(prob > 0).all()`` on a batched mask asks one question of all blocks at once,
      instead of branching on a batched value, which ``vmap`` refuses;
    * ``x.masked_select(mask)`` on batched tensors, whose output size would differ
      across blocks, becomes ``where(mask, x, 0)``, flattened. Its only use there is a
      sum of ``prob * cost`` over the masked entries, which the zeros leave unchanged
      (value and gradient), while ``0 * inf`` never arises.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.all and not kwargs and len(args) == 1 and _is_vmapped(args[0]):
            return _unwrapped(args[0]).all()
        if func is torch.Tensor.masked_select and any(_is_vmapped(a) for a in args):
            value, mask = args
            return torch.where(mask, value, value.new_zeros(())).reshape(-1)
        return func(*args, **kwargs)


def _make_compute_expectation(original: Callable) -> Callable:
    def compute_expectation(self, costs):
        with _MaskFreeExpectation():
            return original(self, costs)

    return compute_expectation


_ELBO_MODULES: tuple[ModuleType, ...] = (
    pyro.infer.trace_elbo,
    pyro.infer.trace_mean_field_elbo,
    pyro.infer.tracegraph_elbo,
    pyro.infer.traceenum_elbo,
)


def _replacements() -> list[tuple[Any, str, Any]]:
    """``(owner, attribute, replacement)`` of every patch, built from the current originals."""
    patches: list[tuple[Any, str, Any]] = []
    for module in _ELBO_MODULES:
        if hasattr(module, "torch_item"):
            patches.append((module, "torch_item", _make_torch_item(module.torch_item)))
        if hasattr(module, "warn_if_nan"):
            patches.append((module, "warn_if_nan", _make_warn_if_nan(module.warn_if_nan)))
    for module in _NORMAL_MODULES:
        patches.append((module, "_standard_normal", _standard_normal))
    patches.append((pyro.ops.special, "_SafeLog", _SafeLog))
    enum_messenger = pyro.poutine.enum_messenger.EnumMessenger
    post_sample = enum_messenger.__dict__["_pyro_post_sample"]
    patches.append((enum_messenger, "_pyro_post_sample", _make_enum_post_sample(post_sample)))
    dice = pyro.infer.util.Dice
    patches.append((dice, "compute_expectation", _make_compute_expectation(dice.compute_expectation)))
    return patches


@contextlib.contextmanager
def vmap_compatible_pyro() -> Iterator[None]:
    """Make Pyro's ELBOs mappable by ``torch.func.vmap`` inside the ``with`` block only.

    Inside: Pyro validation (infer, poutine, distributions) is off; the ELBO modules'
    ``torch_item`` and ``warn_if_nan`` leave ``torch.func`` tensors alone;
    ``pyro.ops.special``'s safe-log Function is a ``setup_context`` version with a
    generated vmap rule; ``EnumMessenger`` reads a batched sample's shape without
    ``.data``; ``Dice.compute_expectation`` needs no data-dependent branch or
    ``masked_select``; torch's normal samplers draw with ``randn``. Each replacement
    behaves as the original outside ``vmap``. On exit, also by an exception, every flag
    and attribute is put back as it was.
    """
    patches = _replacements()
    originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    with pyro.validation_enabled(False):
        try:
            for owner, name, replacement in patches:
                setattr(owner, name, replacement)
            yield
        finally:
            for owner, name, original in originals:
                setattr(owner, name, original)


class BlockRowsOverride(Messenger):
    """Serve local params (params inside the data plate with ``event_dim``) from given
    block rows, already sliced, so that the plate does not slice them again.

    :param rows: site name -> the block's unconstrained rows.
    :param site_constraints: site name -> constraint of that param.
    """

    def __init__(self, rows: dict[str, torch.Tensor], site_constraints: dict[str, constraints.Constraint]):
        super().__init__()
        self.rows = rows
        self.site_constraints = site_constraints

    def _pyro_param(self, msg: Message) -> None:
        name = msg["name"]
        if name not in self.rows:
            return
        msg["value"] = transform_to(self.site_constraints[name])(self.rows[name])
        # The plate slices a param's rows in its postprocess only when event_dim is set;
        # this message's value already holds just the block's rows.
        msg["kwargs"] = {**msg["kwargs"], "event_dim": None}
        msg["done"] = True


class BatchedBlockObjective:
    """Evaluate ``f_b`` for ``m`` equal-size blocks in one ``vmap``-ped Pyro loss.

    The result equals ``[BlockObjective(...)(indices[i], copies[i], rows[i], ...) for i]``
    (see :class:`~pyro_pdvi.infer.objective.BlockObjective`), stacked, up to the Monte
    Carlo noise: with ``randomness="different"`` each block draws its own noise from the
    one generator state, with ``"same"`` all blocks share one draw.

    :param model: the Pyro model.
    :param guide: the Pyro guide.
    :param loss_fn: ``loss_fn(model, guide, *args, **kwargs)`` returning a differentiable
        scalar (an ELBO's ``differentiable_loss``).
    :param plate: the data plate.
    :param layout: layout of the global params.
    :param local_sites: the local param sites.
    :param randomness: ``randomness=`` of :func:`torch.func.vmap`.
    """

    def __init__(
        self,
        model: Callable,
        guide: Callable,
        loss_fn: Callable[..., torch.Tensor],
        plate: DataPlate,
        layout: GlobalLayout,
        local_sites: list[LocalSite],
        randomness: str = "different",
    ) -> None:
        if randomness not in RANDOMNESS:
            raise ValueError(f"Invalid randomness: {randomness!r}; use one of {RANDOMNESS}")
        self.model = model
        self.guide = guide
        self.loss_fn = loss_fn
        self.plate = plate
        self.layout = layout
        self.local_sites = local_sites
        self.randomness = randomness
        self.global_constraints = {s.name: s.constraint for s in layout.sites}
        self.local_constraints = {s.name: s.constraint for s in local_sites}

    def __call__(
        self,
        indices: torch.Tensor,
        copies: dict[str, torch.Tensor],
        rows: dict[str, torch.Tensor],
        args: tuple,
        kwargs: dict,
    ) -> torch.Tensor:
        """The ``m`` block objectives, shape ``(m,)``, differentiable in ``copies`` and ``rows``.

        :param indices: the blocks' data indices, shape ``(m, s)``.
        :param copies: unconstrained ``lambda_b`` per global site, shape ``(m, *site_shape)``.
        :param rows: unconstrained ``phi_b`` per local site, shape ``(m, *rows_shape)`` with
            the block's ``s`` rows along the site's plate axis.
        :param args: positional arguments of model and guide.
        :param kwargs: keyword arguments of model and guide.
        :raises VectorizationError: when ``vmap`` cannot map the model, guide or loss.
        """
        copy_names, row_names = list(copies), list(rows)
        return _MappedLossAndGradient.apply(
            self, indices, copy_names, row_names, args, kwargs, *copies.values(), *rows.values()
        )

    def losses_and_gradients(
        self,
        indices: torch.Tensor,
        copies: dict[str, torch.Tensor],
        rows: dict[str, torch.Tensor],
        args: tuple,
        kwargs: dict,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The ``m`` block objectives and their gradients in ``copies`` and ``rows`` (each
        block's own), by ``vmap(grad_and_value(f_b))``.

        The gradient is taken inside ``vmap`` (not by autograd around it) because inside
        ``vmap`` a tensor does not report ``requires_grad``, which ``TraceEnum_ELBO``
        checks of its loss; inside ``grad_and_value`` it does.

        :returns: losses ``(m,)``, gradients shaped like ``copies`` and like ``rows``.
        """
        scale = indices.shape[1] / self.plate.size

        def block_objective(block_copies, block_rows, block_indices):
            def run_blocked(fn: Callable) -> Callable:
                fn = ParamOverride(block_copies, self.global_constraints)(fn)
                fn = BlockRowsOverride(block_rows, self.local_constraints)(fn)
                return BlockSubsample(self.plate.name, block_indices)(fn)

            loss = self.loss_fn(run_blocked(self.model), run_blocked(self.guide), *args, **kwargs)
            return loss * scale

        mapped = torch.func.vmap(
            torch.func.grad_and_value(block_objective, argnums=(0, 1)), randomness=self.randomness
        )
        try:
            with vmap_compatible_pyro(), torch.enable_grad():
                (copy_grads, row_grads), losses = mapped(copies, rows, indices)
        except (RuntimeError, NotImplementedError) as error:
            raise VectorizationError(
                "torch.func.vmap could not evaluate the model, guide and loss over "
                f"{indices.shape[0]} stacked blocks ({type(error).__name__}: {error}). Vectorized "
                "blocks need a model and guide without data-dependent Python control flow, "
                "`.item()` or in-place writes into captured tensors; use PDVI(..., "
                "vectorize_blocks=False) for this model."
            ) from error
        return losses, copy_grads, row_grads


class _MappedLossAndGradient(torch.autograd.Function):
    """The block losses as a differentiable function of the stacked copies and rows,
    with the per-block gradients from :meth:`BatchedBlockObjective.losses_and_gradients`
    (first order: enough for L-BFGS and torch optimizers)."""

    @staticmethod
    def forward(ctx, objective, indices, copy_names, row_names, args, kwargs, *tensors):
        copies = dict(zip(copy_names, (t.detach() for t in tensors)))
        rows = dict(zip(row_names, (t.detach() for t in tensors[len(copy_names) :])))
        losses, copy_grads, row_grads = objective.losses_and_gradients(indices, copies, rows, args, kwargs)
        ctx.save_for_backward(*copy_grads.values(), *row_grads.values())
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        grads = tuple(
            grad_losses.reshape(grad_losses.shape + (1,) * (g.dim() - 1)) * g for g in ctx.saved_tensors
        )
        return (None,) * 6 + grads


class VectorizedBlockSolver:
    """The generic primal solve of a step's equal-size blocks in one vectorized pass.

    With ``inner_solver="lbfgs"`` every block runs its own L-BFGS
    (:func:`~pyro_pdvi.infer.lbfgs.batched_lbfgs`) on its globals, whitened as in the
    loop, ``lambda_b = lambda_0 + sqrt(eta) z_b``, and its rows; a block's iterates do
    not depend on the other blocks. With ``"optim"`` one torch optimizer minimises
    ``sum_b L_b`` over all blocks' variables; it is coordinate-wise, so it takes the
    steps the loop would.

    :param objective: the batched block objective.
    :param inner_solver: ``"lbfgs"`` or ``"optim"``.
    :param inner_steps: iterations of each block's solve (for ``"lbfgs"``: evaluations,
        one per iteration, rejected trial steps included).
    :param optim: the PyroOptim for ``inner_solver="optim"``.
    """

    def __init__(
        self,
        objective: BatchedBlockObjective,
        inner_solver: str = "lbfgs",
        inner_steps: int = 20,
        optim: PyroOptim | None = None,
    ) -> None:
        if inner_solver not in INNER_SOLVERS:
            raise ValueError(f"Invalid inner_solver: {inner_solver!r}; use one of {INNER_SOLVERS}")
        self.objective = objective
        self.inner_solver = inner_solver
        self.inner_steps = inner_steps
        self.optim = optim

    def solve_batch(self, batch: BlockBatch, noise: FixedNoise | None = None) -> BlockBatchSolution:
        """Solve the batch's subproblems; the Monte Carlo noise of ``noise`` is held
        fixed for every evaluation (none: the global generator as it is, for
        deterministic objectives).

        :param batch: the stacked subproblems.
        :param noise: the noise of this step's solve.
        """
        num_blocks = len(batch)
        consensus = {k: v.expand(num_blocks, *v.shape) for k, v in batch.consensus.items()}

        def block_losses(copies: dict[str, torch.Tensor], rows: dict[str, torch.Tensor]) -> torch.Tensor:
            with noise() if noise is not None else contextlib.nullcontext():
                return self.objective(batch.indices, copies, rows, batch.args, batch.kwargs)

        if self.inner_solver == "lbfgs":
            copies, rows = self._solve_by_lbfgs(batch, consensus, block_losses)
        else:
            free = {k: v.detach().clone().requires_grad_() for k, v in consensus.items()}
            leaves = {k: v.detach().clone().requires_grad_() for k, v in batch.local.items()}

            def augmented_lagrangians() -> torch.Tensor:
                return (block_losses(free, leaves) + batch.penalty(free)).sum()

            # The PyroOptim's torch optimizer is coordinate-wise: it takes the loop's steps.
            minimize(
                augmented_lagrangians, {**free, **leaves}, self.inner_solver, self.inner_steps, self.optim
            )
            copies = {k: v.detach() for k, v in free.items()}
            rows = {k: v.detach() for k, v in leaves.items()}
        # TraceEnum_ELBO's differentiable_loss refuses a loss that nothing requires grad of.
        losses = block_losses({k: v.clone().requires_grad_() for k, v in copies.items()}, rows)
        return BlockBatchSolution(copies, rows, losses.detach())

    def _solve_by_lbfgs(
        self,
        batch: BlockBatch,
        consensus: dict[str, torch.Tensor],
        block_losses: Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Every block's own L-BFGS (:func:`~pyro_pdvi.infer.lbfgs.batched_lbfgs`) on its
        whitened globals ``z_b`` and its rows, flattened into row ``b`` of one ``(m, p)``
        variable. On a CPU the solve stops as soon as every block has stopped (a host
        read costs nothing there); elsewhere it runs ``inner_steps`` iterations without
        reading a value on the host.

        :returns: the copies ``lambda_b`` and rows ``phi_b`` at the solution (detached).
        """
        num_blocks = len(batch)
        # Whitened globals, lambda_b = lambda_0 + sqrt(eta) * z_b, as in the loop.
        root = {k: v.sqrt() for k, v in batch.step_sizes.items()}
        shapes = {k: v.shape[1:] for k, v in consensus.items()}
        shapes.update({k: v.shape[1:] for k, v in batch.local.items()})
        sizes = [shape.numel() for shape in shapes.values()]
        start = torch.cat(
            [v.new_zeros(num_blocks, v[0].numel()) for v in consensus.values()]
            + [v.detach().reshape(num_blocks, -1) for v in batch.local.values()],
            dim=1,
        )

        def unpack(x: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
            parts = {
                k: part.reshape(num_blocks, *shape)
                for (k, shape), part in zip(shapes.items(), x.split(sizes, dim=1))
            }
            copies = {k: consensus[k] + root[k] * parts[k] for k in consensus}
            return copies, {k: parts[k] for k in batch.local}

        def augmented_lagrangians(x: torch.Tensor) -> torch.Tensor:
            copies, rows = unpack(x)
            return block_losses(copies, rows) + batch.penalty(copies)

        check_every = 1 if start.device.type == "cpu" else None
        result = batched_lbfgs(augmented_lagrangians, start, self.inner_steps, check_every=check_every)
        with torch.no_grad():
            copies, rows = unpack(result.x)
        return copies, rows
