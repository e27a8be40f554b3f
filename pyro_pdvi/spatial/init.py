"""Where a Potts-mixture fit starts: labels of a Gaussian mixture of neighbour-averaged
features, and a Potts weight estimated from those labels.

Mean-field coordinate ascent only polishes the labels it starts from [1, App. C.1]: started
from k-means of the spots' own features (the defaults before issue 12) it ended at ARI 0.71 on
the 15k-spot Potts tissue of ``docs/benchmarks.md`` (section 7), below a Gaussian mixture of
neighbour-averaged features (0.84). So the start is a mixture of features averaged over each
spot and its nearest neighbours (:func:`neighbour_average`, the smoothing of BANKSY [2] with
all weight on the neighbourhood), which separates domains that overlap spot by spot, and the
fit itself then runs on the spots' own features, where the Potts prior does the spatial
pooling.

* :func:`mixture_labels`: a diagonal Gaussian mixture by EM, started from k-means with three
  times as many clusters (greedy k-means++ seeding [3]) merged by Ward's rule [5], the best
  of a few such starts on a subsample refined on all spots;
* :func:`pseudo_likelihood_weight`: the Potts interaction that maximises Besag's
  pseudo-likelihood [4] of the start labels, the default ``potts_weight="auto"``.

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
[2] Singhal et al. (2024), "BANKSY unifies cell typing and tissue domain segmentation for
    scalable spatial omics data analysis", Nature Genetics 56.
[3] Arthur, Vassilvitskii (2007), "k-means++: the advantages of careful seeding", SODA.
[4] Besag (1975), "Statistical analysis of non-lattice data", The Statistician 24(3).
[5] Ward (1963), "Hierarchical grouping to optimize an objective function", JASA 58(301).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..models.potts import SpatialGraph

#: Upper end of the estimated Potts weight: labels that agree with every neighbour have an
#: unbounded pseudo-likelihood estimate.
MAX_POTTS_WEIGHT = 5.0


def neighbour_average(features: torch.Tensor, neighbours: torch.Tensor) -> torch.Tensor:
    """Each spot's features averaged with those of its nearest neighbours.

    :param features: ``(N, d)``.
    :param neighbours: ``(N, k)`` indices of each spot's ``k`` nearest other spots
        (:func:`~pyro_pdvi.spatial.graph.nearest_neighbours`).
    :returns: ``(N, d)``, ``(x_i + sum_l x_l) / (k + 1)``.
    """
    neighbours = neighbours.to(features.device)
    total = features.clone()
    for column in range(neighbours.shape[1]):
        total += features.index_select(0, neighbours[:, column])
    return total / (neighbours.shape[1] + 1)


def _squared_distances(data: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
    """``||x_i - c_k||^2``, ``(N, K)``, by one matrix product (clamped at 0 against rounding)."""
    return (
        data.square().sum(-1, keepdim=True) - 2.0 * data @ centers.T + centers.square().sum(-1)
    ).clamp_min(0.0)


def _greedy_seeding(data: torch.Tensor, num_clusters: int, generator: torch.Generator) -> torch.Tensor:
    """Greedy k-means++ [3]: each new centre is the best of ``2 + log K`` candidates drawn with
    probability proportional to the squared distance to the nearest centre so far."""
    num_candidates = 2 + int(math.log(num_clusters))
    first = int(torch.randint(data.shape[0], (), generator=generator))
    centers = data[first : first + 1]
    closest = _squared_distances(data, centers)[:, 0]
    for _ in range(1, num_clusters):
        weights = closest.double().cpu()
        if not weights.sum() > 0:  # every spot sits on a centre already
            weights = torch.ones_like(weights)
        candidates = torch.multinomial(weights, num_candidates, replacement=True, generator=generator)
        candidates = candidates.to(data.device)
        potentials = torch.minimum(closest[:, None], _squared_distances(data, data[candidates]))
        best = int(potentials.sum(0).argmin())
        centers = torch.cat([centers, data[candidates[best]][None]])
        closest = potentials[:, best]
    return centers


def _lloyd(
    data: torch.Tensor, centers: torch.Tensor, num_iterations: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Lloyd's iterations until the labels settle; an emptied cluster keeps its centre.

    :returns: centres, labels and the inertia ``sum_i ||x_i - c_{z_i}||^2``.
    """
    distances = _squared_distances(data, centers)
    labels = distances.argmin(-1)
    for _ in range(num_iterations):
        one_hot = torch.nn.functional.one_hot(labels, centers.shape[0]).to(data.dtype)
        counts = one_hot.sum(0)
        centers = torch.where(
            counts[:, None] > 0, (one_hot.T @ data) / counts.clamp_min(1.0)[:, None], centers
        )
        distances = _squared_distances(data, centers)
        new_labels = distances.argmin(-1)
        if torch.equal(new_labels, labels):
            break
        labels = new_labels
    inertia = float(distances.gather(1, labels[:, None]).sum())
    return centers, labels, inertia


def _subsample(data: torch.Tensor, sample_size: int, generator: torch.Generator) -> torch.Tensor:
    if data.shape[0] <= sample_size:
        return data
    return data[torch.randperm(data.shape[0], generator=generator)[:sample_size].to(data.device)]


class DiagonalMixture(NamedTuple):
    """A Gaussian mixture with diagonal covariances: ``weights (K,)``, ``means (K, d)``,
    ``variances (K, d)``."""

    weights: torch.Tensor
    means: torch.Tensor
    variances: torch.Tensor

    def log_joint(self, data: torch.Tensor) -> torch.Tensor:
        """``log pi_k + log N(x_i | mu_k, diag(s2_k))``, ``(N, K)``, by two matrix products."""
        precision = self.variances.reciprocal()
        quadratic = (
            data.square() @ precision.T
            - 2.0 * data @ (self.means * precision).T
            + (self.means.square() * precision).sum(-1)
        )
        normalizer = (math.log(2.0 * math.pi) + self.variances.log()).sum(-1)
        return self.weights.log() - 0.5 * (quadratic + normalizer)

    @classmethod
    def fit(cls, data: torch.Tensor, responsibilities: torch.Tensor, floor: float) -> DiagonalMixture:
        """The M-step: maximum-likelihood weights, means and variances (floored) given soft labels."""
        counts = responsibilities.sum(0) + 10.0 * torch.finfo(data.dtype).eps
        means = (responsibilities.T @ data) / counts[:, None]
        second = (responsibilities.T @ data.square()) / counts[:, None]
        variances = (second - means.square()).clamp_min(0.0) + floor
        return cls(counts / counts.sum(), means, variances)


def _expectation_maximisation(
    data: torch.Tensor, labels: torch.Tensor, num_clusters: int, num_iterations: int, tol: float
) -> tuple[DiagonalMixture, float]:
    """EM from hard labels until the mean log-likelihood gains less than ``tol``.

    :returns: the mixture and its mean log-likelihood.
    """
    floor = 1e-6 * float(data.var(0).mean().clamp_min(torch.finfo(data.dtype).tiny))
    responsibilities = torch.nn.functional.one_hot(labels, num_clusters).to(data.dtype)
    mixture = DiagonalMixture.fit(data, responsibilities, floor)
    previous = -math.inf
    for _ in range(num_iterations):
        log_joint = mixture.log_joint(data)
        log_likelihood = torch.logsumexp(log_joint, -1, keepdim=True)
        mean = float(log_likelihood.mean())
        mixture = DiagonalMixture.fit(data, (log_joint - log_likelihood).exp(), floor)
        if mean - previous < tol:
            break
        previous = mean
    return mixture, mean


def ward_merge(centers: torch.Tensor, counts: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Agglomerate clusters by Ward's rule [5] until ``num_groups`` remain: merge the pair whose
    union raises the within-cluster sum of squares least, ``n_a n_b / (n_a + n_b) ||c_a - c_b||^2``.

    :param centers: ``(C, d)`` cluster means.
    :param counts: ``(C,)`` their sizes (empty clusters are merged first, at no cost).
    :param num_groups: K <= C.
    :returns: ``(C,)`` the group in ``range(K)`` of each cluster.
    """
    centers, counts = centers.clone(), counts.to(centers.dtype).clone()
    group = torch.arange(centers.shape[0], device=centers.device)
    alive = torch.ones(centers.shape[0], dtype=torch.bool, device=centers.device)
    for _ in range(centers.shape[0] - num_groups):
        pair_counts = (
            counts[:, None] * counts[None, :] / (counts[:, None] + counts[None, :]).clamp_min(1e-300)
        )
        cost = pair_counts * _squared_distances(centers, centers)
        cost = cost.masked_fill(~(alive[:, None] & alive[None, :]), math.inf).fill_diagonal_(math.inf)
        a, b = divmod(int(cost.argmin()), centers.shape[0])
        total = counts[a] + counts[b]
        if total > 0:
            centers[a] = (counts[a] * centers[a] + counts[b] * centers[b]) / total
        counts[a], alive[b] = total, False
        group[group == b] = a
    return torch.unique(group, return_inverse=True)[1]


def mixture_labels(
    data: torch.Tensor,
    num_clusters: int,
    *,
    num_init: int = 3,
    oversplit: int = 3,
    sample_size: int = 20000,
    lloyd_iterations: int = 10,
    num_iterations: int = 100,
    tol: float = 1e-3,
    seed: int = 0,
) -> torch.Tensor:
    """Labels of a diagonal Gaussian mixture fitted by EM, from a start that does not depend
    on luck: k-means with ``oversplit * K`` clusters (greedy k-means++ [3] and Lloyd's
    iterations), merged to K by Ward's rule (:func:`ward_merge`), then EM; ``num_init`` such
    starts on a random subsample of ``sample_size`` spots, the one of the highest likelihood
    refined by EM on all spots.

    k-means with K clusters splits large domains to balance small ones, and its local optima
    are many: on the synthetic tissue of ``docs/benchmarks.md`` (section 7, 15k spots, seed
    0), eight starts of k-means then EM all ended at a lower likelihood than the merged start,
    and 0.08-0.18 lower in ARI.

    :param data: ``(N, d)``.
    :param num_clusters: K (at most N).
    :param num_init: restarts.
    :param oversplit: clusters per domain before merging.
    :param sample_size: spots the restarts run on (all when N is smaller).
    :param lloyd_iterations: maximum Lloyd iterations of the split (it needs no convergence).
    :param num_iterations: maximum EM iterations per run.
    :param tol: EM stops when the mean log-likelihood gains less (as scikit-learn's).
    :param seed: seed of a private generator (the global one is untouched).
    :returns: ``(N,)`` labels in ``range(K)``, numbered in the order of each label's first spot
        (so that one partition gets the same labels on every device: on a GPU the restarts'
        rounding can pick another restart of the same optimum, its labels permuted).
    """
    generator = torch.Generator().manual_seed(seed)
    sample = _subsample(data, sample_size, generator)
    num_fine = min(oversplit * num_clusters, sample.shape[0])
    best, best_likelihood = None, -math.inf
    for _ in range(num_init):
        centers, labels, _ = _lloyd(sample, _greedy_seeding(sample, num_fine, generator), lloyd_iterations)
        counts = torch.bincount(labels, minlength=num_fine)
        labels = ward_merge(centers, counts, num_clusters)[labels]
        mixture, likelihood = _expectation_maximisation(sample, labels, num_clusters, num_iterations, tol)
        if likelihood > best_likelihood:
            best, best_likelihood = mixture, likelihood
    if sample is not data:
        labels = best.log_joint(data).argmax(-1)
        best, _ = _expectation_maximisation(data, labels, num_clusters, num_iterations, tol)
    return _numbered_by_first_spot(best.log_joint(data).argmax(-1), num_clusters)


def _numbered_by_first_spot(labels: torch.Tensor, num_labels: int) -> torch.Tensor:
    """The same partition, its labels renumbered in the order of their first spot (labels no
    spot carries come last, in their old order)."""
    spots = torch.arange(len(labels), device=labels.device)
    first = torch.full((num_labels,), len(labels), dtype=torch.long, device=labels.device)
    first = first.scatter_reduce(0, labels, spots, reduce="amin")
    new_label = torch.empty_like(first)
    new_label[first.argsort(stable=True)] = torch.arange(num_labels, device=labels.device)
    return new_label[labels]


def pseudo_likelihood_weight(
    graph: SpatialGraph,
    labels: torch.Tensor,
    num_labels: int,
    max_weight: float = MAX_POTTS_WEIGHT,
    sample_size: int = 20000,
    seed: int = 0,
) -> float:
    """The Potts interaction ``beta`` that maximises Besag's pseudo-likelihood [4] of labels on
    a graph with edge weights ``beta * w_ij``::

        PL(beta) = sum_i [ beta n_i(z_i) - log sum_k exp(beta n_i(k)) ],
        n_i(k) = sum_j w_ij 1[z_j = k]

    a concave function of ``beta``, maximised by safeguarded Newton steps on ``[0, max_weight]``.

    :param graph: the neighbour graph (its weights ``w_ij`` give the shape of the interaction).
    :param labels: ``(N,)`` labels in ``range(num_labels)``.
    :param num_labels: K.
    :param max_weight: the estimate's upper end (reached when labels agree with nearly every
        neighbour, where the maximiser runs off to infinity).
    :param sample_size: spots whose terms are summed (a random subset when N is larger: the
        sum is then an unbiased estimate of ``PL`` up to the factor ``N / sample_size``).
    :param seed: seed of the subset.
    :returns: the estimate, a float in ``[0, max_weight]``.
    """
    labels = labels.to(graph.indptr.device).long()
    rows = torch.arange(labels.numel(), device=labels.device)
    if labels.numel() > sample_size:
        generator = torch.Generator().manual_seed(seed)
        rows = (
            torch.randperm(labels.numel(), generator=generator)[:sample_size].to(labels.device).sort().values
        )
    one_hot = torch.nn.functional.one_hot(labels, num_labels).to(graph.weights.dtype)
    counts = graph.rows(rows).neighbour_sum(one_hot).double()
    own = counts.gather(1, labels[rows, None])[:, 0]
    low, high, beta = 0.0, max_weight, 1.0
    for _ in range(50):
        probs = torch.softmax(beta * counts, -1)
        mean = (probs * counts).sum(-1)
        gradient = float((own - mean).sum())
        curvature = float((probs * (counts - mean[:, None]).square()).sum())
        if gradient > 0:
            low = beta
        else:
            high = beta
        step = beta + gradient / curvature if curvature > 0 else math.inf
        beta = step if low < step < high else 0.5 * (low + high)
        if high - low < 1e-6 or abs(gradient) < 1e-9 * max(1.0, curvature):
            break
    return float(min(max(beta, 0.0), max_weight))
