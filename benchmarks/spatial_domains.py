"""Spatial domain detection with the Potts mixture of [1, App. C.1]: P2D-VI vs PD-VI vs a
plain Gaussian mixture (no Potts term) vs Pyro SVI+Adam, on synthetic tissue with known domains.

For each size in ``--num-spots`` it draws Potts domains (:func:`make_potts_data`), fits every
method for ``--epochs`` passes over ``--num-patches`` fixed spatial patches, and reports

* the objective (the exact negative ELBO on the patch-restricted graph) per epoch, against
  epochs and seconds, the ARI against the truth per epoch, and the norm of the gradient in
  the global parameters (paper Fig. 4);
* a figure of the recovered domains next to the truth (paper Fig. 5);
* seconds per full pass over the spots, and a timing of the neighbour-sum backends.

The plain mixture is P2D-VI with ``potts_weight = 0``: same solver, same patches, its own
objective (so it is compared by ARI only). SVI+Adam steps the same exact objective through
``pyro.infer.SVI`` one patch at a time.

Run ``python benchmarks/spatial_domains.py --help``; defaults give the benchmark in
``docs/benchmarks.md``. ``examples/spatial_domains.py`` is the short version for users.

[1] Lyu, Yu, Ma, Shi (2026), arXiv:2602.07632.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: import this checkout's benchmarks and pyro_pdvi, not an installed copy.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import markdown_table, pyplot, save_figure, script_parser  # noqa: E402
from pyro_pdvi.metrics import adjusted_rand_index  # noqa: E402
from pyro_pdvi.models.potts import BACKENDS, scatter_available  # noqa: E402
from pyro_pdvi.spatial import fit_potts_mixture, knn_graph, make_potts_data  # noqa: E402

METHODS = {
    "P2D-VI": {"method": "p2dvi"},
    "PD-VI": {"method": "pdvi"},
    "plain GMM (P2D-VI, r=0)": {"method": "p2dvi", "potts_weight": 0.0},
    "SVI+Adam": {"method": "svi"},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--num-spots", type=int, nargs="+", default=[20000, 150000], help="sizes to run")
    parser.add_argument("--num-domains", type=int, default=12, help="K")
    parser.add_argument("--dim", type=int, default=20, help="feature dimension d")
    parser.add_argument("--separation", type=float, default=0.5, help="prior sd of centres (noise sd 1)")
    parser.add_argument("--num-patches", type=int, default=25, help="fixed spatial patches (PD-VI blocks)")
    parser.add_argument("--num-neighbors", type=int, default=6, help="k of the kNN graph")
    parser.add_argument("--potts-weight", type=float, default=1.0, help="Potts interaction r")
    parser.add_argument("--epochs", type=int, default=15, help="passes over the patches per method")
    parser.add_argument("--sweeps", type=int, default=10, help="coordinate-descent sweeps per patch solve")
    parser.add_argument("--lr", type=float, default=0.05, help="Adam learning rate of SVI")
    parser.add_argument(
        "--methods", nargs="+", default=list(METHODS), choices=list(METHODS), help="methods to run"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--seed", type=int, default=0, help="data, initialisation and patch-order seed")
    parser.add_argument("--out", default=None, help="folder for figures and results.json")
    parser.add_argument("--quiet", action="store_true", help="print the summary table only")
    return parser.parse_args(argv)


def time_backends(coords: torch.Tensor, num_neighbors: int, num_domains: int, repeats: int = 5) -> dict:
    """Seconds per neighbour sum ``W phi`` over all spots, per available backend."""
    graph = knn_graph(coords, num_neighbors, dtype=torch.float64)
    phi = torch.softmax(torch.randn(coords.shape[0], num_domains, dtype=torch.float64), -1)
    timings = {}
    for backend in BACKENDS[1:]:
        if backend == "scatter" and not scatter_available():
            continue
        graph.neighbour_sum(phi, backend)
        start = time.perf_counter()
        for _ in range(repeats):
            graph.neighbour_sum(phi, backend)
        timings[backend] = (time.perf_counter() - start) / repeats
    return timings


def epochs_to_reach(objective: list[float], target: float) -> int | None:
    for epoch, value in enumerate(objective):
        if value <= target:
            return epoch
    return None


def run_size(args: argparse.Namespace, num_spots: int) -> dict:
    start = time.perf_counter()
    tissue = make_potts_data(
        num_spots, args.num_domains, args.dim, separation=args.separation, seed=args.seed
    )
    generate_seconds = time.perf_counter() - start
    results = {"num_spots": num_spots, "generate_seconds": generate_seconds, "methods": {}}
    fits = {}
    for name in args.methods:

        def progress(epoch, row, name=name):
            if not args.quiet:
                ari = f" ari {row['ari']:.3f}" if "ari" in row else ""
                print(
                    f"  N={num_spots} {name:<24} epoch {epoch:3d}  {row['seconds']:8.2f}s  "
                    f"objective {row['objective']:.6e}  |grad| {row['grad_norm']:.2e}{ari}",
                    flush=True,
                )

        fit = fit_potts_mixture(
            tissue.data,
            tissue.coords,
            args.num_domains,
            num_patches=args.num_patches,
            num_neighbors=args.num_neighbors,
            num_epochs=args.epochs,
            num_sweeps=args.sweeps,
            lr=args.lr,
            truth=tissue.labels,
            seed=args.seed,
            device=args.device,
            callback=progress,
            **{"potts_weight": args.potts_weight, **METHODS[name]},
        )
        fits[name] = fit
        history = fit.history
        results["methods"][name] = {
            "step_sizes": fit.step_sizes,
            "history": history,
            "final_ari": adjusted_rand_index(tissue.labels, fit.labels),
            "seconds_per_epoch": history["seconds"][-1] / max(args.epochs, 1),
        }
    potts = [n for n in results["methods"] if "plain" not in n]
    if potts:
        best = min(min(results["methods"][n]["history"]["objective"]) for n in potts)
        first = results["methods"][potts[0]]["history"]["objective"][0]
        for n in potts:
            objective = results["methods"][n]["history"]["objective"]
            # epochs until within 1e-3 and 1e-5 of the total decrease from the start to the best
            for tol in (1e-3, 1e-5):
                results["methods"][n][f"epochs_to_{tol:g}"] = epochs_to_reach(
                    objective, best + tol * (first - best)
                )
    results["backends"] = time_backends(tissue.coords, args.num_neighbors, args.num_domains)
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


def summary(results: list[dict]) -> str:
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
                    f"{row['final_ari']:.3f}",
                    f"{row['seconds_per_epoch']:.2f}",
                ]
            )
        backends = ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in result["backends"].items())
        lines.append([result["num_spots"], "neighbour sum W phi (all spots)", backends, "", "", "", "", ""])
    table = markdown_table(header + ["final ARI", "s/epoch"], lines)
    return table.replace("None", "—")


def main(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(1)
    results = [run_size(args, n) for n in args.num_spots]
    table = summary(results)
    print(table)
    print(
        f"torch {torch.__version__}, python {platform.python_version()}, "
        f"{platform.processor() or platform.machine()}, threads {torch.get_num_threads()}, "
        f"device {args.device}"
    )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "spatial_results.json").write_text(json.dumps(results, indent=1, default=str))
        (out / "spatial_table.md").write_text(table + "\n")
    return results


if __name__ == "__main__":
    main(parse_args())
