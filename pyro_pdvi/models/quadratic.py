"""The strongly convex quadratic of the paper's App. C.3, as a Pyro guide and a loss.

``F(phi, lambda) = sum_i 1/2 z_i' Q_i z_i + v_i' z_i + r/2 ||lambda||^2`` with
``z_i = [phi_i; a; b]``: a local ``phi_i`` per datum and the global sites ``a``
and ``b``. The curvature of ``b`` is ``scale_b**2`` times that of ``a``, so one
step size for both fits badly (P2D-VI's case, paper Fig. 2). The optimum is one
linear solve away, which makes this the exact reference for the engine.

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632, App. C.3.
"""

from __future__ import annotations

import pyro
import torch


class Quadratic:
    """A random instance, with non-i.i.d. linear terms along the data order.

    :param num_data: N.
    :param num_blocks: number of contiguous fixed blocks in :attr:`blocks`.
    :param local_dim: size of each ``phi_i``.
    :param dim_a: size of the global site ``a``.
    :param dim_b: size of the global site ``b``.
    :param scale_b: ``b``'s rows and columns of every ``Q_i`` are scaled by this.
    :param seed: seed of the instance.
    """

    def __init__(
        self,
        num_data: int = 24,
        num_blocks: int = 6,
        local_dim: int = 2,
        dim_a: int = 2,
        dim_b: int = 2,
        scale_b: float = 10.0,
        seed: int = 0,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.N, self.p, self.qa, self.qb = num_data, local_dim, dim_a, dim_b
        dim = local_dim + dim_a + dim_b
        root = torch.randn(num_data, dim, dim, generator=g) / dim**0.5
        q = root @ root.transpose(-1, -2) + 0.5 * torch.eye(dim)
        scaling = torch.cat([torch.ones(local_dim + dim_a), torch.full((dim_b,), scale_b)])
        self.Q = q * scaling[:, None] * scaling[None, :]
        drift = 3.0 * torch.randn(1, dim, generator=g) * torch.arange(num_data)[:, None] / num_data
        self.v = torch.randn(num_data, dim, generator=g) + drift
        self.reg = 0.1
        self.blocks = list(torch.arange(num_data).chunk(num_blocks))

    def guide(self, idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Params only: global ``a``, ``b``; local ``phi`` inside the data plate."""
        a = pyro.param("a", torch.zeros(self.qa))
        b = pyro.param("b", torch.zeros(self.qb))
        with pyro.plate("data", self.N, subsample=idx) as ind:
            phi = pyro.param("phi", torch.zeros(self.N, self.p), event_dim=1)
        return phi, a, b, ind

    def model(self, idx: torch.Tensor) -> None:
        """No random variables: the loss is given directly by :meth:`loss`."""

    def loss(self, model, guide, idx: torch.Tensor) -> torch.Tensor:
        """``F`` on the subsample, scaled to the full data as a Pyro ELBO is."""
        phi, a, b, ind = guide(idx)
        z = torch.cat([phi, a.expand(len(ind), -1), b.expand(len(ind), -1)], -1)
        local = 0.5 * torch.einsum("ni,nij,nj->n", z, self.Q[ind], z) + (self.v[ind] * z).sum(-1)
        return local.sum() * (self.N / len(ind)) + 0.5 * self.reg * (a.square().sum() + b.square().sum())

    def block_gradient(self, block: torch.Tensor, phi_rows: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        """``grad_lambda f_b`` at ``(phi_b, lambda)``, ``lambda = [a; b]``."""
        lam = lam.clone().requires_grad_()
        z = torch.cat([phi_rows, lam.expand(len(block), -1)], -1)
        f = 0.5 * torch.einsum("ni,nij,nj->n", z, self.Q[block], z).sum() + (self.v[block] * z).sum()
        f = f + len(block) / self.N * 0.5 * self.reg * lam.square().sum()
        return torch.autograd.grad(f, lam)[0]

    def _solve(self, data: list[int], extra_hessian: torch.Tensor, extra_linear: torch.Tensor):
        """Minimise ``sum_{i in data} (1/2 z_i'Q_i z_i + v_i'z_i) + 1/2 lam'E lam + e'lam``."""
        p, q, m = self.p, self.qa + self.qb, len(data)
        size = m * p + q
        hessian = torch.zeros(size, size)
        linear = torch.zeros(size)
        for k, i in enumerate(data):
            rows = list(range(k * p, (k + 1) * p)) + list(range(m * p, size))
            hessian[[[r] for r in rows], rows] += self.Q[i]
            linear[rows] += self.v[i]
        hessian[m * p :, m * p :] += extra_hessian
        linear[m * p :] += extra_linear
        x = torch.linalg.solve(hessian, -linear)
        return x[: m * p].reshape(m, p), x[m * p :]

    def optimum(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact minimiser of ``F``: ``phi`` ``(N, p)`` and ``lambda`` ``(qa + qb,)``."""
        q = self.qa + self.qb
        return self._solve(list(range(self.N)), self.reg * torch.eye(q), torch.zeros(q))

    def exact_block_solve(
        self, block: torch.Tensor, consensus: torch.Tensor, dual: torch.Tensor, step_sizes: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact argmin of block ``b``'s augmented Lagrangian: ``(phi_b, lambda_b)``."""
        q = self.qa + self.qb
        extra = (len(block) / self.N * self.reg) * torch.eye(q) + torch.diag(1 / step_sizes)
        return self._solve(block.tolist(), extra, dual - consensus / step_sizes)
