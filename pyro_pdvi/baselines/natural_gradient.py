"""Natural-gradient stochastic variational inference [1] for the Bayesian mixture of
:mod:`pyro_pdvi.models.gmm`, the "SVI" baseline of [2, Sec. 5].

The mixture is conditionally conjugate: given the responsibilities ``phi``, the optimal
``q(c_kj)`` is Gaussian with natural parameters that are *linear* in the sufficient
statistics of the data. Store them as

    precision_kj = 1 / sigma1_j^2 + sum_i phi_ik / sigma0_j^2
    shift_kj     = precision_kj (m_kj - xi_j) = sum_i phi_ik (x_ij - xi_j) / sigma0_j^2

(``shift`` is ``precision * m - precision * xi``, an invertible linear map of the usual
natural parameters ``(precision, precision * m)``, so convex combinations in either
coordinate system agree; centring about ``xi`` keeps the arithmetic that of
:func:`~pyro_pdvi.models.gmm.cavi`). One step of [1, Alg. 1] on a mini-batch ``b``:

1. local step: ``phi_i = softmax_k E_q[log p(x_i | c_k)]`` for ``i in b``, exact given
   ``q(c)`` (the weights are equal, so they cancel);
2. intermediate global parameters as if ``b`` were replicated ``N / |b|`` times::

       precision_hat = 1 / sigma1^2 + (N / |b|) sum_{i in b} phi_ik / sigma0^2
       shift_hat     = (N / |b|) sum_{i in b} phi_ik (x_i - xi) / sigma0^2

3. global step ``lambda <- (1 - rho_t) lambda + rho_t lambda_hat`` on both, which is a
   natural-gradient step of size ``rho_t`` on the ELBO [1, Eq. 25], with
   ``rho_t = (t + tau)^(-kappa)`` (Robbins-Monro, ``kappa in (0.5, 1]``) or a constant.

With one block holding all the data and ``rho_t = 1`` a step is one CAVI sweep; with a
constant step on the full batch the fixed points are CAVI's. The class exposes
``(m, rho)`` with ``rho`` the log-variance, as in :mod:`~pyro_pdvi.models.gmm` (Hoffman's
step size is called ``step_size`` here to keep the two apart).

[1] Hoffman, Blei, Wang, Paisley (2013), "Stochastic Variational Inference", JMLR 14,
    1303-1347, Sec. 2.4 and Alg. 1.
[2] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
"""

from __future__ import annotations

import torch

from ..models.gmm import GMMPrior, block_negative_elbo, optimal_logits


class GMMNaturalGradientSVI:
    """Hoffman et al.'s natural-gradient SVI [1, Alg. 1] for :class:`~pyro_pdvi.models.gmm.GMMModel`'s
    mean-field family, on mini-batches given by index tensors (e.g. fixed blocks).

    Example::

        svi = GMMNaturalGradientSVI(data, prior, m=init_m, rho=init_rho, kappa=0.7, tau=1.0)
        for epoch in range(10):
            for b in torch.randperm(len(blocks)).tolist():
                svi.step(blocks[b])
        svi.m, svi.rho

    :param data: ``(N, d)``.
    :param prior: the hyperparameters.
    :param m: initial means ``(K, d)``.
    :param rho: initial log-variances ``(K, d)``; default ``log sigma1_sq`` (the prior).
    :param step_size: a constant step ``rho_t`` in ``(0, 1]``; ``None`` uses the
        Robbins-Monro schedule below.
    :param tau: delay of ``rho_t = (t + tau)^(-kappa)``, ``t = 0, 1, ...`` the step count;
        at least 1 so that no step exceeds 1 (which would extrapolate).
    :param kappa: forgetting rate in ``(0.5, 1]``, so that ``sum rho_t = inf`` and
        ``sum rho_t^2 < inf`` [1, Eq. 26].
    :raises ValueError: on shapes that disagree with the data and prior, or a step size,
        ``tau`` or ``kappa`` out of range.
    """

    def __init__(
        self,
        data: torch.Tensor,
        prior: GMMPrior,
        m: torch.Tensor,
        rho: torch.Tensor | None = None,
        *,
        step_size: float | None = None,
        tau: float = 1.0,
        kappa: float = 0.7,
    ) -> None:
        if data.dim() != 2 or data.shape[1] != prior.dim:
            raise ValueError(f"data must have shape (N, {prior.dim}), got {tuple(data.shape)}")
        shape = (prior.num_components, prior.dim)
        if tuple(m.shape) != shape:
            raise ValueError(f"m must have shape (K, d) = {shape}, got {tuple(m.shape)}")
        if rho is not None and tuple(rho.shape) != shape:
            raise ValueError(f"rho must have shape (K, d) = {shape}, got {tuple(rho.shape)}")
        if step_size is not None and not (isinstance(step_size, (int, float)) and 0 < step_size <= 1):
            raise ValueError(
                f"Invalid step_size: {step_size!r}; use a constant in (0, 1], or None for the "
                "Robbins-Monro schedule (t + tau)^(-kappa)"
            )
        if not (isinstance(tau, (int, float)) and tau >= 1):
            raise ValueError(f"Invalid tau: {tau!r}; use a float >= 1 so that every step is at most 1")
        if not (isinstance(kappa, (int, float)) and 0.5 < kappa <= 1):
            raise ValueError(f"Invalid kappa: {kappa!r}; use a float in (0.5, 1] (Robbins-Monro conditions)")
        self.data = data
        self.prior = prior.to(data.dtype, data.device)
        self.step_size = None if step_size is None else float(step_size)
        self.tau = float(tau)
        self.kappa = float(kappa)
        self.num_steps = 0
        if rho is None:
            rho = self.prior.sigma1_sq.log().expand(shape)
        m = m.detach().to(data.device, data.dtype)
        rho = rho.detach().to(data.device, data.dtype)
        #: Natural parameters of q(c): precision and precision * (m - xi), both (K, d).
        self.precision = (-rho).exp()
        self.shift = self.precision * (m - self.prior.xi)

    @property
    def m(self) -> torch.Tensor:
        """Variational means ``(K, d)``."""
        return self.prior.xi + self.shift / self.precision

    @property
    def rho(self) -> torch.Tensor:
        """Variational log-variances ``(K, d)``."""
        return -self.precision.log()

    def current_step_size(self) -> float:
        """``rho_t`` of the next step: the constant, or ``(t + tau)^(-kappa)``."""
        if self.step_size is not None:
            return self.step_size
        return (self.num_steps + self.tau) ** (-self.kappa)

    def local_step(self, indices: torch.Tensor) -> torch.Tensor:
        """Exact ``log phi`` of the data ``indices`` given the current ``q(c)``, ``(|b|, K)``."""
        data = self.data[indices]
        return optimal_logits(data, self.prior, self.m, self.rho)

    @torch.no_grad()
    def step(self, indices: torch.Tensor) -> float:
        """One SVI step on the mini-batch ``indices``.

        :param indices: 1-D LongTensor of distinct data indices (a block), non-empty.
        :returns: the unbiased estimate ``(N / |b|) f_b`` of the negative ELBO at the
            current ``q(c)`` and the new local ``phi_b``, before the global step (as
            :meth:`pyro.infer.SVI.step` returns the loss before its update).
        :rtype: float
        """
        num_data = self.data.shape[0]
        if indices.dim() != 1 or indices.numel() == 0 or indices.dtype != torch.long:
            raise ValueError(
                f"indices must be a non-empty 1-D LongTensor of data indices, got dtype {indices.dtype} "
                f"and shape {tuple(indices.shape)}"
            )
        if int(indices.min()) < 0 or int(indices.max()) >= num_data:
            raise ValueError(
                f"indices must lie in range(N) = range({num_data}), got min {int(indices.min())} "
                f"and max {int(indices.max())}"
            )
        indices = indices.to(self.data.device)
        prior = self.prior
        data = self.data[indices]
        m, rho = self.m, self.rho
        log_phi = optimal_logits(data, prior, m, rho)
        scale = num_data / data.shape[0]
        loss = scale * float(block_negative_elbo(data, prior, m, rho, log_phi, num_data))

        phi = log_phi.exp()
        counts = phi.sum(0)[:, None]
        precision_hat = scale * counts / prior.sigma0_sq + prior.sigma1_sq.reciprocal()
        shift_hat = scale * (phi.T @ (data - prior.xi)) / prior.sigma0_sq

        step = self.current_step_size()
        self.precision = (1.0 - step) * self.precision + step * precision_hat
        self.shift = (1.0 - step) * self.shift + step * shift_hat
        self.num_steps += 1
        return loss
