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
from fedrun.mlstore import KIND, KIND_TAG, local_store

DEFAULT_STORE = "outputs/mlflow.db"  # conf/config.yaml's tracking.uri, relative to the folder fedrun ran in
MODE = "?workflowType=machine_learning"  # MLflow 3's model-training pages (the default is its GenAI view)


def store_uri(store: str, cwd: Path) -> str:
    """The tracking URI of ``--store``: a server's URL or a database URI (``postgresql://...``) as given; a SQLite
    file (a path or ``sqlite:///path``) or a folder store (``file:`` or a folder) that must exist."""
    if store.startswith(("http://", "https://")):
        return store.rstrip("/")
    path = local_store(store, cwd)
    if path is None:
        return store  # a database server's URI: the MLflow server says if it cannot reach it
    path = path.resolve()
    if store.startswith("file:") or path.is_dir():
        if not path.is_dir():
            raise ConfigError("--store", store, f"an MLflow folder store that exists (none at {path})")
        return path.as_uri()
    if not path.is_file():
        raise ConfigError(
            "--store",
            store,
            f"the MLflow store of fedrun's runs, a file (none at {path}: run fedrun in this folder first, or pass "
            "the file that tracking.uri names)",
        )
    return f"sqlite:///{path}"


def local_folder(uri: str) -> Path | None:
    """The folder a local store lives in (its artifacts go beside it), None for a database server."""
    path = local_store(uri, Path.cwd())
    return None if path is None else path.parent


def address(host: str, port: int) -> str:
    """The base URL to open: a wildcard address is served on this machine's loopback; IPv6 in brackets."""
    shown = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"


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
    ours = [e for e in found if any((t.get("key"), t.get("value")) == (KIND_TAG, KIND) for t in e.get("tags", []))]
    others = [e for e in found if e not in ours and e.get("name") != "Default"]
    lines = [f"fedrun-ui: experiments: {page(base)}"]
    for experiment in (ours + others)[:20]:
        lines.append(f"fedrun-ui:   {experiment['name']}: {page(base, experiment['experiment_id'])}")
    if len(ours + others) > 20:
        lines.append(f"fedrun-ui:   ... and {len(ours + others) - 20} more on the experiments page")
    return lines


def free(host: str, port: int) -> bool:
    """Whether nothing listens on ``host:port``."""
    target = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    family = socket.AF_INET6 if ":" in target else socket.AF_INET
    with socket.socket(family) as probe, contextlib.suppress(OSError):
        probe.settimeout(1)
        return probe.connect_ex((target, port)) != 0
    return True


def start(uri: str, host: str, port: int, log) -> subprocess.Popen:
    """``mlflow server`` on ``uri``, in a new session (its workers with it), its output to the open file ``log``.
    Runs created from the UI keep their artifacts beside the store, as fedrun's do."""
    folder = local_folder(uri)
    artifacts = [] if folder is None else ["--default-artifact-root", (folder / "mlartifacts").as_uri()]
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, *artifacts),
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


def catch_stops() -> None:
    """Ctrl-C (SIGINT), SIGTERM and a closed terminal (SIGHUP) end the UI's wait; the server's group is stopped
    either way. SIGINT and SIGTERM are caught even where the UI inherited them ignored or blocked (a command started
    in the background of a script ignores SIGINT, and Python then leaves it so: Ctrl-C and ``kill -INT`` would leave
    the UI and its server running), as ``fedrun`` catches them during a run. SIGHUP is left ignored where it was
    (``nohup fedrun-ui``: the UI outlives its terminal, as asked)."""
    stops = {signal.SIGINT, signal.SIGTERM} | (
        {signal.SIGHUP} if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN else set()
    )
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt
    for sig in stops - {signal.SIGINT}:
        signal.signal(sig, lambda number, _: sys.exit(128 + number))


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
        if not uri.startswith(("http://", "https://")) and not free(args.host, args.port):
            raise ConfigError(
                "--port", args.port, f"a free port ({args.host}:{args.port} is in use: another UI? pass --port)"
            )
    except ConfigError as exc:
        print(f"fedrun-ui: error: {exc}", file=sys.stderr)
        return 2
    if uri.startswith(("http://", "https://")):  # a tracking server: it serves its own UI
        return listed(uri, args.open)
    catch_stops()
    base = address(args.host, args.port)
    log = tempfile.TemporaryFile("w+")  # the server's output, shown if it fails; nothing written beside the store
    print(f"fedrun-ui: starting MLflow's UI on {uri}", file=sys.stderr, flush=True)
    process = start(uri, args.host, args.port, log)
    try:
        if not ready(base, process, time.monotonic() + args.timeout):
            log.seek(0)
            tail = log.read().strip().splitlines()[-5:]
            print(
                "fedrun-ui: error: the MLflow server did not answer; its log ends:\n  " + "\n  ".join(tail),
                file=sys.stderr,
            )
            return 1
        if code := listed(base, args.open):
            return code
        print("fedrun-ui: Ctrl-C stops the UI and its workers", file=sys.stderr, flush=True)
        process.wait()
        print(f"fedrun-ui: error: the MLflow server stopped (exit {process.returncode})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop(process)
        log.close()


def listed(base: str, open_first: bool) -> int:
    """Print the experiments page and each experiment's runs (and open the first with ``open_first``); one line
    and exit status 1 when the server does not answer the listing (unreachable, or refusing: an authenticated
    server, a host it does not serve)."""
    try:
        lines = shown(base)
    except (OSError, ValueError) as exc:
        print(f"fedrun-ui: error: {base} did not list its experiments ({exc})", file=sys.stderr)
        return 1
    print("\n".join(lines), flush=True)
    if open_first:
        webbrowser.open(lines[min(1, len(lines) - 1)].rsplit(": ", 1)[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
