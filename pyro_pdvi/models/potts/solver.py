"""The closed-form patch solver of the Potts mixture [1, App. C.1].

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...checks import check_positive_int
from ...infer.problem import BlockProblem, BlockSolution
from ..gmm import SITE_NAMES, GMMPrior
from ..gmm.solver import ComponentStep, check_block_sites, check_site_names, scaled_data
from .coordinate_ascent import ColourOrder, mean_field_sweep
from .graph import SpatialGraph
from .objective import (
    likelihood_weights,
    negative_elbo_from_statistics,
    potts_block_negative_elbo,
    potts_energy,
    row_constants,
)


@dataclass
class Patch:
    """What a patch's solves share, built on its first solve: its spots in colour order
    (:class:`~pyro_pdvi.models.potts.coordinate_ascent.ColourOrder`) and their data.

    :param indices: the patch's spots, in the order the problem gives them.
    :param colours: the colour order of the patch's subgraph.
    :param scaled: ``x~ = [(x - xi) / sigma0^2, 1]`` of its spots in colour order, ``(s, d + 1)``.
    :param constant: ``sum_i c_i`` of :func:`~pyro_pdvi.models.potts.objective.row_constants`.
    :param prior: the prior ``scaled`` and ``constant`` were computed with.
    """

    indices: torch.Tensor
    colours: ColourOrder
    scaled: torch.Tensor
    constant: torch.Tensor
    prior: GMMPrior


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
    patch-restricted one (edges inside the block only). On its first solve a patch's spots
    are put in colour order and their scaled data ``x~`` kept (:class:`Patch`): a sweep is
    then one product ``x~ W^T`` for ``E_q log p(x | c)``, the class updates on contiguous
    slices, and one product ``phi^T x~`` for ``(m, rho)``; ``f_b`` comes from the same
    statistics (:func:`~pyro_pdvi.models.potts.objective.negative_elbo_from_statistics`).
    Patches differ in size, and each has its own subgraph, so the blocks of a problem are
    solved one after the other.

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
        self._patches: dict[int, Patch] = {}
        self._prior_key: tuple | None = None
        self._prior_on: GMMPrior | None = None

    def patch(self, block: int, indices: torch.Tensor, dtype: torch.dtype, device: torch.device) -> Patch:
        """The block's :class:`Patch` (cached per block id; rebuilt if the block's indices, the
        dtype, the device or :attr:`prior` change)."""
        cached = self._patches.get(block)
        if (
            cached is not None
            and cached.prior is self.prior
            and cached.scaled.dtype == dtype
            and cached.scaled.device == device
            and torch.equal(cached.indices, indices.to(cached.indices.device))
        ):
            return cached
        indices = indices.to(self.graph.indptr.device)
        colours = ColourOrder.of(self.graph.subgraph(indices))
        prior = self.prior.to(dtype, device)
        data = self.data.index_select(0, indices[colours.order].to(self.data.device)).to(device, dtype)
        colours.graph = colours.graph.to(device, dtype)
        colours.classes = [(start, end, rows.to(device, dtype)) for start, end, rows in colours.classes]
        colours.order, colours.inverse = colours.order.to(device), colours.inverse.to(device)
        constant = row_constants(data, prior).sum()
        self._patches[block] = Patch(indices, colours, scaled_data(data, prior), constant, self.prior)
        return self._patches[block]

    @torch.no_grad()
    def solve(self, problem: BlockProblem) -> BlockSolution:
        """Solve the problem's patches' augmented Lagrangians, one patch after the other.

        :returns: ``lambda_b = (m, rho)``, the patches' logits (normalised, ``log phi``), and
            ``f_b`` there.
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
        patch = self.patch(int(problem.blocks[0]), problem.indices[0], dtype, device)
        colours = patch.colours
        prior = self.prior_on(dtype, device)
        weight = patch.scaled.shape[0] / problem.num_data
        component_step = ComponentStep(problem, (means, log_variances), prior, weight, self.newton_steps)
        log_phi = torch.log_softmax(problem.local[logits][0].to(device, dtype)[colours.order], -1)
        phi = log_phi.exp()
        m, rho = m_0.unsqueeze(0), rho_0.unsqueeze(0)
        for _ in range(self.num_sweeps):
            log_likelihood = patch.scaled @ likelihood_weights(prior, m[0], rho[0]).T
            mean_field_sweep(log_likelihood, phi, log_phi, colours, self.temperature)
            statistics = phi.T @ patch.scaled
            m, rho = component_step(statistics.unsqueeze(0), rho)
        phi_log_phi = (phi * log_phi).sum()
        energy = potts_energy(colours.graph, phi)
        loss = negative_elbo_from_statistics(
            prior, m[0], rho[0], statistics, phi_log_phi, energy, patch.constant, weight
        )
        alpha = log_phi[colours.inverse].unsqueeze(0)
        return BlockSolution({means: m, log_variances: rho}, {logits: alpha}, loss.reshape(1))

    def prior_on(self, dtype: torch.dtype, device: torch.device) -> GMMPrior:
        """:attr:`prior` on ``device`` (cached until :attr:`prior` changes)."""
        key = (id(self.prior), dtype, device)
        if self._prior_key != key:
            self._prior_key, self._prior_on = key, self.prior.to(dtype, device)
        return self._prior_on

    def augmented_lagrangian(
        self, problem: BlockProblem, m: torch.Tensor, rho: torch.Tensor, alpha: torch.Tensor
    ) -> torch.Tensor:
        """``L_b`` of every patch at ``(alpha_b, m, rho)`` (each with a leading block axis),
        shape ``(m,)``, differentiable: for checks and diagnostics."""
        means, log_variances, _ = self.site_names
        prior = self.prior.to(m.dtype, m.device)
        values = []
        for i in range(len(problem)):
            indices = problem.indices[i].to(self.graph.indptr.device)
            data = self.data.index_select(0, indices.to(self.data.device)).to(m.device, m.dtype)
            subgraph = self.graph.subgraph(indices).to(m.device, m.dtype)
            values.append(
                potts_block_negative_elbo(
                    data, prior, subgraph, m[i], rho[i], alpha[i], problem.num_data, self.temperature
                )
            )
        return torch.stack(values) + problem.penalty({means: m, log_variances: rho})
