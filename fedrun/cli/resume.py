"""Which config, dir and checkpoint a job runs with: a new run, ``resume=<run dir>``, a job of a resumed sweep
(``-m ... resume=<sweep dir>``) or a job submitit requeued. A job stopped before its first checkpoint starts
again from round 1 in its dir and MLflow run; a sweep's finished or diverged job is skipped."""

import json
import os
from dataclasses import dataclass
from pathlib import Path

from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from fedrun.checkpoint import FILE, RUN_FILE, Checkpoint, diverged
from fedrun.errors import ConfigError
from fedrun.tracking import flatten


@dataclass
class Job:
    """What ``open_job`` decided.

    Attributes:
        cfg: The config to run (a resumed run's own, saved one).
        output_dir: Its output dir.
        checkpoint: Where it checkpoints; ``checkpoint.resume`` when it continues from a checkpoint.
        restart: It was stopped before its first checkpoint: it starts again from round 1 in the same dir and
            the same MLflow run (``run.json``).
        finished: A sweep job that had finished: its final test accuracy (it is skipped).
        diverged: A sweep job that had diverged: why (it is skipped, and stays failed).
    """

    cfg: DictConfig
    output_dir: Path
    checkpoint: Checkpoint | None
    reopened: dict | None = None

    @property
    def restart(self) -> bool:
        return self.reopened is not None

    finished: float | None = None
    diverged: str | None = None


def open_job(cfg: DictConfig, hydra_cfg) -> Job:
    """The job this invocation runs (see the module docstring); ConfigError for a resume that cannot be."""
    output_dir = Path(hydra_cfg.runtime.output_dir)
    # submitit restarted it (after a checkpoint, or before the first one: its run was open, run.json)
    requeued = bool(os.environ.get("SUBMITIT_EXECUTOR")) and (
        (output_dir / FILE).is_file() or (output_dir / RUN_FILE).is_file()
    )
    resuming = bool(cfg.resume) or requeued
    if resuming and hydra_cfg.mode == RunMode.MULTIRUN:  # this job of an earlier sweep, in its own dir
        done = sweep_job(cfg, output_dir)
        if isinstance(done, str):  # a failed job stays failed: its FAILED run has the metrics of the rounds before
            return Job(cfg, output_dir, None, diverged=done)
        if done is not None:
            return Job(cfg, output_dir, None, finished=done)
        checkpoint = Checkpoint(output_dir, cfg.checkpoint.every, resume=(output_dir / FILE).is_file())
        cfg.resume = None  # what the job's config.yaml says: it is the sweep's job, not a resume of something else
    elif cfg.resume:
        cfg, checkpoint = resumed_config(cfg, hydra_cfg)
        output_dir = checkpoint.path.parent
    else:
        checkpoint = Checkpoint(output_dir, cfg.checkpoint.every)
    reopened = opened_run(output_dir) if resuming and not checkpoint.resume else None
    return Job(cfg, output_dir, checkpoint, reopened=reopened)


def opened_run(output_dir: Path) -> dict | None:
    """What ``run.json`` says of the run in ``output_dir`` (its MLflow run id and title), or None when the run
    never opened one (or the file is unreadable: it is written atomically, so only by hand)."""
    try:
        return json.loads((Path(output_dir) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None


def resumed_config(cfg: DictConfig, hydra_cfg) -> tuple[DictConfig, Checkpoint]:
    """For ``resume=<output dir>``: the config that run was started with, and its checkpoint to resume from. A run
    killed before its first checkpoint has none: it starts again from round 1 (``checkpoint.resume`` is False), in
    the same dir and MLflow run, as a sweep's resume restarts such a job.

    Any other override is refused: the run continues exactly as it started (its results must equal an
    uninterrupted run's)."""
    directory = Path(hydra_cfg.runtime.cwd, cfg.resume).resolve()
    if (reason := diverged(directory)) is not None:
        raise ConfigError("resume", cfg.resume, f"a run that did not diverge (this one did, and would again: {reason})")
    if not (directory / "config.yaml").is_file():
        raise ConfigError(
            "resume", cfg.resume, f"the output dir of a fedrun run ({directory / 'config.yaml'} not found)"
        )
    others = [o for o in hydra_cfg.overrides.task if not o.startswith("resume=")]
    if others:
        raise ConfigError(
            "resume",
            cfg.resume,
            f"no other overrides (the run continues with {directory / 'config.yaml'}); got {' '.join(others)}",
        )
    saved = saved_config(directory, cfg.resume)
    saved.resume = str(directory)
    checkpoint = Checkpoint(directory, saved.checkpoint.every, resume=(directory / FILE).is_file())
    if checkpoint.resume and checkpoint.restored()["finished"]:
        raise ConfigError(
            "resume", cfg.resume, f"a run that did not finish (this one finished at round {checkpoint.saved_round})"
        )
    return saved, checkpoint


def sweep_job(cfg: DictConfig, job_dir: Path) -> float | str | None:
    """For ``-m ... resume=<multirun dir>``: this job's final accuracy when it had finished, the reason when it
    had diverged, else None (it resumes from its checkpoint, or runs from the start when it never reached one).
    A job whose config differs from the one it was started with is refused, checkpoint or not: the sweep must be
    the same one (a job restarted from round 1 reopens its MLflow run, whose params are that config)."""
    reason = diverged(job_dir)
    if not (job_dir / "config.yaml").is_file():  # never started
        return None
    saved = saved_config(job_dir, cfg.resume)
    mine = OmegaConf.to_container(cfg, resolve=True)
    mine["resume"] = saved.get("resume")
    if mine != OmegaConf.to_container(saved, resolve=True):
        before = flatten(OmegaConf.to_container(saved))
        changed = sorted(k for k, v in flatten(mine).items() if before.get(k) != v)
        raise ConfigError(
            "resume",
            cfg.resume,
            f"the same sweep (job dir {job_dir} was started with other values of {', '.join(changed)})",
        )
    if reason is not None:
        return reason
    if not (job_dir / FILE).is_file():
        return None
    state = Checkpoint(job_dir, resume=True).restored()
    return state["rows"][-1]["test_accuracy"] if state["finished"] else None


def saved_config(directory: Path, given) -> DictConfig:
    """The config a run in ``directory`` was started with; one written before the ``pipeline`` group (November
    2026) is refused with the command that upgrades the dir."""
    saved = OmegaConf.load(Path(directory) / "config.yaml")
    if "pipeline" not in saved:
        raise ConfigError(
            "resume",
            given,
            f"a run dir of this fedrun ({directory} was written by an older one: if you trust it, "
            f"upgrade it once with python -m fedrun.upgrade {directory})",
        )
    return saved
