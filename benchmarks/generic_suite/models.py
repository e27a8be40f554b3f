"""The model suite of issue 13: Pyro model/guide pairs as a user would write them, their data
and their fixed, non-i.i.d. blocks (sorted by a covariate or a label).

Every problem's model and guide take one argument, ``idx``, the subsample of the data plate
``pyro.plate("data", N, subsample=idx)``; a step of SVI or PDVI is ``step(blocks[b])``. The
initial params depend on the problem only (not on the run's seed), so every method and every
seed starts from the same point and one reference optimum serves all runs, also for the
non-convex PPCA and GMM. Data are built in float64 and cast to the run's dtype; the
references (:mod:`.references`) keep the float64 copies.

=============  ========================================================================
name           model
=============  ========================================================================
``logreg``     Bayesian logistic regression, sklearn's breast_cancer (569 x 30,
               standardised, + intercept), ``w ~ N(0, I)``, ``AutoNormal``, 20 blocks
               sorted by label, ``Trace_ELBO()``
``ppca``       probabilistic PCA on sklearn's digits (1,797 x 64, centred, one global
               scale), K = 5, ``W ~ N(0, 1)``, ``z_i ~ N(0, I)``, known noise sd 0.7;
               hand-written mean-field guide with local ``z_loc``/``z_scale`` rows
               (``event_dim=1`` inside the data plate), 40 blocks sorted by digit,
               ``Trace_ELBO(num_particles=8, vectorize_particles=True)``
``ppca_cancer`` the same PPCA on sklearn's breast_cancer (569 x 30, each feature
               standardised), 20 blocks sorted by label: a second data set whose loadings
               pass near saddles of their rotation (``docs/benchmarks.md`` 13zn)
``mixed``      random intercept + slope, 30 groups (synthetic, 10-30 rows each, the
               groups' x ranges differ), LogNormal hyper-scales ``tau_a, tau_b`` and
               noise sd ``sigma`` as latent sites, ``AutoNormal``, one block per group,
               ``TraceMeanField_ELBO(num_particles=16, vectorize_particles=True)``
``hier``       hierarchical normal of README / docs/benchmarks.md section 2: ``mu ~ N(0,
               10^2)``, ``theta_i ~ N(mu, 1)``, ``x_i ~ N(theta_i, 0.5^2)``, N = 200,
               ``AutoNormal`` with the data plate, 20 blocks sorted by x,
               ``TraceMeanField_ELBO()`` (one particle, Pyro's default)
``scale``      linear regression with unknown noise sd, sklearn's diabetes (442 x 10,
               standardised, + intercept; y standardised), ``w ~ N(0, I)``,
               ``sigma ~ HalfNormal(1)`` (the guide's q(sigma) is LogNormal),
               ``AutoNormal``, 20 blocks sorted by bmi, ``Trace_ELBO()``
``odlogit``    overdispersed logistic regression: ``logreg``'s data and prior with a
               per-datum random effect ``u_i ~ N(0, 1)`` added to the logit (a local
               Gaussian latent per datum), ``AutoNormal`` with the data plate, 20 blocks
               sorted by label, ``Trace_ELBO()``
``gmm``        the paper's Bayesian GMM through the generic path:
               :class:`pyro_pdvi.models.GMMModel`, K = 5, d = 10, blocks of 1,000 that
               are 95% one cluster (:func:`pyro_pdvi.models.make_biased_gmm`),
               ``TraceEnum_ELBO(max_plate_nesting=1, num_particles=16,
               vectorize_particles=True)`` as in the README; N = 100,000 (quick: 5,000)
``robust``     Student-t linear regression written as a scale mixture, a model none of
               PDVI's defaults were tuned on (added in session 39): ``scale``'s data and
               priors, a precision weight per datum ``weight_i ~ Gamma(2, 2)`` (4 degrees
               of freedom) and ``y_i ~ N(x_i w, sigma^2 / weight_i)``; the guide's
               q(weight_i) is LogNormal (a positive local latent per datum),
               ``AutoNormal`` with the data plate, 20 blocks sorted by age,
               ``Trace_ELBO()``
``poisson``    Poisson regression with a random intercept per site (a log link: the
               exponential's curvature), synthetic counts: 2,000 rows over 40 sites, an
               intercept and 4 covariates, ``w ~ N(0, I)``, ``a_g ~ N(0, tau^2)``,
               ``tau ~ HalfNormal(1)`` (LogNormal q), ``AutoNormal``, 20 blocks sorted by
               the first covariate (time), so every block sees most sites; added in
               session 39 as a model the defaults had not seen, where PDVI was behind
               until the whitening saw the ties between sites (``docs/benchmarks.md``
               13zo)
``poisson200`` the same model with 200 sites and 10,000 rows (50 a site): 206 coordinates of
               tied sites, more than the whitening measures by unit vectors (64); the
               sites' effects are measured by probes (13zo)
``poisson200_few`` the same 200 sites with 2,000 rows (10 a site): the priors pull the sites'
               effects more, and the tie is weaker (13zo)
``poisson1000`` the same model with 1,000 sites and 20,000 rows (20 a site): a group of 1,006
               tied coordinates, more than a dense penalty takes (session 40, 13zp)
``poisson_slopes`` ``poisson200``'s design with a random slope on time per site too
               (``b_g ~ N(0, tau_b^2)``, ``tau_b ~ HalfNormal(1)``): each site's intercept and
               slope tied to each other, which the whitening's probes refuse (13zp)
``poisson_nested`` ``poisson200``'s design with the 200 sites nested in 20 regions and a random
               intercept per region too (``c_r ~ N(0, tau_c^2)``, ``tau_c ~ HalfNormal(1)``):
               each region's effect tied to its ten sites' (session 41, 13zr)
``poisson_crossed`` ``poisson200``'s design with a random intercept per period of time too (40
               periods, ``d_p ~ N(0, tau_d^2)``, ``tau_d ~ HalfNormal(1)``): crossed random
               effects, each period's inside one block (session 41, 13zs)
``poisson_nested100`` ``poisson_nested`` with 100 regions (two sites each): the regions' and the
               sites' effects both larger than 64 coordinates and tied, every block informing
               both (session 42, 13zu)
``poisson_crossed200`` ``poisson_crossed`` with 200 periods (50 rows each, about 10 to a
               block): the periods' and the sites' effects both larger than 64 coordinates
               (session 42, 13zu)
``poisson_nested_slopes`` ``poisson_slopes``' 200 sites nested in 100 regions with a random
               intercept per region too: each site's intercept and slope tied to each other and
               both to their region's effect (session 43, 13zw)
``poisson_three_levels`` ``poisson_nested100``'s 200 sites in 100 regions, the regions nested in
               20 countries with a random intercept per country too (session 43, 13zx)
``negbin``     negative-binomial regression (known total count 2) with a random intercept per
               site, synthetic: 20 sites of 100 rows, one block per site (data sorted by
               site, as by patient), ``AutoNormal``, ``Trace_ELBO()`` (session 39)
``biglogreg``  ``logreg``'s model at scale: 100,000 synthetic rows (quick: 10,000) of 20
               correlated covariates + intercept, labels from a logistic model with
               coefficients ~ N(0, 0.5^2), ``AutoNormal``, 100 blocks (quick: 10) sorted by
               label, ``Trace_ELBO()``
=============  ========================================================================
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.distributions import constraints
from pyro.infer import Trace_ELBO, TraceEnum_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_pdvi.checks import check_positive_int
from pyro_pdvi.models import GMMModel, make_biased_gmm

PROBLEM_NAMES = (
    "logreg",
    "ppca",
    "mixed",
    "hier",
    "scale",
    "odlogit",
    "gmm",
    "biglogreg",
    "ppca_cancer",
    "robust",
    "poisson",
    "poisson200",
    "poisson200_few",
    "poisson1000",
    "poisson_slopes",
    "poisson_nested",
    "poisson_crossed",
    "poisson_nested100",
    "poisson_crossed200",
    "poisson_nested_slopes",
    "poisson_three_levels",
    "negbin",
)


def sorted_blocks(keys: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """Indices sorted by ``keys`` (stable, so ties keep the data order), cut into
    ``num_blocks`` contiguous chunks of (nearly) equal size: non-i.i.d. blocks."""
    order = torch.sort(keys, stable=True).indices
    return [chunk.sort().values for chunk in order.tensor_split(num_blocks)]


def standardise(x: torch.Tensor) -> torch.Tensor:
    return (x - x.mean(0)) / x.std(0)


def design_matrix(features, num_data: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``num_data`` rows of the standardised ``features`` (float64), and the same
    with an intercept column in front."""
    standardised = standardise(torch.as_tensor(features, dtype=torch.float64))[:num_data]
    ones = torch.ones(len(standardised), 1, dtype=torch.float64)
    return standardised, torch.cat([ones, standardised], 1)


@dataclass
class Problem:
    """One model of the suite.

    :param name: short name (``--models``).
    :param title: one line for tables and plots.
    :param num_data: N, the size of the data plate.
    :param blocks: the fixed blocks, 1-D LongTensors that partition ``range(N)``.
    :param loss_class: the ELBO class the user runs with.
    :param loss_kwargs: its keyword arguments as the user passes them.
    :param primary: the metric that ranks methods (see :mod:`.metrics`).
    :param data: float64 tensors the closed forms need (see :mod:`.references`).
    """

    name: str
    title: str
    num_data: int
    blocks: list[torch.Tensor]
    loss_class: type
    loss_kwargs: dict
    primary: str
    data: dict[str, torch.Tensor] = field(default_factory=dict)
    #: Calls of :meth:`model` so far: the runner counts them per step, a cost measure that,
    #: unlike seconds, does not depend on what else runs on the machine.
    model_calls: int = 0

    def model(self, idx: torch.Tensor | None = None) -> None:
        """The Pyro model on the subsample ``idx`` of the data plate (counted)."""
        self.model_calls += 1
        self._model(idx)

    def _model(self, idx: torch.Tensor | None) -> None:
        raise NotImplementedError

    def make_guide(self) -> Callable:
        """A fresh guide (its params are created at its first call)."""
        raise NotImplementedError

    def make_loss(self, particles: int | None = None):
        """The user's ELBO; with ``particles``, the same ELBO with that many vectorized particles."""
        kwargs = dict(self.loss_kwargs)
        if particles is not None:
            kwargs.update(num_particles=particles, vectorize_particles=True)
        return self.loss_class(**kwargs)

    def set_user_particles(self, particles: int) -> None:
        """Make the user's ELBO draw ``particles`` (vectorized if more than one; one is Pyro's
        default)."""
        check_positive_int(particles, "particles")
        self.loss_kwargs = {
            k: v for k, v in self.loss_kwargs.items() if k not in ("num_particles", "vectorize_particles")
        }
        if particles > 1:
            self.loss_kwargs.update(num_particles=particles, vectorize_particles=True)

    def initialise(self, guide: Callable, first_block: torch.Tensor) -> None:
        """Create the guide's params (one call on the first block, no gradient, nothing recorded)."""
        with torch.no_grad(), poutine.block():
            guide(first_block)

    def place(self, device: torch.device | str) -> Problem:
        """Move the run's tensors (data and blocks; not the float64 copies) to ``device``."""
        for name in ("x", "y", "group", "site"):
            if hasattr(self, name):
                setattr(self, name, getattr(self, name).to(device))
        self.blocks = [block.to(device) for block in self.blocks]
        return self

    @property
    def loss_name(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.loss_kwargs.items())
        return f"{self.loss_class.__name__}({args})"


def _data_plate(num_data: int) -> Callable:
    return lambda idx=None: pyro.plate("data", num_data, subsample=idx)


# --------------------------------------------------------------------------- 1. logistic regression


class LogisticRegression(Problem):
    """Bayesian logistic regression on breast_cancer, blocks sorted by label."""

    prior_scale = 1.0
    #: The suite's name of the model, and how its title describes it and its guide.
    short_name = "logreg"
    description = "Bayesian logistic regression"
    guide_description = "AutoNormal"

    def __init__(self, dtype: torch.dtype, num_data: int | None = None, num_blocks: int = 20) -> None:
        x, y, source = self.load(num_data)
        super().__init__(
            name=self.short_name,
            title=f"{self.description}, {source} ({len(x)} x {x.shape[1]}), "
            f"{self.guide_description}, {num_blocks} blocks sorted by label",
            num_data=len(x),
            blocks=sorted_blocks(y, num_blocks),
            loss_class=Trace_ELBO,
            loss_kwargs={},
            primary="rmse_mean",
            data={"x": x, "y": y},
        )
        self.x, self.y = x.to(dtype), y.to(dtype)

    @staticmethod
    def load(num_data: int | None) -> tuple[torch.Tensor, torch.Tensor, str]:
        """The design matrix with an intercept, the labels (float64) and the data's name: the
        first ``num_data`` rows of breast_cancer."""
        from sklearn.datasets import load_breast_cancer

        raw = load_breast_cancer()
        _, x = design_matrix(raw.data, num_data)
        return x, torch.as_tensor(raw.target, dtype=torch.float64)[:num_data], "breast_cancer"

    def _model(self, idx):
        w = pyro.sample(
            "w", dist.Normal(self.x.new_zeros(()), self.prior_scale).expand([self.x.shape[1]]).to_event(1)
        )
        with pyro.plate("data", self.num_data, subsample=idx) as ind:
            logits = (self.x[ind] * w).sum(-1)
            pyro.sample("y", dist.Bernoulli(logits=logits), obs=self.y[ind])

    def make_guide(self):
        return AutoNormal(self.model)


class LargeLogisticRegression(LogisticRegression):
    """:class:`LogisticRegression` on data too many for one batch: ``num_data`` synthetic rows
    (100,000 by default) of 20 correlated covariates, labels drawn from a logistic model with
    known coefficients, blocks sorted by label. A likelihood that is not quadratic in the
    coefficients, at the sizes PDVI is for."""

    short_name = "biglogreg"
    num_covariates = 20

    @classmethod
    def load(cls, num_data: int | None) -> tuple[torch.Tensor, torch.Tensor, str]:
        generator = torch.Generator().manual_seed(0)
        num_data = num_data or 100_000
        size = cls.num_covariates
        mixing = torch.eye(size, dtype=torch.float64) + torch.randn(
            size, size, generator=generator, dtype=torch.float64
        ) / (2 * size**0.5)
        features = torch.randn(num_data, size, generator=generator, dtype=torch.float64) @ mixing
        _, x = design_matrix(features, None)
        coefficients = 0.5 * torch.randn(size + 1, generator=generator, dtype=torch.float64)
        y = torch.bernoulli(torch.sigmoid(x @ coefficients), generator=generator)
        return x, y, "synthetic"


class OverdispersedLogistic(LogisticRegression):
    """:class:`LogisticRegression` with a random effect per datum on the logit: a local
    Gaussian latent per datum, as in a model of extra-binomial variation."""

    effect_scale = 1.0
    short_name = "odlogit"
    description = "overdispersed logistic regression (local u_i)"
    guide_description = "AutoNormal with the data plate"

    def _model(self, idx):
        w = pyro.sample(
            "w", dist.Normal(self.x.new_zeros(()), self.prior_scale).expand([self.x.shape[1]]).to_event(1)
        )
        with pyro.plate("data", self.num_data, subsample=idx) as ind:
            u = pyro.sample("u", dist.Normal(self.x.new_zeros(()), self.effect_scale))
            pyro.sample("y", dist.Bernoulli(logits=(self.x[ind] * w).sum(-1) + u), obs=self.y[ind])

    def make_guide(self):
        return AutoNormal(self.model, create_plates=_data_plate(self.num_data))


# --------------------------------------------------------------------------- 2. PPCA


class PPCA(Problem):
    """Probabilistic PCA with a local ``z_i`` per datum, blocks sorted by label: sklearn's digits
    (``ppca``, centred, one global scale: some pixels are constant) or breast_cancer
    (``ppca_cancer``, each feature standardised).

    :param num_data: the first this many data (all where ``None``).
    :param num_blocks: blocks sorted by label.
    :param dataset: ``"digits"`` or ``"breast_cancer"``.
    """

    latent_dim = 5
    noise_scale = 0.7
    prior_scale = 1.0
    init_loading_scale = 0.1
    init_scale = 0.1

    def __init__(
        self, dtype: torch.dtype, num_data: int | None = None, num_blocks: int = 40, dataset: str = "digits"
    ) -> None:
        from sklearn.datasets import load_breast_cancer, load_digits

        if dataset not in ("digits", "breast_cancer"):
            raise ValueError(f"PPCA's dataset is 'digits' or 'breast_cancer', not {dataset!r}")
        raw = load_digits() if dataset == "digits" else load_breast_cancer()
        features = torch.as_tensor(raw.data, dtype=torch.float64)
        labels = torch.as_tensor(raw.target)
        if num_data is not None:
            features, labels = features[:num_data], labels[:num_data]
        centred = features - features.mean(0)
        x = centred / (centred.std() if dataset == "digits" else centred.std(0))
        super().__init__(
            name="ppca" if dataset == "digits" else "ppca_cancer",
            title=f"PPCA K={self.latent_dim}, {dataset} ({len(x)} x {x.shape[1]}), local z, "
            f"{num_blocks} blocks sorted by {'digit' if dataset == 'digits' else 'label'}",
            num_data=len(x),
            blocks=sorted_blocks(labels, num_blocks),
            loss_class=Trace_ELBO,
            loss_kwargs={"num_particles": 8, "vectorize_particles": True},
            primary="elbo_gap",
            data={"x": x},
        )
        self.x = x.to(dtype)
        generator = torch.Generator().manual_seed(0)
        # Random small loadings break the symmetry W = 0; z starts at the prior.
        self.init = {
            "W_loc": self.init_loading_scale
            * torch.randn(x.shape[1], self.latent_dim, generator=generator, dtype=torch.float64),
            "W_scale": torch.full((x.shape[1], self.latent_dim), self.init_scale, dtype=torch.float64),
            "z_loc": torch.zeros(len(x), self.latent_dim, dtype=torch.float64),
            "z_scale": torch.ones(len(x), self.latent_dim, dtype=torch.float64),
        }

    def _model(self, idx):
        dim, k = self.x.shape[1], self.latent_dim
        zero = self.x.new_zeros(())
        loadings = pyro.sample("W", dist.Normal(zero, self.prior_scale).expand([dim, k]).to_event(2))
        with pyro.plate("data", self.num_data, subsample=idx) as ind:
            z = pyro.sample("z", dist.Normal(zero, 1.0).expand([k]).to_event(1))
            mean = (z.unsqueeze(-2) * loadings).sum(-1)
            pyro.sample("x", dist.Normal(mean, self.noise_scale).to_event(1), obs=self.x[ind])

    def make_guide(self):
        init = {k: v.to(self.x) for k, v in self.init.items()}

        def guide(idx=None):
            w_loc = pyro.param("W_loc", lambda: init["W_loc"].clone())
            w_scale = pyro.param("W_scale", lambda: init["W_scale"].clone(), constraint=constraints.positive)
            pyro.sample("W", dist.Normal(w_loc, w_scale).to_event(2))
            with pyro.plate("data", self.num_data, subsample=idx):
                z_loc = pyro.param("z_loc", lambda: init["z_loc"].clone(), event_dim=1)
                z_scale = pyro.param(
                    "z_scale", lambda: init["z_scale"].clone(), constraint=constraints.positive, event_dim=1
                )
                pyro.sample("z", dist.Normal(z_loc, z_scale).to_event(1))

        return guide


# --------------------------------------------------------------------------- 3. mixed effects


class MixedEffects(Problem):
    """Random intercept + slope per group with latent hyper-scales and noise sd, one block per group."""

    fixed_prior_scale = 5.0

    def __init__(self, dtype: torch.dtype, num_groups: int = 30) -> None:
        generator = torch.Generator().manual_seed(0)

        def randn(*shape):
            return torch.randn(*shape, generator=generator, dtype=torch.float64)

        sizes = torch.randint(10, 31, (num_groups,), generator=generator)
        group = torch.repeat_interleave(torch.arange(num_groups), sizes)
        # Each group sees its own range of x: the blocks differ in what they say about the slope.
        centre = 2.0 * randn(num_groups)
        x = centre[group] + randn(len(group))
        intercepts, slopes = 1.0 * randn(num_groups), 0.5 * randn(num_groups)
        y = 1.0 + intercepts[group] + (-0.5 + slopes[group]) * x + 0.5 * randn(len(group))
        super().__init__(
            name="mixed",
            title=f"random intercept + slope, {num_groups} groups ({len(y)} rows), LogNormal "
            "hyper-scales, AutoNormal, one block per group",
            num_data=len(y),
            blocks=[torch.nonzero(group == g).reshape(-1) for g in range(num_groups)],
            loss_class=TraceMeanField_ELBO,
            loss_kwargs={"num_particles": 16, "vectorize_particles": True},
            primary="rmse_mean",
            data={"x": x, "y": y, "group": group},
        )
        self.num_groups = num_groups
        self.x, self.y, self.group = x.to(dtype), y.to(dtype), group

    def _model(self, idx):
        zero = self.x.new_zeros(())
        alpha = pyro.sample("alpha", dist.Normal(zero, self.fixed_prior_scale))
        beta = pyro.sample("beta", dist.Normal(zero, self.fixed_prior_scale))
        tau_a = pyro.sample("tau_a", dist.LogNormal(zero, 1.0))
        tau_b = pyro.sample("tau_b", dist.LogNormal(zero, 1.0))
        sigma = pyro.sample("sigma", dist.LogNormal(zero, 1.0))
        with pyro.plate("groups", self.num_groups):
            a = pyro.sample("a", dist.Normal(zero, tau_a))
            b = pyro.sample("b", dist.Normal(zero, tau_b))
        with pyro.plate("data", self.num_data, subsample=idx) as ind:
            g = self.group[ind]
            mean = alpha + a[..., g] + (beta + b[..., g]) * self.x[ind]
            pyro.sample("y", dist.Normal(mean, sigma), obs=self.y[ind])

    def make_guide(self):
        return AutoNormal(self.model)


# --------------------------------------------------------------------------- 4. hierarchical normal


class HierarchicalNormal(Problem):
    """The hierarchical normal model of README and docs/benchmarks.md, blocks sorted by x."""

    prior_scale, theta_scale, noise_scale = 10.0, 1.0, 0.5

    def __init__(self, dtype: torch.dtype, num_data: int = 200, num_blocks: int = 20) -> None:
        generator = torch.Generator().manual_seed(0)
        x = torch.sort(torch.randn(num_data, generator=generator, dtype=torch.float64) * 2 + 1).values
        super().__init__(
            name="hier",
            title=f"hierarchical normal, N={num_data}, AutoNormal, {num_blocks} blocks sorted by x",
            num_data=num_data,
            blocks=sorted_blocks(x, num_blocks),
            loss_class=TraceMeanField_ELBO,
            loss_kwargs={},
            primary="mu_error",
            data={"x": x},
        )
        self.x = x.to(dtype)

    def _model(self, idx):
        zero = self.x.new_zeros(())
        mu = pyro.sample("mu", dist.Normal(zero, self.prior_scale))
        with pyro.plate("data", self.num_data, subsample=idx) as ind:
            theta = pyro.sample("theta", dist.Normal(mu, self.theta_scale))
            pyro.sample("x", dist.Normal(theta, self.noise_scale), obs=self.x[ind])

    def make_guide(self):
        return AutoNormal(self.model, create_plates=_data_plate(self.num_data))


# --------------------------------------------------------------------------- 5. unknown noise scale


def diabetes(num_data: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
    """sklearn's diabetes data, its first ``num_data`` rows: the standardised features, the same
    with an intercept column in front, the standardised target (float64) and the features' names."""
    from sklearn.datasets import load_diabetes

    raw = load_diabetes()
    features, x = design_matrix(raw.data, num_data)
    y = standardise(torch.as_tensor(raw.target, dtype=torch.float64))[:num_data]
    return features, x, y, list(raw.feature_names)


class NormalScale(Problem):
    """Linear regression with an unknown noise sd (LogNormal guide site), blocks sorted by bmi."""

    prior_scale = 1.0
    sigma_prior_scale = 1.0

    def __init__(self, dtype: torch.dtype, num_data: int | None = None, num_blocks: int = 20) -> None:
        features, x, y, names = diabetes(num_data)
        bmi = names.index("bmi")
        super().__init__(
            name="scale",
            title=f"linear regression, unknown noise sd (HalfNormal prior, LogNormal q), diabetes "
            f"({len(x)} x {x.shape[1]}), AutoNormal, {num_blocks} blocks sorted by bmi",
            num_data=len(x),
            blocks=sorted_blocks(features[:, bmi], num_blocks),
            loss_class=Trace_ELBO,
            loss_kwargs={},
            primary="rmse_mean",
            data={"x": x, "y": y},
        )
        self.x, self.y = x.to(dtype), y.to(dtype)

    def _model(self, idx):
        zero = self.x.new_zeros(())
        w = pyro.sample("w", dist.Normal(zero, self.prior_scale).expand([self.x.shape[1]]).to_event(1))
        sigma = pyro.sample("sigma", dist.HalfNormal(zero + self.sigma_prior_scale))
        with pyro.plate("data", self.num_data, subsample=idx) as ind:
            pyro.sample("y", dist.Normal((self.x[ind] * w).sum(-1), sigma), obs=self.y[ind])

    def make_guide(self):
        return AutoNormal(self.model)


class RobustRegression(Problem):
    """Student-t linear regression as a scale mixture of normals, on ``scale``'s data: each
    datum has its own precision weight, a positive local latent, ``weight_i ~ Gamma(nu/2,
    nu/2)``, and ``y_i ~ N(x_i w, sigma^2 / weight_i)``, which integrates to a Student-t with
    ``nu`` degrees of freedom. Blocks sorted by age."""

    prior_scale = 1.0
    sigma_prior_scale = 1.0
    degrees_of_freedom = 4.0

    def __init__(self, dtype: torch.dtype, num_data: int | None = None, num_blocks: int = 20) -> None:
        features, x, y, names = diabetes(num_data)
        age = names.index("age")
        super().__init__(
            name="robust",
            title=f"Student-t regression, a Gamma weight per datum (LogNormal q), diabetes "
            f"({len(x)} x {x.shape[1]}), AutoNormal, {num_blocks} blocks sorted by age",
            num_data=len(x),
            blocks=sorted_blocks(features[:, age], num_blocks),
            loss_class=Trace_ELBO,
            loss_kwargs={},
            primary="rmse_mean",
            data={"x": x, "y": y},
        )
        self.x, self.y = x.to(dtype), y.to(dtype)

    def _model(self, idx):
        zero = self.x.new_zeros(())
        half_nu = zero + 0.5 * self.degrees_of_freedom
        w = pyro.sample("w", dist.Normal(zero, self.prior_scale).expand([self.x.shape[1]]).to_event(1))
        sigma = pyro.sample("sigma", dist.HalfNormal(zero + self.sigma_prior_scale))
        with pyro.plate("data", self.num_data, subsample=idx) as ind:
            weight = pyro.sample("weight", dist.Gamma(half_nu, half_nu))
            mean = (self.x[ind] * w).sum(-1)
            pyro.sample("y", dist.Normal(mean, sigma * weight.rsqrt()), obs=self.y[ind])

    def make_guide(self):
        return AutoNormal(self.model, create_plates=_data_plate(self.num_data))


class PoissonRandomIntercept(Problem):
    """Poisson log-linear regression with a Gaussian random intercept per site, synthetic
    counts, blocks sorted by time (the first covariate): the sites' intercepts are shared
    across the blocks, and each block sees its own stretch of time."""

    prior_scale = 1.0
    tau_prior_scale = 1.0

    def __init__(
        self,
        dtype: torch.dtype,
        num_data: int = 2000,
        num_sites: int = 40,
        num_blocks: int = 20,
        name: str = "poisson",
    ) -> None:
        generator = torch.Generator().manual_seed(0)

        def randn(*shape):
            return torch.randn(*shape, generator=generator, dtype=torch.float64)

        covariates = randn(num_data, 4)
        x = torch.cat([torch.ones(num_data, 1, dtype=torch.float64), covariates], 1)
        site = torch.randint(num_sites, (num_data,), generator=generator)
        coefficients = torch.tensor([1.0, 0.5, -0.3, 0.2, 0.4], dtype=torch.float64)
        rate = torch.exp(x @ coefficients + 0.5 * randn(num_sites)[site])
        y = torch.poisson(rate, generator=generator)
        self._set_counts(
            dtype,
            name,
            f"Poisson regression with a random intercept per site, {num_data} rows, "
            f"{num_sites} sites, AutoNormal, {num_blocks} blocks sorted by time",
            x,
            y,
            site,
            num_sites,
            sorted_blocks(covariates[:, 0], num_blocks),
        )

    def _set_counts(
        self,
        dtype: torch.dtype,
        name: str,
        title: str,
        x: torch.Tensor,
        y: torch.Tensor,
        site: torch.Tensor,
        num_sites: int,
        blocks: list[torch.Tensor],
    ) -> None:
        """The :class:`Problem` of design ``x`` (float64), counts ``y`` and each row's ``site`` of
        ``num_sites``."""
        Problem.__init__(
            self,
            name=name,
            title=title,
            num_data=len(y),
            blocks=blocks,
            loss_class=Trace_ELBO,
            loss_kwargs={},
            primary="rmse_mean",
            data={"x": x, "y": y, "site": site},
        )
        self.num_sites = num_sites
        self.x, self.y, self.site = x.to(dtype), y.to(dtype), site

    def _redraw_counts(self, effects: list[torch.Tensor], generator: torch.Generator, title: str) -> None:
        """New counts from ``generator``, their log rate the design's coefficients' plus each of
        ``effects`` (float64, one value per row), under ``title``: the data of a model that adds
        effects to this one's."""
        log_rate = self.data["x"] @ torch.tensor([1.0, 0.5, -0.3, 0.2, 0.4], dtype=torch.float64)
        for effect in effects:
            log_rate = log_rate + effect
        y = torch.poisson(torch.exp(log_rate), generator=generator)
        self.data["y"], self.title, self.y = y, title, y.to(self.x.dtype)

    def _model(self, idx):
        zero = self.x.new_zeros(())
        w = pyro.sample("w", dist.Normal(zero, self.prior_scale).expand([self.x.shape[1]]).to_event(1))
        scales = self.effect_scales(zero)
        with pyro.plate("sites", self.num_sites):
            effects = {name: pyro.sample(name, dist.Normal(zero, scale)) for name, scale in scales.items()}
        effects.update(self.grouped_effects(zero))
        with pyro.plate("data", self.num_data, subsample=idx) as ind:
            log_mean = (self.x[ind] * w).sum(-1) + self.site_terms(effects, ind)
            pyro.sample("y", self.likelihood(log_mean), obs=self.y[ind])

    def effect_scales(self, zero: torch.Tensor) -> dict[str, torch.Tensor]:
        """Samples the prior scale of each kind of site effect: ``a``'s, ``tau``."""
        return {"a": pyro.sample("tau", dist.HalfNormal(zero + self.tau_prior_scale))}

    def grouped_effects(self, zero: torch.Tensor) -> dict[str, torch.Tensor]:
        """Samples the effects of groups of sites or rows, each kind in its own plate (none here)."""
        return {}

    def group_intercepts(
        self, zero: torch.Tensor, name: str, scale: str, count: int
    ) -> dict[str, torch.Tensor]:
        """A random intercept ``name`` for each of ``count`` groups, in the plate ``name + "_groups"``,
        with the prior scale ``scale ~ HalfNormal``: :meth:`grouped_effects`' effects."""
        tau = pyro.sample(scale, dist.HalfNormal(zero + self.tau_prior_scale))
        with pyro.plate(f"{name}_groups", count):
            return {name: pyro.sample(name, dist.Normal(zero, tau))}

    def site_terms(self, effects: dict[str, torch.Tensor], ind: torch.Tensor) -> torch.Tensor:
        """Each row's share of the log mean from its site's effects."""
        return effects["a"][..., self.site[ind]]

    def likelihood(self, log_mean: torch.Tensor) -> dist.Distribution:
        """The counts' distribution given their log mean."""
        return dist.Poisson(log_mean.exp())

    def make_guide(self):
        return AutoNormal(self.model)


class PoissonRandomSlopes(PoissonRandomIntercept):
    """:class:`PoissonRandomIntercept` with a random slope per site on time (the first covariate)
    too, ``b_g ~ N(0, tau_b^2)``, ``tau_b ~ HalfNormal(1)``: a growth curve per site. Each site's
    intercept and slope are tied to each other (time is not centred within a block) as well as to
    the shared coefficients."""

    def __init__(
        self, dtype: torch.dtype, num_data: int = 10_000, num_sites: int = 200, num_blocks: int = 20
    ) -> None:
        super().__init__(dtype, num_data, num_sites, num_blocks, name="poisson_slopes")
        generator = torch.Generator().manual_seed(2)
        slopes = 0.3 * torch.randn(num_sites, generator=generator, dtype=torch.float64)
        x, site = self.data["x"], self.data["site"]
        intercepts = 0.5 * torch.randn(num_sites, generator=generator, dtype=torch.float64)
        self._redraw_counts(
            [intercepts[site], slopes[site] * x[:, 1]],
            generator,
            f"Poisson regression with a random intercept and a random slope on time per site, "
            f"{num_data} rows, {num_sites} sites, AutoNormal, {num_blocks} blocks sorted by time",
        )

    def effect_scales(self, zero: torch.Tensor) -> dict[str, torch.Tensor]:
        scales = super().effect_scales(zero)
        scales["b"] = pyro.sample("tau_b", dist.HalfNormal(zero + self.tau_prior_scale))
        return scales

    def site_terms(self, effects: dict[str, torch.Tensor], ind: torch.Tensor) -> torch.Tensor:
        return super().site_terms(effects, ind) + effects["b"][..., self.site[ind]] * self.x[ind, 1]


class PoissonGroupedIntercepts(PoissonRandomIntercept):
    """:class:`PoissonRandomIntercept` with a random intercept per group of rows too, each row's
    group in ``groups``: the effect ``effect`` in its own plate, its scale ``scale ~
    HalfNormal(1)``. :class:`PoissonNestedIntercepts` and :class:`PoissonCrossedIntercepts` choose
    the groups."""

    def _set_groups(
        self,
        effect: str,
        scale: str,
        groups: torch.Tensor,
        num_groups: int,
        seed: int,
        site_scale: float,
        title: str,
    ) -> None:
        """Set the groups and draw new counts from ``seed``: the groups' intercepts (sd 0.5), then the
        sites' (sd ``site_scale``)."""
        self.effect, self.scale, self.groups, self.num_groups = effect, scale, groups, num_groups
        generator = torch.Generator().manual_seed(seed)
        grouped = 0.5 * torch.randn(num_groups, generator=generator, dtype=torch.float64)
        sites = site_scale * torch.randn(self.num_sites, generator=generator, dtype=torch.float64)
        self._redraw_counts([sites[self.data["site"]], grouped[groups]], generator, title)

    def _nest_sites(self, num_regions: int) -> None:
        """The sites nested in ``num_regions`` regions (site ``g`` in region ``g mod R``), a random
        intercept ``c`` per region with its scale ``tau_c``; the counts are the caller's to draw."""
        self.effect, self.scale, self.num_groups = "c", "tau_c", num_regions
        self.groups = (torch.arange(self.num_sites) % num_regions)[self.data["site"]]

    def grouped_effects(self, zero: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.group_intercepts(zero, self.effect, self.scale, self.num_groups)

    def site_terms(self, effects: dict[str, torch.Tensor], ind: torch.Tensor) -> torch.Tensor:
        return super().site_terms(effects, ind) + effects[self.effect][..., self.groups[ind]]


class PoissonNestedIntercepts(PoissonGroupedIntercepts):
    """The sites nested in regions (site ``g`` in region ``g mod R``), a random intercept per region
    too, ``c_r ~ N(0, tau_c^2)``: each region's effect is tied to its sites' (and all to the shared
    coefficients), not position by position, so the whitening's probes refuse the two together."""

    def __init__(
        self,
        dtype: torch.dtype,
        num_data: int = 10_000,
        num_sites: int = 200,
        num_regions: int = 20,
        num_blocks: int = 20,
        name: str = "poisson_nested",
    ) -> None:
        super().__init__(dtype, num_data, num_sites, num_blocks, name=name)
        region = (torch.arange(num_sites) % num_regions)[self.data["site"]]
        self._set_groups(
            "c", "tau_c", region, num_regions, 3, 0.3,
            f"Poisson regression with a random intercept per site and per region, {num_data} rows, "
            f"{num_sites} sites in {num_regions} regions, AutoNormal, {num_blocks} blocks sorted by time",
        )  # fmt: skip


class PoissonCrossedIntercepts(PoissonGroupedIntercepts):
    """A random intercept per period of time too (the rows cut into ``num_periods`` runs of equal
    size by time), ``d_p ~ N(0, tau_d^2)``: crossed random effects, a site's and a period's. The
    blocks are sorted by time, so each period's effect is informed by one block, and each site's by
    every block."""

    def __init__(
        self,
        dtype: torch.dtype,
        num_data: int = 10_000,
        num_sites: int = 200,
        num_periods: int = 40,
        num_blocks: int = 20,
        name: str = "poisson_crossed",
    ) -> None:
        super().__init__(dtype, num_data, num_sites, num_blocks, name=name)
        period = torch.empty(num_data, dtype=torch.long)
        period[self.data["x"][:, 1].argsort()] = torch.arange(num_data) * num_periods // num_data
        self._set_groups(
            "d", "tau_d", period, num_periods, 4, 0.5,
            f"Poisson regression with a random intercept per site and per period of time, {num_data} "
            f"rows, {num_sites} sites, {num_periods} periods, AutoNormal, {num_blocks} blocks sorted by time",
        )  # fmt: skip


class PoissonNestedSlopes(PoissonGroupedIntercepts, PoissonRandomSlopes):
    """:class:`PoissonRandomSlopes`' sites nested in regions (site ``g`` in region ``g mod R``) with
    a random intercept per region, ``c_r ~ N(0, tau_c^2)``: each site's intercept and slope are tied
    to each other, and both to their region's effect (a growth curve per site, sites in regions)."""

    def __init__(
        self,
        dtype: torch.dtype,
        num_data: int = 10_000,
        num_sites: int = 200,
        num_regions: int = 100,
        num_blocks: int = 20,
        name: str = "poisson_nested_slopes",
    ) -> None:
        PoissonRandomIntercept.__init__(self, dtype, num_data, num_sites, num_blocks, name=name)
        self._nest_sites(num_regions)
        site, time = self.data["site"], self.data["x"][:, 1]
        generator = torch.Generator().manual_seed(5)
        regions = 0.5 * torch.randn(num_regions, generator=generator, dtype=torch.float64)
        intercepts = 0.3 * torch.randn(num_sites, generator=generator, dtype=torch.float64)
        slopes = 0.3 * torch.randn(num_sites, generator=generator, dtype=torch.float64)
        self._redraw_counts(
            [intercepts[site], slopes[site] * time, regions[self.groups]],
            generator,
            f"Poisson regression with a random intercept and a random slope on time per site, a random "
            f"intercept per region, {num_data} rows, {num_sites} sites in {num_regions} regions, "
            f"AutoNormal, {num_blocks} blocks sorted by time",
        )


class PoissonThreeLevels(PoissonGroupedIntercepts):
    """:class:`PoissonNestedIntercepts`' sites nested in regions (site ``g`` in region ``g mod R``),
    the regions nested in countries (region ``r`` in country ``r mod Q``), a random intercept per
    site, region and country (``k_q ~ N(0, tau_k^2)``, ``tau_k ~ HalfNormal(1)``): three levels."""

    def __init__(
        self,
        dtype: torch.dtype,
        num_data: int = 10_000,
        num_sites: int = 200,
        num_regions: int = 100,
        num_countries: int = 20,
        num_blocks: int = 20,
        name: str = "poisson_three_levels",
    ) -> None:
        PoissonRandomIntercept.__init__(self, dtype, num_data, num_sites, num_blocks, name=name)
        self._nest_sites(num_regions)
        self.num_countries = num_countries
        self.countries = (torch.arange(num_regions) % num_countries)[self.groups]
        generator = torch.Generator().manual_seed(7)
        sites = 0.3 * torch.randn(num_sites, generator=generator, dtype=torch.float64)
        regions = 0.4 * torch.randn(num_regions, generator=generator, dtype=torch.float64)
        countries = 0.5 * torch.randn(num_countries, generator=generator, dtype=torch.float64)
        self._redraw_counts(
            [sites[self.data["site"]], regions[self.groups], countries[self.countries]],
            generator,
            f"Poisson regression with a random intercept per site, region and country, {num_data} rows, "
            f"{num_sites} sites in {num_regions} regions in {num_countries} countries, AutoNormal, "
            f"{num_blocks} blocks sorted by time",
        )

    def grouped_effects(self, zero: torch.Tensor) -> dict[str, torch.Tensor]:
        effects = super().grouped_effects(zero)
        effects.update(self.group_intercepts(zero, "k", "tau_k", self.num_countries))
        return effects

    def site_terms(self, effects: dict[str, torch.Tensor], ind: torch.Tensor) -> torch.Tensor:
        return super().site_terms(effects, ind) + effects["k"][..., self.countries[ind]]


class NegativeBinomialRandomIntercept(PoissonRandomIntercept):
    """:class:`PoissonRandomIntercept`'s design with a negative-binomial likelihood (mean
    ``exp(x w + a_site)``, total count :attr:`total_count`, known) and one block per site: the
    data sorted by site, so that each site's effect is informed by its own block only."""

    total_count = 2.0

    def __init__(self, dtype: torch.dtype, num_sites: int = 20, rows_per_site: int = 100) -> None:
        generator = torch.Generator().manual_seed(1)
        num_data = num_sites * rows_per_site
        covariates = torch.randn(num_data, 4, generator=generator, dtype=torch.float64)
        x = torch.cat([torch.ones(num_data, 1, dtype=torch.float64), covariates], 1)
        site = torch.arange(num_sites).repeat_interleave(rows_per_site)
        effects = 0.5 * torch.randn(num_sites, generator=generator, dtype=torch.float64)
        mean = torch.exp(x @ torch.tensor([1.0, 0.5, -0.3, 0.2, 0.4], dtype=torch.float64) + effects[site])
        # A negative binomial draw as a Gamma-Poisson mixture with the same mean (torch's Gamma
        # draws from the global generator: seeded here, and the caller's state kept).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            rate = torch.distributions.Gamma(self.total_count, self.total_count / mean).sample()
        y = torch.poisson(rate, generator=generator)
        self._set_counts(
            dtype,
            "negbin",
            f"negative-binomial regression (total count {self.total_count:g}) with a random "
            f"intercept per site, {num_sites} sites of {rows_per_site} rows, AutoNormal, one block per site",
            x,
            y,
            site,
            num_sites,
            [torch.nonzero(site == g).reshape(-1) for g in range(num_sites)],
        )

    def likelihood(self, log_mean: torch.Tensor) -> dist.Distribution:
        return dist.NegativeBinomial(self.total_count, logits=log_mean - math.log(self.total_count))


# --------------------------------------------------------------------------- 6. GMM


class GMM(Problem):
    """The flagship's Bayesian GMM through the generic Pyro path (:class:`GMMModel`)."""

    def __init__(
        self,
        dtype: torch.dtype,
        num_data: int = 100_000,
        block_size: int = 1000,
        purity: float = 0.95,
        num_components: int = 5,
        dim: int = 10,
    ) -> None:
        synthetic = make_biased_gmm(num_data, num_components, dim, block_size, purity, seed=0)
        gmm64 = GMMModel(synthetic.data, synthetic.prior, seed=0)
        super().__init__(
            name="gmm",
            title=f"GMM K={num_components} d={dim}, N={num_data}, generic path, "
            f"{len(synthetic.blocks)} blocks of {block_size} ({purity:.0%} one cluster)",
            num_data=num_data,
            blocks=synthetic.blocks,
            loss_class=TraceEnum_ELBO,
            loss_kwargs={"max_plate_nesting": 1, "num_particles": 16, "vectorize_particles": True},
            primary="w2_ratio",
            data={"x": synthetic.data, "centers": synthetic.centers},
        )
        self.prior64 = synthetic.prior
        self.init64 = {
            "m": gmm64.init_means,
            "rho": gmm64.init_log_variances,
            "alpha": gmm64.init_logits,
        }
        self.gmm = GMMModel(
            synthetic.data.to(dtype),
            synthetic.prior.to(dtype),
            init_means=gmm64.init_means.to(dtype),
            init_log_variances=gmm64.init_log_variances.to(dtype),
            init_logits=gmm64.init_logits.to(dtype),
        )

    def place(self, device: torch.device | str) -> Problem:
        gmm = self.gmm
        self.gmm = GMMModel(
            gmm.data.to(device),
            gmm.prior,
            init_means=gmm.init_means.to(device),
            init_log_variances=gmm.init_log_variances.to(device),
            init_logits=gmm.init_logits.to(device),
        )
        self.blocks = [block.to(device) for block in self.blocks]
        return self

    def _model(self, idx):
        self.gmm.model(idx)

    def make_guide(self):
        return self.gmm.guide


# --------------------------------------------------------------------------- sizes


def make_problem(
    name: str, quick: bool = False, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> Problem:
    """The problem ``name`` at full size, or at its ``quick`` size (PPCA: the first 400 digits
    in 10 blocks; GMM: N = 5,000 in 5 blocks; the others are small already and keep their size),
    with its run tensors in ``dtype`` on ``device``."""
    return _make_problem(name, quick, dtype).place(device)


def _make_problem(name: str, quick: bool, dtype: torch.dtype) -> Problem:
    if name == "logreg":
        return LogisticRegression(dtype)
    if name == "ppca":
        return PPCA(dtype, num_data=400, num_blocks=10) if quick else PPCA(dtype)
    if name == "mixed":
        return MixedEffects(dtype)
    if name == "hier":
        return HierarchicalNormal(dtype)
    if name == "scale":
        return NormalScale(dtype)
    if name == "odlogit":
        return OverdispersedLogistic(dtype)
    if name == "biglogreg":
        return (
            LargeLogisticRegression(dtype, 10_000, 10) if quick else LargeLogisticRegression(dtype, None, 100)
        )
    if name == "gmm":
        return GMM(dtype, num_data=5000 if quick else 100_000)
    if name == "ppca_cancer":
        return PPCA(dtype, num_blocks=20, dataset="breast_cancer")
    if name == "robust":
        return RobustRegression(dtype)
    if name == "poisson":
        return PoissonRandomIntercept(dtype)
    if name == "poisson200":
        return PoissonRandomIntercept(dtype, num_data=10_000, num_sites=200, name="poisson200")
    if name == "negbin":
        return NegativeBinomialRandomIntercept(dtype)
    if name == "poisson200_few":
        return PoissonRandomIntercept(dtype, num_data=2000, num_sites=200, name="poisson200_few")
    if name == "poisson_slopes":
        return PoissonRandomSlopes(dtype)
    if name == "poisson_nested":
        return PoissonNestedIntercepts(dtype)
    if name == "poisson_crossed":
        return PoissonCrossedIntercepts(dtype)
    if name == "poisson_nested100":
        return PoissonNestedIntercepts(dtype, num_regions=100, name=name)
    if name == "poisson_crossed200":
        return PoissonCrossedIntercepts(dtype, num_periods=200, name=name)
    if name == "poisson_nested_slopes":
        return PoissonNestedSlopes(dtype)
    if name == "poisson_three_levels":
        return PoissonThreeLevels(dtype)
    if name == "poisson1000":
        return PoissonRandomIntercept(dtype, num_data=20_000, num_sites=1000, name="poisson1000")
    raise ValueError(f"Unknown model {name!r}; use one of {PROBLEM_NAMES}")


__all__ = [
    "GMM",
    "PPCA",
    "PROBLEM_NAMES",
    "HierarchicalNormal",
    "LargeLogisticRegression",
    "LogisticRegression",
    "MixedEffects",
    "NegativeBinomialRandomIntercept",
    "NormalScale",
    "OverdispersedLogistic",
    "PoissonCrossedIntercepts",
    "PoissonGroupedIntercepts",
    "PoissonNestedIntercepts",
    "PoissonRandomIntercept",
    "PoissonRandomSlopes",
    "Problem",
    "RobustRegression",
    "make_problem",
    "sorted_blocks",
]
