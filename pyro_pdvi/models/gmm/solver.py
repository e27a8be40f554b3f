"""The closed-form block solver of the mixture [1, App. C.1]: coordinate descent on each
block's augmented Lagrangian, all blocks of a step in one vectorized pass.

:class:`ComponentStep` (the ``m``, ``rho`` half of a sweep, from the responsibilities'
sufficient statistics) and :func:`scaled_data` are shared with the Potts mixture's solver
(:mod:`pyro_pdvi.models.potts`), whose ``q(c)`` half is the same.

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
"""

from __future__ import annotations

import math

import torch

from ...checks import check_positive_int
from ...infer.problem import BlockProblem, BlockSolution
from .model import SITE_NAMES
from .objective import LOG_2PI, block_negative_elbo
from .prior import GMMPrior


def check_block_sites(
    solver: str, problem: BlockProblem, site_names: tuple[str, str, str], hint: str
) -> None:
    """Raise a ``ValueError`` naming the sites a mixture solver expects and those the problem has.

    :param solver: the solver's name, for the message.
    :param problem: the blocks' subproblem.
    :param site_names: the means, log-variances (global) and logits (local) sites.
    :param hint: how to fix it, for the message.
    """
    means, log_variances, logits = site_names
    for name, where, kind in (
        (means, problem.consensus, "global"),
        (log_variances, problem.consensus, "global"),
        (logits, problem.local, "local"),
    ):
        if name not in where:
            raise ValueError(
                f'{solver} expects a {kind} param site "{name}", but the problem of blocks '
                f"{problem.blocks.tolist()} has global sites {sorted(problem.consensus)} and local "
                f"sites {sorted(problem.local)}. {hint}"
            )


def check_site_names(site_names: tuple[str, ...]) -> tuple[str, str, str]:
    """Three distinct names: means, log-variances, logits."""
    if len(site_names) != 3 or len(set(site_names)) != 3:
        raise ValueError(
            f"site_names must name the means, log-variances and logits, three distinct names; "
            f"got {site_names!r}"
        )
    return tuple(site_names)


def scaled_data(data: torch.Tensor, prior: GMMPrior) -> torch.Tensor:
    """``x~_i = [(x_i - xi) / sigma0^2, 1]``, shape ``(..., d + 1)``: ``phi^T x~`` holds a
    block's ``sum_i phi_ik (x_i - xi) / sigma0^2`` and its counts ``N_k``."""
    centred = data - prior.xi
    return torch.cat([centred / prior.sigma0_sq, centred.new_ones(*centred.shape[:-1], 1)], -1)


class ComponentStep:
    """Minimiser of ``m`` blocks' augmented Lagrangians over ``q(c) = N(m, exp(rho))`` given
    their responsibilities (the ``m``, ``rho`` half of a sweep of :class:`GMMBlockSolver`).

    With ``w = |b| / N`` and ``N_k = sum_{i in b} phi_ik``, ``m`` solves the diagonal quadratic
    exactly::

        (N_k / sigma0^2 + w / sigma1^2 + 1 / eta_m) (m - xi)
            = sum_i phi_ik (x_i - xi) / sigma0^2 - mu_m + (m_0 - xi) / eta_m

    and ``rho`` takes ``newton_steps`` Newton steps on the strictly convex
    ``h(rho) = a exp(rho) - (w/2) rho + mu_rho rho + (rho - rho_0)^2 / (2 eta_rho)``,
    ``a = N_k / (2 sigma0^2) + w / (2 sigma1^2)``, started at ``min(rho, cap)`` with the cap
    ``rho_0 - eta_rho (mu_rho - w/2)`` an upper bound of the root: ``h'`` is increasing and
    convex, so Newton from the right of the root decreases monotonically onto it.
    Everything that does not change between sweeps is computed once here.

    :param problem: the blocks' subproblem (consensus, duals, step sizes of the sites).
    :param site_names: the means and log-variances sites.
    :param prior: the hyperparameters, on the problem's dtype and device.
    :param weight: ``w = |b| / N``.
    :param newton_steps: Newton steps on ``rho``.
    """

    def __init__(
        self,
        problem: BlockProblem,
        site_names: tuple[str, str],
        prior: GMMPrior,
        weight: float,
        newton_steps: int,
    ) -> None:
        means, log_variances = site_names
        m_0, rho_0 = problem.consensus[means], problem.consensus[log_variances]
        mu_m, mu_rho = problem.dual[means], problem.dual[log_variances]
        eta_m, eta_rho = problem.step_sizes[means], problem.step_sizes[log_variances]
        self.prior = prior
        self.newton_steps = newton_steps
        self.precision_0 = prior.sigma0_sq.reciprocal()
        prior_precision = weight * prior.sigma1_sq.reciprocal()
        self.fixed_precision_m = prior_precision + eta_m.reciprocal()
        self.pull_m = (m_0 - prior.xi) / eta_m - mu_m
        self.rho_cap = rho_0 - eta_rho * (mu_rho - 0.5 * weight)
        self.inverse_eta_rho = eta_rho.reciprocal()
        self.fixed_gradient_rho = mu_rho - 0.5 * weight - rho_0 * self.inverse_eta_rho
        self.half_prior_precision = 0.5 * prior_precision

    def __call__(self, statistics: torch.Tensor, rho: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The new ``(m, rho)``, each ``(m, K, d)``.

        :param statistics: ``phi^T x~`` of every block (:func:`scaled_data`), ``(m, K, d + 1)``.
        :param rho: the current log-variances (the Newton start), ``(m, K, d)``.
        """
        dim = statistics.shape[-1] - 1
        data_precision = statistics[..., dim:] * self.precision_0
        m = torch.addcdiv(
            self.prior.xi, statistics[..., :dim] + self.pull_m, data_precision + self.fixed_precision_m
        )
        curvature = torch.add(self.half_prior_precision, data_precision, alpha=0.5)
        rho = torch.minimum(rho, self.rho_cap)
        for _ in range(self.newton_steps):
            scaled_rho = curvature * rho.exp()
            gradient = torch.addcmul(scaled_rho + self.fixed_gradient_rho, rho, self.inverse_eta_rho)
            rho = torch.minimum(
                rho.addcdiv(gradient, scaled_rho + self.inverse_eta_rho, value=-1.0), self.rho_cap
            )
        return m, rho


class GMMBlockSolver:
    """Coordinate-descent solve of the blocks' augmented Lagrangians [1, App. C.1]::

        L_b(alpha_b, m, rho) = f_b(alpha_b, m, rho)
                               + <mu_m, m - m_0> + <mu_rho, rho - rho_0>
                               + 1/2 ||m - m_0||^2 / eta_m + 1/2 ||rho - rho_0||^2 / eta_rho

    with ``f_b`` = :func:`~pyro_pdvi.models.gmm.block_negative_elbo`. Starting from the
    consensus ``(m_0, rho_0)``, each sweep

    1. sets ``alpha_b = log softmax E_q[log p(x_i | c_k)]``, the exact minimiser in ``alpha_b``;
    2. sets ``(m, rho)`` by :class:`ComponentStep`: ``m`` exactly, ``rho`` by Newton steps.

    All blocks of a step in one pass: each sweep is two batched matrix products over the
    data and one softmax. With ``x~_i = [(x_i - xi) / sigma0^2, 1]`` (:func:`scaled_data`),
    ``x~_i . [m_k - xi, -1/2 sum_j ((m_kj - xi_j)^2 + exp(rho_kj)) / sigma0_j^2]`` is
    ``E_q[log p(x_i | c_k)]`` up to a term constant in ``k``, which the softmax drops, and
    ``phi^T x~`` holds the statistics of the ``(m, rho)`` half. ``f_b`` is assembled from
    them and ``sum_i ||x_i - xi||^2 / sigma0^2`` (taken once). With ``tol = 0`` nothing is
    read back to the host, so on a GPU the sweeps queue without waiting; with ``tol > 0``
    each block stops on its own (later sweeps leave it unchanged), at the cost of one host
    synchronisation per sweep.

    Pass as ``PDVI(..., solver=GMMBlockSolver(data, prior))`` with
    :class:`~pyro_pdvi.models.gmm.GMMModel`'s mean-field guide (``collapsed=False``). The
    solve is deterministic, so PDVI's default ``global_update="auto"`` takes the paper's
    rule; on cluster-sorted blocks it reached the CAVI optimum in 7 epochs where the
    consensus rule had not in 15 (``docs/benchmarks.md``, section 1b).

    :param data: the full data ``(N, d)``; the blocks' rows are taken by ``problem.indices``.
    :param prior: the hyperparameters.
    :param num_sweeps: coordinate-descent sweeps per solve (the authors use 10-15).
    :param newton_steps: Newton steps on ``rho`` per sweep.
    :param site_names: param names of the means, log-variances and logits in the guide.
    :param tol: stop a block early once no ``m`` or ``rho`` entry moves more than this in a
        sweep (0 never stops early).
    """

    def __init__(
        self,
        data: torch.Tensor,
        prior: GMMPrior,
        num_sweeps: int = 10,
        newton_steps: int = 5,
        site_names: tuple[str, str, str] = SITE_NAMES,
        tol: float = 0.0,
    ) -> None:
        for name, value in (("num_sweeps", num_sweeps), ("newton_steps", newton_steps)):
            check_positive_int(value, name)
        if not tol >= 0:
            raise ValueError(f"Invalid tol: {tol}; use a non-negative float")
        self.data = data
        self.prior = prior
        self.num_sweeps = num_sweeps
        self.newton_steps = newton_steps
        self.site_names = check_site_names(site_names)
        self.tol = tol
        self._priors: dict[tuple[torch.dtype, torch.device], GMMPrior] = {}

    def _check_sites(self, problem: BlockProblem) -> None:
        check_block_sites(
            "GMMBlockSolver",
            problem,
            self.site_names,
            "Pass site_names= matching the guide's param names; the logits must be created inside "
            "the data plate with event_dim=1 (a collapsed guide without them has a different "
            "objective, which this solver does not minimise).",
        )

    def prior_on(self, dtype: torch.dtype, device: torch.device) -> GMMPrior:
        """The prior on ``device``, cached: a copy from host memory each solve would make the
        host wait for the device (a pageable host-to-device copy synchronises)."""
        key = (dtype, device)
        if key not in self._priors:
            self._priors[key] = self.prior.to(dtype, device)
        return self._priors[key]

    def _block_data(self, problem: BlockProblem, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The blocks' data, ``(m, s, d)``."""
        flat = problem.indices.reshape(-1).to(self.data.device)
        return self.data.index_select(0, flat).to(device, dtype).view(*problem.indices.shape, -1)

    @torch.no_grad()
    def solve(self, problem: BlockProblem) -> BlockSolution:
        """Solve the augmented Lagrangians of the problem's equal-size blocks at once.

        :param problem: the blocks' subproblems from the PDVI engine.
        :returns: ``lambda_b = (m, rho)`` of shape ``(m, K, d)``, the new logits ``(m, s, K)``
            and ``f_b`` of shape ``(m,)``.
        :rtype: BlockSolution
        """
        self._check_sites(problem)
        means, log_variances, logits = self.site_names
        m_0, rho_0 = problem.consensus[means], problem.consensus[log_variances]
        dtype, device = m_0.dtype, m_0.device
        prior = self.prior_on(dtype, device)
        num_batch, size = problem.indices.shape
        dim = m_0.shape[-1]
        component_step = ComponentStep(
            problem, (means, log_variances), prior, size / problem.num_data, self.newton_steps
        )
        data = self._block_data(problem, dtype, device).reshape(-1, dim)
        scaled = scaled_data(data, prior)
        squares = ((data - prior.xi) * scaled[:, :dim]).view(num_batch, size * dim).sum(1)
        scaled = scaled.view(num_batch, size, dim + 1)
        del data

        minus_half_precision_0 = (-0.5 * prior.sigma0_sq.reciprocal()).unsqueeze(-1)
        m = m_0.expand(num_batch, -1, -1).clone()
        rho = rho_0.expand(num_batch, -1, -1).clone()
        early_stop = self.tol > 0
        active = torch.ones(num_batch, dtype=torch.bool, device=device) if early_stop else None
        alpha = phi = statistics = None
        for sweep in range(self.num_sweeps):
            centred_means = m - prior.xi
            second_moments = torch.addcmul(rho.exp(), centred_means, centred_means)
            bias = torch.matmul(second_moments, minus_half_precision_0)  # (m, K, 1)
            weights = torch.cat([centred_means, bias], -1).transpose(1, 2)  # (m, d + 1, K)
            scores = torch.bmm(scaled, weights)
            if early_stop or sweep == self.num_sweeps - 1:
                new_alpha = torch.log_softmax(scores, -1)
                new_phi = new_alpha.exp()
            else:
                new_alpha, new_phi = None, torch.softmax(scores, -1)
            del scores
            new_statistics = torch.bmm(new_phi.transpose(1, 2), scaled)  # (m, K, d + 1)
            new_m, new_rho = component_step(new_statistics, rho)
            if not early_stop:
                m, rho, alpha, phi, statistics = new_m, new_rho, new_alpha, new_phi, new_statistics
                continue
            # A block that has converged keeps its values, as if solved alone.
            change = torch.maximum(
                (new_m - m).abs().flatten(1).amax(1), (new_rho - rho).abs().flatten(1).amax(1)
            )
            keep = active.view(-1, 1, 1)
            m, rho = torch.where(keep, new_m, m), torch.where(keep, new_rho, rho)
            alpha = new_alpha if alpha is None else torch.where(keep, new_alpha, alpha)
            phi = new_phi if phi is None else torch.where(keep, new_phi, phi)
            statistics = (
                new_statistics if statistics is None else torch.where(keep, new_statistics, statistics)
            )
            active = active & (change > self.tol)
            if not bool(active.any()):  # the one host synchronisation of an early stop
                break

        loss = self._losses(prior, m, rho, alpha, phi, statistics, squares, size, problem.num_data)
        return BlockSolution(globals={means: m, log_variances: rho}, local={logits: alpha}, loss=loss)

    @staticmethod
    def _losses(
        prior: GMMPrior,
        m: torch.Tensor,
        rho: torch.Tensor,
        alpha: torch.Tensor,
        phi: torch.Tensor,
        statistics: torch.Tensor,
        squares: torch.Tensor,
        size: int,
        num_data: int,
    ) -> torch.Tensor:
        """:func:`~pyro_pdvi.models.gmm.block_negative_elbo` of every block, shape ``(m,)``,
        from the sufficient statistics ``phi^T x~`` (``sum_k phi_ik = 1``)::

            sum_ik phi_ik (alpha_ik + log K) + 1/2 [ sum_i ||x_i - xi||^2 / sigma0^2
                - 2 sum_k S_k . (m_k - xi) + sum_k N_k sum_j ((m_kj - xi_j)^2 + exp(rho_kj)) / sigma0_j^2
                + |b| sum_j log(2 pi sigma0_j^2) ] + |b|/N KL(q(c) || p(c))
        """
        dim = m.shape[-1]
        centred_means = m - prior.xi
        sums, counts = statistics[..., :dim], statistics[..., dim]
        second_moments = ((centred_means.square() + rho.exp()) / prior.sigma0_sq).sum(-1)
        quadratic = (
            squares - 2.0 * (sums * centred_means).flatten(1).sum(1) + (counts * second_moments).sum(1)
        )
        log_normaliser = size * (LOG_2PI + prior.sigma0_sq.log()).sum()
        entropy = (phi * alpha).flatten(1).sum(1) + size * math.log(prior.num_components)
        ratio = (centred_means.square() + rho.exp()) / prior.sigma1_sq
        divergence = 0.5 * (prior.sigma1_sq.log() - rho + ratio - 1.0).flatten(1).sum(1)
        return entropy + 0.5 * (quadratic + log_normaliser) + (size / num_data) * divergence

    def augmented_lagrangian(
        self, problem: BlockProblem, m: torch.Tensor, rho: torch.Tensor, alpha: torch.Tensor
    ) -> torch.Tensor:
        """``L_b`` of every block at ``(alpha_b, m, rho)`` (``(m, s, K)``, ``(m, K, d)``,
        ``(m, K, d)``), shape ``(m,)``, differentiable: for checks and diagnostics."""
        self._check_sites(problem)
        means, log_variances, _ = self.site_names
        prior = self.prior.to(m.dtype, m.device)
        data = self._block_data(problem, m.dtype, m.device)
        f_b = torch.stack(
            [
                block_negative_elbo(data[i], prior, m[i], rho[i], alpha[i], problem.num_data)
                for i in range(len(m))
            ]
        )
        return f_b + problem.penalty({means: m, log_variances: rho})
