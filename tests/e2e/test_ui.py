"""``fedrun-ui`` against a real MLflow server: it starts the UI on fedrun's store, prints the experiments page and each
experiment's runs in model-training mode, answers there, and stops the server and its workers when it is stopped."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # a real server takes 10-20 s to start
UI = str(Path(sys.executable).parent / "fedrun-ui")


def session_members(sid: int) -> list[int]:
    """The processes of session ``sid`` still alive (the server leads its own session: its workers are in it)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":  # field 6 of stat: the session; Z: a zombie, gone
                members.append(int(entry.name))
    return members


def test_the_ui_opens_on_the_runs_and_stops_its_workers(tmp_path):
    from fedrun.tracking import Tracker

    store = tmp_path / "outputs" / "mlflow.db"
    store.parent.mkdir()
    Tracker.experiment_id(f"sqlite:///{store}", "tutorial")  # an experiment as fedrun makes it
    import mlflow

    mlflow.MlflowClient(f"sqlite:///{store}").create_experiment("not fedrun's")  # newer, but listed after fedrun's
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Started as a script's background command is (SIGINT ignored: a test runner started so passes that on), which
    # the UI must override: Ctrl-C stops it and its server all the same.
    ui = subprocess.Popen(
        [UI, "--port", str(port)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        lines = [ui.stdout.readline().strip() for _ in range(3)]  # blocks until the server answered
        base = f"http://127.0.0.1:{port}"
        assert lines[0] == f"fedrun-ui: experiments: {base}/#/experiments?workflowType=machine_learning", lines
        assert lines[1].startswith(f"fedrun-ui:   tutorial: {base}/#/experiments/") and lines[1].endswith(
            "/runs?workflowType=machine_learning"
        ), lines
        assert lines[2].startswith("fedrun-ui:   not fedrun's: "), lines  # fedrun's experiments first
        assert b"<html" in urllib.request.urlopen(base, timeout=10).read().lower()  # the UI itself answers
        server = next(int(p) for p in os.listdir("/proc") if p.isdigit() and _child_of(int(p), ui.pid))
        assert len(session_members(server)) >= 2  # the server and its workers
        ui.send_signal(signal.SIGINT)  # Ctrl-C
        assert ui.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while session_members(server) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert session_members(server) == []
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0  # nothing listens any more
    finally:
        if ui.poll() is None:  # a failed test: the server's session goes with the UI, nothing left running
            for pid in [int(p) for p in os.listdir("/proc") if p.isdigit() and _child_of(int(p), ui.pid)]:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
            ui.kill()


def _child_of(pid: int, parent: int) -> bool:
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent
    except OSError:
        return False


def test_a_missing_store_is_one_line_and_starts_nothing(tmp_path):
    done = subprocess.run([UI, "--store", "nowhere/mlflow.db"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("fedrun-ui: error: --store='nowhere/mlflow.db' is invalid: allowed is the MLflow")
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "nowhere").exists()
