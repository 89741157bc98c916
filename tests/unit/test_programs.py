"""Client programs (fedrun/programs.py): SCAFFOLD, FedDyn and MOON by hand on a one-feature model, their degenerate
cases equal to the methods they reduce to, and a program of the tests' own run by the backends unchanged."""

import math
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from fedrun.backends import LoopTrainer, ProcessTrainer
from fedrun.cohort import LocalWork
from fedrun.models import CNN, flat_delta, flat_parameters
from fedrun.optimizers import ProxSGD
from fedrun.programs import FedDyn, LocalSGD, Moon, Program, Scaffold, representation, train_cohort

# Two clients of a one-feature, two-class linear model w in R^2 (logits w * x), in float64: client 0 holds x = 1
# (class 0) and x = 2 (class 1), client 1 holds x = -1 (class 1). Each takes two full-batch steps at lr 0.5.
X = torch.tensor([[1.0], [2.0], [-1.0]], dtype=torch.float64)
Y = torch.tensor([0, 1, 1])
PARTS = [np.array([0, 1]), np.array([2])]
LR, STEPS = 0.5, 2
W0 = torch.tensor([0.3, -0.2], dtype=torch.float64)


def linear() -> nn.Module:
    return nn.Linear(1, 2, bias=False).double()


def gradient(w: np.ndarray, part: np.ndarray) -> np.ndarray:
    """The mean cross-entropy's gradient in w, by hand: (softmax(w x) - onehot(y)) x, averaged over the samples."""
    total = np.zeros(2)
    for i in part:
        x, y = float(X[i, 0]), int(Y[i])
        p = np.exp(w * x) / np.exp(w * x).sum()
        total += (p - np.eye(2)[y]) * x
    return total / len(part)


def run(program: Program | None, params=W0, optimizer=None, steps=STEPS):
    work = LocalWork(batch_size=2, local_steps=steps)
    make = optimizer or partial(torch.optim.SGD, lr=LR)
    return train_cohort(linear(), params, X, Y, PARTS, np.array([0, 1]), make, LR, work, 0, 1, program=program)


def test_scaffold_by_hand_two_clients_two_steps_and_the_server_variate():
    c = torch.tensor([0.1, -0.05], dtype=torch.float64)
    c_i = torch.tensor([[0.02, 0.03], [-0.04, 0.01]], dtype=torch.float64)
    out = run(Program(Scaffold(), c_i, c))
    for k, part in enumerate(PARTS):
        w = W0.numpy().copy()
        for _ in range(STEPS):  # line 10: y <- y - eta_l (g_i(y) - c_i + c)
            w = w - LR * (gradient(w, part) - c_i[k].numpy() + c.numpy())
        np.testing.assert_allclose(out.deltas[k].numpy(), w - W0.numpy(), rtol=1e-12)
        kept = c_i[k].numpy() - c.numpy() + (W0.numpy() - w) / (STEPS * LR)  # line 12, option II
        np.testing.assert_allclose(out.kept[k].numpy(), kept, rtol=1e-12)
    program = Scaffold()
    program.context, program.server = SimpleNamespace(sizes=np.zeros(10)), c  # N = 10 clients in the run
    program.server_keep(np.array([0, 1]), c_i, out.kept)
    expected = c + (out.kept - c_i).sum(0) / 10  # line 17: c + |S|/N * mean(dc_i)
    assert torch.equal(program.server, expected)


def test_scaffolds_variate_with_heavy_ball_momentum_divides_by_lr_times_the_steps_coefficient_norm():
    """With momentum rho the K steps move y by lr sum_j a_j (g_j - c_i + c), a = (1 + rho, 1) for K = 2: option II
    divides by lr ||a||_1 = lr (2 + rho), so c_i+ is the a-weighted mean of the corrected gradients plus c_i - c (it
    divided by K lr, and c_i+ came out about 1 / (1 - rho) times the gradient it estimates)."""
    rho = 0.9
    c = torch.tensor([0.1, -0.05], dtype=torch.float64)
    c_i = torch.tensor([[0.02, 0.03], [-0.04, 0.01]], dtype=torch.float64)
    out = run(Program(Scaffold(), c_i, c), optimizer=partial(torch.optim.SGD, lr=LR, momentum=rho))
    for k, part in enumerate(PARTS):
        w, buffer = W0.numpy().copy(), None
        for _ in range(STEPS):  # torch's heavy ball on the corrected gradient
            corrected = gradient(w, part) - c_i[k].numpy() + c.numpy()
            buffer = corrected if buffer is None else rho * buffer + corrected
            w = w - LR * buffer
        np.testing.assert_allclose(out.deltas[k].numpy(), w - W0.numpy(), rtol=1e-12)
        kept = c_i[k].numpy() - c.numpy() + (W0.numpy() - w) / (LR * (2 + rho))
        np.testing.assert_allclose(out.kept[k].numpy(), kept, rtol=1e-12)


def test_scaffold_with_zero_variates_is_fedavg_bit_for_bit():
    zeros = torch.zeros(2, 2, dtype=torch.float64)
    plain, scaffold = run(None), run(Program(Scaffold(), zeros, torch.zeros(2, dtype=torch.float64)))
    assert torch.equal(plain.deltas, scaffold.deltas)
    np.testing.assert_array_equal(plain.local_losses.mean, scaffold.local_losses.mean)


def test_feddyn_by_hand_clients_their_linear_term_and_the_server():
    alpha = 0.2
    g = torch.tensor([[0.05, -0.1], [0.0, 0.3]], dtype=torch.float64)
    out = run(Program(FedDyn(alpha=alpha), g, None))
    for k, part in enumerate(PARTS):
        w = W0.numpy().copy()
        for _ in range(STEPS):  # the gradient of L_k - <g_k, theta> + alpha/2 ||theta - theta^{t-1}||^2
            w = w - LR * (gradient(w, part) - g[k].numpy() + alpha * (w - W0.numpy()))
        np.testing.assert_allclose(out.deltas[k].numpy(), w - W0.numpy(), rtol=1e-12)
        np.testing.assert_allclose(out.kept[k].numpy(), g[k].numpy() - alpha * (w - W0.numpy()), rtol=1e-12)
    program = FedDyn(alpha=alpha)
    program.context = SimpleNamespace(sizes=np.zeros(4))  # m = 4 clients
    update = out.deltas.mean(0)
    adjusted = program.adjust(update, out.deltas, np.array([0, 1]))
    h = -alpha * out.deltas.sum(0) / 4  # line 9, from h^0 = 0
    assert torch.allclose(program.server, h, rtol=1e-15, atol=0)
    assert torch.allclose(adjusted, update - h / alpha, rtol=1e-15, atol=0)  # line 10
    again = program.adjust(update, out.deltas, np.array([0, 1]))  # h accumulates
    assert torch.allclose(again, update - 2 * h / alpha, rtol=1e-14, atol=0)


def test_feddyns_first_round_is_fedprox_with_mu_alpha_bit_for_bit():
    zeros = torch.zeros(2, 2, dtype=torch.float64)
    feddyn = run(Program(FedDyn(alpha=0.3), zeros, None))
    fedprox = run(None, optimizer=partial(ProxSGD, lr=LR, mu=0.3))
    assert torch.equal(feddyn.deltas, fedprox.deltas)


class TwoLayer(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(1, 2), nn.Tanh(), nn.Linear(2, 2))
        self.double()


def test_moons_contrastive_term_by_hand_and_its_step_against_a_plain_torch_one():
    # The term alone: z = (1, 0), z_glob = (1, 0), z_prev = (0, 1), tau = 0.5: -log(e^2 / (e^2 + e^0)).
    assert math.log(1 + math.exp(-2)) == pytest.approx(0.12692801104297263, abs=1e-15)
    torch.manual_seed(0)
    model = TwoLayer()
    start = flat_parameters(model).clone()
    previous = start + 0.1 * torch.randn_like(start)
    mu, tau = 2.0, 0.5
    out = train_cohort(
        model, start, X, Y, [np.array([0, 1, 2])], np.array([0]), partial(torch.optim.SGD, lr=LR), LR,
        LocalWork(batch_size=3, local_steps=1), 0, 1, program=Program(Moon(mu=mu, tau=tau), previous[None], None),
    )  # fmt: skip

    def features(flat):  # the first layer and tanh, written out: the input of the last layer
        weight, bias = flat[:2].view(2, 1), flat[2:4]
        return torch.tanh(X @ weight.T + bias)

    w = start.clone().requires_grad_(True)
    z = features(w)
    logits = z @ w[4:8].view(2, 2).T + w[8:10]
    cos = torch.nn.functional.cosine_similarity
    positive, negative = cos(z, features(start), dim=-1) / tau, cos(z, features(previous), dim=-1) / tau
    con = -torch.log(torch.exp(positive) / (torch.exp(positive) + torch.exp(negative))).mean()
    loss = torch.nn.functional.cross_entropy(logits, Y) + mu * con
    (grad,) = torch.autograd.grad(loss, w)
    assert torch.allclose(out.deltas[0], -LR * grad, rtol=1e-12, atol=1e-15)
    assert torch.allclose(out.kept[0], start + out.deltas[0])  # the client's model: next round's z_prev
    assert torch.allclose(representation(model, start, X), features(start), rtol=0, atol=0)


def test_moon_with_mu_zero_is_fedavg_bit_for_bit():
    torch.manual_seed(0)
    model = TwoLayer()
    start = flat_parameters(model).clone()
    args = (
        start,
        X,
        Y,
        PARTS,
        np.array([0, 1]),
        partial(torch.optim.SGD, lr=LR),
        LR,
        LocalWork(2, local_steps=2),
        0,
        1,
    )
    plain = train_cohort(model, *args)
    moon = train_cohort(model, *args, program=Program(Moon(mu=0.0), torch.stack([start, start]), None))
    assert torch.equal(plain.deltas, moon.deltas)


class NoisyGradient(LocalSGD):
    """A program of the tests' own (no edit under fedrun/): Gaussian noise on each gradient, from its own stream
    keyed by the client, and the count of its steps kept as its state."""

    keeps, name = True, "noisy"

    def corrected(self, local) -> None:
        generator = torch.Generator().manual_seed(1000 + local.client.id * 10 + len(local.losses))
        for p in local.client.model.parameters():
            p.grad.add_(0.01 * torch.randn(p.shape, generator=generator, dtype=p.dtype))

    def kept(self, local, delta, steps):
        return local.own + steps


def test_a_program_of_the_tests_own_runs_the_same_on_the_loop_and_in_worker_processes():
    model, owns = linear(), torch.zeros(2, 2, dtype=torch.float64)
    work, make = LocalWork(batch_size=2, local_steps=STEPS), partial(torch.optim.SGD, lr=LR)
    call = Program(NoisyGradient(), owns, None)
    loop = LoopTrainer(model, X, Y, make)(W0, PARTS, np.array([0, 1]), LR, work, 0, 1, program=call)
    workers = ProcessTrainer(model, X, Y, make, workers=2)
    try:
        processes = workers(W0, PARTS, np.array([0, 1]), LR, work, 0, 1, program=call)
    finally:
        workers.close()
    assert torch.equal(loop.deltas, processes.deltas) and torch.equal(loop.kept, processes.kept)
    assert not torch.equal(loop.deltas, run(None).deltas)  # the noise changed the updates
    assert torch.equal(loop.kept, torch.full((2, 2), float(STEPS), dtype=torch.float64))


def test_the_sample_tilted_program_by_hand_and_at_tau_zero_plain_sgd():
    from fedrun.programs import Tilted

    tau = 1.5
    out = run(Program(Tilted(tau=tau)))
    for k, part in enumerate(PARTS):
        w = W0.numpy().copy()
        for _ in range(STEPS):  # the gradient of (1/tau) log mean exp(tau l_j): sum_j softmax(tau l)_j grad l_j
            losses = []
            for i in part:
                x, y = float(X[i, 0]), int(Y[i])
                p = np.exp(w * x) / np.exp(w * x).sum()
                losses.append(-np.log(p[y]))
            weights = np.exp(tau * np.array(losses)) / np.exp(tau * np.array(losses)).sum()
            w = w - LR * sum(weights[j] * gradient(w, np.array([i])) for j, i in enumerate(part))
        np.testing.assert_allclose(out.deltas[k].numpy(), w - W0.numpy(), rtol=1e-12)
    assert torch.equal(run(Program(Tilted(tau=0.0))).deltas, run(None).deltas)


def test_a_clients_delta_is_written_into_its_row_with_the_bits_of_parameters_minus_start():
    # flat_delta (parameter by parameter into the cohort's row) against the two-pass flat_parameters(model) - start,
    # on a channels_last CNN (its parameters not contiguous in the flat order) in float32.
    torch.manual_seed(0)
    model = CNN((3, 8, 8), 4).to(memory_format=torch.channels_last)
    start = torch.randn(flat_parameters(model).numel())
    rows = torch.full((3, start.numel()), float("nan"))
    written = flat_delta(model, start, rows[1])
    assert written.data_ptr() == rows[1].data_ptr() and torch.isnan(rows[[0, 2]]).all()
    assert torch.equal(rows[1], flat_parameters(model) - start) and torch.equal(flat_delta(model, start), rows[1])


class OwnVector(LocalSGD):
    """A program of the tests' that returns its update as a vector of its own (not its row of the cohort's)."""

    def finish(self, local):
        local.out = None  # its row left as it was made (uninitialised): the update is only in the vector returned
        return super().finish(local)


def test_a_program_that_returns_a_vector_of_its_own_gets_it_copied_into_the_cohorts_rows():
    plain, own = run(None), run(Program(OwnVector(), None, None))
    assert torch.equal(own.deltas, plain.deltas) and own.deltas.shape == (2, 2)
