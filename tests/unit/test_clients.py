"""Local training: updates are relative to an untouched global model and match an independent reference."""

import functools
import math

import numpy as np
import pytest
import torch
from numpy.testing import assert_allclose
from torch.nn.functional import cross_entropy

from fedrun.aggregators import FedAvg, RoundView
from fedrun.clients import LocalWork, _batches, cohort_losses
from fedrun.models import MLP, flat_parameters, load_flat
from fedrun.parts import Parts
from fedrun.programs import train_cohort
from fedrun.seeding import torch_generator

torch.manual_seed(0)
X, Y = torch.randn(40, 1, 2, 3), torch.randint(0, 3, (40,))
PARTS = [np.arange(0, 12), np.arange(12, 40)]
SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.5)


def reference_update(model, w, part, client, round_, batch_size=5, epochs=2):
    """Train a private copy with plain torch, as a single client would."""
    copy = MLP((1, 2, 3), 3, hidden=(4,))
    load_flat(copy, w)
    opt = torch.optim.SGD(copy.parameters(), lr=0.1, momentum=0.5)
    idx = torch.as_tensor(part)
    for batch in _batches(len(part), batch_size, epochs, None, torch_generator(0, "batches", round_, client)):
        opt.zero_grad()
        cross_entropy(copy(X[idx[batch]]), Y[idx[batch]]).backward()
        opt.step()
    return flat_parameters(copy) - w


def test_cohort_updates_leave_global_untouched_and_match_reference():
    model = MLP((1, 2, 3), 3, hidden=(4,))
    w = flat_parameters(model)
    w_before = w.clone()
    deltas = train_cohort(model, w, X, Y, PARTS, np.array([0, 1]), SGD, 0.1, LocalWork(5, 2), seed=0, round_=1).deltas
    assert torch.equal(w, w_before), "local training wrote into the global model"
    assert deltas.abs().sum(1).min() > 0
    for row, (part, client) in enumerate(zip(PARTS, [0, 1])):
        torch.testing.assert_close(deltas[row], reference_update(model, w, part, client, 1))


def test_one_fedavg_round_is_the_sample_weighted_mean_of_client_models():
    model = MLP((1, 2, 3), 3, hidden=(4,))
    w = flat_parameters(model)
    deltas = train_cohort(model, w, X, Y, PARTS, np.array([0, 1]), SGD, 0.1, LocalWork(5, 2), seed=0, round_=1).deltas
    report = RoundView(np.array([0, 1]), np.array([12, 28]), None, 1)
    update, _, _ = FedAvg().aggregate(w, deltas, report)
    new = w + update
    client_models = [w + reference_update(model, w, p, c, 1) for p, c in zip(PARTS, [0, 1])]
    torch.testing.assert_close(new, 0.3 * client_models[0] + 0.7 * client_models[1])


def test_local_steps_and_epochs_count_batches():
    g = torch_generator(0, "batches", 1, 0)
    assert [len(b) for b in _batches(12, 5, 2, None, g)] == [5, 5, 2, 5, 5, 2]
    assert [len(b) for b in _batches(12, 5, 1, 4, g)] == [5, 5, 2, 5]


def test_cohort_losses_are_each_clients_mean_loss():
    model = MLP((1, 2, 3), 3, hidden=(4,))
    w = flat_parameters(model)
    losses = cohort_losses(model, w, X, Y, PARTS, batch_size=5)
    with torch.no_grad():
        expected = [cross_entropy(model(X[p]), Y[p]).item() for p in PARTS]
        # authors' scale: batch means of consecutive batches of 5, summed, over n
        authors = [
            sum(cross_entropy(model(X[p[i : i + 5]]), Y[p[i : i + 5]]).item() for i in range(0, len(p), 5)) / len(p)
            for p in PARTS
        ]
    assert_allclose(losses.mean, expected, rtol=1e-5)
    assert_allclose(losses.authors, authors, rtol=1e-5)


def test_local_losses_are_the_last_epochs_running_loss():
    model = MLP((1, 2, 3), 3, hidden=(4,))
    w = flat_parameters(model)
    local = train_cohort(
        model, w, X, Y, PARTS, np.array([0, 1]), SGD, 0.0, LocalWork(5, 3), seed=0, round_=1
    ).local_losses
    # lr = 0: the model never moves, so every batch loss is the global model's loss on that batch
    full = cohort_losses(model, w, X, Y, PARTS, batch_size=5)
    assert_allclose(local.mean, full.mean, rtol=1e-5)


def test_poisson_sampling_draws_each_client_with_its_probability_and_fixed_sampling_is_unchanged():
    from fedrun.rounds import Schedule
    from fedrun.seeding import numpy_rng

    poisson = Schedule(clients_per_round=0.05, sampling="poisson")
    draws = [poisson.draw(numpy_rng(0, "sampling"), 1000)]
    sampler = numpy_rng(1, "sampling")
    draws += [poisson.draw(sampler, 1000) for _ in range(399)]
    sizes = np.array([len(d) for d in draws])
    # 400 rounds of Binomial(1000, 0.05): mean 50 (its standard error sqrt(47.5 / 400) = 0.34), sd sqrt(47.5) = 6.9.
    assert abs(sizes.mean() - 50) < 1.5 and 5.5 < sizes.std() < 8.5
    # Each client's count: Binomial(400, 0.05), mean 20 and variance 19; their mean over 1,000 clients has a
    # standard error of sqrt(19 / 1000) = 0.14 (0.6 is 4.3 of them), their variance one of about 19 * sqrt(2 / 1000).
    counts = np.bincount(np.concatenate(draws), minlength=1000)
    assert abs(counts.mean() - 20) < 0.6 and 15 < counts.var() < 23 and counts.min() >= 3
    assert all(np.all(np.diff(d) > 0) for d in draws)  # sorted ids, no client twice
    again = numpy_rng(1, "sampling")
    assert all(np.array_equal(poisson.draw(again, 1000), d) for d in draws[1:4])  # the seed's draws
    assert len(Schedule(clients_per_round=1.0, sampling="poisson").draw(numpy_rng(0, "s"), 7)) == 7
    # fixed: the draw fedrun always made (same stream, same clients).
    fixed, old = numpy_rng(3, "sampling"), numpy_rng(3, "sampling")
    assert np.array_equal(
        Schedule(clients_per_round=0.1).draw(fixed, 200), np.sort(old.choice(200, size=20, replace=False))
    )


@pytest.mark.parametrize("backend", ["loop", "processes", "vmap"])
def test_a_round_with_nobody_sampled_keeps_the_model_and_is_on_record(backend):
    from fedrun.backends import Device
    from fedrun.datasets import FederatedData
    from fedrun.engine import run
    from fedrun.models import Logistic
    from fedrun.rounds import Schedule

    g = torch.Generator().manual_seed(0)
    data = FederatedData(torch.randn(30, 4, generator=g), torch.randint(0, 3, (30,), generator=g),
                         torch.randn(9, 4, generator=g), torch.randint(0, 3, (9,), generator=g), num_classes=3)  # fmt: skip
    clients = [np.arange(0, 10), np.arange(10, 20), np.arange(20, 30)]
    rows, models = [], []
    torch.manual_seed(0)
    run(
        Logistic((4,), 3),
        data,
        clients,
        Parts(FedAvg()),
        functools.partial(torch.optim.SGD, lr=0.1),
        Schedule(rounds=12, local_steps=1, batch_size=5, clients_per_round=0.3, sampling="poisson"),
        Device("cpu", "contiguous", backend, workers=2),
        0,
        on_round=lambda row, per_client: (rows.append(row), models.append(per_client["alpha"].copy())),
    )
    sizes = [row["cohort_size"] for row in rows]
    assert 0 in sizes and max(sizes) >= 1  # with q = 0.3 and 3 clients, 34% of rounds are empty
    for row, alpha in zip(rows, models):
        if row["cohort_size"] == 0:
            assert not alpha.any() and math.isnan(row["train_loss"]) and row["upload_mb"] == 0
        else:
            assert alpha.sum() == pytest.approx(1.0)
    # The model is unchanged by an empty round (server sgd): its test metrics repeat the previous round's.
    for before, row in zip(rows, rows[1:]):
        if row["cohort_size"] == 0:
            assert row["test_loss"] == before["test_loss"] and row["test_accuracy"] == before["test_accuracy"]
