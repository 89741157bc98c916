"""A sweep dir's layout, which the sweep's parent process, its jobs and the Optuna sweeper all read: where the id of
the MLflow run grouping the sweep is kept, and which job dir holds a study's trial and seed. One module, below the
CLI and the sweeper, so that none of them imports another for it."""

import os
import re
from pathlib import Path

from fedrun import runfiles

STUDY_FILE = "optuna_study.journal"  # a study's default storage (fedrun.study), in the sweep dir
PARENT_FILE = "mlflow_parent_run.txt"  # in a sweep's (or a trial's job) dir: the MLflow run its jobs are children of


def sweep_parent(directory: Path) -> str | None:
    """The id of the MLflow run that groups the jobs under ``directory``, if it names one."""
    path = Path(directory) / PARENT_FILE
    run_id = path.read_text().strip() if path.is_file() and not path.is_symlink() else None
    # an MLflow run id (32 hex digits): anything else in a dir from elsewhere is not put into a search filter
    return run_id if run_id is not None and re.fullmatch(r"[0-9a-f]{32}", run_id) else None


def write_parent(directory: Path, run_id: str) -> None:
    """Point the jobs under ``directory`` at the MLflow run ``run_id`` (``sweep_parent`` reads it)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    runfiles.write_text(directory / PARENT_FILE, run_id)


def first_job(trial: int, seeds: int) -> int:
    """The job number of trial ``trial``'s first seed: trial n's seed i (of S) is job n * S + i."""
    return trial * seeds


def trial_of(job: int, seeds: int) -> tuple[int, int]:
    """(trial, seed index) of job ``job`` of a study with ``seeds`` seeds a trial."""
    return divmod(job, seeds)


def job_dirs(sweep_dir: Path, trial: int, seeds: int) -> list[Path]:
    """The dirs of trial ``trial``'s seed jobs, in seed order (Hydra's ``<sweep dir>/<job number>``)."""
    return [Path(sweep_dir) / str(first_job(trial, seeds) + i) for i in range(seeds)]


def linked_files(directory: Path, depth: int = 3) -> list[Path]:
    """The links in ``directory`` and its folders down to ``depth`` (never followed), symbolic or hard
    (``fedrun.runfiles.linked``: a file with another name): a run dir's ``.hydra/``, a sweep dir's job dirs and
    theirs."""
    found, folders = [], [(Path(directory), 0)]
    while folders:
        folder, level = folders.pop()
        for entry in os.scandir(folder):
            if level == 0 and entry.name.startswith(STUDY_FILE + ".lock"):
                continue  # Optuna's journal lock is a link to the journal (stale after a kill; Optuna breaks it)
            if runfiles.linked(entry):
                found.append(Path(entry.path))
            elif entry.is_dir(follow_symlinks=False) and level < depth:
                folders.append((Path(entry.path), level + 1))
    return sorted(found)
