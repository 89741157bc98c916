"""Look at the MLflow UI as a user does: start ``mlflow ui`` on a store, screenshot its pages with headless Chromium.

Takes PNGs of the experiment page (the runs table, a sweep and a study folded under their parent runs), the
same table sorted by run name (which lists every job flat), the chart view of those jobs, a run's overview
(description, params, tags), the model-metrics page (which charts come first: ``0_main/`` should) of a FedAvg
run, a FedSoftMax run, an asynchronous run and an Optuna study's trial run (``run_metrics_fedavg.png``,
``run_metrics_fedsoftmax.png``, ``run_metrics_async.png``, ``run_metrics_trial.png``; a kind the store lacks is
skipped with a line saying so) and the compare page of a sweep's jobs. Needs Debian's ``chromium``
(``apt-get install chromium``).

MLflow 3.x opens an experiment on its GenAI pages (traces overview) unless the URL says
``workflowType=machine_learning`` or the browser's localStorage (``mlflow.workflowType_v1``) remembers the
"Model training" toggle; the ``mlflow.experimentKind`` tag does not change that. A fresh headless browser has
no localStorage, so every URL here carries ``?workflowType=machine_learning``. A sorting other than by
creation time turns off nesting, so the sorted table and chart view show the jobs rather than the parent's
own metrics. ``--run-all-compositor-stages-before-draw`` makes the experiment chart view draw its charts
(without it they stay loading spinners).

Usage:
    python scripts/ui_screenshots.py --store sqlite:///outputs/mlflow.db --experiment fedrun --out /tmp/ui
    python scripts/ui_screenshots.py --demo --out /tmp/ui     # first makes a new store (below)
    python scripts/ui_screenshots.py --demo --set device.threads=1 --set schedule.rounds=4 --out /tmp/ui

``--demo`` fills a new store with a 4-job sweep (FedAvg and FedSoftMax, two seeds), one asynchronous
FedStaleWeight run and a 2-trial Optuna study of FedSoftMax's temperature (two seeds a trial), all 10 rounds on
digits: 9 jobs, a few minutes on a laptop's CPU. ``--set KEY=VALUE`` (repeatable) is a fedrun override for every
demo job, replacing the demo's own value of that key.
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


# The demo's jobs: small and on digits. ``--set`` replaces these values (or adds keys) in every job.
DEMO = {
    "schedule.rounds": "10",
    "partition": "shards",
    "partition.num_clients": "10",
    "schedule.clients_per_round": "0.5",
    "tracking.experiment": "fedrun",
}


def demo_store(folder: Path, settings: dict[str, str]) -> str:
    """A new SQLite store holding a 4-job sweep (FedAvg and FedSoftMax, two seeds), one asynchronous run
    (FedStaleWeight) and a 2-trial Optuna study of FedSoftMax's temperature with two seeds a trial."""
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    common = [f"{key}={value}" for key, value in {**DEMO, **settings, "tracking.uri": uri}.items()]
    fedrun = [str(BIN / "fedrun")]
    for arguments in (
        ["-m", "aggregator=fedavg,fedsoftmax", "seed=0,1", f"hydra.sweep.dir={folder / 'sweep'}"],
        ["aggregator=fedstaleweight", f"hydra.run.dir={folder / 'async'}"],  # switches to the asynchronous engine
        [
            "-m",
            "hydra/sweeper=optuna",
            "aggregator=fedsoftmax",
            "aggregator.temperature=tag(log,interval(0.05,20))",
            "hydra.sweeper.seeds=[0,1]",
            "hydra.sweeper.n_trials=2",
            f"hydra.sweep.dir={folder / 'study'}",
        ],
    ):
        subprocess.run(fedrun + arguments + common, check=True, cwd=folder)
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


# The runs whose model-metrics page is shot, by the file's name: the newest run a test on its tags accepts, a
# study's seed jobs (tag fedrun.study) after the others.
METRICS_PAGES = {
    "run_metrics_fedavg.png": lambda tags: tags.get("aggregator") == "fedavg",
    "run_metrics_fedsoftmax.png": lambda tags: tags.get("aggregator") == "fedsoftmax",
    "run_metrics_async.png": lambda tags: tags.get("engine") == "async",
    "run_metrics_trial.png": lambda tags: tags.get("fedrun.role") == "trial",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", help="MLflow tracking URI of the store to look at")
    parser.add_argument("--experiment", default="fedrun")
    parser.add_argument(
        "--demo", action="store_true", help="make a new store first: a small sweep, an async run and a small study"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --demo: a fedrun override for every demo job (repeatable), e.g. --set device.threads=1",
    )
    parser.add_argument("--out", type=Path, default=Path("outputs/ui"))
    args = parser.parse_args()
    if not args.store and not args.demo:
        parser.error("give --store or --demo")
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="fedrun-ui-"))
    settings = dict(item.split("=", 1) for item in args.set)
    uri = demo_store(scratch, settings) if args.demo else args.store

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(args.experiment)
    if experiment is None:
        raise SystemExit(f"ui_screenshots: no experiment {args.experiment!r} in {uri}")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"])
    jobs = [r for r in runs if r.data.tags.get("fedrun.role") not in ("sweep", "trial")]  # the runs that train
    parents = [r for r in runs if r.data.tags.get("fedrun.role") == "sweep"]
    parents = [r for r in parents if "fedrun.study" not in r.data.tags] or parents  # a sweep's before a study's
    children = [r for r in jobs if parents and r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id] or jobs
    ordered = sorted(runs, key=lambda r: "fedrun.study" in r.data.tags and r.data.tags.get("fedrun.role") != "trial")
    metrics_pages = {}
    for name, accepts in METRICS_PAGES.items():
        found = next((r for r in ordered if r.data.tags.get("fedrun.role") != "sweep" and accepts(r.data.tags)), None)
        if found is None:
            print(f"ui_screenshots: no run for {name} in {uri}; skipped")
        else:
            metrics_pages[name] = found.info.run_id
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
        for name, run_id in metrics_pages.items():
            screenshot(f"{base}/experiments/{eid}/runs/{run_id}/model-metrics?{ml}", args.out / name, "1600,1400")
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
