"""Graph replay: a block's objective ``f_b`` evaluated by replaying a recorded graph of torch
operations instead of running the Pyro model, guide and ELBO again.

One evaluation of ``f_b`` through Pyro runs the guide under a trace, the model under a replay
of it, and the ELBO's bookkeeping, all in Python: on the generic suite's small models that
Python is most of an evaluation (``docs/benchmarks.md`` 13q). At the fixed Monte Carlo noise
of a step (:class:`~pyro_pdvi.infer.handlers.FixedNoise`), ``f_b`` is a fixed composition of
torch operations of the block's copies and rows, its data indices and the step's tensor
arguments, with the noise drawn from torch's generator. A recording
(:class:`~pyro_pdvi.infer.recording.Recorder`, a
:class:`~torch.utils._python_dispatch.TorchDispatchMode`) runs one evaluation through Pyro and
notes every torch operation it makes (with Pyro's validation off, whose checks branch on
values, and the ELBOs' ``.item()`` calls and NaN hooks left out, as under ``vmap``:
:func:`~pyro_pdvi.infer._vmap.graph_recording_pyro`), drops repeated and unused operations and
compiles the rest to a Python function (:mod:`~pyro_pdvi.infer.recording`); later evaluations
call it: the same operations, which draw the same noise from the same generator state and are
differentiated by autograd as the model's own operations are (first and second order). The
operations are recorded below autograd, as they run on real tensors, so the recording is an
evaluation itself: on the suite it cost about 3-6 evaluations through Pyro (13r).

A graph serves one signature: the block size, the shapes and dtypes of the copies, rows and
tensor arguments, and the values of the other arguments. PDVI visits its fixed blocks again every
epoch, and a block solve evaluates its block several times, so the first signatures, as many as
the blocks (``recurring``), are recorded at their first evaluation: a recording costs a few
evaluations through Pyro (above; 3.7 on the random-effects model in 13s) and a replay about a
third of one, so it is paid back within the block's first solve or two. On the suite's
random-effects model, whose 30 blocks have 15 sizes, that shortened its first epoch by 0.2-0.7
of 4.3-5.5 CPU s in pinned pairs (``docs/benchmarks.md`` 13s). Further
signatures (a step argument that changes every step, say) are recorded once evaluated through
Pyro as many times as a recording is expected to cost (the ski-rental rule: at most about
twice the cost of the better choice in hindsight; the expectation starts at :data:`RECORD_AFTER`
and follows the recordings measured).

A replay is trusted only once checked. The first :data:`CHECKED_REPLAYS` replays of each graph,
and further ones until one at other data indices than the recording's, are compared with an
evaluation through Pyro at the same noise: the first with the recording itself, in value and
(where the inputs require it) gradient, the others in value; after that one replay in
:data:`CHECK_EVERY` is compared too. A graph whose program has the structure of one that passed
all of these (:meth:`~pyro_pdvi.infer.recording.Program.structure`: the same operations reading
each other alike, only its numbers differ, as another block size of the same Python's) is trusted
after its recording's own check: on the suite's random-effects model, 30 blocks of 15 sizes, the
first epoch's evaluations through Pyro fell from 27-28 to 12-16 and its CPU time by about 0.06 s
of 1.2-1.3 (``docs/benchmarks.md`` 13zg). What can make them differ: Python control flow or
state that the recording fixed (a counter in the model, an attribute or global that the model
reads and the user replaces between steps: the graph holds the tensor it read then, while data
changed in place, the step's tensor arguments and the other arguments' values are followed), a
custom ``autograd.Function`` (the recording keeps its forward operations, autograd
differentiates those). On a mismatch, replay is switched off for the run with a warning, and the
evaluation returns Pyro's value. A model whose Python branches on tensor values cannot be
recorded at all (the recording refuses an operation that returns a Python value); its signature
stays with Pyro. On the CPU a replay whose value is not finite is evaluated again through Pyro,
whose argument validation (off in a replay) then names what is wrong, as without replay (NaN in
the data, a value outside a distribution's support). ``PDVI(graph_replay=False)`` never records.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.utils._pytree as pytree

from ..errors import warn_user
from ._vmap import graph_recording_pyro
from .recording import Recorder

Values = dict[str, torch.Tensor]
EagerBlock = Callable[[Values, Values, torch.Tensor, tuple, dict], torch.Tensor]

#: Evaluations through Pyro of a signature before its first recording: a recording is expected
#: to cost this many evaluations until one has been measured (the suite's: about 3-6, 13r).
RECORD_AFTER = 5

#: Replays of each graph compared with an evaluation through Pyro before it is trusted (and
#: further ones until one at data indices other than the recording's).
CHECKED_REPLAYS = 2

#: Once a graph is trusted, one replay in this many (over all graphs) is still compared with
#: Pyro's evaluation, which bounds how long Python state replaced between steps goes unseen (at
#: about 1/64 of the evaluations' cost).
CHECK_EVERY = 64

#: Signatures followed at most: beyond them (a Python number among the step's arguments that
#: changes every step, such as an annealing weight) the evaluations stay with Pyro.
MAX_SIGNATURES = 256

#: Relative tolerance of that comparison: the replay runs the model's own operations in the
#: same order, so agreement is to rounding; a graph that fixed the wrong branch is far off.
REPLAY_RTOL = 1e-5


@dataclass
class _Signature:
    """What one signature's evaluations have cost and what its graph is."""

    recurs: bool = False
    evaluations: int = 0
    seconds: float = 0.0
    graph: Callable[..., torch.Tensor] | None = None
    recorded_indices: torch.Tensor | None = None
    checked: int = 0
    checked_other_indices: bool = False
    failure: str | None = None
    structure: str | None = None


class _Call(NamedTuple):
    """One evaluation's arguments: ``eager`` (``f_b`` through Pyro) and what it is called with,
    with the step's tensor arguments, which a graph takes as inputs."""

    eager: EagerBlock
    copies: Values
    rows: Values
    indices: torch.Tensor
    args: tuple
    kwargs: dict
    tensors: list[torch.Tensor]

    @property
    def differentiable(self) -> list[torch.Tensor]:
        """The copies and rows, in the order of the graph's first inputs."""
        return [*self.copies.values(), *self.rows.values()]

    @property
    def graph_inputs(self) -> list[torch.Tensor]:
        """A graph's inputs: copies, rows, data indices, the step's tensor arguments."""
        return [*self.differentiable, self.indices, *self.tensors]

    def through_pyro(self) -> torch.Tensor:
        return self.eager(self.copies, self.rows, self.indices, self.args, self.kwargs)


@dataclass
class GraphReplayStats:
    """What the replay did so far (``PDVI.diagnostics["graph_replay"]``).

    :param recorded: graphs recorded.
    :param replayed: evaluations by replay.
    :param through_pyro: evaluations through Pyro (before recording, unrecordable signatures,
        checks and evaluations inside ``torch.func`` transforms).
    :param failures: why a signature could not be recorded, one line each.
    :param disabled: why replay was switched off, or ``None``.
    """

    recorded: int = 0
    replayed: int = 0
    through_pyro: int = 0
    failures: list[str] = field(default_factory=list)
    disabled: str | None = None


class GraphReplay:
    """Evaluate ``f_b`` by replaying recorded graphs where that is safe (module docstring).

    :param record_after: evaluations through Pyro of a signature before its first recording
        (later ones follow the measured cost of the recordings).
    :param recurring: how many signatures, the first ones, are expected to recur and are recorded
        at their first evaluation (PDVI's number of blocks).
    """

    def __init__(self, record_after: int = RECORD_AFTER, recurring: int = 0) -> None:
        self.record_after = record_after
        self.recurring = recurring
        self.stats = GraphReplayStats()
        self._signatures: dict[tuple, _Signature] = {}
        # Program structures (Program.structure) of which some graph passed every check.
        self._trusted_structures: set[str] = set()
        self._one_off = False

    @property
    def enabled(self) -> bool:
        return self.stats.disabled is None

    @contextlib.contextmanager
    def one_off(self) -> Iterator[None]:
        """Evaluations inside do not count towards a recording: a one-time pass over the blocks
        that may evaluate a block with another step's arguments (the coupling's, in a run
        resumed within its first epoch), whose signatures need not recur. A signature with a
        trusted graph still replays."""
        self._one_off = True
        try:
            yield
        finally:
            self._one_off = False

    def evaluate(
        self,
        eager: EagerBlock,
        copies: Values,
        rows: Values,
        indices: torch.Tensor,
        args: tuple,
        kwargs: dict,
    ) -> torch.Tensor:
        """``eager(copies, rows, indices, args, kwargs)``, by a replay of its graph where one is
        recorded and trusted, else through Pyro (recording the graph when its turn comes).

        :param eager: ``f_b`` through Pyro.
        :param copies: the block's copies of the global params.
        :param rows: the block's rows of the local params.
        :param indices: the block's data indices, shape ``(s,)``.
        :param args: the step's positional arguments.
        :param kwargs: the step's keyword arguments.
        """
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        call = _Call(eager, copies, rows, indices, args, kwargs, tensors)
        key = self._key(copies, rows, indices, leaves, spec)
        if not self.enabled or key is None or _in_transform(*call.graph_inputs):
            return self._through_pyro(call)
        signature = self._signatures.get(key)
        if self._one_off and (signature is None or signature.graph is None):
            return self._through_pyro(call)
        if signature is None:
            if len(self._signatures) >= MAX_SIGNATURES:  # an argument that changes every step
                return self._through_pyro(call)
            signature = self._signatures[key] = _Signature(recurs=len(self._signatures) < self.recurring)
        if signature.graph is None:
            record_after = 0 if signature.recurs else self.record_after
            if signature.failure is not None or signature.evaluations < record_after:
                return self._timed(signature, call)
            return self._record(signature, call)
        if signature.checked < CHECKED_REPLAYS or not signature.checked_other_indices:
            other_indices = not torch.equal(indices, signature.recorded_indices)
            if signature.checked < CHECKED_REPLAYS or other_indices:
                return self._checked(signature, call, other_indices)
        if (self.stats.replayed + 1) % CHECK_EVERY == 0:
            return self._checked(signature, call, False)
        on_cpu = indices.device.type == "cpu"
        generator = torch.get_rng_state() if on_cpu else None
        value = signature.graph(*call.graph_inputs)
        if on_cpu and not bool(torch.isfinite(value).all()):
            # Again through Pyro, whose validation (off in a replay) names what is wrong, as without
            # replay. On a GPU that would read a value on the host at every evaluation: not there.
            torch.set_rng_state(generator)
            return self._through_pyro(call)
        self.stats.replayed += 1
        return value

    # ----------------------------------------------------------------- internals

    @staticmethod
    def _key(
        copies: Values, rows: Values, indices: torch.Tensor, leaves: list, spec: pytree.TreeSpec
    ) -> tuple | None:
        """The signature of an evaluation; ``None`` if an argument cannot be told apart by value
        (an unhashable non-tensor), which is then never replayed."""

        def tensor_key(t: torch.Tensor) -> tuple:
            return (tuple(t.shape), t.dtype, t.device)

        try:
            others = tuple(
                tensor_key(leaf) if isinstance(leaf, torch.Tensor) else (type(leaf), leaf) for leaf in leaves
            )
            hash(others)
        except TypeError:
            return None
        return (
            tensor_key(indices),
            tuple((k, tensor_key(v)) for k, v in copies.items()),
            tuple((k, tensor_key(v)) for k, v in rows.items()),
            str(spec),
            others,
        )

    def _through_pyro(self, call: _Call) -> torch.Tensor:
        self.stats.through_pyro += 1
        return call.through_pyro()

    def _timed(self, signature: _Signature, call: _Call) -> torch.Tensor:
        """An evaluation through Pyro, counted and timed towards the signature's recording."""
        start = time.perf_counter()
        value = self._through_pyro(call)
        signature.seconds += time.perf_counter() - start
        signature.evaluations += 1
        return value

    def _record(self, signature: _Signature, call: _Call) -> torch.Tensor:
        """Evaluate through Pyro while recording the signature's graph; a failure is kept as the
        signature's for good (the generator's state is put back, and Pyro evaluates again)."""
        inputs, indices = call.graph_inputs, call.indices
        start = time.perf_counter()
        try:
            with _generator_kept(indices.device), graph_recording_pyro():
                recorder = Recorder(inputs)
                with recorder:
                    value = call.through_pyro()
                program = recorder.program(value)
                graph = program.compile()
        except Exception as error:  # whatever the model does that a recording cannot follow
            signature.failure = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            self.stats.failures.append(
                f"blocks of {indices.shape[-1]} data: not recorded ({signature.failure})"
            )
            return self._through_pyro(call)
        seconds = time.perf_counter() - start
        signature.graph = graph
        signature.recorded_indices = indices.detach().clone()
        self.stats.recorded += 1
        if signature.evaluations and signature.seconds > 0:
            cost = seconds / (signature.seconds / signature.evaluations)
            self.record_after = max(1, round(cost))
        # The recording was an evaluation through Pyro at this noise (the generator was put back):
        # its replay draws the same and must give the same value and gradient.
        replayed = graph(*inputs)
        mismatch = _mismatch(replayed, value, call.differentiable, gradients=True)
        if mismatch is not None:
            self._disable(indices.shape[-1], mismatch)
            return value
        signature.checked += 1
        signature.structure = program.structure()
        if signature.structure in self._trusted_structures:
            # Another size's graph of this structure passed every check: this one's own is enough.
            signature.checked, signature.checked_other_indices = CHECKED_REPLAYS, True
        self.stats.replayed += 1
        return replayed

    def _checked(self, signature: _Signature, call: _Call, other_indices: bool) -> torch.Tensor:
        """A replay compared with an evaluation through Pyro at the same noise, in value (the
        recording's check compared gradients too); Pyro's value, and replay off for good, if
        they differ."""
        indices = call.indices
        with _generator_kept(indices.device):
            replayed = signature.graph(*call.graph_inputs)
        value = self._through_pyro(call)
        mismatch = _mismatch(replayed, value, call.differentiable, gradients=False)
        if mismatch is not None:
            self._disable(indices.shape[-1], mismatch)
            return value
        signature.checked += 1
        signature.checked_other_indices |= other_indices
        if signature.checked >= CHECKED_REPLAYS and signature.checked_other_indices:
            self._trusted_structures.add(signature.structure)
        self.stats.replayed += 1
        return replayed

    def _disable(self, block_size: int, mismatch: str) -> None:
        """Replay off for the rest of the run, with a warning that says why (``mismatch``: what
        differed, in blocks of ``block_size`` data)."""
        self.stats.disabled = (
            f"the replay of blocks of {block_size} data differed from the model in its {mismatch}"
        )
        warn_user(
            f"PDVI: {self.stats.disabled}; the model's Python decides something that a recorded "
            "graph of its torch operations cannot follow (a branch, a counter, a data tensor "
            "that an attribute or global now holds instead of the one recorded, a custom "
            "autograd.Function). Every evaluation now goes through Pyro (slower, same results). "
            "Change data in place or pass it as an argument of step(); PDVI(graph_replay=False) "
            "skips the recording."
        )


def _mismatch(
    replayed: torch.Tensor, value: torch.Tensor, inputs: list[torch.Tensor], gradients: bool
) -> str | None:
    """``"value"`` or ``"gradient"`` where the replay and Pyro's evaluation differ, else ``None``
    (the gradients in ``inputs`` compared only with ``gradients``)."""

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        scale = b.detach().abs().max() if b.numel() else b.new_zeros(())
        atol = REPLAY_RTOL * float(scale)
        return bool(torch.allclose(a.detach(), b.detach(), rtol=REPLAY_RTOL, atol=atol, equal_nan=True))

    if not close(replayed, value):
        return "value"
    wrt = [t for t in inputs if t.requires_grad]
    if not gradients or not wrt or not (replayed.requires_grad and value.requires_grad):
        return None
    replayed_grads = torch.autograd.grad(replayed, wrt, retain_graph=True, allow_unused=True)
    grads = torch.autograd.grad(value, wrt, retain_graph=True, allow_unused=True)
    for a, b in zip(replayed_grads, grads):
        a = torch.zeros_like(b) if a is None and b is not None else a
        b = torch.zeros_like(a) if b is None and a is not None else b
        if a is not None and not close(a, b):
            return "gradient"
    return None


def _in_transform(*tensors: torch.Tensor) -> bool:
    """Whether any tensor belongs to a ``torch.func`` transform (``vmap``, ``grad``): there the
    evaluation stays with Pyro."""
    return any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors)


def _generator_kept(device: torch.device) -> contextlib.AbstractContextManager:
    """Run a ``with`` block from the generators' current state and put it back afterwards."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
