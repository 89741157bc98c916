"""fedrun-report: the real command on real runs and on hand-made MLflow stores (the grouping rules on a hand-made
frame: tests/unit/test_report.py)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import mlflow_runs

from fedrun.metrics import mean_ci


@pytest.mark.slow
@pytest.mark.e2e
def test_report_command_on_a_real_sweep(fedrun, store, tmp_path):
    fedrun(
        "-m",
        "aggregator=fedavg,fedsoftmax",
        "seed=0,1",
        "schedule.rounds=3",
        "partition.num_clients=5",
        experiment="report",
    )
    out = tmp_path / "report"
    report = str(Path(sys.executable).parent / "fedrun-report")
    done = subprocess.run(
        [report, "--experiment", "report", "--tracking-uri", f"sqlite:///{store}", "--out", str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "| aggregator | runs |" in done.stdout
    table = pd.read_csv(out / "report.csv").set_index("aggregator")
    assert list(table.index) == ["fedavg", "fedsoftmax"] and list(table["runs"]) == [2, 2]
    _, runs = mlflow_runs(store, "report")
    for aggregator in ("fedavg", "fedsoftmax"):
        finals = [
            r.data.metrics["5_summary/final_test_accuracy"] for r in runs if r.data.tags["aggregator"] == aggregator
        ]
        mean, half = mean_ci(finals)
        assert table.loc[aggregator, "final_test_accuracy_mean"] == pytest.approx(mean)
        assert table.loc[aggregator, "final_test_accuracy_ci95"] == pytest.approx(half)
    assert (out / "report.md").read_text().startswith("# report") and (out / "accuracy.png").stat().st_size > 10_000
    # Any logged metric: its last value per run as a column, its per-round curve as a band plot.
    subprocess.run(
        [
            report,
            "--experiment",
            "report",
            "--tracking-uri",
            f"sqlite:///{store}",
            "--out",
            str(out),
            "--metrics",
            "alpha_distance",
            "--plot",
            "alpha_distance",
            "--per-mb",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert (out / "accuracy_vs_upload_mb.png").stat().st_size > 10_000  # accuracy against the megabytes uploaded
    table = pd.read_csv(out / "report.csv").set_index("aggregator")
    for aggregator in ("fedavg", "fedsoftmax"):
        last = [r.data.metrics["alpha_distance"] for r in runs if r.data.tags["aggregator"] == aggregator]
        assert table.loc[aggregator, "alpha_distance_mean"] == pytest.approx(np.mean(last))
    assert table.loc["fedavg", "alpha_distance_mean"] == pytest.approx(0.0, abs=1e-12)  # FedAvg's alpha is p
    assert (out / "alpha_distance.png").stat().st_size > 10_000
    # Paired by seed against FedAvg: each FedSoftMax run minus the FedAvg run of its seed.
    subprocess.run(
        [
            report,
            "--experiment",
            "report",
            "--tracking-uri",
            f"sqlite:///{store}",
            "--out",
            str(out),
            "--paired",
            "aggregator=fedavg",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    final = {
        (r.data.tags["aggregator"], r.data.params["seed"]): r.data.metrics["5_summary/final_test_accuracy"]
        for r in runs
    }
    diffs = [final[("fedsoftmax", seed)] - final[("fedavg", seed)] for seed in ("0", "1")]
    pairs = pd.read_csv(out / "paired.csv").set_index("aggregator")
    assert pairs.loc["fedsoftmax", "final_test_accuracy_diff"] == pytest.approx(np.mean(diffs))
    assert pairs.loc["fedsoftmax", "final_test_accuracy_ci95"] == pytest.approx(mean_ci(diffs)[1], nan_ok=True)
    assert (out / "paired.md").read_text().startswith("Paired by seed, against aggregator = fedavg")
    alone = subprocess.run(
        [
            report,
            "--experiment",
            "report",
            "--tracking-uri",
            f"sqlite:///{store}",
            "--out",
            str(tmp_path / "alone"),
            "--filter",
            "tags.aggregator = 'fedavg'",
            "--paired",
            "aggregator=fedavg",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert (
        "against aggregator = fedavg: every run is a baseline run, nothing to pair." in alone.stdout
    )  # a sweep's first part, say
    bad = subprocess.run(
        [report, "--experiment", "report", "--tracking-uri", f"sqlite:///{store}", "--paired", "seed=0"],
        capture_output=True,
        text=True,
    )
    assert (
        bad.returncode != 0
        and "--paired 'seed=0': KEY=BASELINE with KEY one of the table's keys (aggregator)" in bad.stderr
    )
    unknown = subprocess.run(
        [report, "--experiment", "report", "--tracking-uri", f"sqlite:///{store}", "--metrics", "acc/slow"],
        capture_output=True,
        text=True,
    )
    assert unknown.returncode != 0 and "metric 'acc/slow' was not logged by these runs (logged: " in unknown.stderr
    versus = subprocess.run(
        [report, "--experiment", "report", "--tracking-uri", f"sqlite:///{store}", "--versus", "seed"],
        capture_output=True,
        text=True,
    )
    assert versus.returncode != 0 and "--versus 'seed': one of the table's config keys (none)" in versus.stderr
    missing = subprocess.run(
        [report, "--experiment", "nope", "--tracking-uri", f"sqlite:///{store}"], capture_output=True, text=True
    )
    assert missing.returncode != 0 and "no experiment 'nope'" in missing.stderr


def test_a_store_with_the_old_metric_names_reports_with_the_new_and_a_study_groups_by_trial(store, tmp_path):
    """Runs stored before the main metrics moved to MLflow's first sections (``test_accuracy``, ``R60``) and runs
    after (``0_main/test_accuracy``, ``1_r_index/R60``) make one table; a study's trial runs are left out."""
    import mlflow
    from mlflow.entities import Metric, RunTag

    from fedrun.report import history, main

    uri = f"sqlite:///{store}"
    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("renamed")
    r60 = [3.0, 5.0, 4.0, 6.0]  # seeds 0, 1 with the old names, 2, 3 with the new: mean 4.5
    for seed, value in enumerate(r60):
        curves, r_index = ("", "") if seed < 2 else ("0_main/", "1_r_index/")
        tags = {"aggregator": "fedavg", "seed": str(seed), "fedrun.trial": str(seed % 2)}
        run = client.create_run(experiment, tags=tags)
        curve = [Metric(curves + "test_accuracy", 0.5 + 0.1 * step, 0, step) for step in (1, 2, 3)]
        summary = [Metric(r_index + "R60", value, 0, 0), Metric("final_test_accuracy", 0.8 + 0.01 * seed, 0, 0)]
        client.log_batch(run.info.run_id, metrics=curve + summary)
        client.set_terminated(run.info.run_id, "FINISHED")
    trial = client.create_run(experiment, tags={"fedrun.role": "trial", "aggregator": "fedavg"})
    client.log_batch(trial.info.run_id, metrics=[Metric("objective", 4.5, 0, 0)], tags=[RunTag("seed", "9")])
    client.set_terminated(trial.info.run_id, "FINISHED")
    main(["--experiment", "renamed", "--tracking-uri", uri, "--out", str(tmp_path / "all")])
    [row] = pd.read_csv(tmp_path / "all" / "report.csv").to_dict("records")
    assert row["runs"] == 4  # the trial run is not one
    assert row["R60_mean"] == pytest.approx(4.5) and row["R60_reached"] == 4
    assert row["final_test_accuracy_mean"] == pytest.approx(0.815)
    seeds = [r.info.run_id for r in client.search_runs([experiment]) if "fedrun.role" not in r.data.tags]
    for run_id in seeds:  # the curves, under either name (accuracy.png)
        assert [m.value for m in history(client, run_id, "test_accuracy")] == pytest.approx([0.6, 0.7, 0.8])
    main(["--experiment", "renamed", "--tracking-uri", uri, "--group-by", "trial", "--out", str(tmp_path / "trials")])
    table = pd.read_csv(tmp_path / "trials" / "report.csv")
    assert table["runs"].tolist() == [2, 2]
    assert table["R60_mean"].tolist() == pytest.approx([3.5, 5.5])  # trial 0: seeds 0 and 2; trial 1: seeds 1 and 3


def test_report_csv_escapes_cells_a_spreadsheet_would_run_and_keeps_numbers_numbers(store, tmp_path):
    """OWASP's CSV-injection rule: a text cell starting with = + - @ gets a leading ', a number (-0.5) does not."""
    import csv

    import mlflow
    from mlflow.entities import Metric, Param

    from fedrun.report import main

    uri = f"sqlite:///{store}"
    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("formulas")
    notes = {'=HYPERLINK("http://x","y")': "-0.5", "@SUM(A1)": "-1e-3", "-2+3": "+2", "+cmd": "0.5", "plain": "1"}
    for note, temperature in notes.items():
        run = client.create_run(experiment, tags={"aggregator": "fedsoftmax", "seed": "0"})
        params = [Param("aggregator.note", note), Param("aggregator.temperature", temperature), Param("seed", "0")]
        metrics = [Metric("0_main/test_accuracy", -0.25, 0, 1), Metric("final_test_accuracy", -0.25, 0, 0)]
        client.log_batch(run.info.run_id, metrics=metrics, params=params)
        client.set_terminated(run.info.run_id, "FINISHED")
    main(["--experiment", "formulas", "--tracking-uri", uri, "--out", str(tmp_path)])
    with (tmp_path / "report.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    cells = {(row["aggregator.note"], row["aggregator.temperature"]) for row in rows}
    assert cells == {
        ('\'=HYPERLINK("http://x","y")', "-0.5"),
        ("'@SUM(A1)", "-1e-3"),
        ("'-2+3", "+2"),
        ("'+cmd", "0.5"),
        ("plain", "1"),
    }
    assert {row["final_test_accuracy_mean"] for row in rows} == {"-0.25"}  # a number column is written as it was


@pytest.mark.slow
@pytest.mark.e2e
def test_fairness_report_on_real_runs_judges_every_client_on_its_tail(fedrun, store, tmp_path):
    from fedrun import report as fedrun_report
    from fedrun.tracking import open_client

    fedrun(
        "-m",
        "aggregator=fedavg,qffl",
        "seed=0,1",
        "schedule.rounds=4",
        "schedule.tail=2",
        "partition.num_clients=6",
        "dataset.client_test_fraction=0.3",
        experiment="fair",
    )
    out = tmp_path / "fair"
    report = str(Path(sys.executable).parent / "fedrun-report")
    uri = f"sqlite:///{store}"
    done = subprocess.run(
        [report, "--experiment", "fair", "--tracking-uri", uri, "--out", str(out), "--fairness"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    table = pd.read_csv(out / "report.csv").set_index("aggregator")
    _, runs = mlflow_runs(store, "fair")
    for aggregator in ("fedavg", "qffl"):
        logged = [
            r.data.metrics["5_summary/tail_fairness_worst10"] for r in runs if r.data.tags["aggregator"] == aggregator
        ]
        assert table.loc[aggregator, "tail_fairness_worst10_mean"] == pytest.approx(np.mean(logged))
    for column in [c for c in table.columns if c.startswith("tail_fairness_") and c.endswith(("_lo", "_hi"))]:
        top = 0.25 if "variance" in column else 1.0
        assert table[column].between(0.0, top).all(), column  # every interval within the measure's range
    assert (out / "fairness_distribution.png").stat().st_size > 10_000
    assert (out / "fairness_frontier.png").stat().st_size > 10_000
    # The path for runs logged before a measure existed (from personal_accuracy.csv) gives the runs' own numbers.
    client = open_client(uri)
    frame = fedrun_report.with_plain_names(
        fedrun_report.search_runs(uri, fedrun_report.find_experiment(client, "fair"))
    )
    frame = frame[(frame["status"] == "FINISHED") & frame[fedrun_report.SWEEP_TAG].isna()]  # the jobs, not the sweep
    wiped = frame.assign(**{f"metrics.tail_fairness_{s}": np.nan for s in ("worst10", "jain", "variance")})
    filled = fedrun_report.with_fairness_tails(wiped, fedrun_report.client_tables(client, frame))
    for s in ("worst10", "jain", "variance"):
        np.testing.assert_allclose(
            filled[f"metrics.tail_fairness_{s}"], frame[f"metrics.tail_fairness_{s}"], rtol=1e-12
        )
    # Runs without client test splits: one line.
    fedrun("aggregator=fedavg", "schedule.rounds=2", "partition.num_clients=4", experiment="unfair")
    bad = subprocess.run(
        [report, "--experiment", "unfair", "--tracking-uri", uri, "--fairness"], capture_output=True, text=True
    )
    assert bad.returncode != 0 and "--fairness: no run of 'unfair' judged its clients" in bad.stderr


def test_per_time_plots_accuracy_against_the_virtual_clock_logged_under_its_mlflow_name(store, tmp_path, monkeypatch):
    """``--per-time`` through ``fedrun-report``'s main on a hand-made store: accuracy indexed by the groups' mean
    ``virtual_time`` (read under the name fedrun logs it by), a group without a clock drawn with no line."""
    import mlflow
    from mlflow.entities import Metric

    from fedrun import report
    from fedrun.tracking import mlflow_name

    uri = f"sqlite:///{store}"
    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("clock")
    clocks = {"0": [10.0, 30.0], "1": [20.0, 50.0]}  # FedBuff's two seeds: the clock at rounds 1 and 2
    for aggregator, seed in (("fedbuff", "0"), ("fedbuff", "1"), ("fedavg", "0")):
        run = client.create_run(experiment, tags={"aggregator": aggregator, "seed": seed})
        points = [Metric(mlflow_name("test_accuracy"), 0.5 + 0.1 * step + 0.05 * int(seed), 0, step) for step in (1, 2)]
        if aggregator == "fedbuff":
            points += [Metric(mlflow_name("virtual_time"), clocks[seed][step - 1], 0, step) for step in (1, 2)]
        client.log_batch(run.info.run_id, metrics=[*points, Metric("final_test_accuracy", 0.7, 0, 0)])
        client.set_terminated(run.info.run_id, "FINISHED")
    drawn, plot_bands = {}, report.plot_bands

    def spy(frames, path, *args, **kwargs):
        drawn[Path(path).name] = frames
        return plot_bands(frames, path, *args, **kwargs)

    monkeypatch.setattr(report, "plot_bands", spy)
    report.main(["--experiment", "clock", "--tracking-uri", uri, "--out", str(tmp_path), "--per-time"])
    assert (tmp_path / "accuracy_vs_virtual_time.png").stat().st_size > 10_000
    frames = drawn["accuracy_vs_virtual_time.png"]
    fedbuff, fedavg = frames["aggregator=fedbuff"], frames["aggregator=fedavg"]  # the groups' legend names
    assert fedbuff.index.tolist() == [15.0, 40.0]  # the two seeds' mean clock at rounds 1 and 2
    assert np.sort(fedbuff.to_numpy(), axis=1).ravel().tolist() == pytest.approx(
        [0.6, 0.65, 0.7, 0.75]
    )  # a row a round
    assert fedavg.empty  # no devices, no clock: no line
