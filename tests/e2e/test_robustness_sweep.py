"""sweep=robustness through the real fedrun and fedrun-report commands, on a small corner of its matrix."""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import mlflow_runs

pytestmark = pytest.mark.slow


def test_the_robustness_sweep_collapses_its_f0_jobs_and_the_report_reads_the_matrix(fedrun, store):
    done = fedrun(
        "-m",
        "sweep=robustness",
        "defence=fedsoftmax,krum",
        "attack=sign_flip,loss_lie_flip",
        "attack.count=0,2",
        "partition=iid",
        "seed=0,1",
        "schedule.rounds=2",
        "partition.samples_per_client=30",
        "dataset=digits",  # the preset's MNIST is 60,000 images to load per job: the 8x8 digits do here
        "hydra.sweep.dir=sweep",
        experiment="robustness_e2e",
    )
    # 2 rules x 2 attacks x 2 counts x 2 seeds = 16 jobs; each attack's count-0 job is attack=none: 4 fewer.
    assert "fedrun: sweep: 16 jobs, 4 equal to another by hydra.sweeper.collapse: 12 run" in done.stdout
    _, runs = mlflow_runs(store, "robustness_e2e")
    assert len(runs) == 12 and all(r.info.status == "FINISHED" for r in runs)
    clean = [r for r in runs if r.data.tags["attack"] == "none"]
    assert len(clean) == 4 and all("attack.count" not in r.data.params for r in clean)
    krum = [r for r in runs if r.data.tags["defence"] == "krum" and r.data.tags["attack"] == "sign_flip"]
    assert {r.data.params["aggregator.f"] for r in krum} == {"2"}  # the rule is told the attackers' count
    soft = [r for r in runs if r.data.tags["defence"] == "fedsoftmax" and r.data.tags["attack"] == "loss_lie_flip"]
    assert all(
        r.data.metrics["5_summary/attack/weight_share_mean"] > 0.99 for r in soft
    )  # the liars take FedSoftMax's weight

    out = fedrun.cwd / "report"
    report = str(Path(sys.executable).parent / "fedrun-report")
    args = ["--experiment", "robustness_e2e", "--tracking-uri", f"sqlite:///{store}", "--robustness", "--out", str(out)]
    shown = subprocess.run([report, *args], capture_output=True, text=True, check=True).stdout
    assert "| rule | iid f=0 (0%) | iid f=2 (10%) |" in shown
    cells = pd.read_csv(out / "robustness.csv")
    assert len(cells) == 2 * (1 + 2) and set(cells["runs"]) == {2}  # per rule: none, and two attacks at f = 2
    assert set(cells["f"]) == {0, 2} and set(cells["clients"]) == {20}
    worst = pd.read_csv(out / "robustness_worst.csv")
    assert len(worst) == 4 and set(worst.loc[worst["f"] == 0, "attack"]) == {"none"}
    for name in ("robustness.md", "robustness_worst.png", "robustness_iid.png"):
        assert (out / name).stat().st_size > 1000
