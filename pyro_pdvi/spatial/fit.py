"""Fitting the Potts mixture [1, App. C.1] on fixed spatial patches: P2D-VI, PD-VI or SVI.

:func:`fit_potts_mixture` takes features and coordinates (tensors) and

1. finds each spot's nearest neighbours and the kNN graph of the Potts prior;
2. starts from a Gaussian mixture of neighbour-averaged features and estimates the Potts
   weight from its labels by pseudo-likelihood (:mod:`~pyro_pdvi.spatial.init`); the prior
   is set from the start labels as the paper does (``Sigma_0`` from the within-cluster
   variance, ``Sigma_1`` from the spread of the cluster means, ``xi`` the data mean:
   :func:`~pyro_pdvi.models.gmm.prior_from_data`);
3. cuts the tissue into patches (one per 10,000 spots by default,
   :func:`~pyro_pdvi.spatial.graph.default_num_patches`) and runs

   * ``"p2dvi"``: :class:`~pyro_pdvi.PDVI` with :class:`~pyro_pdvi.models.potts.PottsBlockSolver`
     and a step size per coordinate of ``m`` and ``rho`` from the closed-form patch
     curvatures (:mod:`~pyro_pdvi.spatial.steps`);
   * ``"pdvi"``: the same with one step size for all, the smallest;
   * ``"svi"``: :class:`pyro.infer.SVI` with Adam on the same exact objective, one patch per step;

   one epoch being one pass over the patches in a random order, one patch per step (``m = 1``
   as in both of the paper's experiments), with the paper's global update, until an epoch
   changes the objective by at most ``tol`` of its size (:mod:`~pyro_pdvi.spatial.monitor`).

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import pyro
import torch
from pyro.infer import SVI

from ..infer import PDVI
from ..models.gmm import GMMPrior, prior_from_data
from ..models.potts import PottsBlockSolver, PottsGMMModel, SpatialGraph
from .checks import check_count, check_non_negative_number
from .graph import default_num_patches, grid_patches, knn_graph, nearest_neighbours
from .init import mixture_labels, neighbour_average, pseudo_likelihood_weight
from .monitor import FitMonitor
from .steps import coordinate_step_sizes

METHODS = ("p2dvi", "pdvi", "svi")


@dataclass
class SpatialFit:
    """What :func:`fit_potts_mixture` returns.

    :param labels: ``(N,)`` most probable domain of each spot.
    :param probabilities: ``(N, K)`` mean-field posteriors ``phi``.
    :param m: ``(K, d)`` variational means of the domain centres.
    :param rho: ``(K, d)`` their log-variances.
    :param prior: the hyperparameters used.
    :param graph: the patch-restricted graph with the Potts weights (the objective's).
    :param patches: the PD-VI blocks.
    :param potts_weight: the Potts interaction ``r`` used (estimated when ``"auto"``).
    :param init_labels: ``(N,)`` the labels the fit started from.
    :param step_sizes: ``eta`` per global site (PD-VI methods).
    :param grad_norm: ``||grad_lambda objective||`` at the end (the paper's Fig. 4 measure).
    :param converged: whether the last epoch changed the objective by at most ``tol``.
    :param warnings: what went wrong, each with its fix (unconverged, objective rose).
    :param timings: seconds of ``graph`` (neighbours, kNN graph), ``start`` (neighbour
        averaging, mixture, Potts weight), ``setup`` (patches, prior, solver), ``epochs`` (the
        passes over the patches), ``monitor`` (the per-epoch objective and gradient) and
        ``total``.
    :param history: per epoch (index 0: the start) ``epoch``, ``seconds`` (cumulative, fitting
        only), ``objective`` (:func:`~pyro_pdvi.models.potts.potts_negative_elbo`), ``grad_norm``,
        ``changed`` (share of labels that changed in the epoch), ``ari`` when a truth was given,
        and ``temperature`` (epochs 1.., when annealing).
    """

    labels: torch.Tensor
    probabilities: torch.Tensor
    m: torch.Tensor
    rho: torch.Tensor
    prior: GMMPrior
    graph: SpatialGraph
    patches: list[torch.Tensor]
    potts_weight: float
    init_labels: torch.Tensor
    step_sizes: dict[str, float] = field(default_factory=dict)
    grad_norm: float = float("nan")
    converged: bool = False
    history: dict[str, list[float]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)


def initial_state(
    features: torch.Tensor, prior: GMMPrior, labels: torch.Tensor, smoothing: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q(c)`` given ``phi = (1 - s) onehot(labels) + s / K`` (conjugate), and ``log phi``."""
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
    potts_weight: float | str = "auto",
    num_neighbors: int = 6,
    bandwidth: float | None = None,
    num_patches: int | str = "auto",
    num_epochs: int = 200,
    tol: float = 1e-6,
    num_sweeps: int = 2,
    newton_steps: int = 5,
    eta_scale: float = 1.0,
    step_sizes: dict[str, float] | None = None,
    lr: float = 0.05,
    prior: GMMPrior | None = None,
    init_labels: torch.Tensor | None = None,
    init_smoothing: float = 0.1,
    anneal: tuple[float, int] | None = None,
    truth: torch.Tensor | None = None,
    seed: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float64,
    callback: Callable[[int, dict], None] | None = None,
    warn: bool = True,
) -> SpatialFit:
    """Fit the Potts mixture of [1, App. C.1] to spots (see the module docstring).

    :param features: ``(N, d)`` expression features (e.g. PCA scores), finite.
    :param coords: ``(N, 2)`` spot coordinates.
    :param num_domains: K (an int, numpy ints too).
    :param method: one of :data:`METHODS`.
    :param potts_weight: the interaction ``r`` of every edge; ``"auto"`` (default): the
        pseudo-likelihood estimate from the start labels
        (:func:`~pyro_pdvi.spatial.init.pseudo_likelihood_weight`); 0: the plain mixture.
    :param num_neighbors: k of the kNN graph (mutual neighbours are joined) and of the
        neighbour averaging of the start.
    :param bandwidth: distance decay of the edge weights (``None``: constant).
    :param num_patches: number of fixed spatial patches (PD-VI blocks); ``"auto"``:
        :func:`~pyro_pdvi.spatial.graph.default_num_patches`.
    :param num_epochs: the most passes over the patches.
    :param tol: stop when an epoch changes the objective by at most ``tol`` times its size
        (0: run all ``num_epochs``).
    :param num_sweeps: coordinate-descent sweeps per patch solve.
    :param newton_steps: Newton steps on ``rho`` per sweep.
    :param eta_scale: the constant of ``eta_j = eta_scale / L_j``.
    :param step_sizes: ``{"m": eta_m, "rho": eta_rho}`` to override the curvature rule.
    :param lr: Adam learning rate for ``method="svi"``.
    :param prior: hyperparameters; default from the start labels as in the paper.
    :param init_labels: start labels ``(N,)``; default k-means of the neighbour-averaged
        features (seeded by ``seed``).
    :param init_smoothing: the start's ``phi = (1 - s) onehot(labels) + s / K``.
    :param anneal: ``(T0, E)``: optional temperature annealing of ``phi`` for the PD-VI
        methods, ``T = 1 + (T0 - 1) (1 - (e - 1) / E)`` in epoch ``e <= E``, then 1 (see
        :class:`~pyro_pdvi.models.potts.PottsBlockSolver`); ``None``: none.
    :param truth: true labels, to record the ARI per epoch.
    :param seed: seed of k-means and of the patch order.
    :param device: where to fit (``"cuda"`` for a GPU); default the features' device.
    :param dtype: floating dtype of the fit.
    :param callback: called as ``callback(epoch, history_row)`` after every epoch (and
        with epoch 0 for the start).
    :param warn: warn when the fit ends unconverged or its objective rose (the messages are
        also in :attr:`SpatialFit.warnings`).
    :rtype: SpatialFit
    """
    features = torch.as_tensor(features)
    coords = torch.as_tensor(coords)
    if features.dim() != 2 or coords.dim() != 2 or coords.shape[0] != features.shape[0]:
        raise ValueError(
            f"features must be (N, d) and coords (N, 2) with the same N, got {tuple(features.shape)} "
            f"and {tuple(coords.shape)}"
        )
    num_spots = features.shape[0]
    for name, values in (("features", features), ("coords", coords)):
        bad = ~torch.isfinite(values).all(1)
        if bool(bad.any()):
            raise ValueError(
                f"{name} has NaN or inf in {int(bad.sum())} of {num_spots} spots (the first at "
                f"{bad.nonzero()[:5, 0].tolist()}); drop or impute those spots first"
            )
    if method not in METHODS:
        raise ValueError(f"Invalid method: {method!r}; use one of {METHODS}")
    num_domains = check_count(num_domains, "num_domains", 1, num_spots, "N, the number of spots")
    if not (isinstance(potts_weight, str) and potts_weight == "auto"):
        potts_weight = check_non_negative_number(potts_weight, "potts_weight")
    if not (isinstance(num_patches, str) and num_patches == "auto"):
        num_patches = check_count(num_patches, "num_patches", 1, num_spots, "N, the number of spots")
    num_epochs = check_count(num_epochs, "num_epochs", 1)
    num_neighbors = check_count(num_neighbors, "num_neighbors", 1, num_spots - 1, "N - 1")
    tol = check_non_negative_number(tol, "tol")
    if anneal is not None and not (len(anneal) == 2 and anneal[0] >= 1 and int(anneal[1]) >= 1):
        raise ValueError(f"Invalid anneal: {anneal!r}; use (T0 >= 1, number of epochs >= 1) or None")
    device = features.device if device is None else torch.device(device)
    features = features.to(device, dtype)
    timings: dict[str, float] = {}
    begin = time.perf_counter()
    clock = {"start": begin}

    def lap(name: str) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        timings[name] = now - clock["start"]
        clock["start"] = now

    neighbours = nearest_neighbours(coords, num_neighbors)
    shape = knn_graph(coords, num_neighbors, 1.0, bandwidth, dtype=dtype, neighbours=neighbours)
    lap("graph")
    if init_labels is None:
        smoothed = neighbour_average(features, torch.from_numpy(neighbours[1]))
        init_labels = mixture_labels(smoothed, num_domains, seed=seed)
    init_labels = torch.as_tensor(init_labels).to(device).long()
    if potts_weight == "auto":
        potts_weight = pseudo_likelihood_weight(shape, init_labels, num_domains, seed=seed)
    lap("start")
    num_patches = default_num_patches(num_spots) if num_patches == "auto" else num_patches
    patches = grid_patches(coords, num_patches)
    graph = shape.with_weights(shape.weights * float(potts_weight)).restrict(patches).to(device, dtype)
    prior = prior_from_data(features, num_domains, init_labels) if prior is None else prior
    prior = prior.to(dtype, device)
    m, rho, alpha = initial_state(features, prior, init_labels, init_smoothing)
    if step_sizes is None:
        steps = coordinate_step_sizes(prior, patches, init_labels, rho, eta_scale)
    else:
        steps = {
            k: torch.as_tensor(v, dtype=dtype, device=device).expand_as(m) for k, v in step_sizes.items()
        }
    if method == "pdvi" and step_sizes is None:
        smallest = min(float(v.min()) for v in steps.values())
        steps = {k: torch.full_like(v, smallest) for k, v in steps.items()}

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
            solver=solver,
            groups=[{"sites": [site], "eta": eta, "name": site} for site, eta in steps.items()],
        )

    monitor = FitMonitor(features, prior, graph, tol, truth)
    temperatures: list[float] = []
    lap("setup")

    def current() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        store = pyro.get_param_store()
        if "m" not in store:
            return m, rho, alpha
        return store["m"].detach(), store["rho"].detach(), store["alpha"].detach()

    def set_temperature(epoch: int) -> None:
        if anneal is not None and method != "svi":
            solver.temperature = 1.0 + (anneal[0] - 1.0) * max(0.0, 1.0 - (epoch - 1) / int(anneal[1]))
            temperatures.append(solver.temperature)

    clock["seconds"] = 0.0

    def after_epoch(epoch: int, loss: float | None = None) -> bool:
        """Record the epoch; ``True`` (stop) once converged at temperature 1."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        clock["seconds"] += time.perf_counter() - clock["start"]
        row = monitor.record(epoch, clock["seconds"], *current())
        if callback is not None:
            callback(epoch, row)
        annealing = bool(temperatures) and temperatures[-1] != 1.0
        stop = tol > 0 and not annealing and monitor.converged
        if epoch < num_epochs and not stop:
            set_temperature(epoch + 1)
        clock["start"] = time.perf_counter()
        return stop

    after_epoch(0)  # the start, and the first epoch's temperature
    clock["start"] = time.perf_counter()
    if method == "svi":
        generator = torch.Generator().manual_seed(seed)
        for epoch in range(1, num_epochs + 1):
            for b in torch.randperm(len(patches), generator=generator).tolist():
                # SVI slices the local params by the subsample on their device.
                algorithm.step(patches[b].to(device))
            if after_epoch(epoch):
                break
    else:
        # PDVI's own generator (the patch order) is seeded from torch's: seed it from `seed`
        # without touching the caller's random state.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            algorithm.run(num_epochs, progress_bar=False, callback=after_epoch, check_convergence=False)

    timings["epochs"] = clock["seconds"]
    timings["total"] = time.perf_counter() - begin
    timings["monitor"] = timings["total"] - sum(v for k, v in timings.items() if k != "total")
    history = monitor.history
    if temperatures:
        history["temperature"] = temperatures
    messages = []
    if tol > 0 and method != "svi":
        fixes = {
            "epochs": f"pass num_epochs= above {num_epochs}, or a larger tol=",
            "rise": f"pass eta_scale= below {eta_scale:g} (e.g. half) or fewer patches (num_patches=)",
        }
        messages = monitor.warnings(fixes)
    if warn:
        for message in messages:
            warnings.warn(f"fit_potts_mixture: {message}", stacklevel=2)
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
        potts_weight=float(potts_weight),
        init_labels=init_labels,
        step_sizes=algorithm.step_sizes if method != "svi" else {},
        grad_norm=history["grad_norm"][-1],
        converged=monitor.converged,
        history=history,
        warnings=messages,
        timings=timings,
    )
