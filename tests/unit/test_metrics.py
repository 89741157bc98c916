import math

import pytest

from fedrun.errors import ConfigError
from fedrun.metrics import r_index, r_name


def test_r_index_is_first_round_reaching_target_skipping_unevaluated():
    rounds, acc = [1, 2, 3, 4, 5], [0.5, math.nan, 0.61, 0.95, 0.89]
    assert r_index(rounds, acc, 0.6) == 3
    assert r_index(rounds, acc, 0.9) == 4
    assert r_index(rounds, acc, 0.99) is None
    assert r_index(rounds, acc, 0.5) == 1


def test_r_names():
    assert [r_name(t) for t in (0.6, 0.9, 0.925, 0.95)] == ["R60", "R90", "R92.5", "R95"]


def test_smoothness_and_lag1_autocorr_on_hand_made_curves():
    from fedrun.metrics import lag1_autocorr, smoothness

    # steady climb: every change equal
    assert smoothness([0.1, 0.2, 0.3, 0.4]) == pytest.approx(0.0)
    # zig-zag: d = [.1, -.1, .1, -.1]; std .1 / mean|d| .1 = 1; autocorrelation 3 * (-.01) / .04
    zigzag = [0.5, 0.6, 0.5, 0.6, 0.5]
    assert smoothness(zigzag) == pytest.approx(1.0)
    assert lag1_autocorr(zigzag) == pytest.approx(-0.75)
    # d = [.1, .2, .05, .2]: mean .1375, population std sqrt(.016875 / 4), autocorr -.01328125 / .016875
    curve = [0.0, 0.1, 0.3, 0.35, 0.55]
    assert smoothness(curve) == pytest.approx(math.sqrt(0.016875 / 4) / 0.1375)
    assert lag1_autocorr(curve) == pytest.approx(-0.01328125 / 0.016875)
    # unevaluated rounds are skipped; too short a curve is NaN
    assert smoothness([0.5, math.nan, 0.6, math.nan, 0.5, 0.6, 0.5]) == pytest.approx(1.0)
    assert math.isnan(smoothness([0.5, 0.6])) and math.isnan(lag1_autocorr([0.5, 0.6, 0.7]))


def test_mean_ci_matches_student_t():
    from fedrun.metrics import mean_ci

    # n = 3, mean 2, sample std 1: t(0.975, 2) = 4.302653 -> half-width 4.302653 / sqrt(3)
    mean, half = mean_ci([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.302653 / math.sqrt(3), rel=1e-6)
    assert mean_ci([5.0])[0] == 5.0 and math.isnan(mean_ci([5.0])[1])


def test_schedule_evaluation_and_stop_decisions():
    from fedrun.engine import Schedule

    schedule = Schedule(rounds=10, eval_every=4, stop_at_accuracy=0.9)
    assert [t for t in range(1, 11) if schedule.evaluates(t)] == [4, 8, 10]
    test = lambda a: {"test_accuracy": a}  # noqa: E731
    assert schedule.reached(test(0.9)) and not schedule.reached(test(0.89)) and not schedule.reached(test(math.nan))
    assert not Schedule(stop_at_accuracy=None).reached(test(1.0))
    assert schedule.reached({"test_accuracy": 0.95, "client_accuracy": 0.85})  # stop_on: test, the default
    client, both = Schedule(stop_at_accuracy=0.9, stop_on="client"), Schedule(stop_at_accuracy=0.9, stop_on="both")
    assert client.reached({"test_accuracy": 0.5, "client_accuracy": 0.9}) and not client.reached(
        {"test_accuracy": 0.95, "client_accuracy": 0.85}
    )
    assert not client.reached(test(0.95))  # no clients' accuracy logged: never reached
    assert not both.reached({"test_accuracy": 0.95, "client_accuracy": 0.85}) and not both.reached(
        {"test_accuracy": 0.85, "client_accuracy": 0.95}
    )
    assert both.reached({"test_accuracy": 0.91, "client_accuracy": 0.9})
    with pytest.raises(ConfigError, match="stop_on"):
        Schedule(stop_on="val")


def test_summary_from_rows_in_memory():
    import pandas as pd

    from fedrun.metrics import summarise

    rows = pd.DataFrame(
        {
            "round": [1, 2, 3, 4],
            "test_accuracy": [0.5, math.nan, 0.7, 0.65],
            "round_wall_s": [1.0, 2.0, 1.5, 0.5],
            "virtual_time": [2.0, 4.5, 7.0, 9.0],
        }
    )
    values, tags = summarise(rows, (0.6, 0.9))
    assert values["rounds_run"] == 4 and values["total_wall_s"] == 5.0
    assert values["final_test_accuracy"] == 0.65 and values["best_test_accuracy"] == 0.7
    assert values["R60"] == 3 and values["R60_time"] == 7.0
    # the tail (window 10 covers the 4 rounds): (0.5 + 0.7 + 0.65) / 3, swing 0.7 - 0.5 > 0.1: unstable
    assert values["tail_test_accuracy"] == pytest.approx(1.85 / 3) and values["tail_test_accuracy_swing"] == pytest.approx(0.2)
    assert tags == {"R90": "not_reached", "unstable": "test_accuracy"}
    # evaluated changes: +0.2, -0.05 -> smoothness = std / mean|d| = 0.125 / 0.125
    assert values["smoothness"] == pytest.approx(1.0)
    assert "lag1_autocorr" not in values  # too short a curve: NaN, left out


def test_the_summary_of_a_private_run_has_the_epsilon_it_spent():
    import pandas as pd

    from fedrun.metrics import summarise

    rows = pd.DataFrame(
        {"round": [1, 2], "round_wall_s": [1.0, 1.0], "test_accuracy": [0.5, 0.6], "epsilon": [1.5, 2.25]}
    )
    assert summarise(rows, (0.9,))[0]["final_epsilon"] == 2.25
    assert "final_epsilon" not in summarise(rows.drop(columns="epsilon"), (0.9,))[0]
