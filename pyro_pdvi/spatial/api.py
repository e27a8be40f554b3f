"""Spatial domains from an AnnData object, with scanpy's conventions, and a plot of them.

:func:`fit_spatial_domains` reads coordinates from ``adata.obsm["spatial"]`` and features
from ``adata.obsm["X_pca"]`` (all of its columns unless ``n_pcs`` is given, as scanpy does), or
computes them with torch the way [1, App. C.1] preprocesses (library-size normalisation,
``log1p``, scaling by the standard deviation with clipping, then PCA:
:func:`expression_features`). It checks them first (:mod:`~pyro_pdvi.spatial.checks`: NaN
or inf, constant features, spots that share a position, the ``spatial`` extra) with errors
that name the user's argument and the fix, fits the Potts mixture
(:func:`~pyro_pdvi.spatial.fit.fit_potts_mixture`), and only then writes the labels to
``adata.obs[key_added]``, the posteriors to ``adata.obsm[key_added + "_probabilities"]`` and
the settings and history to ``adata.uns[key_added]``. :func:`plot_spatial_domains` draws
labels with matplotlib.

Needs pandas, anndata and scipy (``pip install 'pyro-pdvi[spatial]'``).

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from .checks import (
    check_count,
    check_matrix,
    drop_constant_columns,
    duplicate_positions,
    jitter,
    merge_duplicates,
    require_spatial_extra,
)
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
    if not bool(torch.isfinite(values).all()):
        raise ValueError("counts has NaN or inf; drop or impute those spots first")
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


DUPLICATES = ("error", "merge", "jitter")


def fit_spatial_domains(
    adata: Any,
    n_domains: int,
    *,
    use_rep: str | None = None,
    n_pcs: int | None = None,
    spatial_key: str = "spatial",
    key_added: str = "spatial_domain",
    duplicates: str = "error",
    random_state: int = 0,
    device: torch.device | str | None = None,
    **kwargs: Any,
) -> SpatialFit:
    """Spatial domains of an AnnData object by the Potts mixture of [1, App. C.1], with
    scanpy's conventions.

    The fit (:func:`~pyro_pdvi.spatial.fit.fit_potts_mixture`) starts from a Gaussian
    mixture of neighbour-averaged features, estimates the Potts weight from it, and runs
    P2D-VI over spatial patches until the objective settles; it warns, with the fix, if it
    stops before. Nothing is written to ``adata`` unless the fit succeeds; then

    * ``adata.obs[key_added]``: the domains, categorical ``"0", ..., "K-1"``;
    * ``adata.obsm[key_added + "_probabilities"]``: the ``(N, K)`` posteriors;
    * ``adata.uns[key_added]``: ``params`` (the settings), ``potts_weight``, ``converged``,
      ``grad_norm`` and the per-epoch ``history``;
    * ``adata.obsm["X_pca"]`` when features had to be computed (below).

    :param adata: an :class:`anndata.AnnData` with spot coordinates in ``adata.obsm[spatial_key]``.
    :param n_domains: K, the number of domains (an int; numpy integers from ``adata.obs``
        columns too).
    :param use_rep: key of ``adata.obsm`` with the features, or ``"X"``. ``None`` (as in
        scanpy): ``"X_pca"`` if present, else PCA features of ``adata.X`` (raw counts) by
        :func:`expression_features`, stored in ``adata.obsm["X_pca"]``.
    :param n_pcs: the first ``n_pcs`` feature columns; ``None`` (as in scanpy): all of them
        (20 components when they are computed).
    :param spatial_key: key of the ``(N, 2)`` coordinates in ``adata.obsm``.
    :param key_added: where the results go (above).
    :param duplicates: spots that share a position: ``"error"`` (default), ``"merge"`` (the
        spots of a position are fitted as one, with their mean features, and share its label)
        or ``"jitter"`` (each spot moves by a random shift of at most 1% of the spot spacing,
        seeded by ``random_state``).
    :param random_state: seed of the start and of the patch order (scanpy's name).
    :param device: ``"cpu"`` (default) or ``"cuda"``.
    :param kwargs: passed to :func:`~pyro_pdvi.spatial.fit.fit_potts_mixture` (``potts_weight``,
        ``num_neighbors``, ``num_patches``, ``num_epochs``, ``tol``, ``method``, ``truth``, ...).
    :returns: the fit, for every spot of ``adata``.
    :rtype: SpatialFit
    """
    require_spatial_extra("fit_spatial_domains")
    import pandas as pd

    if not (hasattr(adata, "obsm") and hasattr(adata, "obs") and hasattr(adata, "n_obs")):
        raise ValueError(f"adata must be an anndata.AnnData, got a {type(adata).__name__}")
    if "seed" in kwargs:
        raise ValueError("pass the seed as random_state= (scanpy's name), not seed=")
    if duplicates not in DUPLICATES:
        raise ValueError(f"Invalid duplicates: {duplicates!r}; use one of {DUPLICATES}")
    coords = _coordinates(adata, spatial_key)
    positions, group = duplicate_positions(coords)
    if len(positions) == 1:
        raise ValueError(
            f'all {adata.n_obs} spots of adata.obsm["{spatial_key}"] are at one position; spatial '
            "domains need the spots' coordinates (check that the right array is stored there)"
        )
    n_domains = check_count(
        n_domains, "n_domains", 1, len(positions), f"adata has {len(positions)} spots at distinct positions"
    )
    features, where, computed = _features(adata, use_rep, n_pcs)
    features = drop_constant_columns(features, where)
    spot_rows = None  # the fitted row of every spot, when spots share positions and are merged
    if len(positions) < adata.n_obs:
        coords, features, spot_rows = _handle_duplicates(
            coords, features, positions, group, duplicates, spatial_key, random_state
        )
        if spot_rows is not None and kwargs.get("truth") is not None:
            kwargs["truth"] = torch.as_tensor(np.asarray(kwargs["truth"]))[_first_of_each(spot_rows)]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit = fit_potts_mixture(
            torch.from_numpy(features),
            torch.from_numpy(coords),
            n_domains,
            seed=random_state,
            device=device,
            warn=False,
            **kwargs,
        )
    for warning in caught:
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    for message in fit.warnings:
        warnings.warn(f"fit_spatial_domains: {message}", stacklevel=2)
    if spot_rows is not None:
        rows = torch.from_numpy(spot_rows).to(fit.labels.device)
        fit = replace(fit, labels=fit.labels[rows], probabilities=fit.probabilities[rows])

    labels = fit.labels.cpu().numpy()
    if computed is not None:
        adata.obsm["X_pca"] = computed
    adata.obs[key_added] = pd.Categorical(labels.astype(str), categories=[str(k) for k in range(n_domains)])
    adata.obsm[f"{key_added}_probabilities"] = fit.probabilities.cpu().numpy()
    adata.uns[key_added] = {
        "params": {
            "n_domains": n_domains,
            "use_rep": where,
            "n_pcs": features.shape[1],
            "duplicates": duplicates,
            "random_state": random_state,
            **_plain(kwargs),
        },
        "potts_weight": fit.potts_weight,
        "step_sizes": dict(fit.step_sizes),
        "converged": fit.converged,
        "grad_norm": fit.grad_norm,
        "history": {key: np.asarray(value) for key, value in fit.history.items()},
    }
    return fit


def _coordinates(adata: Any, spatial_key: str) -> np.ndarray:
    if spatial_key not in adata.obsm:
        raise ValueError(
            f'adata.obsm has no "{spatial_key}" coordinates (keys: {list(adata.obsm.keys())}); '
            "store the (N, 2) spot coordinates there or pass spatial_key="
        )
    where = f'adata.obsm["{spatial_key}"]'
    coords = check_matrix(
        adata.obsm[spatial_key],
        where,
        "spot coordinates",
        "drop those spots (adata = adata[mask].copy()) or fix their coordinates",
    )
    if coords.shape[1] < 2:
        raise ValueError(f"{where} must have 2 columns (x, y), got {coords.shape[1]}")
    if adata.n_obs < 2:
        raise ValueError(f"adata has {adata.n_obs} spot; spatial domains need at least two")
    return np.ascontiguousarray(coords[:, :2])


def _features(
    adata: Any, use_rep: str | None, n_pcs: int | None
) -> tuple[np.ndarray, str, np.ndarray | None]:
    """The features, how the user refers to them, and the computed PCA (``None`` if read)."""
    if n_pcs is not None:
        n_pcs = check_count(n_pcs, "n_pcs", 1)
    fix = "drop or impute those spots first (e.g. adata = adata[mask].copy())"
    if use_rep is None and "X_pca" in adata.obsm:
        use_rep = "X_pca"
    if use_rep is None:
        counts = adata.X
        _check_finite_counts(counts, fix)
        limit = min(adata.n_obs, adata.n_vars)
        if n_pcs is not None and n_pcs > limit:
            raise ValueError(
                f"Invalid n_pcs: {n_pcs}; adata.X ({adata.n_obs} x {adata.n_vars}) has at most "
                f"{limit} components"
            )
        computed = expression_features(counts, n_pcs or min(20, limit)).numpy()
        return computed, 'adata.obsm["X_pca"] (computed from adata.X)', computed
    if use_rep == "X":
        where, values = "adata.X", adata.X
        values = values.toarray() if hasattr(values, "toarray") else values
    elif use_rep in adata.obsm:
        where, values = f'adata.obsm["{use_rep}"]', adata.obsm[use_rep]
    else:
        raise ValueError(
            f"Invalid use_rep: {use_rep!r}; adata.obsm has {list(adata.obsm.keys())}: pass one of them, "
            '"X", or None to compute PCA features of adata.X'
        )
    features = check_matrix(values, where, "features (spots x components)", fix)
    if n_pcs is not None:
        if n_pcs > features.shape[1]:
            raise ValueError(
                f"Invalid n_pcs: {n_pcs}; {where} has {features.shape[1]} columns: pass n_pcs <= "
                f"{features.shape[1]} (or n_pcs=None for all), or recompute it with more components "
                f"(e.g. sc.pp.pca(adata, n_comps={n_pcs}))"
            )
        features = features[:, :n_pcs]
    return np.ascontiguousarray(features), where, None


def _check_finite_counts(counts: Any, fix: str) -> None:
    """A ``ValueError`` naming ``adata.X`` and its spots with NaN or inf (dense or sparse)."""
    if hasattr(counts, "tocsr"):
        counts = counts.tocsr()
        rows = np.repeat(np.arange(counts.shape[0]), np.diff(counts.indptr))[~np.isfinite(counts.data)]
    else:
        rows = np.flatnonzero(~np.isfinite(np.asarray(counts, dtype=np.float64)).all(1))
    if rows.size:
        rows = np.unique(rows)
        raise ValueError(
            f"adata.X has NaN or inf in {rows.size} of {counts.shape[0]} spots (the first at positions "
            f"{rows[:5].tolist()}); {fix}"
        )


def _handle_duplicates(coords, features, positions, group, duplicates, spatial_key, random_state):
    """Coordinates, features and the spot -> fitted row map (``None``: one row per spot)."""
    where = f'adata.obsm["{spatial_key}"]'
    num_shared = int(coords.shape[0] - len(positions))
    if duplicates == "error":
        counts = np.bincount(group)
        example = positions[np.argmax(counts)]
        raise ValueError(
            f"{where} has {num_shared} spots at positions already taken by another spot (e.g. "
            f"{counts.max()} spots at {example.tolist()}); a section stacked on itself or moved "
            "spots? Fix the coordinates, or pass duplicates='merge' (the spots of a position are "
            "fitted as one, with their mean features) or duplicates='jitter' (each spot moves by "
            "at most 1% of the spot spacing)"
        )
    warnings.warn(
        f"{where}: {num_shared} spots share a position with another spot; duplicates={duplicates!r}",
        stacklevel=3,
    )
    if duplicates == "jitter":
        return jitter(coords, positions, random_state), features, None
    return positions, merge_duplicates(features, group, len(positions)), group


def _first_of_each(group: np.ndarray) -> np.ndarray:
    """For each fitted row, one spot of it (the first)."""
    first = np.full(int(group.max()) + 1, group.size)
    np.minimum.at(first, group, np.arange(group.size))
    return first


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
