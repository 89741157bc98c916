"""fedrun-report --robustness (fedrun/robustness.py): cells, ties, the worst case over attacks, heatmaps; by hand."""

import math
import re

import numpy as np
import pandas as pd
import pytest

from fedrun import robustness
from fedrun.metrics import Interval

T_2 = 4.302652729911275  # Student t, 0.975 quantile, 2 degrees of freedom (scipy.stats.t.ppf(0.975, 2))
T_2_BONFERRONI_2 = 6.205346816570706  # t 0.9875 quantile, 2 df: each of k = 2 intervals at 1 - 0.05 / 2
HALF = T_2 * 0.1 / math.sqrt(3)  # three seeds with sd 0.1: 0.248414
HALF_2 = T_2_BONFERRONI_2 * 0.1 / math.sqrt(3)  # 0.358266


def run(rule, attack, f, seed, accuracy, share=None, split="iid", status="FINISHED", told=None):
    row = {
        "tags.defence": rule,
        "tags.aggregator": "ignored",
        "tags.partition": split,
        "tags.attack": attack,
        "tags.attack_malicious_count": str(f) if attack != "none" else None,
        "params.partition.num_clients": "20",
        "params.seed": str(seed),
        "metrics.tail_test_accuracy": accuracy,
        "metrics.final_test_accuracy": accuracy,
        "metrics.total_wall_s": 2.0 + seed,
        "metrics.upload_mb_total": 10.0,
        "tags.git_commit": "abc123",
        "status": status,
    }
    if share is not None:
        row["metrics.attack/weight_share_mean"] = share
    if told is not None:
        row["params.declared_f"] = str(told)
    return row


@pytest.fixture
def rows():
    rows = []
    for seed, (clean, alie, flip) in enumerate([(0.9, 0.8, 0.4), (0.9, 0.9, 0.5), (0.9, 1.0, 0.6)]):
        rows.append(run("krum", "none", 0, seed, clean))
        rows.append(run("krum", "alie", 2, seed, alie, share=1.0))
        rows.append(run("krum", "sign_flip", 2, seed, flip, share=0.0))
        rows.append(run("fedavg", "none", 0, seed, clean))
        rows.append(run("fedavg", "sign_flip", 2, seed, 0.1 * seed, share=0.1))
    return rows


def frame(rows) -> pd.DataFrame:
    runs = pd.DataFrame(rows)
    runs.loc[runs["tags.defence"] == "fedavg", "tags.defence"] = None  # a run without defence: its aggregator
    runs.loc[runs["tags.defence"].isna(), "tags.aggregator"] = "fedavg"
    return runs


def test_cells_by_hand(rows):
    table = robustness.cells(frame(rows)).set_index(["rule", "split", "attack", "f", "told"])
    alie = table.loc[("krum", "iid", "alie", 2, 2)]
    assert alie["runs"] == 3 and alie["seeds"] == "0 1 2" and alie["clients"] == 20
    assert alie["accuracy_mean"] == pytest.approx(0.9)  # (0.8 + 0.9 + 1.0) / 3
    # 0.9 ± 0.248: the upper end 1.148 is cut to 1, the lower one stays
    assert alie["accuracy_lo"] == pytest.approx(0.9 - HALF) and alie["accuracy_hi"] == 1.0
    assert alie["weight_share_mean"] == 1.0 and alie["wall_s_mean"] == 3.0 and alie["upload_mb_mean"] == 10.0
    flip = table.loc[("fedavg", "iid", "sign_flip", 2, 2)]  # 0.0, 0.1, 0.2: 0.1 ± 0.248 -> [0, 0.348]
    assert flip["accuracy_lo"] == 0.0 and flip["accuracy_hi"] == pytest.approx(0.1 + HALF)
    clean = table.loc[("krum", "iid", "none", 0, 0)]
    assert clean["accuracy_mean"] == pytest.approx(0.9) and clean["accuracy_lo"] == pytest.approx(0.9)
    assert clean["weight_share_mean"] == 0.0  # no attacker: nothing to share
    assert not table["accuracy_split"].any() and set(table["same_as"]) == {""}


def test_the_worst_case_is_the_lowest_mean_with_an_interval_simultaneous_over_the_attacks(rows):
    worst = robustness.worst(robustness.cells(frame(rows))).set_index(["rule", "split", "f"])
    krum = worst.loc[("krum", "iid", 2)]
    assert krum["attack"] == "sign_flip" and krum["accuracy_mean"] == pytest.approx(0.5) and krum["attacks"] == 2
    # Each attack's interval at 1 - 0.05 / 2: sign_flip 0.5 ± 0.358, alie 0.9 ± 0.358 cut at 1; the minimum of
    # the lower ends and of the upper ends covers the smaller true mean whenever both intervals cover theirs.
    assert krum["accuracy_lo"] == pytest.approx(0.5 - HALF_2) and krum["accuracy_hi"] == pytest.approx(0.5 + HALF_2)
    none = worst.loc[("krum", "iid", 0)]
    assert none["attack"] == "none" and none["accuracy_lo"] == pytest.approx(0.9)  # f = 0: its own interval


def test_ties_are_named_and_a_lie_the_rule_does_not_read_is_the_attack_it_adds_to(rows):
    # krum: loss_lie_flip gives sign_flip's accuracies seed by seed (Krum reads no loss): it is sign_flip here;
    # ipm gives them too (to 1e-9): a tie, both named. fedavg: a loss lie that changed something stays itself.
    for seed, flip in enumerate((0.4, 0.5, 0.6)):
        rows.append(run("krum", "loss_lie_flip", 2, seed, flip))
        rows.append(run("krum", "ipm", 2, seed, flip + 1e-9))
        rows.append(run("fedavg", "loss_lie_flip", 2, seed, 0.05 * seed + 0.01))
    table = robustness.cells(frame(rows))
    same = table.set_index(["rule", "attack"])["same_as"]
    assert same[("krum", "loss_lie_flip")] == "sign_flip" and same[("fedavg", "loss_lie_flip")] == ""
    worst = robustness.worst(table).set_index(["rule", "split", "f"])
    assert worst.loc[("krum", "iid", 2), "attack"] == "sign_flip = ipm"
    assert worst.loc[("krum", "iid", 2), "attacks"] == 3  # alie, sign_flip, ipm: the variant is no fourth attack
    assert worst.loc[("fedavg", "iid", 2), "attack"] == "loss_lie_flip"  # 0.01, 0.06, 0.11: below sign_flip's


def test_a_cell_of_few_seeds_shows_them_and_one_whose_seeds_disagree_is_split(rows):
    for seed, value in enumerate((0.057, 0.057, 0.728)):  # the cell: a t interval of 0.281 ± 0.962
        rows.append(run("fedsoftmax", "label_flip", 2, seed, value))
    table = robustness.cells(frame(rows)).set_index(["rule", "attack"])
    cell = Interval.from_row(table.loc[("fedsoftmax", "label_flip")], "accuracy")
    assert cell.split and cell.lo == 0.0 and cell.hi == 1.0
    assert cell.cell() == "split 0.281 [0.000, 1.000] (0.057, 0.057, 0.728)"


def test_a_run_the_attack_made_diverge_counts_as_no_model(rows):
    failed = run("krum", "alie", 2, 3, 0.7, status="FAILED")
    failed["tags.failure_reason"] = "DivergenceError: non-finite global model after aggregation at round 7"
    other = run("krum", "alie", 2, 4, 0.7, status="FAILED")
    other["tags.failure_reason"] = "RuntimeError: out of memory"
    runs = frame([*rows, failed, other])
    runs = runs[(runs["status"] == "FINISHED") | robustness.diverged(runs)]  # as fedrun-report keeps them
    alie = robustness.cells(runs).set_index(["rule", "attack"]).loc[("krum", "alie")]
    assert alie["runs"] == 4 and alie["diverged_runs"] == 1
    assert alie["accuracy_mean"] == pytest.approx((0.8 + 0.9 + 1.0 + 0.0) / 4)


def test_a_misspecified_f_is_a_column_of_its_own(rows):
    for seed in range(3):
        rows.append(run("krum", "alie", 2, seed, 0.3, told=1))
    table = robustness.cells(frame(rows))
    assert robustness._columns(table) == [(0, 0), (2, 2), (2, 1)]
    worst = robustness.worst(table).set_index(["rule", "split", "f", "told"])
    assert worst.loc[("krum", "iid", 2, 1), "accuracy_mean"] == pytest.approx(0.3)


def test_markdown_and_heatmaps(rows, tmp_path):
    for seed, value in enumerate((0.057, 0.057, 0.728)):
        rows.append(run("krum", "ipm", 2, seed, value))
    text, tables, plots = robustness.report(frame(rows), tmp_path, "robustness")
    assert "18 runs (0 of them FAILED as diverged, kept and scored 0); seeds 0, 1, 2; commit abc123" in text
    # the worst-case table: fedavg first (one attack: its own interval), then krum (three: simultaneous, the upper
    # end the smallest of the three at 1 - 0.05 / 3: sign_flip's)
    seeds = "(0.900, 0.900, 0.900)"
    assert f"| fedavg | 0.900 ± 0.000 {seeds} | 0.100 [0.000, 0.348] (0.000, 0.100, 0.200) (sign_flip) |" in text
    assert f"| krum | 0.900 ± 0.000 {seeds} | split 0.281 [0.000, 0.942] (0.057, 0.057, 0.728) (ipm) |" in text
    assert f"| krum | alie | 0.900 ± 0.000 {seeds} | 0.900 [0.652, 1.000] (0.800, 0.900, 1.000) |" in text
    assert f"| krum | ipm | 0.900 ± 0.000 {seeds} | split 0.281 [0.000, 1.000] (0.057, 0.057, 0.728) |" in text
    assert "| krum | alie | - | 1.000 ± 0.000 (1.000, 1.000, 1.000) |" in text  # the attackers' weight share
    assert "| krum | ipm | - | n/a |" in text  # no share logged: a rule whose alpha is no convex combination
    assert set(tables) == {"robustness.csv", "robustness_worst.csv"} and len(tables["robustness.csv"]) == 6
    assert [p.name for p in plots] == ["robustness_worst.png", "robustness_iid.png"]
    assert all(p.stat().st_size > 10_000 for p in plots)


def test_no_cell_of_a_bounded_metric_leaves_its_range():
    """A property over random seed values (0s, 1s, values near them, bimodal cells, 2 to 10 seeds): every printed
    interval of an accuracy or a share lies in [0, 1], the worst case's included."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        n = int(rng.integers(2, 11))
        rows = []
        for attack in ("alie", "ipm", "sign_flip"):
            kind = rng.integers(4)
            values = (
                rng.choice([0.0, 1.0], n)
                if kind == 0
                else rng.uniform(0, 0.02, n)
                if kind == 1
                else rng.choice([0.05, 0.9], n)
                if kind == 2
                else rng.uniform(0, 1, n)
            )
            rows += [run("krum", attack, 2, s, float(v), share=float(rng.uniform())) for s, v in enumerate(values)]
        table = robustness.cells(frame(rows))
        worst = robustness.worst(table)
        for part, names in ((table, ("accuracy", "weight_share")), (worst, ("accuracy",))):
            for name in names:
                lo, hi = part[f"{name}_lo"].dropna(), part[f"{name}_hi"].dropna()
                assert (lo >= 0).all() and (hi <= 1).all() and (lo <= hi).all(), (trial, name)
        for _, row in table.iterrows():
            text = Interval.from_row(row, "accuracy").cell()
            numbers = [float(x) for x in re.findall(r"-?\d+\.\d+", text)]
            assert all(0 <= x <= 1 for x in numbers), text


def test_an_attack_with_one_run_bounds_nothing_in_the_worst_case(rows):
    # sign_flip's three runs and alie's three, and one run of ipm at 0.3: it is the lowest mean, has no interval of
    # its own, so the simultaneous interval's ends are the others' and the whole range's: [0, min(hi)]
    rows.append(run("krum", "ipm", 2, 0, 0.3))
    worst = robustness.worst(robustness.cells(frame(rows))).set_index(["rule", "split", "f"]).loc[("krum", "iid", 2)]
    assert worst["attack"] == "ipm" and worst["accuracy_mean"] == pytest.approx(0.3)
    assert worst["accuracy_lo"] == 0.0 and worst["accuracy_lo"] <= 0.3 <= worst["accuracy_hi"] < 1.0
