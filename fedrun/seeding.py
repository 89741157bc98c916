"""Independent random streams derived from one run seed.

Each consumer (partition, model initialisation, client sampling, mini-batch order) draws from its own
stream, so two runs that differ only in, say, the aggregator share the split, the initial model and
the cohorts. Streams are keyed by name and optional integers (round, client), never by call order.
"""

from __future__ import annotations

import zlib

import numpy as np

from fedrun.lazy import torch


def _entropy(seed: int, stream: str, *keys: int) -> list[int]:
    return [int(seed), zlib.crc32(stream.encode()), *map(int, keys)]


def numpy_rng(seed: int, stream: str, *keys: int) -> np.random.Generator:
    """A NumPy generator for ``stream`` (and optional integer keys) under ``seed``."""
    return np.random.default_rng(np.random.SeedSequence(_entropy(seed, stream, *keys)))


def stream_key(seed: int, stream: str, *keys: int) -> int:
    """A 64-bit integer key for ``stream`` under ``seed`` (a counter-based hash's, ``fedrun.devices.Slotted``)."""
    return int(np.random.SeedSequence(_entropy(seed, stream, *keys)).generate_state(1, dtype=np.uint64)[0])


def torch_seed(seed: int, stream: str, *keys: int) -> int:
    """A 63-bit integer seed for torch generators, derived like ``numpy_rng``."""
    state = np.random.SeedSequence(_entropy(seed, stream, *keys)).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def torch_generator(seed: int, stream: str, *keys: int) -> torch.Generator:
    """A CPU torch generator for ``stream`` under ``seed``."""
    return torch.Generator().manual_seed(torch_seed(seed, stream, *keys))
