"""A ``fedrun`` job, once Hydra has composed its config: open it (which config, dir and checkpoint), check and build
every object, open tracking, run the engine, say what it found. ``fedrun.cli.main`` imports this module only when a
job's parts are built (it imports MLflow and pandas): ``--help``, ``--cfg``, a composition error and a part's
refusal never do.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from fedrun import distributed, runfiles
from fedrun.backends import cpu_kernels, cpu_label, other_kernels, usable_cores
from fedrun.checkpoint import DIVERGED, RUN_FILE, Stopped, StopSignals
from fedrun.cli.build import run_engine, setup
from fedrun.cli.entry import check_run_keys, fail
from fedrun.cli.resume import Job, open_job
from fedrun.cli.runinfo import description, found, git_commit, run_name, swept_keys
from fedrun.cli.sweeps import job_cores, seed_report
from fedrun.clients import calibrate
from fedrun.engine import server_calibration
from fedrun.errors import ConfigError, DivergenceError
from fedrun.lazy import torch
from fedrun.metrics import UNSTABLE_SWING, run_summary, unstable_line
from fedrun.models import load_flat
from fedrun.study import PRUNED
from fedrun.sweepdir import sweep_parent
from fedrun.tracking import CONFIG_GROUPS, Tracker, flatten, preflight, resolve_uri


def run_job(cfg: DictConfig, hydra_cfg, parts: dict | None = None) -> float | None:
    """``main``'s job: open it (which config, dir and checkpoint), check and build it, track it, train it.
    ``parts``: ``build_parts(cfg)``, when ``main`` built them already (a new run's)."""
    try:
        job = open_job(cfg, hydra_cfg)
        if job.diverged is not None:
            fail(
                hydra_cfg,
                f"fedrun: error: had diverged: {job.diverged}; skipped, its FAILED run is kept "
                f"(delete {job.output_dir} to run it again)",
                1,
            )
        if job.finished is not None:
            print(
                f"fedrun: job {hydra_cfg.job.num} ({hydra_cfg.job.override_dirname}) had finished: skipped",
                file=sys.stderr,
            )
            return job.finished
        report = seed_report(job.cfg, hydra_cfg)
        if report is not None and (why := report.pruned()):  # another seed of its trial pruned it meanwhile
            print(
                f"fedrun: job {hydra_cfg.job.num} ({hydra_cfg.job.override_dirname}): skipped, {why}", file=sys.stderr
            )
            return None
        check_run_keys(job.cfg)

        def store_reachable() -> None:  # an unreachable store fails in one line, before the data is read
            if job.cfg.tracking.enabled:
                preflight(resolve_uri(job.cfg.tracking.uri, Path(hydra_cfg.runtime.cwd)))

        parts = setup(job.cfg, checked=store_reachable, objects=parts if job.cfg is cfg else None)
        parts["device"].load_backend()  # imports a class of the user's: named on the command line (``open_job``)
        settle_threads(job, hydra_cfg, parts["device"])
    except (ConfigError, FileNotFoundError) as exc:
        fail(hydra_cfg, f"fedrun: error: {exc}", 2)
    try:
        try:  # a resumed run's CSV files are checked as they are rewound, before its MLflow run opens
            tracker, title = open_tracking(job, hydra_cfg, parts, report)
        except ConfigError as exc:
            fail(hydra_cfg, f"fedrun: error: {exc}", 2)
        return train(job, hydra_cfg, parts, tracker, title, report)
    finally:
        if job.follower:  # a rank > 0 of a distributed run: its temporary dir held nothing rank 0 lacks
            shutil.rmtree(job.output_dir, ignore_errors=True)


def open_tracking(job: Job, hydra_cfg, parts: dict, report=None) -> tuple[Tracker, str]:
    """The run's Tracker, with its MLflow run open: reopened when the job continues (from a checkpoint, or from
    round 1 after a stop before the first one), else new, with the config as params and the tags (a study's
    seed job: its trial and study too). Returns it and the run's title."""
    cfg, output_dir, checkpoint = job.cfg, job.output_dir, job.checkpoint
    choices = {g: hydra_cfg.runtime.choices[g] for g in CONFIG_GROUPS if hydra_cfg.runtime.choices.get(g)}
    tags = {
        **choices,
        "seed": str(cfg.seed),
        "output_dir": str(output_dir),
        "git_commit": git_commit(),
        "torch_version": torch.__version__,
        "num_clients": str(len(parts["clients"])),
        "torch_threads": str(parts["device"].threads),
        "cpu": cpu_label(checkpoint.extra["cpus"][0]),  # the kernels its numbers are of (``settle_cpus``)
    }
    if report is not None:
        tags.update({"fedrun.trial": str(report.trial_number), "fedrun.study": report.study.study_name})
    if "scale" in cfg.dataset:  # the input scale changes what a learning rate and a temperature mean: say it on the run
        tags["input_scale"] = str(cfg.dataset.scale)
    tracker = Tracker(
        output_dir=output_dir,
        num_clients=len(parts["clients"]),
        enabled=cfg.tracking.enabled,
        uri=resolve_uri(cfg.tracking.uri, Path(hydra_cfg.runtime.cwd)),
        experiment=cfg.tracking.experiment,
        max_alpha_series=cfg.tracking.max_alpha_series,
        alpha_informative=parts["aggregator"].alpha_informative or parts["sampler"].alpha_informative,
    )
    title = " ".join(f"{g}={c}" for g, c in choices.items() if g in ("aggregator", "partition", "dataset", "method"))
    title += f" seed={cfg.seed}"
    if checkpoint.resume:  # the same files and MLflow run, from the round after the checkpoint
        saved = checkpoint.restored()
        tracker.rewind(checkpoint.saved_round)
        tracker.start({}, {}, "", run_id=saved["extra"].get("mlflow_run_id"))
        title = saved["extra"].get("title", title)  # this invocation's choices are the defaults
        print(f"fedrun: resuming {output_dir} after round {checkpoint.saved_round}", file=sys.stderr)
    else:
        reopened = job.reopened or {}
        if job.restart:  # the rows the stopped run wrote are measured again
            tracker.rewind(0)
            title = reopened.get("title", title)
            print(
                f"fedrun: restarting {output_dir} from round 1 (it was stopped before its first checkpoint)",
                file=sys.stderr,
            )
        data = parts["data"]
        tracker.log_partition(parts["clients"], data.y_train.numpy(), data.num_classes, parts["client_tests"])
        if not job.restart:  # a restart keeps the file its run was started with
            OmegaConf.save(cfg, tracker.dir / "config.yaml", resolve=True)
        tags["overrides"] = hydra_cfg.job.override_dirname or "(defaults)"
        tags["mlflow.note.content"] = description(cfg, choices, tags["overrides"], output_dir)
        # <sweep dir>/<num>: a study's trial run is its seed jobs' parent (in the job dir), a sweep's run its jobs'
        parent = (
            sweep_parent(output_dir) or sweep_parent(output_dir.parent) if hydra_cfg.mode == RunMode.MULTIRUN else None
        )
        if parent and cfg.tracking.enabled:
            tags["mlflow.parentRunId"] = parent
        varying = (
            swept_keys(Path(str(hydra_cfg.sweep.dir)), OmegaConf.select(hydra_cfg, "sweeper.params"))
            if hydra_cfg.mode == RunMode.MULTIRUN
            else frozenset()
        )
        name = run_name(choices, hydra_cfg.overrides.task, cfg.seed, varying)
        params = flatten(OmegaConf.to_container(cfg, resolve=True))
        tracker.start(params, tags, name, run_id=reopened.get("mlflow_run_id"))
    checkpoint.extra.update(mlflow_run_id=tracker.run_id, title=title)
    checkpoint.before_save.append(tracker.flush)  # the rounds a resume from it will not measure again are in MLflow
    # What a restart before the first checkpoint reopens; written atomically (a kill mid-write leaves the old file).
    runfiles.write_text(output_dir / RUN_FILE, json.dumps(checkpoint.extra) + "\n")
    return tracker, title


MAX_THREADS = 4096  # a thread count read back from a run dir is checked (the dir may come from elsewhere)


def settle_threads(job: Job, hydra_cfg, device) -> int:
    """Set the job's torch threads and default workers, resolved once per run: a run that continues (from its
    checkpoint, or from round 1 after a stop before it) takes the counts its first start resolved (``run.json`` and
    the checkpoint keep them), whatever the machine, the sweep's ``n_jobs`` or the world size now; matrix products
    give other last bits at other thread counts. A new run resolves ``device.threads: null`` to the cores it may use
    (all, or cores / jobs in a parallel sweep), one thread per rank for ``device.backend=distributed`` (the ranks
    are the parallelism: a default that followed the ranks per machine would change a run's numbers with its world
    size). Returns the threads set."""
    saved = job.checkpoint.restored()["extra"] if job.checkpoint.resume else (job.reopened or {})
    if "threads" in saved:
        for key in ("threads", "cores"):
            value = saved.get(key)
            if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_THREADS):
                raise ConfigError(f"{key} saved in {job.output_dir}", value, f"an integer from 1 to {MAX_THREADS}")
        device.threads, cores = saved["threads"], saved["cores"]
    else:
        cores = job_cores(hydra_cfg) if hydra_cfg.mode == RunMode.MULTIRUN else usable_cores()
        if distributed.chosen(job.cfg.device) and device.threads is None:
            device.threads = 1
    device.threads = device.use_cores(cores)
    job.checkpoint.extra.update(threads=device.threads, cores=cores, cpus=settle_cpus(job, saved.get("cpus", [])))
    return device.threads


MAX_CPUS = 64  # CPUs a run dir may name (each start on another CPU adds one)


def settle_cpus(job: Job, cpus) -> list[dict[str, str]]:
    """The CPUs the run has run on (``fedrun.backends.cpu_kernels``), one more each time it starts on another than it
    last ran on, this one last. A run's numbers are its config's, seed's and thread count's on its CPU's kernels, so
    a run that continues on other kernels than it started on says so in one line (its rounds from here may differ in
    their last bits from a run never stopped). A list read back from a run dir is checked."""
    allowed = f"a list of at most {MAX_CPUS} CPUs, each a mapping of names to strings"
    if not isinstance(cpus, list) or len(cpus) > MAX_CPUS:
        shown = f"{len(cpus)} CPUs" if isinstance(cpus, list) else cpus
        raise ConfigError(f"cpus saved in {job.output_dir}", shown, allowed)
    for cpu in cpus:
        if not (isinstance(cpu, dict) and all(isinstance(v, str) for v in cpu.values())):
            raise ConfigError(f"a CPU in cpus saved in {job.output_dir}", cpu, allowed)
    here = cpu_kernels()
    if cpus and (moved := other_kernels(cpus[0], here)) and not job.follower:
        print(
            f"fedrun: warning: {job.output_dir} started on {moved}: its rounds from here may differ in their last "
            "bits from a run that never stopped (other CPU kernels sum in another order)",
            file=sys.stderr,
        )
    return cpus if cpus and cpus[-1] == here else [*cpus, here]


def train(job: Job, hydra_cfg, parts: dict, tracker: Tracker, title: str, report=None) -> float | None:
    """Run the engine and close the MLflow run as FINISHED, FAILED (diverged: exit 1, the rounds before kept) or
    KILLED (a signal: exit 128 + its number, after a checkpoint; under submitit, SIGUSR2 requeues the job; a
    study's pruner: after a checkpoint, returning None, the sweep goes on)."""
    output_dir, checkpoint, model = job.output_dir, job.checkpoint, parts["model"]
    status, reason, final, stopped, divergence, measured = "FAILED", None, None, None, None, {}
    refused = None  # a file of the run dir that became a link while it trained (``fedrun.runfiles``)
    on_submitit = os.environ.get("SUBMITIT_EXECUTOR") and hasattr(signal, "SIGUSR2")
    submitit_handler = signal.getsignal(signal.SIGUSR2) if on_submitit else None
    pruned = None

    def on_round(row: dict, per_client: dict) -> None:
        nonlocal pruned
        tracker.log_round(row, per_client)
        if report is not None and not checkpoint.stop_requested:
            # between rounds: the engine checkpoints and stops as for a signal
            if why := report.report(int(row["round"]), row):  # the study takes its objective's column
                pruned, checkpoint.stop_requested = why, PRUNED

    if (line := parts["schedule"].thin_tail()) and not job.follower:
        print(line, file=sys.stderr)  # a warning: a long stride may be the point (an expensive evaluation)
    signals = StopSignals(checkpoint).__enter__()  # until the run is closed: a signal while it closes waits for that
    try:
        result = run_engine(parts, job.cfg.seed, on_round=on_round, checkpoint=checkpoint)
        load_flat(model, result.params)
        status, final = "FINISHED", model.cpu()
        if (calibration := server_calibration(final, parts["data"].x_train, parts["clients"])) is not None:
            calibrate(final, *calibration)  # model.pt holds the statistics the test accuracy was measured with
        tracker.log_tables(result.tables)
        measured = result.summary
        accuracy = result.rows[-1]["test_accuracy"]
    except Stopped as exc:
        status, reason, stopped = "KILLED", pruned or str(exc), exc
    except DivergenceError as exc:
        reason, divergence = f"DivergenceError: {exc}", exc
    except runfiles.RunFileError as exc:  # a link made in the run dir, a crafted file read back
        reason, refused = f"{type(exc).__name__}: {exc}", exc
    except BaseException as exc:
        reason = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        # The global model is saved only if the run finished (a failed run's workspace holds a client's model).
        window = parts["schedule"].tail
        swing = job.cfg.metrics.get("unstable_swing", UNSTABLE_SWING)  # a run saved before the key: its default
        values, tags = run_summary(tracker.rows, job.cfg.metrics.r_targets, measured, window, swing)
        tags.update(parts["aggregator"].run_tags(), **parts["privacy"].run_tags(), **parts["attack"].run_tags())
        if status == "KILLED" and pruned:
            tags["fedrun.pruned"] = "true"
        tracker.finish(status, values, tags, model=final, reason=reason, title=title)
        signals.__exit__()
        if not job.follower:  # what the run found, and where it is
            schedule = parts["schedule"]
            why = reason or (
                f"schedule.stop_at_accuracy={schedule.stop_at_accuracy} reached"
                if schedule.stop_at_accuracy is not None
                else None
            )
            shown = min(window, len(tracker.rows))  # a run shorter than its tail window: all its rounds
            lines = [unstable_line(values, tags, shown), *found(values, tags, schedule.rounds, status, why)]
            print("\n".join([line for line in lines if line] + [f"fedrun: run folder: {output_dir}"]), file=sys.stderr)
        if tracker.lost:
            print(
                f"fedrun: MLflow missed part of this run ({tracker.lost}); {output_dir} has all of it. Import it with:\n"
                f"  fedrun-import {output_dir}",
                file=sys.stderr,
            )
    # A stop asked for in a sweep job's last round (it finished) or while it diverged: the sweep must not go on to
    # the next job, whose own run would not know of the signal. Under submitit each job is its own process.
    asked = checkpoint.stop_requested if checkpoint.stop_requested != PRUNED else None
    stop_sweep = asked and status != "KILLED" and hydra_cfg.mode == RunMode.MULTIRUN and not on_submitit
    if divergence is not None:
        runfiles.write_text(output_dir / DIVERGED, f"{divergence}\n")
    if stop_sweep:
        what = (
            "in this job's last round: the job finished"
            if status == "FINISHED"
            else f"while this job failed ({reason})"
        )
        print(
            f"fedrun: {asked} came {what}; the sweep stops here (run the same command with resume=<sweep dir> to "
            "go on)",
            file=sys.stderr,
        )
        sys.exit(128 + signal.Signals[asked].value)
    if status == "FINISHED":
        return accuracy
    if stopped is not None and stopped.signal_name == PRUNED:
        print(
            f"fedrun: job {hydra_cfg.job.num} ({hydra_cfg.job.override_dirname}) stopped after round {stopped.round}, "
            f"{pruned}; its run is KILLED and keeps its checkpoint",
            file=sys.stderr,
        )
        return None
    if divergence is not None or refused is not None:
        what = f"training diverged: {divergence}" if refused is None else str(refused)
        fail(
            hydra_cfg,
            f"fedrun: error: {what}; the run is marked FAILED and keeps the metrics of the rounds before ({output_dir})",
            1,
        )
    if not job.follower:  # rank 0 says it (a follower's dir is not the run's)
        print(
            f"fedrun: {stopped}; the run is marked KILLED and kept its metrics. Continue it with:\n"
            f"  fedrun resume={output_dir}",
            file=sys.stderr,
        )
    if stopped.signal_name == "SIGUSR2" and callable(submitit_handler):  # the time limit is near: submitit requeues
        print(
            "fedrun: handing the job to submitit to requeue; it resumes from this checkpoint",
            file=sys.stderr,
            flush=True,
        )
        submitit_handler(signal.SIGUSR2, None)  # the job, which then resumes here from the checkpoint (``requeued``)
    sys.exit(128 + signal.Signals[stopped.signal_name].value)
