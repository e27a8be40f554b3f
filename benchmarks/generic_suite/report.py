"""Tables (markdown, printed and written), CSVs and plots of a suite run.

Every number in a table is the mean over the seeds that ran the method; "best SVI" at a
checkpoint is the SVI configuration (learning rate or schedule) with the lowest mean error at
that checkpoint, picked with hindsight (an oracle-tuned SVI: the comparison issue 13 asks
for). A ratio ``xR`` is the PDVI value over the best SVI value at the same checkpoint:
``R < 1`` means PDVI is better there.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from .baselines import PDVI_CONFIGS
from .metrics import (
    DEFAULT_STANDING,
    GAP_METRICS,
    PLOTTED,
    STANDING,
    at_epoch,
    at_seconds,
    late_geometric_mean,
    objective_rises,
)
from .runner import RunResult


def fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if value == 0 or 1e-3 <= abs(value) < 1e4:
        return f"{value:.{digits}g}"
    return f"{value:.{digits - 1}e}"


def ratio(value: float | None, best: float | None) -> str:
    if value is None or best is None or not best > 0 or math.isnan(value):
        return ""
    return f" (x{value / best:.2g})"


def group_runs(results: Sequence[RunResult]) -> dict[str, list[RunResult]]:
    """Runs by method label, in the order they ran."""
    groups: dict[str, list[RunResult]] = {}
    for r in results:
        groups.setdefault(r.label, []).append(r)
    return groups


def mean_at(runs: list[RunResult], metric: str, *, seconds: float | None = None, epoch: float | None = None):
    """Mean over ``runs`` of ``metric`` at ``seconds`` (or ``epoch``); ``None`` if a run has no
    value there (or the metric is not finite)."""
    values = []
    for r in runs:
        row = at_seconds(r.history, seconds) if seconds is not None else at_epoch(r.history, epoch)
        if row is None or metric not in row or not math.isfinite(row[metric]):
            return None
        values.append(row[metric])
    return statistics.fmean(values) if values else None


def best_svi(groups: dict[str, list[RunResult]], metric: str, **where) -> tuple[float | None, str]:
    """The best SVI configuration's mean ``metric`` at a checkpoint, and its name."""
    best, name = None, "-"
    for runs in groups.values():
        if runs[0].family != "SVI":
            continue
        value = mean_at(runs, metric, **where)
        if value is not None and (best is None or value < best):
            best, name = value, runs[0].config
    return best, name


#: A global sd below this fraction of the reference's (or above its inverse times the
#: reference's) at the end of a run is reported as collapsed (or blown up).
COLLAPSED = 0.01


def median_of(values) -> float:
    """Median of the finite values (NaN if there are none)."""
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def status_of(runs: list[RunResult]) -> str:
    """The runs' status: each seed's early stop and collapsed or blown-up scale, else "ok"."""
    bad = [f"seed {r.seed}: {r.status}" for r in runs if r.status != "ok"]
    for r in runs:
        last = r.history[-1] if r.history else {}
        if last.get("min_sd_ratio", 1.0) < COLLAPSED:
            bad.append(f"seed {r.seed}: collapsed scale (min sd/sd* {last['min_sd_ratio']:.1e})")
        if last.get("max_sd_ratio", 1.0) > 1 / COLLAPSED:
            bad.append(f"seed {r.seed}: scale blew up (max sd/sd* {last['max_sd_ratio']:.1e})")
    return "; ".join(bad)[:300] if bad else "ok"


class ModelReport:
    """Everything reported for one model."""

    def __init__(
        self,
        problem,
        reference,
        results: list[RunResult],
        checkpoints: Sequence[float],
        budget: float,
        eta_grid: Sequence[str] = (),
    ):
        """``eta_grid``: the fixed-eta configurations, reported in the eta table and in the
        accuracy table's rows, but left out of the plots, the summary and "best PDVI"."""
        self.problem = problem
        self.eta_grid = [f"PDVI {c}" for c in eta_grid]
        self.reference = reference
        self.results = results
        self.groups = group_runs(results)
        self.primary, self.secondary = PLOTTED[problem.name]
        self.budget = budget
        self.checkpoints = [t for t in checkpoints if t < budget] + [budget]

    def main_groups(self, grid: bool = False) -> dict[str, list[RunResult]]:
        """SVI configurations and the PDVI configurations that ran on every seed, without (or,
        with ``grid``, with) the fixed-eta grid."""
        seeds = {r.seed for r in self.results}
        return {
            k: v
            for k, v in self.groups.items()
            if v[0].family == "SVI" or ({r.seed for r in v} == seeds and (grid or k not in self.eta_grid))
        }

    # ------------------------------------------------------------------ table 1: equal seconds and epochs

    def accuracy_table(self) -> tuple[str, list[dict]]:
        groups = self.main_groups(grid=True)
        cols = [f"{self.primary} @{fmt(t)}s" for t in self.checkpoints]
        header = ["method", *cols, "epochs in budget", f"{self.secondary} @{fmt(self.budget)}s"] + [
            f"{self.primary} @ equal epochs (E)",
            "best SVI @E",
            "status",
        ]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        rows = []
        best = {t: best_svi(groups, self.primary, seconds=t) for t in self.checkpoints}
        best_secondary = best_svi(groups, self.secondary, seconds=self.budget)
        for label, runs in list(groups.items()) + [("best SVI", None)]:
            if runs is None:
                cells = [f"{fmt(best[t][0])} [{best[t][1]}]" for t in self.checkpoints]
                cells += ["", f"{fmt(best_secondary[0])} [{best_secondary[1]}]", "", "", ""]
                lines.append("| **best SVI** | " + " | ".join(cells) + " |")
                continue
            is_pdvi = runs[0].family == "PDVI"
            cells, row = [], {"model": self.problem.name, "method": label}
            for t in self.checkpoints:
                value = mean_at(runs, self.primary, seconds=t)
                cells.append(fmt(value) + (ratio(value, best[t][0]) if is_pdvi else ""))
                row[f"{self.primary}@{t:g}s"] = value
                row[f"best_svi@{t:g}s"] = best[t][0]
            epochs = statistics.fmean(r.epochs for r in runs)
            secondary = mean_at(runs, self.secondary, seconds=self.budget)
            cells += [fmt(epochs), fmt(secondary) + (ratio(secondary, best_secondary[0]) if is_pdvi else "")]
            row.update({"epochs": epochs, f"{self.secondary}@end": secondary})
            if is_pdvi:
                equal = min(r.epochs for r in runs)
                value = mean_at(runs, self.primary, epoch=equal)
                svi, svi_name = best_svi(groups, self.primary, epoch=equal)
                cells += [f"{fmt(value)}{ratio(value, svi)} (E={fmt(equal)})", f"{fmt(svi)} [{svi_name}]"]
                row.update({"equal_epochs": equal, f"{self.primary}@E": value, "best_svi@E": svi})
            else:
                cells += ["", ""]
            cells.append(status_of(runs))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
            rows.append(row)
        return "\n".join(lines), rows

    def summary_row(self) -> dict:
        """One line for the summary table: the best SVI, PDVI defaults and the best PDVI
        configuration at the budget's end, and PDVI defaults against the best SVI at equal epochs."""
        groups = self.main_groups()
        end = self.budget
        svi, svi_name = best_svi(groups, self.primary, seconds=end)
        row = {"model": self.problem.name, "metric": self.primary, "budget": end}
        row.update(best_svi=svi, best_svi_config=svi_name)
        pdvi = {label: runs for label, runs in groups.items() if runs[0].family == "PDVI"}
        values = {label: mean_at(runs, self.primary, seconds=end) for label, runs in pdvi.items()}
        defaults = pdvi.get("PDVI defaults")
        row["defaults"] = values.get("PDVI defaults")
        row["defaults_status"] = status_of(defaults) if defaults else "-"
        finite = {k: v for k, v in values.items() if v is not None}
        if finite:
            best = min(finite, key=finite.get)
            row.update(best_pdvi=finite[best], best_pdvi_config=best.removeprefix("PDVI "))
        if defaults:
            equal = min(r.epochs for r in defaults)
            row["equal_epochs"] = equal
            row["defaults_at_equal_epochs"] = mean_at(defaults, self.primary, epoch=equal)
            row["best_svi_at_equal_epochs"] = best_svi(groups, self.primary, epoch=equal)[0]
        return row

    def standing_row(self) -> dict:
        """README's cells: at each checkpoint, PDVI defaults' mean error over the best SVI's (the
        best configuration picked per metric and checkpoint), for each of the model's
        :data:`~.metrics.STANDING` metrics; ``None`` where either has no value."""
        groups = self.main_groups()
        metrics = STANDING.get(self.problem.name, DEFAULT_STANDING)
        row = {"model": self.problem.name, "metrics": metrics, "ratios": {}}
        defaults = groups.get("PDVI defaults")
        for t in self.checkpoints:
            ratios = []
            for metric in metrics:
                value = mean_at(defaults, metric, seconds=t) if defaults else None
                best = best_svi(groups, metric, seconds=t)[0]
                ratios.append(value / best if value is not None and best is not None and best > 0 else None)
            row["ratios"][t] = ratios
        return row

    # ------------------------------------------------------------------ table 2: cost per step

    def cost_row(self) -> dict:
        """Median CPU seconds of a step (each run's median over its steps but the first; then the
        median over runs) and the set-up estimate (first step - median); where every run of a
        configuration spent its budget in its first step, the first step's seconds as a lower
        bound of the set-up (``setup_at_least``)."""
        row = {"model": self.problem.name, "blocks": len(self.problem.blocks)}
        svi = [r for r in self.results if r.family == "SVI"]
        row["svi_step"] = median_of(r.median_step for r in svi)
        row["svi_calls"] = median_of(r.median_calls for r in svi)
        for config in ("defaults", "per_site"):
            runs = self.groups.get(f"PDVI {config}", [])
            row[f"{config}_step"] = median_of(r.median_step for r in runs)
            row[f"{config}_calls"] = median_of(r.median_calls for r in runs)
            row[f"{config}_first_calls"] = median_of(r.first_calls for r in runs)
            measured = [r.setup_seconds for r in runs if math.isfinite(r.setup_seconds)]
            row[f"{config}_setup"] = statistics.fmean(measured) if measured else math.nan
            row[f"{config}_setup_at_least"] = max((r.first_step for r in runs if r.num_steps), default=0.0)
        return row

    # ------------------------------------------------------------------ table 3: eta="auto" vs fixed

    def eta_row(self, grid: Sequence[str]) -> dict:
        row = {"model": self.problem.name}
        auto = self.groups.get("PDVI defaults", [])
        row["auto_eta"] = auto[0].step_sizes.get("default", math.nan) if auto else math.nan
        per_site = self.groups.get("PDVI per_site", [])
        etas = list(per_site[0].step_sizes.values()) if per_site else []
        row["per_site_eta_range"] = (min(etas), max(etas)) if etas else None
        row["auto_setup"] = statistics.fmean(r.setup_seconds for r in auto) if auto else math.nan
        seed = auto[0].seed if auto else None
        # Compare on the seed the grid ran on, at the budget's end.
        row["auto_error"] = self._final(auto, seed)
        row["auto_status"] = status_of([r for r in auto if r.seed == seed])
        # The same over the last half of the budget (geometric mean of the records there).
        row["auto_late"] = self._late(auto, seed)
        fixed, fixed_late = {}, {}
        for config in grid:
            runs = self.groups.get(f"PDVI {config}", [])
            if runs:
                eta = PDVI_CONFIGS[config]["eta"]
                fixed[eta] = (self._final(runs, seed), status_of(runs))
                fixed_late[eta] = (self._late(runs, seed), status_of(runs))
        row["fixed"], row["fixed_late"] = fixed, fixed_late
        for suffix, errors in (("", fixed), ("_late", fixed_late)):
            best = best_fixed(errors)
            if best is not None:
                row[f"best_fixed_eta{suffix}"], row[f"best_fixed_error{suffix}"] = best
        return row

    def _final(self, runs: list[RunResult], seed) -> float | None:
        runs = [r for r in runs if r.seed == seed]
        return mean_at(runs, self.primary, seconds=self.budget) if runs else None

    def _late(self, runs: list[RunResult], seed) -> float | None:
        """The primary metric's geometric mean over the last half of the budget, on ``seed``."""
        run = next((r for r in runs if r.seed == seed), None)
        return late_geometric_mean(run.history, self.primary, self.budget) if run else None

    # ------------------------------------------------------------------ table 4: does the objective rise

    def rises_table(self) -> str:
        lines = [
            "| method | seed | epochs | epochs where -ELBO rose | largest rise (rel.) "
            "| end above best (rel.) |",
            "|---|---|---|---|---|---|",
        ]
        for label, runs in self.groups.items():
            for r in runs:
                rises = objective_rises(r.history)
                lines.append(
                    f"| {label} | {r.seed} | {fmt(r.epochs)} | {rises['rises']} | "
                    f"{fmt(rises['largest_rise'])} | {fmt(rises['end_above_best'])} |"
                )
        return "\n".join(lines)

    # ------------------------------------------------------------------ plot

    def plot(self, path: Path) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib not installed: no plot")
            return
        groups = self.main_groups()
        _, best_name = best_svi(groups, self.primary, seconds=self.budget)
        shown = {
            label: runs
            for label, runs in groups.items()
            if runs[0].family == "PDVI" or runs[0].config == best_name or "/(1+" in runs[0].config
        }
        fig, axes = plt.subplots(2, 2, figsize=(12, 8))
        for row, metric in enumerate((self.primary, self.secondary)):
            for col, axis in enumerate(("seconds", "epoch")):
                ax = axes[row][col]
                for label, runs in shown.items():
                    end = min(r.history[-1][axis] for r in runs)
                    grid = [end * i / 200 for i in range(201)]
                    find = at_seconds if axis == "seconds" else at_epoch
                    curves = []
                    for r in runs:
                        values = []
                        for x in grid:
                            point = find(r.history, x)
                            values.append(point.get(metric, math.nan) if point else math.nan)
                        curves.append(values)
                    mean = [
                        statistics.fmean(v) if all(map(math.isfinite, v)) else math.nan for v in zip(*curves)
                    ]
                    style = "--" if runs[0].family == "SVI" else "-"
                    name = f"{label} (best at end)" if runs[0].config == best_name else label
                    (line,) = ax.plot(grid, mean, style, label=name, lw=1.3)
                    if len(runs) > 1:
                        low = [min(v) for v in zip(*curves)]
                        high = [max(v) for v in zip(*curves)]
                        ax.fill_between(grid, low, high, color=line.get_color(), alpha=0.15, lw=0)
                if metric in GAP_METRICS:
                    ax.set_yscale("symlog", linthresh=1e-6)
                else:
                    ax.set_yscale("log")
                if axis == "epoch":  # PDVI runs few epochs where SVI runs hundreds
                    ax.set_xscale("symlog", linthresh=1.0)
                    ax.set_xlim(left=0)
                ax.set_xlabel("fitting CPU seconds (1 thread)" if axis == "seconds" else "epochs")
                ax.set_ylabel(metric)
        axes[0][0].legend(fontsize=7)
        fig.suptitle(
            f"{self.problem.title}\nmean and min-max over seeds (each curve ends where its shortest run "
            f"ended); reference: {self.reference.method}",
            fontsize=9,
        )
        fig.tight_layout()
        fig.savefig(path, dpi=80)
        plt.close(fig)


# --------------------------------------------------------------------------- tables over all models


def summary_table(rows: list[dict]) -> str:
    lines = [
        "| model | metric | budget CPU s | best SVI [config] | PDVI defaults | best PDVI [config] | "
        "equal epochs E | PDVI defaults @E | best SVI @E | PDVI defaults status |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        svi, best_at_e = row["best_svi"], row.get("best_svi_at_equal_epochs")
        best_pdvi = row.get("best_pdvi")
        cells = [
            row["model"],
            row["metric"],
            fmt(row["budget"]),
            f"{fmt(svi)} [{row['best_svi_config']}]",
            fmt(row["defaults"]) + ratio(row["defaults"], svi),
            f"{fmt(best_pdvi)}{ratio(best_pdvi, svi)} [{row.get('best_pdvi_config', '-')}]",
            fmt(row.get("equal_epochs")),
            fmt(row.get("defaults_at_equal_epochs")) + ratio(row.get("defaults_at_equal_epochs"), best_at_e),
            fmt(best_at_e),
            row["defaults_status"].replace("|", "/")[:120],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def standing_table(rows: list[dict], cost_rows: list[dict]) -> str:
    """README's "Where it stands": per model and checkpoint, PDVI defaults' errors over the best
    SVI's (means / sds / ELBO gap, :data:`~.metrics.STANDING`), and a step's cost over
    ``SVI.step``'s. Models whose checkpoints differ (the GMM) get their own header."""
    cost = {row["model"]: row["defaults_step"] / row["svi_step"] for row in cost_rows}
    lines, header = [], None
    for row in rows:
        checkpoints = list(row["ratios"])
        if checkpoints != header:
            header = checkpoints
            lines += [
                "| model (metrics) | "
                + " | ".join(f"{fmt(t)} s" for t in checkpoints)
                + " | PDVI step / SVI step |",
                "|---|" + "---|" * (len(checkpoints) + 1),
            ]
        cells = [f"{row['model']} ({' / '.join(row['metrics'])})"]
        cells += [" / ".join(fmt(r, 2) for r in row["ratios"][t]) for t in checkpoints]
        step = cost.get(row["model"], math.nan)
        cells.append(f"{step:.2g}x" if math.isfinite(step) else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cost_table(rows: list[dict]) -> str:
    lines = [
        "| model | blocks | SVI CPU s/step | PDVI defaults CPU s/step (ratio) | PDVI per_site CPU s/step "
        "(ratio) | model calls/step SVI, defaults, per_site | set-up CPU s defaults (SVI epochs) [calls] | "
        "set-up CPU s per_site (SVI epochs) [calls] |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        svi_epoch = row["svi_step"] * row["blocks"]
        cells = [row["model"], str(row["blocks"]), fmt(row["svi_step"])]
        for config in ("defaults", "per_site"):
            step = row[f"{config}_step"]
            cells.append(fmt(step) + (f" ({step / row['svi_step']:.3g}x)" if math.isfinite(step) else ""))
        cells.append(", ".join(fmt(row.get(f"{k}_calls", math.nan)) for k in ("svi", "defaults", "per_site")))
        for config in ("defaults", "per_site"):
            setup = row[f"{config}_setup"]
            calls = f" [{fmt(row.get(f'{config}_first_calls', math.nan))}]"
            if not math.isfinite(setup):  # every run spent its budget in the first step
                setup = row[f"{config}_setup_at_least"]
                cells.append(f">= {fmt(setup)} (>= {fmt(setup / svi_epoch)}){calls}")
            else:
                cells.append(f"{fmt(setup)} ({fmt(setup / svi_epoch)}){calls}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def best_fixed(errors: dict[float, tuple[float | None, str]]) -> tuple[float, float] | None:
    """The fixed eta with the lowest error and that error, among the runs that finished if any
    did (``errors``: eta -> (error, status))."""
    finished = {eta: err for eta, (err, status) in errors.items() if err is not None and status == "ok"}
    finite = finished or {eta: err for eta, (err, _) in errors.items() if err is not None}
    if not finite:
        return None
    eta = min(finite, key=finite.get)
    return eta, finite[eta]


def eta_table(rows: list[dict], primary: dict[str, str]) -> str:
    """``eta="auto"`` against the fixed step sizes on the grid's seed: the errors at the budget's
    end, and the ratio to the best fixed one both there and over the last half of the budget
    (geometric means of the records, which one record's noise does not decide)."""
    lines = [
        "| model | metric | eta auto (defaults) | set-up s | error, auto | error at each fixed eta | "
        "best fixed eta | best fixed / auto eta | error auto / best fixed | "
        "last half: auto / best fixed [eta] | per_site etas (min-max) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        fixed = ", ".join(
            f"{fmt(eta)}: {fmt(err)}" + ("" if status == "ok" else " (failed)")
            for eta, (err, status) in sorted(row["fixed"].items())
        )
        best_eta, best_err = row.get("best_fixed_eta"), row.get("best_fixed_error")
        span = row["per_site_eta_range"]
        cells = [
            row["model"],
            primary[row["model"]],
            fmt(row["auto_eta"]),
            fmt(row["auto_setup"]),
            fmt(row["auto_error"]) + ("" if row["auto_status"] == "ok" else " (failed)"),
            fixed or "-",
            fmt(best_eta),
            f"{best_eta / row['auto_eta']:.3g}" if best_eta else "-",
            f"{row['auto_error'] / best_err:.3g}" if best_err and row["auto_error"] is not None else "-",
            late_ratio(row),
            f"{fmt(span[0])} - {fmt(span[1])}" if span else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def late_ratio(row: dict) -> str:
    """The eta table's last-half cell: auto's error over the best fixed eta's, and that eta."""
    auto, best = row.get("auto_late"), row.get("best_fixed_error_late")
    if auto is None or not best:
        return "-"
    return f"{auto / best:.3g} [{fmt(row['best_fixed_eta_late'])}]"


def failures_table(results: list[RunResult]) -> str:
    """Per model and method: each seed's status if not ok, and the distinct warnings."""
    lines = ["| model | method | seeds | status | warnings |", "|---|---|---|---|---|"]
    rows: dict[tuple[str, str], list[RunResult]] = {}
    for r in results:
        rows.setdefault((r.model, r.label), []).append(r)
    for (model, label), runs in rows.items():
        warned: list[str] = []
        for r in runs:
            warned += [w for w in r.warnings if w.split(" (x")[0] not in [v.split(" (x")[0] for v in warned]]
        if status_of(runs) == "ok" and not warned:
            continue
        seeds = ",".join(str(r.seed) for r in runs)
        text = "; ".join(w[:160] for w in warned[:4]).replace("|", "/")
        lines.append(f"| {model} | {label} | {seeds} | {status_of(runs).replace('|', '/')} | {text} |")
    return "\n".join(lines)


def saddle_checks_table(results: list[RunResult]) -> str:
    """Per PDVI run that made a saddle check: its checks (``saddle_checks``), one cell each."""
    lines = ["| model | method | seed | checks |", "|---|---|---|---|"]
    for r in results:
        if not isinstance(r.saddle_checks, list) or not r.saddle_checks:
            continue
        cells = []
        for check in r.saddle_checks:
            rounds = "; ".join(
                f"{negative}, {smallest:.2g}{', moved' if moved else ''}"
                for negative, smallest, moved in check["rounds"]
            )
            failed = f" failed: {check['failed'][:80]}" if "failed" in check else ""
            cells.append(f"{check['epoch']} ({check['seconds']:.2f} s): {rounds or '-'}{failed}")
        lines.append(f"| {r.model} | {r.label} | {r.seed} | {' / '.join(cells).replace('|', '/')} |")
    return "\n".join(lines)


def write_csvs(out: Path, results: list[RunResult], accuracy_rows: list[dict], cost_rows, eta_rows) -> None:
    keys: list[str] = []
    for r in results:
        for row in r.history:
            keys += [k for k in row if k not in keys]
    with open(out / "history.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["model", "family", "config", "seed", *keys])
        writer.writeheader()
        for r in results:
            for row in r.history:
                writer.writerow(
                    {"model": r.model, "family": r.family, "config": r.config, "seed": r.seed, **row}
                )
    with open(out / "runs.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            ["model", "family", "config", "seed", "status", "epochs", "fit_cpu_s", "fit_wall_s", "steps",
             "median_step_s", "first_step_s", "setup_s", "median_model_calls", "first_model_calls",
             "step_sizes", "load_before", "load_after", "run_wall_s", "warnings", "saddle_checks"]
        )  # fmt: skip
        for r in results:
            writer.writerow(
                [r.model, r.family, r.config, r.seed, r.status, r.epochs, r.seconds, r.fit_wall_seconds,
                 r.num_steps, r.median_step, r.first_step, r.setup_seconds, r.median_calls, r.first_calls,
                 json.dumps(r.step_sizes), r.load[0], r.load[1], r.wall_seconds, " || ".join(r.warnings),
                 json.dumps(r.saddle_checks)]
            )  # fmt: skip
    for name, rows in (("accuracy", accuracy_rows), ("cost", cost_rows), ("eta", eta_rows)):
        if not rows:
            continue
        fields: list[str] = []
        for row in rows:
            fields += [k for k in row if k not in fields]
        with open(out / f"{name}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows({k: json.dumps(v) if isinstance(v, (dict, tuple)) else v for k, v in row.items()}
                             for row in rows)  # fmt: skip


def load_results(folder: Path) -> list[RunResult]:
    """The runs of a finished suite run, from its runs.csv and history.csv (for a new report
    with other checkpoints, or one report over runs made by several processes)."""
    histories: dict[tuple, list[dict]] = {}
    with open(folder / "history.csv", newline="") as f:
        for row in csv.DictReader(f):
            key = (row.pop("model"), row.pop("family"), row.pop("config"), int(row.pop("seed")))
            histories.setdefault(key, []).append({k: float(v) for k, v in row.items() if v != ""})
    results = []
    with open(folder / "runs.csv", newline="") as f:
        for row in csv.DictReader(f):
            key = (row["model"], row["family"], row["config"], int(row["seed"]))
            results.append(
                RunResult(
                    *key,
                    history=histories.get(key, []),
                    status=row["status"],
                    warnings=[w for w in row["warnings"].split(" || ") if w],
                    step_sizes=json.loads(row["step_sizes"]),
                    saddle_checks=json.loads(row.get("saddle_checks") or "[]"),  # absent before 13zn
                    load=(float(row["load_before"]), float(row["load_after"])),
                    wall_seconds=float(row["run_wall_s"]),
                    fit_wall_seconds=float(row["fit_wall_s"]),
                    num_steps=int(row["steps"]),
                    first_step=float(row["first_step_s"] or "nan"),
                    median_step=float(row["median_step_s"] or "nan"),
                    first_calls=float(row.get("first_model_calls") or "nan"),
                    median_calls=float(row.get("median_model_calls") or "nan"),
                )
            )
    return results
