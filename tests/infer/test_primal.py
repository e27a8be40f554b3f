import torch

from pyro_pdvi.infer.primal import lbfgs


def test_lbfgs_reaches_the_exact_minimiser_past_rounding():
    """A function-value line search stalls near |grad| ~ sqrt(eps); this one goes on."""
    g = torch.Generator().manual_seed(0)
    root = torch.randn(6, 6, generator=g)
    hessian = root @ root.T + torch.diag(torch.logspace(0, 3, 6))
    linear = torch.randn(6, generator=g)
    x = torch.zeros(6, requires_grad=True)

    def objective():
        return 1e4 + 0.5 * x @ hessian @ x + linear @ x  # a large constant, as an ELBO has

    lbfgs(objective, [x], max_iter=200)
    exact = torch.linalg.solve(hessian, -linear)
    assert torch.allclose(x.detach(), exact, rtol=0, atol=1e-10)


def test_lbfgs_backtracks_from_points_outside_the_support():
    """A trial point where the model raises ValueError (e.g. Pyro's validation) is refused."""
    x = torch.tensor([3.0], requires_grad=True)

    def objective():
        if x.abs().max() > 3.5:
            raise ValueError("outside the support")
        return (x - 3.4).square().sum() * 1e3 + (x - 3.4).pow(4).sum()

    lbfgs(objective, [x], max_iter=50)
    assert torch.allclose(x.detach(), torch.tensor([3.4]), atol=1e-8)
