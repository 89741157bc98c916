"""device.backend=distributed through the real command under the real torchrun (2 ranks, gloo on the CPU): the same
metrics.csv as the loop's, rank 0 alone writing; the refusals."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import FEDRUN, mlflow_runs, swept_once

pytestmark = pytest.mark.e2e

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
COMMON = ["device=cpu", "tracking.experiment=distributed"]
LOOP = ["device.threads=1"]  # the loop's thread count (torchrun's: its default, one thread per rank)
ROUNDS = "schedule.rounds=3"


def command(out, *args, ranks: int | None = None) -> list[str]:
    """The loop's command at one thread, or torchrun's at its default (one thread per rank, whatever the ranks)."""
    start = [FEDRUN] if ranks is None else [TORCHRUN, "--standalone", f"--nproc_per_node={ranks}", "-m", "fedrun"]
    backend = LOOP if ranks is None else ["device.backend=distributed"]
    return [*start, *backend, *COMMON, *args, f"hydra.run.dir={out}"]


def fedrun(cwd, out, *args, ranks: int | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(
        command(out, ROUNDS, *args, ranks=ranks),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def metrics(out: Path) -> pd.DataFrame:
    rows = pd.read_csv(out / "metrics.csv")
    return rows[[c for c in rows.columns if not c.endswith("wall_s")]]


CASES = {  # (overrides, ranks)
    # per-client losses gathered from both ranks; each client's residual follows it, whichever rank trains it
    "fedsoftmax_topk_error_feedback": (["aggregator=fedsoftmax", "compression=topk"], 2),
    "central_dp_client_tests": (  # the noise drawn once, the same on every rank; the global model on every client
        [
            "privacy=central",
            "aggregator.weighting=uniform",
            "schedule.sampling=poisson",
            "schedule.clients_per_round=0.5",
            "dataset.client_test_fraction=0.2",
        ],
        2,
    ),
    "fedbn_batch_norm_val": (  # the test and validation splits shared by the ranks; each client's own statistics
        [
            "model.norm=batch",
            "personalization=fedbn",
            "dataset.val_fraction=0.1",
            "dataset.client_test_fraction=0.2",
        ],
        2,
    ),
    "apfl_personal_updates": (["personalization=apfl", "dataset.client_test_fraction=0.2"], 2),  # two updates each
    "fedbuff_async": (["aggregator=fedbuff"], 2),  # the asynchronous engine: each instant's arrivals over the ranks
    # the fair rules: AFL's lambda ascended on the candidates' losses gathered from both ranks; q-FFL's step from
    # every update's norm, behind a server optimizer
    "afl_power_of_choice": (["aggregator=afl", "sampler=power_of_choice", "schedule.clients_per_round=0.5"], 2),
    "qffl_server_adam": (["aggregator=qffl", "server=adam"], 2),
    "population_power_of_choice_4_ranks": (  # a million clients drawn when they train; the candidates' loss pass
        ["partition=population", "schedule.cohort=10", "model=logistic", "sampler=power_of_choice"],
        4,
    ),
}


@pytest.fixture(scope="module")
def on_the_loop(tmp_path_factory, store):
    """case -> the run dir of its run on the loop: every case's, as one sweep in one process, on first use, on the
    worker that runs the cases (one xdist group)."""
    common = ["device.backend=loop", *LOOP, ROUNDS, *COMMON, f"tracking.uri=sqlite:///{store}"]
    return swept_once(tmp_path_factory, "on_the_loop", {c: overrides for c, (overrides, _) in CASES.items()}, *common)


@pytest.mark.slow
@pytest.mark.xdist_group("on_the_loop")
@pytest.mark.parametrize("case", list(CASES))
def test_two_or_four_ranks_give_the_loops_metrics(tmp_path, store, on_the_loop, case):
    overrides, ranks = [*CASES[case][0], f"tracking.uri=sqlite:///{store}"], CASES[case][1]  # the worker's store
    fedrun(tmp_path, tmp_path / "ranks", *overrides, ranks=ranks)
    pd.testing.assert_frame_equal(metrics(tmp_path / "ranks"), metrics(on_the_loop(case)), check_exact=True)
    assert (tmp_path / "ranks" / "config.yaml").is_file()  # rank 0 wrote its run dir; the others left nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ranks"]


def test_the_trainer_on_two_ranks_gives_the_loops_values_and_a_ranks_error_reaches_both(tmp_path):
    # Training (a cohort smaller than the ranks, an empty one, three clients), the loss pass, the shared evaluation
    # pass and the client blocks, bit for bit against the loop; an error raised on rank 1 alone (a ConfigError,
    # which does not unpickle) is raised on rank 1 and named on rank 0.
    import json

    script = Path(__file__).parent / "scripts" / "two_ranks.py"
    done = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc_per_node=2", str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    # gloo's threads sometimes abort the process as it exits (torch's "terminate called without an active
    # exception", about 1 run in 10 of this script, after its results are written): tolerated here, nothing else.
    aborted = "terminate called without an active exception" in done.stderr
    assert done.returncode == 0 or aborted, done.stderr[-3000:]
    found = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for values in found:
        assert all(values[f"{kind}_{n}"] for kind in ("train", "losses") for n in (0, 1, 3)), values
        assert values["per_sample"] and values["by_clients"] == [[0, 1], [2]] and values["by_no_clients"] == []
    assert found[1]["error"].startswith("ConfigError: device.inner")
    assert found[0]["error"].startswith("RuntimeError: rank 1 failed: ConfigError: device.inner")


@pytest.mark.slow
def test_several_ranks_resuming_a_run_that_was_not_distributed_are_refused_in_one_line(tmp_path):
    out = tmp_path / "loop"
    fedrun(tmp_path, out, "schedule.rounds=1", "tracking.enabled=false")
    done = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "fedrun", f"resume={out}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
    )
    assert done.returncode != 0
    line = (
        f"fedrun: error: resume='{out}' is invalid: allowed is a run of device.backend=distributed when torchrun or "
        "srun starts several ranks (this one ran with device.backend=auto: resume it with plain fedrun)"
    )
    assert done.stderr.count(line) == 2, done.stderr[-3000:]  # each rank, before anything runs twice


def test_the_distributed_backend_outside_torchrun_is_refused_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")}
    done = subprocess.run(
        [FEDRUN, "device.backend=distributed", "schedule.rounds=1", "tracking.enabled=false"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**env, "HYDRA_FULL_ERROR": "0"},
    )
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("fedrun: error: device.backend='distributed' is invalid: allowed is a command started by torchrun")
    )


def test_a_sweep_of_the_distributed_backend_is_refused_job_by_job_and_ends_in_one_line_without_a_traceback(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")}
    done = subprocess.run(
        [FEDRUN, "-m", "device.backend=distributed", "seed=0,1", "schedule.rounds=1", "tracking.enabled=false"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**env, "HYDRA_FULL_ERROR": "0"},
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    refused = [line for line in done.stderr.splitlines() if line.startswith("fedrun: error: job ")]
    assert len(refused) == 2 and all("allowed is a single run (without -m" in line for line in refused)
    assert done.stderr.strip().splitlines()[-1] == (
        "fedrun: some jobs of this sweep failed (each said why above); the others ran"
    )


def rank_process(parent: int, rank: int) -> int:
    """The pid of the worker of torchrun ``parent`` that runs rank ``rank``."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                if f"RANK={rank}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    return int(entry.name)
        except OSError:
            continue
    raise LookupError(f"no rank {rank} under {parent}")


@pytest.mark.slow
def test_a_client_program_of_the_tests_own_gives_the_same_metrics_on_every_backend(tmp_path):
    # tests/e2e/scripts/noisy_program.py: a program with per-client state, found by --config-dir and PYTHONPATH
    # like a user's own; loop, worker processes, vmap (which hands it to the loop) and two ranks, bit for bit.
    scripts = Path(__file__).parent / "scripts"
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "PYTHONPATH": str(scripts)}
    args = ["client=noisy", "schedule.rounds=3", "schedule.clients_per_round=0.5"]
    runs = {}
    for name, ranks, backend in (
        ("loop", None, ["device.backend=loop"]),
        ("processes", None, ["device.backend=processes", "device.workers=2"]),
        ("vmap", None, ["device.backend=vmap"]),
        ("ranks", 2, []),
    ):
        cmd = command(tmp_path / name, *args, *backend, ranks=ranks)
        at = next(i for i, word in enumerate(cmd) if word.startswith("device."))  # options before the overrides
        cmd[at:at] = ["--config-dir", str(scripts / "conf")]
        done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = metrics(tmp_path / name)
    for name in ("processes", "vmap", "ranks"):
        pd.testing.assert_frame_equal(runs[name], runs["loop"], check_exact=True, obj=name)
    plain = fedrun(tmp_path, tmp_path / "plain", "device.backend=loop", "schedule.clients_per_round=0.5")
    assert plain.returncode == 0 and not metrics(tmp_path / "plain")["test_loss"].equals(runs["loop"]["test_loss"])


@pytest.mark.slow
def test_a_lost_rank_ends_the_run_killed_and_it_resumes_on_one_rank_and_on_three_with_the_same_numbers(tmp_path):
    args = ["schedule.rounds=20", "checkpoint.every=1", "aggregator=fedsoftmax"]
    whole, out = tmp_path / "whole", tmp_path / "ranks"
    subprocess.run(command(whole, "device.backend=loop", *args), cwd=tmp_path, capture_output=True, check=True)
    process = subprocess.Popen(
        command(out, *args, ranks=2), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 300
    while not (out / "metrics.csv").is_file() or len(pd.read_csv(out / "metrics.csv")) < 3:
        assert process.poll() is None and time.time() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.05)
    os.kill(rank_process(process.pid, 1), signal.SIGKILL)
    started = time.time()
    _, stderr = process.communicate(timeout=120)
    assert process.returncode != 0 and time.time() - started < 60
    assert "fedrun: stopped: another rank was lost" in stderr, stderr[-3000:]
    client, runs = mlflow_runs(tmp_path / "outputs" / "mlflow.db", "distributed")
    assert [r.info.status for r in runs if r.data.tags["output_dir"] == str(out)] == ["KILLED"]
    shutil.copytree(out, tmp_path / "three", symlinks=True)  # the same stopped run, resumed on three ranks
    for ranks, resumed_dir in ((1, out), (3, tmp_path / "three")):
        resumed = subprocess.run(
            [TORCHRUN, "--standalone", f"--nproc_per_node={ranks}", "-m", "fedrun", f"resume={resumed_dir}"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
        )
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        # The default threads (one per rank) and nothing else of the machine or the world size: bit for bit
        pd.testing.assert_frame_equal(metrics(resumed_dir), metrics(whole), check_exact=True)
