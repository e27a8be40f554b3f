"""Effect handlers PDVI runs a model and guide under.

* :class:`BlockSubsample` makes the data plate subsample exactly one block, so a
  step over several blocks can evaluate each block's objective ``f_b`` alone.
* :class:`ParamOverride` feeds the primal solver's own tensors (a block's copy
  of the global parameters and its local rows) to ``pyro.param`` sites, so the
  solve never writes to the param store until the step is accepted.
* :func:`module_parameters` does the same for networks registered with ``pyro.module``.
* :func:`trace_guide_at` traces a guide on one block with its globals at given values,
  through both.
* :class:`FixedNoise` holds the Monte Carlo noise fixed inside one primal
  solve, so a quasi-Newton solver sees a deterministic objective.
* :func:`plate_entry` finds the subsample a step passes to the data plate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pyro
import pyro.primitives
import torch
from pyro import poutine
from pyro.poutine.messenger import Messenger
from pyro.poutine.runtime import Message, NonlocalExit
from pyro.poutine.trace_struct import Trace
from torch.distributions import constraints, transform_to


def is_subsample_site(msg: Message) -> bool:
    """Whether a trace node or message is the subsample site of a ``pyro.plate``."""
    return msg["type"] == "sample" and type(msg["fn"]).__name__ == "_Subsample"


def plate_entry(fn: Callable, plate_name: str, args: tuple, kwargs: dict) -> Message | None:
    """The subsample message of the plate ``plate_name`` when ``fn(*args, **kwargs)`` enters it:
    ``fn`` runs up to the plate and stops there, without sampling the rest (a whole trace of a
    large block cost more than its solve). Its ``value`` is the subsample the caller passed
    (``None`` if none was: the plate would draw one). ``None`` if ``fn`` never enters the plate."""

    def at_plate(msg: dict) -> bool:
        return msg["name"] == plate_name and is_subsample_site(msg)

    try:
        with torch.no_grad(), poutine.block():
            poutine.escape(fn, escape_fn=at_plate)(*args, **kwargs)
    except NonlocalExit as exit_:
        exit_.reset_stack()
        return exit_.site
    return None


def networks_of(*fns: Callable) -> list[torch.nn.Module]:
    """The ``nn.Module`` s among ``fns``, or behind them as bound methods (an autoguide, a
    ``PyroModule`` model, a method of a model class that is a module)."""
    found = []
    for fn in fns:
        owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
        if isinstance(owner, torch.nn.Module):
            found.append(owner)
    return found


@contextlib.contextmanager
def module_parameters(values: dict[str, torch.Tensor], networks: list[torch.nn.Module]) -> Iterator[None]:
    """Inside the ``with`` block, networks compute with the given values of their params (PDVI's
    block copy, keyed by param-store name) instead of their own ``Parameter`` s, which are put
    back on exit.

    A network's forward pass reads its own attributes, which :class:`ParamOverride` cannot
    reach: ``pyro.module(name, net)`` registers each parameter with ``pyro.param`` but ignores
    the value it returns, and so does a ``PyroModule`` for an ``nn.Parameter`` attribute (as
    ``AutoMultivariateNormal.loc``). So every module of ``networks`` whose ``Parameter`` is a
    param-store param in ``values`` has it swapped, and ``pyro.module`` (as ``pyro.module`` and
    ``pyro.primitives.module``) is wrapped to swap the networks it registers.

    :param values: param-store name -> value.
    :param networks: modules to look into (e.g. :func:`networks_of` the model and guide).
    """
    store = pyro.get_param_store()
    by_identity = {id(p): name for name, p in store.named_parameters() if name in values}
    swapped: list[tuple[dict, str, torch.Tensor]] = []

    def swap(network: torch.nn.Module) -> None:
        for module in network.modules():
            for attribute, parameter in list(module._parameters.items()):
                name = by_identity.get(id(parameter))
                if name is not None:
                    swapped.append((module._parameters, attribute, parameter))
                    module._parameters[attribute] = values[name]

    original = pyro.primitives.module

    def module(name: str, nn_module: torch.nn.Module, update_module_params: bool = False) -> torch.nn.Module:
        result = original(name, nn_module, update_module_params)
        swap(nn_module)
        return result

    pyro.primitives.module = pyro.module = module
    try:
        for network in networks:
            swap(network)
        yield
    finally:
        pyro.primitives.module = pyro.module = original
        for parameters, attribute, parameter in reversed(swapped):
            parameters[attribute] = parameter


class BlockSubsample(Messenger):
    """Replace the subsample of the plate ``plate_name`` by ``indices``.

    :param plate_name: name of the data plate.
    :param indices: the block's data indices.
    """

    def __init__(self, plate_name: str, indices: torch.Tensor) -> None:
        super().__init__()
        self.plate_name = plate_name
        self.indices = indices

    def _process_message(self, msg: Message) -> None:
        if msg["name"] == self.plate_name and is_subsample_site(msg):
            msg["value"] = self.indices.to(msg["fn"].device)


class ParamOverride(Messenger):
    """Serve ``pyro.param(name)`` from given unconstrained tensors: a block's copy of the
    global params, and the block's own rows of the local params.

    A local param's value is the block's rows already: the data plate must not slice it
    again (it slices a param's rows in its postprocess only when ``event_dim`` is set),
    so its ``event_dim`` is dropped. A global param's value carries its unconstrained
    tensor for the plate, as the param store's values do.

    :param unconstrained: site name -> unconstrained value (may be a non-leaf tensor that
        depends on the solver's variables).
    :param site_constraints: site name -> constraint of that param.
    :param block_rows: the names in ``unconstrained`` that are a local param's block rows.
    """

    def __init__(
        self,
        unconstrained: dict[str, torch.Tensor],
        site_constraints: dict[str, constraints.Constraint],
        block_rows: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__()
        self.unconstrained = unconstrained
        self.site_constraints = site_constraints
        self.block_rows = block_rows

    def _pyro_param(self, msg: Message) -> None:
        name = msg["name"]
        if name not in self.unconstrained:
            return
        free = self.unconstrained[name]
        value = transform_to(self.site_constraints[name])(free)
        if name in self.block_rows:
            msg["kwargs"] = {**msg["kwargs"], "event_dim": None}
        else:
            # SubsampleMessenger reads this to slice params with event_dim set.
            value._pyro_unconstrained_param = free
        msg["value"] = value
        msg["done"] = True


class FixedNoise:
    """The same Monte Carlo noise for every evaluation of one block objective.

    Common random numbers: the generator state for ``seed`` is built once, and
    each ``with noise():`` block runs from that state, then puts back the state
    the caller had. Restoring a saved state is much cheaper than reseeding.

    :param seed: the seed of this solve.
    :param device: device of the model; its CUDA generator is fixed too.
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        with torch.random.fork_rng(devices=[device] if self.cuda else []):
            torch.default_generator.manual_seed(seed)
            self.cpu_state = torch.get_rng_state()
            if self.cuda:
                torch.cuda.manual_seed(seed)
                self.cuda_state = torch.cuda.get_rng_state(device)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        saved_cpu = torch.get_rng_state()
        saved_cuda = torch.cuda.get_rng_state(self.device) if self.cuda else None
        torch.set_rng_state(self.cpu_state)
        if self.cuda:
            torch.cuda.set_rng_state(self.cuda_state, self.device)
        try:
            yield
        finally:
            torch.set_rng_state(saved_cpu)
            if self.cuda:
                torch.cuda.set_rng_state(saved_cuda, self.device)


def trace_guide_at(
    guide: Callable,
    values: dict[str, torch.Tensor],
    site_constraints: dict[str, constraints.Constraint],
    plate_name: str,
    indices: torch.Tensor,
    args: tuple,
    kwargs: dict,
) -> Trace:
    """The guide's trace on one block with its global params at ``values``: through
    :class:`ParamOverride` for ``pyro.param`` statements and :func:`module_parameters` for the
    ``nn.Parameter`` attributes that a ``PyroModule`` returns itself (``AutoDiagonalNormal.loc``,
    ``AutoMultivariateNormal.loc``) and for ``pyro.module`` networks. With
    :class:`ParamOverride` alone the guide reads such a ``loc`` from the module, and nothing
    taken from the trace depends on ``values`` there.

    :param guide: the Pyro guide.
    :param values: param-store name -> unconstrained value.
    :param site_constraints: param-store name -> constraint of that param.
    :param plate_name: name of the data plate.
    :param indices: the block's data indices.
    :param args: positional arguments of the guide.
    :param kwargs: keyword arguments of the guide.
    """
    guided = BlockSubsample(plate_name, indices)(ParamOverride(values, site_constraints)(guide))
    with module_parameters(values, networks_of(guide)):
        return poutine.trace(guided).get_trace(*args, **kwargs)
