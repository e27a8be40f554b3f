import subprocess
import sys

import pytest
import torch

from pyro_pdvi.infer import hessian_products as module
from pyro_pdvi.infer.hessian_products import hessian_products


def _gradient_graph(point: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A non-quadratic ``f`` with a dense Hessian, and its gradient with its graph kept."""
    point = point.detach().requires_grad_()
    value = (point.sin() * point.cos().sum()).sum() + 0.5 * (point**4).sum()
    (gradient,) = torch.autograd.grad(value, point, create_graph=True)
    return point, gradient


def test_batched_products_equal_the_exact_hessian_columns():
    torch.manual_seed(0)
    at = torch.randn(7, dtype=torch.float64)
    point, gradient = _gradient_graph(at)
    directions = torch.randn(5, 7, dtype=torch.float64)

    def f(x):
        return (x.sin() * x.cos().sum()).sum() + 0.5 * (x**4).sum()

    exact = directions @ torch.autograd.functional.hessian(f, at)
    products = hessian_products(gradient, point, directions)
    assert not products.requires_grad
    assert torch.allclose(products, exact, rtol=1e-12, atol=1e-12)
    # The graph is kept: a second call gives the same products.
    assert torch.equal(hessian_products(gradient, point, directions), products)


def test_the_loop_takes_over_where_the_batched_backward_fails(monkeypatch):
    point, gradient = _gradient_graph(torch.linspace(-1, 1, 6, dtype=torch.float64))
    directions = torch.eye(6, dtype=torch.float64)[:3]
    batched = hessian_products(gradient, point, directions)

    def broken(*args):
        raise AttributeError("torch._vmap_internals has no attribute _vmap")

    monkeypatch.setattr(module, "_batched_backward", broken)
    assert torch.allclose(hessian_products(gradient, point, directions), batched, rtol=1e-14, atol=0.0)


def test_linear_and_unused_coordinates_give_zero_products():
    point = torch.arange(4.0, dtype=torch.float64).requires_grad_()
    (gradient,) = torch.autograd.grad((3.0 * point).sum(), point, create_graph=True)
    products = hessian_products(gradient, point, torch.ones(2, 4, dtype=torch.float64))
    assert torch.equal(products, torch.zeros(2, 4, dtype=torch.float64))
    # Only the first two coordinates enter f: the others' rows and columns are zero.
    point = point.detach().requires_grad_()
    (gradient,) = torch.autograd.grad((point[:2] ** 3).sum(), point, create_graph=True)
    products = hessian_products(gradient, point, torch.eye(4, dtype=torch.float64))
    assert torch.equal(products, torch.diag(torch.tensor([0.0, 6.0, 0.0, 0.0], dtype=torch.float64)))


class _Double(torch.autograd.Function):
    """``2 x``, whose own backward is not implemented."""

    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("derivative of _Double is not implemented")


class _Square(torch.autograd.Function):
    """``x^2``, whose backward goes through :class:`_Double`: no double backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return _Double.apply(x) * grad


def test_a_graph_without_double_backward_raises_as_one_backward_pass_would():
    # PDVI then takes its products from differences of the gradient (upkeep's by_differences).
    point = torch.ones(3, dtype=torch.float64, requires_grad=True)
    (gradient,) = torch.autograd.grad(_Square.apply(point).sum(), point, create_graph=True)
    assert gradient.requires_grad
    with pytest.raises(RuntimeError, match="not implemented"):
        hessian_products(gradient, point, torch.eye(3, dtype=torch.float64))


def test_batched_products_do_not_import_sympy():
    # torch's public is_grads_batched path imports sympy (0.4-0.7 CPU s) on its first call.
    script = (
        "import sys, torch\n"
        "from pyro_pdvi.infer.hessian_products import hessian_products\n"
        "x = torch.randn(5, dtype=torch.float64, requires_grad=True)\n"
        "(g,) = torch.autograd.grad((x.exp() * x).sum(), x, create_graph=True)\n"
        "p = hessian_products(g, x, torch.eye(5, dtype=torch.float64))\n"
        "assert torch.allclose(p, torch.diag((x.exp() * (x + 2)).detach()))\n"
        "print('sympy' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
