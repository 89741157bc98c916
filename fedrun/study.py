"""Optuna studies whose trials each run several seeds (``hydra/sweeper=optuna``).

The sweeper (``hydra_plugins/fedrun_optuna_sweeper``) parses the search space and launches the jobs; this module
holds the rest, with no Hydra in it:

- where a study is stored (``open_storage``: by default a journal file in the sweep dir, refused in one line when
  Optuna cannot replay it: ``check_journal``) and how a resumed one is checked against the command
  (``settings_of``), its interrupted trials relaunched only with values of its search space (``relaunched_params``:
  a journal is data, never code);
- a seed job's objective value from its summary (``objective_value``; an R-index never reached counts as the
  rounds run + 1);
- a seed job's per-round reports and the pruning decision (``SeedReport``): each job writes its value of the
  objective's per-round curve (``CURVES``) each round, and the study's pruner judges the trial's mean over the
  seeds that reached round t against the finished trials' means over those same seeds (``paired_view``);
  an objective without a per-round curve is not pruned (``pruner_for``);
- what a trial leaves when its jobs return (``TrialRecord.close``): its Optuna state and attributes (the mean over
  seeds, its standard error and 95% interval, each seed's value), its MLflow run (a child of the sweep's run, the
  parent of its seeds' runs) and ``optimization_results.yaml``.

A job finds its trial by its number: trial ``n``'s seed ``i`` (of S) is job ``n * S + i`` of the sweep.
"""

from __future__ import annotations

import json
import math
import os
import sys
import typing
from pathlib import Path

from fedrun import runfiles
from fedrun.errors import ConfigError, check
from fedrun.metrics import bounds, mean_ci, r_name, within
from fedrun.sweepdir import STUDY_FILE, job_dirs, write_parent

if typing.TYPE_CHECKING:  # read_summary imports it: a refusal on the way to a run imports this module, not pandas
    import pandas as pd

RESULTS_FILE = "optimization_results.yaml"
PRUNED = "pruned"  # ``checkpoint.stop_requested`` of a pruned job: it checkpoints and stops like a signalled one
VALUE_PREFIX = "fedrun:value:"
VALUE_ATTR = VALUE_PREFIX + "{seed}:{round}"  # a trial's system attribute: one seed's reported value at one round
PRUNED_ATTR = "fedrun:pruned"  # a trial's system attribute: which seed pruned it, at which round, at what mean
RUN_ATTR = "fedrun:mlflow_run_id"  # a trial's system attribute: its MLflow run
SETTINGS_ATTR = "fedrun:settings"  # a study's user attribute: what a resume must repeat (``settings_of``)

# Summary metrics a study may optimise, and their direction (``direction: null`` takes it from here).
MAXIMIZED = ("tail_test_accuracy", "final_test_accuracy", "best_test_accuracy", "final_client_accuracy")
MINIMIZED = ("upload_mb_total", "total_wall_s", "smoothness")

# An objective's per-round curve, from the rows the engine hands ``on_round``: the row's column and how a seed's
# value at round t follows from its rows 1..t. "last": the column at t (final accuracy); "max": its best so far
# (best accuracy); "mean": the total so far / t (a total over rounds: megabytes uploaded, seconds). The mean and not
# the running sum, because Optuna's percentile pruners judge a trial by its best value over steps
# (optuna/pruners/_percentile.py, ``_get_best_intermediate_result_over_steps``), which for a sum that only grows is
# its first round's; dividing every trial's sum at round t by the same t keeps their order at t. The R-index (a
# round reached or not), ``tail_test_accuracy`` (the mean over the run's last schedule.tail rounds), ``smoothness``
# and ``lag1_autocorr`` (of the whole curve) are known when the run ends:
# they have none, and no pruner judges them (``pruner_for``).
CURVES = {
    "final_test_accuracy": ("test_accuracy", "last"),
    "best_test_accuracy": ("test_accuracy", "max"),
    "final_client_accuracy": ("client_accuracy", "last"),
    "upload_mb_total": ("upload_mb", "mean"),
    "total_wall_s": ("round_wall_s", "mean"),
}


def objective_direction(objective: str, direction: str | None, r_targets) -> str:
    """``direction`` checked, or the objective's own when null: accuracy is maximised; an R-index (``R90``, rounds
    to 90% test accuracy, one of ``metrics.r_targets``; ``client_R90`` of the clients' local models), megabytes,
    seconds and ``smoothness`` are minimised. Anything else is refused in one line."""
    r_names = [r_name(t) for t in r_targets]
    known = list(MAXIMIZED) + list(MINIMIZED) + ["lag1_autocorr"] + r_names + ["client_" + r for r in r_names]
    check(objective in known, "hydra.sweeper.objective", objective, f"a run's summary metric: {', '.join(known)}")
    check(
        direction in (None, "maximize", "minimize"),
        "hydra.sweeper.direction",
        direction,
        "maximize, minimize or null (from the objective)",
    )
    if direction is not None:
        return direction
    check(
        objective != "lag1_autocorr",
        "hydra.sweeper.direction",
        direction,
        "maximize or minimize: lag1_autocorr has no better side",
    )
    return "maximize" if objective in MAXIMIZED else "minimize"


def objective_value(summary: pd.Series, objective: str) -> float:
    """A finished seed job's objective from its ``summary.csv`` (values and tags). An R-index its run never reached
    (tag ``R90=not_reached``) is censored at the rounds it ran + 1: later than any run that reached it, by the
    least that says so. ValueError when the summary lacks it."""
    value = summary.get(objective)
    if value == "not_reached":
        return float(summary["rounds_run"]) + 1
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise ValueError(f"{objective} is not in the run's summary")
    return float(value)


def objective_interval(objective: str, mean: float, half: float) -> tuple[float, float]:
    """The objective's 95% interval, mean ± half, cut to the objective's range where it has one (an accuracy:
    [0, 1], ``fedrun.metrics.bounds``)."""
    return within(mean - half, mean + half, bounds(objective))


def read_summary(job_dir: Path) -> pd.Series:
    import pandas as pd

    return pd.read_csv(Path(job_dir) / "summary.csv", index_col=0)["value"]


def open_storage(url: str | None, sweep_dir: Path):
    """The study's Optuna storage: ``url`` (an RDB URL, e.g. ``sqlite:///study.db``, ``postgresql://...``) or, when
    null, a journal file in the sweep dir: the storage Optuna recommends for processes sharing a file system
    (its lock is a file, so jobs on cluster nodes that share the sweep dir can write to it)."""
    import optuna
    from optuna.storages.journal import JournalFileBackend

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # its INFO lines repeat fedrun's line per trial, with less
    if url:
        try:
            return optuna.storages.get_storage(url)
        except Exception as exc:  # SQLAlchemy's errors for a URL are of several kinds (no dialect, no driver, no DB)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(
                "hydra.sweeper.storage", url, f"null (a journal in the sweep dir) or an RDB URL that opens ({first})"
            ) from None
    Path(sweep_dir).mkdir(parents=True, exist_ok=True)

    class Journal(JournalFileBackend):
        """Optuna's journal file, appended to as Optuna does (its lock, one fsynced write) but never through a link
        made in the sweep dir while the study runs (``fedrun.runfiles.appended``)."""

        def append_logs(self, logs: list[dict]) -> None:
            from optuna.storages.journal._file import get_lock_file  # what JournalFileBackend.append_logs holds

            with get_lock_file(self._lock):
                text = "\n".join(json.dumps(log, separators=(",", ":")) for log in logs) + "\n"
                with runfiles.appended(Path(self._file_path), binary=True) as journal:
                    journal.write(text.encode("utf-8"))
                    journal.flush()
                    os.fsync(journal.fileno())

    return optuna.storages.JournalStorage(Journal(str(Path(sweep_dir) / STUDY_FILE)))


def check_journal(path: Path) -> None:
    """Refuse, in one line naming the file and line, a journal that Optuna cannot replay (which it says in a
    traceback): a line that is not JSON or nests deeper than Python's parser goes (``RecursionError``), one that is
    not an operation of Optuna's journal (an object with a known ``op_code``), or one whose operation does not apply
    (replayed here, line by line, as ``JournalStorage`` does). A last line without its newline is a write in
    progress, which Optuna's reader skips too (``JournalFileBackend.read_logs``)."""
    from optuna.storages.journal import BaseJournalBackend, JournalStorage
    from optuna.storages.journal._storage import JournalOperation

    path = Path(path)
    if not path.is_file():
        return
    codes = {int(op) for op in JournalOperation}

    def refuse(number: int, line, why: str) -> ConfigError:
        shown = line.decode("utf-8", "replace").strip() if isinstance(line, bytes) else str(line)
        return ConfigError(f"{path} line {number}", shown[:60] + ("..." if len(shown) > 60 else ""), why)

    logs, lines = [], []
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                break
            try:
                log = json.loads(line)
            except (ValueError, RecursionError) as exc:  # JSONDecodeError and bad UTF-8 are ValueErrors
                raise refuse(number, line, f"one JSON object per line ({type(exc).__name__})") from None
            if not isinstance(log, dict) or type(log.get("op_code")) is not int or log["op_code"] not in codes:
                raise refuse(
                    number, line, f"an operation of Optuna's journal: an object with an op_code in {sorted(codes)}"
                )
            logs.append(log)
            lines.append(line)

    class Replayed(BaseJournalBackend):
        read = 0

        def read_logs(self, log_number_from: int):
            for self.read, log in enumerate(logs[log_number_from:], start=log_number_from + 1):
                yield log

        def append_logs(self, logs) -> None:
            raise AssertionError("the journal is only read here")

    replay = Replayed()
    try:
        JournalStorage(replay)
    except Exception as exc:  # any error of Optuna's replay is the journal's: KeyError, TypeError, ValueError ...
        number = max(replay.read, 1)
        raise refuse(
            number, lines[number - 1], f"an operation Optuna can replay ({type(exc).__name__}: {exc})"
        ) from None


def check_completed(trials, objective: str, where: str) -> None:
    """Refuse, in one line, a COMPLETE trial whose value its objective cannot take: not finite, or outside its
    range (``fedrun.metrics.bounds``: an accuracy's [0, 1], an R-index's [1, inf); every other objective fedrun takes,
    megabytes, seconds, smoothness, is >= 0). A journal is data: a fabricated trial would become the study's best."""
    low, high = bounds(objective) or (0.0, math.inf)
    for trial in trials:
        if trial.state.name != "COMPLETE":
            continue
        value = trial.value
        if not isinstance(value, (int, float)) or not math.isfinite(value) or not low <= value <= high:
            raise ConfigError(
                f"{where} trial {trial.number}",
                value,
                f"a value of {objective} in [{low:g}, {high:g}] (a finite number)",
            )


def relaunched_params(trial, space: dict, where: str) -> dict:
    """An interrupted trial's parameters as they are relaunched: each one of the study's search space (``space``,
    which the resume checked against the command), with a value inside its distribution, given as the
    distribution's own value (a categorical's choice, not what the journal spelt). Anything else is a ConfigError:
    a journal is data, and an override such as a group's ``_target_`` would run code."""
    for name, value in trial.params.items():
        check(
            name in space,
            f"{where}: trial {trial.number}'s parameter {name}",
            value,
            f"a parameter of the study's search space ({', '.join(sorted(space))})",
        )
    missing = sorted(set(space) - set(trial.params))
    check(not missing, f"{where}: trial {trial.number}", f"without {', '.join(missing)}", "a value for each parameter")
    out = {}
    for name, value in trial.params.items():
        distribution = space[name]
        try:
            internal = distribution.to_internal_repr(value)
            inside = distribution._contains(internal)
        except (ValueError, TypeError):
            inside = False
        check(inside, f"{where}: trial {trial.number}'s parameter {name}", value, f"a value of {distribution}")
        out[name] = distribution.to_external_repr(internal)
    return out


def settings_of(space: dict, fixed: dict, seeds: list[int], objective: str, direction: str) -> dict:
    """What a study was started with, which its resume must repeat: the search space (Optuna's JSON of each
    distribution), the fixed overrides (``resume`` left out), the seeds, the objective and its direction."""
    from optuna.distributions import distribution_to_json

    return {
        "space": {name: json.loads(distribution_to_json(d)) for name, d in sorted(space.items())},
        "fixed": {k: str(v) for k, v in sorted(fixed.items()) if k != "resume"},
        "seeds": list(seeds),
        "objective": objective,
        "direction": direction,
    }


def check_resumed(saved: dict, now: dict) -> None:
    """A ConfigError naming the first setting a resumed study's command changed."""
    for key in ("space", "fixed", "seeds", "objective", "direction"):
        if saved.get(key) != now[key]:
            name = {"space": "hydra.sweeper.params", "fixed": "overrides"}.get(key, f"hydra.sweeper.{key}")
            raise ConfigError(
                "resume", "(this sweep dir)", f"the same {name} as the study was started with: {saved.get(key)}"
            )


def pruner_for(objective: str, pruner, default: bool):
    """The pruner a study runs with: ``pruner`` when the objective has a per-round curve (``CURVES``) or nothing
    is pruned anyway; else none, with a printed line when ``pruner`` is the default (``median``) and a ConfigError
    when the user chose one: it would judge a trial on another metric than the one the study optimises."""
    import optuna

    if objective in CURVES or isinstance(pruner, optuna.pruners.NopPruner):
        return pruner
    why = f"{objective} has no per-round curve to judge a trial by before its runs end"
    check(
        default,
        "hydra.sweeper.pruner",
        type(pruner).__name__,
        f"none: {why} (objectives with one: {', '.join(CURVES)})",
    )
    print(f"fedrun: no pruning: {why} (hydra.sweeper.pruner=none says so)", file=sys.stderr)
    return optuna.pruners.NopPruner()


def seed_values(system_attrs: dict) -> dict[int, dict[int, float]]:
    """Round -> {seed: the value that seed reported at that round}, from a trial's system attributes."""
    out: dict[int, dict[int, float]] = {}
    for key, value in system_attrs.items():
        if key.startswith(VALUE_PREFIX):
            seed, round_ = key[len(VALUE_PREFIX) :].split(":")
            out.setdefault(int(round_), {})[int(seed)] = float(value)
    return out


def mean_curve(system_attrs: dict, up_to: int | None = None) -> dict[int, float]:
    """Round -> the mean of the values the trial's seeds reported at that round (over those that reached it)."""
    return {
        r: sum(v.values()) / len(v) for r, v in sorted(seed_values(system_attrs).items()) if up_to is None or r <= up_to
    }


def paired_curve(system_attrs: dict, seeds: list[int], up_to: int | None = None) -> dict[int, float]:
    """Round -> the mean over ``seeds`` of the trial's values at that round, at the rounds every one of them
    reported (a run that stopped early at its target accuracy, or a round not evaluated, has none)."""
    return {
        r: sum(v[s] for s in seeds) / len(seeds)
        for r, v in sorted(seed_values(system_attrs).items())
        if (up_to is None or r <= up_to) and all(s in v for s in seeds)
    }


def paired_view(study, trial, round_: int, finished: dict | None = None):
    """The study as the pruner must see it when ``trial`` (a FrozenTrial, running) is judged at ``round_``: an
    in-memory copy in which the running trial and every finished trial are each their mean over the same seeds,
    those of the running trial that reached ``round_``. Returns (the copy, the running trial's view, those seeds).

    Optuna's pruners judge a trial by its intermediate values and compare them with the finished trials'
    intermediate values at the same step (``MedianPruner`` = ``PercentilePruner(50)``: prune when the trial's best
    value so far is worse than the median of the COMPLETE trials' ``intermediate_values[step]``;
    optuna/pruners/_percentile.py, ``_get_percentile_intermediate_result_over_trials``). A trial of several seeds
    has one curve per seed; seeds differ in difficulty, and under the sequential launcher a trial's first seed is
    judged alone for its whole run. Its mean over the seeds it has reached is comparable only with the other trials'
    means over those same seeds (paired by seed), so each finished trial's intermediate values in the copy are its
    mean over those seeds, round by round. Every finished trial is in the copy (a trial without those seeds' values
    has no value at the step: the pruner leaves it out, as Optuna leaves out a trial that stopped before the step),
    so ``n_startup_trials`` counts as in the study.

    ``finished`` caches each finished trial's paired curve by (trial number, seeds) across a job's rounds: a finished
    trial's values no longer change, and parsing every one of its attributes each round is O(trials x rounds)."""
    import optuna

    finished = {} if finished is None else finished
    seeds = sorted(seed_values(trial.system_attrs).get(round_, {}))
    copy = optuna.create_study(direction=study.direction, sampler=optuna.samplers.RandomSampler(seed=0))
    for done in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        key = (done.number, tuple(seeds))
        if key not in finished:
            finished[key] = paired_curve(done.system_attrs, seeds)
        copy.add_trial(
            optuna.trial.create_trial(
                state=optuna.trial.TrialState.COMPLETE, value=done.value, intermediate_values=finished[key]
            )
        )
    view = optuna.trial.FrozenTrial(
        number=trial.number,
        state=optuna.trial.TrialState.RUNNING,
        value=None,
        datetime_start=trial.datetime_start,
        datetime_complete=None,
        params=trial.params,
        distributions=trial.distributions,
        user_attrs={},
        system_attrs={},
        intermediate_values=paired_curve(trial.system_attrs, seeds, up_to=round_),
        trial_id=trial._trial_id,
    )
    return copy, view, seeds


class SeedReport:
    """One seed job's line to its trial: ``report`` each round's row, and whether to stop.

    The value reported is the objective's per-round curve (``CURVES``) as it is, which the study's pruner compares
    in the study's direction; an objective without one reports nothing and is never pruned (``pruner_for``).

    Args:
        storage: The study's storage (``open_storage``).
        study_name: The study.
        trial_number: This job's trial.
        seed: This job's seed.
        pruner: The study's pruner (an ``optuna.pruners`` object; ``NopPruner`` never prunes).
        last_round: The run's last round: no pruning there (stopping saves nothing).
        objective: The summary metric the study optimises.
    """

    def __init__(
        self,
        storage,
        study_name: str,
        trial_number: int,
        seed: int,
        pruner,
        last_round: int,
        objective: str = "final_test_accuracy",
    ):
        import optuna

        self.study = optuna.load_study(study_name=study_name, storage=storage, pruner=pruner)
        self.storage, self.seed, self.last_round, self.trial_number = storage, seed, last_round, trial_number
        self.trial_id = storage.get_trial_id_from_study_id_trial_number(self.study._study_id, trial_number)
        self.column, self.how = CURVES.get(objective, (None, None))
        # NopPruner (pruner: none) prunes no trial, this one's other seeds included: nothing to read back each round
        self.judged = self.column is not None and not isinstance(pruner, optuna.pruners.NopPruner)
        self.so_far: tuple[int, float] | None = None  # (round, this seed's value there): what "max" and "mean" carry
        self.finished: dict = {}  # the finished trials' paired curves (``paired_view``)

    def pruned(self) -> str | None:
        """Why the trial was pruned (by this or another of its seeds), or None."""
        mark = self.storage.get_trial_system_attrs(self.trial_id).get(PRUNED_ATTR)
        return None if mark is None else describe_pruned(mark)

    def value(self, round_: int, row: dict) -> float | None:
        """This seed's value of the curve at ``round_`` from its row, or None where it has none yet (a round not
        evaluated, for the final accuracy; before the first evaluated round, for the best). A job resumed from a checkpoint carries on from its value at the round before, which it
        wrote to the study before that round's checkpoint."""
        x = float(row.get(self.column, math.nan))
        if self.how == "last":
            return None if math.isnan(x) else x
        if self.so_far is None:
            values = seed_values(self.storage.get_trial_system_attrs(self.trial_id))
            mine = {r: v[self.seed] for r, v in values.items() if self.seed in v}  # the trial's other seeds' too
            before = [r for r in mine if r < round_]
            self.so_far = (max(before), mine[max(before)]) if before else (0, math.nan)
        at, last = self.so_far
        if self.how == "max":
            value = last if math.isnan(x) else x if math.isnan(last) else max(last, x)
        else:  # "mean": every row has the column (megabytes, seconds), so the total to round t is t times the mean
            value = ((0.0 if at == 0 else last * at) + x) / round_
        self.so_far = (round_, value)
        return None if math.isnan(value) else value

    def report(self, round_: int, row: dict) -> str | None:
        """Write this round's value; the reason to stop now when the trial is (or was just) pruned, else None."""
        if self.column is None:
            return None
        value = self.value(round_, row)
        if value is None:
            return None
        self.storage.set_trial_system_attr(self.trial_id, VALUE_ATTR.format(seed=self.seed, round=round_), value)
        if round_ >= self.last_round or not self.judged:
            return None
        trial = self.storage.get_trial(self.trial_id)
        if PRUNED_ATTR in trial.system_attrs:
            return describe_pruned(trial.system_attrs[PRUNED_ATTR])
        copy, view, seeds = paired_view(self.study, trial, round_, self.finished)
        if not self.study.pruner.prune(copy, view):
            return None
        mark = {
            "seed": self.seed,
            "round": round_,
            "mean": view.intermediate_values[round_],
            "seeds": seeds,
            "pruner": type(self.study.pruner).__name__,
        }
        self.storage.set_trial_system_attr(self.trial_id, PRUNED_ATTR, mark)
        return describe_pruned(mark)


def describe_pruned(mark: dict) -> str:
    over = f"seeds {mark['seeds']}, against the other trials over the same seeds" if "seeds" in mark else "its seeds"
    return (
        f"{PRUNED} by {mark['pruner']} at round {mark['round']} (the trial's mean value there, over {over}: "
        f"{mark['mean']:.4g}; seed {mark['seed']} asked)"
    )


class TrialRecord:
    """What a study leaves outside Optuna: a trial's MLflow run (child of the sweep's run, parent of its seeds'),
    the best trial on the sweep's run, and ``optimization_results.yaml`` in the sweep dir.

    Args:
        sweep_dir: The sweep's dir (job ``k``'s dir is ``<sweep_dir>/<k>``).
        uri: The MLflow tracking URI, or None when tracking is off.
        experiment: The MLflow experiment (its name).
        parent: The sweep's MLflow run id (``fedrun.sweepdir.sweep_parent``), or None.
        seeds: Each trial's seeds.
        objective: The summary metric optimised.
    """

    def __init__(
        self, sweep_dir: Path, uri: str | None, experiment: str, parent: str | None, seeds: list[int], objective: str
    ):
        self.sweep_dir, self.uri, self.experiment, self.parent = Path(sweep_dir), uri, experiment, parent
        self.seeds, self.objective = list(seeds), objective
        self.client = None
        if uri is not None:
            from fedrun.tracking import open_client

            self.client = open_client(uri)

    def open(self, study, trial) -> None:
        """Create (or, for a resumed trial, reopen) the trial's MLflow run, and point its seed jobs at it: each job
        dir gets the run's id (``fedrun.sweepdir.write_parent``), which the job reads as its MLflow parent."""
        from fedrun.tracking import Tracker, create_run, log_batch, reopen_run, retried

        if self.client is None:
            return
        run_id = study._storage.get_trial_system_attrs(trial._trial_id).get(RUN_ATTR)
        if run_id is not None:
            retried(lambda: reopen_run(self.client, run_id))
        else:
            experiment = Tracker.experiment_id(self.uri, self.experiment)
            tags = {
                "fedrun.role": "trial",
                "fedrun.trial": str(trial.number),
                "fedrun.study": study.study_name,
                "mlflow.note.content": f"Trial {trial.number} of study `{study.study_name}`: seeds {self.seeds}, "
                "each a child run of this one.",
            }
            if self.parent:
                tags["mlflow.parentRunId"] = self.parent
            name = f"trial {trial.number} " + " ".join(f"{k}={v}" for k, v in trial.params.items())
            run_id = retried(lambda: create_run(self.client, experiment, name[:250], tags))
            retried(lambda: log_batch(self.client, run_id, params=trial.params.items()))
            study._storage.set_trial_system_attr(trial._trial_id, RUN_ATTR, run_id)
        for job_dir in job_dirs(self.sweep_dir, trial.number, len(self.seeds)):
            write_parent(job_dir, run_id)

    def close(self, study, trial, returned: list[bool]) -> None:
        """Tell Optuna how the trial ended, from its seed jobs (``returned``: whether each job returned a result),
        and record it: COMPLETE with the mean of the seeds' objectives (their standard error, 95% interval and
        values as attributes); PRUNED when a seed pruned it; FAIL when a seed failed (a diverged run, a missing
        summary), with the reason as the attribute ``failure``. The mean curve of its seeds' reports becomes its
        intermediate values (what Optuna's tools show); later trials' pruning pairs its seeds' own values."""
        import optuna

        attrs = study._storage.get_trial_system_attrs(trial._trial_id)
        for round_, value in mean_curve(attrs).items():
            trial.report(value, round_)
        state, values, failure = optuna.trial.TrialState.COMPLETE, [], None
        if PRUNED_ATTR in attrs:
            state = optuna.trial.TrialState.PRUNED
        else:
            for seed, job_dir, ok in zip(self.seeds, job_dirs(self.sweep_dir, trial.number, len(self.seeds)), returned):
                try:
                    if not ok:
                        raise ValueError("its job failed")
                    values.append(objective_value(read_summary(job_dir), self.objective))
                except (OSError, ValueError, KeyError) as exc:
                    state, failure = optuna.trial.TrialState.FAIL, f"seed {seed} ({job_dir}): {exc}"
                    break
        if state == optuna.trial.TrialState.COMPLETE:
            import pandas as pd

            mean, half = mean_ci(values)
            se = float(pd.Series(values).std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else math.nan
            trial.set_user_attr("seed_values", dict(zip(map(str, self.seeds), values)))
            trial.set_user_attr("objective_se", se)
            trial.set_user_attr("objective_ci95", half)
            study.tell(trial, mean)
        else:
            if failure:
                trial.set_user_attr("failure", failure)
            study.tell(trial, state=state)
        frozen = study.get_trials(deepcopy=False)[trial.number]
        self._close_run(frozen, attrs)
        print(f"fedrun: {self.describe(frozen)}", file=sys.stderr, flush=True)

    def describe(self, trial) -> str:
        """One line: the trial, its parameters and how it ended."""
        params = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in trial.params.items())
        if trial.state.name == "COMPLETE":
            low, high = objective_interval(
                self.objective, trial.value, trial.user_attrs.get("objective_ci95", math.nan)
            )
            interval = (
                f"± {high - trial.value:.2g}" if high - trial.value == trial.value - low else f"[{low:.4g}, {high:.4g}]"
            )
            ended = f"{self.objective} {trial.value:.4g} {interval} (95% CI) over seeds {self.seeds}"
        elif trial.state.name == "PRUNED":
            ended = describe_pruned(trial.system_attrs[PRUNED_ATTR])
        else:
            ended = f"failed: {trial.user_attrs.get('failure', 'see its jobs')}"
        return f"trial {trial.number} ({params}): {ended}"

    def _close_run(self, frozen, attrs: dict) -> None:
        from fedrun.tracking import end_run, log_batch, retried

        run_id = attrs.get(RUN_ATTR)
        if self.client is None or run_id is None:
            return
        metrics = {}
        if frozen.state.name == "COMPLETE":
            extra = frozen.user_attrs
            metrics = {
                "objective": frozen.value,
                "objective_se": extra["objective_se"],
                "objective_ci95": extra["objective_ci95"],
            }
            metrics.update({f"objective_seed_{s}": v for s, v in frozen.user_attrs["seed_values"].items()})
        tags = {"optuna.state": frozen.state.name}
        if frozen.state.name == "PRUNED":
            tags["failure_reason"] = describe_pruned(attrs[PRUNED_ATTR])
        elif "failure" in frozen.user_attrs:
            tags["failure_reason"] = frozen.user_attrs["failure"]
        finite = [(k, float(v), 0) for k, v in metrics.items() if not math.isnan(v)]
        retried(lambda: log_batch(self.client, run_id, metrics=finite, tags=tags.items()))
        status = {"COMPLETE": "FINISHED", "PRUNED": "KILLED"}.get(frozen.state.name, "FAILED")
        retried(lambda: end_run(self.client, run_id, status))

    def results(self, study, settings: dict, n_trials: int) -> dict:
        """The study's outcome, written to ``optimization_results.yaml`` and put on the sweep's MLflow run: the best
        trial (number, parameters, mean over seeds with its 95% interval, each seed's value) and the count of
        trials in each state."""
        import yaml

        from fedrun.tracking import log_batch, retried

        trials = study.get_trials(deepcopy=False)
        counts = {}
        for t in trials:
            counts[t.state.name.lower()] = counts.get(t.state.name.lower(), 0) + 1
        out = {
            "name": "optuna",
            "study_name": study.study_name,
            "objective": settings["objective"],
            "direction": settings["direction"],
            "seeds": settings["seeds"],
            "n_trials": n_trials,
            "trials": counts,
        }
        complete = [t for t in trials if t.state.name == "COMPLETE"]
        if complete:
            best = study.best_trial
            low, high = objective_interval(self.objective, best.value, best.user_attrs.get("objective_ci95", math.nan))
            out["best_trial"] = {
                "number": best.number,
                "params": dict(best.params),
                "mean": best.value,
                "se": best.user_attrs.get("objective_se"),
                "ci95": [low, high],
                "seed_values": best.user_attrs.get("seed_values"),
            }
            # the "best" keys kept for users of hydra-optuna-sweeper's file
            out["best_params"], out["best_value"] = dict(best.params), best.value
        runfiles.write_text(
            self.sweep_dir / RESULTS_FILE, yaml.safe_dump(json.loads(json.dumps(out, default=float)), sort_keys=False)
        )
        if self.client is not None and self.parent:
            metrics = [(f"trials_{k}", float(v), 0) for k, v in counts.items()]
            tags = {
                "fedrun.study": study.study_name,
                "fedrun.objective": f"{settings['direction']} {settings['objective']}",
            }
            if complete:
                best = out["best_trial"]
                metrics += [("best_objective", float(best["mean"]), 0), ("best_trial", float(best["number"]), 0)]
                half = study.best_trial.user_attrs.get("objective_ci95", math.nan)
                if not math.isnan(half):
                    metrics.append(("best_objective_ci95", float(half), 0))
                tags.update({f"best.{k}": str(v) for k, v in best["params"].items()})
            retried(lambda: log_batch(self.client, self.parent, metrics=metrics, tags=tags.items()))
        return out
