"""fit_spatial_domains with scanpy's conventions, and every kind of bad input refused (or
handled, with a warning) before anything is written to ``adata``."""

import importlib.util

import anndata
import matplotlib
import numpy as np
import pytest
import torch

from pyro_pdvi.metrics import adjusted_rand_index
from pyro_pdvi.spatial import api
from pyro_pdvi.spatial.api import expression_features, fit_spatial_domains, plot_spatial_domains
from pyro_pdvi.spatial.synthetic import make_potts_data

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def tissue():
    return make_potts_data(1000, 4, 8, separation=0.8, seed=1)


def make_adata(tissue, features=None, counts=None):
    adata = anndata.AnnData(X=np.zeros((1000, 3), dtype=np.float32) if counts is None else counts)
    adata.obsm["spatial"] = tissue.coords.numpy().copy()
    if features is not False:
        adata.obsm["X_pca"] = (tissue.data.numpy() if features is None else features).copy()
    return adata


def contents(adata):
    return set(adata.obs.columns), set(adata.obsm.keys()), set(adata.uns.keys())


def test_writes_results_with_scanpy_conventions(tissue):
    adata = make_adata(tissue)
    fit = fit_spatial_domains(adata, np.int64(4), key_added="domains", random_state=3, truth=tissue.labels)
    labels = adata.obs["domains"]
    assert list(labels.cat.categories) == ["0", "1", "2", "3"]
    probabilities = adata.obsm["domains_probabilities"]
    assert probabilities.shape == (1000, 4) and np.allclose(probabilities.sum(1), 1.0, atol=1e-12)
    assert np.array_equal(labels.astype(int).to_numpy(), probabilities.argmax(1))
    uns = adata.uns["domains"]
    assert uns["params"]["n_domains"] == 4 and uns["params"]["random_state"] == 3
    assert uns["params"]["use_rep"] == 'adata.obsm["X_pca"]' and uns["params"]["n_pcs"] == 8
    assert uns["converged"] is True and uns["grad_norm"] == fit.grad_norm
    assert uns["potts_weight"] == fit.potts_weight > 0
    assert uns["history"]["objective"][-1] < uns["history"]["objective"][0]
    assert adjusted_rand_index(tissue.labels, fit.labels) > 0.9
    axes = plot_spatial_domains(adata, ["domains"])
    assert len(axes) == 1 and axes[0].get_title() == "domains"


def test_uses_all_of_x_pca_unless_n_pcs_is_given(tissue):
    adata = make_adata(tissue)
    fit = fit_spatial_domains(adata, 4)
    assert fit.m.shape == (4, 8)
    fit = fit_spatial_domains(adata, 4, n_pcs=5)
    assert fit.m.shape == (4, 5) and adata.uns["spatial_domain"]["params"]["n_pcs"] == 5
    with pytest.raises(
        ValueError, match=r'Invalid n_pcs: 20; adata.obsm\["X_pca"\] has 8 columns: pass n_pcs <= 8'
    ):
        fit_spatial_domains(adata, 4, n_pcs=20)


def test_use_rep_choices(tissue):
    adata = make_adata(tissue)
    adata.obsm["X_banksy"] = adata.obsm["X_pca"][:, :3]
    assert fit_spatial_domains(adata, 4, use_rep="X_banksy").m.shape == (4, 3)
    adata = make_adata(tissue, counts=tissue.data.numpy()[:, :6].copy())
    assert fit_spatial_domains(adata, 4, use_rep="X").m.shape == (4, 6)
    with pytest.raises(ValueError, match=r"Invalid use_rep: 'X_umap'; adata.obsm has \['spatial', 'X_pca'"):
        fit_spatial_domains(adata, 4, use_rep="X_umap")


def test_computes_pca_of_counts_when_absent(tissue):
    rng = np.random.default_rng(1)
    means = np.exp(rng.normal(0.0, 1.0, size=(4, 30)))[tissue.labels.numpy()]
    adata = make_adata(tissue, features=False, counts=rng.poisson(means).astype(np.float32))
    fit = fit_spatial_domains(adata, 4, n_pcs=6)
    assert adata.obsm["X_pca"].shape == (1000, 6) and fit.m.shape == (4, 6)
    assert adata.uns["spatial_domain"]["params"]["use_rep"].startswith('adata.obsm["X_pca"] (computed')


def test_expression_features_are_pca_of_the_paper_preprocessing():
    rng = np.random.default_rng(0)
    counts = rng.poisson(rng.gamma(2.0, 2.0, size=(200, 30))).astype(np.float64)
    scores = expression_features(counts, num_components=3).numpy()
    library = counts.sum(1, keepdims=True)
    values = np.log1p(counts * np.median(library) / library)
    values = values - values.mean(0)
    values = np.clip(values / values.std(0, ddof=1), -10, 10)
    values = values - values.mean(0)
    u, s, _ = np.linalg.svd(values, full_matrices=False)
    reference = u[:, :3] * s[:3]
    signs = np.sign((scores * reference).sum(0))
    assert np.allclose(scores * signs, reference, atol=1e-8)
    counts[3, 4] = np.inf
    with pytest.raises(ValueError, match="counts has NaN or inf"):
        expression_features(counts, num_components=3)


def with_nan(values, rows):
    values = values.copy()
    values[rows, 0] = np.nan
    return values


BAD_INPUTS = {
    "nan in X_pca": (
        lambda t: make_adata(t, features=with_nan(t.data.numpy(), [3, 7])),
        {},
        r'adata.obsm\["X_pca"\] has NaN or inf in 2 of 1000 spots \(the first at positions \[3, 7\]\); drop',
    ),
    "inf in X_pca": (
        lambda t: make_adata(t, features=np.where(np.arange(8) == 2, np.inf, t.data.numpy())),
        {},
        r'adata.obsm\["X_pca"\] has NaN or inf in 1000 of 1000 spots',
    ),
    "nan in X": (
        lambda t: make_adata(t, features=False, counts=with_nan(np.ones((1000, 5), np.float32), [9])),
        {},
        r"adata.X has NaN or inf in 1 of 1000 spots \(the first at positions \[9\]\)",
    ),
    "nan in coordinates": (
        lambda t: (lambda a: (a.obsm["spatial"].__setitem__((4, 1), np.nan), a)[1])(make_adata(t)),
        {},
        r'adata.obsm\["spatial"\] has NaN or inf in 1 of 1000 spots \(the first at positions \[4\]\)',
    ),
    "no coordinates": (
        lambda t: (lambda a: (a.obsm.pop("spatial"), a)[1])(make_adata(t)),
        {},
        'adata.obsm has no "spatial" coordinates',
    ),
    "all-zero features": (
        lambda t: make_adata(t, features=np.zeros((1000, 8))),
        {},
        r'adata.obsm\["X_pca"\] is the same for every spot \(all 8 columns constant\)',
    ),
    "all-zero counts": (
        lambda t: make_adata(t, features=False, counts=np.zeros((1000, 5), np.float32)),
        {},
        r'adata.obsm\["X_pca"\] \(computed from adata.X\) is the same for every spot',
    ),
    "section stacked on itself": (
        lambda t: (lambda a: (a.obsm.__setitem__("spatial", np.tile(a.obsm["spatial"][:500], (2, 1))), a)[1])(
            make_adata(t)
        ),
        {},
        r"500 spots at positions already taken.*duplicates='merge'.*duplicates='jitter'",
    ),
    "all spots at one point": (
        lambda t: (lambda a: (a.obsm.__setitem__("spatial", np.ones((1000, 2))), a)[1])(make_adata(t)),
        {"duplicates": "merge"},
        r'all 1000 spots of adata.obsm\["spatial"\] are at one position',
    ),
    "bool n_domains": (make_adata, {"n_domains": True}, "Invalid n_domains: True"),
    "float n_domains": (make_adata, {"n_domains": 4.0}, "Invalid n_domains: 4.0"),
    "too many domains": (
        make_adata,
        {"n_domains": 1001},
        r"Invalid n_domains: 1001; use an int in \[1, 1000\] \(adata has 1000 spots at distinct positions\)",
    ),
    "seed instead of random_state": (make_adata, {"seed": 1}, r"random_state= \(scanpy's name\)"),
    "unknown duplicates": (make_adata, {"duplicates": "drop"}, "Invalid duplicates: 'drop'"),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_input_is_refused_and_nothing_is_written(tissue, case):
    build, kwargs, message = BAD_INPUTS[case]
    adata = build(tissue)
    before = contents(adata)
    kwargs = {"n_domains": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        fit_spatial_domains(adata, **kwargs)
    assert contents(adata) == before


def test_a_failure_inside_the_fit_writes_nothing(tissue, monkeypatch):
    adata = make_adata(tissue, features=False, counts=np.random.default_rng(0).poisson(3.0, (1000, 20)))

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(api, "fit_potts_mixture", fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        fit_spatial_domains(adata, 4)
    assert contents(adata) == (set(), {"spatial"}, set())


def test_without_the_spatial_extra_the_error_names_it(tissue, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pandas" else real(name, *a)
    )
    with pytest.raises(
        ImportError, match=r"needs pandas, which is not installed: pip install 'pyro-pdvi\[spatial\]'"
    ):
        fit_spatial_domains(make_adata(tissue), 4)


def test_constant_columns_are_left_out_with_a_warning(tissue):
    features = tissue.data.numpy().copy()
    features[:, 2] = 5.0
    adata = make_adata(tissue, features=features)
    with pytest.warns(UserWarning, match=r"columns \[2\] are constant across spots and were left out"):
        fit = fit_spatial_domains(adata, 4)
    assert fit.m.shape == (4, 7)


def test_duplicate_positions_merged_or_jittered_on_request(tissue):
    adata = make_adata(tissue)
    adata.obsm["spatial"][500:] = adata.obsm["spatial"][:500]  # the first half stacked on itself
    adata.obsm["X_pca"][500:] = adata.obsm["X_pca"][:500]
    with pytest.warns(UserWarning, match="500 spots share a position with another spot; duplicates='merge'"):
        merged = fit_spatial_domains(adata, 4, duplicates="merge")
    assert merged.labels.shape == (1000,) and torch.equal(merged.labels[500:], merged.labels[:500])
    assert merged.graph.num_rows == 500
    assert np.array_equal(adata.obs["spatial_domain"].astype(int).to_numpy(), merged.labels.numpy())
    with pytest.warns(UserWarning, match="duplicates='jitter'"):
        jittered = fit_spatial_domains(adata, 4, duplicates="jitter", key_added="jittered")
    assert jittered.graph.num_rows == 1000
    # each spot and its twin are now each other's nearest neighbour, with the same features
    assert float((jittered.labels[500:] == jittered.labels[:500]).double().mean()) > 0.99
