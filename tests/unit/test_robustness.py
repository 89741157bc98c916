"""fedrun-report --robustness (fedrun/robustness.py): cells, the worst case over attacks, heatmaps; by hand."""

import math

import pandas as pd
import pytest

from fedrun import robustness

T_2 = 4.302652729911275  # Student t, 0.975 quantile, 2 degrees of freedom (scipy.stats.t.ppf(0.975, 2))


def run(rule, attack, f, seed, accuracy, share=None, split="iid"):
    row = {
        "tags.defence": rule,
        "tags.aggregator": "ignored",
        "tags.partition": split,
        "tags.attack": attack,
        "tags.attack_malicious_count": str(f) if attack != "none" else None,
        "params.partition.num_clients": "20",
        "params.seed": str(seed),
        "metrics.final_test_accuracy": accuracy,
        "metrics.total_wall_s": 2.0 + seed,
        "metrics.upload_mb_total": 10.0,
        "tags.git_commit": "abc123",
    }
    if share is not None:
        row["metrics.attack/weight_share_mean"] = share
    return row


@pytest.fixture
def runs():
    rows = []
    for seed, (clean, alie, flip) in enumerate([(0.9, 0.8, 0.4), (0.9, 0.9, 0.5), (0.9, 1.0, 0.6)]):
        rows.append(run("krum", "none", 0, seed, clean))
        rows.append(run("krum", "alie", 2, seed, alie, share=1.0))
        rows.append(run("krum", "sign_flip", 2, seed, flip, share=0.0))
        rows.append(run("fedavg", "none", 0, seed, clean))
        rows.append(run("fedavg", "sign_flip", 2, seed, 0.1 * seed, share=0.1))
    frame = pd.DataFrame(rows)
    frame.loc[frame["tags.defence"] == "fedavg", "tags.defence"] = None  # a run without defence: its aggregator
    frame.loc[frame["tags.defence"].isna(), "tags.aggregator"] = "fedavg"
    return frame


def test_cells_by_hand(runs):
    table = robustness.cells(runs).set_index(["rule", "split", "attack", "f"])
    alie = table.loc[("krum", "iid", "alie", 2)]
    assert alie["runs"] == 3 and alie["seeds"] == "0 1 2" and alie["clients"] == 20
    assert alie["accuracy_mean"] == pytest.approx(0.9)  # (0.8 + 0.9 + 1.0) / 3
    assert alie["accuracy_ci95"] == pytest.approx(T_2 * 0.1 / math.sqrt(3))  # sd 0.1: 0.248414
    assert alie["weight_share_mean"] == 1.0 and alie["wall_s_mean"] == 3.0 and alie["upload_mb_mean"] == 10.0
    clean = table.loc[("krum", "iid", "none", 0)]
    assert clean["accuracy_mean"] == pytest.approx(0.9) and clean["accuracy_ci95"] == 0.0
    assert clean["weight_share_mean"] == 0.0  # no attacker: nothing to share
    assert ("fedavg", "iid", "sign_flip", 2) in table.index  # no defence tag: the aggregator names the rule


def test_the_worst_case_is_the_attack_of_lowest_mean_with_its_own_interval(runs):
    worst = robustness.worst(robustness.cells(runs)).set_index(["rule", "split", "f"])
    krum = worst.loc[("krum", "iid", 2)]
    assert krum["attack"] == "sign_flip" and krum["accuracy_mean"] == pytest.approx(0.5)  # not alie's 0.9
    assert krum["accuracy_ci95"] == pytest.approx(T_2 * 0.1 / math.sqrt(3)) and krum["attacks"] == 2
    assert worst.loc[("krum", "iid", 0), "attack"] == "none"  # f = 0: the run without attack


def test_markdown_and_heatmaps(runs, tmp_path):
    text, tables, plots = robustness.report(runs, tmp_path, "robustness")
    assert "15 finished runs; seeds 0, 1, 2; commit abc123" in text
    # the worst-case table: fedavg first, then krum; f = 0 in every attack's column
    assert "| fedavg | 0.900 ± 0.000 | 0.100 ± 0.248 (sign_flip) |" in text
    assert "| krum | 0.900 ± 0.000 | 0.500 ± 0.248 (sign_flip) |" in text
    assert "| krum | alie | 0.900 ± 0.000 | 0.900 ± 0.248 |" in text
    assert "| krum | alie | 0.000 | 1.000 ± 0.000 |" in text  # the attackers' weight share
    assert set(tables) == {"robustness.csv", "robustness_worst.csv"} and len(tables["robustness.csv"]) == 5
    assert [p.name for p in plots] == ["robustness_worst.png", "robustness_iid.png"]
    assert all(p.stat().st_size > 10_000 for p in plots)
