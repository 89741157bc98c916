"""The Optuna sweeper (``hydra/sweeper=optuna``): its search space, objective, pruning and trial records by hand
(studies through the real ``fedrun -m`` command: tests/e2e/test_study.py)."""

import math
import re
from pathlib import Path

import optuna
import pandas as pd
import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from fedrun.errors import ConfigError
from fedrun.study import (
    PRUNED_ATTR,
    SeedReport,
    TrialRecord,
    check_resumed,
    mean_curve,
    objective_direction,
    objective_value,
    open_storage,
    seed_values,
    settings_of,
)
from hydra_plugins.fedrun_optuna_sweeper.optuna_sweeper import contiguous, distribution

optuna.logging.set_verbosity(optuna.logging.WARNING)


def parsed(line: str):
    [override] = OverridesParser.create().parse_overrides([line])
    return distribution(override)


def test_the_search_space_syntax_of_hydras_optuna_sweeper():
    assert parsed("a=interval(0.05, 20)") == FloatDistribution(0.05, 20.0)
    assert parsed("a=tag(log, interval(0.05, 20))") == FloatDistribution(0.05, 20.0, log=True)
    assert parsed("a=choice(fedavg, fedsoftmax)") == CategoricalDistribution(["fedavg", "fedsoftmax"])
    assert parsed("a=0.1,1,10") == CategoricalDistribution([0.1, 1, 10])
    # range(1, 10, 3) is 1, 4, 7 as Python and Hydra's basic sweeper count it: 10 is not in it
    assert parsed("a=range(1, 10, 3)") == IntDistribution(1, 7, step=3)
    assert parsed("a=range(2, 5)") == IntDistribution(2, 4)
    assert parsed("a=range(0.5, 2, 0.5)") == CategoricalDistribution([0.5, 1.0, 1.5])  # as Hydra expands it
    assert parsed("a=3") == "3"  # not a sweep: fixed in every job


def test_the_objective_s_direction_follows_it_unless_given_and_unknown_names_are_refused():
    assert objective_direction("final_test_accuracy", None, [0.9]) == "maximize"
    assert objective_direction("tail_test_accuracy", None, [0.9]) == "maximize"  # the run judged on its tail
    assert objective_direction("R90", None, [0.6, 0.9]) == "minimize"
    assert objective_direction("client_R60", None, [0.6]) == "minimize"
    assert objective_direction("upload_mb_total", "maximize", [0.9]) == "maximize"
    with pytest.raises(ConfigError, match=r"hydra.sweeper.objective='R95' is invalid: allowed is a run's summary"):
        objective_direction("R95", None, [0.6, 0.9])  # 0.95 is not among metrics.r_targets: never computed
    with pytest.raises(ConfigError, match="lag1_autocorr has no better side"):
        objective_direction("lag1_autocorr", None, [0.9])
    with pytest.raises(ConfigError, match="hydra.sweeper.direction='up'"):
        objective_direction("R90", "up", [0.9])


def test_an_r_index_never_reached_counts_as_the_rounds_run_plus_one():
    summary = pd.Series({"rounds_run": "30", "R90": "not_reached", "R60": "7.0", "final_test_accuracy": "0.85"})
    assert objective_value(summary, "R90") == 31.0
    assert objective_value(summary, "R60") == 7.0
    assert objective_value(summary, "final_test_accuracy") == 0.85
    with pytest.raises(ValueError, match="best_test_accuracy is not in the run's summary"):
        objective_value(summary, "best_test_accuracy")


def test_the_mean_curve_averages_the_seeds_that_reached_each_round():
    attrs = {
        "fedrun:value:0:1": 0.5,
        "fedrun:value:0:2": 0.7,
        "fedrun:value:1:1": 0.6,  # seed 1 has not reached round 2
        "fedrun:mlflow_run_id": "x",
    }
    assert mean_curve(attrs) == {1: pytest.approx(0.55), 2: pytest.approx(0.7)}
    assert mean_curve(attrs, up_to=1) == {1: pytest.approx(0.55)}


def finished_study(tmp_path, direction: str, trials: list[dict], pruner=None):
    """A study whose finished trials have these per-seed values ({seed: {round: value}}, as their seed jobs wrote
    them) and their means as intermediate values, and a running trial to judge."""
    storage = open_storage(None, tmp_path)
    pruner = pruner or optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)
    study = optuna.create_study(storage=storage, study_name="s", direction=direction, pruner=pruner)
    space = {"x": FloatDistribution(0, 1)}
    for k, seeds in enumerate(trials):
        attrs = {f"fedrun:value:{seed}:{r}": v for seed, curve in seeds.items() for r, v in curve.items()}
        study.add_trial(
            optuna.trial.create_trial(
                params={"x": 0.1 * k},
                distributions=space,
                value=0.5,
                intermediate_values=mean_curve(attrs),
                system_attrs=attrs,
            )
        )
    return storage, pruner, study.ask(space)


def accuracy(value: float) -> dict:
    """A round's row as the engine hands it to ``on_round`` (the columns a study may read)."""
    return {"test_accuracy": value, "upload_mb": 1.0, "round_wall_s": 0.5}


def test_a_trial_is_pruned_when_its_mean_over_seeds_lags_the_median_and_its_other_seeds_stop(tmp_path):
    # finished trials at round 3: 0.8 and 0.6 on both seeds, median 0.7
    both = [{0: {3: 0.8}, 1: {3: 0.8}}, {0: {3: 0.6}, 1: {3: 0.6}}]
    storage, pruner, trial = finished_study(tmp_path, "maximize", both)
    first, second = (SeedReport(storage, "s", trial.number, seed, pruner, last_round=10) for seed in (1, 0))
    assert first.report(3, accuracy(0.75)) is None  # mean 0.75 > 0.7
    why = second.report(3, accuracy(0.6))  # mean (0.75 + 0.6) / 2 = 0.675 < 0.7
    assert why.startswith("pruned by MedianPruner at round 3") and "0.675" in why
    assert storage.get_trial_system_attrs(trial._trial_id)[PRUNED_ATTR] == {
        "seed": 0,
        "round": 3,
        "mean": pytest.approx(0.675),
        "seeds": [0, 1],
        "pruner": "MedianPruner",
    }
    assert first.report(4, accuracy(0.9)) == why and first.pruned() == why  # the other seed stops at its next round
    fresh = SeedReport(storage, "s", trial.number, 2, pruner, last_round=10)
    assert fresh.pruned() == why  # a seed not started yet is skipped


# The review's case: seed 1 is 4 points harder than seed 0 in every trial. Five finished trials, means over both
# seeds 0.87, 0.89, 0.91, 0.93, 0.95 at round 5 (median 0.91; seed 1 alone: median 0.89); the default pruner.
HARDER_SEED = [{0: {5: m + 0.02}, 1: {5: m - 0.02}} for m in (0.87, 0.89, 0.91, 0.93, 0.95)]


@pytest.mark.parametrize("order", [(1, 0), (0, 1)])
def test_a_trial_better_than_the_median_over_its_seeds_is_not_pruned_whichever_seed_runs_first(tmp_path, order):
    """0.92 over its seeds (0.94 and 0.90) against the median 0.91: judged on seed 1 alone, the old comparison
    (0.90 against the finished trials' 0.91 over both seeds) pruned it at round 5 when seed 1 ran first. Paired by
    seed, seed 1's 0.90 is judged against the other trials' seed 1 (median 0.89), then the mean against 0.91."""
    from hydra_plugins.fedrun_optuna_sweeper.optuna_sweeper import make_pruner

    storage, pruner, trial = finished_study(tmp_path, "maximize", HARDER_SEED, make_pruner("median"))
    mine = {0: 0.94, 1: 0.90}
    for seed in order:  # the sequential launcher: one seed's whole run, then the next
        assert (
            SeedReport(storage, "s", trial.number, seed, pruner, last_round=10).report(5, accuracy(mine[seed])) is None
        )
    assert PRUNED_ATTR not in storage.get_trial_system_attrs(trial._trial_id)


@pytest.mark.parametrize("order", [(1, 0), (0, 1)])
def test_a_trial_worse_than_the_median_on_its_first_seed_is_still_pruned_whichever_seed_runs_first(tmp_path, order):
    """0.86 over its seeds (0.88 and 0.84): its first seed is below the others' median on that seed (0.93 on seed
    0, 0.89 on seed 1), so it is pruned at round 5 and its second seed never runs."""
    from hydra_plugins.fedrun_optuna_sweeper.optuna_sweeper import make_pruner

    storage, pruner, trial = finished_study(tmp_path, "maximize", HARDER_SEED, make_pruner("median"))
    mine = {0: 0.88, 1: 0.84}
    first = SeedReport(storage, "s", trial.number, order[0], pruner, last_round=10)
    assert first.report(4, accuracy(mine[order[0]] - 0.01)) is None  # round 4: still warming up (n_warmup_steps=5)
    why = first.report(5, accuracy(mine[order[0]]))
    assert why.startswith("pruned by MedianPruner at round 5") and f"seeds [{order[0]}]" in why
    assert SeedReport(storage, "s", trial.number, order[1], pruner, last_round=10).pruned() == why


def test_a_study_minimising_upload_is_pruned_on_its_upload_per_round_not_on_test_error(tmp_path):
    """The review's case: a study of upload_mb_total pruned its low-upload trial on test error. The curve is the
    mean upload per round so far (the total to round t over t, in the same order as the totals at t)."""
    finished = [{0: {1: 2.0, 2: 2.0}}, {0: {1: 4.0, 2: 4.0}}]  # 2 and 4 MB a round: median 3 at round 2
    storage, pruner, trial = finished_study(tmp_path, "minimize", finished)
    low = SeedReport(storage, "s", trial.number, 0, pruner, last_round=10, objective="upload_mb_total")
    assert low.report(1, {"test_accuracy": 0.1, "upload_mb": 1.0}) is None  # the worst accuracy, the least upload
    assert low.report(2, {"test_accuracy": 0.1, "upload_mb": 2.0}) is None  # (1 + 2) / 2 = 1.5 MB a round < 3
    assert mean_curve(storage.get_trial_system_attrs(trial._trial_id)) == {1: 1.0, 2: 1.5}
    storage, pruner, trial = finished_study(tmp_path / "high", "minimize", finished)
    high = SeedReport(storage, "s", trial.number, 0, pruner, last_round=10, objective="upload_mb_total")
    assert high.report(1, {"test_accuracy": 0.99, "upload_mb": 5.0}) is not None  # the best accuracy, 5 > 3 MB


def test_a_seed_resumed_from_its_checkpoint_carries_its_running_total_and_best_from_the_study(tmp_path):
    storage, pruner, trial = finished_study(tmp_path, "minimize", [])
    before = SeedReport(storage, "s", trial.number, 0, pruner, last_round=10, objective="upload_mb_total")
    for r, mb in ((1, 1.0), (2, 3.0), (3, 8.0)):  # round 3 was reported, then the job was killed before its checkpoint
        before.report(r, {"upload_mb": mb})
    resumed = SeedReport(storage, "s", trial.number, 0, pruner, last_round=10, objective="upload_mb_total")
    resumed.report(3, {"upload_mb": 5.0})  # round 3 again, after round 2's checkpoint: (1 + 3 + 5) / 3
    assert mean_curve(storage.get_trial_system_attrs(trial._trial_id)) == {1: 1.0, 2: 2.0, 3: 3.0}
    storage, pruner, trial = finished_study(tmp_path / "best", "maximize", [])
    best = SeedReport(storage, "s", trial.number, 0, pruner, last_round=10, objective="best_test_accuracy")
    best.report(1, accuracy(0.5))
    best.report(2, accuracy(math.nan))  # not evaluated: the best so far is still round 1's
    SeedReport(storage, "s", trial.number, 0, pruner, last_round=10, objective="best_test_accuracy").report(
        3, accuracy(0.4)
    )
    assert mean_curve(storage.get_trial_system_attrs(trial._trial_id)) == {1: 0.5, 2: 0.5, 3: 0.5}


@pytest.mark.parametrize("objective", ["upload_mb_total", "best_test_accuracy"])
def test_a_trial_s_second_seed_starts_its_running_value_from_its_own_rounds_not_its_sibling_s(tmp_path, objective):
    """The review's case: a seed's first report read its own value at every round the trial had, its sibling's
    rounds too (a KeyError for seed 1 once seed 0 had reported: every trial of such a study failed)."""
    storage, pruner, trial = finished_study(tmp_path, "minimize", [])
    rows = {0: [0.2, 0.6], 1: [0.4, 0.3]}
    for seed in (0, 1):  # one after the other, as the default launcher runs them
        job = SeedReport(storage, "s", trial.number, seed, pruner, last_round=10, objective=objective)
        for r, x in enumerate(rows[seed], start=1):
            assert job.report(r, {"upload_mb": x, "test_accuracy": x}) is None
    values = seed_values(storage.get_trial_system_attrs(trial._trial_id))
    if objective == "upload_mb_total":  # the total so far over the rounds: seed 0 (0.2, 0.4), seed 1 (0.4, 0.35)
        expected = {1: {0: 0.2, 1: 0.4}, 2: {0: 0.4, 1: 0.35}}
    else:  # the best so far: seed 0 (0.2, 0.6), seed 1 (0.4, 0.4)
        expected = {1: {0: 0.2, 1: 0.4}, 2: {0: 0.6, 1: 0.4}}
    assert values.keys() == expected.keys()
    assert all(values[r] == pytest.approx(expected[r]) for r in expected)


def test_an_objective_without_a_per_round_curve_refuses_a_chosen_pruner_and_turns_the_default_off(tmp_path, capsys):
    from fedrun.study import pruner_for
    from hydra_plugins.fedrun_optuna_sweeper.optuna_sweeper import make_pruner

    threshold = make_pruner({"_target_": "optuna.pruners.ThresholdPruner", "lower": 0.5})
    with pytest.raises(
        ConfigError, match=r"hydra.sweeper.pruner='ThresholdPruner' is invalid: allowed is none: R90 has"
    ):
        pruner_for("R90", threshold, default=False)
    assert capsys.readouterr().err == ""
    off = pruner_for("smoothness", make_pruner("median"), default=True)
    assert isinstance(off, optuna.pruners.NopPruner)
    assert capsys.readouterr().err == (
        "fedrun: no pruning: smoothness has no per-round curve to judge a trial by before its runs end "
        "(hydra.sweeper.pruner=none says so)\n"
    )
    assert pruner_for("upload_mb_total", threshold, default=False) is threshold
    # a seed job of an R90 study writes nothing to judge (and its pruner, whatever it is, is never asked)
    storage, pruner, trial = finished_study(tmp_path, "minimize", [{0: {3: 0.8}}, {0: {3: 0.6}}])
    job = SeedReport(storage, "s", trial.number, 0, threshold, last_round=10, objective="R90")
    assert job.report(3, accuracy(0.0)) is None and storage.get_trial_system_attrs(trial._trial_id) == {}


def test_no_pruning_at_the_last_round_or_with_the_nop_pruner(tmp_path):
    storage, pruner, trial = finished_study(
        tmp_path, "maximize", [{0: {3: 0.8}, 1: {3: 0.8}}, {0: {3: 0.6}, 1: {3: 0.6}}]
    )
    assert SeedReport(storage, "s", trial.number, 0, pruner, last_round=3).report(3, accuracy(0.1)) is None
    nop = optuna.pruners.NopPruner()
    assert SeedReport(storage, "s", trial.number, 1, nop, last_round=10).report(3, accuracy(0.1)) is None


def write_summary(job_dir: Path, **values) -> None:
    job_dir.mkdir(parents=True, exist_ok=True)
    pd.Series(values, dtype=object).to_csv(job_dir / "summary.csv", header=["value"])


def test_a_trial_s_value_is_the_mean_of_its_seeds_with_its_standard_error_and_curve(tmp_path):
    storage = open_storage(None, tmp_path)
    study = optuna.create_study(storage=storage, study_name="s", direction="minimize")
    trial = study.ask({"x": FloatDistribution(0, 1)})
    record = TrialRecord(tmp_path, None, "e", None, [0, 1, 2], "R90")
    for k, r90 in enumerate(["12.0", "not_reached", "15.0"]):  # trial 0's seeds are jobs 0, 1, 2
        write_summary(tmp_path / str(k), rounds_run="20", R90=r90)
    storage.set_trial_system_attr(trial._trial_id, "fedrun:value:0:1", 0.5)
    storage.set_trial_system_attr(trial._trial_id, "fedrun:value:1:1", 0.3)
    record.close(study, trial, [True, True, True])
    done = study.trials[0]
    # the censored seed counts 20 + 1: mean (12 + 21 + 15) / 3 = 16, sd 4.583, se 4.583 / sqrt(3) = 2.646
    assert done.state == optuna.trial.TrialState.COMPLETE and done.value == pytest.approx(16.0)
    assert done.user_attrs["seed_values"] == {"0": 12.0, "1": 21.0, "2": 15.0}
    assert done.user_attrs["objective_se"] == pytest.approx(math.sqrt(21 / 3))
    assert done.user_attrs["objective_ci95"] == pytest.approx(4.303 * math.sqrt(21 / 3), rel=1e-3)  # t(0.975, 2)
    assert done.intermediate_values == {1: pytest.approx(0.4)}  # what later trials' pruning compares against
    out = record.results(study, settings_of({}, {}, [0, 1, 2], "R90", "minimize"), 1)
    assert out["best_trial"]["number"] == 0 and out["best_trial"]["mean"] == pytest.approx(16.0)
    assert yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())["trials"] == {"complete": 1}


def test_a_trial_with_a_failed_seed_fails_and_says_why(tmp_path):
    storage = open_storage(None, tmp_path)
    study = optuna.create_study(storage=storage, study_name="s", direction="maximize")
    trial = study.ask({"x": FloatDistribution(0, 1)})
    write_summary(tmp_path / "0", final_test_accuracy="0.9")
    TrialRecord(tmp_path, None, "e", None, [0, 1], "final_test_accuracy").close(study, trial, [True, False])
    assert study.trials[0].state == optuna.trial.TrialState.FAIL
    assert study.trials[0].user_attrs["failure"].startswith("seed 1")


def test_a_resumed_study_must_repeat_its_space_seeds_and_objective():
    space = {"aggregator.temperature": FloatDistribution(0.05, 20, log=True)}
    saved = settings_of(space, {"aggregator": "fedsoftmax"}, [0, 1], "R90", "minimize")
    check_resumed(saved, settings_of(space, {"aggregator": "fedsoftmax", "resume": "/x"}, [0, 1], "R90", "minimize"))
    with pytest.raises(ConfigError, match="the same hydra.sweeper.seeds"):
        check_resumed(saved, settings_of(space, {"aggregator": "fedsoftmax"}, [0, 1, 2], "R90", "minimize"))
    with pytest.raises(ConfigError, match="the same hydra.sweeper.params"):
        check_resumed(saved, settings_of({}, {"aggregator": "fedsoftmax"}, [0, 1], "R90", "minimize"))


def test_a_pruner_is_median_none_or_an_optuna_class():
    from hydra_plugins.fedrun_optuna_sweeper.optuna_sweeper import make_pruner

    median = make_pruner("median")
    assert isinstance(median, optuna.pruners.MedianPruner) and median._n_warmup_steps == 5
    assert isinstance(make_pruner("none"), optuna.pruners.NopPruner)
    threshold = make_pruner({"_target_": "optuna.pruners.ThresholdPruner", "lower": 0.5})
    assert isinstance(threshold, optuna.pruners.ThresholdPruner)
    with pytest.raises(ConfigError, match="hydra.sweeper.pruner='hyperband' is invalid"):
        make_pruner("hyperband")


def test_successive_halving_which_keeps_unpaired_rungs_per_trial_is_refused():
    from hydra_plugins.fedrun_optuna_sweeper.optuna_sweeper import make_pruner

    for name in ("HyperbandPruner", "SuccessiveHalvingPruner"):
        with pytest.raises(ConfigError, match=f"pruner='optuna.pruners.{name}' is invalid: allowed is a pruner that"):
            make_pruner({"_target_": f"optuna.pruners.{name}"})


def test_the_sweeper_s_own_bad_arguments_are_one_config_error_each(tmp_path):
    from hydra_plugins.fedrun_optuna_sweeper.optuna_sweeper import (
        FedrunOptunaSweeperConf,
        check_arguments,
        make_pruner,
        make_sampler,
        search_space,
    )

    defaults = {k: getattr(FedrunOptunaSweeperConf(), k) for k in ("seeds", "n_trials", "n_jobs", "objective")}
    defaults.update(storage=None, study_name=None, params=None)
    check_arguments(defaults)
    for key, value, message in (
        ("n_trials", "abc", "hydra.sweeper.n_trials='abc' is invalid: allowed is an integer >= 1"),
        ("n_trials", 0, "hydra.sweeper.n_trials=0 is invalid"),
        ("n_jobs", 1.5, "hydra.sweeper.n_jobs=1.5 is invalid"),
        ("seeds", "abc", "hydra.sweeper.seeds='abc' is invalid: allowed is a list of distinct integer seeds"),
        ("seeds", [0, 0], "hydra.sweeper.seeds=\\[0, 0\\] is invalid"),
        ("params", "abc", "hydra.sweeper.params='abc' is invalid: allowed is a mapping"),
    ):
        with pytest.raises(ConfigError, match=message):
            check_arguments({**defaults, key: value})
    with pytest.raises(ConfigError, match="hydra.sweeper.sampler='bogus' is invalid: allowed is an optuna.samplers"):
        make_sampler("bogus", 0)
    with pytest.raises(ConfigError, match="hydra.sweeper.sampler=.*optuna.samplers.Bogus.* is invalid"):
        make_sampler({"_target_": "optuna.samplers.Bogus"}, 0)
    with pytest.raises(ConfigError, match="hydra.sweeper.sampler=.* is invalid"):  # a class that is no sampler
        make_sampler({"_target_": "collections.OrderedDict"}, 0)
    assert make_sampler({"_target_": "optuna.samplers.RandomSampler", "seed": 3}, 2)._rng.rng.randint(100) == (
        optuna.samplers.RandomSampler(seed=5)._rng.rng.randint(100)
    )  # trial 2 of a study seeded 3 asks with seed 5
    with pytest.raises(ConfigError, match="hydra.sweeper.pruner=.* is invalid"):
        make_pruner({"_target_": "optuna.pruners.MedianPruner", "n_warmup_steps": -1})
    with pytest.raises(
        ConfigError, match=r"aggregator.temperature='interval\(1,0.1\)' is invalid: allowed is a search"
    ):
        search_space(["aggregator.temperature=interval(1,0.1)"])
    with pytest.raises(ConfigError, match="hydra.sweeper.storage='bogus://x' is invalid: allowed is null"):
        open_storage("bogus://x", tmp_path)


@pytest.mark.parametrize(
    "line, why",
    [
        ("garbage", "one JSON object per line \\(JSONDecodeError\\)"),
        ('{"op_code": 99}', "an operation of Optuna's journal"),
        ('{"worker_id": "w"}', "an operation of Optuna's journal"),
        ("[" * 100_000 + "]" * 100_000, "one JSON object per line \\(RecursionError\\)"),
        ('{"op_code": 4, "worker_id": "w", "study_id": 0}', "an operation Optuna can replay \\(KeyError"),
    ],
    ids=["garbage", "unknown-op-code", "no-op-code", "deep-nesting", "trial-without-its-start"],
)
def test_a_journal_optuna_cannot_replay_is_refused_naming_its_file_and_line(tmp_path, line, why):
    from fedrun.study import STUDY_FILE, check_journal

    storage = open_storage(None, tmp_path)
    optuna.create_study(storage=storage, study_name="s").ask({"x": FloatDistribution(0, 1)})
    journal = tmp_path / STUDY_FILE
    check_journal(journal)  # Optuna's own journal: fine
    good = len(journal.read_text().splitlines())
    with open(journal, "a") as f:
        f.write(line + "\n")
    with pytest.raises(ConfigError, match=f"{journal} line {good + 1}=.* is invalid: allowed is {why}"):
        check_journal(journal)
    with open(journal, "a") as f:
        f.write('{"op_code": 0')  # a last line still being written is skipped, as Optuna's reader does
    with pytest.raises(ConfigError, match=f"line {good + 1}="):
        check_journal(journal)


def test_an_interrupted_trial_is_relaunched_only_with_values_of_the_search_space():
    from fedrun.study import relaunched_params

    space = {"aggregator.temperature": FloatDistribution(0.05, 20, log=True), "k": CategoricalDistribution([1, 2])}

    def trial(**params):
        return optuna.trial.FrozenTrial(
            number=3,
            state=optuna.trial.TrialState.RUNNING,
            value=None,
            datetime_start=None,
            datetime_complete=None,
            params=params,
            distributions={},
            user_attrs={},
            system_attrs={},
            intermediate_values={},
            trial_id=3,
        )

    assert relaunched_params(trial(**{"aggregator.temperature": "0.5", "k": True}), space, "j") == {
        "aggregator.temperature": 0.5,
        "k": 1,  # the choice itself, not what the journal spelt
    }
    for params, message in (
        (
            {"aggregator.temperature": 1.0, "k": 1, "aggregator._target_": "payload.Aggregator"},
            "j: trial 3's parameter aggregator._target_='payload.Aggregator' is invalid: allowed is a parameter of "
            "the study's search space (aggregator.temperature, k)",
        ),
        (
            {"aggregator.temperature": 30.0, "k": 1},
            "j: trial 3's parameter aggregator.temperature=30.0 is invalid: allowed is a value of FloatDistribution",
        ),
        (
            {"aggregator.temperature": "${oc.env:HOME}", "k": 1},
            "j: trial 3's parameter aggregator.temperature='${oc.env:HOME}' is invalid",
        ),
        (
            {"aggregator.temperature": 1.0, "k": "os.system"},
            "j: trial 3's parameter k='os.system' is invalid: allowed is a value of CategoricalDistribution",
        ),
        ({"aggregator.temperature": 1.0}, "j: trial 3='without k' is invalid: allowed is a value for each parameter"),
    ):
        with pytest.raises(ConfigError) as refused:
            relaunched_params(trial(**params), space, "j")
        assert str(refused.value).startswith(message)


def test_interrupted_trials_are_relaunched_in_runs_of_consecutive_numbers():
    class T:
        def __init__(self, number):
            self.number = number

    runs = contiguous([T(5), T(2), T(3), T(7)])
    assert [[t.number for t in run] for run in runs] == [[2, 3], [5], [7]]


def test_an_accuracy_objectives_interval_stays_in_its_range():
    from fedrun.study import objective_interval

    assert objective_interval("tail_test_accuracy", 0.281, 0.962) == (0.0, 1.0)  # seeds 0.057, 0.057, 0.728
    assert objective_interval("final_test_accuracy", 0.9, 0.05) == pytest.approx((0.85, 0.95))
    assert objective_interval("R90", 12.0, 15.0) == (1.0, 27.0)  # a round: at least 1, no upper bound by its name


def test_a_completed_trial_outside_its_objective_s_range_is_refused_in_one_line():
    import optuna

    from fedrun.errors import ConfigError
    from fedrun.study import check_completed

    def trial(number, value, state=optuna.trial.TrialState.COMPLETE):
        made = optuna.trial.create_trial(params={}, distributions={}, value=value, state=state)
        made.number = number
        return made

    fine = [trial(0, 0.91), trial(1, None, optuna.trial.TrialState.RUNNING)]
    check_completed(fine, "final_test_accuracy", "journal")
    check_completed([trial(0, 14.0)], "R90", "journal")
    cases = ((1e308, "final_test_accuracy"), (1.5, "tail_test_accuracy"), (-3.0, "R90"), (0.5, "R90"))
    for value, objective in cases:  # an R-index is a round: at least 1
        valid = trial(0, 14.0 if objective == "R90" else 0.91)
        with pytest.raises(
            ConfigError, match=rf"^journal trial 2={re.escape(repr(value))} is invalid: allowed is a value"
        ):
            check_completed([valid, trial(2, value)], objective, "journal")


def test_the_journal_is_appended_to_as_optuna_does_but_never_through_a_link_made_while_the_study_runs(tmp_path):
    from fedrun.runfiles import LinkedFile

    storage = open_storage(None, tmp_path)
    study = optuna.create_study(storage=storage, study_name="s")
    study.enqueue_trial({"x": 1.0})
    assert len(optuna.load_study(study_name="s", storage=open_storage(None, tmp_path)).trials) == 1  # replayed
    journal, victim = tmp_path / "optuna_study.journal", tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    kept = journal.read_bytes()
    journal.unlink()
    journal.symlink_to(victim)
    with pytest.raises(LinkedFile, match="optuna_study.journal is a symbolic link"):
        study.enqueue_trial({"x": 2.0})
    assert victim.read_text() == "keep me\n" and kept
