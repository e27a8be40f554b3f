"""What the benchmark scripts share.

* Set-up: :func:`setup_torch` (threads, default dtype), :func:`as_a_user_runs`, comma-list
  parsers for ``argparse`` and the ``--eta-scale``/``--curvature-*``/``--remeasure-epochs``
  options of ``eta="auto"`` (:func:`add_step_size_arguments`, :func:`auto_step_size`).
* The Gaussian mixture of [1, App. C.2] with its CAVI optimum (:func:`make_gmm_problem`)
  and the scorer every GMM benchmark judges a fitted ``q(c)`` by (:meth:`GMMProblem.score`):
  the relative gap of the exact negative ELBO to the CAVI optimum with ``q(z)`` re-solved in
  closed form (``optimal_logits``), and W2 to the true mixture as a ratio to the optimum's
  (``fitted_w2``, the paper's Fig. 3); :func:`gmm_pdvi` builds PDVI for it.
* The epoch loop every method runs (:func:`run_epochs`): a fresh param store and seeds, then
  each epoch a fresh random block order drawn from a generator seeded by the run's seed, so
  that Pyro's SVI and PDVI see the same blocks in the same order; the seconds count the steps
  only, not the scoring. (``PDVI.run`` draws its order from PDVI's own generator, which SVI
  does not have, so the benchmarks keep this loop.)
* Reporting: the first-epoch / steady per-epoch cost split (:func:`cost_split`), the first
  epoch a metric reaches a threshold, markdown tables, CSV files, and matplotlib without a
  display (:func:`pyplot`).

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyro
import torch
from pyro.infer import TraceEnum_ELBO

from pyro_pdvi import PDVI, AutoStepSize
from pyro_pdvi.metrics import adjusted_rand_index
from pyro_pdvi.models.gmm import (
    BiasedGMMData,
    CAVIResult,
    GMMModel,
    cavi,
    fitted_w2,
    make_biased_gmm,
    negative_elbo,
    optimal_logits,
)

#: The scores of :meth:`GMMProblem.score`, in order.
SCORE_KEYS = ("w2", "w2_ratio", "gap", "gap_own", "ari")

# --------------------------------------------------------------------------- set-up


def script_parser(doc: str | None) -> argparse.ArgumentParser:
    """A script's parser, with its module docstring as the ``--help`` text."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def setup_torch(threads: int | None = 1, dtype: torch.dtype = torch.float64) -> None:
    """``threads`` torch CPU threads (``None``: torch's default) and ``dtype`` as the default."""
    if threads is not None:
        torch.set_num_threads(threads)
    torch.set_default_dtype(dtype)


@contextlib.contextmanager
def as_a_user_runs(dtype: torch.dtype = torch.float32) -> Iterator[None]:
    """One torch thread, ``dtype`` as the default, warnings silenced; the caller's default dtype
    and warning filters put back after (a test may call the script's ``main``)."""
    torch.set_num_threads(1)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.set_default_dtype(previous_dtype)


def floats(text: str) -> list[float]:
    """A comma list of floats (empty entries skipped)."""
    return [float(v) for v in text.split(",") if v.strip()]


def ints(text: str) -> list[int]:
    """A comma list of ints (empty entries skipped)."""
    return [int(v) for v in text.split(",") if v.strip()]


def names(text: str) -> list[str]:
    """A comma list of names, stripped (empty entries skipped)."""
    return [v.strip() for v in text.split(",") if v.strip()]


def epochs_tuple(text: str) -> tuple[float, ...]:
    """A comma list of epochs as ``AutoStepSize(remeasure_epochs=...)`` takes it."""
    return tuple(floats(text))


def add_step_size_arguments(parser: argparse.ArgumentParser | Any, scale: bool = True) -> None:
    """The options of ``eta=AutoStepSize(...)`` (``scale=False``: a script that has its own
    list of scales)."""
    if scale:
        parser.add_argument(
            "--eta-scale", type=float, default=2.0, help="eta = scale / measured curvature (AutoStepSize)"
        )
    parser.add_argument(
        "--curvature-blocks", type=int, default=4, help="blocks eta='auto' measures (the max is used)"
    )
    parser.add_argument(
        "--curvature-iterations", type=int, default=6, help="power iterations of eta='auto' per block"
    )
    parser.add_argument(
        "--remeasure-epochs",
        type=epochs_tuple,
        default=(),
        help="epochs after which eta='auto' measures again, a comma list (default: none)",
    )


def auto_step_size(args: argparse.Namespace, scale: float | None = None) -> AutoStepSize:
    """``AutoStepSize`` from the options of :func:`add_step_size_arguments`."""
    return AutoStepSize(
        scale=args.eta_scale if scale is None else scale,
        curvature_blocks=args.curvature_blocks,
        curvature_iterations=args.curvature_iterations,
        remeasure_epochs=args.remeasure_epochs,
    )


# --------------------------------------------------------------------------- the GMM and its scorer


def add_gmm_data_arguments(
    parser: argparse.ArgumentParser | Any,
    *,
    num_data: int,
    dim: int,
    block_size: int,
    separation: float,
    purity: bool = True,
) -> None:
    """The options of the biased-block mixture data (``make_biased_gmm``); ``purity=False`` for a
    script with its own (e.g. a list)."""
    parser.add_argument("--num-data", type=int, default=num_data, help="N, data points")
    parser.add_argument("--num-components", type=int, default=5, help="K, mixture components")
    parser.add_argument("--dim", type=int, default=dim, help="d, data dimension")
    parser.add_argument("--block-size", type=int, default=block_size, help="points per fixed block")
    if purity:
        parser.add_argument("--purity", type=float, default=0.95, help="share of a block's dominant cluster")
    parser.add_argument(
        "--separation", type=float, default=separation, help="prior sd of the true centres / noise sd"
    )


@dataclass
class GMMProblem:
    """A biased-block mixture data set, its Pyro model and its CAVI optimum.

    :param synthetic: the data, truth and blocks (``make_biased_gmm``).
    :param gmm: the Pyro model and guide (its initial means are every method's start).
    :param optimum: full-batch CAVI from the same start, run to convergence.
    :param seed: the data, start and block-order seed.
    """

    synthetic: BiasedGMMData
    gmm: GMMModel
    optimum: CAVIResult
    seed: int

    def __post_init__(self) -> None:
        self.cavi_loss = self.negative_elbo(self.optimum.m, self.optimum.rho)
        self.cavi_w2 = self.w2(self.optimum.m, self.optimum.rho)

    @property
    def data(self) -> torch.Tensor:
        return self.synthetic.data

    @property
    def prior(self):
        return self.synthetic.prior

    @property
    def blocks(self) -> list[torch.Tensor]:
        return self.synthetic.blocks

    def w2(self, m: torch.Tensor, rho: torch.Tensor) -> float:
        """W2 between the true mixture and the fitted predictive components."""
        return fitted_w2(self.prior, self.synthetic.centers, m, rho)

    @torch.no_grad()
    def negative_elbo(self, m: torch.Tensor, rho: torch.Tensor, alpha: torch.Tensor | None = None) -> float:
        """The exact negative ELBO; ``q(z)`` re-solved in closed form unless ``alpha`` is given."""
        if alpha is None:
            alpha = optimal_logits(self.data, self.prior, m, rho)
        return float(negative_elbo(self.data, self.prior, m, rho, alpha))

    @torch.no_grad()
    def score(self, m: torch.Tensor, rho: torch.Tensor, own_alpha: torch.Tensor | None = None) -> dict:
        """The metrics of a fitted ``q(c)`` (:data:`SCORE_KEYS`): W2 and its ratio to the CAVI
        optimum's, the relative -ELBO gap to the optimum with ``q(z)`` re-solved and with the
        method's own ``q(z)`` (``own_alpha``; the re-solved one if ``None``), the ARI of
        ``argmax q(z)`` (re-solved) against the true labels."""
        m, rho = m.detach(), rho.detach()
        alpha = optimal_logits(self.data, self.prior, m, rho)
        loss = self.negative_elbo(m, rho, alpha)
        own = loss if own_alpha is None else self.negative_elbo(m, rho, own_alpha.detach())
        w2, scale = self.w2(m, rho), abs(self.cavi_loss)
        return {
            "w2": w2,
            "w2_ratio": w2 / self.cavi_w2,
            "gap": (loss - self.cavi_loss) / scale,
            "gap_own": (own - self.cavi_loss) / scale,
            "ari": adjusted_rand_index(self.synthetic.labels, alpha.argmax(-1)),
        }

    def score_params(self, with_own: bool = False) -> dict:
        """:meth:`score` of the param store's ``m`` and ``rho`` (and ``alpha`` if ``with_own``)."""
        own = pyro.param("alpha") if with_own else None
        return self.score(pyro.param("m"), pyro.param("rho"), own)


def make_gmm_problem(
    num_data: int,
    num_components: int,
    dim: int,
    block_size: int,
    purity: float,
    seed: int,
    separation: float = 1.0,
    device: str | torch.device = "cpu",
    cavi_iterations: int = 5000,
) -> GMMProblem:
    """``make_biased_gmm`` on ``device``, ``GMMModel`` (initial means: K data points drawn with
    ``seed``) and CAVI from the model's initial ``q(c)``."""
    synthetic = make_biased_gmm(
        num_data, num_components, dim, block_size, purity, seed=seed, separation=separation
    )
    synthetic = synthetic._replace(
        data=synthetic.data.to(device),
        prior=synthetic.prior.to(device=device),
        centers=synthetic.centers.to(device),
    )
    gmm = GMMModel(synthetic.data, synthetic.prior, seed=seed)
    optimum = cavi(
        synthetic.data,
        synthetic.prior,
        m=gmm.init_means.clone(),
        rho=gmm.init_log_variances.clone(),
        num_iterations=cavi_iterations,
    )
    return GMMProblem(synthetic, gmm, optimum, seed)


def gmm_problem_from(
    args: argparse.Namespace, seed: int, purity: float | None = None, num_data: int | None = None
) -> GMMProblem:
    """:func:`make_gmm_problem` from the options of :func:`add_gmm_data_arguments` (and
    ``--device``, ``--cavi-iterations`` where a script has them)."""
    return make_gmm_problem(
        args.num_data if num_data is None else num_data,
        args.num_components,
        args.dim,
        args.block_size,
        args.purity if purity is None else purity,
        seed,
        args.separation,
        getattr(args, "device", "cpu"),
        getattr(args, "cavi_iterations", 5000),
    )


def gmm_elbo(particles: int | None = None) -> TraceEnum_ELBO:
    """``GMMModel``'s loss: ``TraceEnum_ELBO`` (its guide enumerates z), with ``particles``
    vectorized particles, or one particle if ``None``."""
    if particles is None:
        return TraceEnum_ELBO(max_plate_nesting=1)
    return TraceEnum_ELBO(max_plate_nesting=1, num_particles=particles, vectorize_particles=True)


def gmm_pdvi(gmm: GMMModel, blocks: Sequence[torch.Tensor], particles: int | None = None, **options) -> PDVI:
    """PDVI on ``GMMModel`` (``options`` as ``PDVI`` takes them: ``eta``, ``groups``, ``solver``, ...).

    The optimizer only drives a ``GenericSolver(method="optim")``; PDVI requires one."""
    return PDVI(
        gmm.model, gmm.guide, pyro.optim.Adam({"lr": 0.01}), gmm_elbo(particles), blocks=blocks, **options
    )


def step_sizes_text(pdvi: PDVI, separator: str = ", ", fmt: str = ".3g") -> str:
    """``name=eta`` of every preconditioner group."""
    return separator.join(f"{name}={eta:{fmt}}" for name, eta in pdvi.step_sizes.items())


# --------------------------------------------------------------------------- the epoch loop


def run_epochs(
    make_stepper: Callable[[], Any],
    blocks: Sequence[torch.Tensor],
    epochs: int,
    seed: int,
    evaluate: Callable[[int], dict] = lambda epoch: {},
    *,
    callback: Callable[[dict], bool | None] | None = None,
    catch: tuple[type[BaseException], ...] = (),
    nan_keys: Iterable[str] = (),
    label: str = "",
    progress: bool = False,
) -> tuple[Any, list[dict]]:
    """Run one method for ``epochs`` passes over the blocks, one block per step.

    The param store is cleared and Pyro's seeds set to ``seed`` before ``make_stepper()``
    builds the method; each epoch steps on every block once, in a fresh random order drawn
    from ``torch.Generator().manual_seed(seed)``: every method run with the same seed sees the
    same orders. A stepper with ``per_epoch = True`` (full-batch CAVI) gets one ``step(None)``
    per epoch instead.

    :param make_stepper: builds the method: an object with ``step(block)`` (``pyro.infer.SVI``,
        ``PDVI``, ...).
    :param blocks: the fixed blocks.
    :param epochs: passes over the blocks.
    :param seed: the seed of the run and of its block orders.
    :param evaluate: ``evaluate(epoch)`` after every epoch, outside the timing: the row's scores.
    :param callback: ``callback(row)`` after every epoch; returning ``True`` stops the run.
    :param catch: exceptions of a step that mark the run as diverged (its later epochs are not
        run, and their rows hold NaN for ``nan_keys``) instead of ending the benchmark.
    :param nan_keys: the scores of a diverged epoch, or of one whose scores are not finite.
    :param label: the run's name, for messages and the progress bar.
    :param progress: show a tqdm progress bar.
    :returns: the stepper and one row per epoch: ``epoch``, ``seconds`` (cumulative, steps
        only) and the scores.
    """
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    stepper = make_stepper()
    order = torch.Generator().manual_seed(seed)
    nan_keys = tuple(nan_keys)
    rows, elapsed, diverged = [], 0.0, False
    bar = range(1, epochs + 1)
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(bar, desc=label, leave=False)
    for epoch in bar:
        permutation = torch.randperm(len(blocks), generator=order).tolist()
        start = time.perf_counter()
        if not diverged:
            try:
                if getattr(stepper, "per_epoch", False):
                    stepper.step(None)
                else:
                    for b in permutation:
                        stepper.step(blocks[b])
            except catch as error:
                diverged = True
                message = str(error).splitlines()[0][:120]
                print(f"  {label} diverged in epoch {epoch}: {message}", flush=True)
        elapsed += time.perf_counter() - start
        scores = {} if diverged else evaluate(epoch)
        if diverged or not all(math.isfinite(scores.get(key, 0.0)) for key in nan_keys):
            diverged = True
            scores = {**scores, **{key: float("nan") for key in nan_keys}}
        rows.append({"epoch": epoch, "seconds": elapsed, **scores})
        if callback is not None and callback(rows[-1]) is True:
            break
    return stepper, rows


def first_epoch(rows: Sequence[dict], key: str, threshold: float) -> int | None:
    """The first epoch whose ``key`` is at most ``threshold`` (``None`` if none)."""
    return next((row["epoch"] for row in rows if row[key] <= threshold), None)


def cost_split(rows: Sequence[dict]) -> tuple[float, float]:
    """Seconds of the first epoch (which holds one-off costs, e.g. the curvature measurement
    of ``eta="auto"``) and per epoch after it (the first epoch's if there is no other)."""
    first, last = rows[0], rows[-1]
    if len(rows) == 1:
        return first["seconds"], first["seconds"]
    return first["seconds"], (last["seconds"] - first["seconds"]) / (last["epoch"] - first["epoch"])


# --------------------------------------------------------------------------- reporting


def markdown_table(header: Sequence[str], lines: Iterable[Sequence[Any]]) -> str:
    """A markdown table: ``header`` and one row per entry of ``lines`` (cells as ``str``)."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(cell) for cell in line) + " |" for line in lines]
    return "\n".join(out)


def write_csv(rows: Sequence[dict], path: str | Path, fields: Sequence[str] | None = None) -> Path:
    """Write ``rows`` (dicts with the same keys) to ``path``, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields or rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def append_csv(row: dict, path: str | Path, fields: Sequence[str] | None = None) -> None:
    """Append one row to ``path`` (with a header if the file is new): results survive a run
    stopped early."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new_file = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields or row))
        if new_file:
            writer.writeheader()
        writer.writerow(row)


def read_csv(paths: Iterable[str | Path], types: dict[str, Callable[[str], Any]]) -> list[dict]:
    """The rows of CSV files, each column parsed by ``types[column]`` (kept as text if absent)."""
    rows = []
    for path in paths:
        with open(path, newline="") as f:
            rows += [{k: types.get(k, str)(v) for k, v in row.items()} for row in csv.DictReader(f)]
    return rows


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display), or ``None`` (and a message) if
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    return plt


def save_figure(fig, path: str | Path, dpi: int = 110) -> None:
    """Save and close ``fig``, and say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(f"wrote {path}")
