"""fedrun-report: grouping rules on a hand-made frame (the real command on real runs: tests/e2e/test_report.py)."""

import math

import numpy as np
import pandas as pd
import pytest

from fedrun.metrics import mean_ci
from fedrun.report import (
    censored_median,
    group_keys,
    legend_name,
    markdown,
    paired,
    paired_markdown,
    step_name,
    summarise,
)


def frame():
    return pd.DataFrame(
        {
            "run_id": list("abcdef"),
            "tags.aggregator": ["fedavg"] * 2 + ["fedsoftmax"] * 4,
            "tags.dataset": ["digits"] * 6,
            "params.seed": ["0", "1", "0", "1", "0", "1"],
            "params.aggregator._target_": ["A"] * 2 + ["S"] * 4,
            "params.aggregator.temperature": [None, None, "1", "1", "10", "10"],
            "params.tracking.uri": ["x"] * 6,
            "metrics.R60": [3.0, 5.0, 2.0, 4.0, np.nan, 6.0],
            "metrics.R60_time": [30.5, 50.0, 20.0, 40.0, np.nan, 60.0],
            "metrics.rounds_run": [9.0] * 6,
            "tags.R95": ["not_reached"] * 6,
            "metrics.final_test_accuracy": [0.9, 0.92, 0.95, 0.93, 0.91, 0.94],
            "metrics.weight_share/slow": [0.1, 0.3, 0.2, 0.2, 0.5, 0.5],
        }
    )


def test_group_keys_skip_seed_targets_and_keys_implied_by_the_choice():
    runs = frame()
    assert group_keys(runs) == ["tags.aggregator", "params.aggregator.temperature"]
    # temperature only differs between aggregators: implied by the choice, so not a key
    same_t = runs.assign(**{"params.aggregator.temperature": [None, None, "1", "1", "1", "1"]})
    assert group_keys(same_t) == ["tags.aggregator"]


def test_groups_a_method_chooses_are_not_keys_beside_it():
    # method=storm_vr sets aggregator=mvr and optimizer=storm: the method says it all, and a paired table against
    # method=fedavg must not also match on the aggregator (no pairs would be left).
    runs = pd.DataFrame(
        {
            "tags.method": ["fedavg", "fedavg", "storm_vr", "storm_vr"],
            "tags.aggregator": ["fedavg", "fedavg", "mvr", "mvr"],
            "tags.optimizer": ["sgd", "sgd", "storm", "storm"],
            "params.seed": ["0", "1", "0", "1"],
            "params.optimizer.k0": [None, None, "0.15", "0.15"],
            "params.schedule.rounds": ["30", "100", "30", "100"],
        }
    )
    assert group_keys(runs) == ["tags.method", "params.schedule.rounds"]
    # a group that varies within a method (here the partition) stays a key
    by_partition = runs.drop(columns="params.schedule.rounds").assign(
        **{"tags.partition": ["iid", "shards", "iid", "shards"]}
    )
    assert group_keys(by_partition) == ["tags.method", "tags.partition"]


def test_a_run_made_before_a_group_existed_groups_with_that_group_s_default():
    from fedrun.report import with_group_defaults

    # Two runs from before the pipeline and privacy groups, two after: one table row, not two.
    runs = pd.DataFrame(
        {
            "tags.aggregator": ["fedavg"] * 4,
            "tags.pipeline": [None, None, "none", "clip"],
            "tags.privacy": [None, None, "none", "none"],
            "tags.method": [None] * 4,  # a group without a default option stays empty
            "params.seed": ["0", "1", "0", "1"],
        }
    )
    filled = with_group_defaults(runs)
    assert filled["tags.pipeline"].tolist() == ["none", "none", "none", "clip"]
    assert filled["tags.privacy"].tolist() == ["none"] * 4 and filled["tags.method"].isna().all()
    assert group_keys(filled) == ["tags.pipeline"] and group_keys(runs) == ["tags.pipeline", "tags.privacy"]


def test_a_run_made_before_a_key_existed_groups_with_the_runs_that_log_its_default():
    from fedrun.report import with_key_defaults

    # TERM runs from before aggregator.tau (no param) and after it (tau null: "None", as MLflow logs it), and a
    # fedavg run, whose option has no tau: one row per aggregator, not a row for the old TERM runs apart.
    runs = pd.DataFrame(
        {
            "tags.aggregator": ["term", "term", "term", "fedavg"],
            "params.aggregator.tau": [None, "None", "None", None],
            "params.aggregator.t": ["1.0", "1.0", "1.0", None],
            "params.seed": ["0", "1", "2", "0"],
        }
    )
    filled = with_key_defaults(runs)
    assert filled["params.aggregator.tau"].tolist()[:3] == ["None"] * 3 and pd.isna(filled["params.aggregator.tau"][3])
    assert group_keys(filled) == ["tags.aggregator"] and "params.aggregator.tau" in group_keys(runs)
    told = with_key_defaults(runs.assign(**{"params.aggregator.tau": [None, "None", "0.5", None]}))
    assert told["params.aggregator.tau"].tolist()[:3] == ["None", "None", "0.5"]  # a value logged stays


def test_summary_counts_reached_runs_and_uses_student_t():
    runs = frame()
    keys = group_keys(runs)
    table = summarise(runs, keys).set_index(["aggregator", "aggregator.temperature"])
    fedavg = table.loc[("fedavg", "-")]
    assert fedavg["runs"] == 2 and fedavg["R60_reached"] == 2
    assert fedavg["R60_mean"] == 4.0 and fedavg["R60_ci95"] == pytest.approx(mean_ci([3.0, 5.0])[1])
    hot = table.loc[("fedsoftmax", "10")]
    assert hot["R60_reached"] == 1 and hot["R60_mean"] == 6.0 and math.isnan(hot["R60_ci95"])
    assert fedavg["R60_time_mean"] == pytest.approx(40.25) and fedavg["R60_time_reached"] == 2
    assert "rounds_run_mean" not in table  # not an R-index
    assert fedavg["R95_reached"] == 0  # a target no run reached still has its column
    # Censored medians: fedavg [3, 5] -> the 1st of 2 = 3; fedsoftmax T=10 [unreached, 6] -> 6 (half reached);
    # R95 reached by none -> infinite, shown as "> 9" (the runs' 9 rounds).
    assert fedavg["R60_median"] == 3.0 and hot["R60_median"] == 6.0 and math.isinf(fedavg["R95_median"])
    text = markdown(summarise(runs, keys), keys)
    assert (
        "| aggregator | aggregator.temperature | runs | R60 (reached) | R60 median | R95 (reached) | R95 median | "
        "R60_time (reached) | R60_time median |"
    ) in text
    # R60 of seeds 3 and 5: 4 ± 12.7 as a t interval, cut to [1, 9] (a round of these 9-round runs), the two
    # seeds shown; in time [0, inf): 40.25 ± 123.9 cut at 0.
    assert "| 4.0 [1.0, 9.0] (3.0, 5.0) (2/2) | 3 |" in text and "| 6.0 (1/2) | 6 |" in text
    assert "| - (0/2) | > 9 |" in text and "| 40.2 [0.0, 164.1] (30.5, 50.0) (2/2) | 30.5 |" in text
    assert fedavg["R60_lo"] == 1.0 and fedavg["R60_hi"] == 9.0 and not fedavg["R60_split"]


def test_further_metrics_are_summarised_only_when_asked_for():
    runs = frame()
    keys = group_keys(runs)
    assert "weight_share/slow_mean" not in summarise(runs, keys)
    table = summarise(runs, keys, ("weight_share/slow",)).set_index(["aggregator", "aggregator.temperature"])
    # fedavg [0.1, 0.3]: mean 0.2, half-width t(1) 12.706 * 0.1414 / sqrt(2) = 1.2706; T=10 [0.5, 0.5]: no spread
    assert table.loc[("fedavg", "-"), "weight_share/slow_mean"] == pytest.approx(0.2)
    assert table.loc[("fedavg", "-"), "weight_share/slow_ci95"] == pytest.approx(1.2706, abs=1e-4)
    assert table.loc[("fedsoftmax", "10"), "weight_share/slow_ci95"] == 0.0
    assert "weight_share/slow_reached" not in table  # not an R-index
    assert "| weight_share/slow |" in markdown(table.reset_index(), keys)
    # a share lies in [0, 1]: fedavg's 0.2 ± 1.27 is printed cut, with its two seeds' values
    assert table.loc[("fedavg", "-"), "weight_share/slow_lo"] == 0.0
    assert table.loc[("fedavg", "-"), "weight_share/slow_hi"] == 1.0
    assert "| 0.2000 [0.0000, 1.0000] (0.1000, 0.3000) |" in markdown(table.reset_index(), keys)
    # accuracies too, by default: the tail (here absent: "-") first, the final round after it, labelled
    text = markdown(summarise(runs, keys), keys)
    assert "| final_test_accuracy |" in text and "| 0.9100 [0.7829, 1.0000] (0.9000, 0.9200) |" in text


def test_paired_differences_match_runs_on_the_seed_against_the_baseline():
    runs = frame()
    keys = group_keys(runs)
    table = paired(runs, keys, "tags.aggregator", "fedavg").set_index("aggregator.temperature")
    # FedAvg's runs have no temperature: each FedSoftMax run pairs with the FedAvg run of its seed.
    # T=1: R60 [2, 4] - [3, 5] = [-1, -1]: mean -1, no spread. T=10: seed 0 never reached 60% -> one pair, 6 - 5 = 1.
    assert table.loc["1", "R60_diff"] == -1.0 and table.loc["1", "R60_ci95"] == 0.0 and table.loc["1", "R60_pairs"] == 2
    assert (
        table.loc["10", "R60_diff"] == 1.0
        and math.isnan(table.loc["10", "R60_ci95"])
        and table.loc["10", "R60_pairs"] == 1
    )
    # final accuracy, T=1: [0.95, 0.93] - [0.9, 0.92] = [0.05, 0.01]: mean 0.03, sd 0.02828, t(1) 12.706 * 0.02828 / sqrt(2) = 0.2541
    assert table.loc["1", "final_test_accuracy_diff"] == pytest.approx(0.03)
    assert table.loc["1", "final_test_accuracy_ci95"] == pytest.approx(0.2541, abs=1e-4)
    assert table.loc["1", "pairs"] == 2 and "fedavg" not in set(table["aggregator"])
    text = paired_markdown(table.reset_index(), keys, "tags.aggregator", "fedavg")
    assert table.loc["1", "R60_lower"] == 2 and table.loc["1", "R60_higher"] == 0 and table.loc["10", "R60_higher"] == 1
    assert (
        "| fedsoftmax | 1 | 2 | -1.0 ± 0.0 (2: 2-/0=/0+) |" in text
        and "| fedsoftmax | 10 | 2 | 1.0 (1: 0-/0=/1+) |" in text
    )
    # A difference of two R-indices of 9-round runs lies in [-8, 8]: R60 differences -1 and +5 (t interval 2 ± 38.1)
    # are cut to [-8, 8]. R60_time, in time: [20, 40] - [30.5, 50] = [-10.5, -10], open on both sides: not cut.
    wide = frame().assign(**{"metrics.R60": [3.0, 3.0, 2.0, 8.0, np.nan, 6.0]})
    cut = paired(wide, keys, "tags.aggregator", "fedavg").set_index("aggregator.temperature")
    assert (cut.loc["1", "R60_lo"], cut.loc["1", "R60_hi"]) == (-8.0, 8.0) and cut.loc["1", "R60_diff"] == 2.0
    # sd of [-10.5, -10] is 0.3536, over sqrt(2): 0.25; t(1) 12.706 * 0.25 = 3.177
    assert table.loc["1", "R60_time_lo"] == pytest.approx(-10.25 - 12.706204736174705 * 0.25)
    # a difference of accuracies lies in [-1, 1]: 0.03 ± 0.2541 stays inside and is printed as ±
    assert table.loc["1", "final_test_accuracy_lo"] == pytest.approx(0.03 - 0.2541, abs=1e-4)
    assert "0.0300 ± 0.2541 (2: 0-/0=/2+)" in text
    with pytest.raises(ValueError, match="no finished run has aggregator = 'fedprox' \\(there: fedavg, fedsoftmax\\)"):
        paired(runs, keys, "tags.aggregator", "fedprox")
    # The FedAvg baseline run twice for each seed (the same job in two sweeps): still one pair a seed, the same figures.
    twice = paired(pd.concat([runs, runs[runs["tags.aggregator"] == "fedavg"]]), keys, "tags.aggregator", "fedavg")
    twice = twice.set_index("aggregator.temperature")
    assert twice.loc["1", "pairs"] == 2 and twice.loc["1", "final_test_accuracy_ci95"] == pytest.approx(
        0.2541, abs=1e-4
    )


def test_groups_sort_numbers_as_numbers():
    runs = frame().assign(**{"params.aggregator.temperature": [None, None, "3", "3", "10", "10"]})
    table = summarise(runs, group_keys(runs))
    assert list(table["aggregator.temperature"]) == ["-", "3", "10"]  # as text, "10" would come before "3"


def test_a_table_without_group_keys_counts_runs_as_integers():
    runs = frame()
    text = markdown(summarise(runs, []), [])
    # R60 over [3, 5, 2, 4, unreached, 6]: mean 4.0 of the five reached, t(4) 2.776 * 1.581 / sqrt(5) = 1.96;
    # censored median: [2, 3, 4, 5, 6, inf] -> the 3rd, 4
    assert "| 6 | 4.0 ± 2.0 (5/6) | 4 | - (0/6) | > 9 |" in text


def test_censored_median_counts_unreached_runs_as_infinite():
    nan = math.nan
    # sorted with inf: [2, 4, inf] -> the ceil(3/2) = 2nd value, 4 (the mean over the reached runs is 3)
    assert censored_median(np.array([4.0, nan, 2.0])) == 4.0
    # [3, inf, inf]: one of three reached -> fewer than half: infinite ("> max rounds" in the table)
    assert math.isinf(censored_median(np.array([nan, 3.0, nan])))
    # [1, 5, 7, inf]: the 2nd value; half of the runs had reached it by round 5
    assert censored_median(np.array([7.0, nan, 1.0, 5.0])) == 5.0
    assert math.isnan(censored_median(np.array([])))


def test_the_x_axis_counts_aggregations_for_async_runs():
    assert step_name(pd.DataFrame({"tags.engine": ["async", "async"]})) == "aggregation"
    assert step_name(pd.DataFrame({"tags.engine": ["sync", None]})) == "round"
    assert step_name(pd.DataFrame({"tags.engine": ["sync", "async"]})) == "round (aggregation for async runs)"
    assert step_name(pd.DataFrame({"params.seed": ["0"]})) == "round"  # runs from before the engine tag


def test_legend_names_leave_out_keys_without_a_value_and_shorten_unique_ones():
    keys = [
        "tags.aggregator",
        "params.aggregator.anneal",
        "params.partition.shards_per_client",
        "params.a.temperature",
        "params.b.temperature",
    ]
    assert legend_name(keys, ("fedavg", "-", "2", "None", "-")) == "aggregator=fedavg, shards_per_client=2"
    assert legend_name(keys, ("fedsoftmax", "exponential", "2", "1.0", "3")) == (
        "aggregator=fedsoftmax, anneal=exponential, shards_per_client=2, a.temperature=1.0, b.temperature=3"
    )  # two "temperature"s
    assert legend_name([], ()) == "all runs"


def test_a_privacy_utility_plot_has_a_line_per_other_setting_and_the_baseline_as_a_band(tmp_path, monkeypatch):
    from fedrun.plots import plt
    from fedrun.report import plot_versus

    table = pd.DataFrame(
        {
            "privacy": ["central"] * 4 + ["none"],
            "privacy.target_epsilon": ["1", "8", "1", "8", "-"],
            "privacy.adaptive": ["False", "False", "True", "True", "-"],
            "runs": [3, 3, 3, 2, 3],
            "tail_test_accuracy_mean": [0.8, 0.9, 0.1, 0.85, 0.97],
            "tail_test_accuracy_ci95": [0.05, 0.02, np.nan, 0.03, 0.01],
            # the interval within [0, 1] (report.interval_columns): 0.97 ± 0.05 is cut at 1
            "tail_test_accuracy_lo": [0.75, 0.88, np.nan, 0.82, 0.92],
            "tail_test_accuracy_hi": [0.85, 0.92, np.nan, 0.88, 1.0],
        }
    )
    drawn = {}
    monkeypatch.setattr(plt, "close", lambda fig: drawn.setdefault("axes", fig.axes[0]))
    keys = ["tags.privacy", "params.privacy.target_epsilon", "params.privacy.adaptive"]
    path = plot_versus(table, keys, "params.privacy.target_epsilon", tmp_path / "v.png", "utility")
    assert path.stat().st_size > 10_000
    ax = drawn["axes"]
    labels = ax.get_legend_handles_labels()[1]
    assert sorted(labels) == [
        "privacy=central, adaptive=False (n=3)",
        "privacy=central, adaptive=True (n=2)",  # the fewest runs of the line's points
        "privacy=none (n=3)",
    ]
    fixed = ax.containers[0].lines[0]  # the first error-bar line: x in order, y the means
    assert list(fixed.get_xdata()) == [1.0, 8.0] and list(fixed.get_ydata()) == [0.8, 0.9]
    assert ax.get_xscale() == "log"  # 1 to 8 spans a factor of 8
    band = ax.patches[-1]  # the baseline's band: cut at 1, not 1.02
    assert band.get_y() == pytest.approx(0.92) and band.get_y() + band.get_height() == pytest.approx(1.0)


def test_the_keys_of_a_group_switched_off_are_blanked():
    from fedrun.report import without_switched_off_keys

    runs = pd.DataFrame(
        {
            "tags.privacy": ["central", "none"],
            "params.privacy.target_epsilon": ["8", "8"],  # the none run's is a preset's leftover
            "params.privacy._target_": ["fedrun.privacy.Privacy"] * 2,
            "params.seed": ["0", "0"],
        }
    )
    blanked = without_switched_off_keys(runs)
    assert (
        blanked["params.privacy.target_epsilon"].iloc[0] == "8" and blanked["params.privacy.target_epsilon"].isna()[1]
    )
    assert blanked["params.seed"].tolist() == ["0", "0"] and runs["params.privacy.target_epsilon"].tolist() == ["8"] * 2
    assert group_keys(blanked) == ["tags.privacy"]  # the epsilon only changes with the choice: not a key of its own


def test_a_band_plot_leaves_out_a_group_that_never_logged_the_metric(tmp_path):
    from fedrun.report import plot_bands

    logged = pd.DataFrame({"a": [0.5, 0.4], "b": [0.6, 0.5]}, index=[1, 2])
    path = plot_bands({"adaptive": logged, "privacy=none": pd.DataFrame()}, tmp_path / "c.png", "clip", "clip_norm")
    assert path.stat().st_size > 10_000


def test_a_band_plot_of_more_groups_than_colours_draws_no_two_lines_alike(tmp_path, monkeypatch):
    # 11 groups (the personalisation page's): the 11th took the 1st's colour and style, APFL and FedAvg looked alike
    from matplotlib.figure import Figure

    from fedrun.report import plot_bands

    drawn = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (drawn.extend(fig.axes[0].lines), save(fig, *a, **k)))
    groups = {f"g{i}": pd.DataFrame({"a": [0.1 * i, 0.2], "b": [0.1, 0.3]}, index=[1, 2]) for i in range(11)}
    plot_bands(groups, tmp_path / "c.png", "eleven")
    styles = {(line.get_color(), line.get_linestyle()) for line in drawn}
    assert len(drawn) == 11 and len(styles) == 11


def test_a_box_plot_of_more_groups_than_colours_gives_each_its_own_points(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from fedrun.report import plot_distribution

    drawn = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (drawn.extend(fig.axes[0].lines), save(fig, *a, **k)))
    groups = {f"g{i}": np.array([0.5, 0.6 + 0.01 * i, np.nan]) for i in range(11)}
    plot_distribution(groups, tmp_path / "box.png", "eleven")
    points = [line for line in drawn if line.get_linestyle() == "None"]  # the clients' points, not the boxes' lines
    assert len(points) == 11 and len({(p.get_color(), p.get_marker()) for p in points}) == 11
    assert [len(p.get_ydata()) for p in points] == [2] * 11  # a NaN (no test split) is not a point


def test_accuracy_per_megabyte_is_indexed_by_the_cumulative_upload():
    from fedrun.report import per_megabyte

    accuracy = {"topk": pd.DataFrame({"a": [0.5, 0.7, 0.8], "b": [0.6, 0.8, 0.9]}, index=[1, 2, 3])}
    # Run a sends 2 MB a round, run b 4 MB: cumulative 2, 4, 6 and 4, 8, 12; their mean 3, 6, 9.
    uploads = {"topk": pd.DataFrame({"a": [2.0, 2.0, 2.0], "b": [4.0, 4.0, 4.0]}, index=[1, 2, 3])}
    frame = per_megabyte(accuracy, uploads)["topk"]
    assert frame.index.tolist() == [3.0, 6.0, 9.0] and frame["b"].tolist() == [0.6, 0.8, 0.9]
    # evaluated every 2 rounds: the megabytes until round 4 count rounds 1 and 3 too (they were 2 and 4 before)
    every_other = {"topk": pd.DataFrame({"a": [0.5, 0.7], "b": [0.6, 0.8]}, index=[2, 4])}
    uploads = {"topk": pd.DataFrame({"a": [2.0] * 4, "b": [4.0] * 4}, index=[1, 2, 3, 4])}
    assert per_megabyte(every_other, uploads)["topk"].index.tolist() == [6.0, 12.0]


def test_r_index_columns_come_in_one_order_whatever_order_mlflow_gives_them():
    # two fedrun-report runs on one store printed R70_time and R70_mb in either order (ties of the sort key)
    from fedrun.report import metric_columns

    names = ["R70_time", "R60", "client_R90", "R70_mb", "R60_time", "R70", "R60_mb"]
    orders = []
    for shift in range(len(names)):
        turned = names[shift:] + names[:shift]
        runs = pd.DataFrame({f"metrics.{n}": [1.0] for n in turned})
        orders.append(metric_columns(runs)[1])
    assert all(order == orders[0] for order in orders)
    assert [c.removeprefix("metrics.") for c in orders[0]] == [
        "R60",
        "R70",
        "R60_mb",
        "R60_time",
        "R70_mb",
        "R70_time",
        "client_R90",
    ]


def test_accuracy_per_virtual_second_is_indexed_by_the_runs_mean_clock():
    from fedrun.report import per_total

    accuracy = {"fedbuff": pd.DataFrame({"a": [0.5, 0.7], "b": [0.6, 0.8]}, index=[2, 4]), "none": pd.DataFrame()}
    # the clocks of every round; accuracy evaluated at rounds 2 and 4: run a at 10 and 30 s, run b at 20 and 50 s
    clocks = {"fedbuff": pd.DataFrame({"a": [5.0, 10.0, 20.0, 30.0], "b": [8.0, 20.0, 35.0, 50.0]}, index=[1, 2, 3, 4])}
    frame = per_total(accuracy, clocks)
    assert frame["fedbuff"].index.tolist() == [15.0, 40.0] and frame["fedbuff"]["b"].tolist() == [0.6, 0.8]
    assert frame["none"].empty  # a group without devices has no clock: no line


def test_a_run_logged_before_the_tail_summary_gets_it_from_its_history(monkeypatch):
    from types import SimpleNamespace

    from fedrun import report

    curve = {"old": [(r, 0.9 if r % 2 else 0.1) for r in range(1, 13)], "short": [(1, 0.5), (2, 0.7)]}
    monkeypatch.setattr(
        report, "history", lambda client, run_id, metric: [SimpleNamespace(step=s, value=v) for s, v in curve[run_id]]
    )
    runs = pd.DataFrame(
        {
            "run_id": ["old", "short", "new"],
            "params.schedule.tail": [None, "1", "10"],
            "metrics.tail_test_accuracy": [np.nan, np.nan, 0.42],
        }
    )
    filled = report.with_tails(None, runs).set_index("run_id")
    # old: no schedule.tail param, the default 10: rounds 3-12, five 0.9 and five 0.1
    assert filled.loc["old", "metrics.tail_test_accuracy"] == pytest.approx(0.5)
    assert filled.loc["old", "metrics.tail_test_accuracy_swing"] == pytest.approx(0.8)
    assert filled.loc["short", "metrics.tail_test_accuracy"] == pytest.approx(0.7)  # its own tail of 1
    assert filled.loc["new", "metrics.tail_test_accuracy"] == 0.42  # logged: kept


def test_fairness_tails_missing_from_a_run_come_from_its_per_client_table_as_the_run_judges_them():
    from fedrun.metrics import fairness
    from fedrun.report import personal_accuracies, with_fairness_tails

    # Rounds 2, 4, 6 judged, the run ran 7 rounds with a tail of 4: rounds 4-7, so rounds 4 and 6. Client 2 holds no
    # test sample (NaN): left out. worst10 of two clients is the worse one: round 4 0.2, round 6 0.4.
    table = pd.DataFrame(
        {"client_0": [0.1, 0.2, 0.8], "client_1": [0.3, 0.6, 0.4], "client_2": [np.nan] * 3}, index=[2, 4, 6]
    )
    runs = pd.DataFrame(
        {
            "run_id": ["old", "new"],
            "tags.aggregator": ["qffl", "qffl"],
            "params.seed": ["0", "1"],
            "params.schedule.tail": ["4", "4"],
            "metrics.rounds_run": [7.0, 7.0],
            "metrics.tail_fairness_worst10": [np.nan, 0.123],
        }
    )
    filled = with_fairness_tails(runs, {"old": table, "new": table}).set_index("run_id")
    assert filled.loc["old", "metrics.tail_fairness_worst10"] == pytest.approx(0.3)  # (0.2 + 0.4) / 2
    assert filled.loc["old", "metrics.tail_fairness_worst10_swing"] == pytest.approx(0.2)
    assert filled.loc["old", "metrics.tail_fairness_best10"] == pytest.approx(0.7)  # (0.6 + 0.8) / 2
    jain = [fairness(np.array(r), np.ones(2))["jain"] for r in ([0.2, 0.6], [0.8, 0.4])]
    assert filled.loc["old", "metrics.tail_fairness_jain"] == pytest.approx(np.mean(jain))
    assert filled.loc["new", "metrics.tail_fairness_worst10"] == 0.123  # logged: kept
    # Each client's mean over its run's tail, pooled over the group's runs (NaN: no test sample).
    pooled = personal_accuracies(runs, ["tags.aggregator"], {"old": table, "new": table}, over="tail")
    assert list(pooled) == ["aggregator=qffl"]
    np.testing.assert_allclose(pooled["aggregator=qffl"], [0.5, 0.5, np.nan, 0.5, 0.5, np.nan])


def test_fairness_measures_have_their_ranges():
    from fedrun.metrics import bounds

    assert bounds("tail_fairness_worst10") == (0, 1) and bounds("tail_fairness_jain") == (0, 1)
    assert bounds("tail_fairness_variance") == (0, 0.25) and bounds("fairness/left_behind") == (0, 1)


def test_a_run_resumed_across_a_metric_rename_reads_back_whole():
    # epsilon was 2_privacy/epsilon before it became a headline (0_main/epsilon): a run stopped then and resumed now
    # logged rounds 1-2 under the old name and 2-3 under the new; history() gives each round once, the new name's
    from types import SimpleNamespace

    from fedrun.report import history, with_plain_names

    stored = {
        "2_privacy/epsilon": [SimpleNamespace(step=1, value=1.0), SimpleNamespace(step=2, value=2.0)],
        "0_main/epsilon": [SimpleNamespace(step=2, value=2.5), SimpleNamespace(step=3, value=3.0)],
    }
    client = SimpleNamespace(get_metric_history=lambda run_id, name: stored.get(name, []))
    assert [(p.step, p.value) for p in history(client, "r", "epsilon")] == [(1, 1.0), (2, 2.5), (3, 3.0)]
    runs = pd.DataFrame({"metrics.0_main/epsilon": [3.0], "metrics.2_privacy/epsilon": [2.0]})
    assert with_plain_names(runs)["metrics.epsilon"].tolist() == [3.0]  # the current name's last value
