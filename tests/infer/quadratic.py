"""The strongly convex quadratic of the paper's App. C.3, as a Pyro guide plus a loss callable.

``F(phi, lambda) = sum_i 1/2 z_i' Q_i z_i + v_i' z_i + r/2 ||lambda||^2`` with
``z_i = [phi_i; a; b]``: local ``phi_i`` (one row per datum), global sites ``a``
and ``b``. ``b``'s curvature is ``scale_b**2`` times ``a``'s, so one step size
for both is a poor fit (P2D-VI's case).
"""

import pyro
import torch


class Quadratic:
    def __init__(self, num_data=24, num_blocks=6, local_dim=2, dim_a=2, dim_b=2, scale_b=10.0, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.N, self.p, self.qa, self.qb = num_data, local_dim, dim_a, dim_b
        dim = local_dim + dim_a + dim_b
        root = torch.randn(num_data, dim, dim, generator=g) / dim**0.5
        q = root @ root.transpose(-1, -2) + 0.5 * torch.eye(dim)
        scaling = torch.cat([torch.ones(local_dim + dim_a), torch.full((dim_b,), scale_b)])
        self.Q = q * scaling[:, None] * scaling[None, :]
        # Non-i.i.d. linear terms: each block's data pull lambda its own way.
        self.v = (
            torch.randn(num_data, dim, generator=g)
            + 3.0 * torch.randn(1, dim, generator=g) * torch.arange(num_data)[:, None] / num_data
        )
        self.reg = 0.1
        self.blocks = list(torch.arange(num_data).chunk(num_blocks))

    def guide(self, idx):
        a = pyro.param("a", torch.zeros(self.qa))
        b = pyro.param("b", torch.zeros(self.qb))
        with pyro.plate("data", self.N, subsample=idx) as ind:
            phi = pyro.param("phi", torch.zeros(self.N, self.p), event_dim=1)
        return phi, a, b, ind

    def model(self, idx):
        pass

    def loss(self, model, guide, idx):
        """Full-data-scaled loss, as a Pyro ELBO scales a subsample."""
        phi, a, b, ind = guide(idx)
        z = torch.cat([phi, a.expand(len(ind), -1), b.expand(len(ind), -1)], -1)
        local = 0.5 * torch.einsum("ni,nij,nj->n", z, self.Q[ind], z) + (self.v[ind] * z).sum(-1)
        return local.sum() * (self.N / len(ind)) + 0.5 * self.reg * (a.square().sum() + b.square().sum())

    def block_gradient(self, block, phi_rows, lam):
        """grad_lambda f_b at (phi_b, lambda): for the dual identity mu_b = -grad f_b."""
        lam = lam.clone().requires_grad_()
        z = torch.cat([phi_rows, lam.expand(len(block), -1)], -1)
        f = 0.5 * torch.einsum("ni,nij,nj->n", z, self.Q[block], z).sum() + (self.v[block] * z).sum()
        f = f + len(block) / self.N * 0.5 * self.reg * lam.square().sum()
        return torch.autograd.grad(f, lam)[0]

    def optimum(self):
        """Exact minimiser by one linear solve: (phi (N, p), lambda (qa + qb,))."""
        N, p = self.N, self.p
        q = self.qa + self.qb
        size = N * p + q
        H = torch.zeros(size, size)
        c = torch.zeros(size)
        for i in range(N):
            rows = list(range(i * p, (i + 1) * p)) + list(range(N * p, size))
            H[[[r] for r in rows], rows] += self.Q[i]
            c[rows] += self.v[i]
        H[N * p :, N * p :] += self.reg * torch.eye(q)
        x = torch.linalg.solve(H, -c)
        return x[: N * p].reshape(N, p), x[N * p :]

    def exact_block_solve(self, block, consensus, dual, step_sizes):
        """argmin of the block's augmented Lagrangian, by a linear solve."""
        p, q = self.p, self.qa + self.qb
        m = len(block)
        size = m * p + q
        H = torch.zeros(size, size)
        c = torch.zeros(size)
        for k, i in enumerate(block.tolist()):
            rows = list(range(k * p, (k + 1) * p)) + list(range(m * p, size))
            H[[[r] for r in rows], rows] += self.Q[i]
            c[rows] += self.v[i]
        H[m * p :, m * p :] += (m / self.N * self.reg) * torch.eye(q) + torch.diag(1 / step_sizes)
        c[m * p :] += dual - consensus / step_sizes
        x = torch.linalg.solve(H, -c)
        return x[: m * p].reshape(m, p), x[m * p :]
