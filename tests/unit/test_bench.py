"""scripts/bench.py's estimate of a round's seconds, by hand: the same estimator as the floor's (its fastest round),
the evaluations counted at their share."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
import bench  # noqa: E402


def test_a_round_is_the_fastest_plain_round_plus_the_evaluated_rounds_extra_over_eval_every():
    # 9 rounds, an evaluation every 3: rounds 1-3 warm up; rounds 6 and 9 are evaluated; 4, 5, 7, 8 are plain.
    seconds = [9.0, 9.0, 9.0, 1.2, 1.0, 2.5, 1.1, 1.4, 2.9]
    # fastest plain round 1.0 (round 5); evaluated rounds' mean (2.5 + 2.9) / 2 = 2.7: 1.0 + 1.7 / 3
    assert bench.per_round({"eval_every": 3}, seconds) == pytest.approx(1.0 + 1.7 / 3, rel=1e-12)
    # every round evaluated: the fastest measured round (round 1 is the warm-up)
    assert bench.per_round({"eval_every": 1}, [0.5, 2.0, 1.5, 1.7]) == 1.5


def test_the_parts_of_a_round_come_from_the_rounds_its_total_takes_and_add_up_to_it():
    train = [5.0, 5.0, 5.0, 0.9, 0.8, 1.0, 0.7, 0.95, 0.85]
    evaluation = [1.0, 1.0, 1.0, 0.0, 0.0, 1.5, 0.0, 0.0, 1.8]
    other = [0.1, 0.1, 0.1, 0.05, 0.3, 0.1, 0.35, 0.05, 0.1]  # round 4's total (0.95) is the least, not its train
    totals = [a + b + c for a, b, c in zip(train, evaluation, other)]
    spec = {"eval_every": 3}
    parts = [bench.per_round(spec, part, totals) for part in (train, evaluation, other)]
    assert parts[0] == pytest.approx(0.9 + ((1.0 + 0.85) / 2 - 0.9) / 3, rel=1e-12)  # round 4's train, not round 7's
    assert sum(parts) == pytest.approx(bench.per_round(spec, totals), rel=1e-12)
