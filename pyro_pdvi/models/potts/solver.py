"""The closed-form patch solver of the Potts mixture [1, App. C.1].

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
"""

from __future__ import annotations

import torch

from ...checks import check_positive_int
from ...infer.problem import BlockProblem, BlockSolution
from ..gmm import SITE_NAMES, GMMPrior, expected_log_likelihood
from ..gmm.solver import ComponentStep, check_block_sites, check_site_names, scaled_data
from .coordinate_ascent import colour_rows, mean_field_sweep
from .graph import SpatialGraph
from .objective import potts_block_negative_elbo


class PottsBlockSolver:
    """Closed-form coordinate descent on one patch's augmented Lagrangian [1, App. C.1]::

        L_b(alpha_b, m, rho) = f_b(alpha_b, m, rho) + <mu_m, m - m_0> + <mu_rho, rho - rho_0>
                               + 1/2 ||m - m_0||^2 / eta_m + 1/2 ||rho - rho_0||^2 / eta_rho

    with ``f_b`` = :func:`~pyro_pdvi.models.potts.potts_block_negative_elbo` on the patch's
    subgraph. Starting from the
    consensus ``(m_0, rho_0)`` and the patch's last ``alpha_b`` (the neighbour messages make
    the warm start matter), each sweep

    1. updates ``phi_b`` colour class by colour class, ``phi_S = softmax(E_q log p(x_S | c)
       + sum_l r_Sl phi_l)``: exact mean-field minimisation with neighbour messages;
    2. sets ``(m, rho)`` by :class:`~pyro_pdvi.models.gmm.solver.ComponentStep`, as
       :class:`~pyro_pdvi.models.gmm.GMMBlockSolver` does: ``m`` exactly, ``rho`` by
       safeguarded Newton steps on its convex scalar problems.

    Each step minimises ``L_b`` exactly in its coordinates (the last one once Newton has
    converged), so ``L_b`` does not increase from sweep to sweep. The graph must be the
    patch-restricted one (edges inside the block only); the solver caches each block's
    subgraph and colour classes on first use. Patches differ in size, and each has its own
    subgraph, so the blocks of a problem are solved one after the other.

    Pass as ``PDVI(model.model, model.guide, optim, model.loss, blocks=patches, eta=...,
    solver=PottsBlockSolver(data, prior, graph))`` with a :class:`PottsGMMModel`.

    :param data: ``(N, d)`` features.
    :param prior: the hyperparameters.
    :param graph: symmetric graph with edges inside patches only.
    :param num_sweeps: sweeps per solve (the authors use 10-15).
    :param newton_steps: Newton steps on ``rho`` per sweep.
    :param site_names: param names of the means, log-variances and logits.
    :param temperature: ``T >= 1`` of optional annealing: the ``phi`` updates minimise the
        annealed objective (entropy weighted by ``T``, see :func:`block_negative_elbo`).
        A caller lowers it to 1 over the first epochs (``fit_potts_mixture(anneal=...)``);
        at 1 (default) the solver minimises the exact augmented Lagrangian.
    """

    def __init__(
        self,
        data: torch.Tensor,
        prior: GMMPrior,
        graph: SpatialGraph,
        num_sweeps: int = 10,
        newton_steps: int = 5,
        site_names: tuple[str, str, str] = SITE_NAMES,
        temperature: float = 1.0,
    ) -> None:
        for name, value in (("num_sweeps", num_sweeps), ("newton_steps", newton_steps)):
            check_positive_int(value, name)
        if graph.num_rows != data.shape[0] or graph.num_cols != data.shape[0]:
            raise ValueError(
                f"graph must be square over the N = {data.shape[0]} spots, got "
                f"{graph.num_rows} x {graph.num_cols}"
            )
        if not temperature > 0:
            raise ValueError(f"Invalid temperature: {temperature}; use a positive float (1: no annealing)")
        self.data = data
        self.temperature = temperature
        self.prior = prior
        self.graph = graph
        self.num_sweeps = num_sweeps
        self.newton_steps = newton_steps
        self.site_names = check_site_names(site_names)
        self._patches: dict[int, tuple[torch.Tensor, SpatialGraph, list]] = {}

    def patch(self, block: int, indices: torch.Tensor) -> tuple[SpatialGraph, list]:
        """The block's subgraph and its colour classes with their rows (cached per block id,
        rebuilt if the block's indices change)."""
        indices = indices.to(self.graph.indptr.device)
        cached = self._patches.get(block)
        if cached is None or not torch.equal(cached[0], indices):
            subgraph = self.graph.subgraph(indices)
            cached = self._patches[block] = (indices, subgraph, colour_rows(subgraph))
        return cached[1], cached[2]

    @torch.no_grad()
    def solve(self, problem: BlockProblem) -> BlockSolution:
        """Solve the problem's patches' augmented Lagrangians, one patch after the other.

        :returns: ``lambda_b = (m, rho)``, the patches' logits, and ``f_b`` there.
        :rtype: BlockSolution
        """
        check_block_sites(
            "PottsBlockSolver",
            problem,
            self.site_names,
            "Pass site_names= matching the guide (PottsGMMModel's guide creates m, rho and, inside "
            "the data plate with event_dim=1, alpha).",
        )
        solutions = [self._solve_patch(problem.block(i)) for i in range(len(problem))]
        return BlockSolution(
            globals={k: torch.cat([s.globals[k] for s in solutions]) for k in solutions[0].globals},
            local={k: torch.cat([s.local[k] for s in solutions]) for k in solutions[0].local},
            loss=torch.cat([s.loss for s in solutions]),
        )

    def _solve_patch(self, problem: BlockProblem) -> BlockSolution:
        means, log_variances, logits = self.site_names
        m_0, rho_0 = problem.consensus[means], problem.consensus[log_variances]
        dtype, device = m_0.dtype, m_0.device
        prior = self.prior.to(dtype, device)
        indices = problem.indices[0]
        data = self.data.index_select(0, indices.to(self.data.device)).to(device, dtype)
        subgraph, classes = self.patch(int(problem.blocks[0]), indices)
        scaled = scaled_data(data, prior)
        component_step = ComponentStep(
            problem, (means, log_variances), prior, data.shape[0] / problem.num_data, self.newton_steps
        )
        m, rho = m_0.unsqueeze(0), rho_0.unsqueeze(0)
        alpha = torch.log_softmax(problem.local[logits][0].to(device, dtype), -1)
        for _ in range(self.num_sweeps):
            alpha = mean_field_sweep(
                expected_log_likelihood(data, prior, m[0], rho[0]), alpha, classes, self.temperature
            )
            m, rho = component_step((alpha.exp().T @ scaled).unsqueeze(0), rho)
        loss = potts_block_negative_elbo(data, prior, subgraph, m[0], rho[0], alpha, problem.num_data)
        return BlockSolution({means: m, log_variances: rho}, {logits: alpha.unsqueeze(0)}, loss.reshape(1))

    def augmented_lagrangian(
        self, problem: BlockProblem, m: torch.Tensor, rho: torch.Tensor, alpha: torch.Tensor
    ) -> torch.Tensor:
        """``L_b`` of every patch at ``(alpha_b, m, rho)`` (each with a leading block axis),
        shape ``(m,)``, differentiable: for checks and diagnostics."""
        means, log_variances, _ = self.site_names
        prior = self.prior.to(m.dtype, m.device)
        values = []
        for i in range(len(problem)):
            indices = problem.indices[i]
            data = self.data.index_select(0, indices.to(self.data.device)).to(m.device, m.dtype)
            subgraph, _ = self.patch(int(problem.blocks[i]), indices)
            values.append(
                potts_block_negative_elbo(
                    data, prior, subgraph, m[i], rho[i], alpha[i], problem.num_data, self.temperature
                )
            )
        return torch.stack(values) + problem.penalty({means: m, log_variances: rho})
