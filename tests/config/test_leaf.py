"""LEAF through the composed config (experiment=femnist): each user's test samples are its held-out data (the
readers and models on tiny files: tests/unit/test_leaf.py, whose file writers this uses)."""

import functools

import numpy as np
import pytest
import torch
from unit.test_leaf import femnist_files

from fedrun.backends import Device
from fedrun.errors import ConfigError
from fedrun.parts import Parts


def test_each_users_leaf_test_samples_are_its_held_out_data(tmp_path, compose_config):
    from fedrun.aggregators import FedAvg
    from fedrun.cli.build import setup
    from fedrun.clients import evaluate
    from fedrun.engine import run
    from fedrun.models import Logistic, flat_parameters
    from fedrun.rounds import Schedule

    femnist_files(tmp_path)
    parts = setup(
        compose_config(
            "experiment=femnist",
            f"dataset.root={tmp_path}",
            "dataset.client_tests=true",
            "model=logistic",
            "schedule.cohort=2",
        )
    )
    data, tests = parts["data"], parts["client_tests"]
    assert data.client_tests_in == "test" and [len(t) for t in tests] == [2, 1, 2]
    # With a zero learning rate each local model is the global one: client_accuracy is then the mean over the
    # cohort of the global model's accuracy on each client's own test samples, which must be read from the test split.
    torch.manual_seed(0)
    model = Logistic((1, 28, 28), 62)
    w = flat_parameters(model)
    rows = []
    run(
        model,
        data,
        parts["clients"],
        Parts(FedAvg()),
        functools.partial(torch.optim.SGD, lr=0.0),
        Schedule(rounds=1, local_epochs=1, batch_size=5),
        Device("cpu", backend="loop"),
        seed=0,
        client_tests=tests,
        on_round=lambda row, per_client: rows.append(row),
    )
    expected = np.mean([evaluate(model, w, data.x_test[t], data.y_test[t])[0] for t in tests])
    assert rows[0]["client_accuracy"] == pytest.approx(expected)
    with pytest.raises(ConfigError, match="dataset.client_test_fraction=0.2.*0 with client_tests=true"):
        setup(compose_config("experiment=femnist", "dataset.client_tests=true", "dataset.client_test_fraction=0.2"))
