"""Personalised FL (fedrun/personal.py): each method against the case that pins it, the per-client statistics by
hand, and the personal store's memory budget, spill and checkpoint."""

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn.functional import cross_entropy

from fedrun.aggregators import FedAvg
from fedrun.checkpoint import Checkpoint
from fedrun.clients import apfl_step
from fedrun.engine import run
from fedrun.errors import ConfigError
from fedrun.models import MLP, flat_parameters, load_flat
from fedrun.parts import ClientState, Parts, layout
from fedrun.personal import APFL, Ditto, FedPer, FedRep, FineTune, Local, PersonalStore, statistics
from fedrun.rounds import Schedule
from fedrun.seeding import torch_generator, torch_seed
from fedrun.state import Context
from unit.test_parts import DATA, X, Y

# test_parts.py's three clients of 50 samples whose labels are permuted differently: a shared body, a head each.
CLIENTS = [np.arange(50 * c, 50 * c + 34) for c in range(3)]  # trains on 34
VALS = [np.arange(50 * c + 34, 50 * c + 40) for c in range(3)]  # 6 for validation
TESTS = [np.arange(50 * c + 40, 50 * (c + 1)) for c in range(3)]  # its own 10 held out (indices into train)
LR = 0.3
NAMES = ["1.weight", "1.bias", "3.weight", "3.bias"]  # the MLP's parameters


def model():
    torch.manual_seed(torch_seed(0, "init"))
    return MLP((4,), 3, hidden=(8,)).double()


def train(
    client_state=None,
    rounds=4,
    checkpoint=None,
    lr=LR,
    clients=CLIENTS,
    tests=TESTS,
    vals=VALS,
    aggregator=None,
    **schedule,
):
    rows, per_client = [], []
    result = run(
        model(),
        DATA,
        clients,
        Parts(aggregator or FedAvg(), client_state=client_state),
        functools.partial(torch.optim.SGD, lr=lr),
        Schedule(rounds=rounds, **({"local_steps": 2, "batch_size": 10} | schedule)),
        torch.device("cpu"),
        0,
        on_round=lambda row, series: (rows.append(row), per_client.append(series)),
        client_tests=tests,
        checkpoint=checkpoint,
        client_vals=vals,
    )
    return result, rows, per_client


def strip(rows):
    return [{k: v for k, v in r.items() if not k.endswith("wall_s")} for r in rows]


def personal(rows, split="accuracy"):
    return [[r[f"personal/{split}_{s}"] for s in ("mean", "weighted", "p10", "min")] for r in rows]


def test_statistics_by_hand():
    # Four clients with held-out samples, one without (left out of every figure).
    accuracy, counts = np.array([1.0, 0.5, np.nan, 0.0, 0.75]), np.array([2, 4, 0, 1, 4])
    got = statistics(accuracy, counts)
    assert got["mean"] == pytest.approx((1 + 0.5 + 0 + 0.75) / 4)  # 0.5625
    assert got["weighted"] == pytest.approx((2 * 1 + 4 * 0.5 + 0 + 4 * 0.75) / 11)  # 7 / 11: correct / total
    # type 7: sorted (0, 0.5, 0.75, 1), position 0.1 * (4 - 1) = 0.3 -> 0 + 0.3 * (0.5 - 0)
    assert got["p10"] == pytest.approx(0.15)
    assert got["min"] == 0.0


def test_the_global_model_is_judged_on_every_clients_split_without_personalisation():
    result, rows, series = train()
    w = result.params
    load_flat(probe := model(), w)
    by_hand = [float((probe(X[t]).argmax(1) == Y[t]).double().mean()) for t in TESTS]
    assert series[-1]["personal_accuracy"].tolist() == pytest.approx(by_hand)
    assert rows[-1]["personal/accuracy_min"] == pytest.approx(min(by_hand))
    assert not np.isnan(rows[-1]["personal/val_accuracy_mean"])


def test_fedper_with_no_personal_parameters_equals_fedavg_exactly():
    fedavg, fedavg_rows, _ = train()
    fedper, fedper_rows, _ = train(FedPer(personal=[]))
    assert torch.equal(fedper.params, fedavg.params)
    assert strip(fedper_rows) == strip(fedavg_rows)


def test_fedper_keeps_the_head_on_the_client_and_never_sends_it():
    fedper = FedPer()  # default: the last layer
    result, rows, _ = train(fedper)
    fedavg_rows = train()[1]
    assert fedper.names == NAMES[-2:]
    head = fedper.mask
    assert torch.equal(result.params[head], flat_parameters(model())[head])  # the server never saw a head update
    assert not torch.equal(result.params[~head], flat_parameters(model())[~head])
    assert len(fedper.store) == 3
    # labels permuted per client: a head each serves each client; the global model's one head cannot
    assert np.mean(personal(rows[-2:])) > np.mean(personal(fedavg_rows[-2:])) + 0.2


def test_a_client_exchanges_only_its_shared_coordinates():
    # The MLP has 67 float64 coordinates: the body 1.* (32 + 8), the head 3.* (24 + 3). FedPer's three clients get
    # and send the body (40 each), Local's nothing, FedAvg's everything (67).
    for state, coordinates in ((None, 67), (FedPer(), 40), (FedRep(), 40), (Local(), 0), (FineTune(epochs=1), 67)):
        rows = train(state, rounds=1)[1]
        assert rows[0]["cohort_size"] == 3
        assert rows[0]["upload_mb"] == pytest.approx(3 * coordinates * 8 / 1e6), state
        assert rows[0]["download_mb"] == pytest.approx(3 * coordinates * 8 / 1e6), state


def test_finetune_with_zero_epochs_is_fedavgs_per_client_evaluation():
    fedavg, fedavg_rows, _ = train()
    tuned, tuned_rows, _ = train(FineTune(epochs=0))
    assert torch.equal(tuned.params, fedavg.params)
    assert personal(tuned_rows) == personal(fedavg_rows) and personal(tuned_rows, "val_accuracy") == personal(
        fedavg_rows, "val_accuracy"
    )
    one = train(FineTune(epochs=1))[1]
    assert personal(one) != personal(fedavg_rows)  # fine-tuning changes what each client is judged by


def test_local_with_one_client_equals_centralised_training_on_its_data():
    rounds, steps, batch = 3, 2, 10
    state = Local()
    train(state, rounds=rounds, clients=CLIENTS[:1], tests=TESTS[:1], vals=None, local_steps=steps, batch_size=batch)
    # Centralised: plain SGD on the client's 34 samples, each round's batches from the (round, client 0) stream.
    net, part = model(), torch.as_tensor(CLIENTS[0])
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for t in range(1, rounds + 1):
        order = torch.randperm(len(part), generator=torch_generator(0, "batches", t, 0))
        for k in range(steps):
            chosen = part[order[k * batch : (k + 1) * batch]]
            opt.zero_grad()
            cross_entropy(net(X[chosen]), Y[chosen]).backward()
            opt.step()
    assert torch.allclose(state.store.get(0), flat_parameters(net), atol=1e-12)


def test_fedrep_trains_the_head_then_the_body_by_hand():
    state = FedRep(head_epochs=1)
    result, _, _ = train(state, rounds=1, clients=CLIENTS[:1], tests=TESTS[:1], vals=None, local_steps=2)
    net, part = model(), torch.as_tensor(CLIENTS[0])
    head = [p for name, p in net.named_parameters() if name in state.names]
    body = [p for name, p in net.named_parameters() if name not in state.names]
    w0 = flat_parameters(net)

    def sgd(params, chosen):
        grads = torch.autograd.grad(cross_entropy(net(X[chosen]), Y[chosen]), params)
        with torch.no_grad():
            for p, grad in zip(params, grads):
                p -= LR * grad

    order = torch.randperm(34, generator=torch_generator(0, "head", 1, 0))  # phase 1: one epoch of the head
    for k in range(0, 34, 10):
        sgd(head, part[order[k : k + 10]])
    order = torch.randperm(34, generator=torch_generator(0, "batches", 1, 0))  # phase 2: two steps of the body
    for k in range(2):
        sgd(body, part[order[10 * k : 10 * (k + 1)]])
    mine = flat_parameters(net)
    assert torch.allclose(state.store.get(0), mine[state.mask], atol=1e-12)  # the client keeps its new head
    # the server got the body's update only: the global body moved as the client's did, the global head did not
    assert torch.allclose(result.params[~state.mask], mine[~state.mask], atol=1e-12)
    assert torch.equal(result.params[state.mask], w0[state.mask])


def test_ditto_trains_the_global_model_as_fedavg_and_a_large_lambda_keeps_the_personal_model_at_it():
    lr, steps = 0.01, 20
    fedavg = train(rounds=1, lr=lr, local_steps=steps)[0]
    pulled, free = Ditto(lam=1 / lr), Ditto(lam=0.0)  # lr * lambda = 1: the pull undoes every step away from w^t
    assert torch.equal(train(pulled, rounds=1, lr=lr, local_steps=steps)[0].params, fedavg.params)
    train(free, rounds=1, lr=lr, local_steps=steps)
    w0 = flat_parameters(model())  # round 1's w^t
    near = max(float((pulled.store.get(c) - w0).norm()) for c in range(3))
    far = min(float((free.store.get(c) - w0).norm()) for c in range(3))
    assert near < far / 5  # v_k = w^t - lr * grad: one step's length from w^t, not twenty steps' drift
    # lambda = 0 is local training from w^0: the personal model is the client's local model of the round
    assert torch.allclose(free.store.get(0), w0 + _local_delta(0, lr, steps), atol=1e-12)


def test_an_apfl_step_by_hand():
    # One feature, two classes, no bias: logits = W x with W (2 x 1); cross-entropy's gradient in W is
    # (softmax(W x) - onehot(y)) x, averaged over the batch. w = (1, 0), v = (0, 2), alpha = 0.25, lr = 0.5,
    # alpha_lr = 0.1, samples x = 1 (label 0) and x = 2 (label 1).
    net = torch.nn.Linear(1, 2, bias=False).double()
    w, v = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 2.0], dtype=torch.float64)
    x, y = torch.tensor([[1.0], [2.0]], dtype=torch.float64), torch.tensor([0, 1])
    mixed = np.array([0.75, 0.5])  # 0.25 v + 0.75 w
    g = np.zeros(2)
    for xi, yi in ((1.0, 0), (2.0, 1)):
        p = np.exp(mixed * xi) / np.exp(mixed * xi).sum()
        g += (p - np.eye(2)[yi]) * xi / 2
    stepped, alpha = apfl_step(net, w, v, 0.25, x, y, lr=0.5, alpha_lr=0.1)
    assert np.allclose(stepped.numpy(), v.numpy() - 0.5 * 0.25 * g, atol=1e-15)  # v - lr alpha grad f(v_bar)
    assert alpha == pytest.approx(0.25 - 0.1 * float((v.numpy() - w.numpy()) @ g), abs=1e-15)  # - <v - w, g>
    assert apfl_step(net, w, v, 0.25, x, y, lr=0.5, alpha_lr=0.0)[1] == 0.25  # alpha_lr 0: alpha fixed
    assert apfl_step(net, w, v, 0.25, x, y, lr=0.5, alpha_lr=1e6)[1] in (0.0, 1.0)  # kept in [0, 1]


def test_apfl_trains_the_global_model_as_fedavg_and_alpha_one_trains_v_as_local_training():
    fedavg, fedavg_rows, _ = train(rounds=2)
    served_global, rows, _ = train(APFL(alpha=0.0, alpha_lr=0.0), rounds=2)
    assert torch.equal(served_global.params, fedavg.params)  # w's local work, upload and aggregation unchanged
    assert personal(rows) == personal(fedavg_rows)  # alpha 0: each client is served the global model
    alone = APFL(alpha=1.0, alpha_lr=0.0)
    train(alone, rounds=1, lr=0.01, local_steps=20)
    w0 = flat_parameters(model())
    for client in range(3):  # v_bar = v: v's steps are plain SGD on f(v), on the round's own mini-batches
        v, alpha = alone.store.get(client)[:-1], float(alone.store.get(client)[-1])
        assert alpha == 1.0
        assert torch.allclose(v, w0 + _local_delta(client, 0.01, 20, stream="batches"), atol=1e-12)


def test_apfl_learns_alpha_and_serves_the_mixture_with_the_current_global_model():
    state = APFL(alpha=0.5)
    result, rows, series = train(state, rounds=3)
    alphas = [float(state.store.get(c)[-1]) for c in range(3)]
    assert all(0 <= a <= 1 for a in alphas) and alphas != [0.5, 0.5, 0.5]
    served = state.models(result.params, np.arange(3), None)
    for c in range(3):
        v, a = state.store.get(c)[:-1], float(state.store.get(c)[-1])
        assert torch.allclose(served[c], a * v + (1 - a) * result.params, atol=1e-12)


def _local_delta(client: int, lr: float, steps: int, stream: str = "personal") -> torch.Tensor:
    """Client ``client``'s round-1 update from w^0 on ``stream`` (``steps`` steps of 10, across epochs)."""
    net, part = model(), torch.as_tensor(CLIENTS[client])
    w0, opt = flat_parameters(net), torch.optim.SGD(net.parameters(), lr=lr)
    generator = torch_generator(0, stream, 1, client)
    batches = [
        o[k : k + 10] for o in (torch.randperm(34, generator=generator) for _ in range(steps)) for k in range(0, 34, 10)
    ]
    for batch in batches[:steps]:
        chosen = part[batch]
        opt.zero_grad()
        cross_entropy(net(X[chosen]), Y[chosen]).backward()
        opt.step()
    return flat_parameters(net) - w0


@pytest.mark.parametrize("method", [FedPer, FedRep, Ditto, Local, APFL])
def test_personal_state_is_checkpointed_and_restored_exactly(tmp_path, method):
    whole, whole_rows, whole_series = train(method(), rounds=5)
    train(method(), rounds=2, checkpoint=Checkpoint(tmp_path, every=1))
    resumed, rows, series = train(method(), rounds=5, checkpoint=Checkpoint(tmp_path, resume=True))
    assert torch.equal(resumed.params, whole.params)
    assert strip(rows) == strip(whole_rows[2:])
    assert [s["personal_accuracy"].tolist() for s in series] == [
        s["personal_accuracy"].tolist() for s in whole_series[2:]
    ]


def test_a_memory_budget_spills_to_disk_and_gives_the_same_run(tmp_path):
    in_memory = FedPer()
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    expected = train(in_memory, rounds=4, checkpoint=Checkpoint(tmp_path / "a", every=100))[1]
    spilled = FedPer(memory_mb=1e-4)  # 100 bytes: one head (27 float64 = 216 bytes) in memory at a time
    rows = train(spilled, rounds=4, checkpoint=Checkpoint(tmp_path / "b", every=100))[1]
    assert strip(rows) == strip(expected)
    assert len(spilled.store.memory) == 1 and len(spilled.store.disk) == 2
    on_disk = {p.name for p in (tmp_path / "b" / "personal").glob("*.pt")}
    assert set(spilled.store.disk.values()) <= on_disk


def test_the_store_keeps_what_the_last_checkpoint_names_and_drops_orphans(tmp_path):
    store = PersonalStore(budget_mb=1e-5, directory=tmp_path)  # 10 bytes: every tensor but the newest spills
    for client in range(3):
        store.put(client, torch.full((4,), float(client)))
    saved = store.state_dict()  # a checkpoint: clients 0 and 1 on disk, 2 in memory
    assert set(saved["disk"]) == {0, 1} and set(saved["memory"]) == {2}
    assert store.get(0).tolist() == [0.0] * 4  # read back, client 1 spilled... and 2
    store.put(0, torch.full((4,), 9.0))  # changed after the checkpoint: its old file is still named by it
    store.put(3, torch.ones(4))
    assert all((tmp_path / name).exists() for name in saved["disk"].values())
    # a kill here; the resumed store reads the checkpoint, and the files written after it are orphans
    resumed = PersonalStore(budget_mb=1e-5, directory=tmp_path)
    resumed.load_state_dict(saved)
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == sorted(saved["disk"].values())
    assert [resumed.get(c).tolist() for c in range(3)] == [[float(c)] * 4 for c in range(3)]
    assert resumed.get(3) is None


def test_a_restart_before_any_checkpoint_leaves_no_file_of_the_attempt_it_replaces(tmp_path):
    first = PersonalStore(budget_mb=1e-5, directory=tmp_path)  # 10 bytes: every tensor but the newest spills
    for client in range(4):
        first.put(client, torch.full((4,), float(client)))
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["0.0.pt", "1.1.pt", "2.2.pt"]
    # killed before its first checkpoint; the run starts afresh in the same directory and spills client 5 only
    again = PersonalStore(budget_mb=1e-5, directory=tmp_path)
    again.put(5, torch.ones(4))
    again.put(6, torch.ones(4))
    saved = again.state_dict()
    assert saved["disk"] == {5: "5.0.pt"}
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["5.0.pt"]
    assert again.get(5).tolist() == [1.0] * 4


def test_a_personal_pattern_that_matches_no_parameter_is_refused_in_one_line():
    net = model()
    with pytest.raises(ConfigError) as error:
        FedPer(personal=["head.*"]).bind(Context(Schedule(), np.array([1]), layout=layout(net)))
    assert error.value.key == "personal" and "1.weight" in str(error.value)


def test_the_default_client_state_is_not_personal():
    assert not ClientState.personal and FedPer.personal and FineTune.personal and not FineTune.keeps


def test_a_run_is_selected_on_validation_and_pfllibs_best_round_on_test_is_kept_beside_it():
    from fedrun.metrics import summarise

    rows = []
    for t, (test, val) in enumerate([(0.5, 0.6), (0.8, 0.9), (float("nan"), float("nan")), (0.7, 0.9), (0.9, 0.7)], 1):
        rows.append({"round": t, "round_wall_s": 1.0, "test_accuracy": 0.5, "personal/accuracy_weighted": test,
                     "personal/accuracy_mean": test - 0.05, "personal/accuracy_p10": test - 0.3,
                     "personal/accuracy_min": test - 0.4, "personal/val_accuracy_weighted": val})  # fmt: skip
    values, tags = summarise(__import__("pandas").DataFrame(rows), [0.6, 0.9])
    assert values["personal/selected_round"] == 2  # the first of the two rounds of highest validation accuracy
    assert values["personal/selected_accuracy_weighted"] == 0.8
    assert values["personal/selected_accuracy_min"] == pytest.approx(0.4)
    assert values["personal/best_on_test_round"] == 5 and values["personal/best_on_test_accuracy_weighted"] == 0.9
    assert values["personal/final_accuracy_p10"] == pytest.approx(0.6)  # round 5, the last judged
    assert values["personal/R60"] == 2  # the mean (0.75) first reaches 0.6 at round 2
    assert tags["personal/R90"] == "not_reached"  # the mean's best is 0.85


AGGREGATORS = sorted(p.stem for p in (Path(__file__).parents[2] / "conf" / "aggregator").glob("*.yaml"))


def runs_with_every_synchronous_aggregator(compose_config, run_with) -> None:
    """``run_with(aggregator)`` (a personal method's run, -> (result, rows, series)) runs with every synchronous
    aggregator of conf/ or is refused in one line: MVR alone refuses a personal method; Krum's family refuses 3
    clients, whatever the method (their own rule)."""
    from hydra.utils import instantiate

    ran, refused = [], []
    for name in AGGREGATORS:
        aggregator = instantiate(compose_config(f"aggregator={name}").aggregator)
        if aggregator.asynchronous or getattr(aggregator, "root_size", 0):  # the async engine refuses it (test_errors);
            continue  # FLTrust's root set comes from the dataset (tests/e2e)
        try:
            result, rows, _ = run_with(aggregator)
        except ConfigError as error:
            refused.append((name, str(error)))
            continue
        assert torch.isfinite(result.params).all() and not np.isnan(rows[-1]["personal/accuracy_mean"]), name
        ran.append(name)
    assert [name for name, line in refused if "personalization=" in line] == ["mvr"]
    assert {name for name, line in refused if "personalization=" not in line} <= {"krum", "multikrum", "bulyan"}
    assert {"fedavg", "fedsoftmax", "fedmax", "median", "trimmed_mean", "geomed", "fednova", "hybrid"} <= set(ran)


@pytest.mark.parametrize("method", ["fedper", "fedrep", "ditto", "apfl"])
def test_each_personal_method_runs_with_every_synchronous_aggregator_or_is_refused_in_one_line(compose_config, method):
    from hydra.utils import instantiate

    state = compose_config(f"personalization={method}").personalization
    runs_with_every_synchronous_aggregator(
        compose_config, lambda aggregator: train(instantiate(state), rounds=2, lr=0.1, aggregator=aggregator)
    )


def test_the_fairness_measures_by_hand():
    from fedrun.metrics import fairness

    equal = fairness(np.full(4, 0.7), np.ones(4))
    assert equal["jain"] == pytest.approx(1.0) and equal["variance"] == 0.0 and equal["left_behind"] == 0.0
    one = fairness(np.array([0.0, 0.0, 0.9, 0.0]), np.ones(4))
    assert one["jain"] == pytest.approx(0.25) and one["left_behind"] == 0.75  # 1/n; three below 0.8 * 0.225
    # (0.2, 0.6, 0.8, 1.0) and a client with no held-out sample (left out): mean 0.65, population variance
    # (0.2025 + 0.0025 + 0.0225 + 0.1225) / 4 = 0.0875, Jain 2.6^2 / (4 * 2.04) = 0.828431..., 10th percentile
    # 0.2 + 0.3 * 0.4 = 0.32, 90th 0.8 + 0.7 * 0.2 = 0.94, left behind: 0.2 < 0.52 only.
    got = fairness(np.array([0.2, 0.6, 0.8, 1.0, 0.0]), np.array([5, 5, 5, 5, 0]))
    # worst10 and best10: a tenth of 4 clients rounded up is one client, the worst and the best.
    expected = dict(
        mean=0.65,
        min=0.2,
        max=1.0,
        worst10=0.2,
        best10=1.0,
        p10=0.32,
        p90=0.94,
        variance=0.0875,
        jain=6.76 / 8.16,
        left_behind=0.25,
    )
    assert got == pytest.approx(expected, abs=1e-12)
    # 20 clients at 0, 0.05, ..., 0.95 (given shuffled): the worst two average 0.025, the best two 0.925; 11 clients
    # make a tenth of 1.1, two clients.
    twenty = np.random.default_rng(0).permutation(np.arange(20) * 0.05)
    got = fairness(twenty, np.ones(20))
    assert (got["worst10"], got["best10"]) == pytest.approx((0.025, 0.925), abs=1e-12)
    got = fairness(np.array([0.9] * 9 + [0.1, 0.3]), np.ones(11))
    assert (got["worst10"], got["best10"]) == pytest.approx((0.2, 0.9), abs=1e-12)
    assert all(np.isnan(v) for v in fairness(np.array([0.5]), np.array([0])).values())


@pytest.mark.parametrize(
    "name", ["../../victim/important_0.pt", "/etc/hostname", "3.0.pt/../../x.pt", "4.0.pt", "3.x.pt"]
)
def test_a_checkpoint_naming_a_spill_file_outside_the_store_is_refused_and_deletes_nothing(tmp_path, name):
    from fedrun.errors import ConfigError

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "important_0.pt").write_bytes(b"keep me")
    store = PersonalStore(1.0, tmp_path / "run" / "personal")
    (tmp_path / "run" / "personal").mkdir(parents=True)
    with pytest.raises(ConfigError, match="^checkpoint="):
        store.load_state_dict({"memory": {}, "disk": {3: name}, "written": 1})
    assert (victim / "important_0.pt").read_bytes() == b"keep me"
    torch.save({"value": torch.ones(2)}, tmp_path / "run" / "personal" / "3.0.pt")
    store.load_state_dict({"memory": {}, "disk": {3: "3.0.pt"}, "written": 1})  # fedrun's own name is taken
    assert torch.equal(store.get(3), torch.ones(2))


def test_spilled_files_that_are_missing_linked_or_crafted_are_refused_in_one_line_and_the_sweep_spares_others(
    tmp_path,
):
    import pickle
    import warnings

    from fedrun.errors import ConfigError
    from fedrun.runfiles import BadFile

    folder, victim = tmp_path / "run" / "client", tmp_path / "victim.pt"
    folder.mkdir(parents=True)
    torch.save({"value": torch.zeros(3)}, victim)
    with pytest.raises(ConfigError, match="missing, or a link"):
        PersonalStore(1.0, folder).load_state_dict({"disk": {1: "1.0.pt"}, "written": 1})
    (folder / "1.0.pt").symlink_to(victim)
    with pytest.raises(ConfigError, match="missing, or a link"):
        PersonalStore(1.0, folder).load_state_dict({"disk": {1: "1.0.pt"}, "written": 1})
    (folder / "1.0.pt").unlink()
    (folder / "1.0.pt").hardlink_to(victim)
    with pytest.raises(ConfigError, match="missing, or a link"):
        PersonalStore(1.0, folder).load_state_dict({"disk": {1: "1.0.pt"}, "written": 1})
    (folder / "1.0.pt").unlink()
    # Contents: a pickle weights_only refuses, a file that is no torch file, a torch file of something else.
    for content in (pickle.dumps(print), b"plain text\n", None):
        if content is None:
            torch.save([1, 2], folder / "1.0.pt")
        else:
            (folder / "1.0.pt").write_bytes(content)
        store = PersonalStore(1.0, folder)
        store.load_state_dict({"disk": {1: "1.0.pt"}, "written": 1})
        with warnings.catch_warnings(record=True) as warned:  # the refusal is the one line: no torch warning before it
            warnings.simplefilter("always")
            with pytest.raises(BadFile, match=r"1.0.pt is not a client state fedrun spilled"):
                store.get(1)
        assert not warned, [str(w.message) for w in warned]
    # The sweep of an attempt's orphans deletes only what the store recorded writing (written.log), of its own name
    # form, regular and with no other name: not a file it did not record, a link, another name, a path elsewhere.
    (folder / "2.0.pt").symlink_to(victim)
    (folder / "5.3.pt").hardlink_to(victim)
    (folder / "notes.pt").write_bytes(b"mine")
    (folder / "7.1.pt").write_bytes(b"an orphan")
    (folder / "8.0.pt").write_bytes(b"not recorded: not fedrun's to delete")
    (folder / "written.log").write_text("1.0.pt\n7.1.pt\n2.0.pt\n5.3.pt\nnotes.pt\n../victim.pt\n")
    PersonalStore(1.0, folder).load_state_dict({"disk": {1: "1.0.pt"}, "written": 2})
    assert sorted(p.name for p in folder.iterdir()) == [
        "1.0.pt",
        "2.0.pt",
        "5.3.pt",
        "8.0.pt",
        "notes.pt",
        "written.log",
    ]
    assert (folder / "written.log").read_text() == "1.0.pt\n"  # what may still be deleted: what is kept
    assert torch.equal(torch.load(victim, weights_only=True)["value"], torch.zeros(3))
