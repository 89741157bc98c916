"""Local training: updates are relative to an untouched global model and match an independent reference."""

import functools

import numpy as np
import torch
from numpy.testing import assert_allclose
from torch.nn.functional import cross_entropy

from fedrun.aggregators import FedAvg, RoundView
from fedrun.clients import LocalWork, _batches, cohort_losses, train_cohort
from fedrun.models import MLP, flat_parameters, load_flat
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
