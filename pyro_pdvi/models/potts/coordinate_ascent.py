"""Mean-field coordinate ascent for the Potts mixture [2, Sec. 2.4]: the colour-class sweep
that the patch solver runs, and the full-batch fixed point PD-VI is checked against.

A sweep updates ``phi`` one colour class (an independent set of the graph) at a time, each
class at once: within a class no two spots are neighbours, so every class update is the
exact minimiser of the objective in those spots' ``phi`` given all others (the objective in
``phi_i`` alone is ``<phi_i, log phi_i - ell_i - (W phi)_i>`` on the simplex), and a sweep
never increases it. :class:`ColourOrder` renumbers the spots so that every class is a
contiguous range: a class update then reads and writes slices, not scattered rows.

[2] Blei, Kucukelbir, McAuliffe (2017), "Variational Inference: A Review for
    Statisticians", JASA 112(518), Sec. 2.4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..gmm import CAVIResult, GMMPrior, conjugate_update, expected_log_likelihood
from .graph import SpatialGraph
from .objective import potts_negative_elbo


@dataclass
class ColourOrder:
    """A graph's nodes renumbered colour class by colour class.

    :param order: ``(n,)`` the old index of each new position (``x_new = x_old[order]``).
    :param inverse: ``(n,)`` the new position of each old index (``x_old = x_new[inverse]``).
    :param graph: the graph in the new numbering.
    :param classes: per colour class, its range ``(start, end)`` of new positions and the
        rows ``graph.rows(range(start, end))``.
    """

    order: torch.Tensor
    inverse: torch.Tensor
    graph: SpatialGraph
    classes: list[tuple[int, int, SpatialGraph]]

    @classmethod
    def of(cls, graph: SpatialGraph, seed: int = 0) -> ColourOrder:
        """The order of ``graph``'s greedy colouring (:meth:`SpatialGraph.colour_classes`)."""
        colour_classes = graph.colour_classes(seed)
        order = torch.cat(colour_classes)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        permuted = graph.subgraph(order)
        classes, start = [], 0
        for nodes in colour_classes:
            end = start + nodes.numel()
            classes.append((start, end, permuted.rows(torch.arange(start, end, device=order.device))))
            start = end
        return cls(order, inverse, permuted, classes)


def mean_field_sweep(
    log_likelihood: torch.Tensor,
    phi: torch.Tensor,
    log_phi: torch.Tensor,
    colours: ColourOrder,
    temperature: float = 1.0,
) -> None:
    """One pass over the colour classes, in place:
    ``log phi_S = log softmax((ell_S + sum_l r_Sl phi_l) / T)`` for each class ``S``.

    All tensors are in the colour order (:class:`ColourOrder`). The softmax is written out
    (max, ``exp``, sum): with ``K`` of a few tens, :func:`torch.log_softmax` over the last
    axis was twice as slow on the CPU (150k x 12, float64, one thread).

    :param log_likelihood: ``ell`` up to a per-spot constant, ``(n, K)``.
    :param phi: ``(n, K)`` probabilities, updated in place.
    :param log_phi: ``(n, K)`` their logarithms, updated in place.
    :param colours: the classes.
    :param temperature: ``T`` of the annealed objective (1: the exact one).
    """
    for start, end, rows in colours.classes:
        logits = log_likelihood[start:end] + rows.neighbour_sum(phi)
        if temperature != 1.0:
            logits = logits / temperature
        logits = logits - logits.amax(-1, keepdim=True)
        weights = logits.exp()
        total = weights.sum(-1, keepdim=True)
        torch.div(weights, total, out=phi[start:end])
        torch.sub(logits, total.log(), out=log_phi[start:end])


@torch.no_grad()
def coordinate_ascent(
    data: torch.Tensor,
    prior: GMMPrior,
    graph: SpatialGraph,
    alpha: torch.Tensor,
    num_iterations: int = 1000,
    tol: float = 1e-12,
) -> CAVIResult:
    """Full-batch mean-field coordinate ascent [2, Sec. 2.4] for the Potts mixture.

    Starting from ``q(c)`` given ``alpha``, each iteration sweeps ``phi`` colour class by
    colour class (:func:`mean_field_sweep`), then sets ``q(c)`` to its conjugate form. The
    objective never increases. Stops when no ``m``, ``rho`` or ``alpha`` entry moves more
    than ``tol``.

    :param data: ``(N, d)``.
    :param prior: the hyperparameters.
    :param graph: the symmetric graph (restricted to patches to compare with PD-VI).
    :param alpha: initial logits ``(N, K)``.
    :param num_iterations: maximum sweeps.
    :param tol: stopping threshold.
    :rtype: ~pyro_pdvi.models.gmm.CAVIResult
    """
    colours = ColourOrder.of(graph)
    ordered = data[colours.order]
    log_phi = torch.log_softmax(alpha.detach(), -1)[colours.order].clone()
    phi = log_phi.exp()
    m, rho = conjugate_update(ordered, prior, phi)
    losses, converged = [], False
    for _ in range(num_iterations):
        old_log_phi = log_phi.clone()
        mean_field_sweep(expected_log_likelihood(ordered, prior, m, rho), phi, log_phi, colours)
        new_m, new_rho = conjugate_update(ordered, prior, phi)
        losses.append(potts_negative_elbo(ordered, prior, colours.graph, new_m, new_rho, log_phi))
        change = max(
            float((new_m - m).abs().max()),
            float((new_rho - rho).abs().max()),
            float((log_phi - old_log_phi).abs().max()),
        )
        m, rho = new_m, new_rho
        if change < tol:
            converged = True
            break
    return CAVIResult(m, rho, log_phi[colours.inverse], torch.stack(losses), converged)
