"""The round's seams, shown with parts defined here and nowhere else: no engine file knows them.

(a) a client state that keeps each client's last layer local (FedPer's split, Arivazhagan et al. 2019): every client
starts from the global body with its own head, and its head stays with it; (b) a stage that adds noise and says its
message is dense again, so the upload counts what a client really sends wherever the stage stands.
"""

import functools

import numpy as np
import pytest
import torch

from fedrun.aggregators import FedAvg
from fedrun.checkpoint import Checkpoint
from fedrun.compression import TopK
from fedrun.datasets import FederatedData
from fedrun.engine import run
from fedrun.models import MLP
from fedrun.parts import ClientState, Parts
from fedrun.pipeline import Pipeline, Stage
from fedrun.rounds import Schedule
from fedrun.seeding import torch_generator, torch_seed

# Three clients whose labels are permuted differently: one shared body, but each client needs its own head.
g = torch.Generator().manual_seed(0)
X = torch.randn(150, 4, generator=g, dtype=torch.float64)
TRUE = (X @ torch.randn(4, 3, generator=g, dtype=torch.float64)).argmax(1)
PERMUTATIONS = [torch.tensor(p) for p in ([0, 1, 2], [1, 2, 0], [2, 0, 1])]
Y = torch.cat([PERMUTATIONS[c][TRUE[50 * c : 50 * (c + 1)]] for c in range(3)])
DATA = FederatedData(X, Y, X[:30], Y[:30], num_classes=3)
CLIENTS = [np.arange(50 * c, 50 * c + 40) for c in range(3)]  # trains on 40
TESTS = [np.arange(50 * c + 40, 50 * (c + 1)) for c in range(3)]  # its own 10 held out (indices into train)
SGD = functools.partial(torch.optim.SGD, lr=0.3)


class FedPerHead(ClientState):
    """FedPer: the last layer (the head) is each client's own; the body comes from the global model each round."""

    keeps = True

    def __init__(self):
        self.heads: dict[int, torch.Tensor] = {}
        self.span = (0, 0)

    def bind(self, context):
        weight, bias = context.layout[-2:]  # the last Linear's weight and bias: one contiguous span
        self.span = (weight[1], bias[2])

    def starts(self, params, cohort):
        starts = params.repeat(len(cohort), 1)
        lo, hi = self.span
        for row, client in enumerate(cohort):
            if int(client) in self.heads:
                starts[row, lo:hi] = self.heads[int(client)]
        return starts

    def keep(self, cohort, starts, deltas):
        lo, hi = self.span
        for row, client in enumerate(cohort):
            self.heads[int(client)] = (starts[row, lo:hi] + deltas[row, lo:hi]).clone()

    def state_dict(self):
        return {"heads": dict(self.heads)}

    def load_state_dict(self, state):
        self.heads = dict(state.get("heads", {}))


def model():
    torch.manual_seed(torch_seed(0, "init"))
    return MLP((4,), 3, hidden=(8,)).double()


def train(parts, rounds=6, checkpoint=None, cohort=None):
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
        client_tests=TESTS,
        checkpoint=checkpoint,
    )
    return result, rows


def test_a_client_state_keeps_each_clients_head_and_changes_its_accuracy_from_fedavgs():
    fedavg = [row["client_accuracy"] for row in train(Parts(FedAvg()))[1]]
    fedper = FedPerHead()
    personal = [row["client_accuracy"] for row in train(Parts(FedAvg(), client_state=fedper))[1]]
    assert personal != fedavg
    # Labels permuted per client: one global head fits one client at best (1/3 of the labels agree across all
    # three), each client's own head fits it; the mean over the last rounds says so.
    assert np.mean(personal[-3:]) > np.mean(fedavg[-3:]) + 0.2
    assert sorted(fedper.heads) == [0, 1, 2]  # every client trained and kept its head (state only for those)


def test_a_client_state_is_checkpointed_and_restored_exactly(tmp_path):
    whole, whole_rows = train(Parts(FedAvg(), client_state=FedPerHead()), rounds=5)
    train(Parts(FedAvg(), client_state=FedPerHead()), rounds=2, checkpoint=Checkpoint(tmp_path, every=1))
    resumed_state = FedPerHead()
    resumed, resumed_rows = train(
        Parts(FedAvg(), client_state=resumed_state), rounds=5, checkpoint=Checkpoint(tmp_path, resume=True)
    )
    assert torch.equal(resumed.params, whole.params)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.endswith("wall_s")} for r in rows]  # noqa: E731
    assert strip(resumed_rows) == strip(whole_rows[2:])


def test_a_checkpoint_of_another_run_is_refused_in_one_line_before_round_1(tmp_path):
    from fedrun.runfiles import BadFile

    train(Parts(FedAvg(), client_state=FedPerHead()), rounds=2, checkpoint=Checkpoint(tmp_path, every=1))
    saved = Checkpoint(tmp_path, resume=True).restored()
    wrong = {**saved, "loop": {**saved["loop"], "params": torch.zeros(7)}}  # a model of another shape
    Checkpoint(tmp_path, every=1).save(wrong)
    with pytest.raises(BadFile, match=r"checkpoint.pt is not a checkpoint of this run \(ValueError: a global model of"):
        train(Parts(FedAvg(), client_state=FedPerHead()), rounds=5, checkpoint=Checkpoint(tmp_path, resume=True))
    broken = {**saved, "parts": {**saved["parts"], "client_state": {"heads": "not a dict of tensors"}}}
    Checkpoint(tmp_path, every=1).save(broken)
    with pytest.raises(BadFile, match="is not a checkpoint of this run"):
        train(Parts(FedAvg(), client_state=FedPerHead()), rounds=5, checkpoint=Checkpoint(tmp_path, resume=True))


def test_a_client_state_holds_nothing_for_clients_that_never_trained():
    state = FedPerHead()
    assert state.state_dict() == {"heads": {}}
    train(Parts(FedAvg(), client_state=state), rounds=1, cohort=1)  # one client of three trains
    assert len(state.heads) == 1 and len(state.state_dict()["heads"]) == 1


class Noise(Stage):
    """Gaussian noise on each update: whatever came before, the message is dense again (d float64s)."""

    name = "noise"

    def __init__(self, std: float = 0.01):
        self.std, self.seed = std, 0

    def bind(self, context):
        self.seed = context.seed

    def __call__(self, deltas, clients, round_):
        noise = torch.stack(
            [
                torch.randn(deltas.shape[1], generator=torch_generator(self.seed, "test_noise", round_, int(c)))
                for c in clients
            ]
        ).to(deltas)
        return deltas + self.std * noise, {"noise/std": self.std}

    def sent_bits(self, d, bits):
        return d * 64.0  # dense, as the model's float64 parameters


def upload_mb(stages):
    rows = train(Parts(FedAvg(), pipeline=Pipeline(stages)), rounds=1)[1]
    return rows[0]["upload_mb"], rows[0]


def test_a_stage_that_adds_noise_after_compression_makes_the_message_dense_again():
    d = sum(p.numel() for p in model().parameters())
    dense = 3 * d * 8 / 1e6  # three clients, float64
    noised_last, row = upload_mb([TopK(k=0.1), Noise()])
    assert noised_last == dense
    assert row["noise/std"] == 0.01
    compressed_last, _ = upload_mb([Noise(), TopK(k=0.1)])
    assert compressed_last == pytest.approx(3 * TopK(k=0.1).message_bits(d) / 8 / 1e6, rel=1e-12)
    assert compressed_last < dense / 2
