"""The tracker's files: wide and long per-client series, columns that appear mid-run; how a batch is split for
MLflow (no MLflow store here: a client that records its calls)."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import fedrun.tracking as tracking
from fedrun.tracking import Tracker, widest


def test_wide_per_client_files_have_a_column_per_client(tmp_path):
    tracker = Tracker(tmp_path, 3, False, "", "x")
    tracker.log_round({"round": 1, "test_accuracy": 0.5, "round_wall_s": 1.0}, {"alpha": np.array([0.25, 0.0, 0.75])})
    tracker.log_round({"round": 2, "test_accuracy": 0.6, "round_wall_s": 1.0}, {"alpha": np.array([0.0, 1.0, 0.0])})
    alpha = pd.read_csv(tmp_path / "alpha.csv")
    assert list(alpha.columns) == ["round", "client_0", "client_1", "client_2"]
    assert alpha.to_numpy().tolist() == [[1, 0.25, 0.0, 0.75], [2, 0.0, 1.0, 0.0]]


def test_long_per_client_files_keep_only_the_round_s_clients_and_the_heatmap_shows_the_heaviest(tmp_path, monkeypatch):
    monkeypatch.setattr(tracking, "WIDE_CLIENTS", 2)
    monkeypatch.setattr(tracking, "HEATMAP_CLIENTS", 2)
    tracker = Tracker(tmp_path, 5, False, "", "x")
    tracker.log_round(
        {"round": 1, "test_accuracy": 0.5, "test_loss": 1.0, "round_wall_s": 1.0},
        {"alpha": np.array([0.0, 0.25, 0.0, 0.75, 0.0]), "local_steps": np.array([0, 4, 0, 6, 0])},
    )
    tracker.log_round(
        {"round": 2, "test_accuracy": 0.6, "test_loss": 0.9, "round_wall_s": 1.0},
        {"alpha": np.array([0.5, 0.0, 0.0, 0.0, 0.5]), "local_steps": np.array([5, 0, 0, 0, 5])},
    )
    alpha = pd.read_csv(tmp_path / "alpha.csv")
    assert list(alpha.columns) == ["round", "client", "alpha"]
    assert alpha.to_numpy().tolist() == [[1, 1, 0.25], [1, 3, 0.75], [2, 0, 0.5], [2, 4, 0.5]]
    assert pd.read_csv(tmp_path / "local_steps.csv").to_numpy().tolist() == [[1, 1, 4], [1, 3, 6], [2, 0, 5], [2, 4, 5]]
    # Totals: client 3 0.75, clients 0 and 4 0.5 (tie: the first by id), client 1 0.25 -> clients 0 and 3 shown.
    wide = widest(alpha, "alpha", 2)
    assert list(wide.columns) == ["round", "client_0", "client_3"]
    assert wide.to_numpy().tolist() == [[1, 0.0, 0.75], [2, 0.5, 0.0]]
    tracker.finish("FINISHED", title="long")
    assert (tmp_path / "alpha_heatmap.png").stat().st_size > 0


def test_a_column_that_appears_mid_run_rewrites_the_file_with_every_earlier_row(tmp_path):
    tracker = Tracker(tmp_path, 1, False, "", "x")
    tracker.log_round({"round": 1, "loss": 0.5}, {"alpha": np.array([1.0])})
    tracker.log_round({"round": 2, "loss": 0.4, "phase": 1.0}, {"alpha": np.array([1.0])})
    tracker.log_round({"round": 3, "loss": 0.3, "phase": 2.0}, {"alpha": np.array([1.0])})
    metrics = pd.read_csv(tmp_path / "metrics.csv")
    assert list(metrics.columns) == ["round", "loss", "phase"]
    assert metrics["loss"].tolist() == [0.5, 0.4, 0.3] and metrics["phase"].fillna(-1).tolist() == [-1, 1.0, 2.0]


class RecordingClient:
    """Stands in for an MLflow client: keeps each log_batch call's entities."""

    def __init__(self):
        self.calls = []

    def log_batch(self, run_id, metrics=(), params=(), tags=()):
        self.calls.append((run_id, list(metrics), list(params), list(tags)))


def test_a_batch_is_split_at_mlflow_s_limits_and_a_small_one_is_one_call():
    client = RecordingClient()
    tracking.log_batch(client, "r", metrics=[("m", 0.5, 3)], params={"lr": 0.1}.items(), tags=[("t", "x")])
    [(run_id, metrics, params, tags)] = client.calls
    assert run_id == "r" and [(m.key, m.value, m.step) for m in metrics] == [("m", 0.5, 3)]
    assert [(p.key, p.value) for p in params] == [("lr", "0.1")] and [(t.key, t.value) for t in tags] == [("t", "x")]

    client = RecordingClient()
    tracking.log_batch(client, "r", params=[(f"p{i}", i) for i in range(250)])
    assert [len(params) for _, _, params, _ in client.calls] == [100, 100, 50]

    # 1200 metrics and 3 tags: the first call holds the tags and 997 metrics (1000 entities), the second the rest
    client = RecordingClient()
    tracking.log_batch(
        client, "r", metrics=[("m", float(i), i) for i in range(1200)], tags=[("a", "1"), ("b", "2"), ("c", "3")]
    )
    assert [(len(metrics), len(tags)) for _, metrics, _, tags in client.calls] == [(997, 3), (203, 0)]
    steps = [m.step for _, metrics, _, _ in client.calls for m in metrics]
    assert steps == list(range(1200))
    assert len({m.timestamp for _, metrics, _, _ in client.calls for m in metrics}) == 1

    client = RecordingClient()
    tracking.log_batch(client, "r")
    assert client.calls == []


def test_each_metric_has_the_mlflow_section_a_reader_looks_for_it_in_and_the_plain_name_comes_back():
    from fedrun.cli.runinfo import run_name
    from fedrun.tracking import mlflow_name, plain_name, stored_names

    per_round = {
        "test_accuracy": "0_main/test_accuracy",
        "R90": "1_r_index/R90",
        "epsilon": "0_main/epsilon",  # a headline: first on the page (HEADLINE)
        "noise_std": "2_privacy/noise_std",
        "topk/bits_per_coordinate": "2_compression/topk/bits_per_coordinate",
        "selection_p_cv": "2_selection/selection_p_cv",
        "attack/weight_share": "2_attack/weight_share",
        "robust/discarded": "2_robust/discarded",
        "personal/accuracy_min": "0_main/personal_accuracy_min",
        "personal/accuracy_p10": "2_personal/accuracy_p10",
        "upload_mb": "3_communication/upload_mb",
        "train_wall_s": "4_timing/train_wall_s",
        "lr": "lr",
        "alpha_distance": "alpha_distance",
    }
    summary = {
        "final_test_accuracy": "5_summary/final_test_accuracy",
        "final_epsilon": "5_summary/final_epsilon",
        "total_wall_s": "5_summary/total_wall_s",
        "attack/weight_share_mean": "5_summary/attack/weight_share_mean",
        "personal/final_accuracy_min": "5_summary/personal/final_accuracy_min",
        "R90": "1_r_index/R90",
        "selection_cv": "2_selection/selection_cv",
    }
    for names, is_summary in ((per_round, False), (summary, True)):
        for plain, shown in names.items():
            assert mlflow_name(plain, summary=is_summary) == shown
            assert plain_name(shown) == plain
    # a run stored before the headlines had them in their feature's section: read back under the same plain name
    assert (
        plain_name("2_privacy/epsilon") == "epsilon"
        and plain_name("2_personal/accuracy_min") == "personal/accuracy_min"
    )
    assert stored_names("epsilon") == ["0_main/epsilon", "2_privacy/epsilon", "epsilon"]
    assert stored_names("test_accuracy") == ["0_main/test_accuracy", "test_accuracy"]
    choices = {"aggregator": "fedavg", "partition": "iid", "dataset": "digits", "privacy": "central"}
    choices |= {"compression": "none", "sampler": "uniform", "engine": "sync"}
    overrides = ["privacy=central", "privacy.noise_multiplier=0.8", "device.threads=1", "tracking.experiment=x"]
    assert run_name(choices, overrides, 0) == "fedavg iid digits central noise_multiplier=0.8 seed=0"
    # in a sweep, what it varies and the seed lead (the rest keeps its order; a preset given is said last)
    swept = ["experiment=fedprox", *overrides, "seed=4"]
    assert run_name(choices, swept, 4, frozenset({"privacy.noise_multiplier", "seed"})) == (
        "noise_multiplier=0.8 seed=4 fedavg iid digits central fedprox"
    )
    assert run_name(choices, swept, 4, frozenset({"seed"})).startswith("seed=4 fedavg iid")


def test_swept_keys_are_the_command_lines_lists_and_the_sweepers_params(tmp_path):
    from fedrun.cli.runinfo import swept_keys

    task = ["aggregator=fedavg,fedsoftmax", "seed=range(3)", "schedule.rounds=4", "aggregator.temperature=0.5"]
    (tmp_path / "multirun.yaml").write_text(f"hydra:\n  overrides:\n    task: {task}\n")
    assert swept_keys(tmp_path, None) == {"aggregator", "seed"}
    assert swept_keys(tmp_path, {"aggregator.temperature": "interval(0.1, 2)"}) == {
        "aggregator", "seed", "aggregator.temperature"
    }  # fmt: skip
    (tmp_path / "multirun.yaml").write_text("!!python/object:os.system [echo]\n")  # read as plain YAML: refused
    assert swept_keys(tmp_path, None) == frozenset()


def test_a_long_dense_series_keeps_every_client_and_reads_back_as_the_wide_one(tmp_path, monkeypatch):
    # personal_accuracy's zeros are values (a client judged at 0%) and its NaN a client without test samples: the
    # long layout keeps a row for each, and per_client_table reads it back as the wide layout's table.
    accuracy = [np.array([0.0, 0.5, np.nan, 1.0]), np.array([0.25, 0.0, np.nan, 0.0])]
    alpha = [np.array([0.0, 0.5, 0.5, 0.0]), np.array([1.0, 0.0, 0.0, 0.0])]
    tables = {}
    for layout, wide_clients in (("wide", 1000), ("long", 2)):
        monkeypatch.setattr(tracking, "WIDE_CLIENTS", wide_clients)
        out = tmp_path / layout
        out.mkdir()
        tracker = Tracker(out, 4, False, "", "x")
        for t in (1, 2):
            series = {"alpha": alpha[t - 1], "personal_accuracy": accuracy[t - 1]}
            tracker.log_round({"round": t, "test_accuracy": 0.5, "round_wall_s": 1.0}, series)
        tables[layout] = {
            name: tracking.per_client_table(out / f"{name}.csv") for name in ("alpha", "personal_accuracy")
        }
    long = pd.read_csv(tmp_path / "long" / "personal_accuracy.csv")
    assert long["client"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]  # zeros and NaN included
    assert len(pd.read_csv(tmp_path / "long" / "alpha.csv")) == 3  # alpha's zeros are not in the round: left out
    wide_accuracy = tables["wide"]["personal_accuracy"]
    assert list(wide_accuracy.columns) == ["client_0", "client_1", "client_2", "client_3"]
    np.testing.assert_array_equal(wide_accuracy.to_numpy(), np.array(accuracy))
    pd.testing.assert_frame_equal(tables["long"]["personal_accuracy"], wide_accuracy, check_dtype=False)
    # A long sparse file has columns for the clients it names (client 3 never had a weight), 0 where absent.
    np.testing.assert_array_equal(tables["long"]["alpha"].to_numpy(), np.array(alpha)[:, :3])


def test_a_stores_file_or_folder_is_read_one_way_by_tracking_resume_and_the_ui(tmp_path):
    from fedrun.cli.resume import existing_store
    from fedrun.mlstore import local_store
    from fedrun.tracking import resolve_uri
    from fedrun.ui import local_folder, store_uri

    assert local_store("sqlite:///outputs/mlflow.db", tmp_path) == tmp_path / "outputs" / "mlflow.db"
    assert local_store("sqlite:////abs/m.db", tmp_path) == Path("/abs/m.db")
    assert local_store("file:runs", tmp_path) == local_store("file://runs", tmp_path) == tmp_path / "runs"
    assert local_store("runs", tmp_path) == tmp_path / "runs"  # a plain path: MLflow's folder store
    assert local_store("http://host:5000", tmp_path) is None and local_store("postgresql://u@h/db", tmp_path) is None
    # The three readers agree on the same store: a SQLite file relative to the folder fedrun started in.
    uri = resolve_uri("sqlite:///outputs/mlflow.db", tmp_path)  # creates the folder, not the file
    assert uri == f"sqlite:///{tmp_path.resolve()}/outputs/mlflow.db"
    assert existing_store("sqlite:///outputs/mlflow.db", tmp_path) is None  # no file yet: nothing to resume into
    (tmp_path / "outputs" / "mlflow.db").touch()
    assert existing_store("sqlite:///outputs/mlflow.db", tmp_path) == uri == store_uri("outputs/mlflow.db", tmp_path)
    assert local_folder(uri) == (tmp_path / "outputs").resolve() and local_folder("http://h:1") is None
    assert existing_store("file:runs", tmp_path) is None and existing_store("http://h:1", tmp_path) == "http://h:1"
    (tmp_path / "runs").mkdir()
    assert store_uri("file:runs", tmp_path) == (tmp_path / "runs").resolve().as_uri()


UI_SIGNALS = """
import signal
from fedrun.ui import catch_stops
catch_stops()
blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, signal.SIGINT in blocked,
      callable(signal.getsignal(signal.SIGTERM)), signal.getsignal(signal.SIGHUP) == signal.SIG_IGN)
"""


@pytest.mark.parametrize("nohup", [False, True])
def test_the_ui_catches_ctrl_c_inherited_ignored_and_blocked_and_keeps_nohup(nohup):
    # A command started in the background of a script inherits SIGINT ignored (a test runner started so passes it on
    # to the UI it starts, which then outlived Ctrl-C); nohup ignores SIGHUP on purpose.
    import signal
    import subprocess
    import sys

    def inherited():  # SIGHUP set either way: the test itself may run under nohup
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN if nohup else signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    done = subprocess.run([sys.executable, "-c", UI_SIGNALS], capture_output=True, text=True, preexec_fn=inherited)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False", "True", str(nohup)]


def test_a_reopened_run_logs_each_round_mlflow_already_holds_once_and_the_rest_as_usual(tmp_path):
    """A run killed after logging a round and before checkpointing it measures the round again on resume: MLflow
    keeps the first logging of it (one point a step), the files are rewritten, the rounds after it are logged. A
    round whose batch was cut between MLflow's chunks (its first metric held, its last not) is logged again."""
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    def row(round_, accuracy):
        return {"round": round_, "test_accuracy": accuracy, "round_wall_s": 0.5}

    first = Tracker(tmp_path / "run", 2, True, uri, "x")
    first.start({}, {}, "run")
    for t, accuracy in ((1, 0.1), (2, 0.2), (3, 0.3)):
        first.log_round(row(t, accuracy), {"alpha": np.array([0.5, 0.5])})
    first.flush()  # as its checkpoint of round 3 would have
    mlflow.log_metric(tracking.mlflow_name("test_accuracy"), 0.4, step=4)  # round 4 cut after its first metric
    mlflow.end_run("KILLED")
    again = Tracker(tmp_path / "run", 2, True, uri, "x")
    again.rewind(1)  # the checkpoint was of round 1
    again.start({}, {}, "", run_id=first.run_id)
    for t, accuracy in ((2, 0.21), (3, 0.31), (4, 0.41), (5, 0.51)):  # other values, to tell the loggings apart
        again.log_round(row(t, accuracy), {"alpha": np.array([0.5, 0.5])})
    again.flush()
    mlflow.end_run()
    client = mlflow.MlflowClient(uri)
    history = {
        name: [(m.step, m.value) for m in sorted(client.get_metric_history(first.run_id, name), key=lambda m: m.step)]
        for name in (tracking.mlflow_name("test_accuracy"), tracking.mlflow_name("round_wall_s"))
    }
    accuracy, wall = history.values()
    assert accuracy == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4), (4, 0.41), (5, 0.51)]
    assert [step for step, _ in wall] == [1, 2, 3, 4, 5]
    assert pd.read_csv(tmp_path / "run" / "metrics.csv")["test_accuracy"].tolist() == [0.1, 0.21, 0.31, 0.41, 0.51]


def test_rounds_go_to_mlflow_together_at_a_checkpoint_and_at_the_end_each_with_its_own_time(tmp_path, monkeypatch):
    """One MLflow call (a commit) for the rounds of up to ``FLUSH_S``: none is sent before, a checkpoint's save sends
    those measured so far (a resume from it measures none of them again), the run's end sends the rest."""
    import time

    import mlflow

    from fedrun.checkpoint import Checkpoint

    monkeypatch.setattr(tracking, "FLUSH_S", 3600.0)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker, checkpoint = Tracker(tmp_path / "run", 2, True, uri, "x"), Checkpoint(tmp_path / "run", every=2)
    checkpoint.before_save.append(tracker.flush)
    tracker.start({}, {}, "run")
    client, name = mlflow.MlflowClient(uri), tracking.mlflow_name("test_accuracy")

    def steps():
        return [(m.step, m.timestamp) for m in client.get_metric_history(tracker.run_id, name)]

    for t in (1, 2, 3):
        tracker.log_round({"round": t, "test_accuracy": t / 10}, {"alpha": np.array([0.5, 0.5])})
        time.sleep(0.01)  # each round its own millisecond
        if t == 2:
            assert steps() == []  # measured, not sent
            checkpoint.save({"round": 2})
            sent = steps()
            assert [s for s, _ in sent] == [1, 2] and sent[0][1] < sent[1][1]
    tracker.finish("FINISHED")
    assert [s for s, _ in steps()] == [1, 2, 3] and steps()[:2] == sent
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
