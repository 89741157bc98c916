"""LEAF's FEMNIST and Shakespeare (fedrun.leaf) on tiny files in LEAF's exact layout, written here; LEAF's models
(parameter counts, shapes, a gradient check) (the presets through the real ``fedrun`` command: tests/e2e/test_leaf.py)."""

import functools
import json

import numpy as np
import pytest
import torch

from fedrun.backends import Device
from fedrun.errors import ConfigError
from fedrun.leaf import ALL_LETTERS, FEMNIST, Shakespeare
from fedrun.models import CharLSTM, LeafCNN, count_parameters
from fedrun.parts import Parts
from fedrun.vmap import vmap_supported

TEXT = (
    "Full fathom five thy father lies; Of his bones are coral made; Those are pearls that were his eyes: "
    "Nothing of him that doth fade, But doth suffer a sea-change Into something rich and strange. "
)


def write(path, users: dict) -> None:
    """One LEAF JSON file: users, num_samples, user_data (as data/utils/split_data.py writes them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "users": list(users),
                "num_samples": [len(d["y"]) for d in users.values()],
                "user_data": users,
            }
        )
    )


def femnist_files(root, rng=None):
    """Three writers over two train files and one test file; returns {user: (train x, train y, test x, test y)}."""
    rng = rng or np.random.default_rng(0)
    made = {}
    for user, n_train, n_test in (("f0001_01", 5, 2), ("f0002_02", 3, 1), ("f0003_03", 4, 2)):
        x = rng.random((n_train + n_test, 784)).round(4)
        y = rng.integers(0, 62, n_train + n_test)
        made[user] = (x[:n_train], y[:n_train], x[n_train:], y[n_train:])
    as_json = lambda x, y: {"x": x.tolist(), "y": y.tolist()}  # noqa: E731
    write(root / "train" / "a.json", {u: as_json(*made[u][:2]) for u in ("f0001_01", "f0002_02")})
    write(root / "train" / "b.json", {"f0003_03": as_json(*made["f0003_03"][:2])})
    write(root / "test" / "all.json", {u: as_json(*made[u][2:]) for u in made})
    return made


def test_users_without_a_training_sample_are_left_out_and_said(tmp_path, capsys):
    """200,000 empty users in an 8.8 MB file were clients: a cohort of them had no weight to average by."""
    made = femnist_files(tmp_path)
    write(tmp_path / "train" / "c.json", {f"empty_{i}": {"x": [], "y": []} for i in range(1000)})
    data = FEMNIST(root=str(tmp_path)).load(seed=0)
    assert [len(part) for part in data.natural_split] == [len(m[1]) for m in made.values()]
    assert "fedrun: femnist train: left out 1000 users without a training sample" in capsys.readouterr().out
    for name in ("a.json", "b.json"):
        (tmp_path / "train" / name).unlink()
    with pytest.raises(ConfigError, match="LEAF files with a user that has a training sample"):
        FEMNIST(root=str(tmp_path)).load(seed=0)


def windows(text: str, start: int, count: int):
    """LEAF's samples: 80 characters and the next one (shake_utils.py)."""
    return [text[i : i + 80] for i in range(start, start + count)], [text[i + 80] for i in range(start, start + count)]


def shakespeare_files(root):
    roles = {"THE_TEMPEST_ARIEL": (0, 6, 8, 3), "THE_TEMPEST_PROSPERO": (40, 4, 50, 2)}
    train, test = {}, {}
    for role, (a, n, b, m) in roles.items():
        x, y = windows(TEXT, a, n)
        train[role] = {"x": x, "y": y}
        x, y = windows(TEXT, b, m)
        test[role] = {"x": x, "y": y}
    write(root / "train" / "train.json", train)
    write(root / "test" / "test.json", test)
    return train, test


def test_femnist_reads_one_client_per_writer_in_leafs_layout(tmp_path):
    made = femnist_files(tmp_path)
    data = FEMNIST(root=str(tmp_path)).load(seed=0)
    assert data.num_classes == 62 and data.input_shape == (1, 28, 28) and data.x_train.dtype == torch.float32
    assert [len(part) for part in data.natural_split] == [5, 3, 4] and len(data.y_test) == 5
    for part, user in zip(data.natural_split, made):
        x, y = made[user][:2]
        assert np.allclose(data.x_train[part].reshape(len(part), 784).numpy(), x)  # as stored: not inverted
        assert data.y_train[part].tolist() == y.tolist()
    dataset = FEMNIST(root=str(tmp_path), invert=True)
    inverted = dataset.load(seed=0)
    assert torch.allclose(inverted.x_train, 1 - data.x_train)
    # Each writer's own test samples, for client-level evaluation: 2, 1 and 2 of the 5.
    assert [len(p) for p in dataset.natural_test_split] == [2, 1, 2]
    assert inverted.y_test[dataset.natural_test_split[2]].tolist() == made["f0003_03"][3].tolist()


def test_shakespeare_maps_characters_through_leafs_vocabulary(tmp_path):
    train, _ = shakespeare_files(tmp_path)
    data = Shakespeare(root=str(tmp_path)).load(seed=0)
    assert len(ALL_LETTERS) == 80 and data.num_classes == 80 and data.input_shape == (80,)
    assert data.x_train.dtype == torch.int64 and [len(p) for p in data.natural_split] == [6, 4]
    # ALL_LETTERS: newline 0, space 1, ! 2, " 3, & 4, ' 5, ( 6, ) 7, , 8, - 9, . 10, digits 11-20, : 21, ; 22, > 23,
    # ? 24, A-Z 25-50, [ 51, ] 52, a-z 53-78, } 79. "Full" -> F = 25 + 5, u = 53 + 20, l = 53 + 11.
    assert data.x_train[0, :5].tolist() == [30, 73, 64, 64, 1]
    decoded = "".join(ALL_LETTERS[i] for i in data.x_train[6].tolist())  # Prospero's first sample
    assert decoded == train["THE_TEMPEST_PROSPERO"]["x"][0]
    assert ALL_LETTERS[data.y_train[0]] == TEXT[80] and len(data.y_test) == 5


@pytest.mark.parametrize(
    "spoil,message",
    [
        (lambda root: (root / "train" / "a.json").unlink() or (root / "train" / "b.json").unlink(), "no .json file"),
        (lambda root: (root / "train" / "a.json").write_text("{not json"), "a.json.*a LEAF JSON file"),
        (lambda root: (root / "train" / "b.json").write_text('{"users": ["u"]}'), "b.json.*no num_samples"),
        (
            lambda root: write(root / "train" / "b.json", {"u": {"x": [[0.5] * 784], "y": [1, 2]}}),
            "b.json.*'u': num_samples 2, 1 x, 2 y",
        ),
        (lambda root: write(root / "train" / "b.json", {"u": {"x": [[0.5] * 783], "y": [1]}}), "784 pixels"),
        (lambda root: write(root / "train" / "b.json", {"u": {"x": [[0.5] * 784], "y": [62]}}), "labels y in 0-61"),
        (lambda root: write(root / "train" / "b.json", {"f0001_01": {"x": [[0.5] * 784], "y": [1]}}), "recur"),
        # JSON, but not LEAF-shaped: each names the file, the field and LEAF's layout
        (lambda root: leaf_json(root, users=3), r"b.json.*whose users is a list of user names \(here 3\).*layout"),
        (lambda root: leaf_json(root, user_data=[1]), r"b.json.*whose user_data is an object.*\(here \[1\]\)"),
        (lambda root: leaf_json(root, users=[["u"]]), r"b.json.*whose users are strings.*\(here \['u'\]\)"),
        (
            lambda root: leaf_json(root, user_data={"u": {"x": 5, "y": [1]}}),
            r"b.json.*whose user_data\['u'\].x is a list \(here 5\)",
        ),
        (
            lambda root: leaf_json(root, num_samples=["1"]),
            r"b.json.*num_samples of 'u' is an integer >= 0 \(here '1'\)",
        ),
        (lambda root: (root / "train" / "b.json").write_text("[" * 100_000 + "]" * 100_000), "b.json.*nests deeper"),
        (
            lambda root: [write(path, {}) for path in (root / "train" / "a.json", root / "train" / "b.json")],
            "train'.*at least one user in train/",
        ),
        # LEAF stores pixels as grey / 255 in [0, 1] and integer labels: another scale or a fraction is refused
        (
            lambda root: write(root / "train" / "b.json", {"u": {"x": [[255] * 784], "y": [1]}}),
            r"b.json user 'u'.*pixels in \[0, 1\].*one is 255",
        ),
        (
            lambda root: write(root / "train" / "b.json", {"u": {"x": [[0.5] * 784], "y": [3.7]}}),
            r"b.json user 'u'.*integer labels 0-61 \(one is 3.7\)",
        ),
        (
            lambda root: write(root / "train" / "b.json", {"u": {"x": [["0.5"] * 784], "y": [1]}}),
            "b.json user 'u'.*784 pixels a sample \\(got <U3 values",
        ),
    ],
    ids=[
        *("missing", "not-json", "no-num-samples", "counts", "pixels", "labels", "duplicate-user"),
        *("users-int", "user-data-list", "list-as-user", "x-int", "count-str", "deep", "no-users"),
        *("pixel-255", "label-3.7", "pixel-str"),
    ],
)
def test_a_missing_folder_or_malformed_file_is_one_line_naming_it(tmp_path, spoil, message):
    femnist_files(tmp_path)
    spoil(tmp_path)
    with pytest.raises(ConfigError, match=message) as info:
        FEMNIST(root=str(tmp_path)).load(seed=0)
    assert "\n" not in str(info.value) and str(info.value).startswith("dataset.root=")


def leaf_json(root, **fields) -> None:
    """train/b.json as LEAF's layout with one user u, then ``fields`` put in place of LEAF's."""
    data = {"users": ["u"], "num_samples": [1], "user_data": {"u": {"x": [[0.5] * 784], "y": [1]}}, **fields}
    (root / "train" / "b.json").write_text(json.dumps(data))


def test_a_leaf_error_is_its_line_alone_without_a_progress_bar(tmp_path, capsys):
    femnist_files(tmp_path)
    write(tmp_path / "train" / "b.json", {"u": {"x": [[0.5] * 784], "y": [62]}})
    with pytest.raises(ConfigError, match="labels y in 0-61"):
        FEMNIST(root=str(tmp_path)).load(seed=0)
    assert capsys.readouterr().err == ""  # tqdm printed its 0% line here before


def test_a_character_outside_leafs_vocabulary_is_refused_naming_it(tmp_path):
    shakespeare_files(tmp_path)
    write(tmp_path / "test" / "test.json", {"ROLE": {"x": ["caf\u00e9" + "a" * 76], "y": ["a"]}})
    with pytest.raises(ConfigError, match=r"test.json user 'ROLE'.*'\u00e9' is not one"):
        Shakespeare(root=str(tmp_path)).load(seed=0)
    write(tmp_path / "test" / "test.json", {"ROLE": {"x": ["a" * 79], "y": ["a"]}})
    with pytest.raises(ConfigError, match="80-character strings"):
        Shakespeare(root=str(tmp_path)).load(seed=0)


def test_leafs_models_have_their_published_parameter_counts():
    # conv1 5*5*1*32 + 32 = 832; conv2 5*5*32*64 + 64 = 51,264; dense 3136*2048 + 2048 = 6,424,576;
    # out 2048*62 + 62 = 127,038; total 6,603,710.
    assert count_parameters(LeafCNN((1, 28, 28), 62)) == 6_603_710
    # embedding 80*8 = 640; LSTM 1: 4*256*(8 + 256) + 2*4*256 = 272,384; LSTM 2: 4*256*512 + 2048 = 526,336;
    # dense 256*80 + 80 = 20,560; total 819,920.
    assert count_parameters(CharLSTM((80,), 80)) == 819_920
    assert LeafCNN((1, 28, 28), 62)(torch.zeros(3, 1, 28, 28)).shape == (3, 62)


def test_the_lstm_predicts_the_next_symbol_from_the_last_step_and_its_gradient_checks():
    torch.manual_seed(0)
    model = CharLSTM((80,), 80)
    x = torch.randint(0, 80, (5, 80))
    assert model(x).shape == (5, 80)
    small = CharLSTM((6,), 7, embedding=3, hidden=4, layers=2).double()
    x, y = torch.randint(0, 7, (3, 6)), torch.randint(0, 7, (3,))
    names = [name for name, _ in small.named_parameters()]
    shapes = [p.shape for p in small.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in small.parameters()]).requires_grad_()

    def loss(w):
        parts, offset = {}, 0
        for name, shape in zip(names, shapes):
            parts[name] = w[offset : offset + shape.numel()].view(shape)
            offset += shape.numel()
        return torch.nn.functional.cross_entropy(torch.func.functional_call(small, parts, (x,)), y)

    assert torch.autograd.gradcheck(loss, (flat,), eps=1e-6, atol=1e-5)


def test_vmap_refuses_the_lstm_in_one_line_and_the_other_backends_agree():
    make = functools.partial(torch.optim.SGD, lr=0.5)
    assert "recurrent" in vmap_supported(make, CharLSTM((10,), 12, hidden=8))
    from fedrun.aggregators import FedAvg
    from fedrun.datasets import FederatedData
    from fedrun.engine import run
    from fedrun.rounds import Schedule

    g = torch.Generator().manual_seed(0)
    data = FederatedData(
        torch.randint(0, 12, (40, 10), generator=g),
        torch.randint(0, 12, (40,), generator=g),
        torch.randint(0, 12, (8, 10), generator=g),
        torch.randint(0, 12, (8,), generator=g),
        num_classes=12,
    )
    clients = [np.arange(10 * i, 10 * i + 10) for i in range(4)]
    results = []
    for backend in ("loop", "processes"):
        torch.manual_seed(0)
        model = CharLSTM((10,), 12, hidden=8).double()
        schedule = Schedule(rounds=2, local_epochs=1, batch_size=5, clients_per_round=0.5)
        device = Device("cpu", backend=backend, workers=2)
        results.append(run(model, data, clients, Parts(FedAvg()), make, schedule, device, seed=0).params)
    assert torch.allclose(results[0], results[1], atol=1e-10)


def test_the_vmap_backend_trains_leafs_cnn_as_the_loop_does():
    from fedrun.aggregators import FedAvg
    from fedrun.datasets import FederatedData
    from fedrun.engine import run
    from fedrun.rounds import Schedule

    g = torch.Generator().manual_seed(0)
    data = FederatedData(
        torch.rand(30, 1, 8, 8, generator=g, dtype=torch.float64),
        torch.randint(0, 5, (30,), generator=g),
        torch.rand(6, 1, 8, 8, generator=g, dtype=torch.float64),
        torch.randint(0, 5, (6,), generator=g),
        num_classes=5,
    )
    clients = [np.arange(0, 12), np.arange(12, 19), np.arange(19, 30)]  # unequal: padded and masked by vmap
    results = []
    for backend in ("loop", "vmap"):
        torch.manual_seed(0)
        model = LeafCNN((1, 8, 8), 5).double()
        schedule = Schedule(rounds=2, local_epochs=1, batch_size=4)
        device = Device("cpu", backend=backend, memory_format="contiguous")
        make = functools.partial(torch.optim.SGD, lr=0.1)
        results.append(run(model, data, clients, Parts(FedAvg()), make, schedule, device, seed=0).params)
    assert torch.allclose(results[0], results[1], atol=1e-10)


def test_samples_that_would_not_fit_in_memory_are_refused_before_they_are_allocated(tmp_path, monkeypatch):
    import fedrun.leaf as leaf

    femnist_files(tmp_path)
    monkeypatch.setattr(leaf, "most_clients", lambda: (0, 12 * 784 * 4 - 1))  # a byte short of the 12 training samples
    with pytest.raises(ConfigError, match=r"fit this machine's memory \(0.0 GB for 12 samples"):
        FEMNIST(root=str(tmp_path)).load(seed=0)
