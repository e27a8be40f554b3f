"""The latent sites of a Pyro model as one flat vector in unconstrained space.

MF-WGF moves the continuous latent sites of a model in the unconstrained coordinates
of :func:`torch.distributions.biject_to` (the same coordinates as Pyro's
``initialize_model`` and ``AutoNormal``). :func:`trace_sites` traces the model once and
returns a :class:`SiteLayout`: where every continuous site sits in a flat vector of
length ``D``, its transform to the constrained support, the discrete sites that the
E-step sums out (they must be marked ``infer={"enumerate": "parallel"}``), and how many
plate dimensions the model uses, so that a particle plate can be put to their left.

[1] Yao, Yang (2022), "Mean-field variational inference via Wasserstein gradient flow",
    arXiv:2207.08074.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pyro
import torch
from pyro import poutine
from pyro.infer.autoguide.initialization import InitMessenger
from pyro.poutine.util import site_is_subsample
from torch.distributions import Transform, biject_to

#: Name of the plate that carries the particles (or Monte Carlo configurations).
PARTICLE_PLATE = "_mfwgf_particles"


@dataclass(frozen=True)
class LatentSite:
    """One continuous latent site.

    :param name: the site name.
    :param shape: shape of its (constrained) value in the model, ``batch + event``.
    :param unconstrained_shape: shape of its unconstrained value (differs for e.g. a simplex).
    :param transform: ``biject_to(support)``, unconstrained to constrained.
    :param start: first coordinate in the flat vector.
    :param size: number of unconstrained coordinates.
    """

    name: str
    shape: torch.Size
    unconstrained_shape: torch.Size
    transform: Transform
    start: int
    size: int

    @property
    def coordinates(self) -> slice:
        """This site's slice of the flat vector."""
        return slice(self.start, self.start + self.size)


@dataclass(frozen=True)
class SiteLayout:
    """Continuous latent sites of a model, laid out in one flat unconstrained vector.

    :param sites: the continuous latent sites, in the model's order.
    :param enumerated: names of the discrete sites marked for parallel enumeration.
    :param max_plate_nesting: plate dimensions the model uses; the particle plate goes at
        ``dim = -max_plate_nesting - 1``.
    :param initial: the initial point (from ``init_loc_fn``), unconstrained, shape ``(D,)``.
    """

    sites: tuple[LatentSite, ...]
    enumerated: tuple[str, ...]
    max_plate_nesting: int
    initial: torch.Tensor

    @property
    def size(self) -> int:
        """D, the number of unconstrained coordinates."""
        return self.initial.shape[0]

    @property
    def names(self) -> list[str]:
        """The continuous latent site names."""
        return [site.name for site in self.sites]

    def unconstrained(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split ``(B, D)`` into ``{name: (B, *unconstrained_shape)}``."""
        batch = flat.shape[0]
        return {s.name: flat[:, s.coordinates].reshape(batch, *s.unconstrained_shape) for s in self.sites}

    def constrain(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{name: (B, *shape)}``: the constrained values of a batch of flat vectors."""
        return {s.name: s.transform(value) for s, value in zip(self.sites, self.unconstrained(flat).values())}

    def particle_values(self, flat: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Constrained values shaped for the particle plate, and ``log |det J|`` per row.

        A site of shape ``batch + event`` gets the value shape
        ``(B, 1, ..., 1) + batch + event`` with ``max_plate_nesting - len(batch)`` ones, so
        that the particle dimension sits at ``-max_plate_nesting - 1`` of its batch shape.

        :param flat: ``(B, D)`` unconstrained.
        :returns: ``{name: value}`` and the log-Jacobian of unconstrained to constrained, ``(B,)``.
        """
        batch = flat.shape[0]
        values = {}
        log_det = flat.new_zeros(batch)
        for site, value in zip(self.sites, self.unconstrained(flat).values()):
            event_dim = site.transform.domain.event_dim
            batch_ndim = len(site.unconstrained_shape) - event_dim
            pad = (1,) * (self.max_plate_nesting - batch_ndim)
            value = value.reshape(batch, *pad, *site.unconstrained_shape)
            constrained = site.transform(value)
            log_det = log_det + site.transform.log_abs_det_jacobian(value, constrained).reshape(
                batch, -1
            ).sum(-1)
            values[site.name] = constrained
        return values, log_det


def vectorize(model: Callable, num: int, max_plate_nesting: int) -> Callable:
    """``model`` inside a plate of ``num`` particles at ``dim = -max_plate_nesting - 1``,
    the plumbing of Pyro's ``SVGD``: every site gets a particle dimension, so one trace
    and one backward pass serve all particles."""

    def vectorized(*args, **kwargs):
        with pyro.plate(PARTICLE_PLATE, num, dim=-max_plate_nesting - 1):
            return model(*args, **kwargs)

    return vectorized


def _plate_nesting(trace: poutine.Trace) -> int:
    """Plate dimensions a trace uses: its vectorised plates and any batch dimension of a
    sample site that no plate declares (which must then also stay right of the particles)."""
    nesting = 0
    for site in trace.nodes.values():
        if site["type"] != "sample":
            continue
        for frame in site["cond_indep_stack"]:
            if frame.vectorized and frame.dim is not None:
                nesting = max(nesting, -frame.dim)
        if not site_is_subsample(site):
            nesting = max(nesting, len(site["fn"].batch_shape))
    return nesting


def trace_sites(
    model: Callable,
    args: tuple,
    kwargs: dict,
    init_loc_fn: Callable,
    max_plate_nesting: int | None = None,
) -> SiteLayout:
    """Trace ``model`` once and lay out its latent sites.

    :param model: a Pyro model.
    :param args: its positional arguments.
    :param kwargs: its keyword arguments.
    :param init_loc_fn: per-site initialisation, as in ``pyro.infer.autoguide`` (e.g.
        ``init_to_median``); gives :attr:`SiteLayout.initial`.
    :param max_plate_nesting: plate dimensions of the model; guessed from the trace if ``None``.
    :raises ValueError: for a discrete latent site not marked for parallel enumeration, for a
        model without a continuous latent site (both name the sites), or for a
        ``max_plate_nesting`` below what the model uses.
    """

    def init_continuous(site: dict) -> torch.Tensor:  # discrete sites are summed out, not initialised
        return site["fn"].sample() if site["fn"].support.is_discrete else init_loc_fn(site)

    with poutine.block():
        trace = poutine.trace(InitMessenger(init_continuous)(model)).get_trace(*args, **kwargs)
    sites, enumerated, initial = [], [], []
    start = 0
    for name, node in trace.nodes.items():
        if node["type"] != "sample" or node["is_observed"] or site_is_subsample(node):
            continue
        fn = node["fn"]
        if fn.support.is_discrete:
            if node["infer"].get("enumerate") != "parallel" or not fn.has_enumerate_support:
                raise ValueError(
                    f'site "{name}" is discrete ({type(fn).__name__}); MF-WGF moves continuous sites '
                    "and sums discrete ones out with the E-step of [1, eq. 18]. Mark it "
                    'infer={"enumerate": "parallel"} (or wrap the model in '
                    "pyro.infer.config_enumerate); a distribution without enumerate support "
                    "cannot be used"
                )
            enumerated.append(name)
            continue
        try:
            transform = biject_to(fn.support)
        except NotImplementedError as error:
            raise ValueError(
                f'site "{name}": torch has no bijection from unconstrained space to its support '
                f"{fn.support}; use a distribution with a registered support (for a mixture, "
                "pyro.distributions.MixtureOfDiagNormals instead of MixtureSameFamily)"
            ) from error
        unconstrained = transform.inv(node["value"].detach())
        sites.append(
            LatentSite(
                name, node["value"].shape, unconstrained.shape, transform, start, unconstrained.numel()
            )
        )
        initial.append(unconstrained.reshape(-1))
        start += unconstrained.numel()
    if not sites:
        observed = [name for name, node in trace.nodes.items() if node["type"] == "sample"]
        raise ValueError(
            "MF-WGF found no continuous latent sample site in the model (sample sites: "
            f"{observed or 'none'}; observed sites and enumerated discrete sites are not moved). "
            "Add a latent pyro.sample site without obs=, or use pyro.infer.SVI for a model of params only"
        )
    nesting = _plate_nesting(trace)
    if max_plate_nesting is not None:
        if max_plate_nesting < nesting:
            raise ValueError(
                f"max_plate_nesting={max_plate_nesting} is below the {nesting} batch dimensions the model's "
                "sites use (plates, or batch dimensions without a plate); pass at least that, or None"
            )
        nesting = max_plate_nesting
    return SiteLayout(tuple(sites), tuple(enumerated), nesting, torch.cat(initial))
