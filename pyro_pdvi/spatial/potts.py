"""Gaussian mixture with a Potts prior on a spatial graph: the model of [1, App. C.1].

Model, with the mixture of :mod:`pyro_pdvi.models.gmm` and a graph ``E`` with weights ``r_ij``::

    c_k ~ N(xi, diag(sigma1_sq))                                   (global)
    p(zeta) ∝ exp( sum_{(i,j) in E} r_ij 1[zeta_i = zeta_j] )      (Potts prior, local)
    x_i | zeta_i, c ~ N(c_{zeta_i}, diag(sigma0_sq))

Mean-field family ``q(c_kj) = N(m_kj, exp(rho_kj))``, ``q(zeta_i) = Categorical(softmax(alpha_i))``.
The exact negative ELBO [1, App. C.1] is the mixture's (:func:`pyro_pdvi.models.gmm.negative_elbo`)
minus the Potts energy ``sum_{(i,j) in E} r_ij <phi_i, phi_j>`` (:func:`potts_energy`), up to
the constant ``log Z(r) - N log K`` (the mixture's objective carries ``-E log(1/K)`` per spot).

PD-VI blocks are fixed spatial patches [1, Sec. 5]. The block objective ``f_b``
(:func:`block_negative_elbo`) is the mixture's block share minus the energy of the edges
*inside* the patch, so the ``f_b`` add up to the objective on the graph with the edges
between patches dropped (:meth:`~pyro_pdvi.spatial.graph.SpatialGraph.restrict`), as in the
authors' code. That is the stated choice here: a block's subproblem then depends on its own
spots only, which is what makes the blocks independent given ``lambda_0`` (the consensus
form of [1, eq. 2]). With ~6-neighbour graphs and 25 patches of 6k spots about 1-2 % of the
edges cross a patch boundary.

This module gives the exact objective, :func:`coordinate_ascent` (full-batch mean-field
coordinate ascent, the fixed point PD-VI is checked against), :class:`PottsBlockSolver`
(the closed-form local solver of [1, App. C.1]) and :class:`PottsGMMModel` (the Pyro
model and guide, with the exact loss as a callable for :class:`~pyro_pdvi.PDVI` and
:class:`pyro.infer.SVI`).

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
[2] Blei, Kucukelbir, McAuliffe (2017), "Variational Inference: A Review for
    Statisticians", JASA 112(518), Sec. 2.4.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from pyro import poutine

from ..checks import check_positive_int
from ..infer.primal import BlockProblem, BlockSolution
from ..models.gmm import (
    SITE_NAMES,
    GMMModel,
    GMMPrior,
    augmented_component_update,
    expected_log_likelihood,
    global_negative_elbo,
    local_negative_elbo,
)
from .graph import SpatialGraph

# --------------------------------------------------------------------------- the exact objective


def potts_energy(graph: SpatialGraph, phi: torch.Tensor) -> torch.Tensor:
    """``sum_{(i,j) in E} r_ij sum_k phi_ik phi_jk``, each undirected edge once, i.e.
    ``1/2 sum_i <phi_i, (W phi)_i>`` for the symmetric weight matrix ``W``.

    :param graph: symmetric graph on the rows of ``phi``.
    :param phi: ``(N, K)`` probabilities.
    """
    return 0.5 * (phi * graph.neighbour_sum(phi)).sum()


def negative_elbo(
    data: torch.Tensor,
    prior: GMMPrior,
    graph: SpatialGraph,
    m: torch.Tensor,
    rho: torch.Tensor,
    alpha: torch.Tensor,
) -> torch.Tensor:
    """The exact mean-field negative ELBO of [1, App. C.1] up to ``log Z(r) - N log K``:
    terms (A), (B), (D), (E) as in :func:`pyro_pdvi.models.gmm.negative_elbo`, and the Potts
    term (C) ``-sum_{(i,j) in E} r_ij <phi_i, phi_j>``.

    :param data: ``(N, d)``.
    :param prior: the mixture's hyperparameters.
    :param graph: the symmetric neighbour graph with weights ``r_ij``.
    :param m: ``(K, d)``.
    :param rho: ``(K, d)``.
    :param alpha: ``(N, K)`` logits of ``q(zeta_i)``.
    :returns: a scalar, differentiable in ``m, rho, alpha``.
    """
    phi = torch.softmax(alpha, -1)
    mixture = local_negative_elbo(data, prior, m, rho, alpha).sum() + global_negative_elbo(prior, m, rho)
    return mixture - potts_energy(graph, phi)


def block_negative_elbo(
    data_block: torch.Tensor,
    prior: GMMPrior,
    patch_graph: SpatialGraph,
    m: torch.Tensor,
    rho: torch.Tensor,
    alpha_block: torch.Tensor,
    num_data: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Block share ``f_b`` [1, App. C.1]: the spots' local terms, ``|b|/N`` of the KL of
    ``q(c)``, and the Potts term of the edges inside the block.

    With ``temperature = T != 1`` the entropy term (D) is weighted by ``T``: the annealed
    objective ``f_b + (T - 1) sum_i <phi_i, log phi_i>`` whose ``phi``-minimiser is
    ``softmax((ell + messages) / T)``, flatter for ``T > 1``.

    :param data_block: ``(|b|, d)``.
    :param prior: the hyperparameters.
    :param patch_graph: the block's induced subgraph (:meth:`SpatialGraph.subgraph`).
    :param m: ``(K, d)``.
    :param rho: ``(K, d)``.
    :param alpha_block: ``(|b|, K)``.
    :param num_data: N.
    :param temperature: ``T`` of the annealed objective (1: the exact one).
    """
    weight = data_block.shape[0] / num_data
    local = local_negative_elbo(data_block, prior, m, rho, alpha_block).sum()
    log_phi = torch.log_softmax(alpha_block, -1)
    energy = potts_energy(patch_graph, log_phi.exp())
    value = local + weight * global_negative_elbo(prior, m, rho) - energy
    if temperature != 1.0:
        value = value + (temperature - 1.0) * (log_phi.exp() * log_phi).sum()
    return value


# --------------------------------------------------------------------------- coordinate updates


def _mean_field_sweep(
    log_likelihood: torch.Tensor,
    alpha: torch.Tensor,
    colour_rows: list[tuple[torch.Tensor, SpatialGraph]],
    temperature: float = 1.0,
) -> torch.Tensor:
    """One pass over the colour classes: ``alpha_S = log softmax((ell_S + sum_l r_il phi_l) / T)``.

    Within a class no two spots are neighbours, so each class update is the exact
    minimiser of the objective in those spots' ``phi`` given all others (the objective
    in ``phi_i`` alone is ``<phi_i, log phi_i - ell_i - (W phi)_i>`` on the simplex).
    """
    phi = alpha.exp()
    for nodes, rows in colour_rows:
        updated = torch.log_softmax((log_likelihood[nodes] + rows.neighbour_sum(phi)) / temperature, -1)
        alpha[nodes] = updated
        phi[nodes] = updated.exp()
    return alpha


def _colour_rows(graph: SpatialGraph, seed: int = 0) -> list[tuple[torch.Tensor, SpatialGraph]]:
    return [(nodes, graph.rows(nodes)) for nodes in graph.colour_classes(seed) if nodes.numel()]


def _conjugate_update(
    data: torch.Tensor, prior: GMMPrior, phi: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact minimiser over ``q(c)`` given ``phi`` (the Potts term does not involve ``c``)."""
    counts = phi.sum(0)[:, None]
    precision = counts / prior.sigma0_sq + prior.sigma1_sq.reciprocal()
    m = prior.xi + (phi.T @ (data - prior.xi)) / prior.sigma0_sq / precision
    return m, -precision.log()


class CoordinateAscentResult(NamedTuple):
    """What :func:`coordinate_ascent` returns.

    :param m: ``(K, d)``.
    :param rho: ``(K, d)``.
    :param alpha: normalised logits ``log phi``, ``(N, K)``.
    :param losses: the objective after every sweep.
    :param converged: whether the change fell below ``tol``.
    """

    m: torch.Tensor
    rho: torch.Tensor
    alpha: torch.Tensor
    losses: torch.Tensor
    converged: bool


@torch.no_grad()
def coordinate_ascent(
    data: torch.Tensor,
    prior: GMMPrior,
    graph: SpatialGraph,
    alpha: torch.Tensor,
    num_iterations: int = 1000,
    tol: float = 1e-12,
) -> CoordinateAscentResult:
    """Full-batch mean-field coordinate ascent [2, Sec. 2.4] for the Potts mixture.

    Starting from ``q(c)`` given ``alpha``, each sweep updates ``phi`` colour class by
    colour class (:meth:`SpatialGraph.colour_classes`, each an exact minimisation), then
    ``q(c)`` to its conjugate form. The objective never increases. Stops when no ``m``,
    ``rho`` or ``alpha`` entry moves more than ``tol``.

    :param data: ``(N, d)``.
    :param prior: the hyperparameters.
    :param graph: the symmetric graph (restricted to patches to compare with PD-VI).
    :param alpha: initial logits ``(N, K)``.
    :param num_iterations: maximum sweeps.
    :param tol: stopping threshold.
    :rtype: CoordinateAscentResult
    """
    colour_rows = _colour_rows(graph)
    alpha = torch.log_softmax(alpha.detach(), -1).clone()
    m, rho = _conjugate_update(data, prior, alpha.exp())
    losses, converged = [], False
    for _ in range(num_iterations):
        old_alpha = alpha.clone()
        alpha = _mean_field_sweep(expected_log_likelihood(data, prior, m, rho), alpha, colour_rows)
        new_m, new_rho = _conjugate_update(data, prior, alpha.exp())
        losses.append(negative_elbo(data, prior, graph, new_m, new_rho, alpha))
        change = max(
            float((new_m - m).abs().max()),
            float((new_rho - rho).abs().max()),
            float((alpha - old_alpha).abs().max()),
        )
        m, rho = new_m, new_rho
        if change < tol:
            converged = True
            break
    return CoordinateAscentResult(m, rho, alpha, torch.stack(losses), converged)


# --------------------------------------------------------------------------- PD-VI local solver


class PottsBlockSolver:
    """Closed-form coordinate descent on one patch's augmented Lagrangian [1, App. C.1]::

        L_b(alpha_b, m, rho) = f_b(alpha_b, m, rho) + <mu_m, m - m_0> + <mu_rho, rho - rho_0>
                               + 1/2 ||m - m_0||^2 / eta_m + 1/2 ||rho - rho_0||^2 / eta_rho

    with ``f_b`` = :func:`block_negative_elbo` on the patch's subgraph. Starting from the
    consensus ``(m_0, rho_0)`` and the patch's last ``alpha_b`` (the neighbour messages make
    the warm start matter), each sweep

    1. updates ``phi_b`` colour class by colour class, ``phi_S = softmax(E_q log p(x_S | c)
       + sum_l r_Sl phi_l)``: exact mean-field minimisation with neighbour messages;
    2. sets ``m`` to the exact minimiser of its quadratic (as
       :class:`~pyro_pdvi.models.gmm.GMMBlockSolver`);
    3. takes ``newton_steps`` safeguarded Newton steps on the convex scalar problems in ``rho``.

    Each step minimises ``L_b`` exactly in its coordinates (the last one once Newton has
    converged), so ``L_b`` does not increase from sweep to sweep. The graph must be the
    patch-restricted one (edges inside the block only); the solver caches each block's
    subgraph and colour classes on first use.

    Pass as ``PDVI(model.model, model.guide, optim, model.loss, blocks=patches, eta=...,
    local_solver=PottsBlockSolver(data, prior, graph), global_update="paper")`` with a
    :class:`PottsGMMModel`.

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
        if len(site_names) != 3 or len(set(site_names)) != 3:
            raise ValueError(f"site_names must name means, log-variances and logits; got {site_names!r}")
        if not temperature > 0:
            raise ValueError(f"Invalid temperature: {temperature}; use a positive float (1: no annealing)")
        self.data = data
        self.temperature = temperature
        self.prior = prior
        self.graph = graph
        self.num_sweeps = num_sweeps
        self.newton_steps = newton_steps
        self.site_names = tuple(site_names)
        self._patches: dict[int, tuple[torch.Tensor, SpatialGraph, list]] = {}

    def patch(self, block: int, indices: torch.Tensor) -> tuple[SpatialGraph, list]:
        """The block's subgraph and its colour classes with their rows (cached per block id,
        rebuilt if the block's indices change)."""
        indices = indices.to(self.graph.indptr.device)
        cached = self._patches.get(block)
        if cached is None or not torch.equal(cached[0], indices):
            subgraph = self.graph.subgraph(indices)
            cached = self._patches[block] = (indices, subgraph, _colour_rows(subgraph))
        return cached[1], cached[2]

    def _check_sites(self, problem: BlockProblem) -> None:
        means, log_variances, logits = self.site_names
        for name, where, kind in (
            (means, problem.consensus, "global"),
            (log_variances, problem.consensus, "global"),
            (logits, problem.local, "local"),
        ):
            if name not in where:
                raise ValueError(
                    f'PottsBlockSolver expects a {kind} param site "{name}", but block {problem.block}\'s '
                    f"problem has global sites {sorted(problem.consensus)} and local sites "
                    f"{sorted(problem.local)}; pass site_names= matching the guide (PottsGMMModel's "
                    "guide creates m, rho and, inside the data plate with event_dim=1, alpha)"
                )

    @torch.no_grad()
    def __call__(self, problem: BlockProblem) -> BlockSolution:
        """Solve block ``problem.block``'s augmented Lagrangian.

        :returns: ``lambda_b = (m, rho)``, the block's logits, and ``f_b`` there.
        :rtype: BlockSolution
        """
        self._check_sites(problem)
        means, log_variances, logits = self.site_names
        m_0, rho_0 = problem.consensus[means], problem.consensus[log_variances]
        dtype, device = m_0.dtype, m_0.device
        prior = self.prior.to(dtype, device)
        data = self.data.index_select(0, problem.indices.to(self.data.device)).to(device, dtype)
        subgraph, colour_rows = self.patch(problem.block, problem.indices)
        weight = data.shape[0] / problem.num_data
        centred_data = data - prior.xi
        m, rho = m_0.clone(), rho_0.clone()
        alpha = torch.log_softmax(problem.local[logits].to(device, dtype), -1)
        for _ in range(self.num_sweeps):
            alpha = _mean_field_sweep(
                expected_log_likelihood(data, prior, m, rho), alpha, colour_rows, self.temperature
            )
            m, rho = augmented_component_update(
                alpha.exp(),
                centred_data,
                prior,
                weight,
                problem,
                rho,
                self.newton_steps,
                (means, log_variances),
            )
        loss = block_negative_elbo(data, prior, subgraph, m, rho, alpha, problem.num_data)
        return BlockSolution(globals={means: m, log_variances: rho}, local={logits: alpha}, loss=loss)

    def augmented_lagrangian(
        self, problem: BlockProblem, m: torch.Tensor, rho: torch.Tensor, alpha: torch.Tensor
    ) -> torch.Tensor:
        """``L_b`` at ``(alpha_b, m, rho)``, differentiable (for checks and diagnostics)."""
        means, log_variances, _ = self.site_names
        prior = self.prior.to(m.dtype, m.device)
        data = self.data.index_select(0, problem.indices.to(self.data.device)).to(m.device, m.dtype)
        subgraph, _ = self.patch(problem.block, problem.indices)
        f_b = block_negative_elbo(data, prior, subgraph, m, rho, alpha, problem.num_data, self.temperature)
        return f_b + problem.penalty({means: m, log_variances: rho})


# --------------------------------------------------------------------------- Pyro model and guide


class PottsGMMModel(GMMModel):
    """The Potts mixture's sites in Pyro, with its exact objective as a loss callable.

    ``model`` and ``guide`` are :class:`~pyro_pdvi.models.gmm.GMMModel`'s (params ``m``,
    ``rho`` global and ``alpha`` local inside ``pyro.plate("data", N, subsample=idx)``), so
    :class:`~pyro_pdvi.PDVI` finds the global/local split by plate structure. The Potts
    prior couples all ``zeta_i`` and has no per-site Pyro form here, so the objective is
    :meth:`loss`, a callable ``loss(model, guide, idx)`` that runs the guide to read the
    param values and returns the exact :func:`block_negative_elbo` of the subsample ``idx``
    scaled by ``N/|idx|`` (so PDVI's ``|b|/N`` scaling gives ``f_b`` back, and
    :class:`pyro.infer.SVI` steps with it are unbiased for whole-patch subsamples drawn
    uniformly). Potts edges count when both ends are in ``idx``.

    :param data: ``(N, d)``.
    :param prior: the hyperparameters.
    :param graph: the symmetric graph (restricted to the PD-VI patches).
    :param kwargs: initial values, see :class:`~pyro_pdvi.models.gmm.GMMModel`.
    """

    def __init__(self, data: torch.Tensor, prior: GMMPrior, graph: SpatialGraph, **kwargs) -> None:
        super().__init__(data, prior, **kwargs)
        if graph.num_rows != data.shape[0] or graph.num_cols != data.shape[0]:
            raise ValueError(
                f"graph must be square over the N = {data.shape[0]} spots, "
                f"got {graph.num_rows} x {graph.num_cols}"
            )
        self.graph = graph.to(data.device, data.dtype)

    def loss(self, model, guide, idx: torch.Tensor | None = None) -> torch.Tensor:
        """``N/|idx| * f_idx`` at the guide's current (or PDVI-overridden) params."""
        trace = poutine.trace(guide).get_trace(idx)
        names = SITE_NAMES
        m, rho, alpha = (trace.nodes[name]["value"] for name in names)
        indices = trace.nodes["data"]["value"].to(self.data.device)
        if alpha.shape[0] != indices.numel():  # the trace holds the full param, not the plate's slice
            alpha = alpha.index_select(0, indices)
        data = self.data[indices]
        subgraph = self.graph.subgraph(indices)
        f_b = block_negative_elbo(data, self.prior, subgraph, m, rho, alpha, self.num_data)
        return f_b * (self.num_data / indices.numel())

    def negative_elbo(self, m: torch.Tensor, rho: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        """The full objective :func:`negative_elbo` on this model's data and graph."""
        return negative_elbo(self.data, self.prior, self.graph, m, rho, alpha)
