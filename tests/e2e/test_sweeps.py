"""Sweeps on every core: the joblib launcher, threads per job, one SQLite store shared by parallel jobs."""

import os
import subprocess

import pytest
from conftest import FEDRUN, mlflow_runs, sweep_runs

from fedrun.backends import usable_cores

pytestmark = pytest.mark.e2e


@pytest.mark.slow
def test_a_four_job_joblib_sweep_logs_four_runs_into_one_new_sqlite_store(tmp_path):
    store = tmp_path / "fresh.db"  # new: the jobs would race to create its tables and the experiment
    done = subprocess.run(
        [
            FEDRUN,
            "-m",
            "hydra/launcher=joblib",
            "hydra.launcher.n_jobs=2",
            "seed=0,1,2,3",
            "schedule.rounds=4",
            "partition.num_clients=5",
            f"tracking.uri=sqlite:///{store}",
            "tracking.experiment=joblib",
            "device=cpu",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "HYDRA_FULL_ERROR": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "database is locked" not in done.stderr
    _, runs = mlflow_runs(store, "joblib")
    assert sorted(r.data.tags["seed"] for r in runs) == ["0", "1", "2", "3"]
    assert all(r.info.status == "FINISHED" for r in runs)
    _, [parent] = sweep_runs(store, "joblib")  # the sweep is one parent run, its jobs the children
    assert {r.data.tags["mlflow.parentRunId"] for r in runs} == {parent.info.run_id}
    assert (
        parent.info.status == "FINISHED"
        and parent.data.metrics["jobs_finished"] == 4
        and parent.data.metrics["jobs_failed"] == 0
    )
    assert parent.info.run_name == "sweep seed=0,1,2,3 schedule.rounds=4 partition.num_clients=5 device=cpu"
    assert {r.data.tags["torch_threads"] for r in runs} == {
        str(max(1, usable_cores() // 2))
    }  # cores / jobs: no oversubscription


@pytest.mark.slow
def test_device_threads_overrides_the_share_and_is_recorded(fedrun, store):
    fedrun("device.threads=1", "schedule.rounds=1", "partition.num_clients=5", experiment="threads")
    _, [run] = mlflow_runs(store, "threads")
    assert run.data.tags["torch_threads"] == "1" and run.data.params["device.threads"] == "1"


@pytest.mark.slow
def test_runs_have_short_names_the_overrides_as_a_tag_and_a_model_training_experiment(fedrun, store):
    done = fedrun(
        "aggregator=fedsoftmax",
        "aggregator.temperature=0.5",
        "partition=shards",
        "schedule.rounds=1",
        "partition.num_clients=5",
        "seed=3",
        experiment="names",
    )
    client, [run] = mlflow_runs(store, "names")
    # the run's page, opened on MLflow 3's model-training view (its default is the GenAI one)
    assert (
        f"/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}/model-metrics?workflowType=machine_learning"
        in done.stderr
    )
    assert run.info.run_name == "fedsoftmax shards digits temperature=0.5 rounds=1 num_clients=5 seed=3"
    assert run.data.tags["overrides"] == (
        "aggregator.temperature=0.5,aggregator=fedsoftmax,device=cpu,partition.num_clients=5,"
        "partition=shards,schedule.rounds=1,seed=3"
    )
    assert client.get_experiment_by_name("names").tags["mlflow.experimentKind"] == "custom_model_development"
    description = run.data.tags["mlflow.note.content"]  # the run's description in the UI says what it was
    assert description.startswith("**fedsoftmax** on **digits** (standardised), partition **shards**, seed 3")
    assert (
        "- aggregator: `fedsoftmax` temperature=0.5" in description and "- schedule: `default` rounds=1," in description
    )
