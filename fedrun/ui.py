"""``fedrun-ui``: MLflow's UI on fedrun's store, opened on the runs.

``mlflow ui`` opens MLflow 3 on its GenAI home (a welcome page, a demo, an assistant panel), and an experiment in
GenAI mode, where the runs table is one click and a mode switch away. ``fedrun-ui`` starts the same server
(``mlflow server``) on the store fedrun wrote (``outputs/mlflow.db`` of the folder it is started in by default,
``tracking.uri``'s default), waits until it answers, then prints the experiments page and each of fedrun's
experiments in model-training mode (``?workflowType=machine_learning``), which is where the runs table and
their charts are, and opens the first in a browser with ``--open``. Ctrl-C (or SIGTERM) stops the server and
its workers: they run in a process group of their own, which is stopped as a whole.

    fedrun-ui                               # outputs/mlflow.db, http://127.0.0.1:5000
    fedrun-ui --store path/to/mlflow.db --port 5001 --open

A store that does not exist is refused in one line (the UI would create an empty one and show nothing); a
tracking server (``http://...``) is not started again: its pages are printed.
"""

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import webbrowser
from pathlib import Path

from fedrun.errors import ConfigError

DEFAULT_STORE = "outputs/mlflow.db"  # conf/config.yaml's tracking.uri, relative to the folder fedrun ran in
MODE = "?workflowType=machine_learning"  # MLflow 3's model-training pages (the default is its GenAI view)
KIND_TAG = "fedrun.kind"  # fedrun.tracking.KIND_TAG: the experiments fedrun made (not imported: mlflow is slow)


def store_uri(store: str, cwd: Path) -> str:
    """The tracking URI of ``--store``: a server's URL as given, else a SQLite file that must exist."""
    if store.startswith(("http://", "https://")):
        return store.rstrip("/")
    path = Path(store[len("sqlite:///") :] if store.startswith("sqlite:///") else store)
    path = (cwd / path).resolve()
    if not path.is_file():
        raise ConfigError(
            "--store",
            store,
            f"the MLflow store of fedrun's runs, a file (none at {path}: run fedrun in this folder first, or pass "
            "the file that tracking.uri names)",
        )
    return f"sqlite:///{path}"


def page(base: str, experiment_id: str | None = None) -> str:
    """The experiments page, or one experiment's runs, in model-training mode."""
    return f"{base}/#/experiments{f'/{experiment_id}/runs' if experiment_id else ''}{MODE}"


def experiments(base: str) -> list[dict]:
    """The store's experiments, the most recently updated first, through the server's REST API."""
    request = urllib.request.Request(
        f"{base}/api/2.0/mlflow/experiments/search",
        data=json.dumps({"max_results": 1000, "order_by": ["last_update_time DESC"]}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response).get("experiments", [])


def shown(base: str) -> list[str]:
    """Lines that name the experiments page and each experiment's runs (fedrun's first)."""
    found = experiments(base)
    ours = [e for e in found if any(t.get("key") == KIND_TAG for t in e.get("tags", []))]
    others = [e for e in found if e not in ours and e.get("name") != "Default"]
    lines = [f"fedrun-ui: experiments: {page(base)}"]
    for experiment in (ours + others)[:20]:
        lines.append(f"fedrun-ui:   {experiment['name']}: {page(base, experiment['experiment_id'])}")
    if len(ours + others) > 20:
        lines.append(f"fedrun-ui:   ... and {len(ours + others) - 20} more on the experiments page")
    return lines


def free(host: str, port: int) -> bool:
    """Whether nothing listens on ``host:port``."""
    with socket.socket() as probe, contextlib.suppress(OSError):
        probe.settimeout(1)
        return probe.connect_ex((host, port)) != 0
    return True


def start(uri: str, host: str, port: int, log) -> subprocess.Popen:
    """``mlflow server`` on ``uri``, in a new session (its workers with it), its output to the open file ``log``.
    Runs created from the UI keep their artifacts beside the store, as fedrun's do."""
    artifacts = Path(uri[len("sqlite:///") :]).parent / "mlartifacts"
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "mlflow", "server"),
            *("--backend-store-uri", uri, "--default-artifact-root", artifacts.as_uri()),
            *("--no-serve-artifacts", "--host", host, "--port", str(port), "--workers", "1"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop(process: subprocess.Popen) -> None:
    """Stop the server's process group: SIGTERM, then SIGKILL after 15 s."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=wait)
            return


def ready(base: str, process: subprocess.Popen, deadline: float) -> bool:
    """Wait until the server answers ``/health`` (True) or exits or runs past ``deadline`` (False)."""
    while time.monotonic() < deadline and process.poll() is None:
        with contextlib.suppress(OSError):
            urllib.request.urlopen(f"{base}/health", timeout=2).read()
            return True
        time.sleep(0.3)
    return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedrun-ui",
        description="MLflow's UI on fedrun's store, opened on the runs (model-training mode). Ctrl-C stops it and "
        "its workers.",
    )
    parser.add_argument("--store", default=DEFAULT_STORE, help=f"fedrun's MLflow store (default {DEFAULT_STORE})")
    parser.add_argument("--host", default="127.0.0.1", help="the address to serve on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=5000, help="the port (default 5000)")
    parser.add_argument("--open", action="store_true", help="open the first experiment's runs in a browser")
    parser.add_argument("--timeout", type=float, default=120, help="seconds to wait for the server to answer")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        uri = store_uri(args.store, Path.cwd())
        if not 0 < args.port < 65536:
            raise ConfigError("--port", args.port, "a port from 1 to 65535")
        if uri.startswith("sqlite:///") and not free(args.host, args.port):
            raise ConfigError(
                "--port", args.port, f"a free port ({args.host}:{args.port} is in use: another UI? pass --port)"
            )
    except ConfigError as exc:
        print(f"fedrun-ui: error: {exc}", file=sys.stderr)
        return 2
    if not uri.startswith("sqlite:///"):  # a tracking server: it serves its own UI
        lines = shown(uri)
        print("\n".join(lines), flush=True)
        if args.open:
            webbrowser.open(lines[min(1, len(lines) - 1)].split(": ", 2)[-1])
        return 0
    base = f"http://{args.host}:{args.port}"
    log = tempfile.TemporaryFile("w+")  # the server's output, shown if it fails; nothing written beside the store
    print(f"fedrun-ui: starting MLflow's UI on {uri}", file=sys.stderr, flush=True)
    process = start(uri, args.host, args.port, log)
    # Ctrl-C and SIGTERM end the wait below; the server's group is stopped either way.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        if not ready(base, process, time.monotonic() + args.timeout):
            log.seek(0)
            tail = log.read().strip().splitlines()[-5:]
            print(
                "fedrun-ui: error: the MLflow server did not answer; its log ends:\n  " + "\n  ".join(tail),
                file=sys.stderr,
            )
            return 1
        lines = shown(base)
        print("\n".join(lines), flush=True)
        if args.open:
            webbrowser.open(lines[min(1, len(lines) - 1)].split(": ", 2)[-1])
        print("fedrun-ui: Ctrl-C stops the UI and its workers", file=sys.stderr, flush=True)
        process.wait()
        print(f"fedrun-ui: error: the MLflow server stopped (exit {process.returncode})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop(process)
        log.close()


if __name__ == "__main__":
    sys.exit(main())
