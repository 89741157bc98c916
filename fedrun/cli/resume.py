"""Which config, dir and checkpoint a job runs with: a new run, ``resume=<run dir>``, a job of a resumed sweep
(``-m ... resume=<sweep dir>``) or a job submitit requeued. A job stopped before its first checkpoint starts
again from round 1 in its dir and MLflow run; a sweep's finished or diverged job is skipped.

A run dir is data, never code (it may sit on a shared filesystem, written by someone else): the config a resumed
run builds names only what fedrun's own options build, the ``_target_`` of every file in conf/ and the backends
``device.backend`` names, at any depth of the config (``_args_``, ``_partial_`` and nested nodes included).
Anything else is refused in one line before anything is built or imported (``foreign_code``). A run you started
with your own class (``device.backend=mypackage.Trainer``, ``model._target_=mypackage.Net``) resumes when the resume
command names that class again: ``FEDRUN_TRUST=mypackage.Trainer fedrun resume=<dir>`` (an environment variable,
not an override, because an override must compose on today's default config, and a nested key such as
``pipeline.stages.1._target_`` does not). A sweep's jobs build the config of the resuming command line, which
must equal each job's saved one, so what they build was named on that command line; their saved configs are
checked all the same, and a job dir is locked like a run dir (``fedrun.checkpoint.lock``).
"""

import json
import os
import tempfile
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from pathlib import Path

import yaml
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from fedrun import distributed
from fedrun.backends import BACKENDS
from fedrun.checkpoint import FILE, RUN_FILE, Checkpoint, FollowerCheckpoint, diverged, lock
from fedrun.errors import ConfigError
from fedrun.mlstore import SQLITE, local_store
from fedrun.sweepdir import linked_files
from fedrun.tracking import flatten
from fedrun.upgrade import migrate_config

TRUST_VARIABLE = "FEDRUN_TRUST"  # comma-separated import paths a resumed run may build besides fedrun's own


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
        follower: A rank > 0 of a distributed run (``follower_job``).
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
    follower: bool = False  # a rank > 0 of a distributed run: it writes nothing that stays


def open_job(cfg: DictConfig, hydra_cfg) -> Job:
    """The job this invocation runs (see the module docstring); ConfigError for a resume that cannot be."""
    if distributed.chosen(cfg.device) or (cfg.resume and distributed.several()):
        if hydra_cfg.mode == RunMode.MULTIRUN:
            raise ConfigError(
                "device.backend", "distributed", "a single run (without -m: start one torchrun per job of a sweep)"
            )
        if not distributed.launched():
            raise ConfigError(
                "device.backend",
                "distributed",
                "a command started by torchrun or srun (torchrun --nproc_per_node=2 -m fedrun device.backend="
                "distributed ...), or loop, processes, vmap or auto",
            )
        distributed.place()  # this rank's GPU current before the model and data are placed
        if distributed.rank() > 0:
            return follower_job(cfg, hydra_cfg)
    output_dir = Path(hydra_cfg.runtime.output_dir)
    # submitit restarted it (after a checkpoint, or before the first one: its run was open, run.json)
    requeued = bool(os.environ.get("SUBMITIT_EXECUTOR")) and (
        (output_dir / FILE).is_file() or (output_dir / RUN_FILE).is_file()
    )
    resuming = bool(cfg.resume) or requeued
    if hydra_cfg.mode == RunMode.MULTIRUN:  # one process per job dir, also for a fresh job (a later resume sees it)
        lock(output_dir, "resume" if resuming else "hydra.sweep.dir", output_dir)
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
        lock(output_dir, "hydra.run.dir", output_dir)  # a fresh dir, locked so that a resume while it runs is refused
        checkpoint = Checkpoint(output_dir, cfg.checkpoint.every)
    reopened = opened_run(output_dir) if resuming and not checkpoint.resume else None
    return Job(cfg, output_dir, checkpoint, reopened=reopened)


def follower_job(cfg: DictConfig, hydra_cfg) -> Job:
    """A rank > 0 of a distributed run (``fedrun.distributed``): the same config as rank 0 (a resumed run's saved
    one, read without the lock rank 0 holds: rank 0 checks the resume), MLflow off, a temporary dir of its own (not
    Hydra's, which the ranks may share) that the command removes when the job ends, and a checkpoint that reads
    rank 0's file but never writes one."""
    output_dir, source = Path(tempfile.mkdtemp(prefix=f"fedrun-rank{distributed.rank()}-")), None
    if cfg.resume:
        source = Path(hydra_cfg.runtime.cwd, cfg.resume).resolve()
        cfg = spread_run(saved_config(source, cfg.resume), cfg.resume)
        cfg.resume = str(source)
    cfg.tracking.enabled = False
    return Job(cfg, output_dir, FollowerCheckpoint(output_dir, source), follower=True)


def spread_run(saved: DictConfig, resume: str) -> DictConfig:
    """``saved``, the config of the run ``resume=`` continues; a ConfigError when several ranks resume a run that
    was not distributed (each would run it whole)."""
    if distributed.several() and not distributed.chosen(saved.device):
        raise ConfigError(
            "resume",
            resume,
            f"a run of device.backend=distributed when torchrun or srun starts several ranks (this one ran with "
            f"device.backend={saved.device.get('backend')}: resume it with plain fedrun)",
        )
    return saved


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

    Any other override but ``tracking.uri=`` is refused: the run continues exactly as it started (its results must
    equal an uninterrupted run's). Its MLflow store is the one it was created in, or the one ``tracking.uri=``
    names, and it must exist and hold the run (``resumed_store``)."""
    directory = Path(hydra_cfg.runtime.cwd, cfg.resume).resolve()
    if (reason := diverged(directory)) is not None:
        raise ConfigError("resume", cfg.resume, f"a run that did not diverge (this one did, and would again: {reason})")
    if not (directory / "config.yaml").is_file():
        raise ConfigError(
            "resume", cfg.resume, f"the output dir of a fedrun run ({directory / 'config.yaml'} not found)"
        )
    others = [o for o in hydra_cfg.overrides.task if not o.startswith(("resume=", "tracking.uri="))]
    if others:
        raise ConfigError(
            "resume",
            cfg.resume,
            f"no other overrides but tracking.uri= (the run continues with {directory / 'config.yaml'}); got "
            f"{' '.join(others)}",
        )
    lock(directory, "resume", cfg.resume)  # before its checkpoint is read: a second resume, or the run itself, holds it
    saved = spread_run(saved_config(directory, cfg.resume), cfg.resume)
    saved.resume = str(directory)
    checkpoint = Checkpoint(directory, saved.checkpoint.every, resume=(directory / FILE).is_file())
    if checkpoint.resume and checkpoint.restored()["finished"]:
        raise ConfigError(
            "resume", cfg.resume, f"a run that did not finish (this one finished at round {checkpoint.saved_round})"
        )
    if any(o.startswith("tracking.uri=") for o in hydra_cfg.overrides.task):  # the store moved: where it is now
        saved.tracking.uri = cfg.tracking.uri
    resumed_store(saved, directory, Path(hydra_cfg.runtime.cwd))
    return saved, checkpoint


def resumed_store(saved: DictConfig, directory: Path, cwd: Path) -> None:
    """A resumed run logs to the MLflow store it was created in (its saved ``tracking.uri``, or the one the resume's
    ``tracking.uri=`` names) only if that store exists and holds its run (``run.json``'s id): a config from a dir
    made elsewhere cannot have fedrun create a store (a database, its folder) where it says, and a store that moved
    is named rather than replaced by a new, empty one. A ConfigError otherwise, before anything is created."""
    if not saved.tracking.enabled:
        return
    uri, run_id = str(saved.tracking.uri), (opened_run(directory) or {}).get("mlflow_run_id")
    named = "; name it with tracking.uri=<its URI>, the one override a resume takes"
    store = existing_store(uri, cwd)
    if store is None:
        raise ConfigError("tracking.uri", uri, f"the store the run in {directory} was logged to, which exists{named}")
    if not isinstance(run_id, str) or not run_id.isalnum():  # it never opened an MLflow run: it opens one there
        return
    from fedrun.tracking import open_client, preflight

    preflight(store)
    try:
        open_client(store).get_run(run_id)
    except Exception:  # MLflow's RESOURCE_DOES_NOT_EXIST, or a store of another kind
        raise ConfigError(
            "tracking.uri", uri, f"a store that holds the run of {directory} (MLflow run {run_id}){named}"
        ) from None


def existing_store(uri: str, cwd: Path) -> str | None:
    """``uri`` with a relative SQLite path made absolute against ``cwd``, when the store is there: the database file
    of an ``sqlite:///`` URI, the folder of a file store (a path or ``file:``); a server's URI as it is (it is
    asked, not created). None when the file or folder is missing. Nothing is created, unlike ``resolve_uri``."""
    path = local_store(uri, cwd)
    if path is None:
        return uri
    if uri.startswith(SQLITE):
        return SQLITE + str(path.resolve()) if path.is_file() else None
    return uri if path.is_dir() else None


def sweep_job(cfg: DictConfig, job_dir: Path) -> float | str | None:
    """For ``-m ... resume=<multirun dir>``: this job's final accuracy when it had finished, the reason when it
    had diverged, else None (it resumes from its checkpoint, or runs from the start when it never reached one).
    A job whose config differs from the one it was started with is refused, checkpoint or not: the sweep must be
    the same one (a job restarted from round 1 reopens its MLflow run, whose params are that config)."""
    reason = diverged(job_dir)
    if not (job_dir / "config.yaml").is_file():  # never started
        return None
    mine = OmegaConf.to_container(cfg, resolve=True)
    saved = saved_config(job_dir, cfg.resume, named=targets(mine))
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


def saved_config(directory: Path, given, named: frozenset[str] = frozenset()) -> DictConfig:
    """The config a run in ``directory`` was started with, once it is known to build nothing but fedrun's own
    classes, the names in ``FEDRUN_TRUST`` and ``named`` (those the command line names: a sweep's); one written
    before the ``pipeline`` group (November 2026) is refused first, with the command that upgrades the dir (which
    builds nothing: the upgraded config is checked when it is resumed)."""
    directory = Path(directory)
    if links := linked_files(directory, depth=0):
        # fedrun rewrites its files in the dir (metrics.csv on a resume): never through a link to a file elsewhere
        names = ", ".join(link.name for link in links)
        raise ConfigError("resume", given, f"a run dir without links, symbolic or hard ({directory} has {names})")
    try:
        saved = OmegaConf.load(directory / "config.yaml")
        plain = OmegaConf.to_container(saved)
    except Exception as exc:  # not YAML, or not a mapping: the message is OmegaConf's or PyYAML's first line
        raise ConfigError(
            "resume", given, f"a run dir with fedrun's config.yaml ({str(exc).splitlines()[0][:200]})"
        ) from None
    if not isinstance(saved, DictConfig):
        raise ConfigError("resume", given, f"a run dir with fedrun's config.yaml ({directory} has a list)")
    if "pipeline" not in saved:
        raise ConfigError(
            "resume",
            given,
            f"a run dir of this fedrun ({directory} was written by an older one: if you trust it, "
            f"upgrade it once with python -m fedrun.upgrade {directory})",
        )
    if interpolated := next(iter(interpolations(plain)), None):
        # fedrun saves its config resolved: what is checked below is then exactly what gets built
        raise ConfigError("resume", given, f"a config.yaml saved by fedrun (resolved; {interpolated} is ${{...}})")
    trusted = {name.strip() for name in os.environ.get(TRUST_VARIABLE, "").split(",") if name.strip()}
    allowed = trusted | named
    if foreign := [(key, name) for key, name in foreign_code(plain) if not (isinstance(name, str) and name in allowed)]:
        where = ", ".join(f"{name!r} at {key}" for key, name in foreign[:3])
        names = ",".join(dict.fromkeys(str(name) for _, name in foreign))
        raise ConfigError(
            "resume",
            given,
            f"a run dir whose config builds only fedrun's own classes (those conf/ names); {directory / 'config.yaml'} "
            f"names {where}, and nothing was built. If you trust that code (you started the run with it), name it "
            f"again: {TRUST_VARIABLE}={names[:300]} fedrun resume={given}"
            + (
                f" (a class an older fedrun saved: if you wrote this dir, python -m fedrun.upgrade {directory})"
                if any(name == "fedrun.engine.Schedule" for _, name in foreign)  # the one name upgrade maps
                else ""
            ),
        )
    return migrate_config(saved)  # the groups it predates, as it ran without them


@cache
def conf_targets() -> frozenset[str]:
    """Every ``_target_`` in fedrun's config tree (conf/, any file, any depth), Hydra's own settings left out."""
    found = set()

    def visit(folder) -> None:
        for entry in folder.iterdir():
            if entry.is_dir() and entry.name != "hydra":  # conf/hydra/: launchers, never in a run's config
                visit(entry)
            elif entry.name.endswith(".yaml"):
                found.update(
                    node["_target_"]
                    for key, node in nodes(yaml.safe_load(entry.read_text()))
                    if isinstance(node, dict)
                    and isinstance(node.get("_target_"), str)
                    and "hydra" not in key.split(".")  # Hydra's own settings
                )

    visit(files("fedrun.conf"))
    return frozenset(found)


# What ``device.backend`` may name in a run dir: fedrun's backends, by name or by class.
OWN_BACKENDS = frozenset({"auto", *BACKENDS, *BACKENDS.values()})


def foreign_code(config) -> list[tuple[str, object]]:
    """(key, name) of each class or function that ``config`` (plain containers) would build or import and that
    fedrun's options do not: a ``_target_`` not in ``conf_targets`` anywhere in it (Hydra's instantiate builds
    nested nodes, ``_args_`` entries included), and a ``backend`` of a ``fedrun.backends.Device`` node that is not
    one of fedrun's (``Device`` imports the class it names)."""
    found = []
    for key, node in nodes(config):
        if isinstance(node, dict):
            target = node.get("_target_")
            if "_target_" in node and not (isinstance(target, str) and target in conf_targets()):
                found.append((f"{key}._target_".lstrip("."), target))
            backend = node.get("backend", "auto")
            if target == "fedrun.backends.Device" and not (isinstance(backend, str) and backend in OWN_BACKENDS):
                found.append((f"{key}.backend".lstrip("."), node.get("backend")))
    return found


def targets(config) -> frozenset[str]:
    """The names ``foreign_code`` would refuse in ``config``: those a command line named itself."""
    return frozenset(str(name) for _, name in foreign_code(config))


def interpolations(node):
    """The keys of ``node`` (plain containers, unresolved) whose value holds an interpolation (``${...}``)."""
    return (key for key, value in nodes(node) if isinstance(value, str) and "${" in value)


def nodes(node, key: str = ""):
    """(dotted key, value) of ``node`` (plain containers) and of everything in it, at any depth."""
    yield key, node
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for name, value in items:
        yield from nodes(value, f"{key}.{name}".lstrip("."))
