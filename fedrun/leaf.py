"""LEAF's naturally federated datasets (Caldas et al. 2018, github.com/TalwalkarLab/leaf), read from the files a
user already has: ``dataset=femnist`` and ``dataset=shakespeare``.

Layout, as LEAF's ``data/utils/split_data.py`` writes it: ``<root>/train/*.json`` and ``<root>/test/*.json``, each
``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}`` (a top-level
``hierarchies`` list, which only LEAF's unsplit Shakespeare file has, is ignored).

- FEMNIST: x is 784 floats in [0, 1], a 28x28 image as LEAF's ``data_to_json.py`` writes it (grey / 255, not
  inverted: the background is near 1); y is 0-61 (digits, upper case, lower case).
- Shakespeare: x is an 80-character string, y the next character; both map through LEAF's 80-symbol vocabulary
  (``ALL_LETTERS``, ``models/utils/language_utils.py`` line 11). LEAF maps a character outside it to -1, which its
  embedding lookup rejects; fedrun refuses such a file in one line naming the file, the user and the character.

One client per LEAF user (``partition=natural``), in file order. The test split is every user's test samples
together; ``natural_test_split`` keeps which are whose. Loading shows a progress bar over the files, and holds at
most one file's parsed JSON besides the tensors: each file's arrays are copied into the final tensors and freed
file by file, so the data is never held twice.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from fedrun.datasets import Dataset, default_root
from fedrun.errors import ConfigError, check
from fedrun.lazy import torch
from fedrun.partitions import most_clients

# LEAF models/utils/language_utils.py, line 11 (80 symbols; index 0 is the newline, 79 the closing brace).
ALL_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
SEQUENCE = 80  # Shakespeare's input length (LEAF baseline_constants.py: seq_len 80)
LAYOUT = '{"users": [names], "num_samples": [counts], "user_data": {name: {"x": [...], "y": [...]}}}'
_LOOKUP = np.full(256, -1, dtype=np.int64)
_LOOKUP[np.frombuffer(ALL_LETTERS.encode("ascii"), dtype=np.uint8)] = np.arange(len(ALL_LETTERS))


class Leaf(Dataset):
    """Base of the LEAF datasets: reads the JSON files; subclasses convert one user's x and y.

    Args:
        root: The folder holding ``train/`` and ``test/`` (LEAF's ``data/<name>/data``); null: ``$FEDRUN_DATA/<name>``
            or ``data/<name>`` under the working directory.
        client_tests: Each client's held-out data (``client_accuracy``) is its own LEAF test samples; needs
            ``partition=natural`` and ``client_test_fraction`` 0. A user with no test sample counts in no mean.
        val_fraction, client_test_fraction, client_val_fraction: See ``Dataset``.
    """

    folder: str  # under the default root
    sample_shape: tuple[int, ...]

    def __init__(
        self,
        root: str | None = None,
        client_tests: bool = False,
        val_fraction: float = 0.0,
        client_test_fraction: float = 0.0,
        client_val_fraction: float = 0.0,
    ):
        super().__init__(val_fraction, client_test_fraction, client_val_fraction)
        check(isinstance(client_tests, bool), "client_tests", client_tests, "true or false")
        check(
            not (client_tests and client_test_fraction > 0),
            "client_test_fraction",
            client_test_fraction,
            "0 with client_tests=true (each client's held-out data is then its LEAF test samples)",
        )
        self.root = Path(root).expanduser() if root else default_root() / self.folder
        self.client_tests = client_tests
        self.natural_test_split: list[np.ndarray] = []

    def convert(self, x: list, y: list, where: str) -> tuple[np.ndarray, np.ndarray]:
        """One user's samples as arrays (x in ``sample_shape``, y int64); ``where`` names them in errors."""
        raise NotImplementedError

    def files(self, split: str) -> list[Path]:
        folder = self.root / split
        found = sorted(folder.glob("*.json")) if folder.is_dir() else []
        if not found:
            raise ConfigError(
                "dataset.root",
                str(self.root),
                f"a folder with LEAF's {self.folder} files in train/*.json and test/*.json (its data/{self.folder}/"
                f"data after preprocess.sh); {folder} has no .json file",
            )
        return found

    def read(self, split: str) -> tuple[torch.Tensor, torch.Tensor, list[str], list[np.ndarray]]:
        """The split's tensors, its users in file order and each user's sample indices.

        The progress bar shows after a second (tqdm prints its 0% line when a bar opens: a wrong root or a file that
        is not LEAF's is then its one-line error alone), and an error clears it on a terminal.
        """
        xs, ys, users, sizes, seen = [], [], [], [], set()
        started, files = time.perf_counter(), self.files(split)
        bar = tqdm(files, desc=f"{self.folder} {split}", unit="file", dynamic_ncols=True, delay=1.0)
        try:
            for path in bar:
                file_x, file_y = [], []
                for user, x, y in self._users(path):
                    if user in seen:
                        raise ConfigError(
                            "dataset.root", str(self.root / split), f"each user in one file ({user!r} recurs in {path})"
                        )
                    ux, uy = self.convert(x, y, f"{path} user {user!r}")
                    file_x.append(ux), file_y.append(uy), users.append(user), sizes.append(len(uy)), seen.add(user)
                if file_x:
                    xs.append(np.concatenate(file_x)), ys.append(np.concatenate(file_y))
                bar.set_postfix(users=len(users), samples=sum(sizes), refresh=False)  # refresh ignores delay
        except BaseException:
            bar.leave = False
            raise
        finally:
            bar.close()
        if not users:
            raise ConfigError(
                "dataset.root",
                str(self.root / split),
                f"LEAF {self.folder} files with at least one user in {split}/ (users is empty in all {len(files)})",
            )
        x = _stacked(xs, self.sample_shape, self.root / split)
        y = torch.from_numpy(np.concatenate(ys))
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        parts = [np.arange(a, b) for a, b in zip(offsets[:-1], offsets[1:])]
        seconds = time.perf_counter() - started
        tqdm.write(f"fedrun: {self.folder} {split}: {len(users)} users, {len(y)} samples, read in {seconds:.1f} s")
        return x, y, users, parts

    @staticmethod
    def _users(path: Path):
        """(user, x, y) of each user of one LEAF file, checked against its layout; the parsed file is freed after."""
        try:
            with path.open() as handle:
                data = json.load(handle)
        except RecursionError:  # json's decoder recurses once per level: ``[[[[...`` deeper than Python's stack
            raise ConfigError(
                "dataset.root",
                str(path),
                f"a LEAF JSON file, {LAYOUT} (this one nests deeper than {sys.getrecursionlimit()} levels)",
            ) from None
        except (OSError, ValueError) as exc:
            raise ConfigError("dataset.root", str(path), f"a LEAF JSON file ({type(exc).__name__}: {exc})") from None
        missing = [
            key for key in ("users", "num_samples", "user_data") if not isinstance(data, dict) or key not in data
        ]
        if missing:
            raise ConfigError("dataset.root", str(path), f"a LEAF JSON file with {LAYOUT} (no {missing[0]})")
        users, counts, user_data = data.pop("users"), data.pop("num_samples"), data.pop("user_data")
        _expect(isinstance(users, list), path, "users is a list of user names", users)
        _expect(isinstance(counts, list), path, "num_samples is a list of counts, one a user", counts)
        _expect(isinstance(user_data, dict), path, "user_data is an object {name: {x, y}}", user_data)
        if len(users) != len(counts):
            raise ConfigError(
                "dataset.root", str(path), f"as many num_samples as users ({len(counts)} for {len(users)} users)"
            )
        for user, count in zip(users, counts):
            _expect(isinstance(user, str), path, "users are strings (user_data's keys)", user)
            _expect(
                isinstance(count, int) and not isinstance(count, bool) and count >= 0,
                path,
                f"num_samples of {user!r} is an integer >= 0",
                count,
            )
            samples = user_data.pop(user, None)
            if not isinstance(samples, dict) or "x" not in samples or "y" not in samples:
                raise ConfigError(
                    "dataset.root", str(path), f"user_data with x and y for every user ({user!r} has none)"
                )
            for field in ("x", "y"):
                _expect(
                    isinstance(samples[field], list), path, f"user_data[{user!r}].{field} is a list", samples[field]
                )
            if not len(samples["x"]) == len(samples["y"]) == count:
                raise ConfigError(
                    "dataset.root",
                    str(path),
                    f"num_samples equal to the user's x and y ({user!r}: num_samples {count}, "
                    f"{len(samples['x'])} x, {len(samples['y'])} y)",
                )
            yield user, samples["x"], samples["y"]

    def _splits(self):
        x_train, y_train, train_users, train_parts = self.read("train")
        # A user without a training sample is no client (a cohort of them has no weight to average by): left out,
        # as LEAF's own preprocessing leaves out users below its minimum sample count, and said.
        if empty := sum(1 for part in train_parts if not len(part)):
            kept = [i for i, part in enumerate(train_parts) if len(part)]
            if not kept:
                raise ConfigError(
                    "dataset.root", str(self.root / "train"), "LEAF files with a user that has a training sample"
                )
            train_users, train_parts = [train_users[i] for i in kept], [train_parts[i] for i in kept]
            tqdm.write(f"fedrun: {self.folder} train: left out {empty} users without a training sample")
        x_test, y_test, test_users, test_parts = self.read("test")
        by_user = dict(zip(test_users, test_parts))
        empty = np.zeros(0, dtype=np.int64)
        self.natural_test_split = [by_user.get(user, empty) for user in train_users]
        return x_train, y_train, x_test, y_test, train_parts


def _expect(ok: bool, path: Path, what: str, value) -> None:
    """Refuse one field of a LEAF file in one line: the file, what the field must be, what it holds, LEAF's layout."""
    if not ok:
        shown = repr(value) if len(repr(value)) <= 40 else f"{type(value).__name__} {repr(value)[:30]}..."
        raise ConfigError(
            "dataset.root", str(path), f"a LEAF file whose {what} (here {shown}); LEAF's layout: {LAYOUT}"
        )


def _stacked(chunks: list[np.ndarray], shape: tuple[int, ...], where: Path) -> torch.Tensor:
    """The chunks concatenated into one tensor, each freed once copied (never two copies of the data); a ConfigError
    before the tensor is allocated when it would not fit this machine's memory (the files say how many samples)."""
    total = sum(len(c) for c in chunks)
    dtype = torch.from_numpy(chunks[0]).dtype if chunks else torch.float32
    need = total * int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    _, memory = most_clients()
    if memory is not None and need > memory:
        raise ConfigError(
            "dataset.root",
            str(where),
            f"LEAF files whose samples fit this machine's memory ({need / 1e9:.1f} GB "
            f"for {total} samples, {memory / 1e9:.1f} GB here)",
        )
    out = torch.empty((total, *shape), dtype=dtype)
    offset = 0
    while chunks:
        chunk = chunks.pop(0)
        out[offset : offset + len(chunk)] = torch.from_numpy(chunk).reshape(len(chunk), *shape)
        offset += len(chunk)
        del chunk
    return out


class FEMNIST(Leaf):
    """LEAF's FEMNIST: 62 classes, one client per writer, 28x28 images in [0, 1] as stored (background near 1).

    Args:
        invert: Use 1 - x (dark background), as TensorFlow Federated's and FedJAX's EMNIST readers do.
        root, client_tests, val_fraction, client_test_fraction, client_val_fraction: See ``Leaf``.
    """

    folder, sample_shape, num_classes = "femnist", (1, 28, 28), 62

    def __init__(
        self,
        root: str | None = None,
        invert: bool = False,
        client_tests: bool = False,
        val_fraction: float = 0.0,
        client_test_fraction: float = 0.0,
        client_val_fraction: float = 0.0,
    ):
        super().__init__(root, client_tests, val_fraction, client_test_fraction, client_val_fraction)
        check(isinstance(invert, bool), "invert", invert, "true or false")
        self.invert = invert

    def convert(self, x, y, where):
        if not y:
            return np.zeros((0, 784), dtype=np.float32), np.zeros(0, dtype=np.int64)
        try:  # as parsed first: a string or a bool would pass as a number through a float32 cast
            images, labels = np.asarray(x), np.asarray(y)
        except (TypeError, ValueError) as exc:
            raise ConfigError("dataset.root", where, f"x of 784 pixels a sample and integer y ({exc})") from None
        if images.ndim != 2 or images.shape[1] != 784 or images.dtype.kind not in "iuf":
            shape = f"shape {images.shape}" if images.dtype.kind in "iuf" else f"{images.dtype} values"
            raise ConfigError("dataset.root", where, f"x of 784 pixels a sample (got {shape})")
        # LEAF's data_to_json.py stores each pixel as grey / 255: a value outside [0, 1] (255, say) is another scale.
        if not ((images >= 0) & (images <= 1)).all():
            bad = images[~((images >= 0) & (images <= 1))][0]
            raise ConfigError("dataset.root", where, f"x's pixels in [0, 1], as LEAF stores them (one is {bad})")
        if labels.ndim != 1 or labels.dtype.kind not in "iuf" or (labels != np.round(labels)).any():
            bad = next((v for v in y if isinstance(v, bool) or not isinstance(v, (int, float)) or v != round(v)), y)
            raise ConfigError("dataset.root", where, f"y of integer labels 0-61 (one is {bad!r})")
        if not (0 <= labels.min() and labels.max() < 62):
            raise ConfigError("dataset.root", where, "labels y in 0-61")
        images = images.astype(np.float32)
        return (1 - images if self.invert else images), labels.astype(np.int64)


class Shakespeare(Leaf):
    """LEAF's Shakespeare: next-character prediction, one client per speaking role, 80-character inputs over
    LEAF's 80-symbol vocabulary (``ALL_LETTERS``); x is int64 indices, y the next character's index.

    Args:
        root, client_tests, val_fraction, client_test_fraction, client_val_fraction: See ``Leaf``.
    """

    folder, sample_shape, num_classes = "shakespeare", (SEQUENCE,), len(ALL_LETTERS)

    def convert(self, x, y, where):
        if not all(isinstance(s, str) and len(s) == SEQUENCE for s in x):
            bad = next(s for s in x if not (isinstance(s, str) and len(s) == SEQUENCE))
            raise ConfigError("dataset.root", where, f"x of {SEQUENCE}-character strings (one is {str(bad)[:20]!r}...)")
        if not all(isinstance(c, str) and len(c) == 1 for c in y):
            bad = next(c for c in y if not (isinstance(c, str) and len(c) == 1))
            raise ConfigError("dataset.root", where, f"y of single characters (one is {bad!r})")
        return indices("".join(x), where).reshape(-1, SEQUENCE), indices("".join(y), where)


def indices(text: str, where: str) -> np.ndarray:
    """Each character's index in ``ALL_LETTERS``; one outside it is refused in one line."""
    try:
        codes = np.frombuffer(text.encode("latin-1"), dtype=np.uint8)
    except UnicodeEncodeError as exc:
        codes = None
        unknown = text[exc.start]
    else:
        found = _LOOKUP[codes]
        if (found >= 0).all():
            return found
        unknown = chr(codes[np.argmax(found < 0)])
    del codes
    raise ConfigError("dataset.root", where, f"characters of LEAF's 80-symbol vocabulary ({unknown!r} is not one)")
