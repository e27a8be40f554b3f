"""Per-coordinate step sizes: the closed-form curvature they come from, the count bound, and
the PDVI that takes them."""

import pyro
import pytest
import torch

from pyro_pdvi import PDVI
from pyro_pdvi.models.gmm import prior_from_data
from pyro_pdvi.models.potts import PottsBlockSolver, PottsGMMModel, potts_block_negative_elbo
from pyro_pdvi.spatial import grid_patches, knn_graph
from pyro_pdvi.spatial.steps import COUNT_MARGIN, coordinate_step_sizes


@pytest.fixture
def problem():
    generator = torch.Generator().manual_seed(0)
    coords = torch.rand(240, 2, generator=generator, dtype=torch.float64)
    labels = (coords[:, 0] > 0.3).long() + (coords[:, 1] > 0.7).long()
    data = torch.randn(3, 2, generator=generator, dtype=torch.float64)[labels]
    data = data + 0.5 * torch.randn(240, 2, generator=generator, dtype=torch.float64)
    prior = prior_from_data(data, 3, labels)
    patches = grid_patches(coords, 4)
    return data, coords, labels, prior, patches


def test_curvature_of_a_patch_objective_is_the_closed_form(problem):
    data, _, labels, prior, patches = problem
    patch = patches[1]
    phi = torch.nn.functional.one_hot(labels[patch], 3).double()
    alpha = (phi * 30.0).log_softmax(-1)  # phi one-hot up to 1e-13
    m = torch.zeros(3, 2, dtype=torch.float64, requires_grad=True)
    rho = torch.full((3, 2), -1.0, dtype=torch.float64, requires_grad=True)
    graph = knn_graph(torch.rand(len(patch), 2), 3, dtype=torch.float64)
    weight = len(patch) / 240

    def f(m_, rho_):
        return potts_block_negative_elbo(data[patch], prior, graph, m_, rho_, alpha, 240)

    hess_m, _ = torch.autograd.functional.hessian(f, (m, rho))[0]
    _, hess_rho = torch.autograd.functional.hessian(f, (m, rho))[1]
    counts = phi.sum(0)[:, None]
    expected = counts / prior.sigma0_sq + weight / prior.sigma1_sq
    assert torch.allclose(torch.einsum("ijij->ij", hess_m), expected, rtol=1e-10)
    expected_rho = 0.5 * expected * rho.detach().exp()
    assert torch.allclose(torch.einsum("ijij->ij", hess_rho), expected_rho, rtol=1e-10)


def test_step_sizes_take_the_largest_bounded_curvature_over_patches(problem):
    _, _, labels, prior, patches = problem
    rho = torch.full((3, 2), -1.0, dtype=torch.float64)
    steps = coordinate_step_sizes(prior, patches, labels, rho, eta_scale=0.5)
    worst = torch.zeros(3, 2, dtype=torch.float64)
    for patch in patches:
        for k in range(3):
            count = min(COUNT_MARGIN * int((labels[patch] == k).sum()) + 1, len(patch))
            worst[k] = torch.maximum(worst[k], count / prior.sigma0_sq + len(patch) / 240 / prior.sigma1_sq)
    assert torch.allclose(steps["m"], 0.5 / worst, rtol=1e-14)
    assert torch.allclose(steps["rho"], 0.5 / (0.5 * worst * rho.exp()), rtol=1e-14)


def test_pdvi_takes_the_step_sizes_per_coordinate_from_its_groups(problem):
    data, coords, labels, prior, patches = problem
    graph = knn_graph(coords, 5, dtype=torch.float64).restrict(patches)
    pyro.clear_param_store()
    model = PottsGMMModel(data, prior, graph)
    steps = coordinate_step_sizes(prior, patches, labels, torch.full((3, 2), -1.0, dtype=torch.float64))
    pdvi = PDVI(
        model.model,
        model.guide,
        pyro.optim.Adam({"lr": 0.1}),
        model.loss,
        blocks=patches,
        solver=PottsBlockSolver(data, prior, graph),
        groups=[{"sites": [site], "eta": eta, "name": site} for site, eta in steps.items()],
    )
    pdvi.step(patches[0])
    assert torch.equal(pdvi.state.step_sizes, pdvi.layout.flatten(steps))
    assert pdvi.step_sizes == {k: pytest.approx(float(v.log().mean().exp())) for k, v in steps.items()}
