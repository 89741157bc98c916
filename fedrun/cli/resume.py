"""Which config, dir and checkpoint a job runs with: a new run, ``resume=<run dir>``, a job of a resumed sweep
(``-m ... resume=<sweep dir>``) or a job submitit requeued. A job stopped before its first checkpoint starts
again from round 1 in its dir and MLflow run; a sweep's finished or diverged job is skipped."""

import os
from dataclasses import dataclass
from pathlib import Path

from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from fedrun.checkpoint import FILE, RUN_FILE, Checkpoint, diverged
from fedrun.cli.sweeps import sweep_job
from fedrun.errors import ConfigError


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
    restart: bool = False
    finished: float | None = None
    diverged: str | None = None


def open_job(cfg: DictConfig, hydra_cfg) -> Job:
    """The job this invocation runs (see the module docstring); ConfigError for a resume that cannot be."""
    output_dir = Path(hydra_cfg.runtime.output_dir)
    requeued = bool(os.environ.get("SUBMITIT_EXECUTOR")) and (output_dir / FILE).is_file()  # submitit restarted it
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
    restart = resuming and not checkpoint.resume and (output_dir / RUN_FILE).is_file()
    return Job(cfg, output_dir, checkpoint, restart=restart)


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
    saved = OmegaConf.load(directory / "config.yaml")
    saved.resume = str(directory)
    checkpoint = Checkpoint(directory, saved.checkpoint.every, resume=(directory / FILE).is_file())
    if checkpoint.resume and checkpoint.restored()["finished"]:
        raise ConfigError(
            "resume", cfg.resume, f"a run that did not finish (this one finished at round {checkpoint.saved_round})"
        )
    return saved, checkpoint
