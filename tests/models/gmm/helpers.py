"""Small mixtures and checks that the GMM test modules share."""

import torch
from pyro.infer import TraceEnum_ELBO

from pyro_pdvi.models.gmm import make_biased_gmm


def small_problem(num_data=60, num_components=3, dim=2, block_size=20, seed=1):
    data = make_biased_gmm(num_data, num_components, dim, block_size, 0.9, seed=seed, separation=3.0)
    generator = torch.Generator().manual_seed(seed)
    m = 2.0 * torch.randn(num_components, dim, generator=generator)
    rho = -2.0 + 0.3 * torch.randn(num_components, dim, generator=generator)
    alpha = torch.randn(num_data, num_components, generator=generator)
    return data, m, rho, alpha


def monte_carlo_loss(gmm, *args, batches=10, particles=1000):
    """Mean and standard error of TraceEnum_ELBO's loss over batches of vectorized particles."""
    elbo = TraceEnum_ELBO(max_plate_nesting=1, num_particles=particles, vectorize_particles=True)
    values = torch.tensor([elbo.loss(gmm.model, gmm.guide, *args) for _ in range(batches)])
    return values.mean(), values.std() / batches**0.5


def gradient_norm(fn, *tensors):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    grads = torch.autograd.grad(fn(*leaves), leaves)
    return torch.cat([g.reshape(-1) for g in grads]).norm()
