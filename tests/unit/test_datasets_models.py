import gzip
import os
import shutil

import numpy as np
import pytest
import torch

from fedrun.datasets import MNIST, Digits, FashionMNIST, Synthetic, load_digits, stratified_split
from fedrun.errors import ConfigError
from fedrun.models import CNN, MLP, BatchSoftmax, FedAvgCNN, Logistic, count_parameters


def test_digits_splits_and_normalisation():
    data = Digits().load(seed=0)
    assert data.input_shape == (1, 8, 8) and data.num_classes == 10
    assert len(data.y_train) + len(data.y_test) == 1797 and abs(len(data.y_test) - 360) <= 1
    assert abs(data.x_train.mean().item()) < 1e-4 and abs(data.x_train.std().item() - 1) < 1e-3
    assert data.x_val is None


def test_digits_are_scikit_learns_and_the_split_is_train_test_split_draw_for_draw():
    """The fast path (scikit-learn's CSV read directly, its stratified split written out) against scikit-learn's own
    functions: the same images and labels, and the same index arrays in the same order for several fractions and
    seeds (and a made-up label vector with uneven classes and tied remainders)."""
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    images, target = load_digits()
    reference = sklearn_digits()
    assert np.array_equal(images, reference.images) and np.array_equal(target, reference.target)
    assert images.dtype == reference.images.dtype and target.dtype == reference.target.dtype
    uneven = np.repeat([0, 1, 2, 3], [7, 11, 3, 19])
    for labels in (target, uneven):
        for fraction in (0.2, 0.25, 0.1, 0.5, 0.333):
            for seed in (0, 1, 7):
                ours = stratified_split(labels, fraction, seed)
                theirs = train_test_split(
                    np.arange(len(labels)), test_size=fraction, stratify=labels, random_state=seed
                )
                assert all(np.array_equal(a, b) for a, b in zip(ours, theirs)), (fraction, seed)
    with pytest.raises(ConfigError, match=r"^dataset.test_fraction=0.99 is invalid: allowed is a fraction leaving"):
        stratified_split(uneven, 0.99, 0)


def test_scale_raw_is_255_or_16_times_unit_on_the_same_samples_and_standard_is_unit_standardised():
    raw, unit, standard = (Digits(scale=s).load(seed=0) for s in ("raw", "unit", "standard"))
    assert raw.x_train.max().item() == 16.0 and unit.x_train.max().item() == 1.0  # digits store 0-16
    assert torch.equal(raw.x_test, unit.x_test * 16) and torch.equal(raw.y_train, unit.y_train)
    mean, std = unit.x_train.mean(), unit.x_train.std()  # standard: by the training split's own statistics
    torch.testing.assert_close(standard.x_train, (unit.x_train - mean) / std)
    with pytest.raises(ConfigError, match=r"^scale='pixels' is invalid: allowed is standard .*, unit .* or raw"):
        Digits(scale="pixels")


@pytest.mark.skipif(not os.environ.get("FEDRUN_DATA"), reason="needs MNIST under $FEDRUN_DATA")
def test_mnist_raw_is_255_times_unit_as_the_authors_code_feeds_it():
    raw, unit, standard = (MNIST(download=False, scale=s).load(seed=0) for s in ("raw", "unit", "standard"))
    assert raw.x_train.dtype == torch.float32 and raw.x_train.max().item() == 255.0 and raw.x_train.min().item() == 0.0
    torch.testing.assert_close(raw.x_train, unit.x_train * 255, rtol=0, atol=1e-4)  # k / 255 * 255 is k up to rounding
    torch.testing.assert_close(raw.x_test, unit.x_test * 255, rtol=0, atol=1e-4)
    torch.testing.assert_close(standard.x_train, (unit.x_train - 0.1307) / 0.3081)  # torchvision's published constants
    assert torch.equal(raw.y_train, unit.y_train)


def test_validation_split_is_held_out_of_train_by_seed():
    a, b = Digits(val_fraction=0.1).load(seed=0), Digits(val_fraction=0.1).load(seed=1)
    assert len(a.y_val) == round(0.1 * 1437) and len(a.y_train) == 1437 - len(a.y_val)
    assert not torch.equal(a.x_val, b.x_val)


def test_synthetic_comes_split_and_val_keeps_the_split_consistent():
    data = Synthetic(num_clients=5, val_fraction=0.2).load(seed=0)
    assert data.input_shape == (60,)
    sizes = [len(p) for p in data.natural_split]
    assert sum(sizes) == len(data.y_train)
    assert len(np.unique(np.concatenate(data.natural_split))) == len(data.y_train)
    # data is fixed by data_seed, not the run seed
    assert torch.equal(Synthetic(num_clients=5).load(0).x_train, Synthetic(num_clients=5).load(7).x_train)


@pytest.mark.skipif(not os.environ.get("FEDRUN_DATA"), reason="needs MNIST and Fashion-MNIST under $FEDRUN_DATA")
@pytest.mark.parametrize("cls", [MNIST, FashionMNIST])
def test_idx_files_read_without_torchvision_equal_torchvisions_dataset(cls, tmp_path):
    """fedrun reads verified gzipped IDX files itself (importing torchvision costs 2 s of a run's start): the images
    and labels equal torchvision's own dataset's, bit for bit, for both splits; the MD5s checked are torchvision's;
    a folder with the extracted files alone is still read, through torchvision."""
    import torchvision.datasets

    tv = getattr(torchvision.datasets, cls.torchvision_class)
    assert cls.files == tuple(tv.resources)
    ours = cls(download=False)
    # torchvision's dataset from copies of the same archives: their MD5s match, so download=True only extracts them
    # (no network), as fedrun used to have it do
    theirs_raw = tmp_path / "torchvision" / cls.torchvision_class / "raw"
    theirs_raw.mkdir(parents=True)
    for name, _ in cls.files:
        shutil.copyfile(ours._raw() / name, theirs_raw / name)
    for train in (True, False):
        mine, theirs = ours._open(train), tv(str(tmp_path / "torchvision"), train=train, download=True)
        assert isinstance(mine.data, np.ndarray)  # the IDX reader's, not torchvision's (its data is a tensor)
        assert torch.equal(torch.as_tensor(mine.data), theirs.data)
        assert torch.equal(torch.as_tensor(mine.targets), theirs.targets)
    extracted_raw = tmp_path / "extracted" / cls.torchvision_class / "raw"
    extracted_raw.mkdir(parents=True)
    for name, _ in cls.files:  # the files torchvision extracted, alone: read through torchvision
        shutil.copyfile(theirs_raw / name.removesuffix(".gz"), extracted_raw / name.removesuffix(".gz"))
    extracted = cls(root=str(tmp_path / "extracted"), download=False)
    assert not extracted._local_files_verified()
    assert torch.equal(extracted._open(train=False).data, theirs.data)  # theirs: the test split, the loop's last


def test_a_bad_idx_file_is_one_line(tmp_path):
    from fedrun.datasets import read_idx

    path = tmp_path / "x.gz"
    path.write_bytes(gzip.compress(b"\x00\x00\x08\x01" + (3).to_bytes(4, "big") + b"\x01\x02\x03"))
    assert read_idx(path).tolist() == [1, 2, 3]
    path.write_bytes(gzip.compress(b"\x00\x00\x08\x01" + (4).to_bytes(4, "big") + b"\x01\x02\x03"))  # one short
    with pytest.raises(ConfigError, match="an IDX file of \\(4,\\) bytes"):
        read_idx(path)
    path.write_bytes(gzip.compress(b"\x00\x00\x0d\x01" + (1).to_bytes(4, "big") + bytes(4)))  # float32: not MNIST's
    with pytest.raises(ConfigError, match="an IDX file of bytes"):
        read_idx(path)


def test_missing_files_give_one_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        MNIST(root=str(tmp_path), download=False).load(seed=0)
    message = str(info.value)
    assert "train-images-idx3-ubyte.gz" in message and str(tmp_path / "MNIST" / "raw") in message
    assert "\n" not in message


def test_cnn_matches_the_papers_and_adapts_to_8x8():
    paper = CNN((1, 28, 28), 10)
    assert paper.padding == 0 and paper[-1].in_features == 1600
    assert paper(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    digits = CNN((1, 8, 8), 10)
    assert digits.padding == 1 and digits(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    with pytest.raises(ConfigError, match="padding"):
        CNN((1, 8, 8), 10, padding=0)
    with pytest.raises(ConfigError, match="mlp or logistic"):
        CNN((60,), 10)


def test_fedavg_cnn_is_pfllibs_with_its_sizes_and_names():
    # PFLlib's FedAvgCNN(in_features=1, num_classes=10, dim=1024): 28 -conv5-> 24 -pool-> 12 -conv5-> 8 -pool-> 4, so
    # 64 * 4 * 4 = 1024 features; parameters by hand: conv1 25*32+32, conv2 25*32*64+64, fc1 1024*512+512, fc 512*10+10
    model = FedAvgCNN((1, 28, 28), 10)
    assert count_parameters(model) == (25 * 32 + 32) + (25 * 32 * 64 + 64) + (1024 * 512 + 512) + (512 * 10 + 10)
    assert count_parameters(model) == 582_026
    assert [n for n, _ in model.named_parameters()][-2:] == ["fc.weight", "fc.bias"]  # PFLlib's head
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    assert model.fc1.in_features == 1024 and FedAvgCNN((3, 32, 32), 10).fc1.in_features == 1600  # PFLlib's CIFAR dim
    with pytest.raises(ConfigError, match="model='fedavg_cnn'.*16x16"):
        FedAvgCNN((1, 8, 8), 10)


def test_batch_softmax_normalises_each_class_over_the_batch_as_the_authors_convnet():
    # 2 samples, 2 classes, scores z = [[0, ln 3], [0, 0]]. Softmax over dim 0, column by column:
    # class 0: e^0 / (e^0 + e^0) = 0.5 for both; class 1: 3 / (3 + 1) = 0.75 and 1 / 4 = 0.25.
    out = BatchSoftmax()(torch.tensor([[0.0, np.log(3.0)], [0.0, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(out, torch.tensor([[0.5, 0.75], [0.5, 0.25]], dtype=torch.float64))
    # Their loss is CrossEntropyLoss on those outputs: sample 0, label 1: -log(e^0.75 / (e^0.5 + e^0.75))
    # = log(1 + e^-0.25) = log(1.778801) = 0.575939.
    loss = torch.nn.functional.cross_entropy(out, torch.tensor([1, 0]), reduction="none")
    assert loss[0].item() == pytest.approx(0.575939, abs=1e-6)
    # The CNN with head=batch_softmax is the logits CNN followed by that softmax, on the same weights.
    torch.manual_seed(0)
    logits = CNN((1, 28, 28), 10)
    theirs = CNN((1, 28, 28), 10, head="batch_softmax", eval_batch=3)
    theirs.load_state_dict(logits.state_dict())
    x = torch.rand(5, 1, 28, 28) * 255
    torch.testing.assert_close(theirs(x), torch.softmax(logits(x), dim=0))
    assert theirs.eval_batch == 3 and not hasattr(logits, "eval_batch")
    with pytest.raises(ConfigError, match=r"head='softmax' is invalid: allowed is logits .* or batch_softmax"):
        CNN((1, 28, 28), 10, head="softmax")


def test_with_a_batch_softmax_head_predictions_are_made_in_the_model_s_eval_batch():
    # Outputs depend on the batch, so fedrun's inference uses the model's eval_batch, not its own chunking.
    from fedrun.clients import per_sample_loss
    from fedrun.models import flat_parameters

    torch.manual_seed(1)
    model = CNN((1, 28, 28), 10, head="batch_softmax", eval_batch=4)
    x, y = torch.rand(10, 1, 28, 28) * 255, torch.randint(0, 10, (10,))
    loss, correct = per_sample_loss(model, flat_parameters(model), x, y)
    with torch.no_grad():  # batches of 4, 4 and 2, as their test loader would cut them
        out = torch.cat([model(x[i : i + 4]) for i in (0, 4, 8)])
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(out, y, reduction="none"))
    assert torch.equal(correct, out.argmax(1) == y)
    with torch.no_grad():
        whole = model(x)  # one batch of 10 gives other outputs: the chunking is not a detail
    assert not torch.allclose(whole, out)
    # F_i(w) passes each client alone: a client's loss never depends on a neighbour's samples.
    from fedrun.clients import cohort_losses

    parts = [np.arange(0, 3), np.arange(3, 10)]
    losses = cohort_losses(model, flat_parameters(model), x, y, parts, batch_size=64)
    alone = [per_sample_loss(model, flat_parameters(model), x[p], y[p])[0].double().mean().item() for p in parts]
    np.testing.assert_allclose(losses.mean, alone, rtol=1e-12)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("model", ["cnn", "char_lstm"])
def test_inference_takes_the_loss_and_argmax_once_over_all_logits_equal_to_the_chunk_by_chunk_values(model, threads):
    # The fast path (one cross-entropy and one argmax over the concatenated logits) against the plain one (both per
    # chunk of eval_chunk, as until 2026-11-30): equal bit for bit, for a length that is not a multiple of the chunk.
    from fedrun.clients import eval_chunk, loaded_per_sample
    from fedrun.models import CharLSTM

    torch.manual_seed(3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if model == "cnn":
            net, classes = CNN((1, 28, 28), 10), 10
            x = torch.rand(150, 1, 28, 28) * 4 - 2
        else:
            net, classes = CharLSTM((20,), 80, hidden=32), 80
            x = torch.randint(0, 80, (150, 20))
        y = torch.randint(0, classes, (150,))
        net.eval()
        chunk = eval_chunk(net, x.device)
        with torch.inference_mode():
            loss, correct = loaded_per_sample(net, x, y)
            pieces = [(net(x[s : s + chunk]), y[s : s + chunk]) for s in range(0, len(y), chunk)]
            plain_loss = torch.cat([torch.nn.functional.cross_entropy(o, t, reduction="none") for o, t in pieces])
            plain_correct = torch.cat([o.argmax(1) == t for o, t in pieces])
    finally:
        torch.set_num_threads(before)
    assert len(pieces) == 3 and torch.equal(loss, plain_loss) and torch.equal(correct, plain_correct)
    assert 0 < int(correct.sum()) < 150 or model == "char_lstm"  # the CNN's guesses are neither all right nor wrong


def test_mlp_and_logistic_sizes():
    assert count_parameters(MLP((1, 28, 28), 10)) == 784 * 600 + 600 + 600 * 600 + 600 + 600 * 10 + 10
    assert count_parameters(Logistic((60,), 10)) == 610
