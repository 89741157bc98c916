"""Datasets: each option of the ``dataset`` group loads whole splits as in-memory tensors.

A loaded dataset is plain data (``FederatedData``); clients are index arrays into its training tensors.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from fedrun.errors import check
from fedrun.lazy import torch
from fedrun.seeding import numpy_rng


@dataclass
class FederatedData:
    """Train, test and optional validation tensors of one dataset.

    Attributes:
        x_train, y_train: Training inputs (float32, in the dataset's ``scale``) and labels (int64).
        x_test, y_test: Test split.
        x_val, y_val: Validation split held out of train, or None.
        num_classes: Number of classes.
        natural_split: For datasets that come split per client, one index array into train per client.
        client_tests_in: Which split the run's ``client_tests`` index: ``train`` (held out of each client's training
            samples, ``client_test_fraction``) or ``test`` (each LEAF user's own test samples, ``client_tests``).
        root: The server's root set (FLTrust): indices into train that no client holds, or None.
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    x_val: torch.Tensor | None = None
    y_val: torch.Tensor | None = None
    natural_split: list[np.ndarray] | None = field(default=None, repr=False)
    client_tests_in: str = "train"
    root: np.ndarray | None = field(default=None, repr=False)

    def held_out(self, x_train, y_train, x_test, y_test):
        """Of the (prepared) tensors, the pair that ``client_tests`` index."""
        return (x_test, y_test) if self.client_tests_in == "test" else (x_train, y_train)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


class Dataset:
    """Base of the ``dataset`` group: subclasses implement ``_splits``.

    Args:
        val_fraction: Fraction of the training split held out as a validation split, in [0, 1).
        client_test_fraction: Fraction of each client's samples held out as its own test split, in
            [0, 1); > 0 logs ``client_accuracy`` (the loss-weighted papers' accuracy) and judges every client's
            model on it each evaluated round (the ``personal/`` columns; PFLlib holds out 0.25).
        client_val_fraction: Fraction of each client's remaining training samples held out as its own
            validation split, in [0, 1), with ``client_test_fraction`` > 0: the ``personal/val_`` columns, on
            which a run's round is selected (never on test).
    """

    def __init__(self, val_fraction: float = 0.0, client_test_fraction: float = 0.0, client_val_fraction: float = 0.0):
        check(0.0 <= val_fraction < 1.0, "val_fraction", val_fraction, "a fraction in [0, 1)")
        check(0.0 <= client_test_fraction < 1.0, "client_test_fraction", client_test_fraction, "a fraction in [0, 1)")
        check(0.0 <= client_val_fraction < 1.0, "client_val_fraction", client_val_fraction, "a fraction in [0, 1)")
        self.val_fraction, self.client_test_fraction = val_fraction, client_test_fraction
        self.client_val_fraction = client_val_fraction

    def _splits(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[np.ndarray] | None]:
        """Returns (x_train, y_train, x_test, y_test, natural_split or None)."""
        raise NotImplementedError

    @property
    def num_classes(self) -> int:
        raise NotImplementedError

    def load(self, seed: int) -> FederatedData:
        """Load the splits and hold out the validation split with the run seed's ``validation`` stream."""
        x_train, y_train, x_test, y_test, natural = self._splits()
        data = FederatedData(x_train, y_train, x_test, y_test, self.num_classes, natural_split=natural)
        if self.val_fraction > 0:
            _hold_out_validation(data, self.val_fraction, numpy_rng(seed, "validation"))
        return data


def _hold_out_validation(data: FederatedData, fraction: float, rng: np.random.Generator) -> None:
    n = len(data.y_train)
    is_val = np.zeros(n, dtype=bool)
    is_val[rng.permutation(n)[: int(round(fraction * n))]] = True
    keep = np.flatnonzero(~is_val)
    data.x_val, data.y_val = data.x_train[is_val], data.y_train[is_val]
    data.x_train, data.y_train = data.x_train[keep], data.y_train[keep]
    if data.natural_split is not None:
        # Re-index each client's samples into the reduced training split.
        new_index = np.full(n, -1)
        new_index[keep] = np.arange(len(keep))
        data.natural_split = [new_index[idx[~is_val[idx]]] for idx in data.natural_split]


def _standardise(x: torch.Tensor, mean, std) -> torch.Tensor:
    shape = (1, -1) + (1,) * (x.dim() - 2)
    return (x - torch.as_tensor(mean).view(shape)) / torch.as_tensor(std).view(shape)


SCALES = ("standard", "unit", "raw")
SCALE_NAMES = {"standard": "standardised", "unit": "pixels / max, in [0, 1]", "raw": "raw pixel values"}


def _check_scale(scale: str) -> str:
    check(
        scale in SCALES,
        "scale",
        scale,
        "standard (per-channel standardisation), unit (pixels / max, in [0, 1]) or raw (the stored values)",
    )
    return scale


def _scaled(raw: torch.Tensor, maximum: float, scale: str, mean, std) -> torch.Tensor:
    """Image pixels as stored (0..maximum) in the chosen scale: ``raw`` as they are (the loss-weighted papers'
    code feeds MNIST's 0-255 as floats), ``unit`` divided by ``maximum``, ``standard`` then standardised."""
    if scale == "raw":
        return raw
    unit = raw / maximum
    return unit if scale == "unit" else _standardise(unit, mean, std)


class Digits(Dataset):
    """scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes): embedded, works offline.

    Args:
        test_fraction: Fraction held out as the test split (stratified, fixed by ``split_seed``).
        split_seed: Seed of the train/test split, fixed so every run sees the same test set.
        scale: ``standard`` (standardised by the training split's mean and std), ``unit`` (pixels / 16, in
            [0, 1]) or ``raw`` (the stored 0-16 values).
        val_fraction, client_test_fraction, client_val_fraction: See ``Dataset``.
    """

    def __init__(
        self,
        test_fraction: float = 0.2,
        split_seed: int = 0,
        scale: str = "standard",
        val_fraction: float = 0.0,
        client_test_fraction: float = 0.0,
        client_val_fraction: float = 0.0,
    ):
        super().__init__(val_fraction, client_test_fraction, client_val_fraction)
        check(0.0 < test_fraction < 1.0, "test_fraction", test_fraction, "a fraction in (0, 1)")
        self.test_fraction, self.split_seed, self.scale = test_fraction, split_seed, _check_scale(scale)

    num_classes = 10

    def _splits(self):
        images, target = load_digits()
        raw = torch.tensor(images, dtype=torch.float32).unsqueeze(1)  # 0-16
        y = torch.tensor(target, dtype=torch.int64)
        train, test = stratified_split(target, self.test_fraction, self.split_seed)
        # Standardise with the training split's own statistics (there is no published constant for digits).
        unit = raw[train] / 16.0
        x = _scaled(raw, 16.0, self.scale, [unit.mean().item()], [unit.std().item()])
        return x[train], y[train], x[test], y[test], None


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits as ``sklearn.datasets.load_digits`` returns them (``images``, 1797 x 8 x 8
    float64 in 0-16, and ``target``), read from the CSV scikit-learn ships without importing scikit-learn, whose
    import took 0.8 s of every run's start on an idle 2-core machine after MLflow's SciPy (more with tracking off,
    SciPy with it); ``load_digits`` itself where the file is not where scikit-learn keeps it.
    ``tests/unit/test_datasets_models.py`` holds both equal."""
    spec = importlib.util.find_spec("sklearn")
    path = Path(next(iter(spec.submodule_search_locations or []), "")) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        from sklearn import datasets

        digits = datasets.load_digits()
        return digits.images, digits.target
    data = np.loadtxt(path, delimiter=",")  # as load_digits: 64 pixels then the label, one image a row
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The train and test indices of ``sklearn.model_selection.train_test_split(np.arange(n), test_size=
    test_fraction, stratify=labels, random_state=seed)``, draw for draw: scikit-learn 1.9's
    ``StratifiedShuffleSplit._iter_indices`` and ``_approximate_mode`` with one ``RandomState(seed)``. Written
    here for the start-up time of importing scikit-learn (``load_digits``); ``tests/unit/test_datasets_models.py`` holds
    it equal to scikit-learn's own for several fractions and seeds, so a change there shows."""
    n_test = math.ceil(test_fraction * len(labels))
    n_train = len(labels) - n_test
    classes, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    check(
        min(n_train, n_test) >= len(classes),
        "dataset.test_fraction",
        test_fraction,
        f"a fraction leaving each split at least as many samples as the {len(classes)} classes",
    )
    by_class = np.split(np.argsort(inverse, kind="stable"), np.cumsum(counts)[:-1])
    rng = np.random.RandomState(seed)
    train_counts = _approximate_mode(counts, n_train, rng)
    test_counts = _approximate_mode(counts - train_counts, n_test, rng)
    train, test = [], []
    for indices, n_i, t_i, count in zip(by_class, train_counts, test_counts, counts):
        drawn = indices.take(rng.permutation(count), mode="clip")
        train.extend(drawn[:n_i])
        test.extend(drawn[n_i : n_i + t_i])
    return rng.permutation(train), rng.permutation(test)


def _approximate_mode(counts: np.ndarray, draws: int, rng: np.random.RandomState) -> np.ndarray:
    """scikit-learn's ``_approximate_mode``: each class's share of ``draws`` floored, the rest given by largest
    remainder, ties broken by ``rng``."""
    continuous = counts / counts.sum() * draws
    floored = np.floor(continuous)
    need = int(draws - floored.sum())
    if need > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (tied,) = np.where(remainder == value)
            now = min(len(tied), need)
            floored[rng.choice(tied, size=now, replace=False)] += 1
            need -= now
            if need == 0:
                break
    return floored.astype(int)


def default_root() -> Path:
    """``$FEDRUN_DATA`` when set, else ``data/`` under the working directory."""
    return Path(os.environ.get("FEDRUN_DATA") or "data")


class TorchvisionImages(Dataset):
    """An image dataset from torchvision's on-disk layout.

    Verified local files under ``root`` are used first; the network is tried only when they are missing
    and ``download`` is true. When neither works, the error names the files to put where.

    Args:
        root: Folder holding ``<ClassName>/raw/`` (MNIST, FashionMNIST) or ``cifar-10-batches-py/``;
            None means ``$FEDRUN_DATA`` or ``data/`` under the working directory.
        download: Whether to try the network when local files are missing.
        scale: ``standard`` (pixels / 255, standardised with the dataset's published per-channel mean and
            std), ``unit`` (pixels / 255, in [0, 1]) or ``raw`` (0-255 as floats, as the loss-weighted papers'
            code feeds MNIST and Fashion-MNIST: their ``src/datasets.py`` neither divides nor normalises).
        val_fraction, client_test_fraction, client_val_fraction: See ``Dataset``.
    """

    torchvision_class: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    num_classes = 10

    def __init__(
        self,
        root: str | None = None,
        download: bool = True,
        scale: str = "standard",
        val_fraction: float = 0.0,
        client_test_fraction: float = 0.0,
        client_val_fraction: float = 0.0,
    ):
        super().__init__(val_fraction, client_test_fraction, client_val_fraction)
        self.root = Path(root).expanduser() if root else default_root()
        self.download, self.scale = download, _check_scale(scale)

    def _torchvision(self, train: bool, download: bool):
        import torchvision.datasets

        cls = getattr(torchvision.datasets, self.torchvision_class)
        return cls(str(self.root), train=train, download=download)

    def _local_files_verified(self) -> bool:
        raise NotImplementedError

    def _expected_files(self) -> str:
        raise NotImplementedError

    def _open(self, train: bool):
        verified = self._local_files_verified()
        try:
            # torchvision skips the network for files whose MD5 already matches, so download=True with
            # verified local archives only extracts them.
            return self._torchvision(train, download=verified or self.download)
        except Exception as exc:
            tried = "the download failed too" if self.download else "dataset.download=false"
            raise FileNotFoundError(
                f"{self.torchvision_class} not found under {self.root.resolve()} ({tried}: {exc.__class__.__name__}). "
                f"Put {self._expected_files()} there, or point dataset.root (or the FEDRUN_DATA variable) "
                f"at a folder that holds them, or run once with internet and dataset.download=true."
            ) from None

    def _tensors(self, ds) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.as_tensor(np.asarray(ds.data), dtype=torch.float32)
        x = x.unsqueeze(1) if x.dim() == 3 else x.permute(0, 3, 1, 2)  # to N x C x H x W
        return _scaled(x, 255.0, self.scale, self.mean, self.std).contiguous(), torch.as_tensor(np.asarray(ds.targets))

    def _splits(self):
        x_train, y_train = self._tensors(self._open(train=True))
        x_test, y_test = self._tensors(self._open(train=False))
        return x_train, y_train.long(), x_test, y_test.long(), None


class _IdxImages(TorchvisionImages):
    """MNIST-format datasets: four gzipped IDX files under ``<root>/<ClassName>/raw/``.

    Files whose MD5 matches torchvision's are read here (``read_idx``); torchvision is imported only to download
    or to read a folder that holds the extracted files alone. Importing it costs 1.7-2.3 s of every run's start
    on two cores (``torchvision/__init__`` imports its models, whose ``ops.roi_align`` imports ``torch._dynamo``),
    against 0.2 s to decompress the files; what each gives is equal (tests/unit/test_datasets_models.py)."""

    files: tuple[tuple[str, str], ...]  # torchvision.datasets.<ClassName>.resources (equal: a test)

    def _raw(self) -> Path:
        return self.root / self.torchvision_class / "raw"

    def _local_files_verified(self) -> bool:
        return all(_md5(self._raw() / name) == md5 for name, md5 in self.files)

    def _expected_files(self) -> str:
        return f"{', '.join(name for name, _ in self.files)} in {self._raw()}/"

    def _open(self, train: bool):
        if not self._local_files_verified():
            return super()._open(train)
        split = "train" if train else "t10k"
        images, labels = (read_idx(self._raw() / f"{split}-{kind}-ubyte.gz") for kind in ("images-idx3", "labels-idx1"))
        check(len(images) == len(labels), "dataset.root", str(self.root), f"as many {split} labels as images")
        return SimpleNamespace(data=images, targets=labels.astype(np.int64))


def _md5(path: Path) -> str | None:
    """The file's MD5 (as torchvision's ``check_integrity`` checks it), or None when it is not there."""
    return hashlib.md5(path.read_bytes(), usedforsecurity=False).hexdigest() if path.is_file() else None


def read_idx(path: Path) -> np.ndarray:
    """An unsigned-byte array from a gzipped IDX file (LeCun and Cortes's MNIST format, as
    ``torchvision.datasets.mnist.read_sn3_pascalvincent_tensor`` reads it): two zero bytes, the type (0x08:
    unsigned byte, the only one MNIST and Fashion-MNIST use), the number of dimensions, each a big-endian 32-bit
    size, then the values."""
    with gzip.open(path, "rb") as handle:
        data = bytearray(handle.read())  # writable: torch takes the array without a copy or a warning
    kind, ndim = data[2], data[3]
    check(
        data[:2] == b"\x00\x00" and kind == 0x08 and 1 <= ndim <= 3, "dataset.root", str(path), "an IDX file of bytes"
    )
    shape = tuple(int(n) for n in np.frombuffer(data, ">u4", ndim, 4))
    check(len(data) == 4 + 4 * ndim + math.prod(shape), "dataset.root", str(path), f"an IDX file of {shape} bytes")
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape)


class MNIST(_IdxImages):
    torchvision_class = "MNIST"
    files = (
        ("train-images-idx3-ubyte.gz", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
        ("train-labels-idx1-ubyte.gz", "d53e105ee54ea40749a09fcbcd1e9432"),
        ("t10k-images-idx3-ubyte.gz", "9fb629c4189551a2d022fa330f9573f3"),
        ("t10k-labels-idx1-ubyte.gz", "ec29112dd5afa0611ce80d1b7f02629c"),
    )
    mean, std = (0.1307,), (0.3081,)


class FashionMNIST(_IdxImages):
    torchvision_class = "FashionMNIST"
    files = (
        ("train-images-idx3-ubyte.gz", "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
        ("train-labels-idx1-ubyte.gz", "25c81989df183df01b3e8a0aad5dffbe"),
        ("t10k-images-idx3-ubyte.gz", "bef4ecab320f06d8554ea6380940ec79"),
        ("t10k-labels-idx1-ubyte.gz", "bb300cfdad3c16e7a12a480ee83cd310"),
    )
    mean, std = (0.2860,), (0.3530,)


class CIFAR10(TorchvisionImages):
    torchvision_class = "CIFAR10"
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)

    def _local_files_verified(self) -> bool:
        import torchvision.datasets
        from torchvision.datasets.utils import check_integrity

        cls = torchvision.datasets.CIFAR10
        batches = self.root / cls.base_folder
        extracted = all(check_integrity(str(batches / name), md5) for name, md5 in cls.train_list + cls.test_list)
        return extracted or check_integrity(str(self.root / cls.filename), cls.tgz_md5)

    def _expected_files(self) -> str:
        return (
            f"cifar-10-python.tar.gz (MD5 c58f30108f718f92721af3b95e74349a) in {self.root}/, or its extracted "
            f"data_batch_1..5, test_batch and batches.meta in {self.root / 'cifar-10-batches-py'}/"
        )


class Synthetic(Dataset):
    """Synthetic(alpha, beta) of the FedProx paper (Li et al. 2020), generated per client.

    For client k: u_k ~ N(0, alpha), B_k ~ N(0, beta); W_k, b_k ~ N(u_k, 1); v_k ~ N(B_k, 1);
    x ~ N(v_k, Sigma) with Sigma_jj = j^-1.2; y = argmax(W_k x + b_k). Client sizes follow the
    paper's code: lognormal(4, 2) + 50. With ``iid`` every client shares one W, b and v = 0
    (the paper's Synthetic-IID). Each client's samples are split into train and test.

    Args:
        alpha: How much the local models differ across clients.
        beta: How much the local input distributions differ across clients.
        num_clients: Number of clients generated (use ``partition=natural``).
        dim: Feature dimension.
        classes: Number of classes.
        iid: Generate the Synthetic-IID variant instead.
        test_fraction: Fraction of each client's samples held out for the test split.
        data_seed: Seed of the generator, fixed so that run seeds vary training, not the data.
        val_fraction, client_test_fraction, client_val_fraction: See ``Dataset``.
    """

    def __init__(
        self,
        alpha: float = 1.0,
        beta: float = 1.0,
        num_clients: int = 30,
        dim: int = 60,
        classes: int = 10,
        iid: bool = False,
        test_fraction: float = 0.2,
        data_seed: int = 0,
        val_fraction: float = 0.0,
        client_test_fraction: float = 0.0,
        client_val_fraction: float = 0.0,
    ):
        super().__init__(val_fraction, client_test_fraction, client_val_fraction)
        check(alpha >= 0, "alpha", alpha, "a number >= 0")
        check(beta >= 0, "beta", beta, "a number >= 0")
        check(num_clients >= 1, "num_clients", num_clients, "an integer >= 1")
        check(dim >= 1, "dim", dim, "an integer >= 1")
        check(classes >= 2, "classes", classes, "an integer >= 2")
        check(0.0 < test_fraction < 1.0, "test_fraction", test_fraction, "a fraction in (0, 1)")
        self.alpha, self.beta, self.num_clients, self.dim = alpha, beta, num_clients, dim
        self.classes, self.iid, self.test_fraction, self.data_seed = classes, iid, test_fraction, data_seed

    @property
    def num_classes(self) -> int:
        return self.classes

    def _splits(self):
        rng = np.random.default_rng(self.data_seed)
        sizes = rng.lognormal(4, 2, self.num_clients).astype(int) + 50
        sigma = np.arange(1, self.dim + 1) ** -1.2
        shared_w = rng.normal(0, 1, (self.classes, self.dim))
        shared_b = rng.normal(0, 1, self.classes)
        train_x, train_y, test_x, test_y, natural, offset = [], [], [], [], [], 0
        for size in sizes:
            if self.iid:
                w, b, v = shared_w, shared_b, np.zeros(self.dim)
            else:
                u, big_b = rng.normal(0, np.sqrt(self.alpha)), rng.normal(0, np.sqrt(self.beta))
                w, b = rng.normal(u, 1, (self.classes, self.dim)), rng.normal(u, 1, self.classes)
                v = rng.normal(big_b, 1, self.dim)
            x = rng.normal(v, np.sqrt(sigma), (size, self.dim))
            y = np.argmax(x @ w.T + b, axis=1)
            n_test = max(1, int(round(self.test_fraction * size)))
            train_x.append(x[n_test:]), train_y.append(y[n_test:])
            test_x.append(x[:n_test]), test_y.append(y[:n_test])
            natural.append(np.arange(offset, offset + size - n_test))
            offset += size - n_test
        as_x = lambda parts: torch.tensor(np.concatenate(parts), dtype=torch.float32)  # noqa: E731
        as_y = lambda parts: torch.tensor(np.concatenate(parts), dtype=torch.int64)  # noqa: E731
        return as_x(train_x), as_y(train_y), as_x(test_x), as_y(test_y), natural
