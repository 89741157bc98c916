"""The asynchronous engine and buffered aggregators: hand-traced events and hand-computed weights."""

import functools
import math

import numpy as np
import pytest
import torch
from numpy.testing import assert_allclose

from fedrun.aggregators import BufferReport, FedAsync, FedAvg, FedBuff, FedStaleWeight
from fedrun.async_engine import AsyncEngine, SpeedGroup
from fedrun.datasets import FederatedData
from fedrun.engine import Schedule, run
from fedrun.errors import ConfigError
from fedrun.models import Logistic
from fedrun.parts import Parts
from fedrun.seeding import torch_seed
from fedrun.trainer import Trainer

g = torch.Generator().manual_seed(0)
DATA = FederatedData(
    torch.randn(30, 4, generator=g),
    torch.randint(0, 3, (30,), generator=g),
    torch.randn(12, 4, generator=g),
    torch.randint(0, 3, (12,), generator=g),
    num_classes=3,
)
CLIENTS = [np.arange(0, 10), np.arange(10, 20), np.arange(20, 30)]
SGD = functools.partial(torch.optim.SGD, lr=0.1)


def model():
    torch.manual_seed(torch_seed(0, "init"))
    return Logistic((4,), 3)


def constant(*values):
    return [{"name": f"c{i}", "clients": 1, "distribution": "constant", "value": v} for i, v in enumerate(values)]


class Recording(FedBuff):
    """FedBuff that records every buffer it aggregates."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []

    def aggregate(self, global_params, deltas, buffer):
        self.seen.append((buffer.version, list(buffer.clients), list(buffer.staleness)))
        return super().aggregate(global_params, deltas, buffer)


def test_hand_traced_events_for_three_constant_clients():
    # Speeds 1, 2, 3 and b = 2. Arrivals: t=1 c0 | t=2 c0 c1 | t=3 c0 c2 | t=4 c0 c1 | t=5 c0 | t=6 c0 c1 c2.
    # Arrivals at one instant are taken in id order; everyone restarts with the newest model of that instant.
    agg = Recording(buffer_size=2)
    rows = []
    AsyncEngine(constant(1.0, 2.0, 3.0))(
        model(),
        DATA,
        CLIENTS,
        Parts(agg),
        SGD,
        Schedule(rounds=5, local_steps=1, batch_size=5),
        torch.device("cpu"),
        0,
        on_round=lambda row, alpha: rows.append((row, alpha)),
    )
    assert agg.seen == [
        (0, [0, 0], [0, 0]),  # t=2: c0 (its 1st and 2nd update) -> version 1; c1 (pulled v0) waits, staleness 1
        (1, [1, 0], [1, 0]),  # t=3: c1 + c0 -> v2; c2 (pulled v0) waits with staleness 2
        (2, [2, 0], [2, 0]),  # t=4: c2 + c0 -> v3; c1 (pulled v1 at t=2) waits with staleness 2
        (3, [1, 0], [2, 0]),  # t=5
        (4, [0, 1], [0, 1]),  # t=6: c0 then c1 (pulled v3 at t=4) -> v5; c2 (pulled v2 at t=3) is left in the buffer
    ]
    assert [r["virtual_time"] for r, _ in rows] == [2.0, 3.0, 4.0, 5.0, 6.0]
    assert [r["staleness_max"] for r, _ in rows] == [0, 1, 2, 2, 1]
    assert_allclose(rows[0][1]["alpha"], [1.0, 0, 0])  # client 0 twice: its alphas add up


def test_fedbuff_with_b_equal_to_clients_and_equal_speeds_is_synchronous_fedavg():
    schedule = Schedule(rounds=4, local_steps=3, batch_size=4)
    sync_rows, async_rows = [], []
    sync = run(
        model(),
        DATA,
        CLIENTS,
        Parts(FedAvg(weighting="uniform")),
        SGD,
        schedule,
        torch.device("cpu"),
        0,
        on_round=lambda row, alpha: sync_rows.append(row),
    )
    buffered = AsyncEngine(constant(1.0, 1.0, 1.0))(
        model(),
        DATA,
        CLIENTS,
        Parts(FedBuff(buffer_size=3)),
        SGD,
        schedule,
        torch.device("cpu"),
        0,
        on_round=lambda row, alpha: async_rows.append(row),
    )
    torch.testing.assert_close(buffered.params, sync.params)
    assert [r["test_accuracy"] for r in async_rows] == [r["test_accuracy"] for r in sync_rows]
    assert all(r["staleness_max"] == 0 for r in async_rows)


def buffer(clients, staleness):
    return BufferReport(np.array(clients), np.ones(len(clients)), np.array(staleness, float), 0, [])


def test_fedstaleweight_weights_on_a_hand_made_buffer():
    for form, expected in (("eq8", [4, 10, 1]), ("algorithm", [2, 4, 1])):
        agg = FedStaleWeight(buffer_size=3, form=form)
        for client, tau in ((0, 0), (0, 2), (1, 3), (2, 0)):
            agg.observe(client, tau)
        # E[tau] = [1, 3, 0]; eq8: E*3 + 1 = [4, 10, 1]; algorithm: E + 1 = [2, 4, 1]
        assert_allclose(agg.weights(buffer([0, 1, 2], [2, 3, 0])), np.array(expected) / sum(expected))


def test_fedstaleweight_zero_staleness_buffer_keeps_training():
    agg = FedStaleWeight(buffer_size=3)
    for c in range(3):
        agg.observe(c, 0)
    alpha = agg.weights(buffer([0, 1, 2], [0, 0, 0]))
    assert_allclose(alpha, [1 / 3] * 3)
    new, _, _ = agg.aggregate(torch.zeros(2), torch.ones(3, 2), buffer([0, 1, 2], [0, 0, 0]))
    assert_allclose(new.numpy(), [1.0, 1.0])  # the model moves


def test_fedstaleweight_window_drops_the_oldest_value():
    agg = FedStaleWeight(window=2)
    for tau in (5, 1, 1):
        agg.observe(7, tau)
    assert agg.expected_staleness(7) == 1.0  # the last two of 5, 1, 1


def test_fedstaleweight_excluding_the_current_buffer_keeps_a_full_window():
    # window 1, buffer 2: client 0 had tau 4 in an earlier buffer, then arrives twice (tau 0, 0) in this one.
    # Excluding the current buffer, E = 4 (its last earlier value), not 0: weights (4 + 1, 4 + 1) / 10 over
    # its two updates, and the window of earlier values survives the two new arrivals.
    agg = FedStaleWeight(buffer_size=2, form="algorithm", window=1, include_current=False)
    agg.observe(0, 4)
    agg.observe(1, 0)
    agg.weights(buffer([0, 1], [4, 0]))
    agg.observe(0, 0)
    agg.observe(0, 0)
    assert agg.expected_staleness(0) == 4.0
    included = FedStaleWeight(buffer_size=2, form="algorithm", window=1)
    for tau in (4, 0, 0):
        included.observe(0, tau)
    assert included.expected_staleness(0) == 0.0  # the window holds the newest value, 0


def test_fedbuff_staleness_scaling_is_not_renormalised_and_fedasync_mixing_by_hand():
    # FedBuff Algorithm 1: alpha_k = s(tau_k) / K. tau = (0, 3): s = (1/sqrt(1), 1/sqrt(4)) = (1, 0.5), / K=2.
    w = FedBuff(buffer_size=2, staleness_scaling=True).weights(buffer([0, 1], [0, 3]))
    assert_allclose(w, [0.5, 0.25])
    # Equal staleness 4: every weight 1 / (K sqrt(5)), summing to 1/sqrt(5) = 0.4472, not 1.
    w = FedBuff(buffer_size=3, staleness_scaling=True).weights(buffer([0, 1, 2], [4, 4, 4]))
    assert_allclose(w, [1 / (3 * math.sqrt(5))] * 3)
    update, _, _ = FedBuff(buffer_size=3, staleness_scaling=True).aggregate(
        torch.zeros(1), torch.ones(3, 1), buffer([0, 1, 2], [4, 4, 4])
    )
    assert_allclose(update.numpy(), [1 / math.sqrt(5)], rtol=1e-6)  # the stale buffer moves the model less
    assert_allclose(FedBuff(buffer_size=2).weights(buffer([0, 1], [0, 3])), [0.5, 0.5])  # s = 1: plain 1/K
    # w = 0, the update started from 2 and moved by 2: w_local = 4; tau = 3 -> s = 4^-0.5 = 0.5, a = 0.6 * 0.5
    report = BufferReport(np.array([0]), np.ones(1), np.array([3.0]), 5, [torch.tensor([2.0])])
    new, _, _ = FedAsync(mixing=0.6, exponent=0.5).aggregate(torch.zeros(1), torch.tensor([[2.0]]), report)
    assert_allclose(new.numpy(), [0.3 * 4.0])
    assert FedAsync(staleness_function="hinge", hinge_a=10, hinge_b=4).s(6) == pytest.approx(1 / 21)


def test_fedstaleweight_include_current_or_only_earlier_buffers():
    # Client 0: tau 2 in an earlier buffer, then tau 6 in this one; client 1: tau 0 only in this one.
    weigh = {}
    for include in (True, False):
        agg = FedStaleWeight(buffer_size=2, form="algorithm", include_current=include)
        agg.observe(0, 2)
        agg.weights(buffer([0, 5], [2, 0]))  # the earlier aggregation (client 5 stands in)
        agg.observe(0, 6)
        agg.observe(1, 0)
        weigh[include] = agg.weights(buffer([0, 1], [6, 0]))
    # included: E = [(2 + 6)/2, 0] = [4, 0] -> [5, 1] / 6; earlier only: E = [2, 0] -> [3, 1] / 4
    assert_allclose(weigh[True], [5 / 6, 1 / 6])
    assert_allclose(weigh[False], [3 / 4, 1 / 4])


def test_same_seed_same_events_and_metrics():
    speeds = [
        {"name": "fast", "clients": 2, "distribution": "uniform", "low": 1.0, "high": 2.0},
        {"name": "slow", "clients": None, "distribution": "lognormal", "mean": 1.0, "sigma": 0.5},
    ]

    def once(seed):
        rows = []
        AsyncEngine(speeds)(
            model(),
            DATA,
            CLIENTS,
            Parts(FedStaleWeight(buffer_size=2)),
            SGD,
            Schedule(rounds=6, local_steps=1, batch_size=5),
            torch.device("cpu"),
            seed,
            on_round=lambda row, alpha: rows.append({k: v for k, v in row.items() if not k.endswith("_wall_s")}),
        )
        return rows

    assert once(0) == once(0)
    assert once(0) != once(1)


def test_offline_intervals_delay_start_and_delivery():
    group = SpeedGroup("g", None, "constant", offline=[[2.0, 5.0]], value=1.0)
    assert group.online_at(1.5) == 1.5 and group.online_at(2.0) == 5.0 and group.online_at(4.9) == 5.0


def test_speed_groups_must_cover_the_clients():
    with pytest.raises(ConfigError, match="engine.speeds"):
        AsyncEngine(constant(1.0, 1.0)).assign(3)
    with pytest.raises(ConfigError, match="distribution"):
        SpeedGroup("g", 1, "gamma", value=1.0)
    with pytest.raises(ConfigError, match="engine"):
        AsyncEngine(constant(1.0, 1.0, 1.0))(
            model(), DATA, CLIENTS, Parts(FedAvg()), SGD, Schedule(rounds=1), torch.device("cpu"), 0
        )


def test_concurrency_keeps_only_that_many_clients_training():
    # Five clients, all of constant speed 1, concurrency 2, b = 2: at every whole time t exactly the two
    # training clients arrive, fill the buffer and start two freshly drawn clients on the new model. So
    # aggregation t happens at virtual time t with staleness 0, and each buffer holds two distinct clients.
    five = [np.arange(k * 6, (k + 1) * 6) for k in range(5)]
    agg, rows = Recording(buffer_size=2), []
    speeds = [{"name": "all", "clients": None, "distribution": "constant", "value": 1.0}]
    AsyncEngine(speeds, concurrency=2)(
        model(),
        DATA,
        five,
        Parts(agg),
        SGD,
        Schedule(rounds=6, local_steps=1, batch_size=3),
        torch.device("cpu"),
        0,
        on_round=lambda row, alpha: rows.append(row),
    )
    assert [r["virtual_time"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["staleness_max"] == 0 for r in rows)
    assert all(len(set(clients)) == 2 for _, clients, _ in agg.seen)
    assert len({c for _, clients, _ in agg.seen for c in clients}) > 2  # the draw rotates through the population
    # Without the limit all five train at once: five arrivals at t = 1 make two aggregations at that instant.
    unlimited = []
    AsyncEngine(speeds)(
        model(),
        DATA,
        five,
        Parts(Recording(buffer_size=2)),
        SGD,
        Schedule(rounds=2, local_steps=1, batch_size=3),
        torch.device("cpu"),
        0,
        on_round=lambda row, alpha: unlimited.append(row),
    )
    assert [r["virtual_time"] for r in unlimited] == [1, 1]


def test_concurrency_draws_repeat_with_the_seed_and_cover_every_client_when_large():
    five = [np.arange(k * 6, (k + 1) * 6) for k in range(5)]
    speeds = [{"name": "all", "clients": None, "distribution": "uniform", "low": 1.0, "high": 2.0}]

    def once(concurrency, seed=0):
        agg = Recording(buffer_size=2)
        AsyncEngine(speeds, concurrency=concurrency)(
            model(),
            DATA,
            five,
            Parts(agg),
            SGD,
            Schedule(rounds=5, local_steps=1, batch_size=3),
            torch.device("cpu"),
            seed,
        )
        return agg.seen

    assert once(3) == once(3) and once(3) != once(3, seed=1)
    assert once(5) == once(None)  # a limit at the population size changes nothing
    with pytest.raises(ConfigError, match="concurrency"):
        AsyncEngine(speeds, concurrency=0)


def test_fairness_in_one_pass_equals_each_client_evaluated_alone():
    from fedrun.clients import evaluate
    from fedrun.models import MLP, flat_parameters

    torch.manual_seed(0)
    model = MLP((1, 2, 3), 3, hidden=(4,))
    x, y = torch.randn(30, 1, 2, 3), torch.randint(0, 3, (30,))
    clients = [
        np.arange(0, 10),
        np.arange(5, 15),
        np.array([29, 3, 3]),
        np.arange(15, 30),
    ]  # overlapping, repeated samples
    engine = AsyncEngine(
        [
            {"name": "fast", "clients": 2, "distribution": "constant", "value": 1.0},
            {"name": "slow", "clients": None, "distribution": "constant", "value": 2.0},
        ]
    )
    w = flat_parameters(model)
    applied = np.array([0.5, 0.25, 0.25, 0.0])
    summary, tables = engine._fairness(model, w, x, y, clients, None, engine.assign(4), applied)
    alone = np.array([evaluate(model, w, x[torch.as_tensor(c)], y[torch.as_tensor(c)])[0] for c in clients])
    np.testing.assert_allclose(tables["fairness.csv"]["accuracy"], alone, rtol=1e-6)  # evaluate() means in float32
    assert summary["weight_share/fast"] == 0.75 and summary["client_accuracy_std"] == pytest.approx(
        alone.std(), rel=1e-6
    )


DATA64 = FederatedData(DATA.x_train.double(), DATA.y_train, DATA.x_test.double(), DATA.y_test, num_classes=3)


class OneAtATime(Trainer):
    """A trainer that trains the clients of a call one by one, each alone: the plain computation."""

    def __init__(self, inner, calls):
        self.inner, self.calls = inner, calls

    def __call__(self, params, parts, client_ids, lr, work, seed, round_, stream="batches"):
        from fedrun.clients import client_rows

        self.calls.append((client_ids.tolist(), lr))
        from fedrun.cohort import ClientLosses, CohortUpdate

        alone = [
            self.inner(client_rows(params, i, i + 1), parts[i : i + 1], client_ids[i : i + 1], lr, work, seed,
                       client_rows(round_, i, i + 1), stream)
            for i in range(len(parts))
        ]  # fmt: skip
        return CohortUpdate(
            torch.cat([a.deltas for a in alone]),
            ClientLosses.concat([a.local_losses for a in alone]),
            np.concatenate([a.steps for a in alone]),
            np.concatenate([a.coefficient_norms for a in alone]),
        )

    def close(self):
        self.inner.close()


def async_final(device, lr_decay):
    # Speeds 1, 2, 3 and b = 2 (the hand-traced case above): at t = 2, 3, 4 and 6 several clients arrive, each
    # from the version it pulled.
    torch.manual_seed(torch_seed(0, "init"))
    rows = []
    result = AsyncEngine(constant(1.0, 2.0, 3.0))(
        Logistic((4,), 3).double(),
        DATA64,
        CLIENTS,
        Parts(FedBuff(buffer_size=2)),
        SGD,
        Schedule(rounds=6, local_steps=2, batch_size=4, lr_decay=lr_decay),
        device,
        0,
        on_round=lambda row, alpha: rows.append(row["lr"]),
    )
    return result.params, rows


@pytest.mark.parametrize("backend", ["loop", "processes", "vmap"])
def test_the_clients_of_one_instant_train_together_equal_to_each_alone_on_every_backend(backend, monkeypatch):
    from fedrun.backends import Device

    together, _ = async_final(Device(kind="cpu", memory_format="contiguous", backend=backend), 1.0)
    loop_trainer, calls = Device.trainer, []
    monkeypatch.setattr(Device, "trainer", lambda self, *a, **k: OneAtATime(loop_trainer(self, *a, **k), calls))
    alone, _ = async_final(Device(kind="cpu", memory_format="contiguous", backend="loop"), 1.0)
    # One call per instant (a constant rate): t = 1 c0 | t = 2 c0 c1 | t = 3 c0 c2 | t = 4 c0 c1 | ...
    assert [ids for ids, _ in calls[:4]] == [[0], [0, 1], [0, 2], [0, 1]]
    tolerance = 0 if backend == "loop" else 1e-10
    torch.testing.assert_close(together, alone, rtol=tolerance, atol=tolerance)


def test_each_arrival_trains_at_the_rate_of_the_aggregation_it_joins(monkeypatch):
    from fedrun.backends import Device

    loop_trainer, calls = Device.trainer, []
    monkeypatch.setattr(Device, "trainer", lambda self, *a, **k: OneAtATime(loop_trainer(self, *a, **k), calls))
    _, rates = async_final(Device(kind="cpu", memory_format="contiguous", backend="loop"), 0.9)
    # lr 0.1 * 0.9^(v - 1) for aggregation v. t = 1: c0 waits for v1. t = 2: c0 fills the buffer (v1, 0.1), c1
    # starts the next (v2, 0.09). t = 3: c0 joins c1 (v2, 0.09), c2 starts v3 (0.081). t = 4: c0 joins c2 (v3),
    # c1 starts v4 (0.0729).
    expected = [([0], 0.1), ([0], 0.1), ([1], 0.09), ([0], 0.09), ([2], 0.081), ([0], 0.081), ([1], 0.0729)]
    assert [ids for ids, _ in calls[:7]] == [ids for ids, _ in expected]
    assert_allclose([lr for _, lr in calls[:7]], [lr for _, lr in expected], rtol=1e-12)
    assert_allclose(rates, 0.1 * 0.9 ** np.arange(6), rtol=1e-12)  # each aggregation logs its own rate


@pytest.mark.parametrize("backend", ["loop", "processes", "vmap"])
def test_the_fstar_estimate_trains_its_clients_together_equal_to_each_alone_on_every_backend(backend):
    from fedrun.backends import Device
    from fedrun.clients import FStarEstimate, cohort_losses
    from fedrun.cohort import LocalWork
    from fedrun.models import flat_parameters
    from fedrun.programs import train_cohort

    torch.manual_seed(0)
    net = Logistic((4,), 3).double()
    w0 = flat_parameters(net)
    x, y = DATA64.x_train, DATA64.y_train
    # The plain computation: each client alone, epoch by epoch from w_0, its smallest epoch-end loss.
    expected = []
    for client, part in enumerate(CLIENTS):
        w, best = w0, (math.inf, math.inf)
        for epoch in (1, 2, 3):
            w = (
                w
                + train_cohort(
                    net, w, x, y, [part], np.array([client]), SGD, 0.1, LocalWork(4, local_epochs=1), 7, epoch, "fstar"
                ).deltas[0]
            )
            losses = cohort_losses(net, w, x, y, [part], 4)
            best = (min(best[0], losses.mean[0]), min(best[1], losses.authors[0]))
        expected.append(best)
    trainer = Device(kind="cpu", memory_format="contiguous", backend=backend).trainer(net, x, y, SGD, 10**9)
    try:
        estimate = FStarEstimate(trainer, w0, CLIENTS, SGD, 4, 7)
        got = estimate(np.array([2, 0, 1]), 3)
    finally:
        trainer.close()
    tolerance = 0 if backend == "loop" else 1e-10
    assert_allclose(got.mean, [expected[c][0] for c in (2, 0, 1)], rtol=tolerance, atol=tolerance)
    assert_allclose(got.authors, [expected[c][1] for c in (2, 0, 1)], rtol=tolerance, atol=tolerance)
    assert set(estimate.cache) == {(0, 3), (1, 3), (2, 3)}


# --- Attacks on the asynchronous engine ---------------------------------------------------------------------------


def attacked(engine_run, attack, rows):
    from fedrun.attacks import Attack

    schedule = Schedule(rounds=4, local_steps=3, batch_size=4)
    common = (model(), DATA, CLIENTS)
    tail = (SGD, schedule, torch.device("cpu"), 0)
    if engine_run == "sync":
        parts = Parts(FedAvg(weighting="uniform"), attack=attack or Attack())
        return run(*common, parts, *tail, on_round=lambda row, alpha: rows.append(row))
    parts = Parts(FedBuff(buffer_size=3), attack=attack or Attack())
    return AsyncEngine(constant(1.0, 1.0, 1.0))(*common, parts, *tail, on_round=lambda row, alpha: rows.append(row))


@pytest.mark.parametrize("name", ["label_flip", "sign_flip", "gaussian", "scale"])
def test_an_attack_on_fedbuff_with_b_equal_to_clients_is_the_attack_on_synchronous_fedavg(name):
    from fedrun.attacks import Gaussian, LabelFlip, Scale, SignFlip

    make = {
        "label_flip": lambda: LabelFlip(count=1, num_classes=3),
        "sign_flip": lambda: SignFlip(count=1),
        "gaussian": lambda: Gaussian(count=1, sigma=0.1),
        "scale": lambda: Scale(count=1, scale=3.0),
    }[name]
    sync_rows, async_rows, clean_rows = [], [], []
    sync, buffered = attacked("sync", make(), sync_rows), attacked("async", make(), async_rows)
    clean = attacked("async", None, clean_rows)
    torch.testing.assert_close(buffered.params, sync.params)
    assert not torch.equal(buffered.params, clean.params)  # the attack changed the run
    assert [r["attack/weight_share"] for r in async_rows] == pytest.approx([1 / 3] * 4)  # FedBuff's 1/b each
    assert [r["attack/cohort_share"] for r in async_rows] == pytest.approx([1 / 3] * 4)
    assert list(buffered.tables["malicious.csv"]["client"]) == list(sync.tables["malicious.csv"]["client"])


def test_an_async_attack_with_nobody_malicious_is_the_run_without_attack():
    from fedrun.attacks import LabelFlip, SignFlip

    clean = attacked("async", None, [])
    for attack in (SignFlip(count=0), LabelFlip(count=0, num_classes=3)):
        assert torch.equal(attacked("async", attack, []).params, clean.params)


def test_a_robust_rule_over_a_buffer_of_every_client_is_the_rule_on_synchronous_rounds():
    from fedrun.aggregators import BufferedRobust, Median
    from fedrun.attacks import SignFlip

    schedule = Schedule(rounds=4, local_steps=3, batch_size=4)
    tail = (SGD, schedule, torch.device("cpu"), 0)
    sync_rows, async_rows = [], []
    sync = run(
        model(), DATA, CLIENTS, Parts(Median(f=1), attack=SignFlip(count=1)), *tail,
        on_round=lambda row, alpha: sync_rows.append(row),
    )  # fmt: skip
    buffered = AsyncEngine(constant(1.0, 1.0, 1.0))(
        model(), DATA, CLIENTS, Parts(BufferedRobust(Median(f=1), buffer_size=3), attack=SignFlip(count=1)), *tail,
        on_round=lambda row, alpha: async_rows.append(row),
    )  # fmt: skip
    torch.testing.assert_close(buffered.params, sync.params)
    for key in ("robust/discarded", "attack/weight_share"):
        assert [r[key] for r in async_rows] == pytest.approx([r[key] for r in sync_rows])


def test_a_buffer_too_small_for_the_rules_f_is_refused_before_the_first_event():
    from fedrun.aggregators import BufferedRobust, Krum
    from fedrun.state import Context

    with pytest.raises(ConfigError, match=r"^aggregator\.buffer_size=3 is invalid: allowed is a buffer the rule"):
        BufferedRobust(Krum(f=1), buffer_size=3).bind(Context(Schedule(), np.ones(3, dtype=int), 0, "uniform"))
    BufferedRobust(Krum(f=1), buffer_size=5).bind(Context(Schedule(), np.ones(3, dtype=int), 0, "uniform"))  # 5 > 4


def test_devices_time_the_asynchronous_jobs_as_speed_groups_of_the_same_times_do(tmp_path):
    from fedrun.devices import Traced

    # Logistic regression: 15 float32 parameters, 6e-5 MB each way; at 1.2e-4 MB/s that is 0.5 s down and 0.5 s up.
    # One step of 5 samples: 5 passes at 0.2, 0.4, 0.6 s -> jobs of 2, 3 and 4 s, as constant speed groups of 2, 3, 4.
    (tmp_path / "p.csv").write_text(
        "client,speed,up,down\n0,0.2,1.2e-4,1.2e-4\n1,0.4,1.2e-4,1.2e-4\n2,0.6,1.2e-4,1.2e-4\n"
    )
    outcome = {}
    for name, devices in (("groups", None), ("devices", Traced(str(tmp_path / "p.csv")))):
        agg, rows = Recording(buffer_size=2), []
        AsyncEngine(constant(2.0, 3.0, 4.0) if devices is None else constant(9.0, 9.0, 9.0))(  # ignored with devices
            model(),
            DATA,
            CLIENTS,
            Parts(agg, devices=devices),
            SGD,
            Schedule(rounds=5, local_steps=1, batch_size=5),
            torch.device("cpu"),
            0,
            on_round=lambda row, alpha: rows.append(row),
        )
        outcome[name] = agg.seen, [r["virtual_time"] for r in rows], [r["test_accuracy"] for r in rows]
    assert outcome["devices"][0] == outcome["groups"][0]  # the same buffers, in the same order
    assert_allclose(outcome["devices"][1], outcome["groups"][1], rtol=1e-12)
    assert outcome["devices"][2] == outcome["groups"][2]
    # Windows delay a job's start: client 1 offline until t = 10 starts its first job then.
    (tmp_path / "w.csv").write_text("client,start,end\n1,10,100\n")
    windowed = Traced(str(tmp_path / "p.csv"), availability=str(tmp_path / "w.csv"))
    windowed.bind(type("C", (), {"sizes": np.ones(3)})())
    assert windowed.arrival(1, 0.0, 5, 6e-5, 6e-5) == pytest.approx(13.0)
    assert (
        windowed.arrival(1, 50.0, 5, 6e-5, 6e-5) == pytest.approx(53.0)
        and windowed.arrival(0, 0.0, 5, 6e-5, 6e-5) == 2.0
    )
