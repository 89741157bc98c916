"""Attacks in the round (issue 36): where they act, what a run logs of them, and that an attack on nobody changes
nothing. The attacks' own numbers are tests/unit/test_attacks.py's; the robust rules' tests/unit/aggregators/test_robust.py's."""

import functools
from pathlib import Path

import hydra
import numpy as np
import pytest
import torch
from conftest import composed
from omegaconf import OmegaConf

from fedrun.aggregators import FedAvg, FedSoftMax
from fedrun.checkpoint import Checkpoint
from fedrun.datasets import FederatedData
from fedrun.engine import run
from fedrun.models import MLP
from fedrun.parts import Parts
from fedrun.rounds import Schedule
from fedrun.sampling import PowerOfChoice
from fedrun.seeding import torch_seed

g = torch.Generator().manual_seed(0)
X = torch.randn(200, 4, generator=g, dtype=torch.float64)
Y = (X @ torch.randn(4, 3, generator=g, dtype=torch.float64)).argmax(1)
DATA = FederatedData(X, Y, X[:40], Y[:40], num_classes=3)
CLIENTS = [np.arange(20 * c, 20 * (c + 1)) for c in range(10)]
SGD = functools.partial(torch.optim.SGD, lr=0.3)
ATTACKS = sorted(p.stem for p in (Path(__file__).parents[2] / "conf" / "attack").glob("*.yaml") if p.stem != "none")


def model():
    torch.manual_seed(torch_seed(0, "init"))
    return MLP((4,), 3, hidden=(8,)).double()


def train(parts, rounds=4, cohort=5, checkpoint=None):
    rows = []
    result = run(
        model(),
        DATA,
        CLIENTS,
        parts,
        SGD,
        Schedule(rounds=rounds, local_steps=2, batch_size=10, cohort=cohort),
        torch.device("cpu"),
        0,
        on_round=lambda row, per_client: rows.append(row),
        checkpoint=checkpoint,
    )
    return result, rows


def option(name: str, **overrides):
    """The attack option ``conf/attack/<name>.yaml``, composed and built as the CLI builds it (an option may extend
    another through its defaults list: loss_lie_flip)."""
    node = composed(f"attack={name}").attack
    return hydra.utils.instantiate(OmegaConf.merge(node, overrides))


def measured(rows):
    """The rows without wall-clock times and without the attack's own columns."""
    return [{k: v for k, v in r.items() if not k.endswith("wall_s") and not k.startswith("attack/")} for r in rows]


@pytest.mark.parametrize("name", ATTACKS)
def test_every_attack_on_nobody_is_the_run_without_attack_exactly(name):
    honest, honest_rows = train(Parts(FedSoftMax(temperature=1.0)))
    attacked, rows = train(Parts(FedSoftMax(temperature=1.0), attack=option(name, fraction=0.0)))
    assert torch.equal(attacked.params, honest.params)
    assert measured(rows) == measured(honest_rows)


def test_an_attacked_run_logs_the_attackers_share_of_the_weight_and_who_they_were():
    attack = option("sign_flip", fraction=0.3)
    result, rows = train(Parts(FedAvg(weighting="uniform"), attack=attack), rounds=3)
    malicious = set(attack.malicious_ids().tolist())
    assert len(malicious) == 3
    for row in rows:  # uniform FedAvg: the attackers' weight is their share of the cohort
        assert row["attack/weight_share"] == pytest.approx(row["attack/cohort_share"])
    assert set(result.tables["malicious.csv"]["client"]) == malicious


def test_a_loss_liar_takes_fedsoftmax_s_weight_and_fedmax_gives_it_all():
    # One liar reporting the largest honest loss + T ln(9 (n - 1)) takes at least 90% of FedSoftMax's weight
    # (uniform p): its weight is e^{s} / (e^{s} + sum of the others) >= 1 / (1 + (n - 1) / (9 (n - 1))) = 0.9.
    n, temperature = 5, 0.5
    liar = option("loss_lie", fraction=None, count=1, relative_to="honest_max")
    liar.offset = temperature * np.log(9 * (n - 1))
    _, rows = train(Parts(FedSoftMax(temperature=temperature, weighting="uniform"), attack=liar), cohort=n)
    sampled = [row for row in rows if row["attack/cohort_share"] > 0]
    assert sampled and all(row["attack/weight_share"] >= 0.9 - 1e-9 for row in sampled)
    assert all(row["attack/weight_share"] == 0 for row in rows if row["attack/cohort_share"] == 0)


def test_power_of_choice_keeps_the_candidates_that_report_a_huge_loss():
    liars = option("loss_lie", fraction=0.2, offset=100.0)
    _, rows = train(Parts(FedAvg(), sampler=PowerOfChoice(candidates=10), attack=liars), rounds=4, cohort=2)
    # Both liars are among the 10 candidates every round and report the two highest losses: the cohort is theirs.
    assert [row["attack/cohort_share"] for row in rows] == [1.0] * 4


def test_train_loss_is_measured_not_reported():
    honest = train(Parts(FedAvg()))[1]
    lied = train(Parts(FedAvg(), attack=option("loss_lie", fraction=0.3, offset=50.0)))[1]
    assert [r["train_loss"] for r in lied] == [r["train_loss"] for r in honest]  # honest updates, honest losses


def test_a_label_flipping_client_trains_on_flipped_labels_without_lying():
    flipped = train(Parts(FedAvg(), attack=option("label_flip", fraction=0.3)))[0]
    honest = train(Parts(FedAvg()))[0]
    assert not torch.equal(flipped.params, honest.params)


def test_an_attacked_run_resumes_from_its_checkpoint_to_the_same_numbers(tmp_path):
    def parts():
        return Parts(FedSoftMax(temperature=1.0), attack=option("alie", fraction=0.2, who="redrawn"))

    whole, whole_rows = train(parts(), rounds=4)
    train(parts(), rounds=2, checkpoint=Checkpoint(tmp_path, every=1))
    resumed, rows = train(parts(), rounds=4, checkpoint=Checkpoint(tmp_path, resume=True))
    assert torch.equal(resumed.params, whole.params)
    strip = lambda rs: [{k: v for k, v in r.items() if not k.endswith("wall_s")} for r in rs]  # noqa: E731
    assert strip(rows) == strip(whole_rows[2:])
