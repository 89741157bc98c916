"""aggregator=fltrust composed: the server's root set drawn from the seed and held out of every client, and a root
set that cannot be drawn refused in one line (the rules' numbers: tests/unit/aggregators/test_robust.py)."""

import numpy as np
import pytest

from fedrun.errors import ConfigError


def test_the_root_set_is_drawn_from_the_seed_and_held_out_of_every_client(compose_config):
    from fedrun.cli.build import setup

    built = setup(compose_config("aggregator=fltrust", "partition=dirichlet"))
    root, clients, n = built["data"].root, built["clients"], len(built["data"].y_train)
    assert len(root) == 100 and len(np.unique(root)) == 100 and np.all(np.diff(root) > 0)
    held = np.concatenate(clients)
    assert not np.isin(held, root).any()  # no client holds a root sample
    assert len(held) + 100 == n  # and every other sample is someone's (dirichlet partitions all it is given)
    again = setup(compose_config("aggregator=fltrust", "partition=dirichlet"))["data"].root
    other = setup(compose_config("aggregator=fltrust", "partition=dirichlet", "seed=1"))["data"].root
    assert np.array_equal(root, again) and not np.array_equal(root, other)
    assert setup(compose_config("aggregator=fedavg"))["data"].root is None
    # A natural split: each user keeps its own samples, less those the server drew.
    natural = setup(
        compose_config(
            "dataset=synthetic", "partition=natural", "model=mlp", "aggregator=fltrust", "aggregator.root_size=20"
        )
    )
    held = np.concatenate(natural["clients"])
    assert len(natural["data"].root) == 20 and not np.isin(held, natural["data"].root).any()
    assert len(held) + 20 == len(natural["data"].y_train)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["aggregator.root_size=100000"], "^aggregator.root_size=100000 is invalid: allowed is fewer than the"),
        (
            ["partition=population", "schedule.cohort=10"],
            "^aggregator=.fltrust. is invalid: allowed is a partition other than population",
        ),
    ],
)
def test_a_root_set_that_cannot_be_drawn_is_one_line(compose_config, overrides, message):
    from fedrun.cli.build import setup

    with pytest.raises(ConfigError, match=message):
        setup(compose_config("aggregator=fltrust", *overrides))
