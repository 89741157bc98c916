"""``fedrun-import``: log run directories into MLflow, for runs made with ``tracking.enabled=false`` or whose
tracking server went away mid-run. Everything comes from the files a run writes as it goes.

Each directory becomes one new MLflow run (named after it, tagged ``imported_from``): the flattened
``config.yaml`` as params, every ``metrics.csv`` column as a metric series by round (under the names a run logs to
MLflow, ``fedrun.tracking.mlflow_name``), ``alpha/client_<id>`` series up to ``tracking.max_alpha_series`` clients
(from a wide ``alpha.csv``) when the run would have logged them (its summary's ``alpha_series`` tag), ``summary.csv``'s
numbers as metrics and its words as tags, and the directory's files as artifacts. The status is FINISHED when the run
reached its last round (its checkpoint says so, or its rows reach ``schedule.rounds``), FAILED when it diverged
(``diverged.txt`` says why), else KILLED.

Usage:
    fedrun-import DIR [DIR ...] [--uri URI] [--experiment NAME]
"""

import argparse
import math
import sys
import time
from pathlib import Path

import pandas as pd
import yaml

from fedrun.checkpoint import FILE, diverged, read
from fedrun.errors import ConfigError
from fedrun.tracking import flatten, mlflow_name, preflight, resolve_uri

BATCH = 1000  # MLflow's log_batch takes at most 1000 metrics per call


def finished(directory: Path, config: dict, rounds_written: int) -> bool:
    if (directory / FILE).exists():
        return bool(read(directory / FILE).get("finished"))
    return rounds_written >= config.get("schedule", {}).get("rounds", math.inf)


def import_run(directory: Path, uri: str | None, experiment: str | None) -> str:
    """Log one run directory into MLflow; returns the new run's id."""
    import mlflow
    from mlflow.entities import Metric, RunTag

    if not (directory / "metrics.csv").is_file():
        raise ConfigError("directory", str(directory), "a fedrun output dir (with metrics.csv)")
    config = yaml.safe_load((directory / "config.yaml").read_text()) if (directory / "config.yaml").exists() else {}
    metrics = pd.read_csv(directory / "metrics.csv")
    reason = diverged(directory)  # the run failed, and says why
    # Reads the checkpoint (a crafted one is refused here, before anything is logged).
    status = "FAILED" if reason is not None else "FINISHED" if finished(directory, config, len(metrics)) else "KILLED"
    tracking = config.get("tracking", {})
    uri = uri or resolve_uri(tracking.get("uri", "sqlite:///outputs/mlflow.db"), Path.cwd())
    preflight(uri)
    client = mlflow.MlflowClient(tracking_uri=uri)
    name = experiment or tracking.get("experiment", "fedrun")
    found = client.get_experiment_by_name(name)
    experiment_id = found.experiment_id if found else client.create_experiment(name)
    run = client.create_run(
        experiment_id,
        run_name=directory.name,
        tags={"imported_from": str(directory.resolve()), "output_dir": str(directory.resolve())},
    )
    run_id = run.info.run_id
    params = flatten(config)
    items = list(params.items())
    for start in range(0, len(items), 100):
        client.log_batch(
            run_id, params=[mlflow.entities.Param(k, str(v)[:6000]) for k, v in items[start : start + 100]]
        )
    now = int(time.time() * 1000)
    summary = (
        pd.read_csv(directory / "summary.csv", index_col=0)["value"] if (directory / "summary.csv").exists() else None
    )
    series = [
        Metric(mlflow_name(column), float(value), now, int(step))
        for column in metrics.columns
        if column != "round"
        for step, value in zip(metrics["round"], metrics[column])
        if not pd.isna(value)
    ]
    alpha_path = directory / "alpha.csv"
    # a run from before the tag logged every alpha series
    if alpha_path.exists() and (summary is None or summary.get("alpha_series", "per_client") == "per_client"):
        alpha = pd.read_csv(alpha_path)
        clients = [c for c in alpha.columns if c.startswith("client_")]
        if clients and len(clients) <= tracking.get("max_alpha_series", 100):
            series += [
                Metric(f"alpha/{c}", float(v), now, int(step))
                for c in clients
                for step, v in zip(alpha["round"], alpha[c])
            ]
    summary_tags = []
    if summary is not None:
        for key, value in summary.items():
            try:
                series.append(Metric(mlflow_name(str(key)), float(value), now, 0))
            except ValueError:
                summary_tags.append(RunTag(str(key), str(value)[:5000]))
    for start in range(0, len(series), BATCH):
        client.log_batch(run_id, metrics=series[start : start + BATCH])
    if summary_tags:
        client.log_batch(run_id, tags=summary_tags)
    client.log_artifacts(run_id, str(directory))
    if reason is not None:
        client.set_tag(run_id, "failure_reason", f"DivergenceError: {reason}"[:5000])
    client.set_terminated(run_id, status)
    return run_id


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="fedrun-import", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("directories", nargs="+", type=Path, help="run output dirs")
    parser.add_argument("--uri", help="MLflow tracking URI (default: the run's tracking.uri, relative to here)")
    parser.add_argument("--experiment", help="MLflow experiment (default: the run's tracking.experiment)")
    args = parser.parse_args()
    for directory in args.directories:
        try:
            run_id = import_run(directory, args.uri, args.experiment)
        except ConfigError as exc:
            print(f"fedrun-import: error: {exc}", file=sys.stderr)
            sys.exit(2)
        print(f"fedrun-import: {directory} -> MLflow run {run_id}")


if __name__ == "__main__":
    main()
