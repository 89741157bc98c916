"""Sweeps: the MLflow run that groups a sweep's jobs (opened by a Hydra callback before the jobs start, closed
when the sweep's process exits), the cores each job of a parallel launcher may use, and what a resumed sweep
does with each of its jobs."""

import atexit
import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from fedrun.errors import ConfigError
from fedrun.sweepdir import sweep_parent, trial_of, write_parent

# Hydra builds ``SweepRun`` for every command that runs (a single run too) before fedrun's ``main``: torch and MLflow
# are imported where a sweep needs them, so that a config error answers before either (``fedrun.cli``).


def open_sweep_run(uri: str, experiment: str, sweep_dir: Path, name: str, tags: dict) -> str:
    """The MLflow run that groups a sweep's jobs as its children (the UI shows them under it): created on the
    sweep's first launch, reopened when the sweep is resumed. Its id goes to the sweep dir (``fedrun.sweepdir``), where
    every job reads it (``sweep_parent``), on this machine or on a cluster node sharing the dir."""
    from fedrun.tracking import Tracker, create_run, open_client, reopen_run, retried

    client = open_client(uri)
    run_id = sweep_parent(sweep_dir)
    if run_id is not None:
        retried(lambda: reopen_run(client, run_id))
        return run_id
    experiment_id = Tracker.experiment_id(uri, experiment)
    run_id = retried(lambda: create_run(client, experiment_id, name, tags))
    write_parent(sweep_dir, run_id)
    return run_id


def seed_report(cfg: DictConfig, hydra_cfg):
    """This job's line to its trial when it is a seed job of an Optuna study (``hydra/sweeper=optuna``): a
    ``fedrun.study.SeedReport``; else None. Trial n's seed i (of S) is job n * S + i, in ``<sweep dir>/<job>``."""
    from hydra_plugins.fedrun_optuna_sweeper.optuna_sweeper import make_pruner, sweeper_config

    sweeper = sweeper_config(hydra_cfg)
    if sweeper is None or hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    from fedrun.study import SeedReport, open_storage

    trial, _ = trial_of(int(hydra_cfg.job.num), len(sweeper.seeds))
    sweep_dir = Path(hydra_cfg.runtime.output_dir).resolve().parent
    return SeedReport(
        open_storage(sweeper.storage, sweep_dir),
        sweeper.study_name or str(sweep_dir),
        trial,
        int(cfg.seed),
        make_pruner(sweeper.pruner),
        last_round=int(cfg.schedule.rounds),
        objective=str(sweeper.objective),
    )


def close_sweep_run(uri: str, run_id: str) -> str:
    """End a sweep's parent run: FINISHED when every job (a study's: every trial) finished or was pruned, else FAILED
    (one failed, or none ran: the sweep stopped before its jobs, at a config error) or KILLED (one was stopped),
    with the count of children in each state as metrics (``jobs_finished`` ..., ``jobs_pruned``). Returns the
    status."""
    from fedrun.tracking import child_runs, end_run, log_batch, open_client, retried

    client = open_client(uri)
    children = retried(lambda: child_runs(client, run_id))
    pruned = [status == "KILLED" and tags.get("optuna.state") == "PRUNED" for status, tags in children]
    counts = {
        state: sum(status == state and not p for (status, _), p in zip(children, pruned))
        for state in ("FINISHED", "FAILED", "KILLED", "RUNNING")
    }
    counts["PRUNED"] = sum(pruned)
    status = (
        "FAILED"
        if counts["FAILED"] or not children
        else "KILLED"
        if counts["KILLED"] or counts["RUNNING"]
        else "FINISHED"
    )
    retried(lambda: log_batch(client, run_id, metrics=[(f"jobs_{state.lower()}", n, 0) for state, n in counts.items()]))
    retried(lambda: end_run(client, run_id, status))
    return status


def job_cores(hydra_cfg) -> int:
    """The cores a sweep job may use: what a Ray launcher gives each task (``ray.remote.num_cpus``), or cores /
    concurrent jobs under joblib (``n_jobs``; negative counts from the core count as joblib does), else all."""
    ray_cpus = OmegaConf.select(hydra_cfg, "launcher.ray.remote.num_cpus")
    if isinstance(ray_cpus, (int, float)) and ray_cpus >= 1:
        return int(ray_cpus)
    from fedrun.backends import usable_cores

    n_jobs = OmegaConf.select(hydra_cfg, "launcher.n_jobs")
    cores = usable_cores()
    if not isinstance(n_jobs, int) or n_jobs == 0:
        return cores
    jobs = n_jobs if n_jobs > 0 else max(1, cores + 1 + n_jobs)
    return max(1, cores // jobs)


class SweepRun(Callback):
    """Hydra callback: before a sweep launches its jobs, open (create and migrate) the tracking store once, so
    parallel jobs never race to create its tables or the experiment, and open the MLflow run that groups the
    sweep's jobs as its children; it is ended when the sweep's process exits (``close_sweep_run``), also
    after a failed job."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        # One process sweeps a dir: a second `-m ... resume=<sweep dir>` while this one runs would relaunch its
        # jobs and trials (each job's own dir is locked by the job). Held until this process exits.
        from fedrun.checkpoint import lock
        from fedrun.cli.runinfo import git_commit
        from fedrun.tracking import preflight, resolve_uri

        if not config.get("resume"):  # a bad key fails here once, before the sweep's MLflow run, not in every job
            from fedrun.cli.entry import check_known_keys, check_run_keys

            try:
                check_known_keys(config, config.hydra)
                check_run_keys(OmegaConf.masked_copy(config, [k for k in config if k != "hydra"]))
            except ConfigError as exc:
                print(f"fedrun: error: {exc}", file=sys.stderr)
                sys.exit(2)
            except Exception:  # noqa: BLE001  (Hydra would swallow it and skip the rest: each job checks its keys)
                pass
        sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        try:
            lock(sweep_dir, "resume", sweep_dir)
        except ConfigError as exc:
            print(f"fedrun: error: {exc}", file=sys.stderr)
            sys.exit(2)
        if not config.tracking.enabled:
            return
        uri = resolve_uri(config.tracking.uri, Path.cwd())
        preflight(uri)
        from hydra_plugins.fedrun_optuna_sweeper.optuna_sweeper import sweeper_config

        overrides = [o for o in config.hydra.overrides.task if not o.startswith(("tracking.", "hydra.", "resume="))]
        study = sweeper_config(config.hydra)
        what = (
            f"Optuna study of {' '.join(overrides)}, {study.objective} over seeds {list(study.seeds)}: its trials are "
            "this run's children, each trial's seeds the trial's children"
            if study is not None
            else f"Sweep of {' '.join(overrides) or 'the defaults'}; its jobs are this run's children"
        )
        tags = {
            "fedrun.role": "sweep",
            "sweep_dir": str(sweep_dir),
            "overrides": " ".join(config.hydra.overrides.task) or "(defaults)",
            "git_commit": git_commit(),
            "mlflow.note.content": f"{what}. Output: `{sweep_dir}`",
        }
        name = ("study " if study is not None else "sweep ") + " ".join(overrides)
        run_id = open_sweep_run(uri, config.tracking.experiment, sweep_dir, name[:250], tags)
        atexit.register(close_sweep_run, uri, run_id)
