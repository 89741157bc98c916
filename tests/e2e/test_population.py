"""A million-client run through the real ``fedrun`` command (the population: tests/unit/test_population.py)."""

import pandas as pd
import pytest


@pytest.mark.slow
def test_a_million_client_run_through_fedrun(fedrun):
    fedrun(
        "partition=population",
        "schedule.cohort=10",
        "schedule.rounds=2",
        "model=logistic",
        "device.threads=1",
        "hydra.run.dir=run",
    )
    run_dir = fedrun.cwd / "run"
    assert not (run_dir / "partition.csv").exists()  # listing a million clients would draw them all
    alpha = pd.read_csv(run_dir / "alpha.csv")  # long: a row per client of each round
    assert list(alpha.columns) == ["round", "client", "alpha"] and len(alpha) == 20
    assert pd.read_csv(run_dir / "selected.csv").groupby("round")["selected"].sum().tolist() == [10, 10]
