"""Tracking: one MLflow run per job, plus metrics.csv, alpha.csv and plots in the job's output dir.

The CSV files are appended every round, so a run that dies keeps what it measured; MLflow gets one
batched call per round. With ``enabled: false`` only the files are written.

Per-client series (``alpha.csv``, ``local_steps.csv``) are wide, a row per round and a ``client_<id>`` column
per client (0 for clients not in the round), up to ``WIDE_CLIENTS`` clients; above that they are long, a
row per (round, client) for the clients with a non-zero value only, so their size follows the cohorts, not
the population; a series whose zeros are values (``DENSE``: a client judged at 0% accuracy) has a row for every
client. ``per_client_table`` reads either layout as the wide one.
"""

from __future__ import annotations

import csv
import functools
import math
import os
import re
import sys
import time
import typing
import urllib.request
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from fedrun.errors import ConfigError
from fedrun.mlstore import KIND, KIND_TAG, SQLITE, local_store
from fedrun.runfiles import appended, replaced

if typing.TYPE_CHECKING:  # pandas is imported where a table is read or written: a refusal on the way to a run,
    import pandas as pd  # which imports this module, needs none of it (scripts/bench_cli_start.py)
    import torch

# MLflow 3 opens an experiment without this tag as a GenAI one (traces, token usage); fedrun's are model training.
PER_CLIENT = (
    "alpha",
    "local_steps",
    "selected",
    "personal_accuracy",
)  # the per-client series the engines report (``<name>.csv``)
WIDE_CLIENTS = 1000  # per-client CSV files are wide up to this many clients, long above
DENSE = ("personal_accuracy",)  # per-client series whose zeros are values: every client in the long layout too


def _root_config() -> dict:
    """The root config (conf/config.yaml) as plain data."""
    from importlib.resources import files

    import yaml

    return yaml.safe_load(files("fedrun.conf").joinpath("config.yaml").read_text())


def _root_defaults() -> dict[str, str | None]:
    """The root config's defaults list (conf/config.yaml), group -> default option, in its order."""
    defaults = _root_config()["defaults"]
    return {name: option for entry in defaults if isinstance(entry, dict) for name, option in entry.items()}


ROOT_DEFAULTS = _root_defaults()
# The user's store: where a run goes when nothing says otherwise (``tracking.uri`` of conf/config.yaml), relative to
# the directory a command starts in; fedrun-import and fedrun-report default to it too.
DEFAULT_URI = _root_config()["tracking"]["uri"]
# Config groups whose chosen option becomes a run tag (and a grouping key in fedrun-report), in the defaults list's
# order (``sweep`` left out: a named sweep is a multirun, not a run's choice); a new group in conf/config.yaml is a
# tag and a report key without a code edit.
CONFIG_GROUPS = tuple(name for name in ROOT_DEFAULTS if name != "sweep")


def group_defaults() -> dict[str, str]:
    """Each group's default option in the root config (``pipeline: none``), for the groups that have one: what a
    run made before its group existed ran as."""
    return {name: option for name, option in ROOT_DEFAULTS.items() if isinstance(option, str)}


@functools.cache
def option_defaults(group: str, option: str) -> dict:
    """The plain top-level values of ``conf/<group>/<option>.yaml`` (``{"t": 1.0, "tau": None}`` for
    ``aggregator/term``): no ``_target_``, interpolation, list or mapping; empty for an option that is not a file
    of fedrun's (a user's, a name read from a store)."""
    from importlib.resources import files

    import yaml

    if not all(part.replace("_", "").isalnum() for part in (group, option)):  # a name from a store, not a path
        return {}
    path = files("fedrun.conf").joinpath(group, f"{option}.yaml")
    try:
        content = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}
    if not isinstance(content, dict):
        return {}
    plain = (bool, int, float, str, type(None))
    return {
        key: value
        for key, value in content.items()
        if key not in ("_target_", "defaults") and isinstance(value, plain) and "${" not in str(value)
    }


def flatten(config: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists stay values."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def numeric_rows(path: Path, header: list[str] | None, reader) -> list[list[str]]:
    """The rows of a per-round CSV file fedrun wrote, checked: a ``round`` column, a cell per column, every cell a
    number or empty (as fedrun writes them); a ConfigError naming the file, the line and the cell otherwise."""
    if header is None:
        return []
    if "round" not in header:
        raise ConfigError("resume", str(path), "a file fedrun wrote (its header has no round column)")
    at, rows = header.index("round"), []
    for line, row in enumerate(reader, start=2):
        if len(row) != len(header):
            raise ConfigError(
                "resume", str(path), f"a file fedrun wrote (line {line}: {len(row)} cells for {len(header)})"
            )
        for column, cell in enumerate(row):
            try:
                float(cell or ("" if column == at else "0"))  # empty: not measured that round (a round never is)
            except ValueError:
                raise ConfigError(
                    "resume", str(path), f"a file fedrun wrote (line {line}: {cell[:40]!r} is no number)"
                ) from None
        rows.append(row)
    return rows


def resolve_uri(uri: str, start_dir: Path) -> str:
    """Make a relative ``sqlite:///`` URI absolute against the directory fedrun was started in."""
    if uri.startswith(SQLITE) and not Path(uri[len(SQLITE) :]).is_absolute():
        db = local_store(uri, start_dir).resolve()
        db.parent.mkdir(parents=True, exist_ok=True)
        return SQLITE + str(db)
    return uri


def log_run_dir(directory: Path, uri: str) -> None:
    """Log the run dir's files as the open MLflow run's artifacts, except a tracking store kept in it: the SQLite
    file of ``uri`` with its journals, and a folder holding the local artifact root. Logging that root into itself
    never ends (each copy lands inside the root it copies; seen with ``tracking.uri=sqlite:///<run dir>/mlflow.db``)."""
    import mlflow

    root = mlflow.get_artifact_uri()
    root = Path(root.removeprefix("file://")).resolve() if root.startswith(("file://", "/")) else None
    db = local_store(uri, Path.cwd()).resolve() if uri.startswith(SQLITE) else None
    for entry in sorted(Path(directory).iterdir()):
        resolved = entry.resolve()
        if root is not None and root.is_relative_to(resolved):
            continue
        if db is not None and resolved.parent == db.parent and f"{resolved.name}-".startswith(f"{db.name}-"):
            continue  # the store, or its journal (-journal, -wal, -shm); a store named my-runs.db too
        if entry.is_dir():
            mlflow.log_artifacts(str(entry), artifact_path=entry.name)
        else:
            mlflow.log_artifact(str(entry))


PREFLIGHT_TIMEOUT_S = 10
# MLflow retries an unreachable server for minutes by default; a run that loses its server mid-run should
# stall for seconds, not minutes, before it goes on with the files alone (the user's own settings win).
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")


def preflight(uri: str) -> None:
    """Raise a one-line ConfigError for ``tracking.uri`` unless its store answers (within about 10 s)."""
    if uri.startswith(("http://", "https://")):
        try:
            urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=PREFLIGHT_TIMEOUT_S).read()
        except (OSError, ValueError) as exc:
            raise ConfigError(
                "tracking.uri",
                uri,
                f"a reachable MLflow server ({getattr(exc, 'reason', exc)}); "
                "or tracking.enabled=false and fedrun-import later",
            ) from None
        return
    try:
        open_client(uri).search_experiments(max_results=1)
    except Exception as exc:  # a scheme MLflow does not know, a database it cannot open
        raise ConfigError(
            "tracking.uri", uri, f"a tracking URI MLflow can open ({str(exc).splitlines()[0][:200]})"
        ) from None


def retried(call, attempts: int = 8):
    """``call()``, retried with backoff while SQLite says the database is locked (parallel jobs sharing one store
    write at the same moment; MLflow's advice for SQLite is to serialise or retry writes)."""
    for attempt in range(attempts):
        try:
            return call()
        except Exception as exc:
            if "database is locked" not in str(exc) or attempt == attempts - 1:
                raise
            time.sleep(0.05 * 2**attempt)


# The store, for the code around the runs (sweeps' and trials' parent runs, fedrun-import, fedrun-report): these
# functions are its only way to MLflow, so MLflow is imported here alone. A client is an opaque handle to pass back.
# Retrying stays with the callers: a parallel sweep's writes retry, a one-off import or report fails at once.
MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100  # what one MLflow log_batch takes (metrics + params + tags <= 1000)


def open_client(uri: str):
    """An MLflow client of the store at ``uri``."""
    import mlflow

    return mlflow.MlflowClient(tracking_uri=uri)


def find_experiment(client, name: str) -> str | None:
    """The id of the experiment called ``name``, or None when there is none."""
    experiment = client.get_experiment_by_name(name)
    return None if experiment is None else experiment.experiment_id


def experiment_names(client) -> list[str]:
    """The names of the store's experiments."""
    return [experiment.name for experiment in client.search_experiments()]


def create_experiment(client, name: str) -> str:
    """Create the experiment ``name`` with MLflow's defaults (see ``Tracker.experiment_id`` for a run's own); its id."""
    return client.create_experiment(name)


def create_run(client, experiment_id: str, name: str, tags: dict[str, str]) -> str:
    """Create a RUNNING run called ``name`` with ``tags`` (``mlflow.parentRunId`` makes it a child); its id."""
    return client.create_run(experiment_id, run_name=name, tags=tags).info.run_id


def reopen_run(client, run_id: str) -> None:
    """Mark an ended run RUNNING again (a resumed sweep's or trial's parent run)."""
    client.update_run(run_id, status="RUNNING")


def end_run(client, run_id: str, status: str) -> None:
    """End the run with ``status`` (``FINISHED``, ``FAILED`` or ``KILLED``)."""
    client.set_terminated(run_id, status)


def child_runs(client, run_id: str) -> list[tuple[str, dict[str, str]]]:
    """The status and tags of each run whose ``mlflow.parentRunId`` is ``run_id`` (up to 50,000: MLflow's largest
    page)."""
    experiment_id = client.get_run(run_id).info.experiment_id
    children = client.search_runs(
        [experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run_id}'", max_results=50_000
    )
    return [(child.info.status, child.data.tags) for child in children]


def search_runs(uri: str, experiment_id: str, filter_string: str = "") -> pd.DataFrame:
    """The experiment's runs matching the MLflow filter, a row each (``run_id``, ``status``, ``params.<key>``,
    ``tags.<key>``, ``metrics.<name>`` with the last value: ``mlflow.search_runs``'s columns)."""
    import mlflow

    mlflow.set_tracking_uri(uri)  # mlflow.search_runs reads the process's store, not a client's
    return mlflow.search_runs([experiment_id], filter_string=filter_string, output_format="pandas")


def metric_history(client, run_id: str, name: str) -> list:
    """Every value the run logged for metric ``name``, each with its ``step`` and ``value``; empty if none."""
    return client.get_metric_history(run_id, name)


def log_batch(
    client,
    run_id: str,
    metrics: Iterable[tuple] = (),
    params: Iterable[tuple[str, object]] = (),
    tags: Iterable[tuple[str, str]] = (),
) -> None:
    """Log metrics ``(name, value, step)``, params and tags ``(key, value)`` to the run, in as few MLflow calls as its
    batch limits allow (one for the usual handful).

    Args:
        client: From ``open_client``.
        run_id: The run.
        metrics: ``(name, value, step)`` each, or ``(name, value, step, timestamp)`` (milliseconds since the epoch;
            default: now, one time for the whole batch, as one MLflow call would have).
        params: ``(key, value)`` each; a value is logged as ``str(value)``.
        tags: ``(key, value)`` each.
    """
    from mlflow.entities import Metric, Param, RunTag

    now = int(time.time() * 1000)
    metrics = [Metric(m[0], m[1], m[3] if len(m) > 3 else now, m[2]) for m in metrics]
    params = [Param(key, str(value)) for key, value in params]
    tags = [RunTag(key, value) for key, value in tags]
    while metrics or params or tags:
        some_params, params = params[:MAX_PARAMS], params[MAX_PARAMS:]
        some_tags, tags = tags[:MAX_TAGS], tags[MAX_TAGS:]
        room = MAX_METRICS - len(some_params) - len(some_tags)
        some_metrics, metrics = metrics[:room], metrics[room:]
        client.log_batch(run_id, metrics=some_metrics, params=some_params, tags=some_tags)


def log_artifact(client, run_id: str, path: Path, folder: str | None = None) -> None:
    """Copy the file at ``path`` into the run's artifacts, under ``folder`` (None: at their top)."""
    client.log_artifact(run_id, str(path), folder)


def set_tag(client, run_id: str, key: str, value: str) -> None:
    """Set one tag on the run."""
    client.set_tag(run_id, key, value)


# MLflow's run page draws one section of charts per prefix before the last "/" (``alpha/client_3`` is in ``alpha``),
# the sections in alphabetical order and the metrics without a prefix last ("Model metrics"; MLflow 3's
# RunsChartsCardConfig), each section's charts sorted by name. Each metric gets the prefix of the section a reader
# looks for it in, numbered so that the sections come in that order (a digit sorts before letters in either case):
# the curves of test accuracy and loss, training loss and the clients' own accuracy; the R-index (a section of its
# own: in one with the curves, "R90" would sort before "test_accuracy"); a section per feature that ran (privacy,
# compression, selection, the attack, the robust rule, clipping, personalisation); communication; timings; the
# run's summaries (one point each, logged when it ends). What is left (the learning rate, the cohort, the
# aggregator's own diagnostics) is in "Model metrics". These are MLflow's names only: the CSV files, reports and
# ``--metrics`` keep the plain ones (``plain_name``).
MAIN_SECTION, R_INDEX_SECTION = "0_main/", "1_r_index/"
MAIN_METRICS = ("test_accuracy", "test_loss", "train_loss", "client_accuracy")
MAIN_R_INDEX = re.compile(r"^(client_)?R\d+(\.\d+)?$")  # R90, client_R90 (not R90_mb or R90_time)
FEATURE_METRICS = {  # a feature's metrics, by name
    "2_privacy/": (
        "epsilon",
        "epsilon_deployment",
        "clip_norm",
        "clipped_fraction",
        "noise_std",
        "update_norm_mean",
        "unclipped_fraction_noised",
    ),
    "2_selection/": ("selection_p_min", "selection_p_max", "selection_p_cv", "selection_cv", "clients_never_selected"),
    "3_communication/": ("upload_mb", "download_mb"),
}
FEATURE_PREFIXES = {  # a feature's metrics, by their own prefix
    "attack/": "2_attack/",
    "robust/": "2_robust/",
    "clip/": "2_clipping/",
    "personal/": "2_personal/",
    "fairness/": "2_fairness/",
}
COMPRESSION = re.compile(r"^[a-z_]+/(bits_per_coordinate|relative_error)$")  # topk/bits_per_coordinate
TIMING_SECTION, SUMMARY_SECTION = "4_timing/", "5_summary/"
SECTION = re.compile(r"^[0-9]_[a-z_]+/")
# A method's headline, drawn first on the run's page: in the main section, whose charts MLflow sorts by name, before
# the global model's curves, which measure neither a personal method (FedPer's global head is never trained) nor what
# a private run spent. Runs stored before (November 2026) have them under their feature's section (``FORMER``).
HEADLINE = {
    "epsilon": MAIN_SECTION + "epsilon",
    "personal/accuracy_mean": MAIN_SECTION + "personal_accuracy_mean",
    "personal/accuracy_min": MAIN_SECTION + "personal_accuracy_min",
}
HEADLINE_PLAIN = {shown: plain for plain, shown in HEADLINE.items()}
FORMER = {
    "epsilon": "2_privacy/epsilon",
    "personal/accuracy_mean": "2_personal/accuracy_mean",
    "personal/accuracy_min": "2_personal/accuracy_min",
}


def mlflow_name(name: str, summary: bool = False) -> str:
    """The name a metric has in MLflow: ``0_main/test_accuracy``, ``1_r_index/R90``, ``2_privacy/noise_std``,
    ``2_compression/topk/bits_per_coordinate``, ``3_communication/upload_mb``, ``4_timing/train_wall_s``; a run's
    summary (``summary``: logged once, when it ends) ``5_summary/<name>`` unless its name has a section (an
    R-index stays with the R-index, a feature's with its feature); a method's ``HEADLINE`` first in the main section;
    anything else its own name."""
    if name in HEADLINE and not summary:
        return HEADLINE[name]
    if name in MAIN_METRICS:
        return MAIN_SECTION + name
    if MAIN_R_INDEX.match(name):
        return R_INDEX_SECTION + name
    for section, names in FEATURE_METRICS.items():
        if name in names:
            return section + name
    for prefix, section in FEATURE_PREFIXES.items():
        if name.startswith(prefix) and not summary:
            return section + name.removeprefix(prefix)
    if COMPRESSION.match(name):
        return "2_compression/" + name
    if name.endswith("_wall_s") and not summary:
        return TIMING_SECTION + name
    return SUMMARY_SECTION + name if summary else name


def stored_names(name: str) -> list[str]:
    """Every name a per-round metric may have in MLflow, the current first: a headline's name in runs stored before
    ``HEADLINE`` (``FORMER``), then the name without a section (runs stored before sections)."""
    return list(dict.fromkeys([mlflow_name(name), *([FORMER[name]] if name in FORMER else []), name]))


def plain_name(name: str) -> str:
    """The inverse of ``mlflow_name`` (a name without a section is returned as it is: runs stored before them)."""
    if name in HEADLINE_PLAIN:
        return HEADLINE_PLAIN[name]
    plain = SECTION.sub("", name, count=1)
    for prefix, section in FEATURE_PREFIXES.items():
        if name.startswith(section):
            return prefix + plain
    return plain


HEATMAP_CLIENTS = 100  # clients in the alpha heatmap of a long alpha.csv: those with the largest total alpha


def per_client_table(path: Path) -> pd.DataFrame:
    """A per-client CSV file (``<name>.csv``), wide or long, as the wide table: indexed by ``round``, a
    ``client_<id>`` column per client of the file, in client order (a long file's client without a row in a round:
    0, the value the wide layout writes for it; a long file has no column for a client never in it)."""
    import pandas as pd

    table = pd.read_csv(path)
    if list(table.columns[:2]) != ["round", "client"] or len(table.columns) != 3:
        return table.set_index("round")
    name = table.columns[2]
    wide = table.pivot(index="round", columns="client", values=name)
    if name not in DENSE:  # absent: not in the round (a DENSE series's NaN, a client without samples, stays NaN)
        wide = wide.fillna(0.0)
    wide.columns = [f"client_{c}" for c in wide.columns]
    return wide.rename_axis(None, axis=1)


def widest(long: pd.DataFrame, name: str, clients: int) -> pd.DataFrame:
    """The wide table (``round`` and ``client_<id>`` columns, 0 where absent) of the ``clients`` clients with
    the largest total ``name`` in a long per-client table, in client order."""
    top = long.groupby("client")[name].sum().nlargest(clients).index.sort_values()
    wide = long[long["client"].isin(top)].pivot_table(index="round", columns="client", values=name, fill_value=0.0)
    wide = wide.reindex(index=sorted(long["round"].unique()), columns=top, fill_value=0.0)
    wide.columns = [f"client_{c}" for c in wide.columns]
    return wide.rename_axis(None, axis=1).reset_index()


# At most this many seconds between a round's measurement and its arrival in MLflow (``Tracker.flush``): rounds
# shorter than that go together, one commit for several.
FLUSH_S = 1.0


class Tracker:
    """Records one run.

    Args:
        output_dir: The job's output directory (Hydra's run dir).
        num_clients: Number of clients (columns of alpha.csv).
        enabled: Whether to log to MLflow.
        uri: MLflow tracking URI (absolute; see ``resolve_uri``).
        experiment: MLflow experiment name.
        max_alpha_series: Log ``alpha/client_<id>`` metric series only up to this many clients.
        alpha_informative: Whether alpha carries information beyond p_i (``Aggregator.alpha_informative``): only then
            are its per-client series logged to MLflow, where FedAvg's flat lines would come before the curves.

    It only logs: the run's summary is computed by ``fedrun.metrics.run_summary`` (from ``rows``, every row logged
    so far) and handed to ``finish``.
    """

    def __init__(
        self,
        output_dir: Path,
        num_clients: int,
        enabled: bool,
        uri: str,
        experiment: str,
        max_alpha_series: int = 100,
        alpha_informative: bool = True,
    ):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.enabled, self.uri, self.experiment = enabled, uri, experiment
        self.alpha_series = alpha_informative and num_clients <= max_alpha_series
        self.wide = num_clients <= WIDE_CLIENTS
        self.metrics_path, self.alpha_path = self.dir / "metrics.csv", self.dir / "alpha.csv"
        self._columns: dict[Path, list[str]] = {}  # each CSV file's header so far
        self.run_id: str | None = None
        self.experiment_key: str | None = None  # the MLflow experiment's id
        self.lost: str | None = None  # why MLflow stopped taking this run's data mid-run, if it did
        self.rows: list[dict] = []  # the metrics rows so far, those before a resume too (the summary's input)
        # A reopened run (resumed, or restarted before its first checkpoint): the rounds MLflow already holds, read
        # at the first round logged (None: not read yet, or a new run, which holds none).
        self.reopened, self.logged_through = False, None
        # Rounds measured and not yet sent to MLflow: (name, value, step, timestamp), sent together at most
        # ``FLUSH_S`` after the first of them, before each checkpoint and when the run ends (``flush``).
        self.pending: list[tuple[str, float, int, int]] = []
        self.pending_since: float | None = None
        self.client = None  # an MLflow client of the store, once ``flush`` needs one

    def start(self, params: dict, tags: dict, run_name: str, run_id: str | None = None) -> None:
        """Open the MLflow run (when enabled) and log the flattened config and tags; with ``run_id``, reopen
        that run (a resumed one: its params and tags are already there)."""
        if not self.enabled:
            return
        import mlflow

        mlflow.set_tracking_uri(self.uri)
        if run_id is not None:
            info = retried(lambda: mlflow.start_run(run_id=run_id, log_system_metrics=False)).info
            self.run_id, self.experiment_key, self.reopened = info.run_id, info.experiment_id, True
            return
        experiment_id = self.experiment_id(self.uri, self.experiment)
        self.run_id = retried(
            lambda: mlflow.start_run(experiment_id=experiment_id, run_name=run_name, log_system_metrics=False)
        ).info.run_id
        self.experiment_key = experiment_id
        retried(lambda: mlflow.log_params(params))
        retried(lambda: mlflow.set_tags(tags))

    @staticmethod
    def experiment_id(uri: str, name: str) -> str:
        """The experiment's id, created if needed (by whichever parallel job gets there first)."""
        client = open_client(uri)
        for _ in range(2):
            experiment = retried(lambda: client.get_experiment_by_name(name))
            if experiment is not None:
                if experiment.tags.get(KIND_TAG) != KIND:  # made by an older fedrun, or by hand
                    retried(lambda: client.set_experiment_tag(experiment.experiment_id, KIND_TAG, KIND))
                return experiment.experiment_id
            # A local store keeps artifacts beside the database, never in a stray ./mlruns.
            location = (
                (Path(uri[len("sqlite:///") :]).parent / "mlartifacts").as_uri()
                if uri.startswith("sqlite:///")
                else None
            )
            try:
                return client.create_experiment(name, artifact_location=location, tags={KIND_TAG: KIND})
            except Exception:  # another job created it meanwhile: read it back
                continue
        raise RuntimeError(f"cannot create or find MLflow experiment {name!r} in {uri}")

    def _lost(self, exc: Exception) -> None:
        self.lost = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}" if str(exc) else type(exc).__name__
        print(
            f"\nfedrun: warning: MLflow stopped taking this run's data ({self.lost}); training goes on and every round "
            f"goes to {self.metrics_path}. Afterwards: fedrun-import {self.dir}",
            file=sys.stderr,
            flush=True,
        )

    def rewind(self, round_: int) -> None:
        """Keep only the rows of rounds <= ``round_`` in the per-round CSV files (those a killed run wrote after
        its last checkpoint are measured again), and continue appending to them. A file from elsewhere is data: a
        header without ``round``, or a cell that is no number (a spreadsheet formula), is a ConfigError naming the
        file and its line, before anything is rewritten."""
        for path in [self.metrics_path] + [self.dir / f"{name}.csv" for name in PER_CLIENT]:
            if not path.exists():
                continue
            with path.open(newline="") as handle:
                reader = csv.reader(handle)
                header = next(reader, None)
                rows = [
                    row for row in numeric_rows(path, header, reader) if float(row[header.index("round")]) <= round_
                ]
            if header is None:
                continue
            with replaced(path, newline="") as handle:
                writer = csv.writer(handle)
                writer.writerow(header)
                writer.writerows(rows)
            self._columns[path] = header
        if self.metrics_path.exists():
            import pandas as pd

            self.rows = pd.read_csv(self.metrics_path).to_dict("records")

    def log_partition(
        self, clients: list[np.ndarray], labels: np.ndarray, num_classes: int, held_out: list[np.ndarray] | None = None
    ) -> None:
        """Write ``partition.csv``: per client its training samples, held-out samples (when any) and count per label.
        A population's clients are drawn when they train: listing them all would draw them all, so it has none."""
        from fedrun.partitions import LazyClients

        if isinstance(clients, LazyClients):
            return
        counts = (
            np.stack([np.bincount(labels[part], minlength=num_classes) for part in clients])
            if clients
            else np.zeros((0, num_classes))
        )
        import pandas as pd

        table = pd.DataFrame(counts, columns=[f"label_{c}" for c in range(num_classes)])
        table.insert(0, "samples", [len(part) for part in clients])
        if held_out is not None:
            table.insert(1, "held_out", [len(part) for part in held_out])
        table.insert(0, "client", range(len(clients)))
        with replaced(self.dir / "partition.csv", newline="") as handle:
            table.to_csv(handle, index=False)

    def log_round(self, row: dict, per_client: dict[str, np.ndarray]) -> None:
        """Append the round to the CSV files (``metrics.csv``, ``<name>.csv`` per per-client series) and send
        it to MLflow in one batch."""
        self._append(self.metrics_path, row)
        self.rows.append(dict(row))
        for name, values in per_client.items():
            if self.wide:
                self._append(
                    self.dir / f"{name}.csv",
                    {"round": row["round"], **{f"client_{i}": v for i, v in enumerate(values)}},
                )
            else:
                self._append_long(self.dir / f"{name}.csv", name, row["round"], values)
        alpha = per_client["alpha"]
        if self.enabled and self.lost is None:
            values = {mlflow_name(k): float(v) for k, v in row.items() if k != "round" and not math.isnan(float(v))}
            if self.alpha_series:
                values.update({f"alpha/client_{i}": float(a) for i, a in enumerate(alpha)})
            try:
                step, now = int(row["round"]), int(time.time() * 1000)
                if not self.holds(step, list(values)):
                    self.pending.extend((name, value, step, now) for name, value in values.items())
                    self.pending_since = self.pending_since or time.monotonic()
                if self.pending_since is not None and time.monotonic() - self.pending_since >= FLUSH_S:
                    self.flush()
            except Exception as exc:  # the store went away: keep training, the files have every round
                self._lost(exc)

    def flush(self) -> None:
        """Send the rounds measured since the last call to MLflow, in one call (as few as its batch limits allow):
        each call is a commit, about 10 ms on a local SQLite store, 2% of a 0.4-s round when made every round
        (scripts/bench.py's cross-device workload). Called before each checkpoint (so that a run killed after it
        and resumed from it misses no round in MLflow: the rounds after it are measured and logged again) and when
        the run ends. A store that fails here is lost as in ``log_round``: the files have every round."""
        pending, self.pending, self.pending_since = self.pending, [], None
        if not pending or not self.enabled or self.lost is not None or self.run_id is None:
            return
        try:
            self.client = self.client or open_client(self.uri)
            retried(lambda: log_batch(self.client, self.run_id, metrics=pending))
        except Exception as exc:
            self._lost(exc)

    def holds(self, round_: int, names: list[str]) -> bool:
        """Whether the reopened MLflow run already holds round ``round_``: a run killed after logging a round and
        before checkpointing it measures the round again on resume (bit for bit the same numbers, but its wall
        times), and MLflow's metric history only appends, so logging it again would show the round twice. The
        rounds held are those of the first and the last metric of the round's batch (``names``: the whole batch
        when a kill fell between MLflow's chunks of a wide one), read once; its files are rewritten all the same."""
        if not self.reopened or not names:
            return False
        if self.logged_through is None:
            client = self.client = self.client or open_client(self.uri)
            steps = [
                max((m.step for m in retried(lambda n=n: metric_history(client, self.run_id, n))), default=0)
                for n in (names[0], names[-1])
            ]
            self.logged_through = min(steps)
        return round_ <= self.logged_through

    def _append(self, path: Path, row: dict) -> None:
        columns = self._columns.setdefault(path, [])
        if len(row) == len(columns) and row.keys() == set(columns):  # the usual case, in O(columns) for wide files
            new = []
        else:
            known = set(columns)
            new = [key for key in row if key not in known]
        if not new:
            with appended(path, newline="") as handle:
                csv.DictWriter(handle, fieldnames=columns).writerow(row)
            return
        # The first row, or a column that appeared mid-run (a hybrid's next phase): rewrite the file with the
        # wider header, its rows read back from disk (nothing is kept in memory; this happens a few times a run).
        rows = []
        if columns:
            with path.open(newline="") as handle:
                rows = list(csv.DictReader(handle))
        columns.extend(new)
        with replaced(path, newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows + [row])

    def _append_long(self, path: Path, name: str, round_: int, values: np.ndarray) -> None:
        """One (round, client, value) row per client with a non-zero value (every client for a ``DENSE`` series)."""
        clients = np.arange(len(values)) if name in DENSE else np.flatnonzero(values)
        rows = zip([round_] * len(clients), clients.tolist(), values[clients].tolist())
        if path in self._columns:
            with appended(path, newline="") as handle:
                csv.writer(handle).writerows(rows)
            return
        self._columns[path] = ["round", "client", name]
        with replaced(path, newline="") as handle:  # a new file, or a rerun's
            writer = csv.writer(handle)
            writer.writerow(self._columns[path])
            writer.writerows(rows)

    def log_tables(self, tables: dict) -> None:
        """Write the engine's named tables as CSV files (logged as artifacts at the end)."""
        for name, table in tables.items():
            with replaced(self.dir / name, newline="") as handle:
                table.to_csv(handle, index=False)

    def finish(
        self,
        status: str,
        values: dict | None = None,
        tags: dict | None = None,
        model: torch.nn.Module | None = None,
        reason: str | None = None,
        title: str = "",
    ) -> None:
        """Write the summary, final model and plots; log them as artifacts; end the MLflow run.

        Args:
            status: ``FINISHED``, ``FAILED`` or ``KILLED``.
            values: The run's summary metrics (``fedrun.metrics.run_summary``).
            tags: Run-level tags (the summary's, the aggregator's).
            model: The final global model, saved as ``model.pt``.
            reason: Why the run failed, kept as the ``failure_reason`` tag.
            title: Plot title.
        """
        import pandas as pd

        self.flush()
        metrics = pd.DataFrame(self.rows) if self.rows else None
        values, tags = dict(values or {}), dict(tags or {})
        # what MLflow has of alpha: its per-client series, or alpha.csv and the heatmap alone (fedrun-import reads it)
        tags["alpha_series"] = "per_client" if self.alpha_series else "artifacts"
        if reason:
            tags["failure_reason"] = reason[:5000]
        if model is not None:
            with replaced(self.dir / "model.pt", "wb") as handle:
                import torch  # a run's process has it; fedrun-report, -import and -ui never do

                torch.save(model.state_dict(), handle)
        if metrics is not None:
            from fedrun.plots import plot_alpha_heatmap, plot_curves  # matplotlib: when a run ends, not at every start

            plot_curves(metrics, self.dir / "curves.png", title)
            alpha = pd.read_csv(self.alpha_path)
            plot_alpha_heatmap(
                alpha if self.wide else widest(alpha, "alpha", HEATMAP_CLIENTS),
                self.dir / "alpha_heatmap.png",
                title,
                top=10,
            )
        with replaced(self.dir / "summary.csv", newline="") as handle:
            pd.Series({**values, **tags}, dtype=object).to_csv(handle, header=["value"])
        if not self.enabled or self.run_id is None:
            return
        import mlflow

        try:
            if self.lost is None:
                if values:
                    mlflow.log_metrics({mlflow_name(k, summary=True): float(v) for k, v in values.items()})
                if tags:
                    mlflow.set_tags(tags)
                log_run_dir(self.dir, self.uri)
        except Exception as exc:
            self._lost(exc)
        finally:
            try:
                mlflow.end_run(status=status)
            except Exception as exc:
                if self.lost is None:
                    self._lost(exc)
        if self.lost is None:
            print(f"fedrun: {self.link()}", file=sys.stderr)

    def link(self) -> str:
        """Where to look at the run in the MLflow UI: its charts (``model-metrics``; the run's own page opens on its
        overview). The ``workflowType`` parameter makes MLflow 3 open the model-training pages: without it the UI
        starts on its GenAI view whatever the experiment's kind."""
        page = f"#/experiments/{self.experiment_key}/runs/{self.run_id}/model-metrics?workflowType=machine_learning"
        if self.uri.startswith(("http://", "https://")):
            return f"MLflow run at {self.uri.rstrip('/')}/{page}"
        store = self.uri[len("sqlite:///") :] if self.uri.startswith("sqlite:///") else self.uri
        return f"MLflow run: fedrun-ui --store {store}, then http://127.0.0.1:5000/{page}"
