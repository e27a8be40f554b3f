"""The closed-form update of enumerated categorical local rows (pyro_pdvi.infer.local_cavi):
which sites qualify, the update against the mean-field coordinate step in closed form
(float64), the check that drops a site where it is not exact, and PDVI with it at the
exact fixed point of the mixture."""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import Trace_ELBO, TraceEnum_ELBO
from pyro.ops.indexing import Vindex
from torch.distributions import constraints

from pyro_pdvi import PDVI, GenericSolver
from pyro_pdvi.infer.local_cavi import categorical_rows, categorical_update
from pyro_pdvi.infer.sites import find_sites

NUM_DATA, NUM_COMPONENTS, DIM, BLOCK = 30, 3, 2, 10
PRIOR_SD = 3.0


class Mixture:
    """``c_k ~ N(0, 3^2 I)``, ``z_i ~ Cat(1/K)``, ``x_i ~ N(c_{z_i}, I)``; the guide is a point
    mass at ``m`` for the centres (no Monte Carlo: the block objective is exact) and
    ``q(z_i) = Cat(softmax(alpha_i))`` (or ``Cat(probs_i)`` with ``simplex``), enumerated."""

    def __init__(self, simplex=False, scale=1.0, scale_guide=False, seed=0):
        generator = torch.Generator().manual_seed(seed)
        centres = torch.tensor([[-4.0, 0.0], [0.0, 4.0], [4.0, 0.0]], dtype=torch.float64)
        labels = torch.arange(NUM_DATA) % NUM_COMPONENTS
        self.data = centres[labels] + torch.randn(NUM_DATA, DIM, generator=generator, dtype=torch.float64)
        self.init_m = centres + torch.randn(NUM_COMPONENTS, DIM, generator=generator, dtype=torch.float64)
        self.init_alpha = torch.randn(NUM_DATA, NUM_COMPONENTS, generator=generator, dtype=torch.float64)
        self.blocks = list(torch.arange(NUM_DATA).split(BLOCK))
        self.simplex = simplex
        self.scale = scale
        self.scale_guide = scale_guide

    def model(self, idx):
        weights = torch.full((NUM_COMPONENTS,), 1.0 / NUM_COMPONENTS, dtype=torch.float64)
        c = pyro.sample(
            "c",
            dist.Normal(torch.zeros((), dtype=torch.float64), PRIOR_SD)
            .expand([NUM_COMPONENTS, DIM])
            .to_event(2),
        )
        with pyro.plate("data", NUM_DATA, subsample=idx) as ind, poutine.scale(scale=self.scale):
            z = pyro.sample("z", dist.Categorical(weights))
            pyro.sample("x", dist.Normal(Vindex(c)[..., z, :], 1.0).to_event(1), obs=self.data[ind])

    def guide(self, idx):
        m = pyro.param("m", lambda: self.init_m.clone())
        pyro.sample("c", dist.Delta(m, event_dim=2))
        guide_scale = self.scale if self.scale_guide else 1.0
        with pyro.plate("data", NUM_DATA, subsample=idx), poutine.scale(scale=guide_scale):
            if self.simplex:
                probs = pyro.param(
                    "alpha", lambda: self.init_alpha.softmax(-1), constraint=constraints.simplex, event_dim=1
                )
                q = dist.Categorical(probs=probs)
            else:
                q = dist.Categorical(logits=pyro.param("alpha", lambda: self.init_alpha.clone(), event_dim=1))
            pyro.sample("z", q, infer={"enumerate": "parallel"})

    def closed_form_logits(self, m, idx):
        """The mean-field update of ``q(z_i)`` given the point mass at ``m``: ``log N(x_i; m_k, I)``
        normalised (the prior weights are equal)."""
        return dist.Normal(m, 1.0).to_event(1).log_prob(self.data[idx][:, None, :]).log_softmax(-1)


def make_pdvi(mixture, loss=None, **options):
    pyro.clear_param_store()
    loss = loss or TraceEnum_ELBO(max_plate_nesting=1)
    return PDVI(
        mixture.model, mixture.guide, pyro.optim.Adam({"lr": 0.01}), loss, blocks=mixture.blocks, **options
    )


@pytest.mark.parametrize("simplex", [False, True], ids=["logits", "simplex"])
def test_update_is_the_closed_form_mean_field_step(simplex):
    """The rows after the update are the mean-field coordinate step given lambda_0 (to 1e-12),
    for logits and for simplex probabilities, and the site passes the exactness check."""
    mixture = Mixture(simplex=simplex)
    pdvi = make_pdvi(mixture)
    pdvi._setup((mixture.blocks[1],), {})
    assert pdvi._categorical_rows == ("alpha",)
    problem = pdvi._problem(torch.tensor([1]), [0], (mixture.blocks[1],), {})
    rows = categorical_update(problem, ["alpha"])
    expected = mixture.closed_form_logits(mixture.init_m, mixture.blocks[1])
    assert torch.allclose(rows["alpha"][0].log_softmax(-1), expected, rtol=0, atol=1e-12)
    assert torch.allclose(rows["alpha"][0].amax(-1), torch.zeros(BLOCK, dtype=torch.float64))


def test_vectorized_update_equals_the_loop():
    """Two blocks through the vmap kernel give the loop's rows (no Monte Carlo here)."""
    mixture = Mixture()
    pdvi = make_pdvi(mixture)
    pdvi._setup((mixture.blocks[0],), {})
    problem = pdvi._problem(torch.tensor([0, 2]), [0, 1], (torch.cat(mixture.blocks[::2]),), {})
    loop = categorical_update(problem, ["alpha"], vectorize=False)["alpha"]
    mapped = categorical_update(problem, ["alpha"], vectorize=True)["alpha"]
    assert torch.allclose(loop, mapped, rtol=0, atol=1e-12)
    for i, b in enumerate((0, 2)):
        expected = mixture.closed_form_logits(mixture.init_m, mixture.blocks[b])
        assert torch.allclose(loop[i].log_softmax(-1), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("scale_guide", [False, True], ids=["model", "model_and_guide"])
def test_scaled_terms(scale_guide):
    """A poutine.scale(2) on the model's local terms only moves the optimum with the update
    (q(z_i) proportional to exp(2 l_ik), which one gradient at uniform rows still gives);
    one on the guide's site too scales the entropy as well: the update then leaves a
    gradient in the rows, the check warns naming the site, and no rows are set in closed form."""
    mixture = Mixture(scale=2.0, scale_guide=scale_guide)
    pdvi = make_pdvi(mixture)
    if not scale_guide:
        pdvi._setup((mixture.blocks[0],), {})
        assert pdvi._categorical_rows == ("alpha",)
        problem = pdvi._problem(torch.tensor([0]), [0], (mixture.blocks[0],), {})
        expected = (2 * mixture.closed_form_logits(mixture.init_m, mixture.blocks[0])).log_softmax(-1)
        rows = categorical_update(problem, ["alpha"])["alpha"][0]
        assert torch.allclose(rows.log_softmax(-1), expected, rtol=0, atol=1e-12)
        return
    with pytest.warns(UserWarning, match=r'"alpha".*not linear in the site\'s probabilities'):
        pdvi._setup((mixture.blocks[0],), {})
    assert pdvi._categorical_rows == ()


def test_only_enumerated_categorical_rows_under_trace_enum_qualify():
    """A Normal local and a categorical site that Trace_ELBO samples do not qualify."""
    mixture = Mixture()
    pdvi = make_pdvi(mixture, loss=Trace_ELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pdvi._setup((mixture.blocks[0],), {})
    assert pdvi._categorical_rows == ()

    def normal_guide(idx):
        with pyro.plate("data", NUM_DATA, subsample=idx):
            loc = pyro.param("loc", torch.zeros(NUM_DATA, DIM, dtype=torch.float64), event_dim=1)
            pyro.sample("u", dist.Normal(loc, 1.0).to_event(1))

    pyro.clear_param_store()
    found = find_sites(normal_guide, normal_guide, (mixture.blocks[0],), {}, NUM_DATA, None)
    assert categorical_rows(found.guide_trace, found.local_sites, found.plate) == []


def em_fixed_point(mixture, iterations=2000):
    """The exact optimum of the mixture's ELBO over (m, alpha) from the common start: EM
    (q(z) by the closed-form step, m by its closed-form maximiser) to convergence."""
    m = mixture.init_m.clone()
    for _ in range(iterations):
        q = mixture.closed_form_logits(m, torch.arange(NUM_DATA)).exp()
        m_new = (q.T @ mixture.data) / (q.sum(0)[:, None] + 1.0 / PRIOR_SD**2)
        if torch.allclose(m_new, m, rtol=0, atol=1e-15):
            break
        m = m_new
    return m


def test_pdvi_reaches_the_em_fixed_point():
    """PDVI with near-exact solves reaches the mixture's optimum (EM's fixed point) to 1e-9.
    (Measured without the update, local_cavi=False, at eta = 1 and 60 evaluations: the
    L-BFGS solve over the saturated logits stalls 1.3e-5 away.)"""
    mixture = Mixture()
    pdvi = make_pdvi(mixture, eta=0.3, solver=GenericSolver(inner_steps=20))
    for _ in range(25):
        for block in mixture.blocks:
            pdvi.step(block)
    assert torch.allclose(pyro.param("m").detach(), em_fixed_point(mixture), rtol=0, atol=1e-9)


def test_the_update_runs_before_a_solve_and_local_cavi_false_leaves_the_rows_to_it():
    """After a solve of one L-BFGS iteration the rows are the closed-form update with
    local_cavi=True (their gradient there is nil: the step leaves them); with local_cavi=False
    they are one L-BFGS step from the warm start (within 0.1 of it; the update's logits are up
    to tens of units away)."""
    mixture = Mixture()
    start = mixture.init_alpha[mixture.blocks[0]]
    expected = mixture.closed_form_logits(mixture.init_m, mixture.blocks[0])
    for local_cavi in (True, False):
        pdvi = make_pdvi(mixture, eta=1.0, solver=GenericSolver(inner_steps=1, local_cavi=local_cavi))
        pdvi._setup((mixture.blocks[0],), {})
        problem = pdvi._problem(torch.tensor([0]), [0], (mixture.blocks[0],), {})
        rows = pdvi.solver.solve(problem).local["alpha"][0]
        if local_cavi:
            assert torch.allclose(rows.log_softmax(-1), expected, rtol=0, atol=1e-12)
        else:
            assert (rows - start).abs().max() < 0.1
            assert (rows.log_softmax(-1) - expected).abs().max() > 10


def test_no_rows_are_found_for_a_solver_that_does_not_use_them():
    """With local_cavi=False (or a model's own solver) PDVI neither looks for such rows nor
    checks them (which would cost two evaluations per site at its set-up)."""
    mixture = Mixture(scale=2.0, scale_guide=True)  # would fail the check, with a warning
    pdvi = make_pdvi(mixture, solver=GenericSolver(local_cavi=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pdvi._setup((mixture.blocks[0],), {})
    assert pdvi._categorical_rows == ()


def test_local_cavi_must_be_a_bool():
    with pytest.raises(ValueError, match=r"Invalid local_cavi: 1; use True or False"):
        GenericSolver(local_cavi=1)
