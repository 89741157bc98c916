import math

from fedrun.metrics import r_index, r_name


def test_r_index_is_first_round_reaching_target_skipping_unevaluated():
    rounds, acc = [1, 2, 3, 4, 5], [0.5, math.nan, 0.61, 0.95, 0.89]
    assert r_index(rounds, acc, 0.6) == 3
    assert r_index(rounds, acc, 0.9) == 4
    assert r_index(rounds, acc, 0.99) is None
    assert r_index(rounds, acc, 0.5) == 1


def test_r_names():
    assert [r_name(t) for t in (0.6, 0.9, 0.925, 0.95)] == ["R60", "R90", "R92.5", "R95"]
