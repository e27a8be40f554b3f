import anndata
import matplotlib
import numpy as np
import pytest
import torch

from pyro_pdvi.metrics import adjusted_rand_index
from pyro_pdvi.spatial.api import expression_features, fit_spatial_domains, plot_spatial_domains
from pyro_pdvi.spatial.fit import fit_potts_mixture
from pyro_pdvi.spatial.synthetic import make_potts_data

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def tissue():
    return make_potts_data(1500, 4, 5, separation=0.6, seed=1)


def make_adata(tissue):
    adata = anndata.AnnData(X=np.zeros((1500, 3), dtype=np.float32))
    adata.obsm["spatial"] = tissue.coords.numpy()
    adata.obsm["X_pca"] = tissue.data.numpy()
    return adata


def test_fit_spatial_domains_writes_adata_and_beats_plain_mixture(tissue):
    adata = make_adata(tissue)
    fit = fit_spatial_domains(adata, 4, n_pcs=5, num_patches=4, num_epochs=6, truth=tissue.labels)
    labels = adata.obs["spatial_domain"]
    assert list(labels.cat.categories) == ["0", "1", "2", "3"]
    probabilities = adata.obsm["spatial_domain_probabilities"]
    assert probabilities.shape == (1500, 4)
    assert np.allclose(probabilities.sum(1), 1.0, atol=1e-12)
    assert np.array_equal(labels.astype(int).to_numpy(), probabilities.argmax(1))
    history = adata.uns["spatial_domain"]["history"]
    assert history["objective"][-1] < history["objective"][0]
    assert fit.step_sizes["rho"] > fit.step_sizes["m"]  # P2D-VI: one step per site

    plain = fit_potts_mixture(tissue.data, tissue.coords, 4, potts_weight=0.0, num_patches=4, num_epochs=6)
    potts_ari = adjusted_rand_index(tissue.labels, fit.labels)
    plain_ari = adjusted_rand_index(tissue.labels, plain.labels)
    assert potts_ari > plain_ari + 0.1
    assert history["ari"][-1] == pytest.approx(potts_ari)

    axes = plot_spatial_domains(adata, ["spatial_domain"])
    assert len(axes) == 1 and axes[0].get_title() == "spatial_domain"


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


def test_fit_spatial_domains_computes_features_when_absent(tissue):
    rng = np.random.default_rng(1)
    adata = anndata.AnnData(X=rng.poisson(3.0, size=(1500, 12)).astype(np.float32))
    adata.obsm["spatial"] = tissue.coords.numpy()
    fit_spatial_domains(adata, 3, n_pcs=4, num_patches=4, num_epochs=1, record=False)
    assert adata.obsm["X_pca"].shape == (1500, 4)
    assert "spatial_domain" in adata.obs


def test_annealing_schedule_ends_at_the_exact_objective(tissue):
    kwargs = dict(num_patches=4, num_epochs=4)
    annealed = fit_potts_mixture(tissue.data, tissue.coords, 4, anneal=(3.0, 2), **kwargs)
    assert annealed.history["temperature"] == [3.0, 2.0, 1.0, 1.0]
    assert annealed.history["objective"][4] < annealed.history["objective"][0]


def test_errors(tissue):
    adata = make_adata(tissue)
    del adata.obsm["spatial"]
    with pytest.raises(ValueError, match='no "spatial" coordinates'):
        fit_spatial_domains(adata, 3)
    with pytest.raises(ValueError, match="method"):
        fit_potts_mixture(tissue.data, tissue.coords, 3, method="adam")
    with pytest.raises(ValueError, match="anneal"):
        fit_potts_mixture(tissue.data, tissue.coords, 3, anneal=(0.5, 2))
    with pytest.raises(ValueError, match="same N"):
        fit_potts_mixture(tissue.data[:10], tissue.coords, 3)
    with pytest.raises(ValueError, match='no column "domains"'):
        plot_spatial_domains(make_adata(tissue), "domains")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_fit_on_cuda_matches_cpu(tissue):
    kwargs = dict(num_patches=4, num_epochs=3, record=False)
    cpu = fit_potts_mixture(tissue.data, tissue.coords, 4, **kwargs)
    gpu = fit_potts_mixture(tissue.data, tissue.coords, 4, device="cuda", **kwargs)
    assert gpu.m.device.type == "cuda"
    assert torch.allclose(gpu.m.cpu(), cpu.m, atol=1e-8)
