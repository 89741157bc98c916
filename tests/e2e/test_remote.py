"""Remote tracking: a sweep logging to a real ``mlflow server``, read back through the client and fedrun-report."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import FEDRUN, mlflow_runs, sweep_runs

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group("remote")]  # one server, one worker
MLFLOW = str(Path(sys.executable).parent / "mlflow")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real ``mlflow server`` on 127.0.0.1 with a temporary backend store and artifact root; shut down after."""
    root = tmp_path_factory.mktemp("server")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = (root / "server.log").open("w")
    process = subprocess.Popen(
        [
            MLFLOW,
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{root / 'backend.db'}",
            "--artifacts-destination",
            str(root / "artifacts"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(uri + "/health", timeout=2).read()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"mlflow server did not start:\n{(root / 'server.log').read_text()[-3000:]}"
                ) from None
            time.sleep(0.5)
    yield uri, root
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=30)
    log.close()


def test_a_sweep_logs_to_a_real_mlflow_server_and_fedrun_report_reads_it_back(server, tmp_path):
    uri, root = server
    done = subprocess.run(
        [
            FEDRUN,
            "-m",
            "seed=0,1",
            "schedule.rounds=2",
            "partition.num_clients=5",
            f"tracking.uri={uri}",
            "tracking.experiment=remote",
            "device=cpu",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    client, runs = mlflow_runs(None, "remote", uri=uri)
    _, [parent] = sweep_runs(None, "remote", uri=uri)
    assert sorted(r.data.tags["seed"] for r in runs) == ["0", "1"] and all(r.info.status == "FINISHED" for r in runs)
    assert {r.data.tags["mlflow.parentRunId"] for r in runs} == {
        parent.info.run_id
    } and parent.info.status == "FINISHED"
    for run in runs:  # metrics by round and the artifacts went through the server (proxied to its artifact root)
        history = client.get_metric_history(run.info.run_id, "0_main/test_accuracy")
        assert [m.step for m in history] == [1, 2]
        assert {"metrics.csv", "curves.png", "config.yaml"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    assert any((root / "artifacts").rglob("metrics.csv"))
    report = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedrun.report",
            "--experiment",
            "remote",
            "--tracking-uri",
            uri,
            "--out",
            str(tmp_path / "report"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert report.returncode == 0, report.stderr[-3000:]
    assert "2 finished runs (0 others left out)" in (tmp_path / "report" / "report.md").read_text()
    assert (tmp_path / "report" / "accuracy.png").stat().st_size > 10_000
