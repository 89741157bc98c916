"""Fast paths equal the plain computation they replace."""

import functools
import math

import numpy as np
import torch
from torch import nn

from fedrun.aggregators import FedAvg, FedSoftMax
from fedrun.clients import LazyLosses, cohort_losses
from fedrun.datasets import FederatedData
from fedrun.engine import Schedule, run
from fedrun.models import CNN, MLP


def test_cnn_relu_after_pooling_equals_the_papers_order_exactly():
    torch.manual_seed(0)
    model = CNN((1, 28, 28), 10)
    conv1, _, _, conv2, _, _, flatten, linear = model
    papers = nn.Sequential(conv1, nn.ReLU(), nn.MaxPool2d(2), conv2, nn.ReLU(), nn.MaxPool2d(2), flatten, linear)
    x, y = torch.randn(16, 1, 28, 28) - 1.0, torch.randint(0, 10, (16,))  # shifted: many all-negative pooling windows
    grads = []
    for net in (model, papers):
        net.zero_grad()
        out = net(x)
        nn.functional.cross_entropy(out, y).backward()
        grads.append((out.detach(), [p.grad.clone() for p in net.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=0)
    for mine, theirs in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_lazy_losses_compute_once_on_first_read():
    calls = []

    def compute():
        calls.append(1)
        return cohort_losses(model, torch.nn.utils.parameters_to_vector(model.parameters()).detach(), X, Y, PARTS, 5)

    torch.manual_seed(0)
    model = MLP((1, 2, 3), 3, hidden=(4,))
    lazy = LazyLosses(compute)
    assert not lazy.computed and calls == []
    first = lazy.mean
    assert lazy.computed and np.array_equal(lazy.mean, first) and lazy.authors is not None and len(calls) == 1


torch.manual_seed(0)
X, Y = torch.randn(40, 1, 2, 3), torch.randint(0, 3, (40,))
PARTS = [np.arange(0, 12), np.arange(12, 40)]
SGD = functools.partial(torch.optim.SGD, lr=0.1)


def engine_rows(aggregator, eval_every):
    torch.manual_seed(0)
    model = MLP((1, 2, 3), 3, hidden=(4,))
    rows = []
    result = run(model, FederatedData(X, Y, X[:8], Y[:8], num_classes=3), PARTS, aggregator, SGD,
                 Schedule(rounds=4, local_steps=2, batch_size=5, eval_every=eval_every), torch.device("cpu"), 0,
                 on_round=lambda row, per_client: rows.append(row))
    return result.params, rows


def test_losses_nobody_reads_are_skipped_and_train_loss_keeps_its_meaning():
    every, every_rows = engine_rows(FedAvg(), eval_every=1)
    skipping, skipping_rows = engine_rows(FedAvg(), eval_every=2)
    torch.testing.assert_close(skipping, every, rtol=0, atol=0)  # training is untouched
    for t, (a, b) in enumerate(zip(every_rows, skipping_rows), start=1):
        if t % 2 == 0:  # evaluated: the same F(w_t) over the cohort, measured at the round's start model
            assert b["train_loss"] == a["train_loss"] and b["loss_wall_s"] > 0
        else:  # FedAvg reads no losses and the round is not evaluated: no loss pass
            assert math.isnan(b["train_loss"]) and b["loss_wall_s"] == 0
    # An aggregator that reads the losses gets them every round, so train_loss is there every round.
    _, softmax_rows = engine_rows(FedSoftMax(), eval_every=2)
    assert all(not math.isnan(r["train_loss"]) for r in softmax_rows)
    assert softmax_rows[1]["train_loss"] != every_rows[1]["train_loss"]  # a different model by round 2
