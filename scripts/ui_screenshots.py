"""Look at the MLflow UI as a user does: start ``mlflow ui`` on a store, screenshot its pages with headless Chromium.

Takes PNGs of the experiment page (the runs table, a sweep folded under its parent run), the same table
sorted by run name (which lists every job flat), the chart view of those jobs, a run's overview
(description, params, tags), a run's model-metrics page (which charts come first) and the compare page of a
sweep's jobs. Needs Debian's ``chromium`` (``apt-get install chromium``).

MLflow 3.x opens an experiment on its GenAI pages (traces overview) unless the URL says
``workflowType=machine_learning`` or the browser's localStorage (``mlflow.workflowType_v1``) remembers the
"Model training" toggle; the ``mlflow.experimentKind`` tag does not change that. A fresh headless browser has
no localStorage, so every URL here carries ``?workflowType=machine_learning``. A sorting other than by
creation time turns off nesting, so the sorted table and chart view show the jobs rather than the parent's
own metrics. ``--run-all-compositor-stages-before-draw`` makes the experiment chart view draw its charts
(without it they stay loading spinners).

Usage:
    python scripts/ui_screenshots.py --store sqlite:///outputs/mlflow.db --experiment fedrun --out /tmp/ui
    python scripts/ui_screenshots.py --demo --out /tmp/ui     # first runs a small 4-job sweep into a new store
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def demo_store(folder: Path) -> str:
    """A new SQLite store holding one 4-job sweep (FedAvg and FedSoftMax, two seeds, 10 rounds on digits)."""
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    subprocess.run(
        [
            str(BIN / "fedrun"),
            "-m",
            "aggregator=fedavg,fedsoftmax",
            "seed=0,1",
            "schedule.rounds=10",
            "partition=shards",
            "partition.num_clients=10",
            "schedule.clients_per_round=0.5",
            f"tracking.uri={uri}",
            "tracking.experiment=fedrun",
            f"hydra.sweep.dir={folder / 'sweep'}",
        ],
        check=True,
        cwd=folder,
    )
    return uri


def start_ui(uri: str, port: int) -> subprocess.Popen:
    process = subprocess.Popen(
        [str(BIN / "mlflow"), "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return process
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("ui_screenshots: mlflow ui did not start") from None
            time.sleep(0.5)


def screenshot(url: str, path: Path, size: str = "1600,1000") -> None:
    """Render ``url`` in headless Chromium (15 s of virtual time for the page's scripts) into ``path``."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("ui_screenshots: no chromium on PATH (apt-get install chromium)")
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--run-all-compositor-stages-before-draw",
            f"--window-size={size}",
            "--virtual-time-budget=15000",
            f"--screenshot={path}",
            url,
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    print(f"{path}: {url}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", help="MLflow tracking URI of the store to look at")
    parser.add_argument("--experiment", default="fedrun")
    parser.add_argument("--demo", action="store_true", help="make a new store with a small sweep first")
    parser.add_argument("--out", type=Path, default=Path("outputs/ui"))
    args = parser.parse_args()
    if not args.store and not args.demo:
        parser.error("give --store or --demo")
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="fedrun-ui-"))
    uri = demo_store(scratch) if args.demo else args.store

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(args.experiment)
    if experiment is None:
        raise SystemExit(f"ui_screenshots: no experiment {args.experiment!r} in {uri}")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"])
    jobs = [r for r in runs if r.data.tags.get("fedrun.role") != "sweep"]
    parents = [r for r in runs if r.data.tags.get("fedrun.role") == "sweep"]
    children = [r for r in jobs if parents and r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id] or jobs
    port = free_port()
    server = start_ui(uri, port)
    try:
        base, eid = f"http://127.0.0.1:{port}/#", experiment.experiment_id
        ml = "workflowType=machine_learning"  # the "Model training" pages, not the GenAI traces overview
        flat = (
            "orderByKey=" + urllib.parse.quote("tags.`mlflow.runName`") + "&orderByAsc=true"
        )  # not by date: jobs unnested
        run = jobs[0].info.run_id
        compare = urllib.parse.quote(json.dumps([r.info.run_id for r in children[:4]]))
        screenshot(f"{base}/experiments/{eid}/runs?{ml}", args.out / "experiment.png")
        screenshot(f"{base}/experiments/{eid}/runs?{ml}&{flat}", args.out / "experiment_jobs.png")
        screenshot(
            f"{base}/experiments/{eid}/runs?{ml}&{flat}&compareRunsMode=CHART",
            args.out / "experiment_charts.png",
            "1600,1400",
        )
        screenshot(f"{base}/experiments/{eid}/runs/{run}?{ml}", args.out / "run_overview.png", "1600,1400")
        screenshot(f"{base}/experiments/{eid}/runs/{run}/model-metrics?{ml}", args.out / "run_metrics.png", "1600,1400")
        screenshot(
            f"{base}/compare-runs?runs={compare}&experiments={urllib.parse.quote(json.dumps([eid]))}&{ml}",
            args.out / "compare.png",
            "1600,1400",
        )
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
