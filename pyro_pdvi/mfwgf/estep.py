"""The E-step of MF-WGF for enumerated discrete local sites [1, Sec. 3.3, eq. 18].

For a latent-variable model with continuous globals ``theta`` and discrete locals
``z_i`` that are independent given ``theta``, the optimal mean-field factor of ``z_i``
given ``q(theta)`` has the closed form [1, eq. 18]::

    q(z_i = k)  ∝  exp( E_{q(theta)} [ log p(z_i = k, x_i | theta) ] )

where the expectation is the average over the particles (or Monte Carlo configurations)
of ``theta``. The globals then take a JKO step on the potential
``-E_{q(z)}[log p(x, z, theta)]`` [1, eqs. 19-20], which is this module's
:attr:`LocalSumOut.log_joint` (negated).

It works on a trace of the vectorised model under ``poutine.enum``: every site whose
log-density carries the enumeration dimension of ``z`` belongs to ``z``'s group (``z``'s
own prior and the likelihood terms it enters); a site carrying two enumeration
dimensions couples two discrete sites, which this E-step does not handle.

[1] Yao, Yang (2022), "Mean-field variational inference via Wasserstein gradient flow",
    arXiv:2207.08074.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from pyro import poutine
from pyro.poutine.util import site_is_subsample


class LocalSumOut(NamedTuple):
    """What :func:`sum_out_locals` returns.

    :param log_joint: ``E_{q(z)}[log p(x, z, theta)]`` for every configuration, ``(B,)``
        (the plain ``log p`` when the model has no enumerated site).
    :param local_log_probs: ``{site: log q(z)}``, with the enumeration dimension of the
        trace at its place and a particle dimension of size 1.
    :param local_neg_entropy: ``E_{q(z)}[log q(z)]`` summed over all locals (0-dim).
    """

    log_joint: torch.Tensor
    local_log_probs: dict[str, torch.Tensor]
    local_neg_entropy: torch.Tensor


def per_configuration(log_prob: torch.Tensor, particle_dim: int, batch: int) -> torch.Tensor:
    """Sum a log-density over every dimension but the particle one, ``(B,)``."""
    plate_dims = tuple(range(particle_dim + 1, 0))
    if plate_dims:
        log_prob = log_prob.sum(plate_dims)
    if log_prob.dim() == 0:
        return log_prob.expand(batch)
    return log_prob.reshape(-1, log_prob.shape[-1]).sum(0).expand(batch)


def _align_to(
    term: torch.Tensor, local: torch.Tensor, particle_dim: int, names: tuple[str, str]
) -> torch.Tensor:
    """Sum ``term`` over the plates that ``local``'s site is not in (inner plates).

    :raises ValueError: when ``term`` sits outside a plate of the local site: then it
        depends on all of that plate's discrete values at once.
    """
    for dim in range(particle_dim + 1, 0):
        local_size = local.shape[dim] if -dim <= local.dim() else 1
        term_size = term.shape[dim] if -dim <= term.dim() else 1
        if local_size == 1 and term_size > 1:
            term = term.sum(dim, keepdim=True)
        elif local_size > 1 and term_size == 1:
            raise ValueError(
                f'site "{names[0]}" depends on the enumerated site "{names[1]}" but is outside one '
                "of its plates, so it couples all of its values; the E-step of MF-WGF needs "
                "discrete sites that are independent given the continuous sites"
            )
    return term


def sum_out_locals(
    trace: poutine.Trace,
    particle_dim: int,
    batch: int,
    local_log_probs: dict[str, torch.Tensor] | None = None,
) -> LocalSumOut:
    """The log joint of each configuration with the enumerated locals summed out under
    their mean-field factors, and those factors.

    :param trace: a trace of the vectorised, conditioned model (under ``poutine.enum`` if
        it has enumerated sites) on which ``compute_log_prob`` was called.
    :param particle_dim: the particle plate's dimension, ``-max_plate_nesting - 1``.
    :param batch: B, the number of configurations.
    :param local_log_probs: factors to use instead of the E-step (e.g. held fixed while
        curvatures are measured); by default they are computed from this batch:
        ``log q(z) = log_softmax(mean over configurations of the group's log-density)``.
    :raises ValueError: for a site that depends on two enumerated sites, or that depends on
        an enumerated site from outside one of its plates.
    """
    sites = {
        name: site
        for name, site in trace.nodes.items()
        if site["type"] == "sample" and not site_is_subsample(site)
    }
    enum_dims = {
        site["infer"]["_enumerate_dim"]: name
        for name, site in sites.items()
        if "_enumerate_dim" in site["infer"]
    }
    log_joint = next(iter(sites.values()))["log_prob"].new_zeros(batch)
    groups: dict[str, list[str]] = {name: [] for name in enum_dims.values()}
    for name, site in sites.items():
        log_prob = site["log_prob"]
        involved = [dim for dim in range(-log_prob.dim(), particle_dim) if log_prob.shape[dim] > 1]
        if not involved:
            log_joint = log_joint + per_configuration(log_prob, particle_dim, batch)
            continue
        stray = [dim for dim in involved if dim not in enum_dims]
        if stray:
            raise ValueError(
                f'site "{name}" has a log-density of shape {tuple(log_prob.shape)} with a dimension left of '
                f"the particle plate (dim {particle_dim}) that is no enumeration dimension: the model does "
                "not broadcast over a leading particle dimension. Index latent values from the right "
                "(w[..., 0] instead of w[0], w[..., :1] keeps an event dimension) and declare batch "
                "dimensions with pyro.plate, as for pyro.infer.SVGD"
            )
        if len(involved) > 1:
            coupled = sorted(enum_dims[dim] for dim in involved)
            raise ValueError(
                f'site "{name}" depends on the enumerated sites {coupled}; the E-step of MF-WGF '
                "[1, eq. 18] needs discrete sites that are independent given the continuous sites "
                "(each likelihood term may depend on one of them)"
            )
        groups[enum_dims[involved[0]]].append(name)

    new_log_probs, neg_entropy = {}, log_joint.new_zeros(())
    for local_name, members in groups.items():
        local = sites[local_name]
        dim = local["infer"]["_enumerate_dim"]
        reference = local["unscaled_log_prob"]
        unscaled = sum(
            _align_to(sites[m]["unscaled_log_prob"], reference, particle_dim, (m, local_name))
            for m in members
        )
        scaled = sum(
            _align_to(sites[m]["log_prob"], reference, particle_dim, (m, local_name)) for m in members
        )
        if local_log_probs is None:
            log_q = torch.log_softmax(unscaled.detach().mean(particle_dim, keepdim=True), dim)
        else:
            log_q = local_log_probs[local_name]
        q = log_q.exp()
        log_joint = log_joint + per_configuration((q * scaled).sum(dim, keepdim=True), particle_dim, batch)
        neg_entropy = neg_entropy + (q * log_q * local["scale"]).sum()
        new_log_probs[local_name] = log_q
    return LocalSumOut(log_joint, new_log_probs, neg_entropy)
