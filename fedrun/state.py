"""Explicit state: what a run carries between rounds, as plain data that ``torch.load(weights_only=True)`` reads.

A checkpoint is a tree of tensors, numbers, strings, lists, tuples and dicts, and nothing that names code: a
checkpoint file handed to ``fedrun resume=`` or ``fedrun-import`` (a run dir on a shared filesystem) cannot run
anything when it is read. ``encode`` turns the few other things the engines keep into such a tree, each under
a one-key dict that names its kind; ``decode`` turns them back:

- a numpy array (a per-client counter) or numpy scalar (a metric computed with numpy) -> its tensor, dtype kept;
- a numpy ``Generator`` -> its bit generator's name and state (a dict of ints), so that its next draws are the
  same as the saved generator's;
- a ``deque`` (FedStaleWeight's staleness windows) -> its items and ``maxlen``.

Objects are not encoded: an aggregator, server optimizer or pipeline stage gives its state with ``state_dict()``
and takes it back with ``load_state_dict()`` (``Stateful``); the objects themselves are built from the config.
``fedrun.checkpoint`` encodes a whole state when it saves it and decodes it when it reads it.
"""

from __future__ import annotations

import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedrun.lazy import deferred, torch

PLAIN = (type(None), bool, int, float, str, bytes)  # and torch.Tensor (checked last: ``encode`` needs no torch)
KEYS = (bool, int, float, str, type(None))  # dict keys a checkpoint keeps (tuples of them too)
ARRAY, SCALAR, GENERATOR, DEQUE = "__ndarray__", "__numpy_scalar__", "__numpy_generator__", "__deque__"
MARKERS = {ARRAY, SCALAR, GENERATOR, DEQUE}


def load_plain(path):
    """``torch.load(path, weights_only=True)``: plain data, nothing that the file names is run. torch's warning about a
    pickle protocol other than its own (two lines on stderr, for a file fedrun did not write: its own are written
    with torch's) is left out, so that such a file is refused in the caller's one line."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
        return torch.load(path, weights_only=True)


def encode(value, where: str = "state"):
    """``value`` as plain data (see the module docstring); anything else raises TypeError naming where it is."""
    return _encode(value, where, torch.from_numpy)


def check_encodable(value, where: str = "state") -> None:
    """``encode``'s TypeError for a value a checkpoint cannot hold, without building its tensors (nor importing
    torch: a config's parts are checked before it, ``fedrun.lazy``)."""
    _encode(value, where, lambda array: array)


def _encode(value, where: str, tensor):
    """``encode``, turning numpy arrays into what ``tensor`` makes of them."""
    if isinstance(value, np.generic):  # before PLAIN: np.float64 is a float, but it must come back as np.float64
        return {SCALAR: tensor(np.asarray(value).reshape(1).copy())}
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, np.ndarray):  # np.array(copy): contiguous, and a 0-d array stays 0-d
        return {ARRAY: tensor(np.array(value, copy=True, order="C"))}
    if isinstance(value, np.random.Generator):
        return {GENERATOR: {"bit_generator": type(value.bit_generator).__name__, "state": value.bit_generator.state}}
    if isinstance(value, deque):
        return {DEQUE: [_encode(v, f"{where}[]", tensor) for v in value], "maxlen": value.maxlen}
    if isinstance(value, (list, tuple)):
        items = [_encode(v, f"{where}[{i}]", tensor) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        for key in value:
            parts = key if isinstance(key, tuple) else (key,)
            if not all(type(k) in KEYS for k in parts) or key in MARKERS:  # np.int64 keys too: they would not load
                raise TypeError(
                    f"{where} has the key {key!r} ({type(key).__name__}), which a checkpoint cannot hold "
                    "(keys: str, int, float, bool, None, or tuples of them; not fedrun's own markers)"
                )
        return {k: _encode(v, f"{where}[{k!r}]", tensor) for k, v in value.items()}
    if not deferred("torch") and isinstance(value, torch.Tensor):  # no tensor exists before torch does
        return value
    raise TypeError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which a checkpoint cannot hold "
        "(give the object a state_dict() of tensors, numbers, strings, lists and dicts)"
    )


def decode(value):
    """The inverse of ``encode``."""
    if isinstance(value, dict):
        if len(value) == 1 and ARRAY in value:
            return value[ARRAY].numpy()
        if len(value) == 1 and SCALAR in value:
            return value[SCALAR].numpy()[0]
        if len(value) == 1 and GENERATOR in value:
            spec = value[GENERATOR]
            kind = getattr(np.random, str(spec["bit_generator"]), None)  # PCG64, Philox, ...: numpy's own classes only
            if not (isinstance(kind, type) and issubclass(kind, np.random.BitGenerator)):
                raise ValueError(f"not a numpy bit generator: {spec['bit_generator']!r}")
            bit_generator = kind()
            bit_generator.state = spec["state"]
            return np.random.Generator(bit_generator)
        if len(value) == 2 and DEQUE in value:
            return deque((decode(v) for v in value[DEQUE]), maxlen=value["maxlen"])
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, tuple):
        return tuple(decode(v) for v in value)
    return value


@dataclass(frozen=True)
class Context:
    """What every part of a run is bound to, once, before round 1 (``bind``): settings that depend on the run, not
    on the part's own config. A part checks them there, so that a bad combination fails before any training.

    Attributes:
        schedule: The run's ``fedrun.rounds.Schedule`` (rounds, sampling, cohort, local work).
        sizes: Each client's number of training samples (a population's shared array: nothing per client).
        seed: The run's seed (a randomised part derives its streams from it).
        weighting: The aggregator's p_i, ``samples`` or ``uniform`` (what a sampler's q_k is).
        asynchronous: Whether the engine aggregates buffered updates as they arrive (no synchronous rounds).
        layout: The flat model's parameters, ``(name, start, end)`` each, in order (a part that keeps some layers
            per client finds them here).
        initial: The initial global model w^0, flat (where a personal model starts), or None before it exists.
        batch_norm: The names of the model's batch-norm parameters (``fedrun.models.batch_norm_names``: what FedBN
            keeps per client).
        workdir: The run's output dir (where a part may keep files: spilled personal state), or None.
    """

    schedule: Any
    sizes: np.ndarray
    seed: int = 0
    weighting: str = "samples"
    asynchronous: bool = False
    layout: tuple = ()
    initial: Any = None
    workdir: Any = None
    batch_norm: tuple = ()

    @property
    def num_clients(self) -> int:
        return len(self.sizes)


class Stateful:
    """``state_dict()`` / ``load_state_dict()`` for the parts of a run built from its config (aggregators, server
    optimizers, pipeline stages, samplers).

    A class names in ``STATE`` the attributes it carries between rounds (MVR's momentum, Adam's ``m`` and ``v``, a
    compressor's residuals); ``state_dict()`` gives exactly those and ``load_state_dict()`` restores exactly those.
    Settings (constructor arguments) are not state: the config rebuilds them, and a resumed run with the same config
    has the same ones. A saved key that is not state is ignored, so the attribute dicts older checkpoints hold
    (settings included, and keys such as ``diagnostics``) still load; a state key a checkpoint lacks (one written
    before that state existed) keeps its initial value. A part that holds other parts (a pipeline's stages, a
    hybrid's phases) overrides both to nest their states.
    """

    # None: not declared, which a checkpoint refuses (a part that keeps nothing declares ()): no vars(self) default,
    # so that what a part carries is written down and survives refactors (tests/unit/test_state.py walks every class).
    STATE: tuple[str, ...] | None = None

    def bind(self, context: Context) -> None:
        """Called once before round 1 with the run's ``Context``; a setting that cannot run with it is a ConfigError
        here. Nothing to bind by default."""

    def state_dict(self) -> dict:
        """What this part carries between rounds (``STATE``): data that ``encode`` takes (no objects)."""
        if self.STATE is None:
            raise TypeError(f"{type(self).__qualname__} declares no STATE (the attributes it carries between rounds)")
        return {name: getattr(self, name) for name in self.STATE}

    def load_state_dict(self, state: dict) -> None:
        """Restore the ``STATE`` attributes that ``state`` holds; its other keys are not state and are ignored."""
        if self.STATE is None:
            raise TypeError(f"{type(self).__qualname__} declares no STATE (the attributes it carries between rounds)")
        for name in self.STATE:
            if name in state:
                setattr(self, name, state[name])
