"""The changes Pyro 1.9's ELBOs need to run under :func:`torch.func.vmap`, scoped to a
``with`` block (:func:`vmap_compatible_pyro`).

:class:`~pyro_pdvi.infer.objective.BlockObjective` maps one block's objective ``f_b`` over
``m`` stacked blocks with ``vmap`` (its vectorized kernel). Pyro 1.9's ELBOs do a few things
inside the loss that ``vmap`` refuses (measured with pyro-ppl 1.9.2, torch 2.13): validation
checks that branch on tensor values; ``torch_item`` (``.item()``) and ``warn_if_nan`` (a
backward hook) on the loss; ``pyro.ops.special``'s safe-log ``autograd.Function`` of the old
style; ``EnumMessenger`` reading ``value.data``; ``Dice.compute_expectation`` branching on
``(prob > 0).all()`` and calling ``masked_select``; torch's normal samplers filling an
unbatched tensor in place, which ``randomness="different"`` refuses. Inside the ``with``
block each is swapped for a version that behaves the same outside ``vmap`` and batches
inside it; on exit everything is put back. A graph recording (:mod:`~pyro_pdvi.infer.graphs`)
needs the same changes, for every tensor: :func:`graph_recording_pyro`.
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
from pyro.poutine.runtime import Message
from torch.overrides import TorchFunctionMode

#: Set while :func:`graph_recording_pyro` records a graph: every tensor is then treated as a
#: mapped one (no ``.item()``, no NaN hook, no branch on a mask's values).
_recording = False


def _is_vmapped(value: Any) -> bool:
    """Whether ``value`` is a tensor of a ``torch.func`` transform (batched or grad-tracking), or
    any tensor while a graph is recorded."""
    return isinstance(value, torch.Tensor) and (
        _recording or torch._C._functorch.is_functorch_wrapped_tensor(value)
    )


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
      across blocks, becomes ``where(mask, x, 0)`` in ``x``'s shape. Its only use there is a
      sum of ``prob * cost`` over the masked entries, which the zeros leave unchanged
      (value and gradient), while ``0 * inf`` never arises. Kept in ``x``'s shape (not
      flattened), the sum adds the same numbers in the same order as Pyro's path for a mask
      without zeros, so that a recorded graph equals Pyro's evaluation to the last bit. Flattened,
      the two differed by rounding that grows with the particles: 1.9e-5 relative in float32 on
      the suite's GMM with 64 particles (blocks of 1,000), enough to fail the replay's check.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.all and not kwargs and len(args) == 1 and _is_vmapped(args[0]):
            # While recording, the branch on the mask's values takes its masked side, which the
            # where() below makes right for any mask.
            return False if _recording else _unwrapped(args[0]).all()
        if func is torch.Tensor.masked_select and any(_is_vmapped(a) for a in args):
            value, mask = args
            return torch.where(mask, value, value.new_zeros(()))
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


@contextlib.contextmanager
def graph_recording_pyro() -> Iterator[None]:
    """:func:`vmap_compatible_pyro` for a graph recording (:mod:`~pyro_pdvi.infer.graphs`),
    which may not read a tensor's value: every tensor is treated as a mapped one inside the
    ``with`` block."""
    global _recording
    with vmap_compatible_pyro():
        _recording = True
        try:
            yield
        finally:
            _recording = False
