"""MF-WGF (``pyro_pdvi.mfwgf.MFWGF``) against SVI with AutoNormal and against CAVI.

Sections (``--sections``, all by default):

* ``bias``: the stationary variance of the particle schemes against the exact mean-field
  variance ``1/Lambda_jj`` of a correlated Gaussian, over the step ``a h``: Euler-Maruyama
  (``ula``, the paper's scheme), Leimkuhler-Matthews without and with the drift-noise
  correction (``langevin``, the default), and KS distances of a skewed Gamma factor.
* ``accuracy``: W1 distance (over the reference standard deviation) of every fitted factor
  to the exact mean-field factor, on a model where a Gaussian factor is right (Bayesian
  linear regression, closed form) and on one where it is wrong (a bimodal, a skewed and a
  Gaussian factor; reference: CAVI on a 3-D grid). Methods: MF-WGF ``langevin`` and
  ``gaussian``, SVI + AutoNormal (Adam with decay) at several learning rates.
* ``gmm``: the project's Bayesian GMM, where CAVI gives the optimum: MF-WGF (E-step, then
  the JKO step on the centres) and SVI with the mean-field guide, against CAVI.
* ``scaling``: seconds per step against particles and dimension (Bayesian logistic
  regression), with SVI + AutoNormal's step for scale.

Every section prints a markdown table and writes ``<section>.csv`` (and a ``.png``) under
``--out``. Timings are wall-clock at ``--threads`` torch threads; compare methods within a
table. ``--device cuda`` runs everything on the GPU.

Example::

    python benchmarks/mfwgf.py --out results/mfwgf
"""

from __future__ import annotations

import argparse
import csv
import functools
import itertools
import math
import time
from pathlib import Path

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO, TraceEnum_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.infer.autoguide.initialization import init_to_median, init_to_value
from scipy import stats

from pyro_pdvi.mfwgf import MFWGF
from pyro_pdvi.models import GMMModel, cavi, kmeans, make_biased_gmm

SECTIONS = ("bias", "accuracy", "gmm", "scaling")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help="comma-separated subset of " + str(SECTIONS)
    )
    parser.add_argument("--out", default="results/mfwgf", help="folder for the CSV files and plots")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (timings are per this setting)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and of every method")
    parser.add_argument("--particles", type=int, default=2000, help="MF-WGF particles (accuracy, bias)")
    parser.add_argument("--steps", type=int, default=600, help="MF-WGF steps (accuracy)")
    parser.add_argument("--svi-steps", type=int, default=3000, help="SVI steps (accuracy, gmm)")
    parser.add_argument("--svi-lrs", default="0.01,0.03,0.1", help="Adam learning rates of SVI (decayed 10x)")
    parser.add_argument(
        "--svi-particles", default="1,32", help="ELBO particles of SVI + AutoNormal (accuracy)"
    )
    parser.add_argument("--bias-fractions", default="0.05,0.1,0.25,0.5,1.0", help="values of a*h (bias)")
    parser.add_argument("--bias-snapshots", type=int, default=100, help="steps averaged after burn-in (bias)")
    parser.add_argument("--grid", type=int, default=161, help="grid points per axis of grid CAVI (accuracy)")
    parser.add_argument("--gmm-data", type=int, default=500, help="N of the GMM")
    parser.add_argument("--gmm-particles", type=int, default=500, help="MF-WGF particles on the GMM")
    parser.add_argument("--gmm-steps", type=int, default=200, help="MF-WGF steps on the GMM")
    parser.add_argument("--scaling-particles", default="250,1000,4000", help="particle counts (scaling)")
    parser.add_argument("--scaling-dims", default="2,8,32,128", help="dimensions (scaling)")
    parser.add_argument("--scaling-steps", type=int, default=20, help="timed steps per setting (scaling)")
    parser.add_argument("--quiet", action="store_true", help="print only the tables")
    return parser.parse_args(argv)


def floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def table(title: str, rows: list[dict], out: Path, name: str) -> None:
    """Print a markdown table and write ``name.csv``."""
    print(f"\n### {title}\n")
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        cells = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()]
        print("| " + " | ".join(cells) + " |")
    with open(out / f"{name}.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


# ----------------------------------------------------------------------------- metrics

QUANTILE_LEVELS = (np.arange(4000) + 0.5) / 4000


def empirical_quantiles(samples: torch.Tensor) -> np.ndarray:
    return np.quantile(samples.detach().cpu().double().numpy(), QUANTILE_LEVELS)


def w1_over_sd(quantiles: np.ndarray, reference: np.ndarray) -> float:
    """W1 of two 1-D laws from their quantiles at QUANTILE_LEVELS, over the reference's sd."""
    return float(np.abs(quantiles - reference).mean() / reference.std())


def gaussian_quantiles(loc: float, scale: float, transform=lambda v: v) -> np.ndarray:
    return transform(loc + scale * stats.norm.ppf(QUANTILE_LEVELS))


def grid_quantiles(probs: torch.Tensor, grid: torch.Tensor, transform=lambda v: v) -> np.ndarray:
    cdf = probs.cumsum(0).cpu().numpy()
    return transform(np.interp(QUANTILE_LEVELS, cdf, grid.cpu().numpy()))


# ----------------------------------------------------------------------------- models


def correlated_gaussian(device: torch.device):
    """N(m, Sigma), unit variances and correlation 0.9: both factors have precision
    Lambda_jj = 1 / 0.19, so one step size gives both the same ``a h``."""
    mean = torch.tensor([1.0, -2.0], device=device)
    covariance = torch.tensor([[1.0, 0.9], [0.9, 1.0]], device=device)

    def model():
        pyro.sample("theta", dist.MultivariateNormal(mean, covariance))

    return model, 1 / torch.linalg.inv(covariance).diagonal()


def gamma_model(shape):
    """A Gamma(2, 3) site (``shape`` = 2.0 as a tensor on the device)."""
    pyro.sample("scale", dist.Gamma(shape, 3.0))


def linear_regression(x, y, noise=0.5):
    w = pyro.sample("w", dist.Normal(x.new_zeros(()), 1.0).expand([x.shape[1]]).to_event(1))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Normal((x * w).sum(-1), noise), obs=y)


def linear_regression_problem(device: torch.device, seed: int, dim: int = 6, num_data: int = 50):
    """Correlated features (shared factor): the mean-field optimum is N(m_j, 1/Lambda_jj)."""
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randn(num_data, 1, generator=generator)
    x = (0.8 * shared + 0.6 * torch.randn(num_data, dim, generator=generator)).to(device)
    truth = torch.randn(dim, generator=generator).to(device)
    y = x @ truth + 0.5 * torch.randn(num_data, generator=generator).to(device)
    precision = torch.eye(dim, device=device) + x.T @ x / 0.25
    mean = torch.linalg.solve(precision, x.T @ y / 0.25)
    reference = {
        f"w[{j}]": gaussian_quantiles(float(mean[j]), float(precision[j, j] ** -0.5)) for j in range(dim)
    }
    return linear_regression, (x, y), reference


#: Counts and exposures of the Poisson-rates model: few events, so skewed Gamma factors.
COUNTS = (0.0, 0.0, 1.0, 3.0, 8.0)
EXPOSURES = (1.0, 4.0, 1.0, 2.0, 1.0)


def poisson_rates(counts, exposures):
    """rate_g ~ Exponential(1), counts_g ~ Poisson(rate_g exposure_g): independent conjugate
    sites, so mean field is exact and q(rate_g) = Gamma(1 + count_g, 1 + exposure_g)."""
    with pyro.plate("groups", counts.shape[0]):
        rate = pyro.sample("rate", dist.Exponential(counts.new_ones(())))
        pyro.sample("counts", dist.Poisson(rate * exposures), obs=counts)


def poisson_rates_problem(device: torch.device):
    counts, exposures = torch.tensor(COUNTS, device=device), torch.tensor(EXPOSURES, device=device)
    reference = {
        f"rate[{g}]": stats.gamma.ppf(QUANTILE_LEVELS, 1 + COUNTS[g], scale=1 / (1 + EXPOSURES[g]))
        for g in range(len(COUNTS))
    }
    return poisson_rates, (counts, exposures), reference


def bimodal_skewed(y, x):
    """y_i ~ N(theta1^2, sigma), x_j ~ N(theta2, sigma): q(theta1) is bimodal, q(sigma) skewed."""
    zero = y.new_zeros(())  # priors on the data's device, so the particles are too
    theta1 = pyro.sample("theta1", dist.Normal(zero, 2.0))
    theta2 = pyro.sample("theta2", dist.Normal(zero, 2.0))
    sigma = pyro.sample("sigma", dist.HalfNormal(zero + 2.0))
    with pyro.plate("y_data", y.shape[0]):
        pyro.sample("y", dist.Normal(theta1.square(), sigma), obs=y)
    with pyro.plate("x_data", x.shape[0]):
        pyro.sample("x", dist.Normal(theta2, sigma), obs=x)


def bimodal_skewed_data(seed: int, device: torch.device):
    generator = torch.Generator().manual_seed(seed)
    y = 1.3**2 + 0.6 * torch.randn(6, generator=generator)
    x = -1.0 + 0.6 * torch.randn(6, generator=generator)
    return y.to(device), x.to(device)


def bimodal_skewed_log_joint(theta1, theta2, log_sigma, y, x):
    """log p in the unconstrained coordinates (theta1, theta2, log sigma), Jacobian included."""
    sigma = log_sigma.exp()
    log_p = dist.Normal(0.0, 2.0).log_prob(theta1) + dist.Normal(0.0, 2.0).log_prob(theta2)
    log_p = log_p + dist.HalfNormal(2.0).log_prob(sigma) + log_sigma
    log_p = log_p + dist.Normal(theta1.square()[..., None], sigma[..., None]).log_prob(y).sum(-1)
    return log_p + dist.Normal(theta2[..., None], sigma[..., None]).log_prob(x).sum(-1)


def symmetric_start(device: torch.device):
    """Start between the two modes of theta1 (the other sites at their prior medians)."""
    return init_to_value(values={"theta1": torch.zeros((), device=device)}, fallback=init_to_median)


POSITIVE_SITES = ("sigma", "rate")

AXES = {"theta1": (-3.5, 3.5), "theta2": (-3.0, 1.0), "log_sigma": (-3.0, 1.5)}


def grid_cavi_3d(y, x, size: int, iterations: int = 2000):
    """CAVI over three factors on a grid [seed 001]: q_j ∝ exp(E_{q_-j} log p), to a fixed point."""
    grids = [torch.linspace(*AXES[name], size, dtype=y.dtype, device=y.device) for name in AXES]
    mesh = torch.meshgrid(*grids, indexing="ij")
    log_joint = bimodal_skewed_log_joint(*mesh, y, x)
    factors = [torch.full((size,), 1.0 / size, dtype=y.dtype, device=y.device) for _ in range(3)]
    for _ in range(iterations):
        previous = torch.cat(factors)
        factors[0] = torch.softmax(torch.einsum("ijk,j,k->i", log_joint, factors[1], factors[2]), 0)
        factors[1] = torch.softmax(torch.einsum("ijk,i,k->j", log_joint, factors[0], factors[2]), 0)
        factors[2] = torch.softmax(torch.einsum("ijk,i,j->k", log_joint, factors[0], factors[1]), 0)
        if float((torch.cat(factors) - previous).abs().max()) < 1e-13:
            break
    edge = max(float(f[0] + f[-1]) for f in factors)
    return grids, factors, edge


# ----------------------------------------------------------------------------- fitting


def fit_mfwgf(model, args: tuple, steps: int, device: torch.device, **kwargs):
    mf = MFWGF(model, **kwargs)
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        mf.step(*args)
    sync(device)
    return mf, time.perf_counter() - start


def fit_autonormal(
    model, args: tuple, steps: int, lr: float, device: torch.device, init_loc_fn=init_to_median, particles=1
):
    """SVI + AutoNormal with Adam, the learning rate decayed 10x over the run; ``particles``
    ELBO samples per step (vectorised)."""
    pyro.clear_param_store()
    guide = AutoNormal(model, init_loc_fn=init_loc_fn)
    optim = pyro.optim.ClippedAdam({"lr": lr, "lrd": 0.1 ** (1 / steps)})
    svi = SVI(model, guide, optim, Trace_ELBO(num_particles=particles, vectorize_particles=particles > 1))
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        svi.step(*args)
    sync(device)
    return guide, time.perf_counter() - start


# ----------------------------------------------------------------------------- sections


def section_bias(args, device: torch.device, out: Path) -> list[dict]:
    model, optimum = correlated_gaussian(device)
    precision = float(1 / optimum[0])
    gamma_cdf = lambda v: stats.gamma.cdf(v, 2.0, scale=1 / 3.0)  # noqa: E731
    settings = [("ula", {}), ("langevin", {"drift_noise_correction": False}), ("langevin", {})]
    labels = ["ULA", "LM, no correction", "LM (default)"]
    rows = []
    for fraction in floats(args.bias_fractions):
        row = {"a h": fraction, "ULA theory 1/(1 - a h/2)": 1 / (1 - fraction / 2)}
        burn_in = int(10 / fraction) + 50
        for label, (scheme, options) in zip(labels, settings):
            pyro.set_rng_seed(args.seed)
            mf, _ = fit_mfwgf(
                model,
                (),
                burn_in,
                device,
                num_particles=args.particles,
                scheme=scheme,
                step_size=fraction / precision,
                **options,
            )
            ratios = []
            for _ in range(args.bias_snapshots):
                mf.step()
                ratios.append(mf.get_samples()["theta"].var(0) / optimum)
            row[f"{label} var/opt"] = float(torch.stack(ratios).mean())
        for label, scheme in (("ULA", "ula"), ("LM", "langevin")):
            pyro.set_rng_seed(args.seed)
            gamma_shape = (torch.tensor(2.0, device=device),)
            gamma_mf, _ = fit_mfwgf(
                gamma_model,
                gamma_shape,
                burn_in,
                device,
                num_particles=args.particles,
                scheme=scheme,
                step_size=fraction / 2,
            )
            pooled = []
            for _ in range(args.bias_snapshots):
                gamma_mf.step(*gamma_shape)
                pooled.append(gamma_mf.get_samples()["scale"])
            row[f"{label} Gamma KS"] = float(
                stats.kstest(torch.cat(pooled).cpu().numpy(), gamma_cdf).statistic
            )
        rows.append(row)
    table(
        f"Stationary variance / mean-field optimum, correlated Gaussian (unit variances, rho = 0.9: "
        f"optimum 0.19, a = 1/0.19 in both factors), {args.particles} "
        f"particles, averaged over {args.bias_snapshots} steps; KS distance to the exact CDF of a "
        "Gamma(2, 3) "
        "factor moved in log space (curvature a = 2 at its mode, so h = (a h) / 2), particles pooled over "
        "the same steps",
        rows,
        out,
        "bias",
    )
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(5, 3.5))
    steps = [row["a h"] for row in rows]
    for key in [k for k in rows[0] if k.endswith("var/opt") or k.startswith("ULA theory")]:
        axis.plot(steps, [row[key] for row in rows], "o-", label=key)
    axis.set_xlabel("a h")
    axis.set_ylabel("variance / mean-field optimum")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "bias.png", dpi=120)
    plt.close(figure)
    return rows


def split_factor(name: str) -> tuple[str, int | None]:
    """``"w[3]"`` -> ``("w", 3)``; ``"sigma"`` -> ``("sigma", None)``."""
    if "[" in name:
        site, index = name[:-1].split("[")
        return site, int(index)
    return name, None


def constrain(name: str):
    """Unconstrained to constrained for a factor name: exp for the positive sites."""
    return np.exp if split_factor(name)[0] in POSITIVE_SITES else (lambda v: v)


def particle_quantiles(mf: MFWGF, name: str) -> np.ndarray:
    site, index = split_factor(name)
    samples = mf.get_samples()[site]
    return empirical_quantiles(samples if index is None else samples[:, index])


def gaussian_factor_quantiles(mf: MFWGF, name: str) -> np.ndarray:
    site, index = split_factor(name)
    loc, scale = mf.gaussian_factors()[site]
    if index is not None:
        loc, scale = loc[index], scale[index]
    return gaussian_quantiles(float(loc), float(scale), constrain(name))


def autonormal_quantiles(guide: AutoNormal, name: str) -> np.ndarray:
    site, index = split_factor(name)
    loc, scale = getattr(guide.locs, site).detach(), getattr(guide.scales, site).detach()
    if index is not None:
        loc, scale = loc[index], scale[index]
    return gaussian_quantiles(float(loc), float(scale), constrain(name))


def exact_sample_quantiles(reference: np.ndarray, size: int, seed: int) -> np.ndarray:
    """Quantiles of an exact sample of ``size`` (inverse-CDF draws): the noise floor of ``size`` particles."""
    uniforms = stats.uniform.rvs(size=size, random_state=seed)
    return np.quantile(np.interp(uniforms, QUANTILE_LEVELS, reference), QUANTILE_LEVELS)


def accuracy_row(problem: str, reference: dict, method: str, steps: int, seconds: float, quantiles) -> dict:
    """One method's W1/sd per factor; ``quantiles(name)`` gives its quantiles of factor ``name``."""
    cells = {name: w1_over_sd(quantiles(name), ref) for name, ref in reference.items()}
    return {
        "model": problem,
        "method": method,
        "steps": steps,
        "seconds": seconds,
        "max W1/sd": max(cells.values()),
        **cells,
    }


def section_accuracy(args, device: torch.device, out: Path) -> list[dict]:
    y, x = bimodal_skewed_data(args.seed, device)
    grids, factors, edge = grid_cavi_3d(y, x, args.grid)
    bimodal_reference = {  # exact factors of the bimodal + skewed model
        "theta1": grid_quantiles(factors[0], grids[0]),
        "theta2": grid_quantiles(factors[1], grids[1]),
        "sigma": grid_quantiles(factors[2], grids[2], np.exp),
    }
    problems = {
        "linear regression (Gaussian right)": (*linear_regression_problem(device, args.seed), init_to_median),
        "Poisson rates, 0-8 events (skewed)": (*poisson_rates_problem(device), init_to_median),
        # every method starts at theta1 = 0, between the two modes (see the docs for why)
        "bimodal theta1, skewed sigma": (
            bimodal_skewed,
            (y, x),
            bimodal_reference,
            symmetric_start(device),
        ),
    }
    rows, autonormal_fits = [], {}
    for problem, (model, model_args, reference, init_loc_fn) in problems.items():
        row = functools.partial(accuracy_row, problem, reference)
        exact = {
            name: exact_sample_quantiles(ref, args.particles, args.seed) for name, ref in reference.items()
        }
        rows.append(row(f"exact sample of {args.particles} (noise floor)", 0, 0.0, exact.__getitem__))
        pyro.set_rng_seed(args.seed)
        mf, seconds = fit_mfwgf(
            model, model_args, args.steps, device, num_particles=args.particles, init_loc_fn=init_loc_fn
        )
        rows.append(
            row(
                f"MF-WGF langevin, {args.particles} particles",
                args.steps,
                seconds,
                lambda name, mf=mf: particle_quantiles(mf, name),
            )
        )
        particles = mf.get_samples()
        pyro.set_rng_seed(args.seed)
        mf, seconds = fit_mfwgf(
            model,
            model_args,
            args.steps,
            device,
            num_particles=32,
            scheme="gaussian",
            init_loc_fn=init_loc_fn,
        )
        rows.append(
            row(
                "MF-WGF gaussian, 32 configurations",
                args.steps,
                seconds,
                lambda name, mf=mf: gaussian_factor_quantiles(mf, name),
            )
        )
        for lr, elbo_particles in itertools.product(floats(args.svi_lrs), ints(args.svi_particles)):
            pyro.set_rng_seed(args.seed)
            guide, seconds = fit_autonormal(
                model, model_args, args.svi_steps, lr, device, init_loc_fn, elbo_particles
            )
            method = f"SVI AutoNormal, Adam lr {lr:g}, {elbo_particles} ELBO particles"
            quantiles = functools.partial(autonormal_quantiles, guide)
            rows.append(row(method, args.svi_steps, seconds, quantiles))
            if model is bimodal_skewed:  # AutoNormal's Gaussians for the figure, read before the next fit
                autonormal_fits[method] = {
                    k: (float(getattr(guide.locs, k).detach()), float(getattr(guide.scales, k).detach()))
                    for k in reference
                }
    summary = [{k: r[k] for k in ("model", "method", "steps", "seconds", "max W1/sd")} for r in rows]
    table(
        f"W1 / sd to the exact mean-field factor, worst factor; reference: closed form (regression) or "
        f"CAVI on a {args.grid}^3 grid (tail mass at its edges {edge:.1e})",
        summary,
        out,
        "accuracy",
    )
    per_factor = [
        {k: v for k, v in r.items() if k not in ("model", "steps", "seconds", "max W1/sd")}
        for r in rows
        if r["model"].startswith("bimodal")
    ]
    table("W1 / sd per factor, bimodal + skewed model", per_factor, out, "accuracy_factors")
    scores = {r["method"]: r["max W1/sd"] for r in rows if r["model"].startswith("bimodal")}
    best = min(autonormal_fits, key=scores.__getitem__)
    plot_factors(factors, grids, particles, autonormal_fits[best], best, out)
    return rows


def pyplot():
    """matplotlib's pyplot on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_factors(factors, grids, particles: dict, autonormal: dict, label: str, out: Path) -> None:
    """Histograms of the particles against the grid CAVI factors and AutoNormal's Gaussians."""
    plt = pyplot()
    figure, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    for axis, name, grid, probs in zip(axes, ("theta1", "theta2", "sigma"), grids, factors):
        values = grid.exp() if name == "sigma" else grid
        axis.hist(particles[name].cpu().numpy(), bins=60, density=True, alpha=0.5, label="MF-WGF particles")
        axis.plot(
            values.cpu(), (probs / torch.gradient(values)[0]).cpu(), "k", label="exact factor (grid CAVI)"
        )
        density = torch.distributions.Normal(*autonormal[name]).log_prob(grid).exp()
        if name == "sigma":  # AutoNormal is Gaussian in log sigma
            density = density / values
        axis.plot(values.cpu(), density.cpu(), "r--", label=label.replace("SVI ", ""))
        axis.set_title(name)
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out / "accuracy.png", dpi=120)
    plt.close(figure)


def section_gmm(args, device: torch.device, out: Path) -> list[dict]:
    data = make_biased_gmm(args.gmm_data, 3, 2, args.gmm_data, 1.0 / 3.0, seed=args.seed, separation=1.5)
    points, prior = data.data.to(device), data.prior.to(torch.float64, device)
    centres = kmeans(points, 3)[0]
    sync(device)
    start = time.perf_counter()
    reference = cavi(points, prior, m=centres)
    sync(device)
    cavi_seconds = time.perf_counter() - start
    ref_sd = reference.rho.exp().sqrt()

    def errors(loc, var):
        return {
            "max |mean err|/sd": float(((loc - reference.m).abs() / ref_sd).max()),
            "max |var/var* - 1|": float((var / reference.rho.exp() - 1).abs().max()),
        }

    rows = [
        {
            "method": f"CAVI ({len(reference.losses)} sweeps)",
            "seconds": cavi_seconds,
            **errors(reference.m, reference.rho.exp()),
        }
    ]
    model = GMMModel(points, prior, collapsed=True).model
    start_at = init_to_value(values={"c": centres})
    for scheme, particles in (("langevin", args.gmm_particles), ("gaussian", 14)):
        pyro.set_rng_seed(args.seed)
        mf, seconds = fit_mfwgf(
            model, (), args.gmm_steps, device, num_particles=particles, scheme=scheme, init_loc_fn=start_at
        )
        if scheme == "gaussian":
            loc, scale = mf.gaussian_factors()["c"]
            loc, var, count = loc, scale.square(), f"{particles} configurations"
        else:
            c = mf.get_samples()["c"]
            loc, var, count = c.mean(0), c.var(0), f"{particles} particles"
        rows.append(
            {
                "method": f"MF-WGF {scheme}, {count}, {args.gmm_steps} steps",
                "seconds": seconds,
                **errors(loc, var),
            }
        )
    for lr in floats(args.svi_lrs):
        pyro.clear_param_store()
        pyro.set_rng_seed(args.seed)
        gmm = GMMModel(points, prior, init_means=centres)
        optim = pyro.optim.ClippedAdam({"lr": lr, "lrd": 0.1 ** (1 / args.svi_steps)})
        svi = SVI(gmm.model, gmm.guide, optim, TraceEnum_ELBO(max_plate_nesting=1))
        sync(device)
        start = time.perf_counter()
        for _ in range(args.svi_steps):
            svi.step()
        sync(device)
        seconds = time.perf_counter() - start
        fitted = errors(pyro.param("m").detach(), pyro.param("rho").detach().exp())
        method = f"SVI mean-field guide, Adam lr {lr:g}, {args.svi_steps} steps"
        rows.append({"method": method, "seconds": seconds, **fitted})
    table(
        f"GMM (N = {args.gmm_data}, K = 3, d = 2, overlapping clusters): q(c) against the CAVI optimum",
        rows,
        out,
        "gmm",
    )
    return rows


def logistic_regression(x, y):
    w = pyro.sample("w", dist.Normal(x.new_zeros(()), 1.0).expand([x.shape[1]]).to_event(1))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=(x * w).sum(-1)), obs=y)


def timed_steps(count: int, scheme: str, x, y, args, device: torch.device) -> tuple[float, float]:
    """Milliseconds of the first step (set-up and curvature measurement) and per later step
    (no re-measurement), on the logistic regression."""
    pyro.set_rng_seed(args.seed)
    mf = MFWGF(logistic_regression, num_particles=count, scheme=scheme, remeasure=False)
    sync(device)
    start = time.perf_counter()
    mf.step(x, y)
    sync(device)
    first = time.perf_counter() - start
    mf.step(x, y)  # warm-up
    sync(device)
    start = time.perf_counter()
    for _ in range(args.scaling_steps):
        mf.step(x, y)
    sync(device)
    return 1e3 * first, 1e3 * (time.perf_counter() - start) / args.scaling_steps


def section_scaling(args, device: torch.device, out: Path) -> list[dict]:
    rows = []
    for dim in ints(args.scaling_dims):
        generator = torch.Generator().manual_seed(args.seed)
        x = torch.randn(200, dim, generator=generator)
        y = torch.bernoulli(torch.sigmoid(x.sum(-1) / math.sqrt(dim)), generator=generator)
        x, y = x.to(device), y.to(device)
        _, gaussian = timed_steps(2 * (dim + 1), "gaussian", x, y, args, device)
        pyro.set_rng_seed(args.seed)
        _, seconds = fit_autonormal(logistic_regression, (x, y), args.scaling_steps, 0.01, device)
        for particles in ints(args.scaling_particles):
            first, per_step = timed_steps(particles, "langevin", x, y, args, device)
            rows.append(
                {
                    "dim": dim,
                    "particles": particles,
                    "langevin first step ms": first,
                    "langevin ms/step": per_step,
                    "gaussian ms/step (2(D+1) draws)": gaussian,
                    "SVI AutoNormal ms/step": 1e3 * seconds / args.scaling_steps,
                }
            )
    table(
        f"Milliseconds per step, Bayesian logistic regression with N = 200 and D features, one factor per "
        f"coordinate; mean of {args.scaling_steps} steps after the first (set-up, curvature) and one warm-up "
        "step; the gaussian and SVI columns are measured once per D",
        rows,
        out,
        "scaling",
    )
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(5, 3.5))
    for dim in ints(args.scaling_dims):
        subset = [row for row in rows if row["dim"] == dim]
        axis.loglog(
            [r["particles"] for r in subset],
            [r["langevin ms/step"] for r in subset],
            "o-",
            label=f"D = {dim}",
        )
    axis.set_xlabel("particles")
    axis.set_ylabel("ms per step (langevin)")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "scaling.png", dpi=120)
    plt.close(figure)
    return rows


def main(args: argparse.Namespace) -> dict[str, list[dict]]:
    torch.set_num_threads(args.threads)
    torch.set_default_dtype(torch.float64)
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    if not args.quiet:
        print(f"torch {torch.__version__}, pyro {pyro.__version__}, device {device}, threads {args.threads}")
    run = {"bias": section_bias, "accuracy": section_accuracy, "gmm": section_gmm, "scaling": section_scaling}
    return {name: run[name](args, device, out) for name in sections}


if __name__ == "__main__":
    main(parse_args())
