"""fedrun's Optuna sweeper: ``fedrun -m hydra/sweeper=optuna``, on the current Optuna.

A trial runs every seed of ``hydra.sweeper.seeds`` (jobs of whichever launcher is configured) and its objective
is the mean of the seeds' summary metric ``hydra.sweeper.objective``; its jobs report the objective's per-round
curve each round and the study's pruner stops lagging trials between rounds, judging a trial's seeds against the
other trials' same seeds (an objective known only at the end, an R-index, is not pruned); ``resume=<sweep dir>``
continues the study up to ``n_trials`` in all, finishing its interrupted trials from their checkpoints (with
parameters of its search space only). A sweep whose every trial failed exits 1. The parts without Hydra are in
``fedrun.study``.

The search space takes the syntax of Hydra's own Optuna sweeper (``hydra.sweeper.params`` or sweep overrides on
the command line): ``interval(a, b)`` is a float uniform on [a, b], ``tag(log, interval(a, b))`` log-uniform,
``choice(x, y)`` or ``x,y`` categorical, ``range(a, b[, step])`` the integers of Python's ``range`` (b left out, as
Hydra's basic sweeper expands it; hydra-optuna-sweeper 1.3 lets b in), a float or shuffled range categorical
over its values. An override that does not sweep is fixed in every job.
"""

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, ListConfig, OmegaConf

TARGET = "hydra_plugins.fedrun_optuna_sweeper.optuna_sweeper.FedrunOptunaSweeper"


# Every field is typed Any: OmegaConf would refuse a wrong type (``n_trials=abc``) in Hydra's multi-line error;
# ``check_arguments`` says it in fedrun's one line instead.
@dataclass
class FedrunOptunaSweeperConf:
    _target_: str = TARGET
    _recursive_: bool = False  # the sampler and pruner are built here (the sampler anew for each trial)
    objective: Any = "final_test_accuracy"  # a run's summary metric; its mean over the seeds is the trial's value
    direction: Any = None  # maximize | minimize | null: from the objective (accuracy up, R-index down)
    seeds: Any = field(default_factory=lambda: [0, 1, 2])  # every trial runs each
    n_trials: Any = 20  # trials in the study, a resumed study's earlier ones included
    n_jobs: Any = 1  # trials launched together (n_jobs x len(seeds) jobs to the launcher)
    sampler: Any = field(default_factory=lambda: {"_target_": "optuna.samplers.TPESampler", "seed": 0})
    # median (MEDIAN) | none | an optuna.pruners class, '{_target_: optuna.pruners.MedianPruner, n_warmup_steps: 20}'
    pruner: Any = "median"
    storage: Any = None  # an Optuna RDB URL; null: a journal file in the sweep dir
    study_name: Any = None  # null: the sweep dir's path
    params: Any = None  # the search space: key -> interval(...), choice(...), range(...)


ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=FedrunOptunaSweeperConf, provider="fedrun")


# ``pruner: median``: a trial is stopped when its mean over seeds at a round is worse than the median of the finished
# trials' means at that round, once 5 trials have finished (Optuna's default), from round 5 on (Optuna's steps are
# fedrun's rounds, which count from 1: ``n_warmup_steps: 5`` leaves rounds 1 to 4 unjudged).
MEDIAN = {"n_startup_trials": 5, "n_warmup_steps": 5}


def make_pruner(config):
    """The study's pruner from ``hydra.sweeper.pruner``: ``median`` (``MEDIAN``), ``none``, or a node with a
    ``_target_`` in ``optuna.pruners`` (or any BasePruner) but successive halving's: ``SuccessiveHalvingPruner``
    and ``HyperbandPruner`` keep each trial's rungs in the study's storage as the trial runs, values that cannot be
    paired by seed (``fedrun.study.paired_view``)."""
    import optuna

    from fedrun.errors import ConfigError, check

    if config in (None, "none"):
        return optuna.pruners.NopPruner()
    if config == "median":
        return optuna.pruners.MedianPruner(**MEDIAN)
    allowed = "median, none or an optuna.pruners class as {_target_: ...}"
    check(isinstance(config, (dict, DictConfig)) and "_target_" in config, "hydra.sweeper.pruner", config, allowed)
    pruner = built("hydra.sweeper.pruner", config, allowed)
    check(isinstance(pruner, optuna.pruners.BasePruner), "hydra.sweeper.pruner", config, allowed)
    if isinstance(pruner, (optuna.pruners.SuccessiveHalvingPruner, optuna.pruners.HyperbandPruner)):
        raise ConfigError(
            "hydra.sweeper.pruner",
            config.get("_target_"),
            "a pruner that compares intermediate values (median, percentile, threshold, patient, wilcoxon): "
            "successive halving keeps rungs per trial, which cannot be compared seed by seed",
        )
    return pruner


def built(key: str, config, allowed: str):
    """``instantiate(config)``, any error of it a ConfigError for ``key`` (an unknown class, a bad argument)."""
    from hydra.utils import instantiate

    from fedrun.errors import ConfigError

    try:
        return instantiate(config)
    except Exception as exc:  # Hydra wraps the class's own error (TypeError, ValueError ...) in InstantiationException
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            key, OmegaConf.to_container(config) if isinstance(config, DictConfig) else config, f"{allowed} ({first})"
        ) from None


def make_sampler(config, number: int):
    """The sampler that asks trial ``number``, from ``hydra.sweeper.sampler`` (a node with an ``optuna.samplers``
    ``_target_``): built anew with seed = the configured seed + number, so that a resumed study asks the same
    trials as one never interrupted (a sampler's random state is not stored)."""
    import optuna

    from fedrun.errors import check

    allowed = "an optuna.samplers class as {_target_: optuna.samplers.TPESampler, seed: 0, ...}"
    check(isinstance(config, (dict, DictConfig)) and "_target_" in config, "hydra.sweeper.sampler", config, allowed)
    config = OmegaConf.create(OmegaConf.to_container(OmegaConf.create(config)))
    if config.get("seed") is not None:
        check(type(config.seed) is int, "hydra.sweeper.sampler.seed", config.seed, "an integer or null")
        config.seed = int(config.seed) + number
    sampler = built("hydra.sweeper.sampler", config, allowed)
    check(isinstance(sampler, optuna.samplers.BaseSampler), "hydra.sweeper.sampler", config, allowed)
    return sampler


def check_arguments(s: dict) -> None:
    """The sweeper's own arguments (``hydra.sweeper.*``), each refused in one line, before the study is opened
    and any job runs; the objective and direction are checked by ``fedrun.study.objective_direction``."""
    from fedrun.errors import check

    def integer(value) -> bool:
        return type(value) is int

    seeds = s["seeds"]
    check(
        isinstance(seeds, (list, ListConfig))
        and len(seeds) >= 1
        and all(integer(x) for x in seeds)
        and len(set(seeds)) == len(seeds),
        "hydra.sweeper.seeds",
        seeds,
        "a list of distinct integer seeds, one or more",
    )
    for key in ("n_trials", "n_jobs"):
        check(integer(s[key]) and s[key] >= 1, f"hydra.sweeper.{key}", s[key], "an integer >= 1")
    check(isinstance(s["objective"], str), "hydra.sweeper.objective", s["objective"], "a run's summary metric")
    for key in ("storage", "study_name"):
        check(s[key] is None or isinstance(s[key], str), f"hydra.sweeper.{key}", s[key], "a string or null")
    check(
        s["params"] is None or isinstance(s["params"], (dict, DictConfig)),
        "hydra.sweeper.params",
        s["params"],
        "a mapping of keys to search spaces: {aggregator.temperature: 'interval(0.05, 20)'}",
    )


def sweeper_config(hydra_cfg) -> DictConfig | None:
    """The sweeper's config when this job belongs to a fedrun Optuna study, else None."""
    sweeper = OmegaConf.select(hydra_cfg, "sweeper")
    return sweeper if sweeper is not None and sweeper.get("_target_") == TARGET else None


def distribution(override):
    """The Optuna distribution of a sweep override, or the value of a fixed one."""
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep, Transformer
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    value = override.value()
    if not override.is_sweep_override():
        return override.get_value_element_as_str()
    if isinstance(value, IntervalSweep):
        return FloatDistribution(float(value.start), float(value.end), log="log" in value.tags)
    expanded = list(override.sweep_iterator(transformer=Transformer.encode))
    if isinstance(value, RangeSweep) and not value.shuffle and all(isinstance(v, int) for v in expanded):
        if len(expanded) == 1:
            return CategoricalDistribution(expanded)
        return IntDistribution(expanded[0], expanded[-1], step=expanded[1] - expanded[0])
    if isinstance(value, (ChoiceSweep, RangeSweep)):
        return CategoricalDistribution(expanded)
    raise ValueError(f"{override.input_line}: not a search space the Optuna sweeper knows")


class FedrunOptunaSweeper(Sweeper):
    """Hydra sweeper: an Optuna study whose trials each run several seeds (see the module docstring)."""

    def __init__(self, **settings: Any) -> None:
        self.settings = settings
        self.config: DictConfig | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )

    def sweep(self, arguments: list[str]) -> None:
        from fedrun.errors import ConfigError

        try:
            self._sweep(arguments)
        except ConfigError as exc:  # before any job: one line, as fedrun says it
            print(f"fedrun: error: {exc}", file=sys.stderr)
            sys.exit(2)

    def _sweep(self, arguments: list[str]) -> None:
        import optuna

        from fedrun import study as studies
        from fedrun.errors import check
        from fedrun.sweepdir import sweep_parent
        from fedrun.tracking import resolve_uri

        s, config = self.settings, self.config
        check_arguments(s)
        seeds = list(s["seeds"])
        direction = studies.objective_direction(s["objective"], s["direction"], config.metrics.r_targets)
        space, fixed = search_space([f"{k}={v}" for k, v in (s["params"] or {}).items()] + list(arguments))
        check(bool(space), "hydra.sweeper.params", s["params"], "at least one parameter to search")
        make_sampler(s["sampler"], 0)  # a bad sampler is refused now, not when the first trial is asked
        pruner = studies.pruner_for(s["objective"], make_pruner(s["pruner"]), default=s["pruner"] == "median")
        settings = studies.settings_of(space, fixed, seeds, s["objective"], direction)
        sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        if not s["storage"]:
            studies.check_journal(sweep_dir / studies.STUDY_FILE)
        storage = studies.open_storage(s["storage"], sweep_dir)
        name = s["study_name"] or str(sweep_dir)
        try:
            study = optuna.create_study(storage=storage, study_name=name, direction=direction, pruner=pruner)
            study.set_user_attr(studies.SETTINGS_ATTR, settings)
            if config.resume:
                print(f"fedrun: {sweep_dir} held no study: a new one starts", file=sys.stderr)
        except optuna.exceptions.DuplicatedStudyError:
            check(
                bool(config.resume),
                "hydra.sweep.dir",
                str(sweep_dir),
                f"a dir without a study (it holds {name!r}: continue it with resume={sweep_dir})",
            )
            study = optuna.load_study(study_name=name, storage=storage, pruner=pruner)
            studies.check_resumed(study.user_attrs.get(studies.SETTINGS_ATTR, {}), settings)
        states = optuna.trial.TrialState
        interrupted = study.get_trials(deepcopy=False, states=(states.RUNNING, states.WAITING))
        where = s["storage"] or str(sweep_dir / studies.STUDY_FILE)
        studies.check_completed(study.get_trials(deepcopy=False), s["objective"], where)
        # every interrupted trial's parameters are checked before the first is relaunched: none runs if one is bad
        relaunched = {t.number: studies.relaunched_params(t, space, where) for t in interrupted}
        tracking = config.tracking.enabled
        record = studies.TrialRecord(
            sweep_dir,
            resolve_uri(config.tracking.uri, Path.cwd()) if tracking else None,
            config.tracking.experiment,
            sweep_parent(sweep_dir) if tracking else None,
            seeds,
            s["objective"],
        )
        self.seeds, self.fixed, self.record = seeds, fixed, record
        n_trials = int(s["n_trials"])
        out = None  # the results as of the last launch (written after each, so the best trial shows as it goes)
        if interrupted:
            print(f"fedrun: finishing the study's {len(interrupted)} interrupted trials", file=sys.stderr)
            for run in contiguous([optuna.trial.Trial(study, t._trial_id) for t in interrupted]):
                self._launch(study, run, [relaunched[t.number] for t in run])
                out = record.results(study, settings, n_trials)
        while (done := len(study.get_trials(deepcopy=False))) < n_trials:
            batch = []
            for number in range(done, min(done + int(s["n_jobs"]), n_trials)):
                study.sampler = make_sampler(s["sampler"], number)
                batch.append(study.ask(space))
            self._launch(study, batch, [t.params for t in batch])
            out = record.results(study, settings, n_trials)
        if out is None:  # resumed when already complete: nothing launched
            out = record.results(study, settings, n_trials)
        best = out.get("best_trial")
        if not best and out["trials"].get("fail"):  # every trial failed (pruned ones aside): the study found nothing
            print(
                f"fedrun: error: study {name}: no trial completed ({out['trials']}; their jobs' errors are above); "
                f"{sweep_dir / studies.RESULTS_FILE}",
                file=sys.stderr,
            )
            sys.exit(1)
        print(
            f"fedrun: study {name}: {out['trials']}; "
            + (
                f"best trial {best['number']} {best['params']}: {s['objective']} {best['mean']:.4g} "
                f"(95% CI {best['ci95'][0]:.4g} to {best['ci95'][1]:.4g}, {len(seeds)} seeds)"
                if best
                else "no trial completed"
            )
            + f"; {sweep_dir / studies.RESULTS_FILE}",
            file=sys.stderr,
        )

    def _launch(self, study, trials: list, params: list[dict]) -> None:
        """Run every seed of ``trials`` (consecutive numbers: trial n's seed i is job n * S + i) with their
        ``params`` through the launcher, then close each trial from its jobs."""
        from hydra.core.utils import JobStatus

        from fedrun.sweepdir import first_job

        for trial in trials:
            self.record.open(study, trial)
        overrides = [
            tuple(f"{k}={v}" for k, v in {**self.fixed, **values}.items()) + (f"seed={seed}",)
            for values in params
            for seed in self.seeds
        ]
        returns = self.launcher.launch(overrides, initial_job_idx=first_job(trials[0].number, len(self.seeds)))
        for k, trial in enumerate(trials):
            jobs = returns[k * len(self.seeds) : (k + 1) * len(self.seeds)]
            self.record.close(study, trial, [job.status == JobStatus.COMPLETED for job in jobs])


def search_space(lines: list[str]) -> tuple[dict, dict]:
    """(the search space: key -> Optuna distribution, the fixed overrides: key -> value) of override lines, the
    later line winning (the command line comes after ``params``); a search space that is not one (``interval(1,
    0.1)``, low above high) is a ConfigError naming its key. A searched ``seed`` is refused: every trial runs each
    of ``hydra.sweeper.seeds``, and a searched seed would be optimised."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from fedrun.errors import ConfigError, check

    space, fixed, given = {}, {}, {}
    for override in OverridesParser.create().parse_overrides(lines):
        key = override.get_key_element()
        given[key] = override.input_line.split("=", 1)[1]
        try:
            found = distribution(override)
        except ValueError as exc:  # Optuna's (low > high, a step that does not fit) or ours
            raise ConfigError(key, given[key], f"a search space Optuna accepts ({exc})") from None
        into, other = (fixed, space) if isinstance(found, str) else (space, fixed)
        into[key] = found
        other.pop(key, None)
    check(
        "seed" not in space and "seed" not in fixed,
        "seed",
        given.get("seed"),
        "left to hydra.sweeper.seeds (every trial runs each of them; a searched seed would be optimised)",
    )
    return space, fixed


def contiguous(trials: list) -> list[list]:
    """Trials split into runs of consecutive numbers (each run is one launch, its jobs numbered in order)."""
    runs: list[list] = []
    for trial in sorted(trials, key=lambda t: t.number):
        if runs and runs[-1][-1].number + 1 == trial.number:
            runs[-1].append(trial)
        else:
            runs.append([trial])
    return runs
