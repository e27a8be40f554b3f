"""Full-batch mean-field coordinate ascent for the Potts mixture [2, Sec. 2.4]: the fixed
point PD-VI is checked against, and the colour-class sweep that the patch solver shares.

[2] Blei, Kucukelbir, McAuliffe (2017), "Variational Inference: A Review for
    Statisticians", JASA 112(518), Sec. 2.4.
"""

from __future__ import annotations

import torch

from ..gmm import CAVIResult, GMMPrior, conjugate_update, expected_log_likelihood
from .graph import SpatialGraph
from .objective import potts_negative_elbo


def mean_field_sweep(
    log_likelihood: torch.Tensor,
    alpha: torch.Tensor,
    classes: list[tuple[torch.Tensor, SpatialGraph]],
    temperature: float = 1.0,
) -> torch.Tensor:
    """One pass over the colour classes: ``alpha_S = log softmax((ell_S + sum_l r_il phi_l) / T)``.

    Within a class no two spots are neighbours, so each class update is the exact
    minimiser of the objective in those spots' ``phi`` given all others (the objective
    in ``phi_i`` alone is ``<phi_i, log phi_i - ell_i - (W phi)_i>`` on the simplex).

    :param log_likelihood: ``ell = E_q[log p(x_i | c_k)]``, ``(N, K)``.
    :param alpha: the logits, ``(N, K)``, updated in place and returned.
    :param classes: the colour classes with their rows (:func:`colour_rows`).
    :param temperature: ``T`` of the annealed objective.
    """
    phi = alpha.exp()
    for nodes, rows in classes:
        updated = torch.log_softmax((log_likelihood[nodes] + rows.neighbour_sum(phi)) / temperature, -1)
        alpha[nodes] = updated
        phi[nodes] = updated.exp()
    return alpha


def colour_rows(graph: SpatialGraph, seed: int = 0) -> list[tuple[torch.Tensor, SpatialGraph]]:
    """The graph's colour classes (:meth:`SpatialGraph.colour_classes`), each with its rows."""
    return [(nodes, graph.rows(nodes)) for nodes in graph.colour_classes(seed) if nodes.numel()]


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

    Starting from ``q(c)`` given ``alpha``, each sweep updates ``phi`` colour class by
    colour class (:meth:`SpatialGraph.colour_classes`, each an exact minimisation), then
    ``q(c)`` to its conjugate form. The objective never increases. Stops when no ``m``,
    ``rho`` or ``alpha`` entry moves more than ``tol``.

    :param data: ``(N, d)``.
    :param prior: the hyperparameters.
    :param graph: the symmetric graph (restricted to patches to compare with PD-VI).
    :param alpha: initial logits ``(N, K)``.
    :param num_iterations: maximum sweeps.
    :param tol: stopping threshold.
    :rtype: ~pyro_pdvi.models.gmm.CAVIResult
    """
    classes = colour_rows(graph)
    alpha = torch.log_softmax(alpha.detach(), -1).clone()
    m, rho = conjugate_update(data, prior, alpha.exp())
    losses, converged = [], False
    for _ in range(num_iterations):
        old_alpha = alpha.clone()
        alpha = mean_field_sweep(expected_log_likelihood(data, prior, m, rho), alpha, classes)
        new_m, new_rho = conjugate_update(data, prior, alpha.exp())
        losses.append(potts_negative_elbo(data, prior, graph, new_m, new_rho, alpha))
        change = max(
            float((new_m - m).abs().max()),
            float((new_rho - rho).abs().max()),
            float((alpha - old_alpha).abs().max()),
        )
        m, rho = new_m, new_rho
        if change < tol:
            converged = True
            break
    return CAVIResult(m, rho, alpha, torch.stack(losses), converged)
