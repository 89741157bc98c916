import math

import numpy as np
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
    assert values["tail_test_accuracy"] == pytest.approx(1.85 / 3) and values[
        "tail_test_accuracy_swing"
    ] == pytest.approx(0.2)
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


def test_a_curve_is_judged_on_its_tail_by_hand():
    from fedrun.metrics import tail

    # FedSoftMax under label flips: 0.91 and 0.05 in turn. Its last round alone says 0.05 (30 rounds) or 0.91 (29).
    rounds = list(range(1, 31))
    curve = [0.91 if r % 2 else 0.05 for r in rounds]
    assert tail(rounds, curve, 10) == (pytest.approx(0.48), pytest.approx(0.86), 10)
    assert tail(rounds[:-1], curve[:-1], 10)[0] == pytest.approx((5 * 0.91 + 5 * 0.05) / 10)
    # evaluated every 2 rounds the swing is invisible: rounds 22, 24, ..., 30 are all 0.05
    strided = [v if r % 2 == 0 else math.nan for r, v in zip(rounds, curve)]
    assert tail(rounds, strided, 10) == (pytest.approx(0.05), 0.0, 5)
    assert tail([1, 2], [math.nan, math.nan], 10) == (
        pytest.approx(math.nan, nan_ok=True),
        pytest.approx(math.nan, nan_ok=True),
        0,
    )
    assert tail([3, 7, 9], [0.1, 0.5, 0.6], 3)[:2] == (pytest.approx(0.55), pytest.approx(0.1))  # rounds > 6


def test_the_tail_summary_tags_a_run_that_swings_and_says_so_in_one_line():
    import pandas as pd

    from fedrun.metrics import tail_summary, unstable_line

    rows = pd.DataFrame(
        {
            "round": [1, 2, 3, 4],
            "test_accuracy": [0.9, 0.1, 0.9, 0.1],
            "client_accuracy": [0.8, 0.82, 0.81, 0.8],
            "personal/accuracy_mean": [0.7, 0.7, 0.7, 0.75],
        }
    )
    values, tags = tail_summary(rows, 10, 0.1)
    assert values["tail_test_accuracy"] == pytest.approx(0.5) and values["tail_test_accuracy_swing"] == pytest.approx(
        0.8
    )
    assert values["tail_client_accuracy_swing"] == pytest.approx(0.02)
    assert values["tail_personal_accuracy_mean"] == pytest.approx(0.7125)
    assert tags == {"unstable": "test_accuracy"}
    line = unstable_line(values, tags, 10)
    assert line.startswith("fedrun: unstable over its last 10 rounds: test_accuracy swung by 0.800 (tail mean 0.5000)")
    assert tail_summary(rows, 10, 0.9) == (values, {}) and unstable_line(values, {}, 10) is None


def test_a_bounded_interval_is_the_t_interval_cut_to_the_range_by_hand():
    from fedrun.metrics import SHOWN_SEEDS, Interval, bounded_ci, bounds

    t2 = 4.302652729911275  # t 0.975, 2 degrees of freedom
    # The cell: seeds 0.057, 0.057, 0.728: mean 0.2807, sd 0.3874, half-width 0.9624 -> [0, 1]
    cell = bounded_ci([0.057, 0.057, 0.728])
    assert cell.mean == pytest.approx(0.842 / 3) and (cell.lo, cell.hi) == (0.0, 1.0) and cell.split and cell.cut
    assert cell.cell() == "split 0.281 [0.000, 1.000] (0.057, 0.057, 0.728)"
    inside = bounded_ci([0.8, 0.9, 1.0])  # 0.9 ± 0.2484: cut above only
    assert inside.lo == pytest.approx(0.9 - t2 * 0.1 / math.sqrt(3)) and inside.hi == 1.0 and not inside.split
    narrow = bounded_ci([0.86, 0.87, 0.88, 0.87, 0.87])  # five seeds: not listed, symmetric, printed as ±
    half = 2.7764451051977987 * np.std([0.86, 0.87, 0.88, 0.87, 0.87], ddof=1) / math.sqrt(5)  # t 0.975, 4 df
    assert narrow.cell() == f"0.870 ± {half:.3f}" and not narrow.cut and SHOWN_SEEDS == 5
    assert bounded_ci([0.0, 0.0, 0.0]).cell() == "0.000 ± 0.000 (0.000, 0.000, 0.000)"
    assert bounded_ci([0.4]).cell() == "0.400" and bounded_ci([]).cell() == "-"
    spread = bounded_ci([0.05, 0.05, 0.05, 0.9, 0.9, 0.9])  # six seeds that split: their range instead of them
    assert spread.cell().startswith("split 0.475 [") and spread.cell().endswith("(0.050–0.900)")
    assert bounded_ci([-3.0, 5.0], None).lo < -3  # unbounded: the plain t interval
    assert Interval(0.5, 0.4, 0.6, ()).cell(".2g") == "0.5 ± 0.1"
    assert Interval(0.5, 0.4, 0.6, ()).cell(2, brackets=True) == "0.50 [0.40, 0.60]"  # a simultaneous interval
    assert bounds("tail_test_accuracy_swing") == (0, 1) and bounds("attack/weight_share_mean") == (0, 1)
    assert bounds("lag1_autocorr") == (-1, 1) and bounds("train_loss") is None and bounds("rounds_run") is None
    # An R-index in rounds is a round of the run: [1, rounds]; in time or megabytes, and the other quantities that
    # cannot be negative, [0, inf): a cell's interval never goes below 0 (R60 3.0 ± 12.7 once printed from 2 seeds).
    assert (
        bounds("R90") == (1, math.inf) and bounds("client_R60", 30) == (1, 30) and bounds("R90_time", 30)[1] == math.inf
    )
    assert bounds("R90_mb") == bounds("smoothness") == bounds("attack/deviation_mean") == (0, math.inf)
    assert bounds("final_epsilon") == bounds("upload_mb_total") == bounds("selection_wall_s") == (0, math.inf)
    r = bounded_ci([2.0, 4.0], (1, 8))  # 3 ± 12.7 -> [1, 8]; spread 2 of the 7 rounds' scale: not split
    assert (r.lo, r.hi, r.split) == (1, 8, False) and r.cell(1) == "3.0 [1.0, 8.0] (2.0, 4.0)"
    assert bounded_ci([2.0, 7.0], (1, 8)).split  # 5 of 7: the seeds disagree in kind
    smooth = bounded_ci([0.2, 2.5], (0, math.inf))  # 1.35 ± 14.6: cut at 0 only, never split on an open range
    assert smooth.lo == 0 and smooth.hi == pytest.approx(1.35 + 12.706204736174705 * 2.3 / 2) and not smooth.split


def test_a_tail_too_thin_for_the_evaluation_stride_is_warned_about():
    from fedrun.rounds import Schedule

    assert Schedule(rounds=30, tail=10, eval_every=1).tail_evaluations == 10
    assert Schedule(rounds=30, tail=10, eval_every=1).thin_tail() is None
    # stride 25 over 500 rounds: rounds 491-500 hold one evaluation (500, the last)
    stride = Schedule(rounds=500, tail=10, eval_every=25)
    assert stride.tail_evaluations == 1 and "schedule.tail=75 or more" in stride.thin_tail()
    assert Schedule(rounds=500, tail=125, eval_every=25).tail_evaluations == 5
    assert Schedule(rounds=2, tail=10, eval_every=1).thin_tail() is None  # two evaluations in all: nothing to judge


def test_the_async_engines_group_accuracies_are_judged_on_their_tail_too():
    import pandas as pd

    from fedrun.metrics import tail_summary, unstable_line

    rows = pd.DataFrame({"round": [1, 2, 3], "test_accuracy": [0.8, 0.8, 0.8], "accuracy/slow": [0.2, 0.6, 0.4]})
    values, tags = tail_summary(rows, 10, 0.1)
    assert values["tail_accuracy/slow"] == pytest.approx(0.4) and values["tail_accuracy/slow_swing"] == pytest.approx(
        0.4
    )
    assert tags == {"unstable": "accuracy/slow"}
    assert "accuracy/slow swung by 0.400 (tail mean 0.4000)" in unstable_line(values, tags, 10)
