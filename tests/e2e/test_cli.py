"""End-to-end runs of the real ``fedrun`` command on tiny settings, checked through MLflow and the files."""

import json
import os
from pathlib import Path

import pandas as pd
import pytest
from conftest import mlflow_runs

from fedrun.tracking import plain_name

pytestmark = pytest.mark.e2e
TINY = ["schedule.rounds=3", "partition.num_clients=5"]


def job_dirs(cwd: Path, kind: str) -> list[Path]:
    return sorted(p.parent for p in (cwd / "outputs" / kind).rglob("metrics.csv"))


def test_main_job_logs_metrics_alpha_and_artifacts(fedrun, store):
    done = fedrun("aggregator=fedsoftmax", "partition=shards", *TINY, experiment="main")
    client, runs = mlflow_runs(store, "main")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    # It ends by saying what it found, where its files are and where MLflow shows it.
    final, tail = (run.data.metrics[f"5_summary/{k}_test_accuracy"] for k in ("final", "tail"))
    said = done.stderr.strip().splitlines()
    assert f"fedrun: finished after 3 of 3 rounds: test accuracy {final:.4f} at round 3, {tail:.4f} over the tail" in (
        "\n".join(said)
    )
    assert said[-1] == f"fedrun: run folder: {run.data.tags['output_dir']}"
    assert any(line.startswith("fedrun: MLflow run: fedrun-ui --store ") for line in said)
    assert run.data.tags["aggregator"] == "fedsoftmax" and run.data.tags["partition"] == "shards"
    assert run.data.tags["dataset"] == "digits" and run.data.tags["torch_version"]
    assert run.data.params["aggregator.temperature"] == "1.0" and run.data.params["schedule.rounds"] == "3"
    history = client.get_metric_history(run.info.run_id, "0_main/test_accuracy")
    assert [m.step for m in history] == [1, 2, 3] and all(0 <= m.value <= 1 for m in history)
    # FedSoftMax's alpha follows the clients' losses: its per-client series are logged
    alphas = [client.get_metric_history(run.info.run_id, f"alpha/client_{i}") for i in range(5)]
    for step in range(3):
        assert sum(a[step].value for a in alphas) == pytest.approx(1.0)
    assert run.data.tags["alpha_series"] == "per_client"
    for name in ("0_main/train_loss", "0_main/test_loss", "4_timing/round_wall_s", "5_summary/final_test_accuracy"):
        assert name in run.data.metrics
    assert "1_r_index/R60" in run.data.metrics or run.data.tags.get("R60") == "not_reached"
    assert run.data.tags.get("R90") == "not_reached" or run.data.metrics["1_r_index/R90"] >= 1
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {
        "metrics.csv",
        "alpha.csv",
        "model.pt",
        "curves.png",
        "alpha_heatmap.png",
        "config.yaml",
        "partition.csv",
    } <= artifacts
    [job] = job_dirs(fedrun.cwd, "runs")
    metrics, alpha = pd.read_csv(job / "metrics.csv"), pd.read_csv(job / "alpha.csv")
    assert list(metrics["round"]) == [1, 2, 3] and alpha.shape == (3, 6)
    assert metrics["test_accuracy"].iloc[-1] == pytest.approx(history[-1].value)
    saved = json.loads((job / "run.json").read_text())  # the counts a resume takes (tests/unit/cli/test_threads.py)
    assert saved["threads"] == saved["cores"] == len(os.sched_getaffinity(0)) == int(run.data.tags["torch_threads"])
    assert not (fedrun.cwd / "mlruns").exists()


def section(name: str) -> str:
    """The MLflow UI's section of a metric (RunsChartsCardConfig: the name before the last "/", or "Model metrics")."""
    return name.rsplit("/", 1)[0] if "/" in name else "~Model metrics"  # sorted after every prefix, as the UI does


def test_a_fedavg_batch_norm_run_shows_the_main_section_first_no_alpha_series_and_saves_the_servers_statistics(
    fedrun, store
):
    """One run for the metrics page's sections, FedAvg's alpha and batch norm's saved statistics (was two runs)."""
    import torch

    fedrun(
        "aggregator=fedavg",
        "partition=shards",
        "metrics.r_targets=[0.1]",
        "model.norm=batch",
        *TINY,
        experiment="fedavg",
    )
    client, [run] = mlflow_runs(store, "fedavg")
    names = set(run.data.metrics)
    # FedAvg's alpha is p_i, a flat line per client: only alpha.csv and the heatmap have it
    assert not any(n.startswith("alpha/") for n in names) and run.data.tags["alpha_series"] == "artifacts"
    assert {"alpha.csv", "alpha_heatmap.png"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    first, second = sorted({section(n) for n in names})[:2]
    assert {n for n in names if section(n) == first} == {
        "0_main/test_accuracy",
        "0_main/test_loss",
        "0_main/train_loss",
    }
    assert {n for n in names if section(n) == second} == {"1_r_index/R10"}
    [job] = job_dirs(fedrun.cwd, "runs")
    saved = torch.load(job / "model.pt", weights_only=True)
    means = [k for k in saved if k.endswith("running_mean")]
    assert means and all(k.replace("running_mean", "running_var") in saved for k in means)
    assert all(torch.isfinite(saved[k]).all() for k in means)


FEATURES = {
    "privacy": (
        [
            "privacy=central",
            "aggregator.weighting=uniform",
            "schedule.sampling=poisson",
            "schedule.clients_per_round=0.5",
        ],
        {"0_main/epsilon", "2_privacy/clip_norm", "2_privacy/clipped_fraction", "2_privacy/noise_std"},
    ),
    "compression": (["compression=topk"], {"2_compression/topk/bits_per_coordinate"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("feature", list(FEATURES))
def test_a_feature_has_its_section_after_the_main_ones_then_communication_timings_and_summaries(fedrun, store, feature):
    overrides, expected = FEATURES[feature]
    fedrun(*overrides, *TINY, experiment=f"section_{feature}")  # the store is the session's: a name of its own
    _, [run] = mlflow_runs(store, f"section_{feature}")
    names = set(run.data.metrics)
    assert expected <= names
    # the R-index where reached; the selection's, in every run (its probabilities, how evenly it picked)
    sections = [s for s in sorted({section(n) for n in names}) if s not in ("1_r_index", "2_selection")]
    own = min(n for n in expected if section(n) != "0_main")  # a headline (epsilon) is drawn first, in 0_main
    assert sections[:2] == ["0_main", section(own)]
    assert sections[2:5] == ["3_communication", "4_timing", "5_summary"]
    assert {"3_communication/upload_mb", "4_timing/train_wall_s", "5_summary/final_test_accuracy"} <= names
    assert not any(n.endswith("_wall_s") and not n.startswith(("4_timing/", "5_summary/")) for n in names)  # totals


@pytest.mark.slow
def test_multirun_makes_one_run_per_seed_and_same_seed_repeats_exactly(fedrun, store):
    fedrun("-m", "aggregator=fedavg,fedsoftmax", "seed=0,1", *TINY, experiment="sweep")
    _, runs = mlflow_runs(store, "sweep")
    assert sorted(r.data.tags["seed"] for r in runs) == ["0", "0", "1", "1"]
    assert len({r.info.experiment_id for r in runs}) == 1
    # MLflow's runs table shows about the first 15-20 characters of a name: the jobs differ within them
    names = sorted(r.info.run_name for r in runs)
    assert names == [
        f"{a} seed={s} iid digits rounds=3 num_clients=5" for a in ("fedavg", "fedsoftmax") for s in (0, 1)
    ]
    assert len({name[:20] for name in names}) == 4
    fedrun("seed=0", "aggregator=fedsoftmax", *TINY, experiment="sweep")
    sweep_jobs, [single] = job_dirs(fedrun.cwd, "multiruns"), job_dirs(fedrun.cwd, "runs")
    by_seed = {tuple(pd.read_csv(j / ".hydra" / "overrides.yaml", header=None).iloc[:2, 0]): j for j in sweep_jobs}
    by_seed = {seed: job for (aggregator, seed), job in by_seed.items() if aggregator == "- aggregator=fedsoftmax"}

    def numbers(job):
        frame = pd.read_csv(job / "metrics.csv")
        return frame.drop(columns=[c for c in frame if c.endswith("_wall_s")])

    pd.testing.assert_frame_equal(numbers(by_seed["- seed=0"]), numbers(single))
    assert not numbers(by_seed["- seed=1"]).equals(numbers(single))


def test_a_run_stopped_by_its_privacy_budget_says_so_and_what_it_spent(fedrun, store):
    args = ["privacy=central", "privacy.max_epsilon=5", "schedule.sampling=poisson", "schedule.clients_per_round=0.5"]
    done = fedrun(*args, "schedule.rounds=5", "partition.num_clients=5", experiment="budget")
    said = done.stderr.strip().splitlines()
    assert (
        said[-3].startswith("fedrun: finished after 1 of 5 rounds: test accuracy") and "epsilon 3.89 spent" in said[-3]
    )
    assert said[-2] == "fedrun: stopped before its last round: max_epsilon 5: round 2 would bring epsilon to 5.377"


def test_bad_value_stops_before_training_with_one_line(fedrun, store):
    done = fedrun("aggregator=fedsoftmax", "aggregator.temperature=-1", experiment="bad", check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "fedrun: error: aggregator.temperature=-1 is invalid: allowed is a number > 0"
    )
    _, runs = mlflow_runs(store, "bad")
    assert runs == []


@pytest.mark.slow
def test_diverging_run_is_marked_failed_and_keeps_its_metrics(fedrun, store):
    done = fedrun("optimizer.lr=1e6", "schedule.rounds=5", "partition.num_clients=5", experiment="diverge", check=False)
    assert done.returncode != 0
    _, [run] = mlflow_runs(store, "diverge")
    assert run.info.status == "FAILED"
    assert "DivergenceError" in run.data.tags["failure_reason"] and "non-finite" in run.data.tags["failure_reason"]
    [job] = job_dirs(fedrun.cwd, "runs")
    assert len(pd.read_csv(job / "metrics.csv")) >= 1  # the rounds before the failure are kept


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("FEDRUN_DATA"), reason="needs FEDRUN_DATA pointing at a copy of the MNIST files")
def test_the_run_says_which_input_scale_it_ran_on(fedrun, store):
    fedrun("dataset.scale=raw", "schedule.rounds=1", "partition.num_clients=5", experiment="scale")
    _, [run] = mlflow_runs(store, "scale")
    assert run.data.tags["input_scale"] == "raw" and run.data.params["dataset.scale"] == "raw"
    assert run.data.tags["mlflow.note.content"].startswith("**fedavg** on **digits** (raw pixel values)")
    done = fedrun("dataset.scale=pixels", check=False)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        "fedrun: error: dataset.scale='pixels' is invalid: allowed is standard (per-channel standardisation), unit (pixels / max, "
        "in [0, 1]) or raw (the stored values)"
    )


@pytest.mark.slow
def test_mnist_runs_offline_from_fedrun_data(fedrun, store):
    fedrun(
        "dataset=mnist",
        "partition=shards",
        "partition.num_clients=10",
        "partition.samples_per_client=200",
        "schedule.rounds=3",
        "schedule.batch_size=20",
        "tracking.enabled=false",
    )
    [job] = job_dirs(fedrun.cwd, "runs")
    accuracy = pd.read_csv(job / "metrics.csv")["test_accuracy"]
    assert accuracy.iloc[-1] > 0.3  # 10 classes: chance is 0.1
    # The split that produced the result: McMahan's shards, 2 of 100 samples each: mostly two labels a client
    # (a shard straddles two labels where a label's count is not a multiple of 100).
    partition = pd.read_csv(job / "partition.csv")
    counts = partition[[f"label_{c}" for c in range(10)]]
    assert list(partition["client"]) == list(range(10)) and list(partition["samples"]) == [200] * 10
    assert (counts.sum(axis=1) == 200).all() and ((counts > 0).sum(axis=1) <= 2).mean() >= 0.7


def test_missing_dataset_files_say_what_to_put_where(fedrun, tmp_path):
    done = fedrun("dataset=fmnist", f"dataset.root={tmp_path}/nowhere", "dataset.download=false", check=False)
    assert done.returncode == 2
    line = done.stderr.strip().splitlines()[-1]
    assert "train-images-idx3-ubyte.gz" in line and "nowhere/FashionMNIST/raw" in line and "FEDRUN_DATA" in line


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("FEDRUN_DATA"), reason="the presets use MNIST and Fashion-MNIST")
def test_every_preset_runs_shrunk(fedrun):
    leaf = ["femnist", "shakespeare"]  # LEAF's files are the user's: tests/e2e/test_leaf.py runs them on tiny ones
    # PFLlib's split cuts each class into chunks as small as a tenth of a client's share, and each client holds out a
    # test and a validation split: at 20 samples a client, one gets a single sample (refused, as it should be)
    larger = {"pfllib_fmnist": 100}
    shrunk = ["schedule.rounds=1", "schedule.batch_size=10", "schedule.eval_every=1", "tracking.enabled=false"]
    fedrun(
        "-m",
        f"experiment=glob(*,exclude=[{','.join(leaf + list(larger))}])",
        "partition.samples_per_client=20",
        *shrunk,
    )
    for preset, size in larger.items():
        fedrun("-m", f"experiment={preset}", f"partition.samples_per_client={size}", *shrunk)
    presets = [p.stem for p in (Path(__file__).parents[2] / "conf" / "experiment").glob("*.yaml")]
    assert len(job_dirs(fedrun.cwd, "multiruns")) == len([p for p in presets if p not in leaf])


@pytest.mark.slow
def test_named_sweep_runs_every_point(fedrun, store):
    fedrun(
        "sweep=topk", "hydra.sweeper.params.seed=0", "schedule.rounds=1", "partition.num_clients=5", experiment="topk"
    )
    _, runs = mlflow_runs(store, "topk")
    assert sorted(r.data.params["aggregator.k"] for r in runs) == ["0.1", "0.2", "0.5", "1", "1.0"]


@pytest.mark.slow  # two runs (20 s); tests/unit/test_async_engine.py checks the engine in the fast tier
def test_async_run_logs_virtual_time_staleness_and_fairness_and_repeats_exactly(fedrun, store):
    speeds = "engine.speeds=[{name:fast,clients:3,distribution:uniform,low:1.0,high:2.0},{name:slow,clients:2,distribution:uniform,low:8.0,high:12.0}]"
    args = [
        "aggregator=fedstaleweight",
        "aggregator.buffer_size=2",
        "partition=label_split",
        "partition.groups=[{clients:3,labels:[4,5,6,7,8,9]},{clients:2,labels:[0,1,2,3]}]",
        speeds,
        "schedule.rounds=6",
        "schedule.local_steps=1",
        "schedule.eval_every=3",
    ]
    fedrun(*args, experiment="async")
    fedrun(*args, "tracking.enabled=false")
    client, [run] = mlflow_runs(store, "async")
    assert run.info.status == "FINISHED" and run.data.tags["engine"] == "async"
    plain = {plain_name(name): value for name, value in run.data.metrics.items()}  # whatever their MLflow section
    for name in (
        "virtual_time",
        "staleness_mean",
        "staleness_max",
        "accuracy/fast",
        "accuracy/slow",
        "weight_share/fast",
        "weight_share/slow",
        "client_accuracy_std",
    ):
        assert name in plain, name
    assert plain["weight_share/fast"] + plain["weight_share/slow"] == pytest.approx(1.0)
    assert "fairness.csv" in {a.path for a in client.list_artifacts(run.info.run_id)}
    first, second = (
        pd.read_csv(j / "metrics.csv").filter(regex="^(?!.*_wall_s$)") for j in job_dirs(fedrun.cwd, "runs")
    )
    assert len(first) == 6
    pd.testing.assert_frame_equal(first, second)


@pytest.mark.slow
def test_methods_set_three_groups_and_mvr_doubles_communication(fedrun, store):
    fedrun(
        "-m",
        "method=fedavg,storm_vr",
        "schedule.rounds=2",
        "partition.num_clients=4",
        "schedule.local_steps=2",
        "heterogeneity=stragglers",
        "heterogeneity.fraction=0.5",
        experiment="methods",
    )
    client, runs = mlflow_runs(store, "methods")
    by_method = {r.data.tags["method"]: r for r in runs}
    assert (
        by_method["storm_vr"].data.tags["aggregator"] == "mvr"
        and by_method["storm_vr"].data.tags["optimizer"] == "storm"
    )
    assert by_method["fedavg"].data.tags["server"] == "sgd"
    upload = {m: r.data.metrics["3_communication/upload_mb"] for m, r in by_method.items()}
    assert upload["storm_vr"] == pytest.approx(2 * upload["fedavg"])
    for job in job_dirs(fedrun.cwd, "multiruns"):
        steps = pd.read_csv(job / "local_steps.csv").drop(columns="round").to_numpy()
        # every round: two clients do their full 2 steps, the two stragglers between 1 and 2
        assert ((steps >= 1) & (steps <= 2)).all() and ((steps == 2).sum(axis=1) >= 2).all()
