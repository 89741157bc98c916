"""LEAF through the real ``fedrun`` command: a bad file is one line and exit 2, both presets run from the default
root (the tiny files are tests/unit/test_leaf.py's)."""

import pandas as pd
import pytest
from unit.test_leaf import femnist_files, leaf_json, shakespeare_files


def test_a_bad_leaf_file_is_one_line_and_exit_2_through_fedrun(fedrun, tmp_path):
    femnist_files(tmp_path / "data")
    leaf_json(tmp_path / "data", users=3)
    args = ("experiment=femnist", f"dataset.root={tmp_path / 'data'}", "schedule.cohort=2", "tracking.enabled=false")
    done = fedrun(*args, check=False)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"fedrun: error: dataset.root='{tmp_path / 'data' / 'train' / 'b.json'}' is invalid: allowed is a LEAF file "
        "whose users is a list of user names (here 3); LEAF's layout: "
        '{"users": [names], "num_samples": [counts], "user_data": {name: {"x": [...], "y": [...]}}}'
    ]


@pytest.mark.slow
def test_both_presets_run_two_rounds_through_fedrun_from_the_default_root(fedrun, tmp_path, monkeypatch):
    femnist_files(tmp_path / "femnist")
    shakespeare_files(tmp_path / "shakespeare")
    monkeypatch.setenv("FEDRUN_DATA", str(tmp_path))  # dataset.root null: $FEDRUN_DATA/<name>
    done = fedrun(
        "-m",
        "experiment=femnist,shakespeare",
        "schedule.rounds=2",
        "schedule.cohort=2",
        "schedule.eval_every=1",
        "++dataset.client_tests=true",  # ++: Hydra composes the sweep's base config (digits) with it too
        "device.threads=1",
        "hydra.sweep.dir=sweep",
        experiment="leaf",
    )
    assert "femnist train: 3 users, 12 samples" in done.stderr + done.stdout
    for job, sizes in ((0, [5, 3, 4]), (1, [6, 4])):
        metrics = pd.read_csv(fedrun.cwd / "sweep" / str(job) / "metrics.csv")
        assert metrics["round"].tolist() == [1, 2] and (metrics["cohort_size"] == 2).all()
        assert metrics["test_accuracy"].between(0, 1).all() and metrics["client_accuracy"].between(0, 1).all()
        assert pd.read_csv(fedrun.cwd / "sweep" / str(job) / "partition.csv")["samples"].tolist() == sizes
