"""Every partition is disjoint, covers its pool exactly once and has the label structure it promises."""

import numpy as np
import pytest

from fedrun.errors import ConfigError
from fedrun.partitions import IID, Dirichlet, LabelSplit, Natural, Shards

LABELS = np.repeat(np.arange(10), 100)  # 1000 samples, 100 per label
np.random.default_rng(0).shuffle(LABELS)


def rng(seed=0):
    return np.random.default_rng(seed)


def check_disjoint_cover(parts, pool_size):
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == len(joined), "clients share samples"
    assert len(joined) == pool_size, "pool not covered exactly once"
    return joined


def test_iid_equal_sizes_cover_everything():
    parts = IID(num_clients=7)(LABELS, rng())
    joined = check_disjoint_cover(parts, 1000)
    assert set(joined) == set(range(1000))
    assert sorted(len(p) for p in parts) == [142] * 1 + [143] * 6


def test_iid_unbalanced_sizes_vary_and_cover():
    parts = IID(num_clients=10, unbalanced=1.0)(LABELS, rng())
    check_disjoint_cover(parts, 1000)
    sizes = [len(p) for p in parts]
    assert min(sizes) >= 1 and max(sizes) > 2 * min(sizes)


def test_samples_per_client_draws_the_pool_first():
    parts = IID(num_clients=5, samples_per_client=20)(LABELS, rng())
    check_disjoint_cover(parts, 100)
    assert [len(p) for p in parts] == [20] * 5


def test_shards_give_each_client_its_shards_of_one_label_each():
    # 10 clients x 2 shards of 50: every shard lies inside one label (100 samples per label)
    parts = Shards(num_clients=10, shard_size=50, shards_per_client=2)(LABELS, rng())
    check_disjoint_cover(parts, 1000)
    for p in parts:
        assert len(p) == 100 and len(np.unique(LABELS[p])) <= 2


def test_shards_derived_size_drops_only_the_remainder():
    parts = Shards(num_clients=7, shards_per_client=2)(LABELS, rng())
    check_disjoint_cover(parts, 14 * (1000 // 14))
    assert len({len(p) for p in parts}) == 1


def test_larger_shards_give_fewer_labels():
    def mean_labels(shard_size, per_client):
        parts = Shards(num_clients=10, samples_per_client=100, shard_size=shard_size, shards_per_client=per_client)(LABELS, rng())
        return np.mean([len(np.unique(LABELS[p])) for p in parts])

    assert mean_labels(100, 1) <= 2 < mean_labels(25, 4)


def test_shards_that_do_not_fit_are_rejected():
    with pytest.raises(ConfigError, match="shard_size"):
        Shards(num_clients=10, shard_size=60, shards_per_client=2)(LABELS, rng())
    with pytest.raises(ConfigError, match="shard_size"):
        Shards(num_clients=50, samples_per_client=200, shard_size=60, shards_per_client=4)


def test_dirichlet_respects_min_size_and_small_alpha_concentrates_labels():
    parts = Dirichlet(num_clients=10, alpha=0.1, min_size=5)(LABELS, rng())
    check_disjoint_cover(parts, 1000)
    assert min(len(p) for p in parts) >= 5
    concentrated = np.mean([np.bincount(LABELS[p], minlength=10).max() / len(p) for p in parts])
    spread = Dirichlet(num_clients=10, alpha=100.0)(LABELS, rng())
    uniformish = np.mean([np.bincount(LABELS[p], minlength=10).max() / len(p) for p in spread])
    assert concentrated > 0.5 > uniformish


def test_label_split_groups_own_their_labels():
    split = LabelSplit(groups=[{"clients": 10, "labels": [4, 5, 6, 7, 8, 9]}, {"clients": 5, "labels": [0, 1, 2, 3]}])
    parts = split(LABELS, rng())
    assert len(parts) == 15
    check_disjoint_cover(parts, 1000)
    for c, p in enumerate(parts):
        assert set(LABELS[p]) <= (set(range(4, 10)) if c < 10 else set(range(4)))
    assert all(abs(len(p) - 60) <= 6 for p in parts[:10]) and all(abs(len(p) - 80) <= 4 for p in parts[10:])


def test_label_split_rejects_wrong_total():
    with pytest.raises(ConfigError, match="num_clients"):
        LabelSplit(groups=[{"clients": 2, "labels": [0]}], num_clients=3)


def test_natural_uses_the_datasets_split_and_others_refuse_it():
    natural = [np.arange(0, 5), np.arange(5, 12)]
    parts = Natural()(np.zeros(12, int), rng(), natural=natural)
    assert [list(p) for p in parts] == [list(range(5)), list(range(5, 12))]
    capped = Natural(samples_per_client=3)(np.zeros(12, int), rng(), natural=natural)
    assert [len(p) for p in capped] == [3, 3] and set(capped[1]) <= set(range(5, 12))
    with pytest.raises(ConfigError, match="natural"):
        IID(num_clients=2)(np.zeros(12, int), rng(), natural=natural)
    with pytest.raises(ConfigError, match="natural"):
        Natural()(np.zeros(12, int), rng(), natural=None)


def test_partitions_are_pure_functions_of_labels_config_and_seed():
    for make in (lambda: IID(num_clients=4), lambda: Shards(num_clients=4), lambda: Dirichlet(num_clients=4, alpha=0.5)):
        a, b, c = make()(LABELS, rng(1)), make()(LABELS, rng(1)), make()(LABELS, rng(2))
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
        assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_more_clients_than_samples_is_rejected():
    with pytest.raises(ConfigError, match="num_clients"):
        IID(num_clients=2000)(LABELS, rng())
