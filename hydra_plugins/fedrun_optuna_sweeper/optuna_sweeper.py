"""fedrun's Optuna sweeper: ``fedrun -m hydra/sweeper=optuna``, on the current Optuna.

A trial runs every seed of ``hydra.sweeper.seeds`` (jobs of whichever launcher is configured) and its objective
is the mean of the seeds' summary metric ``hydra.sweeper.objective``; its jobs report their test accuracy each
round and the study's pruner stops lagging trials between rounds; ``resume=<sweep dir>`` continues the study up
to ``n_trials`` in all, finishing its interrupted trials from their checkpoints. The parts without Hydra are in
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
from omegaconf import DictConfig, OmegaConf

TARGET = "hydra_plugins.fedrun_optuna_sweeper.optuna_sweeper.FedrunOptunaSweeper"


@dataclass
class FedrunOptunaSweeperConf:
    _target_: str = TARGET
    _recursive_: bool = False  # the sampler and pruner are built here (the sampler anew for each trial)
    objective: str = "final_test_accuracy"  # a run's summary metric; its mean over the seeds is the trial's value
    direction: str | None = None  # maximize | minimize | null: from the objective (accuracy up, R-index down)
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # every trial runs each
    n_trials: int = 20  # trials in the study, a resumed study's earlier ones included
    n_jobs: int = 1  # trials launched together (n_jobs x len(seeds) jobs to the launcher)
    sampler: Any = field(default_factory=lambda: {"_target_": "optuna.samplers.TPESampler", "seed": 0})
    # median (MEDIAN) | none | an optuna.pruners class, '{_target_: optuna.pruners.MedianPruner, n_warmup_steps: 20}'
    pruner: Any = "median"
    storage: str | None = None  # an Optuna RDB URL; null: a journal file in the sweep dir
    study_name: str | None = None  # null: the sweep dir's path
    params: dict[str, str] | None = None  # the search space: key -> interval(...), choice(...), range(...)


ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=FedrunOptunaSweeperConf, provider="fedrun")


# ``pruner: median``: a trial is stopped when its mean over seeds at a round is worse than the median of the finished
# trials' means at that round, once 5 trials have finished (Optuna's default), from round 5 on (Optuna's steps are
# fedrun's rounds, which count from 1: ``n_warmup_steps: 5`` leaves rounds 1 to 4 unjudged).
MEDIAN = {"n_startup_trials": 5, "n_warmup_steps": 5}


def make_pruner(config):
    """The study's pruner from ``hydra.sweeper.pruner``: ``median`` (``MEDIAN``), ``none``, or a node with a
    ``_target_`` in ``optuna.pruners`` (or any BasePruner)."""
    import optuna
    from hydra.utils import instantiate

    if config in (None, "none"):
        return optuna.pruners.NopPruner()
    if config == "median":
        return optuna.pruners.MedianPruner(**MEDIAN)
    if isinstance(config, (dict, DictConfig)) and "_target_" in config:
        return instantiate(config)
    from fedrun.errors import ConfigError

    raise ConfigError("hydra.sweeper.pruner", config, "median, none or an optuna.pruners class as {_target_: ...}")


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
        from hydra.core.override_parser.overrides_parser import OverridesParser

        from fedrun import study as studies
        from fedrun.cli.sweeps import sweep_parent
        from fedrun.errors import ConfigError, check
        from fedrun.tracking import resolve_uri

        s, config = self.settings, self.config
        seeds = list(s["seeds"])
        check(
            len(seeds) >= 1 and len(set(seeds)) == len(seeds),
            "hydra.sweeper.seeds",
            seeds,
            "a list of distinct seeds, one or more",
        )
        check(int(s["n_trials"]) >= 1, "hydra.sweeper.n_trials", s["n_trials"], "an integer >= 1")
        check(int(s["n_jobs"]) >= 1, "hydra.sweeper.n_jobs", s["n_jobs"], "an integer >= 1")
        direction = studies.objective_direction(s["objective"], s["direction"], config.metrics.r_targets)
        lines = [f"{k}={v}" for k, v in (s["params"] or {}).items()] + list(arguments)
        space, fixed, given = {}, {}, {}
        for override in OverridesParser.create().parse_overrides(lines):
            key = override.get_key_element()
            given[key] = override.input_line.split("=", 1)[1]
            try:
                found = distribution(override)
            except ValueError as exc:
                raise ConfigError(key, override.get_value_element_as_str(), str(exc)) from None
            into, other = (fixed, space) if isinstance(found, str) else (space, fixed)
            into[key] = found
            other.pop(key, None)  # the command line comes after params: it wins
        check(
            "seed" not in space and "seed" not in fixed,
            "seed",
            given.get("seed"),
            "left to hydra.sweeper.seeds (every trial runs each of them; a searched seed would be optimised)",
        )
        check(bool(space), "hydra.sweeper.params", s["params"], "at least one parameter to search")
        settings = studies.settings_of(space, fixed, seeds, s["objective"], direction)
        sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        storage = studies.open_storage(s["storage"], sweep_dir)
        name = s["study_name"] or str(sweep_dir)
        pruner = make_pruner(s["pruner"])
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
        states = optuna.trial.TrialState
        interrupted = study.get_trials(deepcopy=False, states=(states.RUNNING, states.WAITING))
        out = None  # the results as of the last launch (written after each, so the best trial shows as it goes)
        if interrupted:
            print(f"fedrun: finishing the study's {len(interrupted)} interrupted trials", file=sys.stderr)
            for run in contiguous([optuna.trial.Trial(study, t._trial_id) for t in interrupted]):
                self._launch(study, run)
                out = record.results(study, settings, n_trials)
        while (done := len(study.get_trials(deepcopy=False))) < n_trials:
            batch = []
            for number in range(done, min(done + int(s["n_jobs"]), n_trials)):
                study.sampler = self._sampler(number)
                batch.append(study.ask(space))
            self._launch(study, batch)
            out = record.results(study, settings, n_trials)
        if out is None:  # resumed when already complete: nothing launched
            out = record.results(study, settings, n_trials)
        best = out.get("best_trial")
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

    def _sampler(self, number: int):
        """The sampler that asks trial ``number``: built anew with seed = the configured seed + number, so that a
        resumed study asks the same trials as one never interrupted (a sampler's random state is not stored)."""
        from hydra.utils import instantiate

        config = OmegaConf.create(OmegaConf.to_container(OmegaConf.create(self.settings["sampler"])))
        if config.get("seed") is not None:
            config.seed = int(config.seed) + number
        return instantiate(config)

    def _launch(self, study, trials: list) -> None:
        """Run every seed of ``trials`` (consecutive numbers: trial n's seed i is job n * S + i) through the
        launcher, then close each trial from its jobs."""
        from hydra.core.utils import JobStatus

        for trial in trials:
            self.record.open(study, trial)
        overrides = [
            tuple(f"{k}={v}" for k, v in {**self.fixed, **trial.params}.items()) + (f"seed={seed}",)
            for trial in trials
            for seed in self.seeds
        ]
        returns = self.launcher.launch(overrides, initial_job_idx=trials[0].number * len(self.seeds))
        for k, trial in enumerate(trials):
            jobs = returns[k * len(self.seeds) : (k + 1) * len(self.seeds)]
            self.record.close(study, trial, [job.status == JobStatus.COMPLETED for job in jobs])


def contiguous(trials: list) -> list[list]:
    """Trials split into runs of consecutive numbers (each run is one launch, its jobs numbered in order)."""
    runs: list[list] = []
    for trial in sorted(trials, key=lambda t: t.number):
        if runs and runs[-1][-1].number + 1 == trial.number:
            runs[-1].append(trial)
        else:
            runs.append([trial])
    return runs
