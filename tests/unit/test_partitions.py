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
        parts = Shards(num_clients=10, samples_per_client=100, shard_size=shard_size, shards_per_client=per_client)(
            LABELS, rng()
        )
        return np.mean([len(np.unique(LABELS[p])) for p in parts])

    assert mean_labels(100, 1) <= 2 < mean_labels(25, 4)


def test_shards_that_do_not_fit_are_rejected():
    with pytest.raises(ConfigError, match="shard_size"):
        Shards(num_clients=10, shard_size=60, shards_per_client=2)(LABELS, rng())
    with pytest.raises(ConfigError, match="shard_size"):
        Shards(num_clients=50, samples_per_client=200, shard_size=60, shards_per_client=4)


SMALL = np.array([0, 1, 2] * 4)  # 12 samples, 4 per label: label l is at indices l, l + 3, l + 6, l + 9


@pytest.mark.parametrize("seed", range(5))
def test_dataset_shards_by_hand(seed):
    # shard_source=dataset, shards of 4 over 12 samples sorted by label: exactly the 3 shards {label 0},
    # {label 1}, {label 2}. Two clients x one shard draw 2 of the 3 without replacement, so each client holds
    # all 4 samples of one label, the two labels differ, and the third label is not in the federation.
    parts = Shards(num_clients=2, shard_size=4, shards_per_client=1, shard_source="dataset")(SMALL, rng(seed))
    labels = [set(SMALL[p]) for p in parts]
    assert all(len(label) == 1 for label in labels) and labels[0] != labels[1]
    for p, (label,) in zip(parts, labels):
        assert list(p) == [label, label + 3, label + 6, label + 9]


@pytest.mark.parametrize("seed", range(5))
def test_pool_shards_by_hand(seed):
    # shard_source=pool with 3 clients x 4 samples: the pool is all 12 samples, cut into 3 shards of 4 = one
    # label each, and all of them are dealt: every label is in the federation once.
    parts = Shards(num_clients=3, samples_per_client=4, shards_per_client=1, shard_source="pool")(SMALL, rng(seed))
    assert sorted(int(SMALL[p][0]) for p in parts) == [0, 1, 2]
    assert all(len(set(SMALL[p])) == 1 and len(p) == 4 for p in parts)


def test_dataset_shards_give_an_uneven_federation_label_marginal_and_pool_an_even_one():
    # 5 clients x 2 shards of 10 (100 of 1000 samples). dataset: 10 of 100 single-label shards, so the
    # federation's label counts are multiples of 10 and labels go missing; pool: a random 100-sample pool,
    # so every label is present in about its share.
    missing = {"dataset": [], "pool": []}
    for source in missing:
        for seed in range(10):
            parts = Shards(num_clients=5, samples_per_client=20, shards_per_client=2, shard_source=source)(
                LABELS, rng(seed)
            )
            check_disjoint_cover(parts, 100)
            counts = np.bincount(LABELS[np.concatenate(parts)], minlength=10)
            missing[source].append(int((counts == 0).sum()))
            if source == "dataset":  # whole single-label shards: at most two labels per client
                assert set(counts % 10) == {0}
                assert all(len(np.unique(LABELS[p])) <= 2 for p in parts)
    assert sum(missing["pool"]) == 0
    assert np.mean(missing["dataset"]) >= 1  # 10 C(90,10) / C(100,10) = 3.3 labels missing on average


def test_shard_source_is_checked():
    with pytest.raises(ConfigError, match="shard_source"):
        Shards(shard_source="mcmahan")
    with pytest.raises(ConfigError, match="shards_per_client"):
        Shards(num_clients=5, samples_per_client=25, shards_per_client=2)  # 25 / 2 is not a shard size


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


def test_label_split_independent_draws_draw_each_client_s_quota_of_each_label_as_the_authors_code():
    labels = np.repeat(np.arange(4), 50)  # 50 samples of each of 4 labels
    split = LabelSplit(
        [{"clients": 3, "labels": [0, 1]}, {"clients": 2, "labels": [1, 2, 3]}],
        samples_per_client=20,
        draw="independent",
    )
    parts = split(labels, np.random.default_rng(0))
    assert len(parts) == 5
    for part in parts[:3]:  # int(20 / 2) = 10 of labels 0 and 1
        assert np.bincount(labels[part], minlength=4).tolist() == [10, 10, 0, 0]
    for part in parts[3:]:  # int(20 / 3) = 6 of labels 1, 2 and 3: 18, not 20 (their int(1/3 * size))
        assert np.bincount(labels[part], minlength=4).tolist() == [0, 6, 6, 6]
    assert all(len(np.unique(p)) == len(p) for p in parts)  # without replacement within a client
    # Independently of the others: with 5 draws of 10-16 out of 50 label-1 samples, some are shared.
    assert len(np.unique(np.concatenate(parts))) < sum(len(p) for p in parts)
    assert all(np.array_equal(a, b) for a, b in zip(parts, split(labels, np.random.default_rng(0))))
    with pytest.raises(
        ConfigError, match="samples_per_client=None is invalid: allowed is an integer with draw=independent"
    ):
        LabelSplit([{"clients": 1, "labels": [0]}], draw="independent")
    with pytest.raises(
        ConfigError, match=r"samples_per_client=120 is invalid: allowed is at most 100 \(50 samples of label 0\)"
    ):
        LabelSplit([{"clients": 1, "labels": [0, 1]}], samples_per_client=120, draw="independent")(
            labels, np.random.default_rng(0)
        )
    with pytest.raises(ConfigError, match="draw='random'"):
        LabelSplit([{"clients": 1, "labels": [0]}], draw="random")


def test_random_deal_gives_every_shard_out_each_client_one_first_as_the_authors_code():
    # 12 samples, labels 0 x 6 then 1 x 6, shards of 2: six shards, sorted by label, the last three of label 1.
    labels = np.repeat([0, 1], 6)
    split = Shards(num_clients=3, samples_per_client=4, shards_per_client=2, deal="random")
    sizes = set()
    for seed in range(20):
        parts = split(labels, np.random.default_rng(seed))
        assert sorted(np.concatenate(parts).tolist()) == list(range(12))  # every shard dealt, none twice
        assert all(len(p) % 2 == 0 and len(p) >= 2 for p in parts)
        # The first three shards popped (from the end: label 1) go one to each client (datasplitting.py:18-20).
        assert all((labels[p] == 1).sum() >= 2 for p in parts)
        sizes.add(tuple(len(p) for p in parts))
    assert any(s != (4, 4, 4) for s in sizes)  # sizes vary with the seed
    with pytest.raises(ConfigError, match="deal='even' is invalid"):
        Shards(num_clients=3, deal="even")


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
    for make in (
        lambda: IID(num_clients=4),
        lambda: Shards(num_clients=4),
        lambda: Dirichlet(num_clients=4, alpha=0.5),
    ):
        a, b, c = make()(LABELS, rng(1)), make()(LABELS, rng(1)), make()(LABELS, rng(2))
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
        assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_more_clients_than_samples_is_rejected():
    with pytest.raises(ConfigError, match="num_clients"):
        IID(num_clients=2000)(LABELS, rng())


def test_the_pathological_split_deals_classes_as_pfllibs_generator_does():
    from fedrun.partitions import Pathological

    # 4 classes of 10 samples, 4 clients of 2 classes: ceil(4 / 4 * 2) = 2 clients a class, the first still lacking
    labels = np.repeat(np.arange(4), 10)
    parts = Pathological(num_clients=4, classes_per_client=2, balance=True)(labels, np.random.default_rng(0))
    assert [sorted(set(labels[p].tolist())) for p in parts] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [len(p) for p in parts] == [10, 10, 10, 10]  # balance: 5 of each class each
    # PFLlib's 20 clients on 10 classes: groups of 4 on one label pair, each class cut unequally (the last chunk the
    # rest), every sample dealt once
    labels = np.repeat(np.arange(10), 600)
    parts = Pathological(num_clients=20)(labels, np.random.default_rng(1))
    assert [sorted(set(labels[p].tolist())) for p in parts] == [[2 * (i // 4), 2 * (i // 4) + 1] for i in range(20)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(6000))
    for group in range(5):
        for label in (2 * group, 2 * group + 1):
            chunks = [int((labels[parts[4 * group + j]] == label).sum()) for j in range(4)]
            assert all(15 <= size < 150 for size in chunks[:3])  # [max(150 / 10, 1 / 10), 150): 150 = 600 / 4
            assert chunks[3] == 600 - sum(chunks[:3])
    with pytest.raises(ConfigError) as refused:  # 2 samples a class for 4 clients: [0.1, 0.5) -> [0, 0) is empty
        Pathological(num_clients=20)(np.repeat(np.arange(10), 2), np.random.default_rng(0))
    assert refused.value.key == "num_clients"
