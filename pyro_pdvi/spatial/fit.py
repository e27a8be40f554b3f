"""Fitting the Potts mixture [1, App. C.1] on fixed spatial patches: P2D-VI, PD-VI or SVI.

:func:`fit_potts_mixture` takes features and coordinates (tensors), builds the kNN graph and
the patches, initialises as the paper does (k-means labels; ``Sigma_0`` from the
within-cluster variance, ``Sigma_1`` from the spread of the cluster means, ``xi`` the data
mean: :func:`~pyro_pdvi.models.gmm.prior_from_data`), and runs

* ``"p2dvi"``: :class:`~pyro_pdvi.PDVI` with :class:`~pyro_pdvi.models.potts.PottsBlockSolver`,
  one step size per global site (``m`` and ``rho``) from their curvatures (below);
* ``"pdvi"``: the same with one step size for both, the smaller (that of ``m``);
* ``"svi"``: :class:`pyro.infer.SVI` with Adam on the same exact objective, one patch per step.

One epoch is one pass over the patches in a random order, one patch per step (``m = 1`` as
in both of the paper's experiments), with the paper's global update.

Step sizes: ``eta_j = eta_scale / L_j`` [1, Thm. 4.7] with ``L_j`` the largest diagonal
curvature of a patch objective ``f_b`` in group ``j`` at the initial point, which has a
closed form: ``N_kb / sigma0_j^2 + w_b / sigma1_j^2`` for ``m_kj`` and
``(N_kb / sigma0_j^2 + w_b / sigma1_j^2) exp(rho_kj) / 2`` for ``rho_kj`` (``N_kb`` the
k-means count of component k in patch b, ``w_b = |b|/N``). The first is of the order of the
patch size, the second below one: the heterogeneity P2D-VI is made for.

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pyro
import torch
from pyro.infer import SVI

from ..infer import PDVI
from ..metrics import adjusted_rand_index
from ..models.gmm import GMMPrior, kmeans, prior_from_data
from ..models.potts import PottsBlockSolver, PottsGMMModel, SpatialGraph, potts_negative_elbo
from .graph import grid_patches, knn_graph

METHODS = ("p2dvi", "pdvi", "svi")


@dataclass
class SpatialFit:
    """What :func:`fit_potts_mixture` returns.

    :param labels: ``(N,)`` most probable domain of each spot.
    :param probabilities: ``(N, K)`` mean-field posteriors ``phi``.
    :param m: ``(K, d)`` variational means of the domain centres.
    :param rho: ``(K, d)`` their log-variances.
    :param prior: the hyperparameters used.
    :param graph: the patch-restricted graph (the objective's).
    :param patches: the PD-VI blocks.
    :param step_sizes: ``eta`` per global site (PD-VI methods).
    :param history: per epoch (index 0: the start) ``epoch``, ``seconds`` (cumulative, fitting
        only), ``objective`` (:func:`~pyro_pdvi.models.potts.potts_negative_elbo`), ``grad_norm``
        (``||grad_lambda objective||`` at the consensus), ``ari`` when a truth was given, and
        ``temperature`` (epochs 1.., when annealing).
    """

    labels: torch.Tensor
    probabilities: torch.Tensor
    m: torch.Tensor
    rho: torch.Tensor
    prior: GMMPrior
    graph: SpatialGraph
    patches: list[torch.Tensor]
    step_sizes: dict[str, float] = field(default_factory=dict)
    history: dict[str, list[float]] = field(default_factory=dict)


def curvature_step_sizes(
    prior: GMMPrior,
    labels: torch.Tensor,
    patches: list[torch.Tensor],
    rho: torch.Tensor,
    eta_scale: float = 1.0,
) -> dict[str, float]:
    """``eta_m`` and ``eta_rho`` from the closed-form patch curvatures (module docstring)."""
    num_data = labels.numel()
    worst_m = worst_rho = 0.0
    for patch in patches:
        counts = torch.bincount(labels[patch.to(labels.device)], minlength=prior.num_components)
        curvature = (
            counts.to(rho.dtype)[:, None] / prior.sigma0_sq + (len(patch) / num_data) / prior.sigma1_sq
        )
        worst_m = max(worst_m, float(curvature.max()))
        worst_rho = max(worst_rho, float((0.5 * curvature * rho.exp()).max()))
    return {"m": eta_scale / worst_m, "rho": eta_scale / worst_rho}


def _initial_state(
    features: torch.Tensor, prior: GMMPrior, labels: torch.Tensor, smoothing: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_components = prior.num_components
    one_hot = torch.nn.functional.one_hot(labels, num_components).to(features.dtype)
    phi = (1.0 - smoothing) * one_hot + smoothing / num_components
    counts = phi.sum(0)[:, None]
    precision = counts / prior.sigma0_sq + prior.sigma1_sq.reciprocal()
    m = prior.xi + (phi.T @ (features - prior.xi)) / prior.sigma0_sq / precision
    return m, -precision.log(), phi.log()


def fit_potts_mixture(
    features: torch.Tensor,
    coords: torch.Tensor,
    num_domains: int,
    *,
    method: str = "p2dvi",
    potts_weight: float = 1.0,
    num_neighbors: int = 6,
    bandwidth: float | None = None,
    num_patches: int = 25,
    num_epochs: int = 20,
    num_sweeps: int = 10,
    newton_steps: int = 5,
    eta_scale: float = 1.0,
    step_sizes: dict[str, float] | None = None,
    lr: float = 0.05,
    prior: GMMPrior | None = None,
    init_labels: torch.Tensor | None = None,
    init_smoothing: float = 0.1,
    anneal: tuple[float, int] | None = None,
    truth: torch.Tensor | None = None,
    record: bool = True,
    seed: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float64,
    callback: Callable[[int, dict], None] | None = None,
) -> SpatialFit:
    """Fit the Potts mixture of [1, App. C.1] to spots (see the module docstring).

    :param features: ``(N, d)`` expression features (e.g. PCA scores).
    :param coords: ``(N, 2)`` spot coordinates.
    :param num_domains: K.
    :param method: one of :data:`METHODS`.
    :param potts_weight: the interaction ``r`` of every edge (0: the plain mixture).
    :param num_neighbors: k of the kNN graph (mutual neighbours are joined).
    :param bandwidth: distance decay of the edge weights (``None``: constant).
    :param num_patches: number of fixed spatial patches (PD-VI blocks).
    :param num_epochs: passes over the patches.
    :param num_sweeps: coordinate-descent sweeps per patch solve.
    :param newton_steps: Newton steps on ``rho`` per sweep.
    :param eta_scale: the constant of ``eta_j = eta_scale / L_j``.
    :param step_sizes: ``{"m": eta_m, "rho": eta_rho}`` to override the curvature rule.
    :param lr: Adam learning rate for ``method="svi"``.
    :param prior: hyperparameters; default from the k-means labels as in the paper.
    :param init_labels: initial labels ``(N,)``; default k-means (seeded by ``seed``).
    :param init_smoothing: initial ``phi = (1 - s) onehot(labels) + s / K``.
    :param anneal: ``(T0, E)``: optional temperature annealing of ``phi`` for the PD-VI
        methods, ``T = 1 + (T0 - 1) (1 - (e - 1) / E)`` in epoch ``e <= E``, then 1 (see
        :class:`~pyro_pdvi.models.potts.PottsBlockSolver`); ``None``: none.
    :param truth: true labels, to record the ARI per epoch.
    :param record: compute the objective and gradient norm after every epoch.
    :param seed: seed of k-means and of the patch order.
    :param device: where to fit (``"cuda"`` for a GPU); default the features' device.
    :param dtype: floating dtype of the fit.
    :param callback: called as ``callback(epoch, history_row)`` after every recorded epoch.
    :rtype: SpatialFit
    """
    if method not in METHODS:
        raise ValueError(f"Invalid method: {method!r}; use one of {METHODS}")
    if isinstance(num_domains, bool) or not isinstance(num_domains, int) or num_domains < 1:
        raise ValueError(f"Invalid num_domains: {num_domains!r}; use a positive int")
    features = torch.as_tensor(features)
    coords = torch.as_tensor(coords)
    if features.dim() != 2 or coords.dim() != 2 or coords.shape[0] != features.shape[0]:
        raise ValueError(
            f"features must be (N, d) and coords (N, 2) with the same N, got {tuple(features.shape)} "
            f"and {tuple(coords.shape)}"
        )
    if not potts_weight >= 0:
        raise ValueError(f"Invalid potts_weight: {potts_weight}; use a non-negative float")
    if anneal is not None and not (len(anneal) == 2 and anneal[0] >= 1 and int(anneal[1]) >= 1):
        raise ValueError(f"Invalid anneal: {anneal!r}; use (T0 >= 1, number of epochs >= 1) or None")
    device = features.device if device is None else torch.device(device)
    features = features.to(device, dtype)

    patches = grid_patches(coords, num_patches)
    graph = knn_graph(coords, num_neighbors, potts_weight, bandwidth, dtype=dtype).restrict(patches)
    graph = graph.to(device, dtype)
    if init_labels is None:
        _, init_labels = kmeans(features, num_domains, seed=seed)
    init_labels = torch.as_tensor(init_labels).to(device).long()
    prior = prior_from_data(features, num_domains, init_labels) if prior is None else prior
    prior = prior.to(dtype, device)
    m, rho, alpha = _initial_state(features, prior, init_labels, init_smoothing)
    steps = (
        dict(step_sizes)
        if step_sizes is not None
        else curvature_step_sizes(prior, init_labels, patches, rho, eta_scale)
    )
    if method == "pdvi" and step_sizes is None:
        steps["rho"] = steps["m"] = min(steps.values())

    pyro.clear_param_store()
    model = PottsGMMModel(features, prior, graph, init_means=m, init_log_variances=rho, init_logits=alpha)
    if method == "svi":
        algorithm = SVI(model.model, model.guide, pyro.optim.Adam({"lr": lr}), model.loss)
    else:
        solver = PottsBlockSolver(features, prior, graph, num_sweeps, newton_steps)
        algorithm = PDVI(
            model.model,
            model.guide,
            pyro.optim.Adam({"lr": lr}),  # unused: the local solver does the primal step
            model.loss,
            blocks=patches,
            eta=steps["m"],
            groups=[{"sites": ["rho"], "eta": steps["rho"]}],
            solver=solver,
        )

    history: dict[str, list[float]] = {"epoch": [], "seconds": [], "objective": [], "grad_norm": []}
    if truth is not None:
        history["ari"] = []
    temperatures: list[float] = []

    def current() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        store = pyro.get_param_store()
        if "m" not in store:
            return m, rho, alpha
        return store["m"].detach(), store["rho"].detach(), store["alpha"].detach()

    def log(epoch: int, seconds: float) -> None:
        m_now, rho_now, alpha_now = current()
        params = [m_now.clone().requires_grad_(), rho_now.clone().requires_grad_()]
        objective = potts_negative_elbo(features, prior, graph, *params, alpha_now)
        gradients = torch.autograd.grad(objective, params)
        row = {
            "epoch": epoch,
            "seconds": seconds,
            "objective": float(objective.detach()),
            "grad_norm": float(torch.cat([g.flatten() for g in gradients]).norm()),
        }
        if truth is not None:
            row["ari"] = adjusted_rand_index(truth, alpha_now.argmax(-1))
        for key, value in row.items():
            history[key].append(value)
        if callback is not None:
            callback(epoch, row)

    if record:
        log(0, 0.0)

    def set_temperature(epoch: int) -> None:
        if anneal is not None and method != "svi":
            solver.temperature = 1.0 + (anneal[0] - 1.0) * max(0.0, 1.0 - (epoch - 1) / int(anneal[1]))
            temperatures.append(solver.temperature)

    clock = {"start": time.perf_counter(), "seconds": 0.0}

    def after_epoch(epoch: int, loss: float | None = None) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        clock["seconds"] += time.perf_counter() - clock["start"]
        if record:
            log(epoch, clock["seconds"])
        if epoch < num_epochs:
            set_temperature(epoch + 1)
        clock["start"] = time.perf_counter()

    set_temperature(1)
    clock["start"] = time.perf_counter()
    if method == "svi":
        generator = torch.Generator().manual_seed(seed)
        for epoch in range(1, num_epochs + 1):
            for b in torch.randperm(len(patches), generator=generator).tolist():
                # SVI slices the local params by the subsample on their device.
                algorithm.step(patches[b].to(device))
            after_epoch(epoch)
    else:
        # PDVI's own generator (the patch order) is seeded from torch's: seed it from `seed`
        # without touching the caller's random state.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            algorithm.run(num_epochs, progress_bar=False, callback=after_epoch)

    if temperatures:
        history["temperature"] = temperatures
    m_now, rho_now, alpha_now = current()
    probabilities = torch.softmax(alpha_now, -1)
    return SpatialFit(
        labels=probabilities.argmax(-1),
        probabilities=probabilities,
        m=m_now,
        rho=rho_now,
        prior=prior,
        graph=graph,
        patches=patches,
        step_sizes=steps if method != "svi" else {},
        history=history,
    )
