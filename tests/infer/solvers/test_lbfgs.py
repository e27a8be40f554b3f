"""Per-block batched L-BFGS (:func:`batched_lbfgs`): every block of a batch must follow its own
single-block run, reach closed-form optima, ignore other blocks' non-finite values, and read
nothing on the host inside its loop."""

import pytest
import torch
import torch.nn.functional as F

from pyro_pdvi.infer.solvers import lbfgs
from pyro_pdvi.infer.solvers.lbfgs import batched_lbfgs


def quadratics(num_blocks=4, dim=6, seed=0):
    """f_b(x) = 1/2 x'A_b x - c_b'x, A_b with condition number 10^(b+1): x_b* = A_b^{-1} c_b."""
    g = torch.Generator().manual_seed(seed)
    hessians = []
    for b in range(num_blocks):
        rotation, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g))
        hessians.append(rotation @ torch.diag(torch.logspace(0, b + 1, dim)) @ rotation.T)
    hessians = torch.stack(hessians)
    linear = torch.randn(num_blocks, dim, generator=g)

    def objective(x, blocks=slice(None)):
        return 0.5 * torch.einsum("bi,bij,bj->b", x, hessians[blocks], x) - (linear[blocks] * x).sum(1)

    return objective, torch.linalg.solve(hessians, linear)


def logistic_regressions(num_blocks=3, num_data=40, dim=5, seed=1, ridge=0.1):
    """f_b(w) = sum_i softplus(x_i'w) - y_i x_i'w + ridge/2 |w|^2 on each block's own data."""
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(num_blocks, num_data, dim, generator=g)
    truth = 2.0 * torch.randn(num_blocks, dim, generator=g)
    labels = (
        torch.rand(num_blocks, num_data, generator=g) < torch.sigmoid(features @ truth[..., None])[..., 0]
    )
    labels = labels.double()

    def objective(w, blocks=slice(None)):
        logits = (features[blocks] * w[:, None, :]).sum(-1)
        return (F.softplus(logits) - labels[blocks] * logits).sum(1) + 0.5 * ridge * w.square().sum(1)

    return objective, dim


def single_block_runs(objective, x0, **kwargs):
    """Block b run alone (m = 1) by the same algorithm."""
    return [
        batched_lbfgs(lambda x, b=b: objective(x, slice(b, b + 1)), x0[b : b + 1], **kwargs)
        for b in range(x0.shape[0])
    ]


@pytest.mark.parametrize("max_iter", [7, 25, 200])
@pytest.mark.parametrize("problem", ["quadratic", "logistic"])
def test_each_block_equals_its_single_block_run(problem, max_iter):
    """Mid-run (7, 25 iterations: blocks in different phases, some backtracking) and converged."""
    if problem == "quadratic":
        objective, _ = quadratics()
        x0 = torch.randn(4, 6)
    else:
        objective, dim = logistic_regressions()
        x0 = torch.randn(3, dim)
    batched = batched_lbfgs(objective, x0, max_iter=max_iter, history_size=5)
    for b, alone in enumerate(single_block_runs(objective, x0, max_iter=max_iter, history_size=5)):
        torch.testing.assert_close(batched.x[b], alone.x[0], rtol=0, atol=1e-10)
        torch.testing.assert_close(batched.value[b], alone.value[0], rtol=1e-12, atol=1e-10)
        assert int(batched.accepted_steps[b]) == int(alone.accepted_steps[0])
    assert batched.evaluations == max_iter + 1


def test_quadratics_with_different_conditioning_reach_the_closed_form_optimum():
    objective, optimum = quadratics(num_blocks=4, dim=8)
    result = batched_lbfgs(objective, torch.zeros(4, 8), max_iter=150)
    assert result.converged.all()
    # Conditioning 10 to 10^4: the harder blocks take more steps, each its own number.
    assert len(set(result.accepted_steps.tolist())) > 1
    relative = (result.x - optimum).norm(dim=1) / optimum.norm(dim=1)
    assert relative.max() <= 1e-8
    torch.testing.assert_close(result.grad, torch.zeros_like(result.grad), rtol=0, atol=1e-11)


def test_logistic_regressions_reach_the_optimum_that_newton_finds():
    objective, dim = logistic_regressions()
    result = batched_lbfgs(objective, torch.zeros(3, dim), max_iter=120)
    assert result.converged.all()
    for b in range(3):

        def block(w, b=b):
            return objective(w[None], slice(b, b + 1))[0]

        w = torch.zeros(dim)
        for _ in range(30):  # Newton's method: quadratic convergence on a strictly convex function
            gradient = torch.autograd.functional.jacobian(block, w)
            w = w - torch.linalg.solve(torch.autograd.functional.hessian(block, w), gradient)
        torch.testing.assert_close(result.x[b], w, rtol=0, atol=1e-9)


def barrier_objective(x, blocks=slice(None)):
    """Block 0: sum_j -log(1 - 4 x_j) + 2 x_j^2 - 40 x_j, finite only for x_j < 1/4;
    blocks 1, 2: sum_j (x_j - c)^2 / 2 + (x_j - c)^4 / 4 with c = 3, -2."""
    centre = torch.tensor([0.0, 3.0, -2.0])[blocks][:, None]
    smooth = 0.5 * (x - centre).square().sum(1) + 0.25 * (x - centre).pow(4).sum(1)
    barrier = -torch.log1p(-4.0 * x).sum(1) + 2.0 * x.square().sum(1) - 40.0 * x.sum(1)
    first = torch.arange(3)[blocks] == 0
    return torch.where(first, barrier, smooth)


def test_a_block_with_non_finite_trial_values_does_not_affect_the_others():
    """Block 0's minimiser lies near its domain's edge x < 1/4, so its first trial steps land
    outside (log of a negative: NaN); it backtracks alone, and blocks 1, 2 follow their own runs."""
    x0 = torch.zeros(3, 4)
    batched = batched_lbfgs(barrier_objective, x0, max_iter=80)
    assert batched.converged.all()
    # 1/(1 - 4x) * 4 + 4x - 40 = 0  <=>  (1 - 4x)(10 - x) = 1.
    x_star = (41 - torch.sqrt(torch.tensor(41.0**2 - 4 * 4 * 9))) / 8
    torch.testing.assert_close(batched.x[0], x_star.expand(4), rtol=0, atol=1e-10)
    alone = single_block_runs(barrier_objective, x0, max_iter=80)
    for b in range(3):
        torch.testing.assert_close(batched.x[b], alone[b].x[0], rtol=0, atol=1e-10)
        assert int(batched.accepted_steps[b]) == int(alone[b].accepted_steps[0])


def test_a_block_that_starts_at_a_non_finite_value_stays_put_and_the_others_converge():
    objective, optimum = quadratics(num_blocks=3, dim=4)

    def poisoned(x):
        values = objective(x)
        return torch.where(torch.arange(3) == 1, values + torch.nan, values)

    x0 = torch.randn(3, 4)
    result = batched_lbfgs(poisoned, x0, max_iter=100)
    assert not result.converged[1]
    assert torch.equal(result.x[1], x0[1])
    assert int(result.accepted_steps[1]) == 0
    for b in (0, 2):
        torch.testing.assert_close(result.x[b], optimum[b], rtol=0, atol=1e-8 * float(optimum[b].norm()))


@pytest.fixture
def no_host_sync(monkeypatch):
    """Every way of reading a tensor's value on the host raises."""

    def refuse(self, *args, **kwargs):
        raise AssertionError("host synchronisation")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


def test_the_loop_reads_no_tensor_value_on_the_host(no_host_sync):
    with pytest.raises(AssertionError, match="host synchronisation"):
        bool(torch.tensor(True))
    objective, _ = logistic_regressions()
    result = batched_lbfgs(objective, torch.zeros(3, 5), max_iter=30)
    poisoned = batched_lbfgs(barrier_objective, torch.zeros(3, 4), max_iter=30)
    boxed = batched_lbfgs(objective, torch.zeros(3, 5), max_iter=30, box=lambda grad: 2 * grad.abs() + 1e-3)
    assert result.evaluations == poisoned.evaluations == boxed.evaluations == 31


def test_check_every_stops_early_with_the_same_result():
    objective, _ = quadratics()
    x0 = torch.randn(4, 6)
    full = batched_lbfgs(objective, x0, max_iter=300)
    early = batched_lbfgs(objective, x0, max_iter=300, check_every=5)
    assert full.converged.all()
    assert early.evaluations < 100 and early.evaluations % 5 == 1
    assert torch.equal(full.x, early.x)
    assert torch.equal(full.accepted_steps, early.accepted_steps)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"x0": torch.zeros(3)}, "Invalid x0"),
        ({"max_iter": -1}, "Invalid max_iter"),
        ({"history_size": 0}, "Invalid history_size"),
        ({"check_every": 0}, "Invalid check_every"),
        ({"objective": lambda x: x.sum()}, "Invalid objective"),
    ],
)
def test_argument_errors(kwargs, match):
    arguments = {"objective": lambda x: x.square().sum(1), "x0": torch.zeros(2, 3), "max_iter": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        batched_lbfgs(**arguments)


def test_one_block_reaches_the_exact_minimiser_past_rounding():
    """A function-value line search stalls near |grad| ~ sqrt(eps); this one goes on."""
    g = torch.Generator().manual_seed(0)
    root = torch.randn(6, 6, generator=g)
    hessian = root @ root.T + torch.diag(torch.logspace(0, 3, 6))
    linear = torch.randn(6, generator=g)

    def objective(x):
        return 1e4 + 0.5 * torch.einsum("bi,ij,bj->b", x, hessian, x) + x @ linear  # a large constant

    result = batched_lbfgs(objective, torch.zeros(1, 6), max_iter=200)
    exact = torch.linalg.solve(hessian, -linear)
    torch.testing.assert_close(result.x[0], exact, rtol=0, atol=1e-10)


def test_a_trial_point_outside_the_support_is_refused():
    """A trial point where the model raises ValueError (e.g. Pyro's validation) is backtracked from."""

    def objective(x):
        if x.abs().max() > 3.5:
            raise ValueError("outside the support")
        return (x - 3.4).square().sum(1) * 1e3 + (x - 3.4).pow(4).sum(1)

    result = batched_lbfgs(objective, torch.tensor([[3.0]]), max_iter=50)
    torch.testing.assert_close(result.x, torch.tensor([[3.4]]), rtol=0, atol=1e-8)


def test_a_box_from_a_non_finite_start_gradient_leaves_the_other_blocks_free():
    """A block whose start gradient is not finite gets no box (it is frozen anyway): its trial
    points stay finite, so an objective that refuses non-finite input (as Pyro's argument
    validation does, raising for the whole batch) does not reject the other blocks' steps."""
    objective, optimum = quadratics(num_blocks=3, dim=4)

    def validated(x):
        if not bool(torch.isfinite(x).all()):
            raise ValueError("non-finite argument")
        # Block 1's value and gradient are NaN; the others' are untouched.
        poisoned = (x[1:2] * torch.nan).sum(1)
        return torch.cat([objective(x[:1], slice(0, 1)), poisoned, objective(x[2:], slice(2, 3))])

    x0 = torch.randn(3, 4)
    result = batched_lbfgs(validated, x0, max_iter=100, box=lambda grad: 100.0 * (grad.abs() + 1.0))
    assert torch.equal(result.x[1], x0[1])
    for b in (0, 2):
        torch.testing.assert_close(result.x[b], optimum[b], rtol=0, atol=1e-8 * float(optimum[b].norm()))


def test_a_rejected_step_is_shortened_by_quadratic_interpolation_within_bounds():
    value = torch.zeros(5, dtype=torch.float64)
    slope = torch.tensor([-1.0, -1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    # f(t) = -t + q t^2 along the step: the minimiser 1/(2q), kept within [0.1, 0.5].
    q = torch.tensor([4.0, 100.0, 1.5, 4.0, 4.0], dtype=torch.float64)
    trial = value + slope + q
    trial[3] = float("inf")
    factor = lbfgs._backtracking_factor(value, trial, slope)
    expected = torch.tensor([0.125, 0.1, 1 / 3, 0.5, 0.5], dtype=torch.float64)
    torch.testing.assert_close(factor, expected)


def test_an_overshooting_quasi_newton_step_is_recovered_in_fewer_evaluations_than_by_halving(monkeypatch):
    # f(x) = -x + exp(x - 5): flat near 0, a wall near 5. The step after the first (scaled
    # steepest descent) step measures the flat part and overshoots the wall by about 15x.
    def objective(x):
        return (-x + torch.exp(x - 5.0)).sum(1)

    start = torch.zeros(1, 1, dtype=torch.float64)
    probe = batched_lbfgs(objective, start, max_iter=1)
    interpolated = batched_lbfgs(objective, start, max_iter=4)
    monkeypatch.setattr(lbfgs, "BACKTRACK_BOUNDS", (0.5, 0.5))
    halved = batched_lbfgs(objective, start, max_iter=4)
    assert interpolated.value.item() < probe.value.item() - 0.5
    assert halved.value.item() == probe.value.item()  # still backtracking
