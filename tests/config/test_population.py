"""partition=population composed: what a population cannot hold is refused before the dataset is read (the
population itself: tests/unit/test_population.py)."""

import pytest

from fedrun.errors import ConfigError


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
    from fedrun.cli.build import setup
    from fedrun.datasets import Dataset

    def read(*args, **kwargs):
        raise AssertionError("the dataset was read before the refusal")

    monkeypatch.setattr(Dataset, "load", read)
    with pytest.raises(ConfigError, match=message) as info:
        setup(compose_config("partition=population", "dataset=digits", *overrides))
    assert "\n" not in str(info.value)
