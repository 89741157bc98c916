"""Populations of a million clients (fedrun.partitions.Population): clients made when they train, the same each
time, nothing kept per client; the engines and the asynchronous engine's draw over idle clients without listing
them; one run through the real ``fedrun`` command."""

import functools
import tracemalloc

import numpy as np
import pandas as pd
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


@pytest.mark.parametrize(
    "overrides,message",
    [
        # round(C N) of a million with the default C = 1: a minute of drawing, then a 42.8 GB gather (issue 34)
        ([], r"schedule.cohort=None .*from 1 to 1,000,000 with partition=population.*trains 1,000,000 clients"),
        (["schedule.cohort=2000000"], r"schedule.cohort=2000000 .*from 1 to 1,000,000 with partition=population"),
        (["schedule.sampling=poisson"], r"schedule.clients_per_round=1.0 .*a rate below 1 with partition=population"),
        (["aggregator=fedbuff"], r"engine.concurrency=None .*from 1 to 1,000,000 with partition=population"),
        # 7.3 TiB of selection counts: numpy's MemoryError after the dataset was read
        (
            ["partition.num_clients=1000000000000", "schedule.cohort=10"],
            r"partition.num_clients=1000000000000 .*an integer from 1 to [\d,]+: .*64 bytes a client.*59,605 GiB",
        ),
        (["partition.labels_per_client=true", "schedule.cohort=10"], "partition.labels_per_client=True .*an integer"),
        (["partition.num_clients=true", "schedule.cohort=1"], "partition.num_clients=True .*an integer >= 1"),
    ],
    ids=["no-cohort", "cohort-over-n", "poisson-1", "async-unbounded", "num-clients-1e12", "labels-true", "n-true"],
)
def test_a_population_refuses_what_it_cannot_hold_before_the_dataset_is_read(
    compose_config, monkeypatch, overrides, message
):
    from fedrun.cli import setup
    from fedrun.datasets import Dataset

    def read(*args, **kwargs):
        raise AssertionError("the dataset was read before the refusal")

    monkeypatch.setattr(Dataset, "load", read)
    with pytest.raises(ConfigError, match=message) as info:
        setup(compose_config("partition=population", "dataset=digits", *overrides))
    assert "\n" not in str(info.value)


def test_the_population_bound_follows_the_memory_a_client_costs(monkeypatch):
    from fedrun import partitions

    monkeypatch.setattr(partitions.os, "sysconf", lambda name: {"SC_PHYS_PAGES": 2**20, "SC_PAGE_SIZE": 4096}[name])
    assert partitions.most_clients() == (2**32 // 64, 2**32)  # 4 GiB: 67,108,864 clients of 64 bytes
    Population(num_clients=2**26)
    with pytest.raises(ConfigError, match="num_clients=67108865 .*from 1 to 67,108,864.*machine has 4 GiB"):
        Population(num_clients=2**26 + 1)


@pytest.mark.slow
def test_a_million_client_run_through_fedrun(fedrun):
    fedrun(
        "partition=population",
        "schedule.cohort=10",
        "schedule.rounds=2",
        "model=logistic",
        "device.threads=1",
        "hydra.run.dir=run",
    )
    run_dir = fedrun.cwd / "run"
    assert not (run_dir / "partition.csv").exists()  # listing a million clients would draw them all
    alpha = pd.read_csv(run_dir / "alpha.csv")  # long: a row per client of each round
    assert list(alpha.columns) == ["round", "client", "alpha"] and len(alpha) == 20
    assert pd.read_csv(run_dir / "selected.csv").groupby("round")["selected"].sum().tolist() == [10, 10]
