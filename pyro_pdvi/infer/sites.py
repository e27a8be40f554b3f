"""Split a model/guide's params into global (lambda) and local (phi) sites.

A param is *local* when it is created inside the data plate with ``event_dim``
set: Pyro then slices its batch rows by the plate's subsample, so the rows of a
block are that block's ``phi_b`` [1, Sec. 3.2]. Every other param is *global*:
all blocks share it, and PD-VI keeps a per-block copy ``lambda_b`` and a dual
``mu_b`` of it.

Globals are handled as one flat vector (in Pyro's unconstrained space) laid out
by :class:`GlobalLayout`, so duals and block copies are plain ``(n, P)`` tensors.

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer.autoguide import AutoContinuous, AutoGuide, AutoGuideList
from pyro.poutine.trace_struct import Trace
from torch.distributions import constraints

from .handlers import is_subsample_site


@dataclass(frozen=True)
class LocalSite:
    """A param whose rows along ``axis`` belong to individual data.

    :param name: param site name.
    :param axis: negative axis of the unconstrained tensor indexed by the data
        plate (``plate.dim - event_dim``).
    :param constraint: the param's constraint.
    """

    name: str
    axis: int
    constraint: constraints.Constraint


@dataclass(frozen=True)
class GlobalSite:
    """A param shared by all blocks.

    :param name: param site name.
    :param shape: shape of the unconstrained tensor.
    :param constraint: the param's constraint.
    """

    name: str
    shape: torch.Size
    constraint: constraints.Constraint

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass(frozen=True)
class DataPlate:
    """The subsampled plate over the blocked data."""

    name: str
    size: int


class GlobalLayout:
    """Flat layout of the global params: name -> slice of one vector.

    :param sites: the global sites, in a fixed order.
    """

    def __init__(self, sites: list[GlobalSite]) -> None:
        self.sites = sites
        self.slices: dict[str, slice] = {}
        start = 0
        for site in sites:
            self.slices[site.name] = slice(start, start + site.numel)
            start += site.numel
        self.size = start

    @property
    def names(self) -> list[str]:
        return [site.name for site in self.sites]

    def flatten(self, values: dict[str, torch.Tensor], batch_dims: int = 0) -> torch.Tensor:
        """Concatenate per-site tensors into one vector (or, with ``batch_dims`` leading
        batch dims, into a batch of vectors of shape ``batch + (size,)``)."""
        if not self.sites:
            return torch.zeros(0)
        batch = values[self.sites[0].name].shape[:batch_dims]
        return torch.cat([values[site.name].reshape(*batch, -1) for site in self.sites], dim=-1)

    def unflatten(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``vector`` (or of its last dim) shaped like each site."""
        batch = vector.shape[:-1]
        return {
            site.name: vector[..., self.slices[site.name]].reshape(batch + site.shape) for site in self.sites
        }

    def site_of(self, flat_index: int) -> str:
        """Name of the site that holds coordinate ``flat_index``."""
        for name, span in self.slices.items():
            if span.start <= flat_index < span.stop:
                return name
        raise IndexError(flat_index)


def find_data_plate(traces: list[Trace], num_data: int, plate_name: str | None) -> DataPlate:
    """Find the subsampled plate over the blocked data: the one named ``plate_name``, else the
    one of size ``num_data`` (the number of indices the blocks hold), else the only one.

    :param traces: guide and model traces of one step.
    :param num_data: the number of indices the blocks hold.
    :param plate_name: the plate's name if the user named it, else ``None``.
    :raises ValueError: when no plate, or more than one, could be the data plate.
    """
    plates: dict[str, int] = {}
    for trace in traces:
        for name, site in trace.nodes.items():
            if is_subsample_site(site):
                plates[name] = site["fn"].size
    if plate_name is not None:
        if plate_name not in plates:
            raise ValueError(
                f"plate_name={plate_name!r} names no pyro.plate in the model or guide; "
                f"plates found: {sorted(plates) or 'none'}"
            )
        return DataPlate(plate_name, plates[plate_name])
    candidates = [name for name, size in plates.items() if size == num_data] or list(plates)
    if not candidates:
        raise ValueError(
            f"PDVI was given blocks over {num_data} data but the model and guide have no subsampled "
            "pyro.plate. Wrap the per-datum sites of both model and guide in "
            f'`with pyro.plate("data", {num_data}, subsample=idx) as ind:` and index the data with `ind`.'
        )
    if len(candidates) > 1:
        raise ValueError(
            f"the model and guide have several plates, {plates}, and none of size {num_data} (the "
            "number of indices in the blocks); pass plate_name= to PDVI to say which one the blocks "
            "partition"
        )
    return DataPlate(candidates[0], plates[candidates[0]])


def split_param_sites(
    traces: list[Trace],
    plate: DataPlate,
    site_constraints: dict[str, constraints.Constraint],
    unconstrained: dict[str, torch.Tensor],
) -> tuple[list[GlobalSite], list[LocalSite]]:
    """Classify every param site seen in ``traces`` as global or local.

    :param traces: guide and model traces.
    :param plate: the data plate.
    :param site_constraints: constraints from the param store.
    :param unconstrained: unconstrained values from the param store.
    :returns: global sites sorted by name, local sites sorted by name.
    """
    local: dict[str, LocalSite] = {}
    seen: set[str] = set()
    for trace in traces:
        for name, site in trace.nodes.items():
            if site["type"] != "param":
                continue
            seen.add(name)
            event_dim = site["kwargs"].get("event_dim")
            frames = [f for f in site["cond_indep_stack"] if f.name == plate.name]
            if event_dim is None or not frames:
                continue
            axis = frames[0].dim - event_dim
            shape = unconstrained[name].shape
            if len(shape) < -axis or shape[axis] != plate.size:
                raise ValueError(
                    f'param site "{name}" is inside plate {plate.name!r} with event_dim='
                    f"{event_dim}, so its axis {axis} should have size {plate.size}, but its "
                    f"shape is {tuple(shape)}. Create it with one row per datum or drop "
                    "event_dim to make it global."
                )
            local[name] = LocalSite(name, axis, site_constraints[name])
    global_sites = [
        GlobalSite(name, unconstrained[name].shape, site_constraints[name])
        for name in sorted(seen - set(local))
    ]
    return global_sites, [local[name] for name in sorted(local)]


def _is_point_mass(fn: dist.Distribution) -> bool:
    """A ``Delta``, also behind ``.to_event()`` (``Independent``)."""
    while isinstance(fn, dist.Independent):
        fn = fn.base_dist
    return isinstance(fn, dist.Delta)


def monte_carlo_sites(guide_trace: Trace) -> list[str]:
    """Guide sample sites that a loss estimates by Monte Carlo (not Delta, not enumerated):
    where the block objective depends on the noise of a solve."""
    return [
        name
        for name, site in guide_trace.nodes.items()
        if site["type"] == "sample"
        and not is_subsample_site(site)
        and not _is_point_mass(site["fn"])
        and site["infer"].get("enumerate") is None
    ]


@dataclass(frozen=True)
class FoundSites:
    """What :func:`find_sites` finds in one call of a model and guide.

    :param plate: the data plate.
    :param global_sites: the global param sites, by name.
    :param local_sites: the local param sites, by name.
    :param plate_in_guide: whether the guide enters the data plate (else only the model does).
    :param monte_carlo_sites: the guide's sample sites estimated by Monte Carlo.
    :param guide_trace: the guide's trace on the step's subsample.
    """

    plate: DataPlate
    global_sites: list[GlobalSite]
    local_sites: list[LocalSite]
    plate_in_guide: bool
    monte_carlo_sites: list[str]
    guide_trace: Trace


def find_sites(
    model: Callable, guide: Callable, args: tuple, kwargs: dict, num_data: int, plate_name: str | None
) -> FoundSites:
    """Trace the guide and the model once (creating their params) and classify what they hold.

    :param model: the Pyro model.
    :param guide: the Pyro guide.
    :param args: positional arguments of a step.
    :param kwargs: keyword arguments of a step.
    :param num_data: N, the number of indices the blocks cover.
    :param plate_name: the data plate's name if the user gave it.
    :raises ValueError: from :func:`find_data_plate` and :func:`split_param_sites`.
    """
    with torch.no_grad(), poutine.block():
        guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
        model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(*args, **kwargs)
    traces = [guide_trace, model_trace]
    plate = find_data_plate(traces, num_data, plate_name)
    store = pyro.get_param_store()
    unconstrained = dict(store.named_parameters())
    check_local_latents_stay_local(guide, model_trace, plate)
    global_sites, local_sites = split_param_sites(
        traces, plate, store.get_state()["constraints"], unconstrained
    )
    return FoundSites(
        plate,
        global_sites,
        local_sites,
        plate.name in guide_trace.nodes,
        monte_carlo_sites(guide_trace),
        guide_trace,
    )


def local_latents(model_trace: Trace, plate: DataPlate) -> list[str]:
    """The model's latent sample sites inside the data plate: one value per datum."""
    return [
        name
        for name, site in model_trace.nodes.items()
        if site["type"] == "sample"
        and not site["is_observed"]
        and not is_subsample_site(site)
        and any(frame.name == plate.name for frame in site["cond_indep_stack"])
    ]


def check_local_latents_stay_local(guide: Callable, model_trace: Trace, plate: DataPlate) -> None:
    """Refuse an autoguide that folds per-datum latents into one global vector.

    ``AutoMultivariateNormal``, ``AutoLowRankMultivariateNormal``, ``AutoDiagonalNormal`` and
    the other :class:`~pyro.infer.autoguide.AutoContinuous` guides put every latent site into
    one vector with global params: a per-datum site then has no rows of its own, the plate
    structure that PD-VI's blocks rest on is gone, and every block's solve would move every
    datum's parameters.

    :raises ValueError: naming the guide, the folded sites and the fix.
    """
    locals_ = local_latents(model_trace, plate)
    parts = list(guide) if isinstance(guide, AutoGuideList) else [guide]
    for part in parts:
        if not isinstance(part, AutoContinuous):
            continue
        folded = [name for name in locals_ if name in part._unconstrained_shapes]
        if folded:
            kind = type(part).__name__
            global_names = [name for name in part._unconstrained_shapes if name not in folded]
            raise ValueError(
                f"{kind} folds the per-datum latent sites {folded} (inside the data plate "
                f'"{plate.name}") into one vector with global params, so they have no per-block '
                "params for PD-VI to solve. Use AutoNormal(model, create_plates=...) for them; to "
                f"keep {kind}'s correlations over the global sites {global_names}, append "
                f"{kind}(poutine.block(model, expose={global_names})) and AutoNormal(poutine.block("
                f"model, hide={global_names})) to an AutoGuideList(model, create_plates=lambda *a, "
                f'**k: pyro.plate("{plate.name}", {plate.size}, subsample=<the step\'s indices>))'
            )


def missing_subsample_message(site: dict, where: str, guide: Callable) -> str:
    """Why a step's data plate has no subsample, and what to write instead.

    :param site: the plate's subsample message (from :func:`~pyro_pdvi.infer.handlers.plate_entry`).
    :param where: ``"guide"`` or ``"model"``.
    :param guide: the guide, to name an autoguide's ``create_plates``.
    """
    name, size, subsample_size = site["name"], site["fn"].size, site["fn"].subsample_size
    fix = (
        f'write it `pyro.plate("{name}", {size}, subsample=idx) as ind`, index the data with `ind`, '
        "and pass one block's indices each step (`pdvi.step(..., blocks[b])`); or call "
        "`pdvi.run(num_epochs, ...)`, which sets each block itself"
    )
    if subsample_size is not None and subsample_size < size:
        message = (
            f'the {where}\'s plate "{name}" draws its own random minibatch (subsample_size='
            f"{subsample_size}), but PD-VI steps on fixed blocks, each with its own dual: {fix}"
        )
    else:
        message = (
            f'the {where}\'s plate "{name}" got no subsample in this step (it would cover all '
            f"{size} data), so PDVI cannot tell which block the step is: {fix}"
        )
    if where == "guide" and isinstance(guide, AutoGuide):
        message += (
            f". {type(guide).__name__} built without create_plates makes its plates so: build it with "
            f'create_plates=lambda *args, **kwargs: pyro.plate("{name}", {size}, subsample=<the '
            "step's indices>)"
        )
    return message
