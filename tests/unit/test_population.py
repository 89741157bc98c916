"""Populations of a million clients (fedrun.partitions.Population): clients made when they train, the same each
time, nothing kept per client; the engines and the asynchronous engine's draw over idle clients without listing
them (one run through the real ``fedrun`` command: tests/e2e/test_population.py)."""

import functools
import tracemalloc

import numpy as np
import pytest
import torch
from conftest import TINY_DATA as DATA

from fedrun.aggregators import FedAvg, FedBuff
from fedrun.async_engine import AsyncEngine
from fedrun.backends import Device
from fedrun.engine import run
from fedrun.errors import ConfigError
from fedrun.models import Logistic
from fedrun.partitions import LazyClients, Population, client_sizes
from fedrun.parts import Parts
from fedrun.rounds import Schedule


def population(num_clients=1_000_000, samples=4, labels_per_client=None, seed=0):
    labels = DATA.y_train.numpy()
    return Population(num_clients, samples, labels_per_client)(labels, np.random.default_rng(seed))


def test_a_client_is_the_same_each_time_and_its_labels_are_its_own():
    clients = population(labels_per_client=1)
    assert isinstance(clients, LazyClients) and len(clients) == 1_000_000
    assert np.array_equal(clients[123_456], clients[123_456]) and not np.array_equal(clients[0], clients[1])
    labels = DATA.y_train.numpy()
    for c in (0, 999_999, 5):
        part = clients[c]
        assert len(part) == 4 and len(np.unique(labels[part])) == 1 and (np.diff(part) >= 0).all()
    assert client_sizes(clients).tolist()[:3] == [4, 4, 4] and client_sizes(clients).shape == (1_000_000,)
    with pytest.raises(IndexError):
        clients[1_000_000]


def test_a_million_clients_cost_nothing_until_they_train():
    tracemalloc.start()
    clients = population()
    size, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert (
        len(clients) == 1_000_000 and peak < 1_000_000
    )  # under a byte a client: the label index arrays of the 60 samples, and no per-client part
    with pytest.raises(ConfigError, match="labels_per_client=4.*at most the 3 labels"):
        population(labels_per_client=4)


def tiny_run(clients, **kwargs):
    torch.manual_seed(0)
    rows = []
    result = run(
        Logistic((4,), 3).double(),
        DATA,
        clients,
        Parts(FedAvg()),
        functools.partial(torch.optim.SGD, lr=0.3),
        Schedule(rounds=3, local_epochs=1, batch_size=2, cohort=5),
        Device("cpu", backend="loop"),
        seed=2,
        on_round=lambda row, per_client: rows.append(per_client),
        **kwargs,
    )
    return result, rows


def test_a_round_of_a_million_trains_its_cohort_only():
    clients = population()
    result, rows = tiny_run(clients)
    assert all(per_client["selected"].sum() == 5 and len(per_client["alpha"]) == 1_000_000 for per_client in rows)
    # The same run on the cohort's clients made into a plain list over the population gives the same model.
    listed = _Listed(clients)
    again, _ = tiny_run(listed)
    assert torch.equal(result.params, again.params) and listed.asked <= 15


class _Listed(LazyClients):
    """A population that counts which clients were asked for."""

    def __init__(self, inner):
        self.inner, self.sizes, self.asked = inner, inner.sizes, 0

    def __getitem__(self, c):
        self.asked += 1
        return self.inner[c]


def test_the_asynchronous_draw_over_idle_clients_equals_listing_them():
    engine = AsyncEngine(
        [{"name": "all", "clients": None, "distribution": "uniform", "low": 1.0, "high": 2.0}], concurrency=6
    )
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(8, 40))
        training = rng.choice(n, size=int(rng.integers(2, 7)), replace=False)
        arrived = [int(c) for c in training[: int(rng.integers(1, len(training)))]]
        pulled = {int(c): None for c in training}
        seed = int(rng.integers(1000))
        drawn = engine._next(arrived, dict(pulled), n, np.random.default_rng(seed))
        busy = np.zeros(n, dtype=bool)
        busy[[c for c in pulled if c not in arrived]] = True
        listed = np.random.default_rng(seed).choice(np.flatnonzero(~busy), size=len(arrived), replace=False)
        assert drawn == sorted(int(c) for c in listed)


def test_the_asynchronous_engine_takes_a_population_with_a_concurrency():
    clients = population()
    engine = AsyncEngine(
        [{"name": "all", "clients": None, "distribution": "uniform", "low": 1.0, "high": 2.0}], concurrency=4
    )
    torch.manual_seed(0)
    result = engine(
        Logistic((4,), 3).double(),
        DATA,
        clients,
        Parts(FedBuff(buffer_size=2)),
        functools.partial(torch.optim.SGD, lr=0.3),
        Schedule(rounds=3, local_epochs=1, batch_size=2),
        Device("cpu", backend="loop"),
        0,
    )
    fairness = result.tables["fairness.csv"]
    assert 1 <= len(fairness) <= 6 and (fairness["weight_share"] > 0).all()  # the clients applied, not a million
    unbounded = AsyncEngine([{"name": "all", "clients": None, "distribution": "uniform", "low": 1.0, "high": 2.0}])
    with pytest.raises(ConfigError, match="engine.concurrency=None.*partition=population"):
        unbounded(
            Logistic((4,), 3).double(),
            DATA,
            clients,
            FedBuff(buffer_size=2),
            functools.partial(torch.optim.SGD, lr=0.3),
            Schedule(rounds=1),
            Device("cpu", backend="loop"),
            0,
        )


def test_the_population_bound_follows_the_memory_a_client_costs(monkeypatch):
    from fedrun import partitions

    monkeypatch.setattr(partitions.os, "sysconf", lambda name: {"SC_PHYS_PAGES": 2**20, "SC_PAGE_SIZE": 4096}[name])
    assert partitions.most_clients() == (2**32 // 64, 2**32)  # 4 GiB: 67,108,864 clients of 64 bytes
    Population(num_clients=2**26)
    with pytest.raises(ConfigError, match="num_clients=67108865 .*from 1 to 67,108,864.*machine has 4 GiB"):
        Population(num_clients=2**26 + 1)
