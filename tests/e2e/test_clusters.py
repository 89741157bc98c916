"""Sweeps on clusters through Hydra's launchers. submitit: submitit_local runs each job as its own process, as a
SLURM array task would; a job at its time limit checkpoints, is requeued by submitit and resumes. Ray: a sweep
on a local Ray head started by the test."""

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import pytest
from conftest import FEDRUN, mlflow_runs, sweep_runs

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
submitit = pytest.importorskip("submitit")  # the [slurm] extra (in [dev])
RAY = str(Path(sys.executable).parent / "ray")


def sweep(tmp_path, store, experiment, *args, options=(), env=None):
    launcher = [] if any(a.startswith("hydra/launcher=") for a in args) else ["hydra/launcher=submitit_local"]
    return subprocess.run(
        [
            FEDRUN,
            *options,  # fedrun's own flags, before the overrides
            "-m",
            *launcher,
            *args,
            "partition.num_clients=5",
            "device=cpu",
            f"tracking.uri=sqlite:///{store}",
            f"tracking.experiment={experiment}",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
    )


def deterministic(job: Path) -> pd.DataFrame:
    metrics = pd.read_csv(job / "metrics.csv")
    return metrics[[c for c in metrics.columns if not c.endswith("_wall_s")]]


def test_a_submitit_local_sweep_runs_each_job_in_its_own_process(tmp_path, store):
    done = sweep(tmp_path, store, "submitit", "seed=0,1", "schedule.rounds=2")
    assert done.returncode == 0, done.stderr[-3000:]
    _, runs = mlflow_runs(store, "submitit")
    _, [parent] = sweep_runs(store, "submitit")
    assert sorted(r.data.tags["seed"] for r in runs) == ["0", "1"] and all(r.info.status == "FINISHED" for r in runs)
    assert {r.data.tags["mlflow.parentRunId"] for r in runs} == {
        parent.info.run_id
    } and parent.info.status == "FINISHED"
    logs = sorted((tmp_path / "sweep" / ".submitit").glob("*/*_log.out"))
    assert len(logs) == 2  # one submitit job (its own process and log) per sweep job
    for job in ("0", "1"):
        assert len(pd.read_csv(tmp_path / "sweep" / job / "metrics.csv")) == 2


# The job is paced (tests/e2e/scripts/paced_program.py: a second's sleep before each of its 5 clients trains, on the
# loop): 8 rounds last 40 s and more on any machine, past the first leg's 30 s with start-up and short of a third
# leg, mostly asleep. The uninterrupted run is unpaced: pacing changes no number, which the equality also shows.
ROUNDS, SCRIPTS = 8, Path(__file__).parent / "scripts"


def test_a_job_at_its_time_limit_checkpoints_is_requeued_and_resumes_to_the_uninterrupted_result(tmp_path, store):
    # submitit_local sends SIGUSR2 30 s before timeout_min (1 minute; neither a fraction of a minute nor another
    # delay passes submitit's AutoExecutor), as SLURM does signal_delay_s before a job's limit: the job stops after
    # its round with a checkpoint, submitit requeues it, the new process resumes from the checkpoint in the same job
    # dir and the same MLflow run. submitit_local_requeue: submitit_local with max_num_timeout 30, not submitit's 3.
    run = [f"schedule.rounds={ROUNDS}", "schedule.eval_every=2", "seed=0", "device.backend=loop", "device.threads=1"]
    limit = ["hydra/launcher=submitit_local_requeue", "hydra.launcher.timeout_min=1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SCRIPTS), os.environ.get("PYTHONPATH")]))}
    paced = {"options": ["--config-dir", str(SCRIPTS / "conf")], "env": env}  # client=paced: the tests' own
    done = sweep(tmp_path, store, "time_limit", *limit, "client=paced", *run, **paced)
    assert done.returncode == 0, done.stderr[-3000:]
    [log] = (tmp_path / "sweep" / ".submitit").glob("*/*_0_log.err")
    text = log.read_text()
    assert "stopped by SIGUSR2 after round" in text and "handing the job to submitit to requeue" in text
    assert f"fedrun: resuming {tmp_path / 'sweep' / '0'} after round" in text
    whole = subprocess.run(
        [
            FEDRUN,
            *run,
            "partition.num_clients=5",
            "device=cpu",
            "tracking.enabled=false",
            f"hydra.run.dir={tmp_path / 'whole'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert whole.returncode == 0, whole.stderr[-3000:]
    pd.testing.assert_frame_equal(deterministic(tmp_path / "sweep" / "0"), deterministic(tmp_path / "whole"))
    client, [job] = mlflow_runs(store, "time_limit")  # one run, reopened by the requeued job: no duplicate
    assert job.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(job.info.run_id, "0_main/test_accuracy")] == list(
        range(2, ROUNDS + 1, 2)
    )


def test_the_slurm_presets_are_accepted_by_submitit():
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    for preset, gpus in (("slurm", 1), ("slurm_cpu", None)):
        with initialize_config_module(config_module="fedrun.conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=[f"hydra/launcher={preset}"], return_hydra_config=True)
        launcher = OmegaConf.to_container(cfg.hydra.launcher)
        assert (
            launcher["_target_"].endswith("SlurmLauncher")
            and launcher["gpus_per_node"] == gpus
            and launcher["signal_delay_s"] == 120
        )
        # What the launcher hands SLURM, as hydra-submitit-launcher and submitit's AutoExecutor rename it; an
        # unknown key raises TypeError here, as it would on the cluster.
        renamed = {"timeout_min": "time", "tasks_per_node": "ntasks_per_node", "name": "job_name"}
        params = {
            renamed.get(k, k): v
            for k, v in launcher.items()
            if k not in ("_target_", "submitit_folder", "max_num_timeout", "mem_gb") and v is not None
        }
        from submitit.slurm.slurm import _make_sbatch_string

        text = _make_sbatch_string(
            "fedrun", "/tmp/fedrun-submitit-preset-check", mem=f"{launcher['mem_gb']}GB", **params
        )
        assert "#SBATCH --signal=USR2@120" in text and "#SBATCH --time=240" in text
        assert ("#SBATCH --gpus-per-node=1" in text) == (gpus == 1)


@pytest.fixture
def ray_head(tmp_path):
    """A local Ray head (2 CPUs, no dashboard) for the test's duration, in its own temp dir."""
    pytest.importorskip("ray", reason="the [ray] extra: pip install -e '.[dev,ray]' && pytest -m ray")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # Ray's socket paths must stay short
    started = subprocess.run(
        [RAY, "start", "--head", "--num-cpus=2", "--include-dashboard=false", f"--temp-dir={temp}", "--port=0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert started.returncode == 0, started.stderr[-3000:]
    address = re.search(r"--address='([^']+)'", started.stdout + started.stderr).group(1)
    yield address, env
    subprocess.run([RAY, "stop", "--force"], capture_output=True, env=env, timeout=120)
    shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.ray
def test_a_sweep_on_a_ray_cluster_runs_its_jobs_as_ray_tasks(tmp_path, store, ray_head):
    address, env = ray_head
    done = subprocess.run(
        [
            FEDRUN,
            "-m",
            "hydra/launcher=ray_cluster",
            f"hydra.launcher.ray.init.address={address}",
            "seed=0,1",
            "schedule.rounds=2",
            "partition.num_clients=5",
            "device=cpu",
            f"tracking.uri=sqlite:///{store}",
            "tracking.experiment=ray",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        "Connected to Ray cluster" in done.stdout + done.stderr
        and "Ray Launcher is launching 2 jobs" in done.stdout + done.stderr
    )
    _, runs = mlflow_runs(store, "ray")
    assert sorted(r.data.tags["seed"] for r in runs) == ["0", "1"] and all(r.info.status == "FINISHED" for r in runs)
    assert {r.data.tags["torch_threads"] for r in runs} == {
        "1"
    }  # ray.remote.num_cpus of the preset: no oversubscription
