"""Synthetic spatial data with known domains: Potts labels on spots, Gaussian features.

The domains are drawn by Gibbs sampling of the Potts model
``p(zeta) ∝ exp(beta sum_{(i,j) in E} r_ij 1[zeta_i = zeta_j])`` [1, App. C.1], done colour
class by colour class (:meth:`~pyro_pdvi.spatial.graph.SpatialGraph.colour_classes`), so that
each class is updated exactly from its conditional and the kernel leaves the Potts law
invariant (:func:`gibbs_sweeps`). Started from uniform labels at ``beta`` above the critical
value, a finite number of sweeps gives coarsening domains whose size grows with the sweeps:
the truth is the chain's last state, a draw from the chain after that many sweeps rather than
from the equilibrium law (which above criticality is one label almost everywhere).

Domains of tissue size cost many fine sweeps, so :func:`make_potts_data` runs the
coarsening on a coarse square lattice (4 neighbours, ``spacing`` spots apart), gives every
spot the label of its nearest lattice node, and then smooths the blocky boundaries with a few
Gibbs sweeps on the spots' own kNN graph. Features are ``x_i ~ N(c_{zeta_i}, I)`` with centres
``c_k ~ N(0, separation^2 I)``, exactly the mixture of [1, App. C.1] given the labels.

:func:`make_irregular_data` draws the same features on domains that no Potts model drew:
Voronoi cells of random seeds, several cells per domain, or layers with wavy boundaries
across the tissue (a cortex-like section), so that a fit is not judged only on data from
its own prior.

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from ..checks import check_positive_int
from ..models.gmm import GMMPrior
from ..models.potts import SpatialGraph
from .graph import knn_graph


def critical_beta(num_states: int) -> float:
    """``log(1 + sqrt(K))``, the critical inverse temperature of the K-state Potts model on
    the square lattice with 4 neighbours (Baxter 1973)."""
    return math.log1p(math.sqrt(num_states))


@torch.no_grad()
def gibbs_sweeps(
    graph: SpatialGraph,
    labels: torch.Tensor,
    num_states: int,
    beta: float,
    num_sweeps: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Gibbs sweeps of the Potts model ``p(zeta) ∝ exp(beta sum_{i<j} r_ij 1[zeta_i = zeta_j])``.

    Every colour class (independent set) is redrawn at once from its exact conditional
    ``p(zeta_i = k | rest) ∝ exp(beta sum_l r_il 1[zeta_l = k])``.

    :param graph: symmetric graph with weights ``r_ij``.
    :param labels: ``(N,)`` LongTensor in ``range(num_states)``, the start.
    :param num_states: K.
    :param beta: inverse temperature (>= 0).
    :param num_sweeps: sweeps over all classes.
    :param generator: torch generator (on CPU) for the draws.
    :returns: the labels after the sweeps (a new tensor).
    """
    if not beta >= 0:
        raise ValueError(f"Invalid beta: {beta}; use a non-negative float")
    labels = labels.clone()
    classes = [(nodes, graph.rows(nodes)) for nodes in graph.colour_classes(strategy="rounds")]
    for _ in range(num_sweeps):
        for nodes, rows in classes:
            one_hot = torch.nn.functional.one_hot(labels, num_states).to(graph.weights.dtype)
            probs = torch.softmax(beta * rows.neighbour_sum(one_hot), -1)
            labels[nodes] = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return labels


def lattice_graph(num_x: int, num_y: int, weight: float = 1.0) -> SpatialGraph:
    """The ``num_x x num_y`` square lattice with 4 neighbours; node ``ix * num_y + iy``."""
    import scipy.sparse

    def path(n: int):
        return scipy.sparse.diags([np.ones(n - 1), np.ones(n - 1)], [-1, 1], shape=(n, n))

    adjacency = scipy.sparse.kron(path(num_x), scipy.sparse.identity(num_y)) + scipy.sparse.kron(
        scipy.sparse.identity(num_x), path(num_y)
    )
    return SpatialGraph.from_scipy(weight * adjacency.tocsr(), dtype=torch.float64)


class PottsData(NamedTuple):
    """What :func:`make_potts_data` returns.

    :param coords: ``(N, 2)`` spot coordinates.
    :param data: ``(N, d)`` features.
    :param labels: ``(N,)`` true domains.
    :param centers: ``(K, d)`` true centres.
    :param prior: the true mixture hyperparameters (``xi = 0``, ``sigma0 = 1``,
        ``sigma1 = separation``).
    """

    coords: torch.Tensor
    data: torch.Tensor
    labels: torch.Tensor
    centers: torch.Tensor
    prior: GMMPrior


def make_potts_data(
    num_spots: int,
    num_domains: int,
    dim: int,
    *,
    layout: str = "scattered",
    spacing: float | None = None,
    beta: float | None = None,
    coarse_sweeps: int = 20,
    refine_sweeps: int = 4,
    refine_beta: float | None = None,
    num_neighbors: int = 6,
    separation: float = 1.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> PottsData:
    """Spots with Potts-distributed domains and Gaussian features (module docstring).

    :param num_spots: N (a lattice layout rounds it to ``ceil(sqrt(N))^2`` cut back to N).
    :param num_domains: K.
    :param dim: d.
    :param layout: ``"scattered"`` (uniform spots in a square, mean spacing 1) or ``"lattice"``.
    :param spacing: coarse-lattice spacing in spot units (the scale of domain detail);
        default ``sqrt(N) / 24``, so that the tissue looks alike at every N.
    :param beta: inverse temperature of the coarse sweeps; default ``1.1 * critical_beta(K)``.
    :param coarse_sweeps: Gibbs sweeps on the coarse lattice (domain size grows with them).
    :param refine_sweeps: Gibbs sweeps on the spots' kNN graph.
    :param refine_beta: their inverse temperature; default ``2 beta``, which smooths the
        blocky boundaries (a kNN graph has more neighbours than the lattice).
    :param num_neighbors: k of the spots' graph used by the refining sweeps.
    :param separation: prior standard deviation of the centres (noise standard deviation 1).
    :param seed: seed of a private generator; the global RNG is untouched.
    :param dtype: dtype of coordinates and features.
    :rtype: PottsData
    """
    for name, value in (
        ("num_spots", num_spots),
        ("num_domains", num_domains),
        ("dim", dim),
        ("num_neighbors", num_neighbors),
    ):
        check_positive_int(value, name)
    for name, value in (("coarse_sweeps", coarse_sweeps), ("refine_sweeps", refine_sweeps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"Invalid {name}: {value!r}; use a non-negative int")
    if layout not in ("scattered", "lattice"):
        raise ValueError(f"Invalid layout: {layout!r}; use 'scattered' or 'lattice'")
    if (spacing is not None and not spacing > 0) or not separation > 0:
        raise ValueError(f"spacing and separation must be positive, got {spacing} and {separation}")
    beta = 1.1 * critical_beta(num_domains) if beta is None else beta
    refine_beta = 2.0 * beta if refine_beta is None else refine_beta
    generator = torch.Generator().manual_seed(seed)
    side = math.sqrt(num_spots)
    spacing = max(side / 24.0, 1.0) if spacing is None else spacing
    if layout == "lattice":
        n = math.ceil(side)
        grid = torch.stack(torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij"), -1).reshape(-1, 2)
        coords = grid[:num_spots].to(dtype)
    else:
        coords = side * torch.rand(num_spots, 2, generator=generator, dtype=dtype)

    coarse_x = max(2, math.ceil(float(coords[:, 0].max()) / spacing) + 1)
    coarse_y = max(2, math.ceil(float(coords[:, 1].max()) / spacing) + 1)
    coarse = lattice_graph(coarse_x, coarse_y)
    start = torch.randint(num_domains, (coarse_x * coarse_y,), generator=generator)
    coarse_labels = gibbs_sweeps(coarse, start, num_domains, beta, coarse_sweeps, generator)
    nearest = (coords / spacing).round().long()
    labels = coarse_labels[nearest[:, 0] * coarse_y + nearest[:, 1]]
    if refine_sweeps and num_spots > num_neighbors:
        graph = knn_graph(coords, num_neighbors, dtype=torch.float64, backend="sparse")
        labels = gibbs_sweeps(graph, labels, num_domains, refine_beta, refine_sweeps, generator)

    prior = GMMPrior(
        xi=torch.zeros(dim, dtype=dtype),
        sigma0_sq=torch.ones(dim, dtype=dtype),
        sigma1_sq=torch.full((dim,), float(separation) ** 2, dtype=dtype),
        num_components=num_domains,
    )
    centers = separation * torch.randn(num_domains, dim, generator=generator, dtype=dtype)
    data = centers[labels] + torch.randn(num_spots, dim, generator=generator, dtype=dtype)
    return PottsData(coords, data, labels, centers, prior)


#: Domain shapes of :func:`make_irregular_data`.
IRREGULAR_KINDS = ("voronoi", "layers")


def make_irregular_data(
    num_spots: int,
    num_domains: int,
    dim: int,
    *,
    kind: str = "voronoi",
    cells_per_domain: int = 3,
    separation: float = 1.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> PottsData:
    """Spots on domains of irregular shape, with the features of :func:`make_potts_data`.

    Spots are uniform in a square of side ``sqrt(N)`` (mean spacing 1).

    * ``"voronoi"``: ``cells_per_domain * K`` seeds uniform in the square; a spot's domain is
      that of its nearest seed, the seeds' domains a random permutation of
      ``0, 1, ..., K-1`` repeated, so every domain is a few polygons of different sizes.
    * ``"layers"``: ``K`` bands stacked along ``y``, widths ``~ Dirichlet(3, ..., 3)`` times the
      side, boundaries bent by ``0.08 side sin(3 pi x / side)`` (a cortex-like section).

    :param num_spots: N.
    :param num_domains: K.
    :param dim: d.
    :param kind: one of :data:`IRREGULAR_KINDS`.
    :param cells_per_domain: Voronoi cells per domain.
    :param separation: prior standard deviation of the centres (noise standard deviation 1).
    :param seed: seed of a private generator; the global RNG is untouched.
    :param dtype: dtype of coordinates and features.
    :returns: a :class:`PottsData` (its ``prior`` is the true mixture's).
    """
    for name, value in (
        ("num_spots", num_spots),
        ("num_domains", num_domains),
        ("dim", dim),
        ("cells_per_domain", cells_per_domain),
    ):
        check_positive_int(value, name)
    if kind not in IRREGULAR_KINDS:
        raise ValueError(f"Invalid kind: {kind!r}; use one of {IRREGULAR_KINDS}")
    if not separation > 0:
        raise ValueError(f"separation must be positive, got {separation}")
    generator = torch.Generator().manual_seed(seed)
    side = math.sqrt(num_spots)
    coords = side * torch.rand(num_spots, 2, generator=generator, dtype=torch.float64)
    if kind == "voronoi":
        seeds = side * torch.rand(cells_per_domain * num_domains, 2, generator=generator, dtype=torch.float64)
        domain_of_seed = torch.arange(seeds.shape[0])[torch.randperm(seeds.shape[0], generator=generator)]
        nearest = torch.cdist(coords, seeds).argmin(-1)
        labels = domain_of_seed[nearest] % num_domains
    else:
        # Gamma(3, 1) widths as sums of three Exp(1) draws: normalised, Dirichlet(3, ..., 3).
        widths = -torch.rand(num_domains, 3, generator=generator, dtype=torch.float64).log().sum(1)
        edges = side * (widths.cumsum(0) / widths.sum())[:-1]
        height = coords[:, 1] + 0.08 * side * torch.sin(3 * math.pi * coords[:, 0] / side)
        labels = torch.searchsorted(edges, height.contiguous())
    prior = GMMPrior(
        xi=torch.zeros(dim, dtype=dtype),
        sigma0_sq=torch.ones(dim, dtype=dtype),
        sigma1_sq=torch.full((dim,), float(separation) ** 2, dtype=dtype),
        num_components=num_domains,
    )
    centers = separation * torch.randn(num_domains, dim, generator=generator, dtype=dtype)
    data = centers[labels] + torch.randn(num_spots, dim, generator=generator, dtype=dtype)
    return PottsData(coords.to(dtype), data, labels, centers, prior)
