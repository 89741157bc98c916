"""scripts/reproduce.py by hand: the parts a paper's selection needs, the temperature chosen on the paper's measure,
the table paired once its baseline has run."""

import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
import reproduce  # noqa: E402


def test_parts_select_a_paper_s_sweeps_with_the_temperature_sweep_they_need():
    spec = reproduce.PAPERS["000"]
    assert [p.name for p in reproduce.selected(spec, ["fedavg_iid"])] == ["fedavg_iid"]  # FedAvg needs no T
    assert [p.name for p in reproduce.selected(spec, ["fedsoftmax_pool", "fedavg_iid"])] == [
        "temperature",
        "fedavg_iid",
        "fedsoftmax_pool",
    ]
    assert reproduce.selected(spec, None) == list(spec.parts)
    with pytest.raises(
        SystemExit, match="--parts 'nope' is not a part of this paper \\(its parts: temperature, fedavg_shards"
    ):
        reproduce.selected(spec, ["nope"])


def test_the_table_is_paired_once_its_baseline_part_has_run(tmp_path, capsys):
    assert [p.name for p in reproduce.PAPERS["002"].parts if reproduce.has_baseline(p, "method=fedavg")] == [
        "baselines"
    ]  # in a list
    assert [p.name for p in reproduce.PAPERS["001"].parts if reproduce.has_baseline(p, "aggregator=fedavg")] == [
        "fedavg"
    ]  # not the check's
    reproduce.reproduce("004", tmp_path, 1, tiny=True, dry_run=True, parts=["table"])
    assert "--paired aggregator=fedbuff" in capsys.readouterr().out
    reproduce.reproduce(
        "001", tmp_path, 1, tiny=True, dry_run=True, parts=["fedsoftbetter"]
    )  # FedAvg has not run: no pairs yet
    printed = capsys.readouterr().out
    assert "fedrun-report" in printed and "--paired" not in printed
    (tmp_path / "001" / "fedavg").mkdir(parents=True)
    (tmp_path / "001" / "fedavg" / "multirun.yaml").write_text("{}\n")  # FedAvg's sweep ran in an earlier call
    reproduce.reproduce("001", tmp_path, 1, tiny=True, dry_run=True, parts=["fedsoftbetter"])
    assert "--paired aggregator=fedavg" in capsys.readouterr().out
    reproduce.reproduce(
        "000", tmp_path, 1, tiny=True, dry_run=True, parts=["fedavg_iid"]
    )  # the TNIID view waits for its runs
    assert "report_tniid" not in capsys.readouterr().out
    reproduce.reproduce("000", tmp_path, 1, tiny=True, dry_run=True)
    assert "report_tniid" in capsys.readouterr().out


def test_the_temperature_is_chosen_on_the_paper_s_measure(tmp_path):
    # 000a picks T on the clients' accuracy (their measure): T = 0.1 reaches it first there, T = 0.2 on the test set.
    report = tmp_path / "report.csv"
    pd.DataFrame(
        {
            "aggregator.temperature": [0.2, 0.1, 0.05],
            "R90_median": [20, 25, 30],
            "client_R90_median": [14, 12, 12],
            "final_test_accuracy_mean": [0.8, 0.7, 0.75],
        }
    ).to_csv(report, index=False)
    assert reproduce.best_temperature(report) == "0.2"
    assert reproduce.best_temperature(report, "client_R90") == "0.05"  # tied at 12: the higher final accuracy
    assert reproduce.PAPERS["000a"].select_by == "client_R90" and reproduce.PAPERS["000"].select_by == "R90"
