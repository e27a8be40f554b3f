"""Spatial domains from an AnnData object, and a plot of them on the tissue.

:func:`fit_spatial_domains` reads coordinates from ``adata.obsm["spatial"]`` and features
from an existing representation (``adata.obsm["X_pca"]`` by default) or computes them with
torch the way [1, App. C.1] preprocesses (library-size normalisation, ``log1p``, scaling by
the standard deviation with clipping, then PCA), fits the Potts mixture with P2D-VI
(:func:`~pyro_pdvi.spatial.fit.fit_potts_mixture`), and writes the labels to
``adata.obs[key_added]`` and the posteriors to ``adata.obsm[key_added + "_probabilities"]``.
:func:`plot_spatial_domains` draws them with matplotlib.

Needs ``anndata`` (``pip install pyro-pdvi[spatial]``).

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .fit import SpatialFit, fit_potts_mixture


def expression_features(
    counts: Any, num_components: int = 20, clip: float = 10.0, seed: int = 0, exact_max_genes: int = 4000
) -> torch.Tensor:
    """PCA features of raw counts as in [1, App. C.1]: scale every spot to the median
    library size, ``log1p``, divide each gene by its standard deviation (after centring)
    and clip to ``[-clip, clip]``, then the top ``num_components`` principal components:
    exact (eigendecomposition of the gene scatter matrix) for up to ``exact_max_genes``
    genes, else randomised (:func:`torch.pca_lowrank`, seeded, 10 power iterations).

    :param counts: ``(N, G)`` dense array or scipy sparse matrix of counts.
    :param num_components: number of components (at most ``min(N, G)``).
    :param clip: clipping of the scaled values.
    :param seed: seed of the randomised PCA.
    :param exact_max_genes: largest gene count for the exact PCA.
    :returns: ``(N, num_components)`` float64 scores.
    """
    if hasattr(counts, "toarray"):
        counts = counts.toarray()
    values = torch.as_tensor(np.asarray(counts), dtype=torch.float64)
    if values.dim() != 2:
        raise ValueError(f"counts must be a 2-D (spots x genes) matrix, got shape {tuple(values.shape)}")
    if not 1 <= num_components <= min(values.shape):
        raise ValueError(f"Invalid num_components: {num_components}; use 1 <= n <= {min(values.shape)}")
    library = values.sum(1, keepdim=True)
    values = (values * (library.median() / library.clamp_min(1e-12))).log1p()
    values = values - values.mean(0)
    values = (values / values.std(0).clamp_min(1e-12)).clamp(-clip, clip)
    values = values - values.mean(0)
    if values.shape[1] <= exact_max_genes:
        # Exact: eigenvectors of the (G x G) scatter matrix, largest first.
        _, vectors = torch.linalg.eigh(values.T @ values)
        return values @ vectors.flip(-1)[:, :num_components]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        u, s, _ = torch.pca_lowrank(values, q=num_components, center=False, niter=10)
    return u[:, :num_components] * s[:num_components]


def fit_spatial_domains(
    adata: Any,
    n_domains: int,
    *,
    use_rep: str = "X_pca",
    n_pcs: int = 20,
    spatial_key: str = "spatial",
    key_added: str = "spatial_domain",
    device: torch.device | str | None = None,
    **kwargs: Any,
) -> SpatialFit:
    """Spatial domains of an AnnData object by the Potts mixture of [1, App. C.1].

    :param adata: an :class:`anndata.AnnData` with spot coordinates in ``adata.obsm[spatial_key]``.
    :param n_domains: K, the number of domains.
    :param use_rep: key of ``adata.obsm`` with features; when absent, PCA features of
        ``adata.X`` (:func:`expression_features`) are computed and stored there.
    :param n_pcs: number of feature columns used (and computed).
    :param spatial_key: key of the ``(N, 2)`` coordinates in ``adata.obsm``.
    :param key_added: ``adata.obs`` column for the labels (categorical); the ``(N, K)``
        posteriors go to ``adata.obsm[key_added + "_probabilities"]`` and the fit's
        settings and per-epoch history to ``adata.uns[key_added]``.
    :param device: ``"cpu"`` (default) or ``"cuda"``.
    :param kwargs: passed to :func:`~pyro_pdvi.spatial.fit.fit_potts_mixture` (``method``,
        ``potts_weight``, ``num_neighbors``, ``num_patches``, ``num_epochs``, ``prior``,
        ``init_labels``, ``truth``, ``seed``, ...).
    :returns: the fit (labels and posteriors also written into ``adata``).
    :rtype: SpatialFit
    """
    import pandas as pd

    if spatial_key not in adata.obsm:
        raise ValueError(
            f'adata.obsm has no "{spatial_key}" coordinates (keys: {list(adata.obsm.keys())}); '
            "store the (N, 2) spot coordinates there or pass spatial_key="
        )
    coords = np.asarray(adata.obsm[spatial_key], dtype=np.float64)[:, :2]
    if use_rep not in adata.obsm:
        adata.obsm[use_rep] = expression_features(adata.X, n_pcs).numpy()
    features = np.asarray(adata.obsm[use_rep], dtype=np.float64)
    if features.shape[1] < n_pcs:
        raise ValueError(
            f'adata.obsm["{use_rep}"] has {features.shape[1]} columns, fewer than n_pcs = {n_pcs}'
        )
    fit = fit_potts_mixture(
        torch.from_numpy(features[:, :n_pcs].copy()),
        torch.from_numpy(coords),
        n_domains,
        device=device,
        **kwargs,
    )
    labels = fit.labels.cpu().numpy()
    adata.obs[key_added] = pd.Categorical(labels.astype(str), categories=[str(k) for k in range(n_domains)])
    adata.obsm[f"{key_added}_probabilities"] = fit.probabilities.cpu().numpy()
    adata.uns[key_added] = {
        "params": {"n_domains": n_domains, "use_rep": use_rep, "n_pcs": n_pcs, **_plain(kwargs)},
        "step_sizes": dict(fit.step_sizes),
        "history": {key: np.asarray(value) for key, value in fit.history.items()},
    }
    return fit


def _plain(kwargs: dict) -> dict:
    """Settings that AnnData can store (numbers, strings, bools)."""
    return {k: v for k, v in kwargs.items() if isinstance(v, (int, float, str, bool))}


def plot_spatial_domains(
    adata: Any,
    keys: str | list[str] = "spatial_domain",
    *,
    spatial_key: str = "spatial",
    spot_size: float | None = None,
    axes: Any = None,
    cmap: str = "tab20",
):
    """Draw labels on the tissue, one panel per key of ``adata.obs`` (e.g. truth and fit).

    :param adata: the AnnData object.
    :param keys: one ``adata.obs`` column or a list of them.
    :param spatial_key: key of the coordinates in ``adata.obsm``.
    :param spot_size: marker size (default scaled to the number of spots).
    :param axes: matplotlib axes to draw into (one per key); new ones if ``None``.
    :param cmap: a qualitative colormap.
    :returns: the list of axes.
    """
    import matplotlib.pyplot as plt

    keys = [keys] if isinstance(keys, str) else list(keys)
    for key in keys:
        if key not in adata.obs:
            raise ValueError(f'adata.obs has no column "{key}"; run fit_spatial_domains first or pass keys=')
    coords = np.asarray(adata.obsm[spatial_key])[:, :2]
    if axes is None:
        _, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 4.5), squeeze=False)
        axes = list(axes[0])
    size = spot_size if spot_size is not None else max(0.02, 3000.0 / coords.shape[0])
    for ax, key in zip(axes, keys):
        codes = np.unique(np.asarray(adata.obs[key]).astype(str), return_inverse=True)[1]
        ax.scatter(coords[:, 0], coords[:, 1], c=codes, s=size, cmap=cmap, linewidths=0, rasterized=True)
        ax.set_aspect("equal")
        ax.set_title(key)
        ax.set_xticks([])
        ax.set_yticks([])
    return axes
