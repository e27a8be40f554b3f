import pytest
import torch
from torch.distributions import constraints

from pyro_pdvi.infer.preconditioner import coordinate_groups, estimate_curvatures, resolve_groups
from pyro_pdvi.infer.sites import GlobalLayout, GlobalSite

NAMES = ["AutoNormal.locs.w", "AutoNormal.scales.w", "bias"]


def test_groups_by_names_regex_and_callable_rest_in_default():
    groups = resolve_groups(
        [
            {"sites": r"AutoNormal\.locs\..*", "name": "locs"},
            {"sites": lambda name: name.endswith("scales.w"), "eta": 1e-3},
        ],
        NAMES,
        "auto",
    )
    assert [(g.name, g.sites, g.eta) for g in groups] == [
        ("locs", ["AutoNormal.locs.w"], "auto"),
        ("group1", ["AutoNormal.scales.w"], 1e-3),
        ("default", ["bias"], "auto"),
    ]
    assert [g.sites for g in resolve_groups("per_site", NAMES, 0.1)] == [[n] for n in NAMES]
    assert [g.sites for g in resolve_groups(None, NAMES, 0.1)] == [NAMES]


@pytest.mark.parametrize("eta", [0.0, float("inf"), True, "1e-3"])
def test_invalid_step_sizes(eta):
    with pytest.raises(ValueError, match="Invalid step size"):
        resolve_groups([{"sites": ["bias"], "eta": eta}], NAMES, 0.1)


def test_power_iteration_finds_each_groups_largest_curvature():
    sites = [
        GlobalSite("a", torch.Size([3]), constraints.real),
        GlobalSite("b", torch.Size([2]), constraints.real),
    ]
    layout = GlobalLayout(sites)
    groups = resolve_groups("per_site", layout.names, "auto")
    group_of = coordinate_groups(groups, layout)
    root = torch.randn(5, 5, generator=torch.Generator().manual_seed(0))
    hessian = root @ root.T + torch.diag(torch.tensor([1.0, 2.0, 3.0, 100.0, 300.0]))

    def gradient(point):
        return hessian @ point + 1.0

    curvatures = estimate_curvatures(gradient, torch.randn(5), group_of, 2, num_iterations=50)
    expected = [torch.linalg.eigvalsh(hessian[:3, :3]).max(), torch.linalg.eigvalsh(hessian[3:, 3:]).max()]
    assert torch.allclose(curvatures, torch.stack(expected), rtol=1e-6)
