"""Batch norm (fedrun.models.BatchNorm, fedrun.clients.calibrate) and FedBN (fedrun.personal.FedBN): the statistics
by hand, calibrated evaluation against PyTorch's training-mode normalisation, where each evaluation takes its
statistics from, what FedBN keeps on the client, its checkpoint, and the worker processes against the loop."""

import functools
import math

import numpy as np
import pytest
import torch
from torch import nn

from fedrun.aggregators import FedAvg
from fedrun.checkpoint import Checkpoint
from fedrun.clients import calibrate, per_sample_loss
from fedrun.datasets import FederatedData
from fedrun.engine import run
from fedrun.errors import ConfigError
from fedrun.models import CNN, BatchNorm, FedAvgCNN, batch_norm_names, flat_parameters, load_flat
from fedrun.parts import Parts, layout
from fedrun.personal import FedBN
from fedrun.rounds import Schedule
from fedrun.seeding import torch_seed
from fedrun.state import Context
from unit.test_backends import images

X, Y = images(90)  # 3 x 8 x 8 images, 4 classes; client c's inputs shifted by 2c (each its own statistics)
X = (X + 2.0 * torch.arange(90).div(30, rounding_mode="floor").view(90, 1, 1, 1)).double()
DATA = FederatedData(X, Y, X[:20], Y[:20], num_classes=4)
CLIENTS = [np.arange(30 * c, 30 * c + 20) for c in range(3)]  # trains on 20
TESTS = [np.arange(30 * c + 20, 30 * (c + 1)) for c in range(3)]  # its own 10 held out (indices into train)


def model(norm="batch"):
    torch.manual_seed(torch_seed(0, "init"))
    return CNN((3, 8, 8), 4, norm=norm).double()


def train(client_state=None, rounds=3, checkpoint=None, device=None, norm="batch", aggregator=None):
    rows, series = [], []
    result = run(
        model(norm),
        DATA,
        CLIENTS,
        Parts(aggregator or FedAvg(), client_state=client_state),
        functools.partial(torch.optim.SGD, lr=0.1),
        Schedule(rounds=rounds, local_steps=3, batch_size=5),
        device or torch.device("cpu"),
        0,
        on_round=lambda row, per_client: (rows.append(row), series.append(per_client)),
        client_tests=TESTS,
        checkpoint=checkpoint,
    )
    return result, rows, series


def judged_by_hand(net, params, calibration_index, test_index):
    """Accuracy of ``params`` on ``test_index``, normalised by the statistics of ``calibration_index``."""
    load_flat(net, params)
    net.eval()
    calibrate(net, DATA.x_train, torch.as_tensor(calibration_index))
    with torch.no_grad():
        return float((net(DATA.x_train[test_index]).argmax(1) == DATA.y_train[test_index]).double().mean())


def test_calibrated_statistics_by_hand_layer_by_layer():
    # bn1 on x = 1, 2, 3, 6: mean 3, biased variance (4 + 1 + 0 + 9) / 4 = 3.5. A 1x1 convolution (2 z + 1) of the
    # normalised z: mean 1, variance 4 * 3.5 / (3.5 + eps), what bn2 sees in evaluation with bn1's statistics set.
    net = nn.Sequential(BatchNorm(1), nn.Conv2d(1, 1, 1), BatchNorm(1)).double()
    with torch.no_grad():
        net[1].weight.fill_(2.0), net[1].bias.fill_(1.0)
    x = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.float64).view(4, 1, 1, 1)
    calibrate(net, x)
    assert net[0].statistics[0].item() == pytest.approx(3.0) and net[0].statistics[1].item() == pytest.approx(3.5)
    assert net[2].statistics[0].item() == pytest.approx(1.0, abs=1e-12)
    assert net[2].statistics[1].item() == pytest.approx(4 * 3.5 / (3.5 + 1e-5), rel=1e-12)
    calibrate(net, x, torch.tensor([0, 1]))  # 1 and 2: mean 1.5, variance 0.25
    assert net[0].statistics[0].item() == pytest.approx(1.5) and net[0].statistics[1].item() == pytest.approx(0.25)


def test_calibrated_evaluation_on_a_set_equals_training_mode_normalisation_of_that_set_as_one_batch():
    torch.manual_seed(0)
    net = FedAvgCNN((1, 28, 28), 10, norm="batch").double()
    x, y = torch.randn(70, 1, 28, 28, dtype=torch.float64), torch.randint(0, 10, (70,))
    loss, _ = per_sample_loss(net, flat_parameters(net), x, y, (x, None))  # in chunks of 64, two of them
    net.train()
    torch.testing.assert_close(loss, nn.functional.cross_entropy(net(x), y, reduction="none"), rtol=1e-10, atol=1e-12)
    assert batch_norm_names(net) == ("bn1.weight", "bn1.bias", "bn2.weight", "bn2.bias")
    assert sum(p.numel() for p in net.parameters()) == 582_026 + 2 * (32 + 64)


def test_a_batch_norm_model_is_never_judged_by_statistics_it_was_not_calibrated_for():
    net, x = model(), X[:10].double()
    net.eval()
    with pytest.raises(RuntimeError, match="without statistics"):
        net(x)
    calibrate(net, x)
    net(x)
    load_flat(net, flat_parameters(net))  # new parameters: the statistics were the old ones'
    with pytest.raises(RuntimeError, match="without statistics"):
        net(x)


def test_every_evaluation_takes_its_statistics_from_the_data_its_side_holds():
    # FedAvg with batch norm: the server's test accuracy by the pooled clients' training samples (their held-out
    # ones left out), each client's judged accuracy and train loss by its own training samples.
    result, rows, series = train(norm="batch")
    net, w = model(), result.params
    pooled = np.concatenate(CLIENTS)
    load_flat(net, w)
    net.eval()
    calibrate(net, DATA.x_train, torch.as_tensor(pooled))
    with torch.no_grad():
        test = float((net(DATA.x_test).argmax(1) == DATA.y_test).double().mean())
    assert rows[-1]["test_accuracy"] == pytest.approx(test, abs=1e-6)  # the engine means in float32
    own = [judged_by_hand(net, w, CLIENTS[c], TESTS[c]) for c in range(3)]
    assert series[-1]["personal_accuracy"].tolist() == pytest.approx(own, abs=1e-12)
    # round 1's train loss, F(w_0): each client's mean loss under its own statistics, weighted by its samples; by
    # the pooled statistics, the shifted clients' losses would differ
    w0, own_losses, pooled_losses = flat_parameters(model()), [], []
    for part in CLIENTS:
        index = torch.as_tensor(part)
        own_losses.append(float(per_sample_loss(net, w0, X[index], Y[index], (X, index))[0].mean()))
        pooled_losses.append(
            float(per_sample_loss(net, w0, X[index], Y[index], (X, torch.as_tensor(pooled)))[0].mean())
        )
    assert rows[0]["train_loss"] == pytest.approx(np.mean(own_losses), rel=1e-12)
    assert abs(np.mean(pooled_losses) - np.mean(own_losses)) > 0.01


def test_fedbn_keeps_every_batch_norm_layer_on_its_client():
    fedbn = FedBN()
    result, rows, series = train(fedbn)
    net = model()
    norm = fedbn.mask
    assert fedbn.names == list(batch_norm_names(net)) == ["1.weight", "1.bias", "5.weight", "5.bias"]
    assert int(norm.sum()) == 2 * (32 + 64)
    w0 = flat_parameters(net)
    assert torch.equal(result.params[norm], w0[norm])  # the server never saw a batch-norm update
    assert not torch.equal(result.params[~norm], w0[~norm])
    kept = [fedbn.store.get(c) for c in range(3)]
    assert all(not torch.equal(kept[0], other) for other in kept[1:])  # one set of layers a client
    by_hand = []
    for c in range(3):  # each client's model: the global one with its own batch-norm layers, its own statistics
        mine = result.params.clone()
        mine[norm] = kept[c]
        by_hand.append(judged_by_hand(net, mine, CLIENTS[c], TESTS[c]))
    assert series[-1]["personal_accuracy"].tolist() == pytest.approx(by_hand, abs=1e-12)


def test_fedbn_refuses_a_model_without_batch_norm_in_one_line():
    net = model(norm="none")
    context = Context(None, np.array([20, 20, 20]), layout=layout(net), batch_norm=batch_norm_names(net))
    with pytest.raises(ConfigError, match="model.norm=batch") as info:
        FedBN().bind(context)
    assert info.value.key == "personalization"


def test_fedbn_state_is_checkpointed_and_restored_exactly(tmp_path):
    whole, whole_rows, whole_series = train(FedBN(), rounds=4)
    train(FedBN(), rounds=2, checkpoint=Checkpoint(tmp_path, every=1))
    resumed, rows, series = train(FedBN(), rounds=4, checkpoint=Checkpoint(tmp_path, resume=True))
    assert torch.equal(resumed.params, whole.params)
    strip = lambda rs: [{k: v for k, v in r.items() if not k.endswith("wall_s")} for r in rs]  # noqa: E731
    assert strip(rows) == strip(whole_rows[2:])
    assert [s["personal_accuracy"].tolist() for s in series] == [
        s["personal_accuracy"].tolist() for s in whole_series[2:]
    ]


def test_worker_processes_run_fedbn_as_the_loop_does():
    from fedrun.backends import Device

    loop, loop_rows, loop_series = train(FedBN())
    forked, forked_rows, forked_series = train(FedBN(), device=Device("cpu", "contiguous", "processes", workers=2))
    torch.testing.assert_close(forked.params, loop.params, rtol=1e-10, atol=1e-12)
    for a, b in zip(forked_rows, loop_rows):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-10)
        assert a["personal/accuracy_mean"] == b["personal/accuracy_mean"]
    assert not math.isnan(loop_rows[-1]["train_loss"])


def test_vmap_refuses_batch_norm_in_one_line():
    from fedrun.vmap import VmapTrainer

    with pytest.raises(ConfigError, match="batch norm") as info:
        VmapTrainer(model(), X, Y, functools.partial(torch.optim.SGD, lr=0.1))
    assert info.value.key == "device.backend"


def test_fedbn_runs_with_every_synchronous_aggregator_or_is_refused_in_one_line(compose_config):
    from unit.test_personal import runs_with_every_synchronous_aggregator

    runs_with_every_synchronous_aggregator(compose_config, lambda aggregator: train(FedBN(), 2, aggregator=aggregator))


def test_a_saved_model_carries_its_statistics_and_evaluates_as_judged_in_fedrun_and_in_plain_torch():
    net = model()
    calibrate(net, X, torch.arange(60))
    saved = net.state_dict()
    norms = [name for name, module in net.named_modules() if isinstance(module, BatchNorm)]
    for name, module in zip(norms, (m for m in net.modules() if isinstance(m, BatchNorm))):
        assert torch.equal(saved[f"{name}.running_mean"], module.statistics[0])
        assert torch.equal(saved[f"{name}.running_var"], module.statistics[1])
    net.eval()
    with torch.no_grad():
        expected = net(X)
    fresh = model()
    load_flat(fresh, flat_parameters(fresh) + 1.0)  # other parameters, and no statistics, before loading
    fresh.load_state_dict(saved)
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(fresh(X), expected)
    # One layer in plain torch: nn.BatchNorm2d in evaluation normalises by the saved statistics as ours does.
    name, ours = norms[0], dict(net.named_modules())[norms[0]]
    plain = nn.BatchNorm2d(ours.num_features).double().eval()
    plain.load_state_dict(
        {k.removeprefix(f"{name}."): v for k, v in saved.items() if k.startswith(f"{name}.")}, strict=False
    )
    h = torch.randn(5, ours.num_features, 4, 4, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(plain(h), ours(h), rtol=0, atol=1e-12)
    # A model never calibrated saves none and loads with none.
    never = model().state_dict()
    assert not any(k.endswith("running_mean") for k in never)
    fresh.load_state_dict(never)
    with pytest.raises(RuntimeError, match="without statistics"):
        fresh.eval()(X)
