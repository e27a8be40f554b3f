"""Small models with exact answers that several test modules share."""

import pyro
import pyro.distributions as dist
import torch
from pyro.infer.autoguide import AutoNormal


class Hierarchical:
    """mu ~ N(0, s0^2); theta_i ~ N(mu, tau^2); x_i ~ N(theta_i, sigma^2); blocks sorted by x."""

    def __init__(self, num_data=100, num_blocks=5, spread=2.0, s0=10.0, tau=1.0, sigma=0.5):
        g = torch.Generator().manual_seed(0)
        self.x = torch.sort(torch.randn(num_data, generator=g) * spread + 1.0).values
        self.N, self.s0, self.tau, self.sigma = num_data, s0, tau, sigma
        self.blocks = list(torch.arange(num_data).chunk(num_blocks))

    def model(self, idx):
        mu = pyro.sample("mu", dist.Normal(0.0, self.s0))
        with pyro.plate("data", self.N, subsample=idx) as ind:
            theta = pyro.sample("theta", dist.Normal(mu, self.tau))
            pyro.sample("x", dist.Normal(theta, self.sigma), obs=self.x[ind])

    def guide(self, idx):
        loc = pyro.param("mu_loc", torch.tensor(0.0))
        scale = pyro.param("mu_scale", torch.tensor(1.0), constraint=dist.constraints.positive)
        mu = pyro.sample("mu", dist.Normal(loc, scale))
        with pyro.plate("data", self.N, subsample=idx):
            theta_loc = pyro.param("theta_loc", torch.zeros(self.N), event_dim=0)
            theta_scale = pyro.param(
                "theta_scale", torch.ones(self.N), constraint=dist.constraints.positive, event_dim=0
            )
            pyro.sample("theta", dist.Normal(theta_loc, theta_scale))
        return mu

    def auto_guide(self):
        return AutoNormal(self.model, create_plates=lambda idx: pyro.plate("data", self.N, subsample=idx))

    def posterior_mean_mu(self):
        """Exact (and mean-field optimal: the target is Gaussian) mean of q(mu)."""
        var = self.tau**2 + self.sigma**2
        return float((self.x.sum() / var) / (1 / self.s0**2 + self.N / var))


class LinearGaussian:
    """y_i = x_i'w + u_i + noise, w ~ N(0, I), u_i ~ N(0, 1): MAP (AutoDelta) is one linear solve."""

    def __init__(self, num_data=24, dim=3, sigma=0.5, block_size=6):
        g = torch.Generator().manual_seed(1)
        self.X = torch.randn(num_data, dim, generator=g)
        drift = 2.0 * torch.linspace(-1, 1, num_data)  # non-i.i.d. blocks along the data order
        self.y = self.X @ torch.tensor([1.0, -2.0, 0.5])[:dim] + 0.3 * torch.randn(num_data, generator=g)
        self.y = self.y + drift
        self.N, self.d, self.sigma = num_data, dim, sigma
        self.blocks = list(torch.arange(num_data).split(block_size))

    def model(self, idx):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([self.d]).to_event(1))
        with pyro.plate("data", self.N, subsample=idx) as ind:
            u = pyro.sample("u", dist.Normal(0.0, 1.0))
            # (X w) written to broadcast over vectorized particles of w.
            pyro.sample("y", dist.Normal((self.X[ind] * w).sum(-1) + u, self.sigma), obs=self.y[ind])

    def create_plates(self, idx):
        return pyro.plate("data", self.N, subsample=idx)

    def exact_map(self):
        A = torch.cat([self.X, torch.eye(self.N)], 1)
        H = A.T @ A / self.sigma**2 + torch.eye(self.d + self.N)
        solution = torch.linalg.solve(H, A.T @ self.y / self.sigma**2)
        return solution[: self.d], solution[self.d :]


def intercepts_and_slopes(num_groups=8, size=6, device="cpu"):
    """y = alpha + a_g + (beta + b_g) x + noise, one block per group (each group's x off centre,
    so its data tie a_g and b_g to both alpha and beta). Returns model, blocks and the exact
    posterior means of (alpha, beta, a, b), the mean-field optimum's too (a Gaussian target). The
    model's data are float64 on ``device``; the blocks' indices and the means on the host."""
    g = torch.Generator().manual_seed(0)

    def randn(k):
        return torch.randn(k, generator=g, dtype=torch.float64)

    group = torch.arange(num_groups).repeat_interleave(size)
    x = 2.0 * randn(num_groups)[group] + randn(len(group))
    y = 1.0 + randn(num_groups)[group] + (0.5 + 0.3 * randn(num_groups)[group]) * x + 0.5 * randn(len(group))

    x_data, y_data, group_data = x.to(device), y.to(device), group.to(device)

    def model(idx=None):
        zero = y_data.new_zeros(())
        alpha = pyro.sample("alpha", dist.Normal(zero, 10.0))
        beta = pyro.sample("beta", dist.Normal(zero, 10.0))
        with pyro.plate("groups", num_groups):
            a = pyro.sample("a", dist.Normal(zero, 1.0))
            b = pyro.sample("b", dist.Normal(zero, 0.5))
        with pyro.plate("data", len(y_data), subsample=idx) as i:
            g = group_data[i]
            mean = alpha + a[..., g] + (beta + b[..., g]) * x_data[i]
            pyro.sample("y", dist.Normal(mean, 0.5), obs=y_data[i])

    one_hot = torch.nn.functional.one_hot(group).to(y)
    design = torch.cat([torch.ones(len(y), 1, dtype=y.dtype), x[:, None], one_hot, one_hot * x[:, None]], 1)
    prior = torch.cat([y.new_full((2,), 0.01), y.new_ones(num_groups), y.new_full((num_groups,), 4.0)])
    mean = torch.linalg.solve(torch.diag(prior) + design.T @ design / 0.25, design.T @ y / 0.25)
    return model, [torch.nonzero(group == k).reshape(-1) for k in range(num_groups)], mean
