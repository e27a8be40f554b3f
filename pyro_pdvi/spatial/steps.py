"""Step sizes of the Potts fit: one per coordinate of ``m`` and ``rho``, from the patch
curvatures in closed form [1, Thm. 4.7], for :class:`~pyro_pdvi.PDVI`'s groups (a tensor
``eta`` per site).

The curvature of a patch objective ``f_b`` [1, App. C.1] in ``m_kj`` is
``N_kb / sigma0_j^2 + w_b / sigma1_j^2`` and in ``rho_kj`` half that times ``exp(rho_kj)``
(``N_kb`` the count of domain k in patch b, ``w_b = |b| / N``). The step size of a coordinate
is ``eta_scale`` over its largest curvature over the patches (P2D-VI with one group per
coordinate: the paper's ``eta_j ~ 1 / L_j`` with ``j`` running over coordinates). One step size
for all would have to suit the stiffest coordinate, the largest domain in the least noisy
feature, and leave small domains and noisy features nearly frozen: on the cSCC section of
``docs/benchmarks.md`` (section 7, one patch) the objective still fell by more than ``1e-6``
of its size per epoch after 300 epochs, against 87 epochs per coordinate.

The counts move during a fit. ``N_kb`` is taken as :data:`COUNT_MARGIN` times its count
under the start labels plus one, capped at the patch size: a count can grow that much, and a
coordinate's ``eta L`` reach 2 (beyond which a gradient step can raise the objective) only
when it grows six-fold. With patches of thousands of spots and a start from a mixture of
neighbour-averaged features the counts move by a few percent. With patches of a few dozen
spots and a poor start (k-means of the raw features) they moved more, the objective rose
in some epochs, and the fit warned with the fix (``eta_scale=0.5`` made it monotone); with
a margin of 2 it rose in one epoch with the default start.

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
"""

from __future__ import annotations

import torch

from ..models.gmm import GMMPrior

#: The count bound of a domain in a patch, in counts under the start labels (plus one spot).
COUNT_MARGIN = 3.0


def coordinate_step_sizes(
    prior: GMMPrior,
    patches: list[torch.Tensor],
    labels: torch.Tensor,
    rho: torch.Tensor,
    eta_scale: float = 1.0,
) -> dict[str, torch.Tensor]:
    """``eta`` of every coordinate of ``m`` and ``rho`` (module docstring).

    :param prior: the hyperparameters.
    :param patches: the blocks.
    :param labels: ``(N,)`` the start labels (their counts per patch).
    :param rho: ``(K, d)`` the start's log-variances.
    :param eta_scale: the constant of ``eta = eta_scale / L``.
    :returns: ``{"m": (K, d), "rho": (K, d)}``.
    """
    num_data = labels.numel()
    worst = torch.zeros_like(rho)
    for patch in patches:
        size = len(patch)
        counts = torch.bincount(labels[patch.to(labels.device)], minlength=prior.num_components)
        bound = (COUNT_MARGIN * counts.to(rho.dtype) + 1.0).clamp(max=size)[:, None]
        worst = torch.maximum(worst, bound / prior.sigma0_sq + (size / num_data) / prior.sigma1_sq)
    return {"m": eta_scale / worst, "rho": eta_scale / (0.5 * worst * rho.exp())}
