"""Never lose a run: checkpoints, kill-and-resume through the real CLI, clean stops on signals, tracking
outages, fedrun-import, one-line errors."""

import contextlib
import itertools
import json
import os
import pickle
import pty
import select
import signal
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import FEDRUN, config_can_say, mlflow_runs, sweep_runs, swept_once

from fedrun.backends import cpu_label
from fedrun.checkpoint import FILE, RUN_FILE, TERMINAL_LOG, Checkpoint, read
from fedrun.state import encode
from fedrun.tracking import mlflow_name

pytestmark = pytest.mark.e2e


def start(cwd, out, store, *args):
    cmd = [
        FEDRUN,
        *args,
        f"hydra.run.dir={out}",
        f"tracking.uri=sqlite:///{store}",
        "tracking.experiment=resume",
        "device=cpu",
    ]
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
    )


def rows_written(out: Path) -> int:
    try:
        return len(pd.read_csv(out / "metrics.csv"))
    except (FileNotFoundError, pd.errors.EmptyDataError):
        return 0


def kill_after(process, out: Path, rounds: int, sig=signal.SIGKILL, settle: float = 0.0) -> None:
    """Send ``sig`` once ``rounds`` rows are in metrics.csv and ``settle`` seconds more have passed (the run goes on
    meanwhile: the kill lands anywhere)."""
    deadline = time.time() + 300
    while rows_written(out) < rounds:
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.time() < deadline
        time.sleep(0.02)
    time.sleep(settle)
    process.send_signal(sig)


def same_rows(resumed: Path, whole: Path, saved: int | None = None) -> None:
    """metrics.csv of two runs equal, bit for bit, but for timings; on a difference, every column that differs is
    shown for both runs, with the round the run was resumed after (the rows up to it came from before the kill: a
    difference there is two fresh runs differing, not the resume)."""
    left, right = deterministic(resumed), deterministic(whole)
    try:
        pd.testing.assert_frame_equal(left, right, check_exact=True)  # pandas' default is rtol=1e-5 for floats
    except AssertionError as error:
        differ = [c for c in left.columns if c in right and not left[c].equals(right[c])]
        shown = pd.concat({"resumed": left[["round", *differ]], "whole": right[["round", *differ]]}, axis=1)
        raise AssertionError(
            f"{error}\nresumed after round {saved}; differing columns: {differ}\n{shown.to_string()}\n"
            f"{ran_on(resumed=resumed, whole=whole)}"
        ) from None


def ran_on(**runs: Path) -> str:
    """Where each run ran, from its ``run.json``: the thread count its start resolved and the CPUs its starts ran on
    (other kernels sum in another order), and whether they differ (then the machine changed under the runs)."""
    saved = {name: json.loads((run / RUN_FILE).read_text()) for name, run in runs.items()}
    said = "; ".join(
        f"{name} ran at {s.get('threads')} threads of {s.get('cores')} cores on "
        f"{', '.join(cpu_label(c) for c in s.get('cpus', [])) or '?'}"
        for name, s in saved.items()
    )
    if len({json.dumps([s.get(k) for k in ("threads", "cpus")], sort_keys=True) for s in saved.values()}) > 1:
        said += ": NOT THE SAME THREADS OR CPU KERNELS (the machine changed under the runs; their last bits may differ)"
    return said


def deterministic(out: Path) -> pd.DataFrame:
    metrics = pd.read_csv(out / "metrics.csv")
    return metrics[[c for c in metrics.columns if not c.endswith("_wall_s")]]


ADAPTIVE_CLIP = ["pipeline=clip", "pipeline.stages.0.adaptive=true", "pipeline.stages.0.max_norm=0.05"]
CASES = {
    # every stateful part of the synchronous engine: FedOpt moments, MVR's momentum and previous model, F* estimates
    "sync": [
        "aggregator=mvr",
        "server=adam",
        "schedule.rounds=8",
        "partition.num_clients=6",
        "device.backend=processes",
        "device.workers=2",
    ],
    # ... and a stateful stage of the update pipeline (the adaptive clip norm moves every round), and the devices'
    # virtual clock with a deadline that drops the slower clients
    "hybrid_fstar": [
        "aggregator=hybrid",
        "+aggregator.phases.0.aggregator.fstar=estimate",
        "aggregator.phases.0.until_round=5",
        "schedule.rounds=8",
        "partition.num_clients=6",
        "schedule.clients_per_round=0.5",
        *ADAPTIVE_CLIP,
        "devices=trace",
        f"devices.profiles={Path(__file__).parents[1] / 'data' / 'devices' / 'profiles.csv'}",
        "devices.deadline=8",  # clients 0, 1 and 4 (0.008-0.012 s a pass) report in time, 2, 3 and 5 do not
    ],
    # the asynchronous event heap, buffer, pulled versions and FedStaleWeight's staleness windows, and the adaptive clip
    # norm, the jobs timed by devices that are online in daily windows
    "async": [
        "aggregator=fedstaleweight",
        "engine.concurrency=3",
        "schedule.rounds=8",
        "partition.num_clients=6",
        *ADAPTIVE_CLIP,
        "devices=trace",
        f"devices.profiles={Path(__file__).parents[1] / 'data' / 'devices' / 'profiles.csv'}",
        f"devices.availability={Path(__file__).parents[1] / 'data' / 'devices' / 'availability.csv'}",
        "devices.period=86400",
    ],
    # the privacy ledger (epsilon goes on from the checkpoint's rounds), Poisson sampling, the noise streams and
    # adaptive clipping's clip norm
    "private": [
        "privacy=central",
        "privacy.noise_multiplier=0.8",
        "privacy.clip_norm=0.1",
        "privacy.adaptive=true",
        "privacy.clip_count_noise=1.0",
        "aggregator.weighting=uniform",
        "schedule.sampling=poisson",
        "schedule.clients_per_round=0.5",
        "schedule.rounds=8",
        "partition.num_clients=6",
    ],
    # the importance sampler's last-known norms and selection counts, and top-k's error-feedback residuals
    "selection": [
        "sampler=importance",
        "compression=topk",
        "compression.k=0.2",
        "schedule.clients_per_round=0.5",
        "schedule.rounds=8",
        "partition.num_clients=6",
    ],
    # Power-of-Choice's candidate draws and loss probes, QSGD's quantisation stream, and AFL's lambda (ascending on
    # the losses the candidates reported)
    "power_of_choice": [
        "sampler=power_of_choice",
        "aggregator=afl",
        "aggregator.lambda_lr=0.05",
        "sampler.candidates=5",
        "compression=qsgd",
        "schedule.clients_per_round=0.5",
        "schedule.rounds=8",
        "partition.num_clients=6",
    ],
    # an attack redrawn each round (its set from (seed, round)), ALIE against a trimmed mean, and malicious.csv
    "attack": [
        "attack=alie",
        "attack.fraction=0.34",
        "attack.who=redrawn",
        "aggregator=trimmed_mean",
        "aggregator.f=1",
        "schedule.clients_per_round=0.5",
        "schedule.rounds=8",
        "partition.num_clients=6",
    ],
    # personal state (FedRep's heads in a store that spills beyond 1 kB to personal/ in the run dir) and every
    # client's accuracy each round on its own test and validation splits
    "personal": [
        "personalization=fedrep",
        "personalization.memory_mb=0.001",
        "partition=shards",
        "dataset.client_test_fraction=0.25",
        "dataset.client_val_fraction=0.1",
        "schedule.clients_per_round=0.5",
        "schedule.rounds=8",
        "partition.num_clients=6",
    ],
    # a client program's per-client state (SCAFFOLD's variates, spilled to client/ beyond 1 kB) and its server half (c)
    "scaffold": [
        "client=scaffold",
        "client.memory_mb=0.001",
        "schedule.clients_per_round=0.5",
        "schedule.rounds=8",
        "partition.num_clients=6",
    ],
    # local DP: each client's count of rounds in the ledger, each client's noise stream
    "local": [
        "privacy=local",
        "privacy.noise_multiplier=0.8",
        "privacy.clip_norm=0.1",
        "aggregator.weighting=uniform",
        "schedule.clients_per_round=0.5",
        "schedule.rounds=8",
        "partition.num_clients=6",
    ],
}


# The cases a config can say (not a list's entry by index: the adaptive clip's stage): their uninterrupted runs as
# one sweep, in one process (conftest.run_cases), on the worker that runs their kills (one xdist group).
SWEPT = [c for c, overrides in CASES.items() if config_can_say(overrides)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, store):
    """case -> the run dir of its uninterrupted run, every case of ``SWEPT`` in one sweep, on first use."""
    common = ["checkpoint.every=2", f"tracking.uri=sqlite:///{store}", "tracking.experiment=resume", "device=cpu"]
    return swept_once(tmp_path_factory, "uninterrupted", {c: CASES[c] for c in SWEPT}, *common)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=[pytest.mark.xdist_group("uninterrupted")] if c in SWEPT else []) for c in CASES]
)
def test_a_run_killed_with_sigkill_and_resumed_equals_an_uninterrupted_run(tmp_path, store, uninterrupted, case):
    """Killed with SIGKILL after round 3 at the earliest, resumed, and compared with the same config run without
    a stop: in the sweep of ``uninterrupted`` (so a job of a sweep equals a run alone as well) or, for a case a
    config cannot say, alone."""
    args = [*CASES[case], "checkpoint.every=2"]
    if case in SWEPT:
        whole_dir = uninterrupted(case)
    else:
        whole_dir = tmp_path / "whole"
        whole = start(tmp_path, whole_dir, store, *args)
        assert whole.wait() == 0, whole.communicate()[1][-3000:]
    killed = start(tmp_path, tmp_path / "killed", store, *args)
    kill_after(killed, tmp_path / "killed", 3)  # after round 3 at the earliest: a checkpoint of round 2, rows beyond it
    assert killed.wait() == -signal.SIGKILL
    deadline = time.time() + 15  # its worker processes see the parent gone and exit: nothing is left behind
    while subprocess.run(["pgrep", "-f", str(tmp_path / "killed")], capture_output=True).returncode == 0:
        assert time.time() < deadline, "processes of the killed run are still alive"
        time.sleep(0.1)
    saved, written = Checkpoint(tmp_path / "killed", resume=True).restored()["round"], rows_written(tmp_path / "killed")
    assert 2 <= saved <= written < 8  # the rows after the checkpoint are measured again
    resumed = subprocess.run([FEDRUN, f"resume={tmp_path / 'killed'}"], cwd=tmp_path, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stderr
    same_rows(tmp_path / "killed", whole_dir, saved)
    tables = ("alpha.csv", "selected.csv")[: 2 if (whole_dir / "selected.csv").exists() else 1]
    optional = tuple(n for n in ("malicious.csv", "personal_accuracy.csv") if (whole_dir / n).exists())
    for name in tables + optional:
        pd.testing.assert_frame_equal(
            pd.read_csv(tmp_path / "killed" / name), pd.read_csv(whole_dir / name), check_exact=True
        )
    client, runs = mlflow_runs(store, "resume")
    run = next(r for r in runs if r.data.tags["output_dir"] == str(tmp_path / "killed"))
    assert run.info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "0_main/test_accuracy"))
    assert steps[-1] == 8 and len(set(steps)) == len(steps)  # the rounds measured again are not logged twice


@pytest.mark.slow
@pytest.mark.xdist_group("uninterrupted")
def test_a_closed_terminal_stops_the_run_and_its_workers_cleanly_and_it_resumes_to_the_same_numbers(
    tmp_path, store, uninterrupted
):
    """An SSH session lost: the terminal fedrun runs in closes, so the kernel sends SIGHUP to its foreground job
    (fedrun and its worker processes), and the shell sends it again to its jobs. The run finishes its round,
    checkpoints, is KILLED in MLflow and exits 129, saying how to resume in its terminal.log; resumed, it equals the
    run never stopped (the [sync] case: MVR, server Adam, two worker processes)."""
    out = tmp_path / "hung"
    cmd = [FEDRUN, *CASES["sync"], "checkpoint.every=2", f"hydra.run.dir={out}", f"tracking.uri=sqlite:///{store}"]
    cmd += ["tracking.experiment=resume", "device=cpu"]
    pid, terminal = pty.fork()  # a new session whose controlling terminal is the pseudo-terminal
    if pid == 0:
        os.chdir(tmp_path)
        os.execvpe(cmd[0], cmd, {**os.environ, "HYDRA_FULL_ERROR": "0"})
    shown, deadline = bytearray(), time.time() + 300
    while rows_written(out) < 3:  # the terminal is read, as a person's is (a full one would block the run)
        assert time.time() < deadline and os.waitpid(pid, os.WNOHANG) == (0, 0), shown[-3000:].decode()
        if select.select([terminal], [], [], 0.02)[0]:
            shown += os.read(terminal, 65536)
    os.close(terminal)  # the hang-up: SIGHUP (and SIGCONT) to the foreground process group
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGHUP)  # bash's, to each of its jobs, as its own SIGHUP arrives
    _, status = os.waitpid(pid, 0)
    log = (out / TERMINAL_LOG).read_text()
    assert os.waitstatus_to_exitcode(status) == 128 + signal.SIGHUP, log[-3000:]
    assert f"fedrun resume={out}" in log and "Traceback" not in log
    deadline = time.time() + 15  # its workers ignored the hang-up and left with the parent
    while subprocess.run(["pgrep", "-f", str(out)], capture_output=True).returncode == 0:
        assert time.time() < deadline, "processes of the hung-up run are still alive"
        time.sleep(0.1)
    saved = Checkpoint(out, resume=True).restored()["round"]
    assert 3 <= saved == rows_written(out) < 8  # checkpointed at the stop, after the round it was in
    client, runs = mlflow_runs(store, "resume")
    run = next(r for r in runs if r.data.tags["output_dir"] == str(out))
    assert run.info.status == "KILLED" and "SIGHUP" in run.data.tags["failure_reason"]
    resumed = subprocess.run([FEDRUN, f"resume={out}"], cwd=tmp_path, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    same_rows(out, uninterrupted("sync"), saved)


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_restarts_in_its_dir_and_mlflow_run_and_equals_an_uninterrupted_one(
    tmp_path, store
):
    args = [*CASES["sync"], "checkpoint.every=100"]  # no checkpoint before the last round
    whole = start(tmp_path, tmp_path / "whole", store, *args)
    assert whole.wait() == 0, whole.communicate()[1][-3000:]
    killed = start(tmp_path, tmp_path / "killed", store, *args)
    kill_after(killed, tmp_path / "killed", 2)
    assert killed.wait() == -signal.SIGKILL
    assert (
        not (tmp_path / "killed" / FILE).exists()
        and (tmp_path / "killed" / RUN_FILE).is_file()
        and rows_written(tmp_path / "killed") >= 2
    )
    resumed = subprocess.run([FEDRUN, f"resume={tmp_path / 'killed'}"], cwd=tmp_path, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "restarting" in resumed.stderr and "from round 1" in resumed.stderr
    same_rows(tmp_path / "killed", tmp_path / "whole")
    pd.testing.assert_frame_equal(
        pd.read_csv(tmp_path / "killed" / "alpha.csv"), pd.read_csv(tmp_path / "whole" / "alpha.csv"), check_exact=True
    )
    client, runs = mlflow_runs(store, "resume")
    mine = [r for r in runs if r.data.tags["output_dir"] == str(tmp_path / "killed")]
    assert len(mine) == 1 and mine[0].info.status == "FINISHED"  # the same MLflow run, reopened
    whole_run = next(r for r in runs if r.data.tags["output_dir"] == str(tmp_path / "whole"))
    assert mine[0].data.metrics["0_main/test_accuracy"] == whole_run.data.metrics["0_main/test_accuracy"]
    assert [m.step for m in client.get_metric_history(mine[0].info.run_id, "0_main/test_accuracy")][-1] == 8


class Crafted:
    """A pickle that runs a command when it is unpickled without ``weights_only``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_crafted_checkpoint_is_refused_in_one_line_by_resume_and_import_and_runs_nothing(tmp_path, compose_config):
    from omegaconf import OmegaConf

    run = tmp_path / "run"
    run.mkdir()
    OmegaConf.save(compose_config("schedule.rounds=3"), run / "config.yaml", resolve=True)
    (run / "metrics.csv").write_text("round,test_accuracy\n1,0.5\n")
    marker = tmp_path / "pwned"
    crafted = {"round": 1, "finished": False, "payload": Crafted(marker)}
    # torch's own file, and a bare pickle in a protocol torch does not write (torch warned about it in two lines)
    for write, cmd in itertools.product(
        (lambda: torch.save(crafted, run / FILE), lambda: (run / FILE).write_bytes(pickle.dumps(crafted))),
        (
            [FEDRUN, f"resume={run}"],
            [str(Path(FEDRUN).with_name("fedrun-import")), str(run), "--uri", f"sqlite:///{tmp_path / 'x.db'}"],
        ),
    ):
        write()
        done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 2, done.stderr[-3000:]
        last = done.stderr.strip().splitlines()
        assert len(last) == 1 and f"checkpoint='{run / FILE}' is invalid" in last[0] and "weights_only" in last[0], (
            done.stderr
        )
        assert "Traceback" not in done.stderr and not marker.exists()
    assert not (tmp_path / "x.db").exists()  # refused before the store was touched


@pytest.mark.slow
def test_sigterm_stops_after_the_round_as_killed_with_artifacts_and_a_resume_command(tmp_path, store):
    args = ["aggregator=fedsoftmax", "schedule.rounds=30", "partition.num_clients=6", "checkpoint.every=100"]
    stopped = start(tmp_path, tmp_path / "run", store, *args)
    kill_after(stopped, tmp_path / "run", 2, signal.SIGTERM)
    _, err = stopped.communicate(timeout=120)
    assert stopped.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert f"fedrun resume={tmp_path / 'run'}" in err and "Traceback" not in err
    done = rows_written(tmp_path / "run")
    assert Checkpoint(tmp_path / "run", resume=True).restored()["round"] == done < 30  # checkpointed at the stop
    assert {"summary.csv", "curves.png", "alpha_heatmap.png", FILE} <= {p.name for p in (tmp_path / "run").iterdir()}
    client, runs = mlflow_runs(store, "resume")
    run = next(r for r in runs if r.data.tags["output_dir"] == str(tmp_path / "run"))
    assert run.info.status == "KILLED" and "SIGTERM" in run.data.tags["failure_reason"]
    assert "summary.csv" in {a.path for a in client.list_artifacts(run.info.run_id)}
    # ... and resumed as if it had started on another CPU: said in one line, and both CPUs kept in run.json
    state = read(tmp_path / "run" / FILE)
    elsewhere = {"model": "Elsewhere CPU", "capability": "DEFAULT", "flags": "avx"}
    here, state["extra"]["cpus"] = state["extra"]["cpus"], [elsewhere]
    torch.save(encode(state), tmp_path / "run" / FILE)
    resumed = subprocess.run([FEDRUN, f"resume={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert rows_written(tmp_path / "run") == 30
    [warned] = [line for line in resumed.stderr.splitlines() if line.startswith("fedrun: warning:")]
    assert warned.startswith(
        f"fedrun: warning: {tmp_path / 'run'} started on Elsewhere CPU (DEFAULT), now on {cpu_label(here[0])}"
    )
    assert json.loads((tmp_path / "run" / RUN_FILE).read_text())["cpus"] == [elsewhere, *here]
    _, runs = mlflow_runs(store, "resume")
    assert next(r for r in runs if r.data.tags["output_dir"] == str(tmp_path / "run")).info.status == "FINISHED"


def test_resume_refuses_other_overrides_and_missing_checkpoints_in_one_line(tmp_path):
    done = subprocess.run([FEDRUN, f"resume={tmp_path}"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith("fedrun: error: resume=")
    (tmp_path / FILE).write_bytes(b"")
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    done = subprocess.run(
        [FEDRUN, f"resume={tmp_path}", "optimizer.lr=0.5"], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 2 and "no other overrides" in done.stderr and "optimizer.lr=0.5" in done.stderr


@pytest.mark.slow
def test_sigterm_to_the_whole_process_group_with_worker_processes_stops_cleanly(tmp_path, store):
    """As SLURM does at the time limit: every process of the job gets SIGTERM, the forked workers included."""
    cmd = [
        FEDRUN,
        "device=cpu",
        "schedule.rounds=30",
        "partition.num_clients=6",
        "checkpoint.every=100",
        "device.backend=processes",
        "device.workers=2",
        f"hydra.run.dir={tmp_path / 'run'}",
        f"tracking.uri=sqlite:///{store}",
        "tracking.experiment=resume",
        "device=cpu",
    ]
    process = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.time() + 300
    while rows_written(tmp_path / "run") < 2:
        assert process.poll() is None and time.time() < deadline
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err and f"fedrun resume={tmp_path / 'run'}" in err
    resumed = subprocess.run([FEDRUN, f"resume={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert rows_written(tmp_path / "run") == 30


@pytest.mark.slow
def test_an_unreachable_tracking_server_fails_in_one_line_within_15_seconds(tmp_path):
    started = time.time()
    done = subprocess.run(
        [FEDRUN, "tracking.uri=http://127.0.0.1:9", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert time.time() - started < 15
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert (
        done.stderr.strip().splitlines()[-1].startswith("fedrun: error: tracking.uri='http://127.0.0.1:9' is invalid")
    )
    assert not (tmp_path / "run" / "metrics.csv").exists()  # nothing loaded or trained


@pytest.mark.slow
def test_a_store_lost_mid_run_keeps_training_and_fedrun_import_brings_the_run_back(tmp_path):
    store = tmp_path / "lost.db"
    out = tmp_path / "run"
    process = start(tmp_path, out, store, "schedule.rounds=25", "partition.num_clients=6")
    deadline = time.time() + 300
    while rows_written(out) < 2:
        assert process.poll() is None and time.time() < deadline
        time.sleep(0.02)
    store.unlink()  # the database is gone: MLflow's next write fails
    _, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    assert (
        "MLflow stopped taking this run's data" in err and err.strip().splitlines()[-1] == f"  fedrun-import {out}"
    )  # said again at the end
    assert rows_written(out) == 25  # every round is in the files
    imported = tmp_path / "imported.db"
    done = subprocess.run(
        [str(Path(FEDRUN).parent / "fedrun-import"), str(out), f"--uri=sqlite:///{imported}"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    client, [run] = mlflow_runs(imported, "resume")
    metrics = pd.read_csv(out / "metrics.csv")
    history = client.get_metric_history(run.info.run_id, "0_main/test_accuracy")
    assert [m.step for m in history] == metrics["round"].tolist()
    assert [m.value for m in history] == pytest.approx(metrics["test_accuracy"].tolist())
    assert run.info.status == "FINISHED" and run.data.params["schedule.rounds"] == "25"
    # FedAvg's alpha is p_i: its per-client series are not logged, and not imported (alpha.csv is an artifact)
    assert not client.get_metric_history(run.info.run_id, "alpha/client_0")
    assert "metrics.csv" in {a.path for a in client.list_artifacts(run.info.run_id)}


@pytest.mark.slow
def test_fedrun_import_of_an_untracked_run_has_every_metric(tmp_path):
    out = tmp_path / "run"
    done = subprocess.run(
        [
            FEDRUN,
            "schedule.rounds=4",
            "partition.num_clients=5",
            "tracking.enabled=false",
            f"hydra.run.dir={out}",
            "schedule.eval_every=2",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    store = tmp_path / "store.db"
    done = subprocess.run(
        [str(Path(FEDRUN).parent / "fedrun-import"), str(out), f"--uri=sqlite:///{store}", "--experiment=imported"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    client, [run] = mlflow_runs(store, "imported")
    metrics = pd.read_csv(out / "metrics.csv")
    for column in metrics.columns.drop("round"):
        expected = metrics[["round", column]].dropna()
        history = client.get_metric_history(run.info.run_id, mlflow_name(column))
        assert [(m.step, m.value) for m in history] == [
            (int(r), pytest.approx(v)) for r, v in expected.itertuples(index=False)
        ], column
    assert run.data.metrics["5_summary/rounds_run"] == 4 and run.info.status == "FINISHED"


@pytest.mark.slow
def test_diverging_run_prints_one_line_without_a_traceback(tmp_path):
    done = subprocess.run(
        [
            FEDRUN,
            "optimizer.lr=1e6",
            "schedule.rounds=5",
            "partition.num_clients=5",
            "tracking.enabled=false",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("fedrun: error: training diverged: non-finite")
        and "round 1" in last
        and "lr=1e+06" in last
        and "FAILED" in last
    )
    # Imported later (it ran without tracking), it is FAILED with its reason, not KILLED.
    store = tmp_path / "store.db"
    done = subprocess.run(
        [
            str(Path(FEDRUN).parent / "fedrun-import"),
            str(tmp_path / "run"),
            f"--uri=sqlite:///{store}",
            "--experiment=imported",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    _, [run] = mlflow_runs(store, "imported")
    assert run.info.status == "FAILED" and run.data.tags["failure_reason"].startswith("DivergenceError: non-finite")


@pytest.mark.slow
def test_a_sweep_with_a_diverging_job_finishes_the_others_and_names_the_failed_overrides(tmp_path, store):
    done = subprocess.run(
        [
            FEDRUN,
            "-m",
            "optimizer.lr=0.05,1e6,0.1",
            "schedule.rounds=3",
            "partition.num_clients=5",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
            f"tracking.uri=sqlite:///{store}",
            "tracking.experiment=sweep_fail",
            "device=cpu",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
    )
    assert done.returncode == 1
    [line] = [line for line in done.stderr.splitlines() if line.startswith("fedrun: error: job 1 (")]
    assert "optimizer.lr=1000000.0" in line and "training diverged" in line
    for job in (0, 1, 2):  # the job after the failed one ran too
        assert rows_written(tmp_path / "sweep" / str(job)) >= 1
    _, runs = mlflow_runs(store, "sweep_fail")
    assert sorted(r.info.status for r in runs) == ["FAILED", "FINISHED", "FINISHED"]
    _, [parent] = sweep_runs(store, "sweep_fail")  # ended although the sweep failed, and marked so
    assert (
        parent.info.status == "FAILED"
        and parent.data.metrics["jobs_failed"] == 1
        and parent.data.metrics["jobs_finished"] == 2
    )
    # Resumed, the diverged job is a result like the finished ones: skipped, no second FAILED run (it diverged at
    # round 1, before any checkpoint, so without its mark it would run again from the start).
    again = subprocess.run(
        [
            FEDRUN,
            "-m",
            "optimizer.lr=0.05,1e6,0.1",
            "schedule.rounds=3",
            "partition.num_clients=5",
            f"resume={tmp_path / 'sweep'}",
            f"tracking.uri=sqlite:///{store}",
            "tracking.experiment=sweep_fail",
            "device=cpu",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
    )
    assert again.returncode == 1 and again.stderr.count("had finished: skipped") == 2
    [line] = [line for line in again.stderr.splitlines() if line.startswith("fedrun: error: job 1 (")]
    assert "had diverged: non-finite" in line and "skipped, its FAILED run is kept" in line
    _, runs = mlflow_runs(store, "sweep_fail")
    assert sorted(r.info.status for r in runs) == ["FAILED", "FINISHED", "FINISHED"]
    refused = subprocess.run(
        [FEDRUN, f"resume={tmp_path / 'sweep' / '1'}", "tracking.enabled=false"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert (
        refused.returncode == 2
        and "a run that did not diverge (this one did, and would again: non-finite" in refused.stderr
    )


@pytest.mark.slow
def test_a_killed_sweep_resumes_skipping_finished_jobs_and_equals_an_uninterrupted_one(tmp_path, store):
    sweep = ["-m", "seed=0,1,2", "schedule.rounds=6", "partition.num_clients=5", "checkpoint.every=2"]
    common = [f"tracking.uri=sqlite:///{store}", "tracking.experiment=sweep_resume", "device=cpu"]
    whole = subprocess.run(
        [FEDRUN, *sweep, f"hydra.sweep.dir={tmp_path / 'whole'}", *common], cwd=tmp_path, capture_output=True, text=True
    )
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = subprocess.Popen(
        [FEDRUN, *sweep, f"hydra.sweep.dir={tmp_path / 'killed'}", *common],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    kill_after(killed, tmp_path / "killed" / "1", 3)  # job 0 done, job 1 part-way, job 2 never started
    killed.wait()
    assert not (tmp_path / "killed" / "2").exists()
    resumed = subprocess.run(
        [FEDRUN, *sweep, f"resume={tmp_path / 'killed'}", *common], cwd=tmp_path, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "job 0 (" in resumed.stderr and "had finished: skipped" in resumed.stderr
    assert f"resuming {tmp_path / 'killed' / '1'} after round" in resumed.stderr
    for job in ("0", "1", "2"):
        pd.testing.assert_frame_equal(
            deterministic(tmp_path / "killed" / job), deterministic(tmp_path / "whole" / job), check_exact=True
        )
    changed = subprocess.run(
        [
            FEDRUN,
            "-m",
            "seed=0,1,2",
            "schedule.rounds=7",
            "partition.num_clients=5",
            "checkpoint.every=2",
            f"resume={tmp_path / 'killed'}",
            *common,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert changed.returncode == 1 and "the same sweep" in changed.stderr and "schedule.rounds" in changed.stderr
    _, parents = sweep_runs(store, "sweep_resume")  # the resumed sweep reopened its parent run, not a new one
    killed_parent = [p for p in parents if p.data.tags["sweep_dir"] == str(tmp_path / "killed")]
    assert len(parents) == 2 and len(killed_parent) == 1 and killed_parent[0].info.status == "FINISHED"


@pytest.mark.slow
def test_a_sigterm_in_a_sweep_jobs_last_round_finishes_the_job_and_stops_the_sweep(tmp_path, store):
    sweep = [
        "-m",
        "seed=0,1",
        "schedule.rounds=4",
        "schedule.local_epochs=6",
        "partition.num_clients=5",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    common = [f"tracking.uri=sqlite:///{store}", "tracking.experiment=last_round", "device=cpu"]
    process = subprocess.Popen(
        [FEDRUN, *sweep, *common], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    # Once round 4, job 0's last, has begun, and 0.5 s more: past round 3's logging to MLflow (its row is in
    # metrics.csv first), well inside round 4.
    kill_after(process, tmp_path / "sweep" / "0", 3, signal.SIGTERM, settle=0.5)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "came in this job's last round" in err and "Traceback" not in err
    assert (
        rows_written(tmp_path / "sweep" / "0") == 4 and not (tmp_path / "sweep" / "1").exists()
    )  # job 1 never started
    _, runs = mlflow_runs(store, "last_round")
    assert [r.info.status for r in runs] == ["FINISHED"]
