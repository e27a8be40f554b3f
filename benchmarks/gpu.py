"""Throughput of PDVI's closed-form and generic paths on one device (a GPU, or the CPU),
against full-batch CAVI, Pyro's SVI and the memory-bandwidth floor.

The model is the Bayesian GMM of ``pyro_pdvi.models.gmm`` (N points in d dimensions,
K components, fixed equal-size blocks). Every timing is the median of ``--repeats`` runs
after a warm-up run, with ``torch.cuda.synchronize()`` before and after each run on a
GPU; float32 on a GPU, float64 on the CPU unless ``--dtype`` says otherwise. Sections:

a. ``cavi``: one full CAVI pass (responsibilities, then the conjugate update of q(c))
   over all N points, and ten passes.
b. ``closed-form``: one PD-VI epoch (every block once) with :class:`GMMBlockSolver`
   and ``--sweeps`` coordinate-descent sweeps per block,

   * through ``PDVI.step`` with m blocks per step (``--blocks-per-step``; "all" = one
     step over every block, which the engine hands to one ``solver.solve`` call);
   * through direct ``solver.solve(problem)`` calls, each on a ``BlockProblem`` of m blocks;
   * ``engine``: per step, the time of ``PDVI.step`` minus the solver's time inside it,
     and the engine's parts (running the guide up to the data plate to read the
     subsample, finding its blocks, building the ``BlockProblem``, the dual/global update).
c. ``generic``: one ``PDVI.step`` on one block through Pyro's ``TraceEnum_ELBO`` with
   ``GenericSolver`` (L-BFGS, ``--inner-steps`` evaluations), timed at the blocks' second
   visits (four blocks, each visited once before); ``generic-vmap``: one step
   over 8 equal blocks with ``GenericSolver(vectorize=True)`` (one ``vmap`` pass, each block
   its own L-BFGS, :func:`~pyro_pdvi.infer.solvers.batched_lbfgs`); the user's ELBO draws one
   particle and ``particles="auto"`` chooses the solves' (the note says how many);
   ``generic-particles``: the one-block step with the solves' particles set
   (:data:`PARTICLE_COUNTS`), to measure where more start to cost.
d. ``svi``: one ``pyro.infer.SVI.step`` with Adam on one block (the same model, guide
   and ELBO).
e. ``floor``: the bytes an epoch must move (each sweep reads every block's data once;
   the logits are read and written once), divided by the device's copy bandwidth
   measured here with a large tensor copy.

Results are printed as they come and appended to ``gpu_benchmark.csv`` under ``--out``
(a failing section is reported in the table and the CSV, and the rest still runs).

On a machine whose Python has PyTorch but not Pyro and no network, fetch the wheels
beforehand on a machine with network, for the target's Python version and platform and
without torch (``--no-deps``: pip would otherwise fetch torch and its CUDA libraries)::

    pip download --no-deps --only-binary=:all: --python-version 3.11 \
        --platform manylinux2014_x86_64 -d wheels \
        pyro-ppl==1.9.2 pyro-api opt-einsum tqdm numpy pytest iniconfig pluggy packaging

(pytest and its dependencies only for ``tests/test_cuda.py``), and pass ``--wheels wheels``:
the wheels of the distributions that are not installed are installed with
``python -m pip install --no-index --no-deps --target /tmp/site`` (or unpacked, without
pip) and ``/tmp/site`` is appended to ``sys.path``. The tests then run with
``PYTHONPATH=/tmp/site python -m pytest tests/test_cuda.py``.

Example::

    python benchmarks/gpu.py --device cuda --points 10000000 --blocks 100 --out results
    python benchmarks/gpu.py --device cpu --points 1000000 --blocks 100 --threads 1
"""

from __future__ import annotations

import argparse
import csv
import importlib
import importlib.metadata
import subprocess
import sys
import time
import traceback
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
FIELDS = ["section", "method", "blocks_per_step", "points", "ms", "points_per_s", "note"]
#: The solves' particles that ``generic-particles`` times.
PARTICLE_COUNTS = (2, 8, 32, 64)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--wheels", default=None, help="folder of wheel files to install Pyro from")
    parser.add_argument("--site", default="/tmp/site", help="where --wheels installs to")
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="torch device (default: cuda if available, else cpu)",
    )
    parser.add_argument("--dtype", default=None, help="float32 or float64 (default: float32 on a GPU)")
    parser.add_argument("--points", type=int, default=10_000_000, help="N, data points")
    parser.add_argument("--blocks", type=int, default=100, help="number of equal-size blocks")
    parser.add_argument("--dim", type=int, default=10, help="d")
    parser.add_argument("--components", type=int, default=5, help="K")
    parser.add_argument("--sweeps", type=int, default=10, help="coordinate-descent sweeps per block solve")
    parser.add_argument(
        "--blocks-per-step", default="1,10,all", help="m values for the closed-form epoch (comma list)"
    )
    parser.add_argument(
        "--inner-steps", type=int, default=10, help="GenericSolver(inner_steps=...): evaluations per solve"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median)")
    parser.add_argument("--budget", type=float, default=200.0, help="seconds; later sections are skipped")
    parser.add_argument(
        "--sections",
        default="cavi,closed-form,engine,generic,generic-vmap,generic-particles,svi,floor",
        help="sections to run, comma list (see above)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0, help="data and initialisation seed")
    parser.add_argument("--out", default="results", help="folder for gpu_benchmark.csv")
    return parser.parse_args(argv)


# ------------------------------------------------------------------ getting Pyro


def ensure_importable(wheels: str | None, site: str) -> None:
    """Make ``pyro`` and ``pyro_pdvi`` importable: the repository root on ``sys.path``,
    and Pyro from the wheel files in ``wheels`` when it is not installed."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    try:
        import pyro  # noqa: F401

        return
    except ImportError:
        if wheels is None:
            raise ImportError("pyro-ppl is not installed; pass --wheels DIR with its wheel files") from None
    install_wheels(wheels, site)
    import pyro  # noqa: F401


def install_wheels(wheels: str, site: str) -> list[str]:
    """Install the wheels in folder ``wheels`` whose distributions are not installed into
    ``site`` (pip without index or dependency resolution; unpacked if pip fails) and
    append ``site`` to ``sys.path``.

    :returns: the file names of the wheels installed.
    """
    files = sorted(Path(wheels).glob("*.whl"))
    if not files:
        raise FileNotFoundError(f"--wheels {wheels}: no .whl files there")
    missing = [f for f in files if not _installed(f.name.split("-")[0])]
    print(f"installing {[f.name for f in missing]} into {site}", flush=True)
    command = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--target", site]
    result = subprocess.run(command + [str(f) for f in missing], capture_output=True, text=True)
    if result.returncode != 0:
        print(f"pip failed ({result.stderr.strip()[-300:]}); unpacking the wheels instead", flush=True)
        for f in missing:
            with zipfile.ZipFile(f) as archive:
                archive.extractall(site)
    # Appended: packages already installed (numpy, ...) keep precedence over the wheels.
    if site not in sys.path:
        sys.path.append(site)
    importlib.invalidate_caches()
    return [f.name for f in missing]


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution.replace("_", "-"))
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


# ------------------------------------------------------------------ timing


class Bench:
    """Timing, the result table and the CSV, written row by row."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device = args, device
        self.rows: list[dict] = []
        self.start = time.perf_counter()
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        self.csv_path = out / "gpu_benchmark.csv"
        with open(self.csv_path, "w", newline="") as f:
            csv.DictWriter(f, FIELDS).writeheader()
        print(f"{'section':12s} {'method':44s} {'m':>5s} {'points':>10s} {'ms':>11s} {'points/s':>10s}  note")

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def time(self, fn: Callable[[], object], repeats: int | None = None) -> float:
        """Median seconds of ``fn()`` after one warm-up call; fewer repeats for slow calls."""
        repeats = self.args.repeats if repeats is None else repeats
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        first = time.perf_counter() - start
        if first > 2.0:  # slow: keep within the time budget
            repeats = min(repeats, 2)
        times = []
        for _ in range(repeats):
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    def add(self, section: str, method: str, m, points: int, seconds: float | None, note: str = "") -> None:
        row = {
            "section": section,
            "method": method,
            "blocks_per_step": m,
            "points": points,
            "ms": None if seconds is None else round(seconds * 1e3, 4),
            "points_per_s": None if not seconds else round(points / seconds),
            "note": note,
        }
        self.rows.append(row)
        with open(self.csv_path, "a", newline="") as f:
            csv.DictWriter(f, FIELDS).writerow(row)
        ms = "" if row["ms"] is None else f"{row['ms']:11.3f}"
        rate = "" if row["points_per_s"] is None else f"{row['points_per_s']:10.3g}"
        print(f"{section:12s} {method:44s} {m!s:>5s} {points:10d} {ms:>11s} {rate:>10s}  {note}", flush=True)

    def section(self, name: str, body: Callable[[], None]) -> None:
        if name not in self.args.sections.split(","):
            return
        if self.elapsed() > self.args.budget:
            self.add(name, "skipped", "", 0, None, f"time budget {self.args.budget:.0f} s used up")
            return
        try:
            body()
        except Exception as error:  # report and go on with the next section
            traceback.print_exc()
            self.add(name, "FAILED", "", 0, None, f"{type(error).__name__}: {str(error)[:200]}")
        finally:
            import pyro

            pyro.clear_param_store()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()


# ------------------------------------------------------------------ the sections


class Setup:
    """Data, prior, blocks and the Pyro model on the device."""

    def __init__(self, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
        from pyro_pdvi.models.gmm import GMMModel, make_biased_gmm

        if args.points % args.blocks:
            raise ValueError(f"--points {args.points} must be a multiple of --blocks {args.blocks}")
        self.block_size = args.points // args.blocks
        synthetic = make_biased_gmm(
            args.points, args.components, args.dim, self.block_size, 0.9, seed=args.seed, dtype=dtype
        )
        self.data = synthetic.data.to(device)
        self.prior = synthetic.prior.to(dtype, device)
        self.blocks = [b.to(device) for b in synthetic.blocks]
        self.gmm = GMMModel(self.data, self.prior, seed=args.seed)
        self.num_data = args.points
        self.device = device


def cavi_pass(data, prior, m, rho):
    """One CAVI pass: responsibilities, then the conjugate update of q(c) given them."""
    from pyro_pdvi.models.gmm import conjugate_update, optimal_logits

    return conjugate_update(data, prior, optimal_logits(data, prior, m, rho).exp())


def run_cavi(bench: Bench, setup: Setup) -> None:
    m, rho = setup.gmm.init_means, setup.gmm.init_log_variances

    def passes(count):
        def run():
            state = (m, rho)
            for _ in range(count):
                state = cavi_pass(setup.data, setup.prior, *state)

        return run

    bench.add("cavi", "one full CAVI pass", "", setup.num_data, bench.time(passes(1)))
    seconds = bench.time(passes(10))
    bench.add("cavi", "ten CAVI passes", "", setup.num_data, seconds, "the target: PD-VI epoch <= 3x this")


def make_pdvi(setup: Setup, solver, particles: int | None = None):
    """PDVI on the GMM with fixed step sizes (no curvature measurement in the timings); with
    ``particles``, the user's ELBO vectorizes that many, which the solves then draw (else it
    draws one and ``particles="auto"`` chooses)."""
    import pyro

    from benchmarks.common import gmm_pdvi

    pyro.clear_param_store()
    groups = [{"sites": ["rho"], "eta": 1e-1}]
    return gmm_pdvi(
        setup.gmm, setup.blocks, particles, eta=1e-2, groups=groups, solver=solver, global_update="paper"
    )


def step_subsamples(setup: Setup, per_step: int) -> list[torch.Tensor]:
    """The subsamples of one epoch with ``per_step`` blocks per step (on the device)."""
    n = len(setup.blocks)
    return [torch.cat(setup.blocks[start : start + per_step]) for start in range(0, n, per_step)]


def blocks_per_step_values(args: argparse.Namespace) -> list[int]:
    values = []
    for item in args.blocks_per_step.split(","):
        value = args.blocks if item.strip() == "all" else int(item)
        if args.blocks % value:
            raise ValueError(f"--blocks-per-step {value} must divide --blocks {args.blocks}")
        values.append(value)
    return values


def block_problems(setup: Setup, per_step: int) -> list:
    """An epoch's subproblems, ``per_step`` blocks each, at the initial point (zero duals)."""
    from pyro_pdvi import BlockProblem

    consensus = {"m": setup.gmm.init_means, "rho": setup.gmm.init_log_variances}
    step_sizes = {"m": torch.full_like(consensus["m"], 1e-2), "rho": torch.full_like(consensus["rho"], 1e-1)}
    problems = []
    for start in range(0, len(setup.blocks), per_step):
        ids = torch.arange(start, start + per_step)
        indices = torch.stack([setup.blocks[b] for b in ids.tolist()])
        problems.append(
            BlockProblem(
                blocks=ids,
                indices=indices,
                consensus=consensus,
                dual={k: v.new_zeros(per_step, *v.shape) for k, v in consensus.items()},
                step_sizes=step_sizes,
                local={"alpha": setup.gmm.init_logits[indices]},
                num_blocks=len(setup.blocks),
                num_data=setup.num_data,
            )
        )
    return problems


def run_closed_form(bench: Bench, setup: Setup) -> None:
    from pyro_pdvi.models.gmm import GMMBlockSolver

    solver = GMMBlockSolver(setup.data, setup.prior, num_sweeps=bench.args.sweeps)
    for per_step in blocks_per_step_values(bench.args):
        pdvi = make_pdvi(setup, solver)
        subsamples = step_subsamples(setup, per_step)

        def epoch(pdvi=pdvi, subsamples=subsamples):
            for subsample in subsamples:
                pdvi.step(subsample)

        path = "one block per solve" if per_step == 1 else f"{per_step} blocks per solve"
        seconds = bench.time(epoch)
        bench.add("closed-form", f"PD-VI epoch via PDVI.step ({path})", per_step, setup.num_data, seconds)

    # Direct solver calls: the same subproblems without the engine around them.
    for per_step in blocks_per_step_values(bench.args):
        problems = block_problems(setup, per_step)

        def direct(problems=problems):
            for problem in problems:
                solver.solve(problem)

        seconds = bench.time(direct)
        bench.add("closed-form", "PD-VI epoch via direct solver.solve", per_step, setup.num_data, seconds)
        del problems


class Timed:
    """Wraps a callable and adds up its (synchronised) time."""

    def __init__(self, bench: Bench, fn: Callable) -> None:
        self.bench, self.fn, self.seconds, self.calls = bench, fn, 0.0, 0

    def __call__(self, *args, **kwargs):
        self.bench.sync()
        start = time.perf_counter()
        result = self.fn(*args, **kwargs)
        self.bench.sync()
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return result


def run_engine(bench: Bench, setup: Setup) -> None:
    """Where a closed-form PDVI step spends its time outside the solver."""
    from pyro_pdvi.models.gmm import GMMBlockSolver

    args = bench.args
    for per_step in sorted({1, args.blocks}):
        solver = GMMBlockSolver(setup.data, setup.prior, num_sweeps=args.sweeps)
        pdvi = make_pdvi(setup, solver)
        subsamples = step_subsamples(setup, per_step)
        pdvi.step(subsamples[0])  # set-up happens here
        parts = {
            "find the subsample (guide up to the data plate)": ("_step_subsample", pdvi),
            "find blocks (blocks_in)": ("blocks_in", pdvi.partition),
            "build the BlockProblem (_problem)": ("_problem", pdvi),
            "dual+global update, param store (_commit)": ("_commit", pdvi),
        }
        timers = {}
        for label, (attribute, owner) in parts.items():
            timers[label] = Timed(bench, getattr(owner, attribute))
            setattr(owner, attribute, timers[label])
        solve = Timed(bench, solver.solve)
        solver.solve = solve
        steps = subsamples[: max(1, min(len(subsamples), 20))]
        bench.sync()
        start = time.perf_counter()
        for subsample in steps:
            pdvi.step(subsample)
        bench.sync()
        total = time.perf_counter() - start
        count = len(steps)
        points = per_step * setup.block_size
        inside = solve.seconds / count
        bench.add("engine", "PDVI.step, whole step", per_step, points, total / count)
        bench.add("engine", "  solver inside the step", per_step, points, inside)
        bench.add("engine", "  engine overhead (step - solver)", per_step, points, total / count - inside)
        for label, timer in timers.items():
            if timer.calls:
                bench.add("engine", f"    {label}", per_step, points, timer.seconds / count)


def run_generic(bench: Bench, setup: Setup, per_step: int = 1, particles: int | None = None) -> None:
    """Generic-path steps (``GenericSolver``: L-BFGS through ``TraceEnum_ELBO``): one block per
    step, or ``per_step`` equal blocks in one vmapped pass, each block its own L-BFGS
    (``vectorize=True``; ``batched_lbfgs``, no host read in its loop); the solves draw
    ``particles`` (else ``particles="auto"``'s choice)."""
    from pyro_pdvi import GenericSolver

    vectorize = per_step > 1
    pdvi = make_pdvi(setup, GenericSolver(bench.args.inner_steps, vectorize=vectorize), particles)
    steps = step_subsamples(setup, min(per_step, len(setup.blocks)))
    # Four steps' subsamples, each visited once before the clock starts: a block's first visit
    # also records its graph, which a timing of four steps over a hundred blocks counted in every
    # step (it made no measurable difference there: section 14).
    steps = [s for s in steps if len(s) == len(steps[0])][:4]
    counter = iter(range(10**9))

    def step():
        pdvi.step(steps[next(counter) % len(steps)])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-particle warning: this is a timing
        for _ in steps[1:]:
            step()
        seconds = bench.time(step, repeats=min(bench.args.repeats, 3))
    blocks = len(steps[0]) // setup.block_size
    drawn = pdvi.solve_loss.loss.num_particles
    note = f"L-BFGS, {bench.args.inner_steps} evaluations, TraceEnum_ELBO, {drawn} particles"
    if vectorize:
        note = "vmap + per-block " + note
        bench.add("generic-vmap", "PDVI.step, generic path, vectorized", blocks, len(steps[0]), seconds, note)
    elif particles is not None:
        method = f"PDVI.step, generic path, {particles} particles"
        bench.add("generic-particles", method, 1, setup.block_size, seconds, note)
    else:
        bench.add("generic", "PDVI.step, generic path, one block", 1, setup.block_size, seconds, note)


def run_generic_particles(bench: Bench, setup: Setup) -> None:
    """The generic step against the solves' particles: where more cost little
    (``pyro_pdvi.infer.particles.ELEMENTS_PER_OPERATION``, measured on the CPU, not yet on a GPU)."""
    for particles in PARTICLE_COUNTS:
        run_generic(bench, setup, particles=particles)


def run_svi(bench: Bench, setup: Setup) -> None:
    import pyro
    from pyro.infer import SVI, TraceEnum_ELBO

    pyro.clear_param_store()
    svi = SVI(
        setup.gmm.model, setup.gmm.guide, pyro.optim.Adam({"lr": 0.01}), TraceEnum_ELBO(max_plate_nesting=1)
    )
    blocks = setup.blocks
    counter = iter(range(10**9))

    def step():
        svi.step(blocks[next(counter) % len(blocks)])

    seconds = bench.time(step, repeats=max(bench.args.repeats, 10))
    bench.add("svi", "pyro SVI.step (Adam), one block", 1, setup.block_size, seconds, "TraceEnum_ELBO")
    small = blocks[0][:100]
    seconds = bench.time(lambda: svi.step(small), repeats=max(bench.args.repeats, 10))
    bench.add("svi", "pyro SVI.step (Adam), 100 points", 1, 100, seconds, "TraceEnum_ELBO")


def run_floor(bench: Bench, setup: Setup) -> None:
    size = 1 << 28 if setup.device.type == "cuda" else 1 << 25  # bytes per buffer
    source = torch.empty(size // 4, dtype=torch.float32, device=setup.device).fill_(1.0)
    target = torch.empty_like(source)
    seconds = bench.time(lambda: target.copy_(source), repeats=max(bench.args.repeats, 10))
    bandwidth = 2 * size / seconds  # a copy reads and writes
    element = setup.data.element_size()
    data_bytes = setup.num_data * setup.prior.dim * element
    logits_bytes = setup.num_data * setup.prior.num_components * element
    bench.add("floor", "device copy bandwidth", "", 0, None, f"{bandwidth / 1e9:.1f} GB/s (read + write)")
    bench.add("floor", "floor of one CAVI pass (data read once)", "", setup.num_data, data_bytes / bandwidth)
    epoch_bytes = bench.args.sweeps * data_bytes + 2 * logits_bytes
    note = f"{bench.args.sweeps} reads of the data, logits read and written once"
    bench.add("floor", "floor of one PD-VI epoch", "", setup.num_data, epoch_bytes / bandwidth, note)


def main(args: argparse.Namespace) -> list[dict]:
    ensure_importable(args.wheels, args.site)
    import pyro

    device = torch.device(args.device)
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.float32 if device.type == "cuda" else torch.float64)
    )
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    pyro.set_rng_seed(args.seed)
    torch.set_default_dtype(dtype)
    bench = Bench(args, device)
    print(
        f"# torch {torch.__version__}, pyro {pyro.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
        + f", {dtype}, threads {torch.get_num_threads()}, N={args.points} d={args.dim} K={args.components} "
        f"blocks={args.blocks} sweeps={args.sweeps}",
        flush=True,
    )
    start = time.perf_counter()
    setup = Setup(args, device, dtype)
    print(f"# data ready in {time.perf_counter() - start:.1f} s", flush=True)
    bench.section("cavi", lambda: run_cavi(bench, setup))
    bench.section("closed-form", lambda: run_closed_form(bench, setup))
    bench.section("engine", lambda: run_engine(bench, setup))
    bench.section("generic", lambda: run_generic(bench, setup))
    bench.section("generic-vmap", lambda: run_generic(bench, setup, per_step=8))
    bench.section("generic-particles", lambda: run_generic_particles(bench, setup))
    bench.section("svi", lambda: run_svi(bench, setup))
    bench.section("floor", lambda: run_floor(bench, setup))
    print(f"# done in {bench.elapsed():.1f} s; table in {bench.csv_path}", flush=True)
    return bench.rows


if __name__ == "__main__":
    main(parse_args())
