"""A recording of torch operations as a straight-line Python function: graph replay's recorder
(:mod:`~pyro_pdvi.infer.graphs`).

:class:`Recorder` is a :class:`~torch.utils._python_dispatch.TorchDispatchMode`: inside its
``with`` block every torch operation runs on real tensors as usual and is noted as one
:class:`Step` (the ATen operation, its arguments with each tensor replaced by a reference to
an input, a constant, or an earlier step's output). Below autograd, so the operations noted are
the forward ones, which autograd differentiates again when the function runs.

:meth:`Recorder.program` gives the noted steps as a :class:`Program`, simplified before it is
compiled to a Python function:

* common subexpressions: an operation that repeats an earlier one on the same references and
  values is dropped and its uses read the earlier output (Pyro computes a scale's log, a
  distribution's standardised value, for the guide's and the model's log-densities alike);
  only in a program without in-place operations, where no output changes after it is made;
* dead code: an operation whose output nothing returned depends on is dropped (the ELBO's
  bookkeeping, log-densities that the chosen estimator does not use), unless it mutates a
  tensor, draws from a generator (dropping a draw would shift every later one), or returns
  nothing.

On the suite's random-effects model that removes 191 of 536 operations (13r); the outputs are
the same operations on the same values, so equal to the last bit. The compiled function is one
line per operation, each calling the operation object directly, and frees each intermediate
after its last use. There a recording with its check measured 29-37 ms against 42-50 ms with
``torch.fx``'s graphs, used before (their node bookkeeping and code generation), and a forward
replay 1.3-1.6 ms against 2.7-3.5 ms.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Python values written into a compiled program as literals; every other value (a float, a
#: dtype, a device) is passed to it as a named constant, exactly.
_LITERALS = (bool, int, str, type(None))


class DataDependentError(RuntimeError):
    """The model read a tensor's value in Python (``.item()``, ``bool``), which a recording of
    torch operations cannot replay."""


class Ref(NamedTuple):
    """A tensor in a program: input ``a{i}``, constant ``c{i}`` or step output ``v{i}`` (item
    ``item`` of it where the step returns several tensors).

    :param name: the variable's name.
    :param step: the index of the step that makes it, ``None`` for an input or constant.
    :param item: which of the step's outputs, ``None`` where it returns one tensor.
    """

    name: str
    step: int | None = None
    item: int | None = None

    def code(self) -> str:
        return self.name if self.item is None else f"{self.name}[{self.item}]"


@dataclass
class Step:
    """One recorded operation: ``op(*args, **kwargs)``, tensors in them as :class:`Ref`."""

    op: Callable
    args: tuple
    kwargs: dict

    def __post_init__(self) -> None:
        #: The tensors it reads.
        self.reads = _refs_in(self.args) + _refs_in(tuple(self.kwargs.values()))

    @property
    def pure(self) -> bool:
        """Whether it can be dropped or merged: it mutates nothing, draws nothing and returns
        something."""
        return _is_pure(self.op)


@functools.cache
def _is_pure(op: Callable) -> bool:
    schema = getattr(op, "_schema", None)
    return (
        schema is not None
        and not schema.is_mutable
        and len(schema.returns) > 0
        and torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ())
    )


@dataclass
class Program:
    """Recorded steps over ``inputs`` inputs, returning ``output``.

    :param steps: the operations in order (a dropped one is ``None``).
    :param inputs: the number of inputs.
    :param constants: the tensors the steps read that are not inputs (the data, a model's
        constants), named ``c0, c1, ...``.
    :param output: what the program returns.
    """

    steps: list[Step | None]
    inputs: int
    constants: list[torch.Tensor]
    output: Ref

    def without_common_subexpressions(self) -> Program:
        """Each pure step that repeats an earlier one (same operation, references and values)
        dropped, its uses reading the earlier output. A step whose output is later written in
        place is never merged; unchanged where a write could change a value read elsewhere (a
        written tensor that is an input, a constant, or read by another step: a view of it
        could be)."""
        kept = [step for step in self.steps if step is not None]
        if any(getattr(step.op, "_schema", None) is None for step in kept):
            return self
        written = [ref for step in kept for ref in _written(step)]
        uses: dict[Ref, int] = {}
        for step in kept:
            for ref in step.reads:
                uses[ref] = uses.get(ref, 0) + 1
        # The steps that made each written tensor, through the views it is of (an ``empty``,
        # a ``detach`` of it, then ``normal_``: how torch.distributions draws noise).
        fresh: set[int] = set()
        while written:
            ref = written.pop()
            if ref.step is None or uses[ref] > 1:
                return self
            fresh.add(ref.step)
            written.extend(_viewed(self.steps[ref.step]))
        first: dict[tuple, int] = {}
        renamed: dict[str, Ref] = {}
        steps: list[Step | None] = []
        for index, step in enumerate(self.steps):
            if step is None:
                steps.append(None)
                continue
            if any(ref.name in renamed for ref in step.reads):
                step = Step(step.op, _renamed(step.args, renamed), _renamed(step.kwargs, renamed))
            key = _key(step) if step.pure and index not in fresh else None
            if key is not None and key in first:
                renamed[f"v{index}"] = Ref(f"v{first[key]}", first[key])
                steps.append(None)
                continue
            if key is not None:
                first[key] = index
            steps.append(step)
        return Program(steps, self.inputs, self.constants, _renamed(self.output, renamed))

    def without_dead_code(self) -> Program:
        """Each pure step whose output the returned value does not depend on dropped."""
        needed = {self.output.step}
        steps: list[Step | None] = [None] * len(self.steps)
        for index in reversed(range(len(self.steps))):
            step = self.steps[index]
            if step is None or (step.pure and index not in needed):
                continue
            steps[index] = step
            needed.update(ref.step for ref in step.reads)
        return Program(steps, self.inputs, self.constants, self.output)

    def compile(self) -> Callable[..., torch.Tensor]:
        """The program as a Python function of its inputs: one line per step, each intermediate
        deleted after its last use."""
        namespace: dict[str, Any] = {f"c{i}": constant for i, constant in enumerate(self.constants)}
        op_names: dict[Callable, str] = {}
        last_use: dict[str, int] = {}
        for index, step in enumerate(self.steps):
            for ref in step.reads if step is not None else ():
                last_use[ref.name] = index

        def code(value: Any) -> str:
            if isinstance(value, Ref):
                return value.code()
            if isinstance(value, (list, tuple)):
                items = "".join(f"{code(v)}, " for v in value)
                return f"[{items}]" if isinstance(value, list) else f"({items})"
            if type(value) in _LITERALS:
                return repr(value)
            name = f"k{len(namespace)}"
            namespace[name] = value
            return name

        lines = [f"def replay({', '.join(f'a{i}' for i in range(self.inputs))}):"]
        for index, step in enumerate(self.steps):
            if step is None:
                continue
            op = op_names.setdefault(step.op, f"op{len(op_names)}")
            namespace[op] = step.op
            arguments = [code(a) for a in step.args] + [f"{k}={code(v)}" for k, v in step.kwargs.items()]
            lines.append(f"    v{index} = {op}({', '.join(arguments)})")
            freed = {r.name for r in step.reads if r.step is not None and last_use[r.name] == index}
            freed.discard(self.output.name)
            if freed:
                lines.append(f"    del {', '.join(sorted(freed))}")
        lines.append(f"    return {self.output.code()}")
        exec(compile("\n".join(lines), "<pdvi graph replay>", "exec"), namespace)
        return namespace["replay"]

    def structure(self) -> str:
        """The program with its numbers left out: its operations, what each reads and its other
        values (dtypes, devices, flags). The recordings of blocks of different sizes that the
        same Python made share it (the numbers are the sizes, the subsample's scale ``N / s``,
        the model's constants, and any index the model read into Python); graph replay trusts a
        new size's graph sooner where another of its structure has passed every check
        (:mod:`~pyro_pdvi.infer.graphs`)."""

        def text(value: Any) -> str:
            if isinstance(value, Ref):
                return value.code()
            if isinstance(value, (list, tuple)):
                return "(" + ",".join(text(v) for v in value) + ")"
            if type(value) in (int, float):
                return "#"
            return repr(value)

        lines = [f"{self.inputs} inputs, {len(self.constants)} constants, returns {self.output.code()}"]
        for index, step in enumerate(self.steps):
            if step is not None:
                arguments = [text(a) for a in step.args] + [f"{k}={text(v)}" for k, v in step.kwargs.items()]
                lines.append(f"v{index}={step.op}({','.join(arguments)})")
        return "\n".join(lines)

    def __len__(self) -> int:
        return sum(step is not None for step in self.steps)


class Recorder(TorchDispatchMode):
    """Note the torch operations run inside its ``with`` block (module docstring); a tensor
    that is neither an input nor made inside (the data, a constant of the model) becomes a
    constant of the program.

    :param inputs: the tensors that become the program's inputs, in order.
    """

    def __init__(self, inputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.steps: list[Step | None] = []
        self.inputs = len(inputs)
        self.constants: list[torch.Tensor] = []
        self._refs: dict[int, Ref] = {}
        # Every tensor seen stays alive until the recording ends, so that no id is reused.
        self._seen: list[torch.Tensor] = []
        for i, tensor in enumerate(inputs):
            self._bind(tensor, Ref(f"a{i}"))

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ to keep torch.compile out of it, which imports
        # torch._dynamo at the first operation (1.3-2 CPU s here); nothing here is compiled.
        return False

    def _bind(self, tensor: torch.Tensor, ref: Ref) -> None:
        self._refs[id(tensor)] = ref
        self._seen.append(tensor)

    def _ref(self, value: Any) -> Any:
        """``value`` with every tensor replaced by its reference (an operation's arguments hold
        tensors, numbers, and tuples or lists of them)."""
        if isinstance(value, (tuple, list)):
            return type(value)([self._ref(v) for v in value])
        if not isinstance(value, torch.Tensor):
            return value
        ref = self._refs.get(id(value))
        if ref is None:
            ref = Ref(f"c{len(self.constants)}")
            self.constants.append(value)
            self._bind(value, ref)
        return ref

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        if not all(o is None or isinstance(o, torch.Tensor) for o in outputs):
            raise DataDependentError(f"{func} returned a Python value (the model read a tensor's value)")
        index = len(self.steps)
        self.steps.append(Step(func, self._ref(args), {k: self._ref(v) for k, v in kwargs.items()}))
        if isinstance(out, torch.Tensor):
            self._bind(out, Ref(f"v{index}", index))
        else:
            for i, o in enumerate(outputs):
                if o is not None:
                    self._bind(o, Ref(f"v{index}", index, i))
        return out

    def program(self, value: torch.Tensor) -> Program:
        """The recorded steps returning ``value``, simplified (module docstring)."""
        program = Program(self.steps, self.inputs, self.constants, self._ref(value))
        self._seen.clear()
        self._refs.clear()
        return program.without_common_subexpressions().without_dead_code()


def _refs_in(values: tuple | list) -> list[Ref]:
    """The references among ``values`` and the lists and tuples in them."""
    refs = []
    for value in values:
        if type(value) is Ref:
            refs.append(value)
        elif isinstance(value, (list, tuple)):
            refs.extend(_refs_in(value))
    return refs


def _written(step: Step) -> list[Ref]:
    """The tensors a step writes in place (its schema's arguments marked ``!``)."""
    return _arguments(step, lambda alias: alias.is_write)


def _viewed(step: Step) -> list[Ref]:
    """The tensors whose view a step returns (its schema's arguments and returns share an alias
    set, as ``detach``, ``view``, ``expand`` do)."""
    if not any(r.alias_info is not None for r in step.op._schema.returns):
        return []
    return _arguments(step, lambda alias: True)


def _arguments(step: Step, chosen: Callable[[Any], bool]) -> list[Ref]:
    """The tensors a step takes as arguments whose schema alias annotation is ``chosen``."""
    refs = []
    for i, argument in enumerate(step.op._schema.arguments):
        if argument.alias_info is not None and chosen(argument.alias_info):
            value = step.args[i] if i < len(step.args) else step.kwargs.get(argument.name)
            refs.extend(_refs_in([value]))
    return refs


def _renamed(value: Any, renamed: dict[str, Ref]) -> Any:
    """``value`` with references to dropped steps' outputs read from the steps they repeat."""
    if isinstance(value, Ref):
        first = renamed.get(value.name)
        return value if first is None else Ref(first.name, first.step, value.item)
    if isinstance(value, dict):
        return {k: _renamed(v, renamed) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_renamed(v, renamed) for v in value)
    return value


def _key(step: Step) -> tuple | None:
    """What makes two pure steps the same: the operation and its arguments, each value with its
    type and exact representation (``0.0`` and ``-0.0``, ``1`` and ``1.0`` differ); ``None``
    where a value cannot be told apart so (it is never merged)."""

    def frozen(value: Any) -> Any:
        if isinstance(value, Ref):
            return value
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, *map(frozen, value))
        if isinstance(value, (bool, int, float, str, type(None), torch.dtype, torch.device)):
            return (type(value).__name__, repr(value))
        if isinstance(value, (torch.layout, torch.memory_format)):
            return (type(value).__name__, str(value))
        raise TypeError(type(value))

    try:
        return (step.op, frozen(step.args), tuple((k, frozen(v)) for k, v in step.kwargs.items()))
    except TypeError:
        return None
