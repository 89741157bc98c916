"""Local solvers, FedNova, MVR and heterogeneity: equalities with plain SGD/FedAvg and hand-computed numbers."""

import functools

import numpy as np
import pytest
import torch
from numpy.testing import assert_allclose

from fedrun.aggregators import MVR, FedAvg, FedNova, RoundView
from fedrun.clients import LocalWork
from fedrun.heterogeneity import RandomSteps, Stragglers
from fedrun.models import MLP, flat_parameters
from fedrun.optimizers import STORM, ProxSGD, coefficient_norm
from fedrun.parts import Parts
from fedrun.programs import train_cohort
from fedrun.servers import ServerOptimizer

torch.manual_seed(0)
X, Y = torch.randn(40, 1, 2, 3), torch.randint(0, 3, (40,))
PARTS = [np.arange(0, 12), np.arange(12, 40)]


def updates(make_optimizer, lr=0.1, work=LocalWork(5, 2)):  # noqa: B008 (LocalWork is immutable)
    torch.manual_seed(1)
    model = MLP((1, 2, 3), 3, hidden=(4,))
    return train_cohort(
        model, flat_parameters(model), X, Y, PARTS, np.array([0, 1]), make_optimizer, lr, work, seed=0, round_=1
    )


def test_prox_with_mu_zero_is_sgd_and_mu_pulls_towards_the_global_model():
    sgd = updates(functools.partial(torch.optim.SGD, momentum=0.5)).deltas
    torch.testing.assert_close(updates(functools.partial(ProxSGD, mu=0.0, momentum=0.5)).deltas, sgd, rtol=0, atol=0)
    pulled = updates(functools.partial(ProxSGD, mu=5.0, momentum=0.5)).deltas
    assert (pulled.norm(dim=1) < sgd.norm(dim=1)).all()


def test_storm_with_beta_one_is_sgd():
    sgd = updates(torch.optim.SGD).deltas
    torch.testing.assert_close(updates(functools.partial(STORM, beta=1.0)).deltas, sgd)
    assert not torch.allclose(updates(functools.partial(STORM, beta=0.3)).deltas, sgd)


def quadratic_steps(opt, p, rounds_and_steps):
    """Run ``opt`` on 0.5 (p - 3)^2 (deterministic, so STORM's correction vanishes); returns p after each step."""

    def closure():
        opt.zero_grad()
        loss = 0.5 * (p - 3).pow(2).sum()
        loss.backward()
        return loss

    seen = []
    for _ in range(rounds_and_steps):
        opt.step(closure)
        seen.append(p.item())
    return seen


def test_storm_adaptive_step_follows_the_round_by_hand():
    # Theorem A.1 (paper 002 line 259): eta_t = k0 / (w0 + sigma2 t)^(1/3); k0 = 1, w0 = 7, sigma2 = 1.
    # Round 1: eta = 1 / 8^(1/3) = 1/2 for every step of the round: p = 0 -> 0 + 3/2 = 1.5 -> 1.5 + 1.5/2 = 2.25.
    p = torch.nn.Parameter(torch.zeros(1))
    opt = STORM([p], adaptive=True, k0=1.0, w0=7.0, sigma2=1.0, beta=0.5)
    opt.start_round(1, None)
    assert quadratic_steps(opt, p, 2) == pytest.approx([1.5, 2.25])
    assert opt.etas == pytest.approx([0.5, 0.5])
    # Round 20, a fresh solver (clients keep nothing): eta = 1 / 27^(1/3) = 1/3: p = 0 -> 1 -> 1 + 2/3.
    p = torch.nn.Parameter(torch.zeros(1))
    opt = STORM([p], adaptive=True, k0=1.0, w0=7.0, sigma2=1.0, beta=0.5)
    opt.start_round(20, None)
    assert quadratic_steps(opt, p, 2) == pytest.approx([1.0, 5 / 3])
    # The defaults (k0 = w0 = 0.1, sigma2 = 1) decay from 0.1 / 1.1^(1/3) = 0.1 / 1.03228 = 0.09687
    # to 0.1 / 30.1^(1/3) = 0.1 / 3.11070 = 0.03215 at round 30.
    assert STORM.step_size(1, 0.1, 0.1, 1.0) == pytest.approx(0.09687, abs=1e-5)
    assert STORM.step_size(30, 0.1, 0.1, 1.0) == pytest.approx(0.03215, abs=1e-5)


def batch_closures(opt, p, curvatures):
    """Closures over mini-batches k with loss 0.5 a_k p^2 (gradient a_k p), one per step."""

    def make(a):
        def closure():
            opt.zero_grad()
            loss = 0.5 * a * p.pow(2).sum()
            loss.backward()
            return loss

        return closure

    return [make(a) for a in curvatures]


def test_storm_pure_recursion_beta_zero_by_hand():
    # beta = 0, eta = 0.1, p0 = 1, batches with a = 1, 2, 4:
    # d0 = 1 * 1 = 1, p1 = 0.9; d1 = 2 * 0.9 + (d0 - 2 * 1) = 0.8, p2 = 0.82;
    # d2 = 4 * 0.82 + (d1 - 4 * 0.9) = 0.48, p3 = 0.772.
    p = torch.nn.Parameter(torch.ones(1))
    opt = STORM([p], lr=0.1, beta=0.0)
    seen = []
    for closure in batch_closures(opt, p, [1.0, 2.0, 4.0]):
        opt.step(closure)
        seen.append(p.item())
    assert seen == pytest.approx([0.9, 0.82, 0.772])


def test_storm_full_gradient_init_by_hand():
    # init full: d0 is the full-data gradient (here 3 p) instead of the first batch's; then the recursion.
    # d0 = 3 * 1 = 3, p1 = 0.7; d1 = 2 * 0.7 + (3 - 2 * 1) = 2.4, p2 = 0.7 - 0.24 = 0.46.
    p = torch.nn.Parameter(torch.ones(1))
    opt = STORM([p], lr=0.1, beta=0.0, init="full")
    full = batch_closures(opt, p, [3.0])[0]
    opt.start_round(1, full)
    for closure in batch_closures(opt, p, [1.0, 2.0]):
        opt.step(closure)
    assert p.item() == pytest.approx(0.46)


def test_storm_init_full_through_train_cohort_uses_the_clients_full_gradient():
    # One local step with init full and beta = 0 is one full-batch gradient step: the same as SGD with a
    # batch as large as the client.
    full_batch = updates(torch.optim.SGD, work=LocalWork(40, local_steps=1)).deltas
    storm = updates(functools.partial(STORM, beta=0.0, init="full"), work=LocalWork(5, local_steps=1)).deltas
    torch.testing.assert_close(storm, full_batch)


def test_mvr_trajectories_take_the_same_adaptive_steps():
    """Paper 002 Algorithm 1 line 13: omega and omega-hat (from the previous global model) step with the same eta_t."""
    from fedrun.datasets import FederatedData
    from fedrun.engine import Schedule, run

    made = []

    def solver(params, lr):
        made.append(STORM(params, lr=lr, beta=0.0, init="full", adaptive=True, k0=0.1, w0=0.1, sigma2=1.0))
        return made[-1]

    solver.keywords = {"lr": 0.1}  # what the engine reads as the base rate of a partial
    torch.manual_seed(0)
    model = MLP((1, 2, 3), 3, hidden=(4,))
    data = FederatedData(X, Y, X[:8], Y[:8], num_classes=3)
    run(
        model,
        data,
        PARTS,
        Parts(MVR(beta=0.5)),
        solver,
        Schedule(rounds=3, local_steps=3, batch_size=5),
        torch.device("cpu"),
        0,
    )
    # Round 1: one trajectory per client; rounds 2 and 3: from w_t, then from w_{t-1}, per client.
    assert len(made) == 2 + 4 + 4
    for t, first in ((2, 2), (3, 6)):
        eta = 0.1 / (0.1 + t) ** (1 / 3)
        for i in range(2):
            assert made[first + i].etas == made[first + 2 + i].etas == pytest.approx([eta] * 3)


def test_coefficient_norms_match_fednova_closed_forms():
    assert coefficient_norm(7, 0.1) == 7
    rho, tau = 0.5, 6
    assert coefficient_norm(tau, 0.1, momentum=rho) == pytest.approx(
        (tau - rho * (1 - rho**tau) / (1 - rho)) / (1 - rho)
    )
    lr, mu = 0.1, 0.5
    assert coefficient_norm(tau, lr, mu=mu) == pytest.approx((1 - (1 - lr * mu) ** tau) / (lr * mu))
    assert coefficient_norm(tau, 0.0, momentum=rho, mu=mu) == coefficient_norm(
        tau, 0.1, momentum=rho
    )  # lr -> 0: no prox pull


def test_coefficient_norms_with_dampening_and_nesterov_match_their_sums_and_torchs_sgd():
    """torch's SGD with dampening d (its first step takes the gradient whole) and Nesterov's step g + rho * buffer:
    ||a||_1 as the sums of each gradient's later displacement, and as torch moves a parameter under a unit gradient
    (FedNova's normaliser and SCAFFOLD's option II read it; both once counted these as heavy-ball steps)."""
    rho, d, tau, lr = 0.9, 0.3, 7, 0.1
    geometric = [(1 - rho**i) / (1 - rho) for i in range(1, tau + 1)]  # one gradient's displacement over i steps
    damped = geometric[-1] + (1 - d) * sum(geometric[:-1])
    nesterov = tau + rho * sum(geometric)
    assert coefficient_norm(tau, lr, momentum=rho, dampening=d) == pytest.approx(damped, rel=1e-14)
    assert coefficient_norm(tau, lr, momentum=rho, nesterov=True) == pytest.approx(nesterov, rel=1e-14)
    for kwargs in ({"dampening": d}, {"nesterov": True}, {"dampening": 0.5, "weight_decay": 0.0}):
        p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        sgd = torch.optim.SGD([p], lr=lr, momentum=rho, **kwargs)
        for _ in range(tau):
            p.grad = torch.ones(1, dtype=torch.float64)
            sgd.step()
        moved = -float(p.detach()[0]) / lr
        kwargs.pop("weight_decay", None)
        assert coefficient_norm(tau, lr, momentum=rho, **kwargs) == pytest.approx(moved, rel=1e-13)
    assert coefficient_norm(tau, lr, momentum=0.0, dampening=d) == tau  # no momentum: dampening does nothing


def test_storms_coefficient_norm_counts_its_steps_in_units_of_the_base_rate():
    """The update of K STORM steps is -eta sum_k d_k: ||a||_1 = K eta / lr, K where eta is lr (not adaptive)."""
    p = torch.nn.Parameter(torch.zeros(2))
    fixed = STORM([p], lr=0.1, beta=0.5)
    fixed.start_round(3, None)
    assert fixed.coefficient_norm(4) == 4.0
    adaptive = STORM([p], lr=0.1, adaptive=True, k0=1.0, w0=7.0, sigma2=1.0, beta=0.5)
    adaptive.start_round(1, None)
    eta = 1.0 / (7.0 + 1.0) ** (1 / 3)  # Theorem A.1's k0 / (w0 + sigma2 t)^(1/3) at t = 1
    assert adaptive.coefficient_norm(4) == pytest.approx(4 * eta / 0.1, rel=1e-15)


def test_solver_reports_steps_and_norms():
    done = updates(functools.partial(torch.optim.SGD, momentum=0.5))
    assert list(done.steps) == [6, 12]  # ceil(12/5) * 2, ceil(28/5) * 2
    assert_allclose(done.coefficient_norms, [coefficient_norm(6, 0.1, 0.5), coefficient_norm(12, 0.1, 0.5)])


def report(sizes, norms, previous=None):
    return RoundView(
        np.arange(len(sizes)),
        np.array(sizes),
        None,
        1,
        coefficient_norms=np.array(norms, float),
        previous_deltas=previous,
    )


def test_fednova_equals_fedavg_with_equal_work_and_follows_its_formula_otherwise():
    deltas = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    w = torch.zeros(2)
    equal = report([1, 3], [5, 5])
    torch.testing.assert_close(FedNova().aggregate(w, deltas, equal)[0], FedAvg().aggregate(w, deltas, equal)[0])
    # p = [.25, .75], ||a|| = [2, 4]: tau_eff = 3.5, scales p * 3.5 / ||a|| = [.4375, .65625]
    update, alpha, diagnostics = FedNova().aggregate(w, deltas, report([1, 3], [2, 4]))
    assert_allclose(update.numpy(), [0.4375, 0.65625])
    assert_allclose(alpha, [0.25, 0.75])


def test_mvr_first_round_is_plain_averaging_then_its_momentum_by_hand():
    agg, w = MVR(beta=0.5), torch.zeros(2)
    first, _, _ = agg.aggregate(w, torch.tensor([[1.0, 3.0], [1.0, -1.0]]), report([1, 1], [1, 1]))
    assert_allclose(first.numpy(), [1.0, 1.0])
    # fresh mean [1, 1]; correction mean(Delta - Delta_hat) = [.5, .5]; m = .5 [1, 1] + .5 ([1, 1] + [.5, .5])
    second, _, _ = agg.aggregate(
        w,
        torch.tensor([[2.0, 0.0], [0.0, 2.0]]),
        report([1, 1], [1, 1], previous=torch.tensor([[1.0, 0.0], [0.0, 1.0]])),
    )
    assert_allclose(second.numpy(), [1.25, 1.25])


@pytest.mark.parametrize("lr", [0.1, 0.01])
def test_two_client_quadratic_fedavg_bias_and_fednova_fixed_points(lr):
    """F_i(x) = (x - e_i)^2 / 2, e = (0, 1), p = (1/2, 1/2), tau = (1, 10) local GD steps at this lr.

    A client's update from x is c_i (e_i - x) with c_i = 1 - (1 - lr)^tau_i. FedAvg's fixed point is
    sum p_i c_i e_i / sum p_i c_i; FedNova's (||a_i|| = tau_i) is sum p_i (c_i/tau_i) e_i / sum p_i (c_i/tau_i);
    the true optimum is 1/2. (Wang et al.'s objective inconsistency: FedNova's residual bias vanishes as lr -> 0.)
    """
    e, tau = np.array([0.0, 1.0]), np.array([1, 10])
    c = 1 - (1 - lr) ** tau
    closed = {"fedavg": (c @ e) / c.sum(), "fednova": ((c / tau) @ e) / (c / tau).sum()}
    for name, agg in (("fedavg", FedAvg(weighting="uniform")), ("fednova", FedNova(weighting="uniform"))):
        x, server = torch.tensor([0.3], dtype=torch.float64), ServerOptimizer()
        for _ in range(3000):
            deltas = []
            for target, steps in zip(e, tau):
                local = x.clone()
                for _ in range(steps):
                    local = local - lr * (local - target)  # exact gradient step
                deltas.append(local - x)
            r = RoundView(
                np.arange(2), np.ones(2), None, 1, coefficient_norms=np.array([coefficient_norm(s, lr) for s in tau])
            )
            x = server.step(x, agg.aggregate(x, torch.stack(deltas), r)[0])
        assert x.item() == pytest.approx(closed[name], abs=1e-9)
    assert abs(closed["fednova"] - 0.5) < abs(closed["fedavg"] - 0.5) / 3


def test_heterogeneity_plans():
    cohort, sizes, work = np.arange(6), np.full(6, 20), LocalWork(5, local_epochs=2)
    fixed = RandomSteps(low=2, high=9)
    first, again = fixed.plan(1, cohort, sizes, work, 0), fixed.plan(2, cohort, sizes, work, 0)
    assert [w.local_steps for w in first] == [w.local_steps for w in again]
    assert all(2 <= w.local_steps <= 9 for w in first)
    redrawn = RandomSteps(low=2, high=9, redraw=True)
    assert [w.local_steps for w in redrawn.plan(1, cohort, sizes, work, 0)] != [
        w.local_steps for w in redrawn.plan(2, cohort, sizes, work, 0)
    ]
    partial = Stragglers(fraction=0.5).plan(3, cohort, sizes, work, 0)
    assert sum(w is not work for w in partial) == 3 and all(1 <= w.local_steps <= 8 for w in partial if w is not work)
    dropped = Stragglers(fraction=0.5, mode="drop").plan(3, cohort, sizes, work, 0)
    assert sum(w is None for w in dropped) == 3


def test_the_learning_rate_of_round_t_is_the_base_rate_decayed_t_minus_1_times():
    import functools

    from fedrun.engine import Schedule
    from fedrun.optimizers import base_lr

    schedule = Schedule(lr_decay=0.99)
    assert schedule.lr(1e-4, 1) == 1e-4  # round 1: the base rate (paper 000, Table 2: 1e-4 * 0.99^r from r = 0)
    assert schedule.lr(1e-4, 3) == pytest.approx(9.801e-05, rel=1e-12)  # 1e-4 * 0.99^2
    assert base_lr(functools.partial(torch.optim.SGD, lr=0.05)) == 0.05 and base_lr(object(), default=0.1) == 0.1


def test_a_runs_solvers_are_built_cleared_saved_and_loaded_without_importing_torchs_compiler():
    """``fedrun.optimizers.eager_optimizer_methods``: the four compiler-guarded methods of ``torch.optim.Optimizer``
    run as themselves in a fresh interpreter, where nothing imported ``torch._dynamo`` before: a solver is built,
    its state saved and loaded back, its gradients cleared and a group added, and the compiler is still not
    imported; in this process, a fedrun solver's (STORM's) state saved and loaded into another is the same."""
    import subprocess
    import sys

    probe = """
import sys, torch
from fedrun.optimizers import eager_optimizer_methods
print(sorted(eager_optimizer_methods()))
model = torch.nn.Linear(3, 2)
sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model(torch.ones(4, 3)).sum().backward()
saved = sgd.state_dict()
sgd.load_state_dict(saved)
sgd.zero_grad()
sgd.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
print("torch._dynamo" in sys.modules, [p.grad for p in model.parameters()], len(sgd.param_groups))
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.split("\n")[:2] == [
        "['add_param_group', 'load_state_dict', 'state_dict', 'zero_grad']",
        "False [None, None] 2",
    ]
    model = torch.nn.Linear(3, 2)
    solver = STORM(model.parameters(), lr=0.1)
    again = STORM(torch.nn.Linear(3, 2).parameters(), lr=0.1)
    again.load_state_dict(solver.state_dict())
    assert again.state_dict() == solver.state_dict()
