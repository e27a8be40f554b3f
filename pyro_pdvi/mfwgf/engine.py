"""``MFWGF``: mean-field VI by Wasserstein gradient flow for Pyro models [1].

Each factor ``q_j`` of a fully factorised ``q`` takes one JKO step per iteration, all
factors in parallel [1, eq. 16]: ``q_j`` moves along the gradient flow of
``KL(q_j ⊗ q_{-j} || pi)`` with the other factors held at their current state, so its
drift is ``E_{q_{-j}}[grad_j log pi]``. The fixed point is CAVI's [1, eq. 17], and for
log-concave targets the rate is linear in ``W2`` [1, Thm. 4.3]. Discrete local sites
marked for enumeration are summed out by the closed-form E-step [1, eq. 18] before the
globals' JKO step [1, eqs. 19-20]. The engine has the shape of Pyro's ``SVGD`` and ``SVI``.

[1] Yao, Yang (2022), "Mean-field variational inference via Wasserstein gradient flow",
    arXiv:2207.08074.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
from pyro.infer.autoguide.initialization import init_to_median
from tqdm import tqdm

from ..checks import check_positive_int
from ..errors import NonFiniteStepError
from .arguments import (
    check_factors,
    check_float,
    check_max_plate_nesting,
    check_num_particles,
    check_step_size,
)
from .factors import FactorLayout, FactorSpec, resolve_factors
from .potential import Potential
from .schemes import SCHEMES, Scheme, make_scheme
from .sites import SiteLayout, trace_sites
from .step_sizes import auto_step_sizes

#: Default ``step_fraction`` (``h_j L_j``, or ``tau_j L_j`` for the Gaussian scheme) per scheme.
DEFAULT_STEP_FRACTION = {"langevin": 0.25, "ula": 0.1, "gaussian": 0.5}
#: Configurations the curvature of ``step_size="auto"`` is averaged over.
CURVATURE_POINTS = 8
#: ``step_size="auto"`` measures at the first step and again before steps 8, 16, 32, ...
REMEASURE_FIRST = 8


class MFWGF:
    """Mean-field variational inference by Wasserstein gradient flow [1].

    Example::

        mf = MFWGF(model, num_particles=2000, step_size="auto")
        for _ in range(num_steps):
            loss = mf.step(*args, **kwargs)
        samples = mf.get_samples()  # {site: (num_particles, *site_shape)}, constrained

    Continuous latent sites move in unconstrained space; every scalar coordinate is its
    own factor by default (as ``AutoNormal``). The model must be vectorisable over a plate
    left of its own plates (as for Pyro's ``SVGD``): all particles are evaluated by one
    trace and one backward pass, with no loop over particles, on CPU or GPU alike.

    :param model: a Pyro model; discrete latent sites need ``infer={"enumerate": "parallel"}``
        and must be independent given the continuous sites (local ``z_i``).
    :param num_particles: P, particles per factor (``"gaussian"``: configurations per step,
        even, for antithetic pairs).
    :param step_size: ``"auto"`` (``step_fraction / L_j`` per factor from measured
        curvatures, see :mod:`.step_sizes`) or a float ``h`` (``tau`` for ``"gaussian"``),
        in unconstrained units.
    :param scheme: ``"langevin"`` (Leimkuhler-Matthews particles, default), ``"ula"``
        (Euler-Maruyama particles, the paper's scheme, biased by ``O(h)``) or ``"gaussian"``
        (diagonal Gaussian factors with the closed-form JKO step); see :mod:`.schemes`.
    :param factors: ``"coordinate"``, ``"site"`` or a list of site names / lists of site
        names (:func:`~.factors.resolve_factors`). A diagonal Gaussian factor is a product of
        its coordinates, so ``"gaussian"`` is the same for every choice.
    :param num_draws: R, draws of the other factors averaged per drift (particle schemes);
        with ``R >= 2`` their spread corrects the injected noise (:mod:`.langevin`).
    :param step_fraction: ``h_j L_j`` of ``step_size="auto"``; defaults
        :data:`DEFAULT_STEP_FRACTION`.
    :param init_loc_fn: per-site initial point, as in ``pyro.infer.autoguide``.
    :param init_scale: initial spread of every factor around it (unconstrained).
    :param max_plate_nesting: plate dimensions of the model; guessed when ``None``.
    :param drift_noise_correction: subtract the drift's Monte Carlo variance from the
        injected noise (``"langevin"``, ``R >= 2``).
    :param remeasure: with ``step_size="auto"``, measure the curvatures again before steps 8,
        16, 32, ...: the curvature where the factors sit changes as they move from their
        start (a doubling schedule follows that transient at ``log2(steps)`` measurements).
    """

    def __init__(
        self,
        model: Callable,
        num_particles: int = 1000,
        step_size: float | str = "auto",
        *,
        scheme: str = "langevin",
        factors: FactorSpec = "coordinate",
        num_draws: int = 2,
        step_fraction: float | None = None,
        init_loc_fn: Callable = init_to_median,
        init_scale: float = 0.1,
        max_plate_nesting: int | None = None,
        drift_noise_correction: bool = True,
        remeasure: bool = True,
    ) -> None:
        if not callable(model):
            raise ValueError(f"model must be callable, got {type(model).__name__}")
        if scheme not in SCHEMES:
            raise ValueError(f"Invalid scheme: {scheme!r}; use one of {sorted(SCHEMES)}")
        if step_fraction is None:
            step_fraction = DEFAULT_STEP_FRACTION[scheme]
        self.model = model
        self.num_particles = check_num_particles(num_particles, scheme)
        self.step_size = check_step_size(step_size)
        self.scheme_name = scheme
        self.factors = check_factors(factors)
        self.num_draws = check_positive_int(num_draws, "num_draws")
        # Langevin steps are stable for a h < 2; the Gaussian scheme's implicit step for any tau
        self.step_fraction = check_float(
            step_fraction, "step_fraction", 2.0 if scheme != "gaussian" else math.inf
        )
        self.init_loc_fn = init_loc_fn
        self.init_scale = check_float(init_scale, "init_scale")
        self.max_plate_nesting = check_max_plate_nesting(max_plate_nesting)
        self.drift_noise_correction = drift_noise_correction
        self.remeasure = remeasure
        self.num_steps = 0
        self._layout: SiteLayout | None = None
        self._scheme: Scheme | None = None
        self._generator: torch.Generator | None = None
        self._pending_state: dict | None = None

    # ------------------------------------------------------------------ set-up at the first step

    def _setup(self, args: tuple, kwargs: dict) -> None:
        """Trace the model, lay out sites and factors, place the particles, load any waiting
        state and set the steps; the engine is changed only if all of it succeeds."""
        layout = trace_sites(self.model, args, kwargs, self.init_loc_fn, self.max_plate_nesting)
        factors = resolve_factors(self.factors, layout)
        potential = Potential(self.model, layout)
        generator = torch.Generator(device=layout.initial.device)
        generator.manual_seed(int(torch.randint(0, 2**62, (1,), device="cpu")))
        scheme = make_scheme(
            self.scheme_name,
            potential,
            factors,
            self.num_particles,
            self.num_draws,
            self.drift_noise_correction,
        )
        scheme.initialize(layout.initial, self.init_scale, generator)
        state, num_steps = self._pending_state, 0
        if state is not None:
            self._check_state(state, layout)
            scheme.load_state_dict(state["scheme"])
            generator.set_state(state["generator"])
            num_steps = state["num_steps"]
        ones = torch.ones_like(layout.initial)
        if self.step_size != "auto":
            scheme.set_steps(self.step_size * ones, None)
        elif state is not None and state.get("step_sizes") is not None:
            scheme.set_steps(state["step_sizes"].to(ones), state["curvature"].to(ones))
        else:
            scheme.set_steps(*self._measure_steps(scheme, generator, args, kwargs))
        self._layout, self._scheme, self._generator = layout, scheme, generator
        self.num_steps, self._pending_state = num_steps, None

    def _measure_steps(
        self, scheme: Scheme, generator: torch.Generator, args: tuple, kwargs: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``step_size="auto"``: steps and curvatures per coordinate at the current factors."""
        configurations, local_log_probs = scheme.curvature_points(args, kwargs, generator)
        chunk = self.num_particles * self.num_draws

        def gradient(batch: torch.Tensor) -> torch.Tensor:
            return scheme.potential.gradient(batch, args, kwargs, local_log_probs, chunk)

        fraction = scheme.mean_step_fraction(self.step_fraction)
        steps, curvature, _ = auto_step_sizes(
            gradient, configurations[:CURVATURE_POINTS], scheme.factors, fraction
        )
        return scheme.from_mean_steps(steps, curvature), curvature

    def _remeasure_due(self) -> bool:
        """``"auto"`` re-measures before steps 8, 16, 32, ... (counting from 0)."""
        k = self.num_steps
        return self.step_size == "auto" and self.remeasure and k >= REMEASURE_FIRST and k & (k - 1) == 0

    # ------------------------------------------------------------------ the step

    def step(self, *args, **kwargs) -> float:
        """One MF-WGF iteration: the E-step for enumerated locals, then one JKO step of every
        factor in parallel [1, eqs. 16, 18-20].

        :returns: the loss at the particles before the step: the negative ELBO estimate for
            ``"gaussian"``; for the particle schemes its energy part
            ``E_q[-log p] + E_q[log q(z)]`` (a cloud of particles has no density, so its
            entropy is left out: the number levels off as the flow settles).
        :rtype: float
        :raises NonFiniteStepError: if the loss or the new state is not finite; then nothing
            is changed (particles, random generator and step count stay as they were), as
            for any error the model raises during the step.
        """
        if self._scheme is None:
            self._setup(args, kwargs)
        scheme, generator = self._scheme, self._generator
        generator_state, steps = generator.get_state(), (scheme.steps, scheme.curvature)
        try:
            if self._remeasure_due():
                scheme.set_steps(*self._measure_steps(scheme, generator, args, kwargs))
            proposal, loss = scheme.propose(args, kwargs, generator)
            finite = torch.stack([torch.isfinite(t).all() for t in proposal]).all() & torch.isfinite(loss)
            loss_value, accepted = torch.stack([loss.detach(), finite.to(loss.dtype)]).tolist()
        except Exception:  # e.g. a distribution's argument check inside the model
            generator.set_state(generator_state)
            scheme.set_steps(*steps)
            raise
        if not accepted:
            generator.set_state(generator_state)
            scheme.set_steps(*steps)
            raise NonFiniteStepError(
                f"MF-WGF step {self.num_steps + 1}: the loss or the new {self.scheme_name} state is not "
                "finite, so nothing was changed. Lower step_size (or step_fraction), or check the model's "
                "log-density where the particles are; to continue from here, load state_dict() into an "
                "engine with a smaller step"
            )
        self._scheme.state = proposal
        self.num_steps += 1
        return loss_value

    def run(self, num_steps: int, *args, progress_bar: bool = True, **kwargs) -> list[float]:
        """``num_steps`` calls of :meth:`step`, with a tqdm bar showing the loss.

        :param num_steps: number of steps.
        :param progress_bar: show the bar.
        :returns: the loss of every step.
        """
        check_positive_int(num_steps, "num_steps")
        losses = []
        with tqdm(range(num_steps), disable=not progress_bar, desc="MF-WGF") as bar:
            for _ in bar:
                losses.append(self.step(*args, **kwargs))
                bar.set_postfix(loss=f"{losses[-1]:.4g}", refresh=False)
        return losses

    # ------------------------------------------------------------------ results

    def _require_setup(self) -> None:
        if self._scheme is None:
            raise RuntimeError("MFWGF has no particles yet: call step() or run() first")

    @property
    def step_sizes(self) -> dict[str, torch.Tensor]:
        """The step of every coordinate, ``{site: (*unconstrained_shape)}``."""
        self._require_setup()
        return {
            name: value[0] for name, value in self._layout.unconstrained(self._scheme.steps[None]).items()
        }

    @property
    def factor_layout(self) -> FactorLayout:
        """Which coordinates form each factor."""
        self._require_setup()
        return self._scheme.factors

    def get_samples(self) -> dict[str, torch.Tensor]:
        """``{site: (num_particles, *site_shape)}`` in constrained space: the particles, or
        (``"gaussian"``) fresh draws from the factors with torch's global RNG (the engine's
        own generator is left alone, so the trajectory does not change)."""
        self._require_setup()
        return {
            name: value.detach() for name, value in self._layout.constrain(self._scheme.samples()).items()
        }

    def gaussian_factors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{site: (loc, scale)}`` of the diagonal Gaussian factors (``"gaussian"`` only),
        unconstrained, each of the site's unconstrained shape."""
        self._require_setup()
        if self.scheme_name != "gaussian":
            raise ValueError(
                f'gaussian_factors() needs scheme="gaussian", this engine uses "{self.scheme_name}"'
            )
        loc, scale = self._scheme.state
        locs = self._layout.unconstrained(loc[None])
        scales = self._layout.unconstrained(scale[None])
        return {name: (locs[name][0], scales[name][0]) for name in locs}

    def local_posteriors(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """The E-step's factors ``q(z)`` of the enumerated sites at the current state
        [1, eq. 18], ``{site: (*plates, K)}`` with the model's ``max_plate_nesting`` plate
        dimensions; drawn with torch's global RNG, not the engine's generator."""
        self._require_setup()
        generator = torch.Generator(device=self._layout.initial.device)
        generator.manual_seed(int(torch.randint(0, 2**62, (1,), device="cpu")))
        _, local_log_probs = self._scheme.curvature_points(args, kwargs, generator)
        nesting = self._layout.max_plate_nesting
        return {
            name: log_q.exp().movedim(-log_q.dim(), -1).reshape(log_q.shape[-nesting:] + log_q.shape[:1])
            if nesting
            else log_q.exp().reshape(-1)
            for name, log_q in (local_log_probs or {}).items()
        }

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Everything needed to resume the same trajectory: the scheme's state, the step
        sizes measured by ``"auto"``, the engine's random generator and the step count."""
        self._require_setup()
        scheme = self._scheme
        measured = self.step_size == "auto"
        return {
            "scheme_name": self.scheme_name,
            "sites": {site.name: tuple(site.unconstrained_shape) for site in self._layout.sites},
            "scheme": scheme.state_dict(),
            "step_sizes": scheme.steps.clone() if measured else None,
            "curvature": scheme.curvature.clone() if measured and scheme.curvature is not None else None,
            "generator": self._generator.get_state(),
            "num_steps": self.num_steps,
        }

    def _check_state(self, state: dict, layout: SiteLayout) -> None:
        if state["scheme_name"] != self.scheme_name:
            raise ValueError(
                f'state is of scheme "{state["scheme_name"]}", this engine uses "{self.scheme_name}"'
            )
        sites = {site.name: tuple(site.unconstrained_shape) for site in layout.sites}
        if state["sites"] != sites:
            raise ValueError(f"state has the sites {state['sites']}, the model has {sites}")

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`. Before the first step the state waits for it (the
        model's sites are known only then), as Pyro's optimizers do with loaded state.

        :raises ValueError: for a state of another scheme or other sites.
        """
        state = copy.deepcopy(state)
        if self._scheme is None:
            self._pending_state = state
            return
        self._check_state(state, self._layout)
        self._scheme.load_state_dict(state["scheme"])
        self._generator.set_state(state["generator"])
        self.num_steps = state["num_steps"]
        if self.step_size == "auto" and state.get("step_sizes") is not None:
            ones = torch.ones_like(self._layout.initial)
            self._scheme.set_steps(state["step_sizes"].to(ones), state["curvature"].to(ones))
