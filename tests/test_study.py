"""The Optuna sweeper (``hydra/sweeper=optuna``): its search space, objective, pruning and trial records by hand,
then studies through the real ``fedrun -m`` command."""

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pandas as pd
import pytest
import yaml
from conftest import mlflow_runs, sweep_runs
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
    settings_of,
)
from hydra_plugins.fedrun_optuna_sweeper.optuna_sweeper import contiguous, distribution

FEDRUN = str(Path(sys.executable).parent / "fedrun")
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


def study_with_two_finished_trials(tmp_path, direction: str, curves: list[dict]):
    """A study whose finished trials have these intermediate values, and a running third trial."""
    storage = open_storage(None, tmp_path)
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)
    study = optuna.create_study(storage=storage, study_name="s", direction=direction, pruner=pruner)
    space = {"x": FloatDistribution(0, 1)}
    for k, curve in enumerate(curves):
        study.add_trial(
            optuna.trial.create_trial(
                params={"x": 0.1 * k}, distributions=space, value=curve[max(curve)], intermediate_values=curve
            )
        )
    return storage, pruner, study.ask(space)


def test_a_trial_is_pruned_when_its_mean_over_seeds_lags_the_median_and_its_other_seeds_stop(tmp_path):
    # finished trials at round 3: 0.8 and 0.6, median 0.7
    storage, pruner, trial = study_with_two_finished_trials(tmp_path, "maximize", [{3: 0.8}, {3: 0.6}])
    first, second = (SeedReport(storage, "s", trial.number, seed, pruner, last_round=10) for seed in (1, 0))
    assert first.report(3, 0.75) is None  # mean 0.75 > 0.7
    why = second.report(3, 0.6)  # mean (0.75 + 0.6) / 2 = 0.675 < 0.7
    assert why.startswith("pruned by MedianPruner at round 3") and "0.675" in why
    assert storage.get_trial_system_attrs(trial._trial_id)[PRUNED_ATTR] == {
        "seed": 0,
        "round": 3,
        "mean": pytest.approx(0.675),
        "pruner": "MedianPruner",
    }
    assert first.report(4, 0.9) == why and first.pruned() == why  # the other seed stops at its next round
    fresh = SeedReport(storage, "s", trial.number, 2, pruner, last_round=10)
    assert fresh.pruned() == why  # a seed not started yet is skipped


def test_a_minimising_study_is_told_the_test_error_so_the_worse_accuracy_is_pruned(tmp_path):
    # an R-index study: its finished trials' curves are test errors 0.2 and 0.4 at round 3 (median 0.3)
    storage, pruner, trial = study_with_two_finished_trials(tmp_path, "minimize", [{3: 0.2}, {3: 0.4}])
    good = SeedReport(storage, "s", trial.number, 0, pruner, last_round=10)
    assert good.report(3, 0.75) is None  # error 0.25 < 0.3: better than the median
    assert storage.get_trial_system_attrs(trial._trial_id)["fedrun:value:0:3"] == pytest.approx(0.25)
    worse = SeedReport(storage, "s", trial.number, 1, pruner, last_round=10)
    assert worse.report(3, 0.45) is not None  # mean error (0.25 + 0.55) / 2 = 0.4 > 0.3


def test_no_pruning_at_the_last_round_or_with_the_nop_pruner(tmp_path):
    storage, pruner, trial = study_with_two_finished_trials(tmp_path, "maximize", [{3: 0.8}, {3: 0.6}])
    assert SeedReport(storage, "s", trial.number, 0, pruner, last_round=3).report(3, 0.1) is None
    nop = optuna.pruners.NopPruner()
    assert SeedReport(storage, "s", trial.number, 1, nop, last_round=10).report(3, 0.1) is None


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


def test_interrupted_trials_are_relaunched_in_runs_of_consecutive_numbers():
    class T:
        def __init__(self, number):
            self.number = number

    runs = contiguous([T(5), T(2), T(3), T(7)])
    assert [[t.number for t in run] for run in runs] == [[2, 3], [5], [7]]


STUDY = [
    "hydra/sweeper=optuna",
    "aggregator=fedsoftmax",
    "aggregator.temperature=tag(log,interval(0.05,20))",
    "hydra.sweeper.seeds=[0,1]",
    "schedule.rounds=3",
    "partition.num_clients=5",
]


@pytest.mark.e2e
def test_a_study_through_fedrun_records_trials_over_seeds_in_mlflow(fedrun, store):
    fedrun("-m", *STUDY, "hydra.sweeper.n_trials=2", experiment="study")
    sweep_dir = next((fedrun.cwd / "outputs" / "multiruns").glob("*/*"))
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{store}")
    experiment = client.get_experiment_by_name("study")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("fedrun.role") == "sweep"]
    trials = sorted((r for r in runs if r.data.tags.get("fedrun.role") == "trial"), key=lambda r: r.info.start_time)
    seeds = [r for r in runs if "fedrun.trial" in r.data.tags and "fedrun.role" not in r.data.tags]
    assert len(parents) == 1 and len(trials) == 2 and len(seeds) == 4  # a study, its trials, their seeds
    [parent] = parents
    assert parent.info.status == "FINISHED" and parent.data.metrics["jobs_finished"] == 2  # its trials
    assert parent.info.run_name.startswith("study ") and "seeds [0, 1]" in parent.data.tags["mlflow.note.content"]
    assert {t.data.tags["mlflow.parentRunId"] for t in trials} == {parent.info.run_id}
    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    for number, trial in enumerate(trials):
        mine = [r for r in seeds if r.data.tags["fedrun.trial"] == str(number)]
        assert {r.data.tags["mlflow.parentRunId"] for r in mine} == {trial.info.run_id}
        assert sorted(r.data.tags["seed"] for r in mine) == ["0", "1"]
        # the trial's objective is the mean of its seeds' final test accuracy (the default objective)
        values = [r.data.metrics["final_test_accuracy"] for r in mine]
        assert trial.data.metrics["objective"] == pytest.approx(sum(values) / 2)
        temperature = trial.data.params["aggregator.temperature"]
        assert {r.data.params["aggregator.temperature"] for r in mine} == {temperature}
    best = max(trials, key=lambda t: t.data.metrics["objective"])
    assert parent.data.metrics["best_objective"] == pytest.approx(best.data.metrics["objective"])
    assert results["best_trial"]["mean"] == pytest.approx(best.data.metrics["objective"])
    assert str(results["best_trial"]["params"]["aggregator.temperature"]) == best.data.params["aggregator.temperature"]
    assert parent.data.tags["best.aggregator.temperature"] == best.data.params["aggregator.temperature"]


def run_study(cwd: Path, store: Path, sweep_dir: Path, *extra: str, check: bool = True):
    done = subprocess.run(
        [FEDRUN, "-m", *STUDY, f"tracking.uri=sqlite:///{store}", f"hydra.sweep.dir={sweep_dir}", *extra],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def trials_of(sweep_dir: Path) -> list:
    study = optuna.load_study(study_name=str(sweep_dir), storage=open_storage(None, sweep_dir))
    return study.get_trials(deepcopy=False)


@pytest.mark.slow
@pytest.mark.e2e
def test_a_study_killed_mid_trial_resumes_to_n_trials_and_equals_one_never_killed(tmp_path, store):
    """4 trials x 2 seeds: a study killed (SIGKILL) in its third trial finishes from the jobs' checkpoints without
    extra trials; its trials equal those of the same study never killed (same sampler seed, same trials)."""
    whole = tmp_path / "whole"
    run_study(tmp_path, store, whole, "hydra.sweeper.n_trials=4", "schedule.rounds=6")
    killed = tmp_path / "killed"
    command = [FEDRUN, "-m", *STUDY, f"tracking.uri=sqlite:///{store}", f"hydra.sweep.dir={killed}"]
    extra = ["hydra.sweeper.n_trials=4", "schedule.rounds=6", "checkpoint.every=1", "tracking.experiment=killed"]
    process = subprocess.Popen(command + extra, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while (
        not (killed / "4" / "metrics.csv").is_file() or len((killed / "4" / "metrics.csv").read_text().splitlines()) < 3
    ):
        assert process.poll() is None and time.time() < deadline
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert [t.state.name for t in trials_of(killed)] == ["COMPLETE", "COMPLETE", "RUNNING"]
    resumed = run_study(tmp_path, store, killed, *extra, f"resume={killed}")
    assert "finishing the study's 1 interrupted trials" in resumed.stderr
    assert "resuming" in resumed.stderr  # job 4 went on from its checkpoint
    again, once = trials_of(killed), trials_of(whole)
    assert len(again) == 4 and all(t.state.name == "COMPLETE" for t in again)
    assert [t.params for t in again] == [t.params for t in once]
    assert [t.value for t in again] == pytest.approx([t.value for t in once])
    assert sorted(p.name for p in killed.iterdir() if p.name.isdigit()) == [str(k) for k in range(8)]
    _, seeds = mlflow_runs(store, "killed")  # the killed job's run was reopened, not made twice
    assert len(seeds) == 8 and all(r.info.status == "FINISHED" for r in seeds)
    client, [parent] = sweep_runs(store, "killed")
    trial_runs = client.search_runs([parent.info.experiment_id], "tags.`fedrun.role` = 'trial'")
    assert len(trial_runs) == 4 and {r.info.status for r in trial_runs} == {"FINISHED"}
    assert parent.info.status == "FINISHED" and parent.data.metrics["jobs_finished"] == 4
    refused = run_study(tmp_path, store, killed, *extra, check=False)  # the same dir again, without resume=
    assert refused.returncode == 2 and "resume=" in refused.stderr.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.e2e
def test_a_forced_pruner_stops_a_trial_between_rounds_and_its_run_is_killed_with_its_checkpoint(tmp_path, store):
    sweep_dir = tmp_path / "pruned"
    pruner = "hydra.sweeper.pruner={_target_: optuna.pruners.ThresholdPruner, lower: 1.01, n_warmup_steps: 2}"
    done = run_study(tmp_path, store, sweep_dir, "hydra.sweeper.n_trials=1", pruner, "schedule.rounds=5")
    [trial] = trials_of(sweep_dir)
    assert trial.state.name == "PRUNED"
    mark = trial.system_attrs[PRUNED_ATTR]
    assert mark["seed"] == 0 and mark["round"] == 2  # steps are rounds, from 1: round 2 is the first not warming up
    assert "stopped after round 2" in done.stderr and "skipped, pruned by ThresholdPruner" in done.stderr
    assert (sweep_dir / "0" / "checkpoint.pt").is_file() and not (sweep_dir / "1" / "metrics.csv").exists()
    _, runs = mlflow_runs(store, "fedrun")
    [seed_run] = [r for r in runs if r.data.tags.get("output_dir") == str(sweep_dir / "0")]
    assert seed_run.info.status == "KILLED" and seed_run.data.tags["failure_reason"].startswith("pruned by")


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize(
    "launcher", [["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"], ["hydra/launcher=submitit_local"]]
)
def test_a_study_s_batches_run_side_by_side_under_the_joblib_and_submitit_launchers(tmp_path, store, launcher):
    """Two trials launched together (n_jobs=2): four seed jobs in the launcher's own processes, each writing its
    rounds to the study's journal beside another."""
    name = launcher[0].split("=")[1]
    sweep_dir = tmp_path / name
    extra = ["hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=2", *launcher, "device.threads=1"]
    run_study(tmp_path, store, sweep_dir, *extra, f"tracking.experiment={name}")
    trials = trials_of(sweep_dir)
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]
    for trial in trials:
        finals = [
            float(
                pd.read_csv(sweep_dir / str(2 * trial.number + i) / "summary.csv", index_col=0)["value"][
                    "final_test_accuracy"
                ]
            )
            for i in range(2)
        ]
        assert trial.value == pytest.approx(sum(finals) / 2)
        assert sorted(trial.intermediate_values) == [1, 2, 3]  # both seeds' rounds reached the journal
    _, runs = mlflow_runs(store, name)
    assert len(runs) == 4 and all(r.info.status == "FINISHED" for r in runs)


@pytest.mark.slow
@pytest.mark.e2e
def test_a_searched_seed_or_an_unknown_objective_is_refused_in_one_line_before_any_job(tmp_path, store):
    for extra, line in (
        (["seed=0,1"], "fedrun: error: seed='0,1' is invalid: allowed is left to hydra.sweeper.seeds"),
        (["hydra.sweeper.objective=R95"], "fedrun: error: hydra.sweeper.objective='R95' is invalid"),
    ):
        sweep_dir = tmp_path / extra[0].split("=")[0]
        done = run_study(tmp_path, store, sweep_dir, *extra, "tracking.experiment=refused", check=False)
        assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith(line)
        assert not any(p.name.isdigit() for p in sweep_dir.iterdir())  # no job ran
    _, parents = sweep_runs(store, "refused")
    assert len(parents) == 2 and all(p.info.status == "FAILED" for p in parents)  # no job ran: not FINISHED
