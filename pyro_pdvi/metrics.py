"""Scores that benchmarks, examples and notebooks share: the mixture Wasserstein distance of
the paper's Fig. 3 and the adjusted Rand index of its spatial experiment [1, Sec. 5].

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
[3] Delon, Desolneux (2020), "A Wasserstein-type distance in the space of Gaussian
    mixture models", SIAM J. Imaging Sci. 13(2).
[4] Hubert, Arabie (1985), "Comparing partitions", J. Classification 2.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def _as_tensor(value: torch.Tensor | np.ndarray) -> torch.Tensor:
    return torch.as_tensor(value).detach().to("cpu", torch.float64)


def gaussian_w2_squared(
    means_a: torch.Tensor, cov_diag_a: torch.Tensor, means_b: torch.Tensor, cov_diag_b: torch.Tensor
) -> torch.Tensor:
    """Pairwise squared 2-Wasserstein distances between diagonal Gaussians::

        W2^2(N(a, diag(S)), N(b, diag(T))) = ||a - b||^2 + ||sqrt(S) - sqrt(T)||^2

    :param means_a: ``(K, d)``.
    :param cov_diag_a: ``(K, d)`` or ``(d,)`` (shared).
    :param means_b: ``(L, d)``.
    :param cov_diag_b: ``(L, d)`` or ``(d,)``.
    :returns: ``(K, L)``.
    """
    root_a = cov_diag_a.sqrt().expand_as(means_a)
    root_b = cov_diag_b.sqrt().expand_as(means_b)
    mean_part = (means_a[:, None, :] - means_b[None, :, :]).square().sum(-1)
    cov_part = (root_a[:, None, :] - root_b[None, :, :]).square().sum(-1)
    return mean_part + cov_part


def wasserstein_gmm(
    true_means: torch.Tensor | np.ndarray,
    true_cov_diag: torch.Tensor | np.ndarray,
    fitted_means: torch.Tensor | np.ndarray,
    fitted_cov_diag: torch.Tensor | np.ndarray,
) -> float:
    """Distance between two equal-weight mixtures of K diagonal Gaussians, the metric of
    [1, Fig. 3]: the mixture Wasserstein distance MW2 of [3] with weights ``1/K``::

        MW2 = sqrt( min_{permutation pi} (1/K) sum_k W2^2(N_k, N'_{pi(k)}) )

    With equal weights the optimal coupling of the components is a permutation, found by
    :func:`scipy.optimize.linear_sum_assignment`. It is an upper bound of the exact W2
    between the two mixture densities, zero iff the mixtures have the same components.

    For this model compare the true mixture ``N(c_k, Sigma_0)`` with the fitted posterior
    predictive components ``N(m_k, Sigma_0 + diag(exp(rho_k)))``, see
    :func:`pyro_pdvi.models.gmm.predictive_components`.

    :param true_means: ``(K, d)``.
    :param true_cov_diag: ``(K, d)`` or ``(d,)``.
    :param fitted_means: ``(K, d)``.
    :param fitted_cov_diag: ``(K, d)`` or ``(d,)``.
    :rtype: float
    """
    true_means, fitted_means = _as_tensor(true_means), _as_tensor(fitted_means)
    if true_means.shape != fitted_means.shape:
        raise ValueError(
            f"both mixtures need the same number of components and dimension, got "
            f"{tuple(true_means.shape)} and {tuple(fitted_means.shape)}"
        )
    cost = gaussian_w2_squared(
        true_means, _as_tensor(true_cov_diag), fitted_means, _as_tensor(fitted_cov_diag)
    )
    # Imported here so that the model and solvers need no scipy (e.g. on a bare GPU machine).
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(cost.numpy())
    return math.sqrt(float(cost.numpy()[rows, cols].mean()))


def adjusted_rand_index(
    labels_true: torch.Tensor | np.ndarray, labels_pred: torch.Tensor | np.ndarray
) -> float:
    """Adjusted Rand index [4] of two labelings of the same items (1 for identical
    partitions up to renaming, about 0 for independent ones). When both labelings put
    everything in one cluster, or each item alone, it is 1.

    :param labels_true: ``(N,)`` labels of any hashable kind numpy can sort.
    :param labels_pred: ``(N,)``.
    :rtype: float
    """
    labels_true = np.asarray(labels_true.cpu() if isinstance(labels_true, torch.Tensor) else labels_true)
    labels_pred = np.asarray(labels_pred.cpu() if isinstance(labels_pred, torch.Tensor) else labels_pred)
    if labels_true.ndim != 1 or labels_true.shape != labels_pred.shape:
        raise ValueError(
            f"labels must be two 1-D arrays of the same length, got shapes {labels_true.shape} "
            f"and {labels_pred.shape}"
        )
    _, rows = np.unique(labels_true, return_inverse=True)
    _, cols = np.unique(labels_pred, return_inverse=True)
    table = np.zeros((rows.max(initial=-1) + 1, cols.max(initial=-1) + 1), dtype=np.int64)
    np.add.at(table, (rows, cols), 1)

    def pairs(counts: np.ndarray) -> float:
        counts = counts.astype(np.float64)
        return float((counts * (counts - 1.0) / 2.0).sum())

    num_pairs = pairs(np.array([labels_true.size]))
    index = pairs(table)
    row_pairs, col_pairs = pairs(table.sum(1)), pairs(table.sum(0))
    expected = row_pairs * col_pairs / num_pairs if num_pairs > 0 else 0.0
    maximum = 0.5 * (row_pairs + col_pairs)
    if maximum == expected:
        return 1.0
    return (index - expected) / (maximum - expected)
