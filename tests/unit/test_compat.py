"""The compatibility table (fedrun/compat.py): each rule refuses exactly its combination, in one line."""

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest
import torch

from fedrun import attacks, compat
from fedrun.aggregators import MVR, TERM, FedAvg, FedBuff, FedNova, FedSoftMax, Hybrid, RoundView
from fedrun.async_engine import AsyncEngine
from fedrun.attacks import ALIE, Attack, LossLie, SignFlip
from fedrun.datasets import Dataset
from fedrun.devices import Traced
from fedrun.engine import SyncEngine
from fedrun.errors import ConfigError
from fedrun.heterogeneity import EqualWork, RandomSteps, Stragglers
from fedrun.partitions import Population
from fedrun.parts import ClientState
from fedrun.pipeline import Clip, Pipeline, Stage
from fedrun.privacy import Privacy
from fedrun.programs import FedDyn, LocalSGD, Moon, Scaffold
from fedrun.rounds import Schedule
from fedrun.sampling import Importance, PowerOfChoice, Uniform


class Crossing(Stage):
    """A stage whose effect on one update depends on the round's other updates (what it does does not matter)."""

    def crosses_clients(self):
        return True


class Keeping(ClientState):
    """A client state that keeps something per client (what it keeps does not matter to the table)."""

    keeps = True


PROFILES = str(Path(__file__).parents[1] / "data" / "devices" / "profiles.csv")  # 100 clients
WINDOWS = str(Path(__file__).parents[1] / "data" / "devices" / "availability.csv")  # their daily windows


def central():
    return Privacy(mechanism="central", noise_multiplier=1.0)


def asynchronous(concurrency=None):
    speeds = [{"name": "all", "clients": None, "distribution": "uniform", "low": 1.0, "high": 2.0}]
    return AsyncEngine(speeds, concurrency=concurrency)


# One case per rule, in the table's order: the fewest parts that trigger it, and today's one-line refusal.
CASES = [
    (
        lambda: {"privacy": central(), "engine": asynchronous()},
        "engine='async' is invalid: allowed is sync with privacy=central (asynchronous privacy is not accounted; an "
        "asynchronous aggregator runs on engine=async)",
    ),
    (
        lambda: {"engine": SyncEngine(), "aggregator": FedBuff()},
        "engine='sync' is invalid: allowed is async for FedBuff, an asynchronous aggregator",
    ),
    (
        lambda: {"engine": SyncEngine(), "sampler": Importance(), "aggregator": FedSoftMax()},
        "aggregator='FedSoftMax' is invalid: allowed is fedavg with sampler=importance (its weights q_k / (m p_k) "
        "make FedAvg's update unbiased; other aggregators choose their own alpha)",
    ),
    (
        lambda: {"engine": SyncEngine(), "sampler": Importance(), "heterogeneity": Stragglers(mode="drop")},
        "heterogeneity.mode='drop' is invalid: allowed is partial with sampler=importance (clients dropping out "
        "after the draw would bias its estimate)",
    ),
    (
        lambda: {"engine": SyncEngine(), "sampler": Importance(), "devices": Traced(PROFILES, deadline=5.0)},
        "devices.deadline=5.0 is invalid: allowed is null with sampler=importance (clients dropped after the draw "
        "would bias its estimate)",
    ),
    (
        lambda: {"sampler": PowerOfChoice(), "devices": Traced(PROFILES, availability=WINDOWS)},
        f"devices.availability='{WINDOWS}' is invalid: allowed is null with sampler=power_of_choice (it draws from "
        "every client; uniform draws among those online)",
    ),
    (
        lambda: {"engine": SyncEngine(), "aggregator": MVR(), "pipeline": Pipeline([Clip(1.0)])},
        "pipeline=['Clip'] is invalid: allowed is none with aggregator=mvr (its second update per client, from the "
        "previous model, would bypass the stages)",
    ),
    (
        lambda: {"engine": asynchronous(), "client_state": Keeping()},
        "engine='async' is invalid: allowed is sync with a client state that keeps per-client state or serves each "
        "client its own model (Keeping: the asynchronous engine starts each client from the model it pulls, keeps "
        "nothing and judges the global model only)",
    ),
    (
        lambda: {"aggregator": MVR(), "client_state": Keeping()},
        "aggregator='mvr' is invalid: allowed is an aggregator that reads one update per client with "
        "personalization=keeping (MVR's second update is trained from the previous global model, not from each "
        "client's own)",
    ),
    (
        lambda: {"engine": asynchronous(), "attack": ALIE(fraction=0.1)},
        "engine='async' is invalid: allowed is sync with attack=ALIE (its update is built from the round's other "
        "updates; an asynchronous arrival is sent alone: label_flip, random_labels, sign_flip, gaussian, scale with a "
        "scale, count_lie run there)",
    ),
    (
        lambda: {"engine": asynchronous(), "attack": LossLie(fraction=0.1, offset=1.0)},
        "engine='async' is invalid: allowed is sync with attack=LossLie (no asynchronous aggregator reads a reported "
        "loss)",
    ),
    (
        lambda: {"aggregator": TERM(tau=2.0), "attack": LossLie(fraction=0.1, offset=1.0)},
        "aggregator.tau=2.0 is invalid: allowed is null with attack=LossLie (the tilted risk is measured on the "
        "client's data: the lie would not reach it)",
    ),
    (
        lambda: {"engine": asynchronous(), "sampler": PowerOfChoice()},
        "sampler='power_of_choice' is invalid: allowed is uniform with engine=async (a client trains again when it "
        "comes back)",
    ),
    (
        lambda: {"engine": asynchronous(), "schedule": Schedule(cohort=5)},
        "schedule.cohort=5 is invalid: allowed is null with engine=async (engine.concurrency sets who trains at once)",
    ),
    (
        lambda: {"engine": asynchronous(), "schedule": Schedule(sampling="poisson", clients_per_round=0.5)},
        "schedule.sampling='poisson' is invalid: allowed is fixed with engine=async (its clients come back as they "
        "finish)",
    ),
    (
        lambda: {"engine": asynchronous(), "aggregator": FedAvg()},
        "engine='async' is invalid: allowed is sync for FedAvg, a synchronous aggregator",
    ),
    (
        lambda: {"engine": asynchronous(), "devices": Traced(PROFILES, deadline=5.0)},
        "devices.deadline=5.0 is invalid: allowed is null with engine=async (a deadline and the reports kept end a "
        "synchronous round; the buffer decides there)",
    ),
    (
        lambda: {"engine": asynchronous(), "heterogeneity": RandomSteps()},
        "heterogeneity='RandomSteps' is invalid: allowed is none with engine=async (speeds model the heterogeneity)",
    ),
    (
        lambda: {"partition": Population(num_clients=1000), "engine": asynchronous()},
        "engine.concurrency=None is invalid: allowed is an integer from 1 to 1,000 with partition=population (the "
        "clients training at once, not all of them)",
    ),
    (
        lambda: {
            "partition": Population(num_clients=1000),
            "engine": SyncEngine(),
            "schedule": Schedule(sampling="poisson", clients_per_round=1.0),
        },
        "schedule.clients_per_round=1.0 is invalid: allowed is a rate below 1 with partition=population and poisson "
        "sampling (1 draws all 1,000 clients every round)",
    ),
    (
        lambda: {"partition": Population(num_clients=1000), "engine": SyncEngine(), "schedule": Schedule()},
        "schedule.cohort=None is invalid: allowed is an integer from 1 to 1,000 with partition=population (clients "
        "a round as a count; clients_per_round=1.0 trains 1,000 clients every round)",
    ),
    (
        lambda: {"privacy": central(), "sampler": PowerOfChoice()},
        "sampler='power_of_choice' is invalid: allowed is uniform with privacy=central (the accountant's "
        "amplification assumes each client is drawn alike, whatever the data)",
    ),
    (
        lambda: {"privacy": Privacy(mechanism="local", noise_multiplier=1.0), "aggregator": FedNova("uniform")},
        "aggregator='FedNova' is invalid: allowed is fedavg with privacy=local (weights that follow the clients' "
        "losses, steps or data would change the sensitivity the noise is calibrated to)",
    ),
    (
        lambda: {"privacy": central(), "aggregator": FedAvg()},
        "aggregator.weighting='samples' is invalid: allowed is uniform with privacy=central, which privacy=central "
        "sets by itself (DP-FedAvg weighs every client alike; sample counts are private)",
    ),
    (
        lambda: {"privacy": central(), "heterogeneity": Stragglers()},
        "heterogeneity='Stragglers' is invalid: allowed is none with privacy=central (stragglers that drop out change "
        "the sampling that is accounted; the other options are not checked against the accounting yet)",
    ),
    (
        lambda: {"privacy": central(), "devices": Traced(PROFILES, reports=10)},
        "devices.reports=10 is invalid: allowed is null with privacy=central (clients dropped after the draw change "
        "the sampling that is accounted)",
    ),
    (
        lambda: {"privacy": central(), "pipeline": Pipeline([Stage(), Crossing()])},
        "pipeline.stages.1='Crossing' is invalid: allowed is a stage that acts on each update alone with "
        "privacy=central (one that adapts to the round's clients carries them into later rounds unaccounted; for "
        "adaptive clipping with its count noised and accounted, privacy.adaptive=true)",
    ),
    (
        lambda: {"privacy": central(), "pipeline": Pipeline([Stage(), Clip(1.0)])},
        "pipeline.stages.1='Clip' is invalid: allowed is no clipping stage with privacy=central (the mechanism clips "
        "each update to privacy.clip_norm itself, and its noise is calibrated to that norm: a second clip below it "
        "would waste the noise; set privacy.clip_norm, or privacy.adaptive=true)",
    ),
    (
        lambda: {"privacy": central(), "schedule": Schedule(stop_at_accuracy=0.9, stop_on="both")},
        "schedule.stop_on='both' is invalid: allowed is test with privacy=central and stop_at_accuracy (the clients' "
        "held-out accuracy is un-noised client data: stopping on it would release it)",
    ),
    (
        lambda: {"engine": asynchronous(), "client": Scaffold()},
        "client='scaffold' is invalid: allowed is sgd or moon with engine=async (its server half updates from each "
        "synchronous round's cohort, SCAFFOLD's c and FedDyn's h; their papers define no buffered version)",
    ),
    (
        lambda: {"client_state": Keeping(), "client": FedDyn()},
        "client='feddyn' is invalid: allowed is sgd with personalization=keeping (a personal method trains its "
        "clients its own way: FedRep's phases, Ditto's and APFL's personal models)",
    ),
    (
        lambda: {"aggregator": MVR(), "client": Moon()},
        "client='moon' is invalid: allowed is sgd with aggregator=mvr (its second update per client, from the "
        "previous model, would run the program twice)",
    ),
    (
        lambda: {"privacy": central(), "client": Scaffold()},
        "client='scaffold' is invalid: allowed is sgd, feddyn or moon with privacy=central (SCAFFOLD's clients "
        "upload their control variates beside their update, unclipped and un-noised: the accounted epsilon would "
        "not cover them)",
    ),
    (
        lambda: {"schedule": Schedule(stop_at_accuracy=0.9, stop_on="client"), "dataset": Dataset()},
        "schedule.stop_on='client' is invalid: allowed is test while dataset.client_test_fraction is 0 "
        "(client_accuracy needs each client's held-out samples)",
    ),
]


def applying(parts: dict) -> list[int]:
    """The rules of the table that apply to these parts (those that need a missing part are skipped)."""
    namespace = compat.Parts(**parts)
    return [
        i
        for i, rule in enumerate(compat.RULES)
        if all(parts.get(n) is not None for n in rule.needs) and rule.applies(namespace)
    ]


def test_the_table_has_one_case_per_rule():
    assert len(CASES) == len(compat.RULES)


@pytest.mark.parametrize("index", range(len(CASES)))
def test_each_rule_refuses_its_combination_alone_in_one_line(index):
    make, line = CASES[index]
    parts = make()
    assert applying(parts) == [index]
    with pytest.raises(ConfigError) as refused:
        compat.check(parts)
    assert str(refused.value) == line and "\n" not in line
    assert refused.value.key == line.split("=")[0]


def test_windows_that_lose_clients_after_the_draw_are_refused_with_privacy_as_a_deadline_is():
    # a client offline when its report would arrive is lost (fedrun.devices.Profiled.round): dropped after the draw
    parts = {"privacy": central(), "devices": Traced(PROFILES, availability=WINDOWS)}
    [index] = applying(parts)
    assert CASES[index][0]()["devices"].reports == 10  # the rule of the cap on reports, with its key named
    with pytest.raises(ConfigError) as refused:
        compat.check(parts)
    assert str(refused.value) == (
        f"devices.availability='{WINDOWS}' is invalid: allowed is null with privacy=central (clients dropped after "
        "the draw change the sampling that is accounted)"
    )


@pytest.mark.parametrize(
    "parts",
    [
        lambda: {
            "privacy": central(),
            "engine": SyncEngine(),
            "aggregator": FedAvg(weighting="uniform"),
            "sampler": Uniform(),
            "heterogeneity": EqualWork(),
            "pipeline": Pipeline([Stage()]),
            "schedule": Schedule(cohort=10, stop_at_accuracy=0.9, stop_on="test"),
            "partition": Population(num_clients=1000),
            "dataset": Dataset(client_test_fraction=0.2),
            "client_state": Keeping(),  # a personal part runs on the synchronous engine
            "attack": SignFlip(fraction=0.1),  # so does an attack, private or not
            "client": LocalSGD(),
            "devices": Traced(PROFILES),  # device profiles time a synchronous round
        },
        lambda: {
            "privacy": Privacy(),
            "engine": asynchronous(concurrency=10),
            "aggregator": FedBuff(),
            "sampler": Uniform(),
            "heterogeneity": EqualWork(),
            "pipeline": Pipeline([Clip(1.0, adaptive=True)]),
            "schedule": Schedule(stop_at_accuracy=0.9, stop_on="both"),
            "partition": Population(num_clients=1000),
            "dataset": Dataset(client_test_fraction=0.2),
            "client_state": ClientState(),  # the default keeps nothing
            "attack": Attack(),  # attack=none
            "client": LocalSGD(),
            "devices": Traced(PROFILES, availability=WINDOWS),  # devices time the jobs, windows delay them
        },
    ],
    ids=["sync-private", "async"],
)
def test_parts_that_can_run_together_pass_every_rule(parts):
    parts = parts()
    assert all(all(n in parts for n in rule.needs) for rule in compat.RULES)  # every rule was looked at
    compat.check(parts)


def test_a_subclass_of_fedavg_follows_the_importance_sampler_and_is_accepted():
    class MyAvg(FedAvg):
        """A FedAvg of one's own: it inherits FedAvg's capabilities, not a refusal of its name."""

    compat.check({"engine": SyncEngine(), "sampler": Importance(), "aggregator": MyAvg()})
    view = RoundView(np.arange(2), np.array([10, 30]), sampled_weights=np.array([0.5, 1.5]))
    update, alpha, _ = MyAvg().aggregate(torch.zeros(2), torch.eye(2), view)
    assert alpha.tolist() == [0.5, 1.5] and update.tolist() == [0.5, 1.5]


def test_a_new_rule_is_one_row_over_a_capability_a_test_only_stage_declares(monkeypatch):
    class Sparsify(Stage):
        """A test-only stage whose messages need the dense update (a capability no fedrun part has)."""

        needs_dense_updates = True

    rule = compat.Rule(
        ("pipeline", "aggregator"),
        lambda p: (
            any(getattr(s, "needs_dense_updates", False) for s in p.pipeline.stages)
            and p.aggregator.reads_second_update
        ),
        "pipeline",
        lambda p: [type(s).__name__ for s in p.pipeline.stages],
        "stages that take any update with a second update per client",
    )
    monkeypatch.setattr(compat, "RULES", [*compat.RULES, rule])
    compat.check({"pipeline": Pipeline([Sparsify()]), "aggregator": FedAvg()})
    with pytest.raises(ConfigError, match=r"^pipeline=\['Sparsify'\] is invalid: allowed is stages that take any"):
        compat.check({"pipeline": Pipeline([Sparsify()]), "aggregator": MVR()})


def test_no_rule_tests_a_class():
    tree = ast.parse(inspect.getsource(compat))

    def called(node):
        return {n.func.id for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}

    assert not {"isinstance", "issubclass"} & called(tree)
    # type() only names a part's class in a message (``name``), never in a condition.
    outside = [n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name == "name")]
    assert all("type" not in called(n) for n in outside)


def test_the_asynchronous_engine_takes_an_arrivals_own_attack_and_refuses_a_round_built_one_in_one_line():
    from fedrun import compat
    from fedrun.errors import ConfigError

    engine = type("Engine", (), {"asynchronous": True, "concurrency": None})()
    for attack in (attacks.SignFlip(fraction=0.1), attacks.LabelFlip(fraction=0.1), attacks.CountLie(fraction=0.1)):
        compat.check({"engine": engine, "attack": attack})  # an attacker's update arrives like any other
    with pytest.raises(ConfigError, match=r"^engine='async' is invalid: allowed is sync with attack=ALIE \(its update"):
        compat.check({"engine": engine, "attack": attacks.ALIE(fraction=0.1)})
    with pytest.raises(
        ConfigError, match=r"^engine='async' is invalid: allowed is sync with attack=Scale \(its update"
    ):
        compat.check({"engine": engine, "attack": attacks.Scale(fraction=0.1)})  # scale=null: by the cohort's size
    with pytest.raises(ConfigError, match=r"^engine='async' is invalid: .*no asynchronous aggregator reads a reported"):
        compat.check({"engine": engine, "attack": attacks.LossLie(fraction=0.1, offset=1.0)})


def test_a_hybrid_phase_that_measures_the_tilted_risk_is_named_by_its_key_beside_a_loss_lie():
    hybrid = Hybrid([{"aggregator": FedAvg(), "until_round": 3}, {"aggregator": TERM(t=1.0, tau=-1.5)}])
    with pytest.raises(ConfigError) as refused:
        compat.check({"aggregator": hybrid, "attack": LossLie(fraction=0.1, offset=1.0)})
    assert refused.value.key == "aggregator.phases[1].aggregator.tau" and refused.value.value == -1.5
    compat.check({"aggregator": Hybrid([{"aggregator": TERM(t=1.0)}]), "attack": LossLie(fraction=0.1, offset=1.0)})


def test_a_nested_hybrids_measuring_phase_and_an_aggregator_without_tau_are_refused_not_crashed():
    inner = Hybrid([{"aggregator": FedAvg(), "until_round": 2}, {"aggregator": TERM(tau=0.5)}])
    outer = Hybrid([{"aggregator": FedAvg(), "until_round": 1}, {"aggregator": inner}])
    with pytest.raises(ConfigError) as refused:
        compat.check({"aggregator": outer, "attack": LossLie(fraction=0.1, offset=1.0)})
    assert refused.value.key == "aggregator.phases[1].aggregator.phases[1].aggregator.tau"

    class Measuring(FedAvg):  # a user's aggregator that measures losses and names no tau
        measures_losses = True

    with pytest.raises(ConfigError) as refused:
        compat.check({"aggregator": Measuring(), "attack": LossLie(fraction=0.1, offset=1.0)})
    assert refused.value.key == "aggregator" and refused.value.value == "Measuring"
