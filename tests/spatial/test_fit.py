"""fit_potts_mixture: better domains than the neighbour-averaged mixture, a monotone objective
that converges by default at 600 and 150,000 spots, warnings with fixes, and its errors."""

import warnings

import numpy as np
import pytest
import torch

from pyro_pdvi.metrics import adjusted_rand_index
from pyro_pdvi.models.gmm import kmeans
from pyro_pdvi.models.potts import potts_negative_elbo
from pyro_pdvi.spatial import (
    fit_potts_mixture,
    make_irregular_data,
    make_potts_data,
    neighbour_averaged_mixture,
)


def rises(history):
    objective = history["objective"]
    return [e for e, (a, b) in enumerate(zip(objective, objective[1:]), 1) if b - a > 1e-10 * abs(a)]


@pytest.fixture(scope="module")
def tissue():
    return make_potts_data(1500, 4, 5, separation=0.6, seed=1)


@pytest.mark.parametrize("kind", ["potts", "voronoi"])
def test_default_fit_beats_the_neighbour_averaged_mixture_on_small_sections(kind):
    """Five sections of 600 spots, K = 10, d = 15, centres 0.5 apart (noise sd 1)."""
    for seed in range(5):
        if kind == "potts":
            section = make_potts_data(600, 10, 15, separation=0.5, seed=seed)
        else:
            section = make_irregular_data(600, 10, 15, kind=kind, separation=0.5, seed=seed)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # converged, monotone: no warning
            fit = fit_potts_mixture(section.data, section.coords, 10, seed=seed)
        baseline = neighbour_averaged_mixture(section.data, section.coords, 10, seed=seed)
        assert adjusted_rand_index(section.labels, fit.labels) > adjusted_rand_index(section.labels, baseline)
        assert fit.converged and rises(fit.history) == [] and len(fit.patches) == 1


def test_default_fit_beats_the_neighbour_averaged_mixture_on_layers_of_15k_spots():
    section = make_irregular_data(15000, 12, 20, kind="layers", separation=0.5, seed=0)
    fit = fit_potts_mixture(section.data, section.coords, 12)
    baseline = neighbour_averaged_mixture(section.data, section.coords, 12)
    assert (
        adjusted_rand_index(section.labels, fit.labels) > adjusted_rand_index(section.labels, baseline) + 0.05
    )
    assert fit.converged and rises(fit.history) == [] and len(fit.patches) == 2


def test_monotone_and_converged_on_150k_spots():
    section = make_potts_data(150000, 12, 20, separation=0.5, seed=0)
    fit = fit_potts_mixture(section.data, section.coords, 12, num_epochs=30)
    assert fit.converged and rises(fit.history) == [] and len(fit.patches) == 15
    assert adjusted_rand_index(section.labels, fit.labels) > 0.95
    assert set(fit.timings) == {"graph", "start", "setup", "epochs", "monitor", "total"}
    assert sum(v for k, v in fit.timings.items() if k != "total") == pytest.approx(fit.timings["total"])


def test_small_patches_stay_monotone_and_a_rise_warns_with_a_fix_that_works():
    """The issue's section, 25 patches of 24 spots: monotone from the default start; from
    k-means of the raw features the objective rises, the warning says so, its fix works."""
    section = make_potts_data(600, 10, 15, separation=0.5)
    options = dict(num_patches=25, potts_weight=0.0, num_epochs=40)
    assert rises(fit_potts_mixture(section.data, section.coords, 10, **options).history) == []
    _, labels = kmeans(section.data, 10)
    with pytest.warns(UserWarning) as caught:
        fit_potts_mixture(section.data, section.coords, 10, init_labels=labels, **options)
    messages = [str(w.message) for w in caught]
    assert any(
        "objective rose in epochs" in m and "pass eta_scale= below 1 (e.g. half)" in m for m in messages
    )
    options["num_epochs"] = 80
    fixed = fit_potts_mixture(section.data, section.coords, 10, init_labels=labels, eta_scale=0.5, **options)
    assert rises(fixed.history) == [] and fixed.converged


def test_unconverged_fit_warns_with_the_fix(tissue):
    with pytest.warns(
        UserWarning, match=r"stopped after 1 epochs before converging.*pass num_epochs= above 1"
    ):
        fit = fit_potts_mixture(tissue.data, tissue.coords, 4, num_epochs=1)
    assert not fit.converged and fit.warnings and np.isfinite(fit.grad_norm)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = fit_potts_mixture(tissue.data, tissue.coords, 4, num_epochs=1, warn=False)
    assert quiet.warnings == fit.warnings


def test_result_holds_the_final_gradient_norm_and_the_estimated_weight(tissue):
    fit = fit_potts_mixture(tissue.data, tissue.coords, 4, truth=tissue.labels)
    params = [fit.m.clone().requires_grad_(), fit.rho.clone().requires_grad_()]
    alpha = fit.probabilities.log()
    objective = potts_negative_elbo(tissue.data, fit.prior, fit.graph, *params, alpha)
    gradient = torch.cat([g.flatten() for g in torch.autograd.grad(objective, params)])
    assert fit.grad_norm == pytest.approx(float(gradient.norm()), rel=1e-8)
    assert fit.history["objective"][-1] == pytest.approx(float(objective.detach()), rel=1e-12)
    assert fit.history["ari"][-1] == pytest.approx(adjusted_rand_index(tissue.labels, fit.labels))
    assert 0 < fit.potts_weight < 5 and torch.allclose(
        fit.graph.weights, torch.tensor(fit.potts_weight).double()
    )
    assert fit.step_sizes["rho"] > fit.step_sizes["m"] > 0


def test_pdvi_and_svi_methods_and_plain_mixture(tissue):
    common = dict(num_patches=4, num_epochs=5, tol=0.0)
    p2dvi = fit_potts_mixture(tissue.data, tissue.coords, 4, **common)
    pdvi = fit_potts_mixture(tissue.data, tissue.coords, 4, method="pdvi", **common)
    assert pdvi.step_sizes["m"] == pytest.approx(pdvi.step_sizes["rho"])
    assert p2dvi.history["objective"][-1] <= pdvi.history["objective"][-1]
    svi = fit_potts_mixture(tissue.data, tissue.coords, 4, method="svi", **common)
    assert svi.step_sizes == {} and len(svi.history["objective"]) == 6
    plain = fit_potts_mixture(tissue.data, tissue.coords, 4, potts_weight=0.0, **common)
    assert plain.potts_weight == 0.0
    assert (
        adjusted_rand_index(tissue.labels, p2dvi.labels)
        > adjusted_rand_index(tissue.labels, plain.labels) + 0.1
    )


def test_annealing_schedule_ends_at_the_exact_objective(tissue):
    annealed = fit_potts_mixture(tissue.data, tissue.coords, 4, anneal=(3.0, 2), num_epochs=4, tol=0.0)
    assert annealed.history["temperature"] == [3.0, 2.0, 1.0, 1.0]
    assert annealed.history["objective"][4] < annealed.history["objective"][0]


def test_numpy_integers_are_accepted(tissue):
    fit = fit_potts_mixture(tissue.data, tissue.coords, np.int64(4), num_patches=np.int32(2), warn=False)
    assert fit.probabilities.shape == (1500, 4) and len(fit.patches) == 2


def test_errors(tissue):
    data, coords = tissue.data, tissue.coords
    for kwargs, message in [
        (dict(method="adam"), "method"),
        (dict(anneal=(0.5, 2)), "anneal"),
        (dict(potts_weight=-1.0), "Invalid potts_weight"),
        (dict(num_patches=0), r"Invalid num_patches: 0; use an int in \[1, 1500\]"),
        (dict(num_epochs=2.5), "Invalid num_epochs"),
        (dict(num_neighbors=1500), "Invalid num_neighbors"),
        (dict(tol=-1e-3), "Invalid tol"),
    ]:
        with pytest.raises(ValueError, match=message):
            fit_potts_mixture(data, coords, 3, **kwargs)
    for bad in (True, 3.0, 0, 1501):
        with pytest.raises(ValueError, match="Invalid num_domains"):
            fit_potts_mixture(data, coords, bad)
    with pytest.raises(ValueError, match="same N"):
        fit_potts_mixture(data[:10], coords, 3)
    broken = data.clone()
    broken[[4, 9], 1] = float("nan")
    with pytest.raises(
        ValueError, match=r"features has NaN or inf in 2 of 1500 spots \(the first at \[4, 9\]\)"
    ):
        fit_potts_mixture(broken, coords, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_fit_on_cuda_matches_cpu(tissue):
    kwargs = dict(num_patches=4, num_epochs=3, tol=0.0)
    cpu = fit_potts_mixture(tissue.data, tissue.coords, 4, **kwargs)
    gpu = fit_potts_mixture(tissue.data, tissue.coords, 4, device="cuda", **kwargs)
    assert gpu.m.device.type == "cuda"
    assert torch.allclose(gpu.m.cpu(), cpu.m, atol=1e-8)
