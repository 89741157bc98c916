"""The Optuna sweeper (``hydra/sweeper=optuna``): studies through the real ``fedrun -m`` command (its search space,
objective, pruning and trial records by hand: tests/unit/test_study.py)."""

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
from conftest import all_runs, mlflow_runs, sweep_runs
from optuna.distributions import CategoricalDistribution, FloatDistribution

from fedrun.study import (
    PRUNED_ATTR,
    open_storage,
    settings_of,
)

FEDRUN = str(Path(sys.executable).parent / "fedrun")


STUDY = [
    "hydra/sweeper=optuna",
    "aggregator=fedsoftmax",
    "aggregator.temperature=tag(log,interval(0.05,20))",
    "hydra.sweeper.seeds=[0,1]",
    "schedule.rounds=3",
    "partition.num_clients=5",
]


def check_recorded(store: Path, experiment: str, sweep_dir: Path, n_trials: int) -> None:
    """A study's MLflow records: one parent run, its trials as children, each trial's seeds as the trial's children,
    the objective the mean of the seeds' final test accuracy, the best trial named on the parent and in Optuna's
    results file."""
    _, runs = all_runs(store, experiment)
    parents = [r for r in runs if r.data.tags.get("fedrun.role") == "sweep"]
    trials = sorted((r for r in runs if r.data.tags.get("fedrun.role") == "trial"), key=lambda r: r.info.start_time)
    seeds = [r for r in runs if "fedrun.trial" in r.data.tags and "fedrun.role" not in r.data.tags]
    assert len(parents) == 1 and len(trials) == n_trials and len(seeds) == 2 * n_trials  # a study, trials, seeds
    [parent] = parents
    assert parent.info.status == "FINISHED" and parent.data.metrics["jobs_finished"] == n_trials  # its trials
    assert parent.info.run_name.startswith("study ") and "seeds [0, 1]" in parent.data.tags["mlflow.note.content"]
    assert {t.data.tags["mlflow.parentRunId"] for t in trials} == {parent.info.run_id}
    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    for number, trial in enumerate(trials):
        mine = [r for r in seeds if r.data.tags["fedrun.trial"] == str(number)]
        assert {r.data.tags["mlflow.parentRunId"] for r in mine} == {trial.info.run_id}
        assert sorted(r.data.tags["seed"] for r in mine) == ["0", "1"]
        # the trial's objective is the mean of its seeds' final test accuracy (the default objective)
        values = [r.data.metrics["5_summary/final_test_accuracy"] for r in mine]
        assert trial.data.metrics["objective"] == pytest.approx(sum(values) / 2)
        temperature = trial.data.params["aggregator.temperature"]
        assert {r.data.params["aggregator.temperature"] for r in mine} == {temperature}
    best = max(trials, key=lambda t: t.data.metrics["objective"])
    assert parent.data.metrics["best_objective"] == pytest.approx(best.data.metrics["objective"])
    assert results["best_trial"]["mean"] == pytest.approx(best.data.metrics["objective"])
    assert str(results["best_trial"]["params"]["aggregator.temperature"]) == best.data.params["aggregator.temperature"]
    assert parent.data.tags["best.aggregator.temperature"] == best.data.params["aggregator.temperature"]


def run_study(cwd: Path, store: Path, sweep_dir: Path, *extra: str, check: bool = True, study=STUDY, env=None):
    done = subprocess.run(
        [FEDRUN, "-m", *study, f"tracking.uri=sqlite:///{store}", f"hydra.sweep.dir={sweep_dir}", *extra],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
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
    extra trials; its trials equal those of the same study never killed (same sampler seed, same trials), whose
    MLflow records (parent, trials, seeds, objective, best trial) ``check_recorded`` reads first."""
    whole = tmp_path / "whole"
    run_study(tmp_path, store, whole, "hydra.sweeper.n_trials=4", "schedule.rounds=6", "tracking.experiment=whole")
    check_recorded(store, "whole", whole, 4)  # the study never killed, as MLflow holds it
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


@pytest.mark.slow
@pytest.mark.e2e
def test_a_study_whose_every_trial_fails_exits_non_zero_in_one_line(tmp_path, store):
    """A search space where every value is invalid (a temperature must be > 0): each job fails in its line, then
    the sweep says that no trial completed and exits 1 (it exited 0)."""
    study = [line for line in STUDY if not line.startswith("aggregator.temperature=")]
    sweep_dir = tmp_path / "failing"
    extra = ["aggregator.temperature=choice(-1,-2)", "hydra.sweeper.n_trials=2", "tracking.experiment=failing"]
    done = run_study(tmp_path, store, sweep_dir, *extra, check=False, study=study)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"fedrun: error: study {sweep_dir}: no trial completed ({{'fail': 2}}; their jobs' errors are above); "
        f"{sweep_dir / 'optimization_results.yaml'}"
    )
    assert [t.state.name for t in trials_of(sweep_dir)] == ["FAIL", "FAIL"]


@pytest.mark.slow
@pytest.mark.e2e
def test_a_resumed_study_relaunches_no_parameter_from_its_journal_outside_its_search_space(tmp_path, store):
    """A crafted journal whose RUNNING trial sets the aggregator's ``_target_`` to a module that writes a marker
    when imported: the resume refuses it in one line before any job, and the marker is never written."""
    from fedrun.study import SETTINGS_ATTR

    marker, sweep_dir = tmp_path / "marker", tmp_path / "crafted"
    (tmp_path / "payload.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nAggregator = dict\n")
    storage = open_storage(None, sweep_dir)
    study = optuna.create_study(storage=storage, study_name=str(sweep_dir), direction="maximize")
    space = {"aggregator.temperature": FloatDistribution(0.05, 20.0, log=True)}
    fixed = {
        "aggregator": "fedsoftmax",
        "schedule.rounds": "3",
        "partition.num_clients": "5",
        "tracking.uri": f"sqlite\\:///{store}",  # as Hydra gives a fixed override's value: its colon escaped
        "tracking.experiment": "crafted",
    }
    study.set_user_attr(SETTINGS_ATTR, settings_of(space, fixed, [0, 1], "final_test_accuracy", "maximize"))
    trial = storage.create_new_trial(study._study_id)
    storage.set_trial_param(trial, "aggregator.temperature", 1.0, space["aggregator.temperature"])
    storage.set_trial_param(trial, "aggregator._target_", 0, CategoricalDistribution(["payload.Aggregator"]))
    journal = sweep_dir / "optuna_study.journal"
    done = run_study(
        tmp_path,
        store,
        sweep_dir,
        "tracking.experiment=crafted",
        "hydra.sweeper.n_trials=1",  # the crafted trial is all there is to run
        f"resume={sweep_dir}",
        check=False,
        env={"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])},
    )
    assert not marker.exists(), done.stderr[-2000:]
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        f"fedrun: error: {journal}: trial 0's parameter aggregator._target_='payload.Aggregator' is invalid: "
        "allowed is a parameter of the study's search space (aggregator.temperature)"
    ), done.stderr[-2000:]
    assert not any(p.name.isdigit() for p in sweep_dir.iterdir())  # no job ran


@pytest.mark.slow
@pytest.mark.e2e
def test_the_sweeper_s_bad_arguments_and_a_garbage_journal_are_one_line_before_any_job(tmp_path, store):
    """``n_trials=abc`` (Hydra's multi-line error) and a resumed study whose journal has a garbage line (Optuna's
    traceback): one line each, exit 2, no job."""
    bad = tmp_path / "bad"
    done = run_study(tmp_path, store, bad, "hydra.sweeper.n_trials=abc", "tracking.experiment=refused", check=False)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "fedrun: error: hydra.sweeper.n_trials='abc' is invalid: allowed is an integer >= 1"
    ]
    garbage = tmp_path / "garbage"
    optuna.create_study(storage=open_storage(None, garbage), study_name=str(garbage))
    journal = garbage / "optuna_study.journal"
    with open(journal, "a") as f:
        f.write("garbage\n")
    done = run_study(tmp_path, store, garbage, f"resume={garbage}", "tracking.experiment=refused", check=False)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        f"fedrun: error: {journal} line 2='garbage' is invalid: allowed is one JSON object per line (JSONDecodeError)"
    )
    assert not any(p.name.isdigit() for p in garbage.iterdir())
