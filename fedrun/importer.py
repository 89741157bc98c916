"""``fedrun-import``: log run directories into MLflow, for runs made with ``tracking.enabled=false`` or whose
tracking server went away mid-run. Everything comes from the files a run writes as it goes.

Each directory becomes one new MLflow run (named after it, tagged ``imported_from``): the flattened
``config.yaml`` as params, every ``metrics.csv`` column as a metric series by round (under the names a run logs to
MLflow, ``fedrun.tracking.mlflow_name``), ``alpha/client_<id>`` series up to ``tracking.max_alpha_series`` clients
(from a wide ``alpha.csv``) when the run would have logged them (its summary's ``alpha_series`` tag), ``summary.csv``'s
numbers as metrics and its words as tags, and the directory's files as artifacts. The status is FINISHED when the run
reached its last round (its checkpoint says so, or its rows reach ``schedule.rounds``), FAILED when it diverged
(``diverged.txt`` says why), else KILLED.

A run dir is data from wherever it came from (a shared filesystem): everything in it is checked before the MLflow
run is created, so a bad file is one line and no half-imported run (``checked``): the rounds are integers that fit
MLflow's steps, the values numbers, the metric, param and tag names ones MLflow accepts. A failure after the run is
created (the store, the artifact copy) marks it FAILED. Links, symbolic or hard (a file with another name: its
content is a file elsewhere), are neither read nor copied (one line says which were left out). The run goes to ``--uri``, else to the user's store (``fedrun.tracking.DEFAULT_URI``, as fedrun
itself), never to the ``tracking.uri`` the dir's config names.

Usage:
    fedrun-import DIR [DIR ...] [--uri URI] [--experiment NAME]
"""

import argparse
import csv
import math
import os
import posixpath
import re
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from fedrun.checkpoint import FILE, LOCK_FILE, diverged, read
from fedrun.errors import ConfigError
from fedrun.tracking import (
    DEFAULT_URI,
    create_experiment,
    create_run,
    end_run,
    find_experiment,
    flatten,
    log_artifact,
    log_batch,
    mlflow_name,
    open_client,
    preflight,
    resolve_uri,
    set_tag,
)

# MLflow's rule for metric, param and tag names (mlflow.utils.validation: validate_param_and_metric_name, whose
# ``^...$`` would also let a trailing newline through, path_not_unique, MAX_ENTITY_KEY_LENGTH): letters, digits,
# _ - . : / and spaces, at most 250 characters, and not a path that resolves to another name (``../../x``).
NAME = re.compile(r"[/\w.\- :]+")
MAX_NAME = 250
# A number as fedrun's CSV files write one (Python's repr of a float or an int: nan and inf included); anything else
# (a formula, a word, Python's 1_000) is refused.
NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?|[+-]?(nan|inf)", re.IGNORECASE)
MAX_STEP = 2**63 - 1  # MLflow's steps are 64-bit integers
MAX_EXPERIMENT_NAME = 500  # mlflow.utils.validation.MAX_EXPERIMENT_NAME_LENGTH


def shown(text: str) -> str:
    """``text`` as a refusal quotes it: its first 80 characters (a name of 1,000 is not one line)."""
    return text if len(text) <= 80 else text[:80] + "..."


def metric_name(name: str, where: str) -> str:
    """``name`` when MLflow accepts it as a metric, param or tag name (``NAME``), else a ConfigError for ``where``."""
    normal = posixpath.normpath(name)
    if (
        len(name) > MAX_NAME
        or not NAME.fullmatch(name)
        or normal != name
        or normal == "."
        or normal.startswith(("..", "/"))
    ):
        raise ConfigError(
            where,
            shown(name),
            f"a name MLflow accepts (at most {MAX_NAME} letters, digits, _ - . : / or spaces, not a path that "
            "resolves elsewhere)",
        )
    return name


def number(cell: str, where: str) -> float:
    if not NUMBER.fullmatch(cell):
        raise ConfigError(where, shown(cell), "a number")
    return float(cell)


def finite(cell: str, where: str) -> float:
    """A number that is finite (an aggregation weight, a round): ``inf``, ``nan`` and 1e999 are refused."""
    value = number(cell, where)
    if not math.isfinite(value):
        raise ConfigError(where, shown(cell), "a finite number")
    return value


def step(cell: str, where: str) -> int:
    if not (cell.isascii() and cell.isdigit() and int(cell) <= MAX_STEP):
        raise ConfigError(where, shown(cell), f"a round: an integer 0 to {MAX_STEP}")
    return int(cell)


def regular(path: Path) -> bool:
    """A file that is neither a link, symbolic or hard (its content is a file elsewhere too), nor a device or
    pipe."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_nlink == 1


def table(path: Path) -> tuple[list[str], list[list[str]]]:
    """The header and rows of a CSV file, each row as long as the header (a ConfigError otherwise)."""
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            rows = list(csv.reader(handle))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ConfigError(path.name, str(path), f"a CSV file fedrun wrote ({type(exc).__name__}: {exc})") from None
    if not rows:
        raise ConfigError(path.name, str(path), "a CSV file with a header")
    header, rows = rows[0], rows[1:]
    if len(set(header)) != len(header):
        raise ConfigError(path.name, str(path), "a CSV file whose columns have distinct names")
    for number_, row in enumerate(rows, 2):
        if len(row) != len(header):
            raise ConfigError(f"{path.name} line {number_}", ",".join(row)[:80], f"{len(header)} cells, as the header")
    return header, rows


@dataclass
class Checked:
    """Everything ``import_run`` logs, read from the dir and checked."""

    status: str
    params: dict
    series: list = field(default_factory=list)  # (name, value, step)
    summary_metrics: list = field(default_factory=list)  # (name, value)
    summary_tags: list = field(default_factory=list)  # (name, value)
    reason: str | None = None
    experiment: str = "fedrun"
    artifacts: list = field(default_factory=list)  # (file, artifact folder or None)
    links: list = field(default_factory=list)  # symbolic links left out, relative to the dir


def checked(directory: Path, experiment: str | None) -> Checked:
    """Read and check everything in ``directory`` (see the module docstring); a ConfigError for the first bad
    thing, before anything is logged."""
    if not regular(directory / "metrics.csv"):
        raise ConfigError("directory", str(directory), "a fedrun output dir (with metrics.csv)")
    config = {}
    if regular(directory / "config.yaml"):
        try:
            config = yaml.safe_load((directory / "config.yaml").read_text(encoding="utf-8")) or {}
            params = flatten(config) if isinstance(config, dict) else None
        except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError) as exc:
            raise ConfigError(
                "config.yaml", str(directory / "config.yaml"), f"a YAML mapping ({type(exc).__name__})"
            ) from None
        if params is None:
            raise ConfigError("config.yaml", str(directory / "config.yaml"), "a YAML mapping")
    else:
        params = {}
    for key in params:
        metric_name(str(key), "config.yaml key")
    tracking = config.get("tracking", {})
    schedule = config.get("schedule", {})
    if not isinstance(tracking, dict) or not isinstance(schedule, dict):
        raise ConfigError(
            "config.yaml", str(directory / "config.yaml"), "fedrun's config (tracking, schedule: mappings)"
        )
    name = experiment or tracking.get("experiment", "fedrun")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_EXPERIMENT_NAME:
        raise ConfigError("tracking.experiment", name, f"an experiment name of 1 to {MAX_EXPERIMENT_NAME} characters")
    result = Checked("KILLED", params, experiment=name)

    header, rows = table(directory / "metrics.csv")
    if "round" not in header:
        raise ConfigError("metrics.csv", str(directory / "metrics.csv"), "a table with a round column")
    at = header.index("round")
    names = [metric_name(mlflow_name(column), "metrics.csv column") for column in header]
    for line, row in enumerate(rows, 2):
        round_ = step(row[at], f"metrics.csv line {line} round")
        for column, (name_, cell) in enumerate(zip(names, row)):
            if column != at and cell != "":
                value = number(cell, f"metrics.csv line {line} {header[column]}")
                if not math.isnan(value):
                    result.series.append((name_, value, round_))

    summary = {}
    if regular(directory / "summary.csv"):
        summary_header, summary_rows = table(directory / "summary.csv")
        if len(summary_header) != 2:
            raise ConfigError("summary.csv", str(directory / "summary.csv"), "a table of names and values")
        for key, value in summary_rows:
            summary[key] = value
            if NUMBER.fullmatch(value):
                result.summary_metrics.append(
                    (metric_name(mlflow_name(key, summary=True), "summary.csv name"), float(value))
                )
            else:
                result.summary_tags.append((metric_name(key, "summary.csv name"), value[:5000]))

    # a run from before the tag logged every alpha series
    max_alpha = tracking.get("max_alpha_series", 100)
    if regular(directory / "alpha.csv"):  # checked whole even when only copied: a weight is a finite number
        alpha_header, alpha_rows = table(directory / "alpha.csv")
        at = alpha_header.index("round") if "round" in alpha_header else None
        alphas = [
            [finite(cell, f"alpha.csv line {line} {name}") for name, cell in zip(alpha_header, row)]
            for line, row in enumerate(alpha_rows, 2)
        ]
        clients = [i for i, c in enumerate(alpha_header) if re.fullmatch(r"client_\d{1,12}", c)]
        wanted = summary.get("alpha_series", "per_client") == "per_client"
        if wanted and at is not None and clients and isinstance(max_alpha, int) and len(clients) <= max_alpha:
            for line, (row, values) in enumerate(zip(alpha_rows, alphas), 2):
                round_ = step(row[at], f"alpha.csv line {line} round")
                result.series += [(f"alpha/{alpha_header[i]}", values[i], round_) for i in clients]

    reason = diverged(directory) if regular(directory / "diverged.txt") else None  # the run failed, and says why
    rounds = schedule.get("rounds", math.inf)
    rounds = rounds if isinstance(rounds, int) else math.inf
    # A crafted checkpoint is refused here (fedrun.checkpoint.read), before anything is logged.
    done = bool(read(directory / FILE).get("finished")) if regular(directory / FILE) else len(rows) >= rounds
    result.status, result.reason = ("FAILED" if reason is not None else "FINISHED" if done else "KILLED"), reason

    for root, folders, names_ in os.walk(directory):  # followlinks=False: a linked folder is listed, never entered
        for entry in sorted(folders + names_):
            path = Path(root, entry)
            relative = path.relative_to(directory)
            if path.is_symlink() or (path.is_file() and not regular(path)):  # a hard link too
                result.links.append(str(relative))
            elif entry in names_ and regular(path) and relative != Path(LOCK_FILE):
                result.artifacts.append((path, None if relative.parent == Path(".") else relative.parent.as_posix()))
    return result


def import_run(directory: Path, uri: str, experiment: str | None) -> str:
    """Log one run directory into MLflow at ``uri``; returns the new run's id. Everything is checked first
    (``checked``: a ConfigError creates nothing); a failure once the run exists marks it FAILED."""
    found = checked(directory, experiment)
    if found.links:
        print(
            f"fedrun-import: {directory}: left out {len(found.links)} link(s), symbolic or hard, neither read nor "
            "copied: " + ", ".join(found.links[:10]),
            file=sys.stderr,
        )
    uri = resolve_uri(uri, Path.cwd())
    preflight(uri)
    client = open_client(uri)
    experiment_id = find_experiment(client, found.experiment)
    if experiment_id is None:
        experiment_id = create_experiment(client, found.experiment)
    run_id = create_run(
        client,
        experiment_id,
        directory.name,
        {"imported_from": str(directory.resolve()), "output_dir": str(directory.resolve())},
    )
    try:
        log_batch(client, run_id, params=[(k, str(v)[:6000]) for k, v in found.params.items()])
        log_batch(client, run_id, metrics=found.series + [(name, value, 0) for name, value in found.summary_metrics])
        log_batch(client, run_id, tags=found.summary_tags)
        for path, folder in found.artifacts:
            log_artifact(client, run_id, path, folder)
        if found.reason is not None:
            set_tag(client, run_id, "failure_reason", f"DivergenceError: {found.reason}"[:5000])
        end_run(client, run_id, found.status)
    except BaseException as exc:
        try:
            end_run(client, run_id, "FAILED")
        except Exception:  # the store itself is what failed: the run stays as the store has it
            pass
        if isinstance(exc, Exception):
            raise ImportFailed(run_id, exc) from exc
        raise
    return run_id


class ImportFailed(Exception):
    """A failure once the MLflow run existed (the store, the artifact copy): the run is marked FAILED."""

    def __init__(self, run_id: str, cause: Exception):
        first = str(cause).splitlines()[0][:300] if str(cause) else ""
        super().__init__(f"{type(cause).__name__}: {first} (its MLflow run {run_id} is marked FAILED)")


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments (the docs' command reference prints its help)."""
    parser = argparse.ArgumentParser(
        prog="fedrun-import",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Documentation: docs/how-to/resume.md (how to), docs/reference/index.md (every command and option)",
    )
    parser.add_argument("directories", nargs="+", type=Path, help="run output dirs")
    parser.add_argument(
        "--uri", default=DEFAULT_URI, help="MLflow tracking URI (default: fedrun's, %(default)s, relative to here)"
    )
    parser.add_argument("--experiment", help="MLflow experiment (default: the run's tracking.experiment)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    for directory in args.directories:
        try:
            run_id = import_run(directory, args.uri, args.experiment)
        except ConfigError as exc:
            print(f"fedrun-import: error: {exc}", file=sys.stderr)
            sys.exit(2)
        except ImportFailed as exc:
            print(f"fedrun-import: error: {directory}: {exc}", file=sys.stderr)
            sys.exit(1)
        print(f"fedrun-import: {directory} -> MLflow run {run_id}")


if __name__ == "__main__":
    main()
