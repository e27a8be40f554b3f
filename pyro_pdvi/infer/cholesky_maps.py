"""The Cholesky factor of a full-covariance Gaussian global guide site by the fixed point.

For ``q(z) = N(m, L L')`` the Price / Stein identity [1] gives the derivative of the negative
ELBO's block share in the lower triangle of ``L`` as ``d f_b / dL = tril(H_b L) - s_b diag(1 /
L_ii)``, where ``H_b = E_q[-grad^2 g_b]`` (``g_b`` the block's log joint seen from ``z``, its share
``s_b = |b| / N`` of the prior) and ``s_b diag(1 / L_ii)`` is the derivative of its share of
``-log det L`` (the entropy). So at the optimum, as for the diagonal scales of
:mod:`~pyro_pdvi.infer.scales`,

    Sigma^-1 = E_q[-grad^2 log p] = sum_b H_b,

and each block's symmetric ``H_b`` follows from the gradient alone: ``tril(H_b L) = R_b`` with
``R_b = d f_b / dL + s_b diag(1 / L_ii)``, a triangular system that :func:`symmetric_from_lower_product`
solves in closed form. A diagonal ``L`` gives the scales' ``h_bi = (d f_b /
d sigma_i + s_b / sigma_i) / sigma_i``. The fixed point then sets ``L = chol((sum_b H_b)^-1)``.

:class:`CholeskyMap` is the map from param coordinates to ``L`` that this needs in both
directions: ``L = diag(s) B`` with ``s`` a positive param's constrained value (absent: 1) and
``B`` a ``unit_lower_cholesky`` param (with ``s``) or a ``lower_cholesky`` one (without), as
``AutoMultivariateNormal`` writes ``scale[..., None] * scale_tril`` and a hand-written guide
``pyro.param("L", ..., constraint=constraints.lower_cholesky)``. Its block information is the
lower triangle of ``H_b``, ``D (D + 1) / 2`` numbers, as many as the coordinates that move ``L``,
so that :class:`~pyro_pdvi.infer.scales.ScaleFixedPoint` stores and averages it as it does the
diagonal scales' ``h_b``.

Why (``docs/benchmarks.md`` 13zi): left to the Monte Carlo primal-dual iteration, an
``AutoMultivariateNormal``'s covariance crawled: 0.64 from the optimum after 20 CPU s on a
conjugate regression, level with the best SVI, while its means were exact.

[1] Opper, Archambeau (2009), "The variational Gaussian approximation revisited", Neural Comput.
    21(3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pyro.distributions import constraints
from torch.distributions import transform_to

from .sites import GlobalLayout


def symmetric_from_lower_product(lower_product: torch.Tensor, cholesky: torch.Tensor) -> torch.Tensor:
    """The symmetric ``H`` with ``tril(H L) = R`` (module docstring), batched, in closed form.

    Write ``H L = R + U`` with ``U`` strictly upper triangular. ``H`` is symmetric exactly when
    ``L' H L = L' R + L' U`` is, and ``V = L' U`` is strictly upper triangular (``L'`` upper,
    ``U`` strictly upper); so ``L' H L`` is the symmetric matrix whose lower triangle is that of
    ``A = L' R``, ``V`` completing its upper one. Hence ``H = L^-T sym(A) L^-1`` with ``sym(A) =
    tril(A) + tril(A, -1)'``: two triangular solves and no loop over the ``D`` columns, which on a
    GPU launched a few kernels per column. On the CPU (one thread) it took 1/5, 1/3 and 1/2.5 of the
    column-by-column solve's time at 11, 48 and 128 dimensions (``docs/benchmarks.md`` 13zj).

    :param lower_product: ``R``, ``(..., D, D)``, lower triangular (its upper triangle is ignored).
    :param cholesky: ``L``, ``(..., D, D)``, lower triangular with a positive diagonal.
    :returns: ``H``, ``(..., D, D)``, symmetric.
    """
    lower_product, cholesky = torch.broadcast_tensors(lower_product.tril(), cholesky)
    congruent = (cholesky.mT @ lower_product).tril()
    congruent = congruent + congruent.tril(-1).mT
    left = torch.linalg.solve_triangular(cholesky.mT, congruent, upper=True)
    result = torch.linalg.solve_triangular(cholesky, left, upper=False, left=False)
    return (result + result.mT) / 2


@dataclass
class CholeskyMap:
    """``L = diag(s) B`` of one guide site from param coordinates (module docstring).

    :param site: the guide site's name.
    :param params: the names of the param sites ``L`` comes from (comma-separated).
    :param size: ``D``.
    :param factor_coordinates: the flat coordinates of ``B``'s free entries, in
        ``torch.tril_indices(D, D, offset)`` order (``offset`` -1 for a unit lower ``B``, else 0).
    :param factor_transform: ``transform_to`` of ``B``'s constraint, on the param's ``(D, D)`` shape.
    :param factor_start: the flat coordinate where ``B``'s unconstrained ``(D, D)`` value starts.
    :param scale_coordinates: the flat coordinates of ``s`` (``None``: no ``s``).
    :param scale_transform: ``s = scale_transform(u)`` elementwise.
    """

    site: str
    params: str
    size: int
    factor_coordinates: torch.Tensor
    factor_transform: torch.distributions.Transform
    factor_start: int
    scale_coordinates: torch.Tensor | None = None
    scale_transform: torch.distributions.Transform | None = None

    @property
    def unit(self) -> bool:
        return self.scale_coordinates is not None

    @property
    def coordinates(self) -> torch.Tensor:
        """The coordinates that move ``L``: ``s``'s, then ``B``'s free entries."""
        if self.scale_coordinates is None:
            return self.factor_coordinates
        return torch.cat([self.scale_coordinates, self.factor_coordinates])

    @property
    def precision_entries(self) -> torch.Tensor:
        """Which of the block information's entries (``H_b``'s lower triangle) are on its diagonal."""
        rows, columns = torch.tril_indices(self.size, self.size)
        return rows == columns

    def _factor_values(self, point: torch.Tensor) -> torch.Tensor:
        """``B``'s whole unconstrained ``(D, D)`` value in ``point``."""
        size = self.size
        return point[self.factor_start : self.factor_start + size * size].reshape(size, size)

    def cholesky_at(self, point: torch.Tensor) -> torch.Tensor:
        """``L`` at the flat params ``point`` (float64)."""
        point = point.detach().to(torch.float64)
        factor = self.factor_transform(self._factor_values(point))
        if self.scale_coordinates is None:
            return factor
        return self.scale_transform(point[self.scale_coordinates]).unsqueeze(-1) * factor

    def scales_at(self, point: torch.Tensor) -> torch.Tensor:
        """``L`` at the flat params ``point`` (float64): what
        :meth:`~pyro_pdvi.infer.scales.ScaleMap.scales_at` gives of a diagonal site."""
        return self.cholesky_at(point)

    def information(self, gradients: torch.Tensor, shares: torch.Tensor, point: torch.Tensor) -> torch.Tensor:
        """Blocks' ``H_b`` from ``grad_lambda f_b`` at points whose ``L`` is ``point``'s: the lower
        triangle, ``(m, D (D + 1) / 2)``, float64 (module docstring).

        :param gradients: ``(m, P)``, flat, in the params' unconstrained coordinates.
        :param shares: ``s_b``, ``(m,)``.
        :param point: ``lambda_0``, ``(P,)``.
        """
        point = point.detach().to(torch.float64)
        gradients = gradients.detach().to(torch.float64)
        size = self.size
        rows, columns = torch.tril_indices(size, size, -1 if self.unit else 0, device=point.device)
        # d f / dB at B's free entries, through B's elementwise transform.
        leaf = self._factor_values(point).clone().requires_grad_()
        with torch.enable_grad():
            factor = self.factor_transform(leaf)
            (slope,) = torch.autograd.grad(factor[rows, columns].sum(), leaf)
        factor = factor.detach()
        by_factor = gradients[:, self.factor_coordinates] / slope[rows, columns]
        if self.unit:
            scale = self.scale_transform(point[self.scale_coordinates])
            by_lower = torch.zeros(len(gradients), size, size).to(gradients)
            by_lower[:, rows, columns] = by_factor / scale[rows]  # L_ij = s_i B_ij below the diagonal
            u = point[self.scale_coordinates].clone().requires_grad_()
            with torch.enable_grad():
                (scale_slope,) = torch.autograd.grad(self.scale_transform(u).sum(), u)
            by_scale = gradients[:, self.scale_coordinates] / scale_slope
            # d f / ds_i = sum_j B_ij d f / dL_ij, and B_ii = 1
            diagonal = by_scale - (by_lower * factor).sum(-1)
            by_lower = by_lower + torch.diag_embed(diagonal)
            cholesky = scale.unsqueeze(-1) * factor
        else:
            by_lower = torch.zeros(len(gradients), size, size).to(gradients)
            by_lower[:, rows, columns] = by_factor
            cholesky = factor
        pivots = cholesky.diagonal()
        lower_product = by_lower + shares.to(gradients)[:, None, None] * torch.diag_embed(
            1.0 / pivots
        ).unsqueeze(0)
        precision = symmetric_from_lower_product(lower_product, cholesky)
        full_rows, full_columns = torch.tril_indices(size, size, device=point.device)
        return precision[:, full_rows, full_columns]

    def values(self, information: torch.Tensor, point: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The coordinates' values that put ``L = chol((sum_b H_b)^-1)``, and whether they could
        be (``sum_b H_b`` positive definite).

        :param information: the lower triangle of ``sum_b H_b``, ``(D (D + 1) / 2,)``, float64.
        :param point: ``lambda_0``, ``(P,)``.
        :returns: ``((K,), ())`` in float64: the values (the current ones where not usable) and
            a boolean.
        """
        size = self.size
        point = point.detach().to(torch.float64)
        rows, columns = torch.tril_indices(size, size, device=information.device)
        precision = torch.zeros(size, size).to(information)
        precision[rows, columns] = information
        precision = precision + precision.tril(-1).mT
        precision_cholesky, info = torch.linalg.cholesky_ex(precision)
        usable = info == 0
        covariance = torch.cholesky_inverse(
            torch.where(usable, precision_cholesky, torch.eye(size).to(precision))
        )
        cholesky = torch.linalg.cholesky_ex(covariance)[0]
        if self.unit:
            scale = cholesky.diagonal()
            factor = cholesky / scale.unsqueeze(-1)
            parts = [self.scale_transform.inv(scale)]
        else:
            factor, parts = cholesky, []
        free_rows, free_columns = torch.tril_indices(
            size, size, -1 if self.unit else 0, device=information.device
        )
        parts.append(self.factor_transform.inv(factor)[free_rows, free_columns])
        values = torch.cat(parts)
        usable = usable & torch.isfinite(values).all()
        return torch.where(usable, values, point[self.coordinates]), usable


def cholesky_map(
    name: str, scale_tril: torch.Tensor, leaf: torch.Tensor, layout: GlobalLayout
) -> CholeskyMap | None:
    """The site's :class:`CholeskyMap` if its ``scale_tril`` is ``diag(s) B`` of whole param sites
    as the module docstring says, else ``None`` (the check at a shifted point is the caller's).

    :param name: the guide site's name.
    :param scale_tril: the site's Cholesky factor, built from ``leaf``.
    :param leaf: the flat params.
    :param layout: their layout.
    """
    if scale_tril.dim() != 2 or not scale_tril.requires_grad:
        return None
    size = scale_tril.shape[-1]
    (grad,) = torch.autograd.grad(scale_tril.sum(), leaf, retain_graph=True, allow_unused=True)
    if grad is None:
        return None
    owners = sorted({layout.site_of(j) for j in (grad != 0).nonzero().reshape(-1).tolist()})
    sites = {s.name: s for s in layout.sites}
    factor_site = scale_site = None
    for owner in owners:
        constraint = sites[owner].constraint
        if constraint in (constraints.unit_lower_cholesky, constraints.lower_cholesky):
            factor_site = owner
        elif constraint in (constraints.positive, constraints.softplus_positive):
            scale_site = owner
    if factor_site is None or len(owners) != 1 + (scale_site is not None):
        return None
    unit = sites[factor_site].constraint is constraints.unit_lower_cholesky
    if unit != (scale_site is not None) or tuple(sites[factor_site].shape) != (size, size):
        return None
    span = layout.slices[factor_site]
    rows, columns = torch.tril_indices(size, size, -1 if unit else 0)
    factor_coordinates = span.start + rows * size + columns
    scale_coordinates = scale_transform = None
    if scale_site is not None:
        if tuple(sites[scale_site].shape) != (size,):
            return None
        scale_span = layout.slices[scale_site]
        scale_coordinates = torch.arange(scale_span.start, scale_span.stop)
        scale_transform = transform_to(sites[scale_site].constraint)
    found = CholeskyMap(
        site=name,
        params=", ".join(owners),
        size=size,
        factor_coordinates=factor_coordinates.to(leaf.device),
        factor_transform=transform_to(sites[factor_site].constraint),
        factor_start=span.start,
        scale_coordinates=None if scale_coordinates is None else scale_coordinates.to(leaf.device),
        scale_transform=scale_transform,
    )
    if not torch.allclose(
        found.cholesky_at(leaf), scale_tril.detach().to(torch.float64), rtol=1e-5, atol=1e-8
    ):
        return None
    return found
