"""Run dirs from elsewhere (a shared filesystem) are data, never code: a resumed run builds only what fedrun's options
build, a backend named by a dir is not imported, one process writes a run dir at a time, fedrun-import checks the
dir before it creates anything. The crafted dirs are built in tests/config/test_rundirs.py."""

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from config.test_rundirs import crafted_run
from conftest import FEDRUN
from omegaconf import OmegaConf

import fedrun.checkpoint as checkpoint
import fedrun.cli.entry as entry
from fedrun.errors import ConfigError

# Read at use (not imported by name), so that each test fails for its own reason on a fedrun without them.
LOCK_FILE, TRUST_VARIABLE = "fedrun.lock", "FEDRUN_TRUST"

IMPORT = str(Path(FEDRUN).with_name("fedrun-import"))


def test_fedrun_resume_of_a_crafted_dir_exits_2_in_one_line_and_runs_nothing(tmp_path, compose_config):
    run = crafted_run(tmp_path / "run", compose_config, "torch.load")
    done = subprocess.run([FEDRUN, f"resume={run}"], cwd=tmp_path, capture_output=True, text=True)
    assert not (tmp_path / "marker").exists()
    assert done.returncode == 2, done.stderr[-3000:]
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"fedrun: error: resume='{run}' is invalid: allowed is a run dir whose config builds only")
    assert f"{TRUST_VARIABLE}=torch.load fedrun resume={run}" in line


def test_a_resume_of_a_dir_with_a_link_in_hydra_s_files_is_refused_before_hydra_writes_through_it(
    tmp_path, compose_config
):
    """Hydra writes .hydra/overrides.yaml into the run dir before any of fedrun's code runs, following links."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(compose_config(), run / "config.yaml", resolve=True)
    yours = tmp_path / "yours.txt"
    yours.write_text("keep me\n")
    (run / ".hydra" / "overrides.yaml").symlink_to(yours)
    done = subprocess.run([FEDRUN, "resume=run"], cwd=tmp_path, capture_output=True, text=True)
    assert yours.read_text() == "keep me\n"
    assert done.returncode == 2, done.stderr[-3000:]
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("fedrun: error: resume='run' is invalid: allowed is a dir without links, symbolic or hard (")
    assert ".hydra/overrides.yaml" in line
    for spelt in ("++resume=run", "+resume=run", "resume='run'"):  # Hydra reads each as resume=run
        with pytest.raises(ConfigError, match="a dir without links, symbolic or hard"):
            entry.refuse_linked_resume([spelt], str(tmp_path))


HOLD = "import sys, time\nfrom fedrun.checkpoint import lock\nlock(sys.argv[1], 'k', 'v')\nprint('held', flush=True)\ntime.sleep(60)\n"


def test_a_run_dir_s_lock_names_its_holder_and_is_free_once_the_holder_is_killed(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(ConfigError) as refused:
            checkpoint.lock(tmp_path, "resume", tmp_path)
        assert f"process {holder.pid} holds {tmp_path / LOCK_FILE}" in str(refused.value)
        from fedrun.upgrade import upgrade

        with pytest.raises(ConfigError, match=f"process {holder.pid} holds"):  # nor rewritten under it
            upgrade(tmp_path)
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        checkpoint.lock(tmp_path, "resume", tmp_path)  # the kernel dropped the dead holder's lock
        assert (tmp_path / LOCK_FILE).read_text() == f"{os.getpid()}\n"
        # a forked child (a worker process) does not keep the dir locked: once the parent lets go, it is free
        ready, tell = os.pipe()
        child = os.fork()
        if child == 0:
            os.write(tell, b"up")  # past fork's hooks
            time.sleep(3)
            os._exit(0)
        assert os.read(ready, 2) == b"up"
        os.close(ready), os.close(tell)
        checkpoint.unlock(tmp_path)
        fd = os.open(tmp_path / LOCK_FILE, os.O_RDWR)  # a new open file: it conflicts with any other holder's
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the child's copy holds nothing
        finally:
            os.close(fd)
        os.waitpid(child, 0)
    finally:
        holder.kill()
        checkpoint.unlock(tmp_path)


def test_a_sweep_dir_another_process_sweeps_is_refused_in_one_line_before_any_job(tmp_path):
    """The review's case: a second `-m ... resume=<sweep dir>` while the sweep runs relaunched its jobs."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(sweep)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        done = subprocess.run(
            [FEDRUN, "-m", "seed=0,1", "schedule.rounds=1", "tracking.enabled=false", f"resume={sweep}"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
        )
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 2, done.stderr[-3000:]
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("fedrun: error: resume=") and f"process {holder.pid} holds {sweep / LOCK_FILE}" in line
    assert sorted(p.name for p in sweep.iterdir()) == [LOCK_FILE]  # no job ran


@pytest.mark.slow
def test_a_resume_while_the_run_is_running_is_refused_with_its_pid_and_accepted_once_it_was_killed(tmp_path, store):
    from e2e.test_reliability import kill_after, rows_written, start

    out = tmp_path / "run"
    running = start(tmp_path, out, store, "schedule.rounds=200", "partition.num_clients=5", "checkpoint.every=1")
    try:
        kill_after(running, out, 1, sig=0)  # signal 0: nothing is sent, the run is under way
        refused = subprocess.run([FEDRUN, f"resume={out}"], cwd=tmp_path, capture_output=True, text=True)
        assert refused.returncode == 2, refused.stderr[-3000:]
        [line] = refused.stderr.strip().splitlines()
        assert f"process {running.pid} holds {out / LOCK_FILE}" in line and line.startswith("fedrun: error: resume=")
        assert running.poll() is None  # the refused resume wrote nothing of its own
    finally:
        running.send_signal(signal.SIGKILL)
        running.wait()
    before = rows_written(out)
    resumed = subprocess.Popen([FEDRUN, f"resume={out}"], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while rows_written(out) <= before:
            assert resumed.poll() is None, resumed.communicate()[1][-3000:]
            assert time.time() < deadline
            time.sleep(0.05)
        assert (out / LOCK_FILE).read_text() == f"{resumed.pid}\n"  # the resume holds the dir now
    finally:
        resumed.send_signal(signal.SIGKILL)
        resumed.wait()


@pytest.mark.slow
def test_links_made_while_a_run_trains_are_replaced_or_refused_never_written_through(tmp_path, store):
    """A check of the dir's links when a resume starts cannot see a link made while the run trains: fedrun's writes
    replace a whole file by renaming a new one over its name, and refuse to append to a link (fedrun.runfiles)."""
    from e2e.test_reliability import kill_after, start

    victims = {name: tmp_path / "elsewhere" / f"{name}.txt" for name in ("summary", "metrics")}
    victims["summary"].parent.mkdir()
    for victim in victims.values():
        victim.write_text("keep me\n")
    out = tmp_path / "run"
    running = start(tmp_path, out, store, "schedule.rounds=40", "partition.num_clients=5")
    kill_after(running, out, 1, sig=0)  # signal 0: nothing is sent, the run is under way
    (out / "summary.csv").symlink_to(victims["summary"])  # the summary is written at the end
    _, err = running.communicate(timeout=600)
    assert running.returncode == 0, err[-3000:]
    assert victims["summary"].read_text() == "keep me\n"
    assert not (out / "summary.csv").is_symlink() and "final_test_accuracy" in (out / "summary.csv").read_text()

    # A copy made with cp -al shares every file with the run it copies: resuming it is refused before Hydra writes.
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-al", str(out), str(copy)], check=True)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and not p.is_symlink()}
    refused = subprocess.run([FEDRUN, f"resume={copy}"], cwd=tmp_path, capture_output=True, text=True)
    assert refused.returncode == 2, refused.stderr[-3000:]
    [line] = refused.stderr.strip().splitlines()
    assert line.startswith(
        f"fedrun: error: resume='{copy}' is invalid: allowed is a dir without links, symbolic or hard"
    )
    assert {p: p.read_bytes() for p in before} == before

    # metrics.csv swapped for a hard link to a file elsewhere while the run trains: one line, the run FAILED.
    out = tmp_path / "run2"
    running = start(tmp_path, out, store, "schedule.rounds=300", "partition.num_clients=5")
    kill_after(running, out, 1, sig=0)
    (out / "metrics.csv").unlink()
    (out / "metrics.csv").hardlink_to(victims["metrics"])
    _, err = running.communicate(timeout=600)
    assert running.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("fedrun: error: ") and "metrics.csv is a hard link: fedrun does not write through it" in last
    assert "Traceback" not in err and victims["metrics"].read_text() == "keep me\n"


@pytest.mark.slow
def test_a_resume_logs_only_to_an_existing_store_that_holds_its_run_and_takes_tracking_uri_when_it_moved(tmp_path):
    """A crafted tracking.uri in a run dir's config created a database where it said; a store that moved was
    replaced by a new, empty one."""
    from e2e.test_reliability import kill_after, rows_written, start

    store, out = tmp_path / "runs.db", tmp_path / "run"
    running = start(tmp_path, out, store, "schedule.rounds=6", "partition.num_clients=5", "checkpoint.every=1")
    kill_after(running, out, 2)
    running.wait()
    config = (out / "config.yaml").read_text()

    def resume(*args):
        done = subprocess.run([FEDRUN, f"resume={out}", *args], cwd=tmp_path, capture_output=True, text=True)
        lines = done.stderr.strip().splitlines()
        return done.returncode, (lines[-1] if lines else "")

    rows = (out / "metrics.csv").read_text()
    (out / "metrics.csv").write_text(rows + "=cmd|' /C calc'!A0" + "," * rows.splitlines()[0].count(",") + "\n")
    code, line = resume()  # a spreadsheet formula in a row: one line naming the file and the line, nothing trained
    assert code == 2 and line.startswith(f"fedrun: error: resume='{out / 'metrics.csv'}' is invalid: allowed is a file")
    assert f"line {len(rows.splitlines()) + 1}: \"=cmd|' /C calc'!A0\" is no number" in line
    (out / "metrics.csv").write_text(rows)
    crafted = tmp_path / "elsewhere" / "new.db"
    (out / "config.yaml").write_text(config.replace(f"sqlite:///{store}", f"sqlite:///{crafted}"))
    code, line = resume()
    assert code == 2 and line.startswith(f"fedrun: error: tracking.uri='sqlite:///{crafted}' is invalid: allowed is ")
    assert not crafted.parent.exists()  # neither the database nor its folder
    (out / "config.yaml").write_text(config)
    moved = tmp_path / "moved.db"
    store.rename(moved)
    code, line = resume()
    assert code == 2 and "name it with tracking.uri=<its URI>, the one override a resume takes" in line
    assert not store.exists()
    empty = tmp_path / "empty.db"
    subprocess.run(
        [sys.executable, "-c", f"import mlflow; mlflow.MlflowClient('sqlite:///{empty}').search_experiments()"],
        check=True,
    )
    code, line = resume(f"tracking.uri=sqlite:///{empty}")
    assert code == 2 and "a store that holds the run of" in line
    code, line = resume(f"tracking.uri=sqlite:///{moved}", "seed=3")
    assert code == 2 and "no other overrides but tracking.uri=" in line
    code, _ = resume(f"tracking.uri=sqlite:///{moved}")
    assert code == 0 and rows_written(out) == 6
    import mlflow

    [run] = mlflow.MlflowClient(f"sqlite:///{moved}").search_runs(
        [mlflow.MlflowClient(f"sqlite:///{moved}").get_experiment_by_name("resume").experiment_id]
    )
    assert run.info.status == "FINISHED"
    assert [
        m.step
        for m in mlflow.MlflowClient(f"sqlite:///{moved}").get_metric_history(run.info.run_id, "0_main/test_accuracy")
    ] == list(range(1, 7))


# fedrun-import: each crafted dir is refused in one line before the store is touched (the database is not even
# created), so no half-imported run is left RUNNING.
CONFIG = "schedule: {rounds: 2}\ntracking: {experiment: imported}\n"


def test_fedrun_import_refuses_bad_names_elsewhere_in_one_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_text("round,test_accuracy\n1,0.5\n2,-0.25\n")
    (run / "config.yaml").write_text(CONFIG + "'../../x': 1\n")
    done = subprocess.run(
        [IMPORT, str(run), f"--uri=sqlite:///{tmp_path / 'store.db'}"], capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "fedrun-import: error: config.yaml key='../../x' is invalid: allowed is a name MLflow accepts (at most 250 "
        "letters, digits, _ - . : / or spaces, not a path that resolves elsewhere)"
    ]
    (run / "config.yaml").write_text(CONFIG)
    (run / "summary.csv").write_text(",value\nR90,3\n=cmd,x\n")
    with pytest.raises(ConfigError, match="summary.csv name='=cmd'"):
        from fedrun.importer import import_run

        import_run(run, f"sqlite:///{tmp_path / 'store.db'}", None)
    assert not (tmp_path / "store.db").exists()


def test_fedrun_import_goes_to_the_user_s_store_not_the_one_the_dir_names(tmp_path, monkeypatch):
    import fedrun.importer as importer

    (tmp_path / "config.yaml").write_text("tracking: {uri: 'sqlite:////elsewhere/theirs.db'}\n")
    calls = []
    monkeypatch.setattr(importer, "import_run", lambda directory, uri, experiment: calls.append(uri) or "id")
    for given in ([], ["--uri", "http://mine:5000"]):
        monkeypatch.setattr(sys, "argv", ["fedrun-import", str(tmp_path), *given])
        importer.main()
    users = OmegaConf.load(Path(__file__).parents[2] / "conf" / "config.yaml").tracking.uri  # what fedrun uses
    assert calls == [users, "http://mine:5000"]


def test_fedrun_import_copies_no_link_and_marks_a_failed_import_failed(tmp_path, store, monkeypatch, capsys):
    import mlflow

    import fedrun.importer as importer

    secret = tmp_path / "secret.txt"
    secret.write_text("not yours\n")
    run = tmp_path / "run"
    (run / "plots").mkdir(parents=True)
    (run / "metrics.csv").write_text("round,test_accuracy,test_loss\n1,0.5,\n2,0.75,-0.5\n")
    (run / "config.yaml").write_text(CONFIG)
    (run / "plots" / "a.txt").write_text("a plot\n")
    (run / "stolen.txt").symlink_to(secret)
    (run / "linked").symlink_to(tmp_path)
    (run / "plots" / "hard.txt").hardlink_to(secret)  # a hard link: another name of the secret
    (run / LOCK_FILE).write_text("123\n")
    uri = f"sqlite:///{store}"
    run_id = importer.import_run(run, uri, "import_links")
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fedrun-import")]
    assert said == [
        f"fedrun-import: {run}: left out 3 link(s), symbolic or hard, neither read nor copied: linked, stolen.txt, "
        "plots/hard.txt"
    ]
    client = mlflow.MlflowClient(tracking_uri=uri)
    assert {a.path for a in client.list_artifacts(run_id)} == {"config.yaml", "metrics.csv", "plots"}
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "0_main/test_loss")] == [(2, -0.5)]
    assert client.get_run(run_id).info.status == "FINISHED"

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(mlflow.MlflowClient, "log_artifact", broken)
    monkeypatch.setattr(sys, "argv", ["fedrun-import", str(run), "--uri", uri, "--experiment", "import_links"])
    with pytest.raises(SystemExit) as exited:
        importer.main()
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fedrun-import: error")]
    assert exited.value.code == 1 and line.startswith(
        f"fedrun-import: error: {run}: OSError: disk full (its MLflow run"
    )
    failed = line.split("its MLflow run ")[1].split(" ")[0]
    assert client.get_run(failed).info.status == "FAILED"


@pytest.mark.slow
def test_a_store_kept_inside_the_run_dir_is_not_logged_into_itself(tmp_path):
    """The run dir is the run's artifacts, but for the tracking store kept in it: the SQLite file and the artifact
    root beside it (copying that root into itself nested ``mlartifacts/<id>/artifacts/mlartifacts/...`` until the
    file name was too long, and MLflow missed the run's artifacts)."""
    import mlflow

    out = tmp_path / "run"
    uri = f"sqlite:///{out}/mlflow.db"
    args = ["schedule.rounds=1", "partition.num_clients=4", f"hydra.run.dir={out}", f"tracking.uri={uri}"]
    done = subprocess.run([FEDRUN, *args, "tracking.experiment=inside"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0 and "MLflow missed" not in done.stderr, done.stderr[-3000:]
    client = mlflow.MlflowClient(uri)
    run = client.search_runs([client.get_experiment_by_name("inside").experiment_id])[0]
    logged = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"metrics.csv", "summary.csv", "config.yaml"} <= logged
    assert not logged & {"mlflow.db", "mlartifacts"}
