"""An attack through the real ``fedrun`` command: its share, its clients and its tags in the files and in MLflow
(attacks in the round: tests/config/test_attacks.py)."""

import pandas as pd
import pytest


@pytest.mark.e2e
@pytest.mark.slow
def test_an_attack_through_fedrun_logs_its_share_its_clients_and_its_tags(fedrun, store):
    from conftest import mlflow_runs

    done = fedrun(
        "attack=sign_flip",
        "attack.fraction=0.2",
        "aggregator=median",
        "aggregator.f=2",
        "schedule.rounds=3",
        "hydra.run.dir=out",
        experiment="attack",
    )
    assert done.returncode == 0
    out = fedrun.cwd / "out"
    rows = pd.read_csv(out / "metrics.csv")
    assert {"attack/weight_share", "attack/cohort_share", "robust/discarded"} <= set(rows.columns)
    malicious = pd.read_csv(out / "malicious.csv")["client"].tolist()
    assert len(malicious) == 4  # 20 % of the 20 clients
    _, runs = mlflow_runs(store, "attack")
    tags = runs[0].data.tags
    assert tags["attack"] == "sign_flip" and tags["attack_malicious_count"] == "4"
    assert tags["attack_malicious_ids"] == ",".join(str(c) for c in malicious)
