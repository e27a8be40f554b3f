"""The mixture as a Pyro model and mean-field guide (:class:`GMMModel`), for
:class:`pyro.infer.SVI` and :class:`~pyro_pdvi.PDVI`.

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.ops.indexing import Vindex

from .objective import optimal_logits
from .prior import GMMPrior

#: Param names of :class:`GMMModel`'s guide, which :class:`~pyro_pdvi.models.gmm.GMMBlockSolver`
#: expects by default.
SITE_NAMES = ("m", "rho", "alpha")


class GMMModel:
    """The mixture as a Pyro model and mean-field guide, closing over the data.

    ``model(idx)`` and ``guide(idx)`` take the subsample ``idx`` of the data plate
    ``pyro.plate("data", N, subsample=idx)`` (``None``: all data). The guide's params are
    the global ``m`` and ``rho`` (``(K, d)``, outside the data plate) and, unless
    ``collapsed``, the local ``alpha`` (``(N, K)``, created inside the data plate with
    ``event_dim=1`` so that Pyro and :class:`~pyro_pdvi.PDVI` slice it by the subsample).

    * ``collapsed=False`` (mean-field, [1, App. C.1]): the guide enumerates ``z``, so use
      ``TraceEnum_ELBO(max_plate_nesting=1)``: its loss is then exact in ``z`` and Monte
      Carlo only in ``c``, an unbiased estimate of :func:`negative_elbo` (and of
      :func:`block_negative_elbo` times ``N/|b|`` on a block). This is the form
      :class:`GMMBlockSolver` solves.
    * ``collapsed=True``: no local params; the *model* enumerates ``z`` (use the same
      ``TraceEnum_ELBO``), so the loss estimates ``E_q[-log p(x | c)] + KL(q(c) || p(c))``,
      with ``z`` summed out exactly. This is a different, tighter objective: it is at most
      :func:`negative_elbo` for any ``alpha``, and there is no closed form for it.

    :param data: ``(N, d)``.
    :param prior: the hyperparameters.
    :param collapsed: drop ``q(z)`` and sum ``z`` out in the model.
    :param init_means: initial ``m``; default ``K`` distinct data points drawn with ``seed``.
    :param init_log_variances: initial ``rho``; default ``log(sigma0_sq K / N)``, the
        posterior variance of a centre holding ``N/K`` points.
    :param init_logits: initial ``alpha``; default the responsibilities given the initial
        ``m, rho`` (one CAVI half-step).
    :param seed: seed of the default initial means.
    """

    def __init__(
        self,
        data: torch.Tensor,
        prior: GMMPrior,
        *,
        collapsed: bool = False,
        init_means: torch.Tensor | None = None,
        init_log_variances: torch.Tensor | None = None,
        init_logits: torch.Tensor | None = None,
        seed: int = 0,
    ) -> None:
        if data.dim() != 2 or data.shape[1] != prior.dim:
            raise ValueError(f"data must have shape (N, {prior.dim}), got {tuple(data.shape)}")
        self.data = data
        self.prior = prior.to(data.dtype, data.device)
        self.collapsed = collapsed
        num_data, num_components = data.shape[0], prior.num_components
        if init_means is None:
            if num_components > num_data:
                raise ValueError(f"cannot pick K = {num_components} initial means from N = {num_data} data")
            pick = torch.randperm(num_data, generator=torch.Generator().manual_seed(seed))[:num_components]
            init_means = data[pick.to(data.device)]
        if init_log_variances is None:
            scale = num_components / num_data
            init_log_variances = (self.prior.sigma0_sq * scale).log().expand(num_components, -1)
        if init_logits is None and not collapsed:
            init_logits = optimal_logits(data, self.prior, init_means, init_log_variances)
        self.init_means = init_means.detach().clone()
        self.init_log_variances = init_log_variances.detach().clone()
        self.init_logits = None if init_logits is None else init_logits.detach().clone()

    @property
    def num_data(self) -> int:
        """N."""
        return self.data.shape[0]

    def model(self, idx: torch.Tensor | None = None) -> None:
        """``c ~ N(xi, Sigma_1)``, ``z_i ~ Cat(1/K)``, ``x_i ~ N(c_{z_i}, Sigma_0)`` on subsample ``idx``."""
        prior, num_components = self.prior, self.prior.num_components
        centres = pyro.sample(
            "c", dist.Normal(prior.xi, prior.sigma1_sq.sqrt()).expand([num_components, prior.dim]).to_event(2)
        )
        weights = torch.full(
            (num_components,), 1.0 / num_components, dtype=self.data.dtype, device=self.data.device
        )
        infer = {"enumerate": "parallel"} if self.collapsed else {}
        with pyro.plate("data", self.num_data, subsample=idx) as ind:
            z = pyro.sample("z", dist.Categorical(probs=weights), infer=infer)
            # Vindex broadcasts c's particle dims against z's enumeration dims.
            loc = Vindex(centres)[..., z, :]
            pyro.sample("x", dist.Normal(loc, prior.sigma0_sq.sqrt()).to_event(1), obs=self.data[ind])

    def guide(self, idx: torch.Tensor | None = None) -> None:
        """``q(c_kj) = N(m_kj, exp(rho_kj))`` and, unless collapsed, ``q(z_i) = Cat(softmax(alpha_i))``."""
        m = pyro.param(SITE_NAMES[0], lambda: self.init_means.clone())
        rho = pyro.param(SITE_NAMES[1], lambda: self.init_log_variances.clone())
        pyro.sample("c", dist.Normal(m, (0.5 * rho).exp()).to_event(2))
        if self.collapsed:
            return
        with pyro.plate("data", self.num_data, subsample=idx):
            alpha = pyro.param(SITE_NAMES[2], lambda: self.init_logits.clone(), event_dim=1)
            pyro.sample("z", dist.Categorical(logits=alpha), infer={"enumerate": "parallel"})
