"""The ``fedrun`` command: compose the config, validate and build every object, open tracking, run the engine.

This is the only module that touches Hydra or OmegaConf; everything below it takes plain objects.
"""

import atexit
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import typing
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from fedrun.backends import usable_cores
from fedrun.checkpoint import DIVERGED, FILE, RUN_FILE, Checkpoint, Stopped, StopSignals, diverged
from fedrun.datasets import SCALE_NAMES
from fedrun.errors import ConfigError, DivergenceError
from fedrun.models import load_flat
from fedrun.partitions import hold_out
from fedrun.rounds import STOP_ON
from fedrun.seeding import numpy_rng, torch_seed
from fedrun.tracking import (
    CONFIG_GROUPS,
    Tracker,
    close_sweep_run,
    flatten,
    open_sweep_run,
    preflight,
    resolve_uri,
    sweep_parent,
)

# ``${fedrun.either:a,b}``: a unless it is null or empty, else b (the run dir of ``resume=<dir>`` is that dir).
OmegaConf.register_new_resolver("fedrun.either", lambda value, default: value if value else default, replace=True)


def build(group: str, node: DictConfig, **runtime):
    """``instantiate(node, **runtime)``, turning constructor errors into one-line ConfigErrors for ``group``."""
    try:
        return instantiate(node, **runtime)
    except InstantiationException as exc:
        cause = exc.__cause__
        if isinstance(cause, ConfigError):
            raise cause.within(group) from None
        raise _explain(group, node, cause or exc) from None


def _explain(group: str, node: DictConfig, cause: BaseException) -> ConfigError:
    """A ConfigError naming the one key the constructor's error is about: an unknown key, a value of the wrong
    type, or the value its message quotes (torch's "Invalid learning rate: -0.1")."""
    target = node.get("_target_")
    constructor = None
    try:
        constructor = hydra.utils.get_object(target).__init__
        hints = typing.get_type_hints(constructor)
    except Exception:  # a target without usable annotations: fall back to the constructor's own message
        hints = {}
    arguments = {k: v for k, v in OmegaConf.to_container(node).items() if not k.startswith("_")}
    unknown = re.search(r"unexpected keyword argument '(\w+)'", str(cause))
    if unknown and unknown.group(1) in arguments:
        known = (
            [
                name
                for name in inspect.signature(constructor).parameters
                if name not in ("self", "params", "args", "kwargs")
            ]
            if constructor
            else []
        )
        return ConfigError(
            f"{group}.{unknown.group(1)}",
            arguments[unknown.group(1)],
            f"a key of {group} ({', '.join(known)})" if known else f"a key of {target}",
        )
    for key, value in arguments.items():
        types = typing.get_args(hints.get(key)) or (hints.get(key),)
        if (int in types or float in types) and isinstance(value, (str, bool)):
            return ConfigError(f"{group}.{key}", value, "a number" if float in types else "an integer")
    quoted = [
        key
        for key, value in arguments.items()
        if isinstance(value, (int, float)) and re.search(rf"(?<![\w.-]){re.escape(str(value))}(?![\w.])", str(cause))
    ]
    if len(quoted) == 1:
        return ConfigError(f"{group}.{quoted[0]}", arguments[quoted[0]], f"a value {target} accepts ({cause})")
    return ConfigError(group, arguments, f"valid arguments for {target} ({cause})")


def setup(cfg: DictConfig) -> dict:
    """Build every object of the run and check them against each other, before any training."""
    seed = cfg.seed
    if not isinstance(seed, int) or seed < 0:
        raise ConfigError("seed", seed, "an integer >= 0")
    groups = ("dataset", "partition", "aggregator", "server", "schedule", "heterogeneity", "device", "engine")
    objects = {group: build(group, cfg[group]) for group in groups}
    # Each stage on its own, so that an error names its key (pipeline.stages.0.max_norm), then the pipeline around them.
    stages = [build(f"pipeline.stages.{i}", stage) for i, stage in enumerate(cfg.pipeline.get("stages", []))]
    objects["pipeline"] = build("pipeline", cfg.pipeline, stages=stages)
    objects["engine"].check(objects["aggregator"], objects["heterogeneity"], objects["pipeline"])
    schedule = objects["schedule"]
    if (
        schedule.stop_at_accuracy is not None
        and "client_accuracy" in STOP_ON[schedule.stop_on]
        and not objects["dataset"].client_test_fraction
    ):
        raise ConfigError(
            "schedule.stop_on",
            schedule.stop_on,
            "test while dataset.client_test_fraction is 0 (client_accuracy needs each client's held-out samples)",
        )
    optimizer = build("optimizer", cfg.optimizer)
    try:  # torch optimizers check their arguments when built: do it now, not in round 1
        optimizer([torch.zeros(1, requires_grad=True)])
    except ConfigError as exc:
        raise exc.within("optimizer") from None
    except (ValueError, TypeError) as exc:
        raise _explain("optimizer", cfg.optimizer, exc) from None
    check_run_keys(cfg)

    data = objects["dataset"].load(seed)
    try:
        clients = objects["partition"](data.y_train.numpy(), numpy_rng(seed, "partition"), natural=data.natural_split)
    except ConfigError as exc:
        raise exc.within("partition") from None
    client_tests = None
    if objects["dataset"].client_test_fraction > 0:
        try:
            clients, client_tests = hold_out(
                clients, objects["dataset"].client_test_fraction, numpy_rng(seed, "client_test")
            )
        except ConfigError as exc:
            raise exc.within("dataset") from None
    torch.manual_seed(torch_seed(seed, "init"))  # the initial model depends on the seed only
    model = build("model", cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
    return dict(objects, optimizer=optimizer, data=data, clients=clients, client_tests=client_tests, model=model)


def check_run_keys(cfg: DictConfig) -> None:
    """The root-level keys that no constructor checks."""
    targets = cfg.metrics.r_targets
    if not OmegaConf.is_list(targets) or not all(isinstance(t, (int, float)) and 0 < t <= 1 for t in targets):
        raise ConfigError(
            "metrics.r_targets",
            OmegaConf.to_container(targets) if OmegaConf.is_config(targets) else targets,
            "a list of accuracies in (0, 1]",
        )
    tracking = cfg.tracking
    if not isinstance(tracking.enabled, bool):
        raise ConfigError("tracking.enabled", tracking.enabled, "true or false")
    if not isinstance(tracking.uri, str) or not tracking.uri:
        raise ConfigError(
            "tracking.uri", tracking.uri, "an MLflow tracking URI (sqlite:///path.db, http://host:port, ...)"
        )
    if not isinstance(tracking.experiment, str) or not tracking.experiment:
        raise ConfigError("tracking.experiment", tracking.experiment, "a non-empty experiment name")
    if (
        not isinstance(tracking.max_alpha_series, int)
        or isinstance(tracking.max_alpha_series, bool)
        or tracking.max_alpha_series < 0
    ):
        raise ConfigError("tracking.max_alpha_series", tracking.max_alpha_series, "an integer >= 0")


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


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


class JobFailed(Exception):
    """A sweep job that failed (its one-line reason already printed): the sweep's other jobs still run."""


def fail(hydra_cfg, line: str, code: int) -> typing.NoReturn:
    """Print the one-line reason; exit with ``code``, or in a sweep fail only this job (Hydra runs the rest and
    reports the failed jobs' overrides at the end)."""
    if hydra_cfg.mode == RunMode.MULTIRUN:
        line = line.replace(
            "fedrun: error: ", f"fedrun: error: job {hydra_cfg.job.num} ({hydra_cfg.job.override_dirname}): ", 1
        )
        print(line, file=sys.stderr)
        raise JobFailed(line)
    print(line, file=sys.stderr)
    sys.exit(code)


def run_name(choices: dict, overrides, seed: int) -> str:
    """A short run name that says what the run is and what differs: the aggregator, partition and dataset
    chosen, each overridden value by its last key (paths and tracking keys left out), and the seed; e.g.
    ``fedsoftmax shards mnist temperature=0.1 seed=2``. The whole override string is the tag ``overrides``."""
    words = [choices.get(group) for group in ("aggregator", "partition", "dataset") if choices.get(group)]
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if "." not in key or key.startswith(("tracking.", "hydra.")) or "/" in value or key == "resume":
            continue  # group choices are in the words already; paths say nothing about the run
        words.append(f"{key.rsplit('.', 1)[-1]}={value}")
    return " ".join(words + [f"seed={seed}"])[:250]


def description(cfg: DictConfig, choices: dict, overrides: str, output_dir: Path) -> str:
    """The run's description in the MLflow UI (markdown): each config group's choice and its values, the
    overrides, the seed and the output dir."""
    scale = f" ({SCALE_NAMES[cfg.dataset.scale]})" if "scale" in cfg.dataset else ""
    lines = [
        f"**{choices.get('aggregator', '')}** on **{choices.get('dataset', '')}**{scale}, partition **{choices.get('partition', '')}**, "
        f"seed {cfg.seed}",
        "",
    ]
    for group in CONFIG_GROUPS:
        node = cfg.get(group)
        if not isinstance(node, DictConfig):
            continue
        values = ", ".join(
            f"{k}={v}" for k, v in flatten(OmegaConf.to_container(node, resolve=True)).items() if not k.startswith("_")
        )
        lines.append(f"- {group}: `{choices.get(group, '')}` {values}")
    lines += ["", f"Overrides: `{overrides}`", "", f"Output: `{output_dir}`"]
    return "\n".join(lines)


def job_cores(hydra_cfg) -> int:
    """The cores a sweep job may use: what a Ray launcher gives each task (``ray.remote.num_cpus``), or cores /
    concurrent jobs under joblib (``n_jobs``; negative counts from the core count as joblib does), else all."""
    ray_cpus = OmegaConf.select(hydra_cfg, "launcher.ray.remote.num_cpus")
    if isinstance(ray_cpus, (int, float)) and ray_cpus >= 1:
        return int(ray_cpus)
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
        if not config.tracking.enabled:
            return
        uri = resolve_uri(config.tracking.uri, Path.cwd())
        preflight(uri)
        overrides = [o for o in config.hydra.overrides.task if not o.startswith(("tracking.", "hydra.", "resume="))]
        sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        tags = {
            "fedrun.role": "sweep",
            "sweep_dir": str(sweep_dir),
            "overrides": " ".join(config.hydra.overrides.task) or "(defaults)",
            "git_commit": git_commit(),
            "mlflow.note.content": f"Sweep of {' '.join(overrides) or 'the defaults'}; its jobs are this run's children. Output: `{sweep_dir}`",
        }
        run_id = open_sweep_run(
            uri, config.tracking.experiment, sweep_dir, ("sweep " + " ".join(overrides))[:250], tags
        )
        atexit.register(close_sweep_run, uri, run_id)


def sweep_job(cfg: DictConfig, job_dir: Path) -> float | str | None:
    """For ``-m ... resume=<multirun dir>``: this job's final accuracy when it had finished, the reason when it
    had diverged, else None (it resumes from its checkpoint, or runs from the start when it never reached one).
    A job whose config differs from the one it was started with is refused: the sweep must be the same one."""
    reason = diverged(job_dir)
    if not (job_dir / FILE).is_file() and reason is None:
        return None
    saved = OmegaConf.load(job_dir / "config.yaml")
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
    state = Checkpoint(job_dir, resume=True).restored()
    return state["rows"][-1]["test_accuracy"] if state["finished"] else None


@hydra.main(config_path="pkg://fedrun.conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    """Run one job; returns the final test accuracy (Hydra sweepers can use it)."""
    hydra_cfg = HydraConfig.get()
    output_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        requeued = (
            bool(os.environ.get("SUBMITIT_EXECUTOR")) and (output_dir / FILE).is_file()
        )  # submitit restarted this job
        resuming = bool(cfg.resume) or requeued
        if resuming and hydra_cfg.mode == RunMode.MULTIRUN:  # this job of an earlier sweep, in its own dir
            done = sweep_job(cfg, output_dir)
            if isinstance(done, str):  # a failed job stays failed: its FAILED run has the metrics of the rounds before
                fail(
                    hydra_cfg,
                    f"fedrun: error: had diverged: {done}; skipped, its FAILED run is kept (delete {output_dir} to run it again)",
                    1,
                )
            if done is not None:
                print(
                    f"fedrun: job {hydra_cfg.job.num} ({hydra_cfg.job.override_dirname}) had finished: skipped",
                    file=sys.stderr,
                )
                return done
            checkpoint = Checkpoint(output_dir, cfg.checkpoint.every, resume=(output_dir / FILE).is_file())
            cfg.resume = None  # what the job's config.yaml says: it is the sweep's job, not a resume of something else
        elif cfg.resume:
            cfg, checkpoint = resumed_config(cfg, hydra_cfg)
            output_dir = checkpoint.path.parent
        else:
            checkpoint = Checkpoint(output_dir, cfg.checkpoint.every)
        # Resumed (or requeued) before its first checkpoint: it starts again in the same dir, and in the same MLflow
        # run when it had opened one (run.json, written once the run is open).
        restart = resuming and not checkpoint.resume and (output_dir / RUN_FILE).is_file()
        check_run_keys(cfg)
        if cfg.tracking.enabled:  # an unreachable store fails now, in one line, not after loading and training
            preflight(resolve_uri(cfg.tracking.uri, Path(hydra_cfg.runtime.cwd)))
        parts = setup(cfg)
    except (ConfigError, FileNotFoundError) as exc:
        fail(hydra_cfg, f"fedrun: error: {exc}", 2)

    choices = {
        group: hydra_cfg.runtime.choices[group] for group in CONFIG_GROUPS if hydra_cfg.runtime.choices.get(group)
    }
    tags = {
        **choices,
        "seed": str(cfg.seed),
        "output_dir": str(output_dir),
        "git_commit": git_commit(),
        "torch_version": torch.__version__,
        "num_clients": str(len(parts["clients"])),
        "torch_threads": str(
            parts["device"].use_cores(job_cores(hydra_cfg) if hydra_cfg.mode == RunMode.MULTIRUN else usable_cores())
        ),
    }
    if "scale" in cfg.dataset:  # the input scale changes what a learning rate and a temperature mean: say it on the run
        tags["input_scale"] = str(cfg.dataset.scale)
    tracker = Tracker(
        output_dir=output_dir,
        num_clients=len(parts["clients"]),
        enabled=cfg.tracking.enabled,
        uri=resolve_uri(cfg.tracking.uri, Path(hydra_cfg.runtime.cwd)),
        experiment=cfg.tracking.experiment,
        max_alpha_series=cfg.tracking.max_alpha_series,
        r_targets=tuple(cfg.metrics.r_targets),
    )
    title = (
        " ".join(f"{g}={c}" for g, c in choices.items() if g in ("aggregator", "partition", "dataset", "method"))
        + f" seed={cfg.seed}"
    )
    if checkpoint.resume:  # the same files and MLflow run, from the round after the checkpoint
        saved = checkpoint.restored()
        tracker.rewind(checkpoint.saved_round)
        tracker.start({}, {}, "", run_id=saved["extra"].get("mlflow_run_id"))
        title = saved["extra"].get("title", title)  # this invocation's choices are the defaults
        print(f"fedrun: resuming {output_dir} after round {checkpoint.saved_round}", file=sys.stderr)
    else:
        if restart:  # the rows the killed run wrote are measured again
            tracker.rewind(0)
            reopened = json.loads((output_dir / RUN_FILE).read_text())
            title = reopened.get("title", title)
            print(
                f"fedrun: restarting {output_dir} from round 1 (it was stopped before its first checkpoint)",
                file=sys.stderr,
            )
        tracker.log_partition(
            parts["clients"], parts["data"].y_train.numpy(), parts["data"].num_classes, parts["client_tests"]
        )
        OmegaConf.save(cfg, tracker.dir / "config.yaml", resolve=True)
        tags["overrides"] = hydra_cfg.job.override_dirname or "(defaults)"
        tags["mlflow.note.content"] = description(cfg, choices, tags["overrides"], output_dir)
        parent = (
            sweep_parent(output_dir.parent) if hydra_cfg.mode == RunMode.MULTIRUN else None
        )  # a job's dir is <sweep dir>/<num>
        if parent and cfg.tracking.enabled:
            tags["mlflow.parentRunId"] = parent
        tracker.start(
            flatten(OmegaConf.to_container(cfg, resolve=True)),
            tags,
            run_name(choices, hydra_cfg.overrides.task, cfg.seed),
            run_id=reopened.get("mlflow_run_id") if restart else None,
        )
    checkpoint.extra.update(mlflow_run_id=tracker.run_id, title=title)
    (output_dir / RUN_FILE).write_text(
        json.dumps(checkpoint.extra) + "\n"
    )  # what a restart before the first checkpoint reopens

    status, reason, model, final, stopped, divergence = "FAILED", None, parts["model"], None, None, None
    submitit_handler = (
        signal.getsignal(signal.SIGUSR2) if os.environ.get("SUBMITIT_EXECUTOR") and hasattr(signal, "SIGUSR2") else None
    )
    try:
        with StopSignals(checkpoint):
            result = parts["engine"](
                model=model,
                data=parts["data"],
                clients=parts["clients"],
                aggregator=parts["aggregator"],
                optimizer=parts["optimizer"],
                schedule=parts["schedule"],
                device=parts["device"],
                seed=cfg.seed,
                server=parts["server"],
                on_round=tracker.log_round,
                client_tests=parts["client_tests"],
                heterogeneity=parts["heterogeneity"],
                pipeline=parts["pipeline"],
                checkpoint=checkpoint,
            )
        load_flat(model, result.params)
        status, final = "FINISHED", model.cpu()
        tracker.log_result(result.summary, result.tables)
        return result.rows[-1]["test_accuracy"]
    except Stopped as exc:
        status, reason, stopped = "KILLED", str(exc), exc
    except DivergenceError as exc:
        reason, divergence = f"DivergenceError: {exc}", exc
    except BaseException as exc:
        reason = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        # The global model is saved only if the run finished (a failed run's workspace holds a client's model).
        tracker.finish(status, model=final, reason=reason, title=title, tags=parts["aggregator"].tags)
        if tracker.lost:
            print(
                f"fedrun: MLflow missed part of this run ({tracker.lost}); {output_dir} has all of it. Import it with:\n"
                f"  fedrun-import {output_dir}",
                file=sys.stderr,
            )
    if divergence is not None:
        (output_dir / DIVERGED).write_text(f"{divergence}\n")
        fail(
            hydra_cfg,
            f"fedrun: error: training diverged: {divergence}; the run is marked FAILED and keeps the metrics of "
            f"the rounds before ({output_dir})",
            1,
        )
    print(
        f"fedrun: {stopped}; the run is marked KILLED and kept its metrics. Continue it with:\n"
        f"  fedrun resume={output_dir}",
        file=sys.stderr,
    )
    if stopped.signal_name == "SIGUSR2" and callable(submitit_handler):  # the time limit is near: submitit requeues the
        print(
            "fedrun: handing the job to submitit to requeue; it resumes from this checkpoint",
            file=sys.stderr,
            flush=True,
        )
        submitit_handler(signal.SIGUSR2, None)  # job, which then resumes here from the checkpoint (``requeued``)
    sys.exit(128 + signal.Signals[stopped.signal_name].value)
