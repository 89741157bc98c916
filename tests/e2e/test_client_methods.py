"""Every client-side method's numbers, pinned before the client's program becomes a part (issue 50): a short run of
each through the real ``fedrun`` command, on the ``loop`` and ``processes`` backends, against the metrics recorded
under ``tests/data/client_methods/`` (every column but the timings, written exactly). A refactor of what a client
computes must leave each of them equal.

Bit for bit on a machine that runs one recording's CPU kernels: torch's own (``get_cpu_capability()``) and
oneDNN's ISA (``onednn_isa``), by which its convolutions and matrix products choose their implementation; another
instruction set sums in another order. Two recordings, each made from the code before the refactor (9dd76ee; the
three programs and MOON on FedBuff from the commits that added them, 438cc9d and 2fae707):

- ``avx512/`` (2026-11-28): an AVX-512 machine without AMX; it predates the oneDNN key, so a recording without the key
  counts as made without AMX.
- ``amx/`` (2026-11-30): an AVX10.1 + AMX machine ("Intel AVX10.1 and Intel AMX with bfloat16 and 8-bit integer
  support"), where every one of the 34 cases differs from ``avx512/`` in its last bits and 12 by more than 1e-5
  (storm_vr's test accuracy and fedbn's test loss already at round 1).

On kernels no recording was made with, the cells on which the recordings agree to 1e-5 are compared to 1e-5 and the
failure names every machine's kernels. Record (on purpose only, from the code before a refactor, and say why in the
commit) with ``FEDRUN_RECORD=<folder> pytest -m slow -n 0 tests/e2e/test_client_methods.py``. Each backend's cases run as
one sweep in one process (``swept``).
"""

import csv
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import swept_once

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FIXTURES = Path(__file__).parents[1] / "data" / "client_methods"
COMMON = ["schedule.rounds=3", "partition.num_clients=6", "device=cpu", "device.threads=1", "tracking.enabled=false"]
HELD_OUT = ["dataset.client_test_fraction=0.25", "schedule.clients_per_round=0.5"]
CASES = {  # every method that changes what a client computes, sends or reports
    "fedprox": ["method=fedprox"],
    "storm_vr": ["method=storm_vr"],  # the local STORM estimator
    "mvr": ["aggregator=mvr"],  # the previous model's update, trained again
    "fednova": ["method=fednova", "heterogeneity=random_steps"],  # unequal local steps, normalised
    "fedrep": ["personalization=fedrep", *HELD_OUT],
    "ditto": ["personalization=ditto", *HELD_OUT],
    "apfl": ["personalization=apfl", *HELD_OUT],
    "fedbn": ["personalization=fedbn", "model.norm=batch", *HELD_OUT],
    "finetune": ["personalization=finetune", *HELD_OUT],
    "local": ["personalization=local", *HELD_OUT],
    "local_dp": [
        "privacy=local",
        "privacy.noise_multiplier=0.8",
        "privacy.clip_norm=0.5",
        "aggregator.weighting=uniform",
    ],
    "label_flip": ["attack=label_flip", "attack.fraction=0.34"],  # attackers train on their own data view
    "power_of_choice": ["sampler=power_of_choice", "schedule.clients_per_round=0.5"],  # the candidates' loss pass
    # the client programs (fedrun/programs.py): per-client state (spilled to client/ for SCAFFOLD) and server halves
    "scaffold": ["client=scaffold", "client.memory_mb=0.001", "schedule.clients_per_round=0.5"],
    "feddyn": ["client=feddyn", "client.alpha=0.1", "schedule.clients_per_round=0.5"],
    "moon": ["client=moon", "model=mlp", "schedule.clients_per_round=0.5"],
    "moon_async": ["client=moon", "model=mlp", "aggregator=fedbuff", "engine.concurrency=3"],  # on each arrival
}
BACKENDS = ("loop", "processes")


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """backend -> case -> its run dir: every case on a backend as one sweep (``conftest.swept_once``: one process
    instead of 17), run once per worker (a backend's cases share an xdist group). That a job's numbers do not depend
    on the jobs run before it in the same process is part of what the recordings, made one process a case, now
    hold."""
    return {
        backend: swept_once(
            tmp_path_factory,
            f"client_methods_{backend}",
            CASES,
            *COMMON,
            f"device.backend={backend}",
            *(["device.workers=2"] if backend == "processes" else []),
        )
        for backend in BACKENDS
    }


@functools.cache
def onednn_isa() -> str:
    """The ISA oneDNN dispatches on, as it reports it (``ONEDNN_VERBOSE``) at its first convolution, in a fresh
    process ("" where it reports none)."""
    probe = "import torch; cl = torch.channels_last; torch.nn.Conv2d(1, 4, 3).to(memory_format=cl)(torch.zeros(2, 1, 8, 8).to(memory_format=cl))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env={**os.environ, "ONEDNN_VERBOSE": "1"}
    )
    return next((line.split("isa:", 1)[1].strip() for line in done.stdout.splitlines() if ",isa:" in line), "")


def same_kernels(recorded: dict, capability: str) -> bool:
    """Whether this machine (torch's ``capability``) runs the recording's CPU kernels: torch's and oneDNN's ISA (a
    recording without the ISA was made without AMX: the module's docstring)."""
    if recorded["cpu_capability"] != capability:
        return False
    return recorded["onednn_isa"] == onednn_isa() if "onednn_isa" in recorded else "AMX" not in onednn_isa()


def without_timings(path: Path) -> list[list[str]]:
    rows = list(csv.reader(path.open(newline="")))
    kept = [i for i, name in enumerate(rows[0]) if not name.endswith("_wall_s")]
    return [[row[i] for i in kept] for row in rows]


@pytest.mark.parametrize(
    "case, backend",
    [pytest.param(c, b, marks=pytest.mark.xdist_group(f"client_methods_{b}")) for b in BACKENDS for c in CASES],
    ids=[f"{c}-{b}" for b in BACKENDS for c in CASES],
)
def test_a_client_methods_numbers_are_the_recorded_ones(swept, case, backend):
    got, capability = without_timings(swept[backend](case) / "metrics.csv"), torch.backends.cpu.get_cpu_capability()
    if name := os.environ.get("FEDRUN_RECORD"):
        record(FIXTURES / name, f"{case}_{backend}.csv", got, capability)
        return
    recordings = {name: without_timings(FIXTURES / name / f"{case}_{backend}.csv") for name in RECORDINGS}
    reference = next(iter(recordings.values()))  # what a failure on unknown kernels quotes
    columns = reference[0]
    # Every recorded column, by name, in its order; a column added since (fairness/) is new, not a changed number.
    missing = [name for name in columns if name not in got[0]]
    assert not missing, f"{case} on {backend}: columns gone since the recording: {missing}"
    got = [[row[got[0].index(name)] for name in columns] for row in got]
    here = f"{capability}, {onednn_isa() or 'no oneDNN ISA'}"
    if mine := next((name for name, kernels in RECORDINGS.items() if same_kernels(kernels, capability)), None):
        # the same kernels: the same text, bit for bit
        assert got == recordings[mine], f"{case} on {backend} ({mine}): {first_difference(got, recordings[mine])}"
        return
    # Kernels no recording was made with sum in another order, and some methods carry that far within a round
    # (storm_vr's test accuracy, fedbn's test loss at round 1 between the two recordings): compare, to 1e-5
    # relative, the cells on which every recording agrees to 1e-5 (those another ISA leaves alone), and say so.
    first, *others = (frame(rows) for rows in recordings.values())
    steady = np.logical_and.reduce([close(other, first) for other in others] or [np.ones(first.shape, bool)])
    off = steady & ~close(frame(got), first)
    if off.any():
        row, col = (int(i[0]) for i in np.nonzero(off))
        pytest.fail(
            f"{case} on {backend}, here {here}, kernels no recording was made with ({describe()}): of the "
            f"{int(steady.sum())} of {steady.size} cells on which the recordings agree to 1e-5, round {got[row + 1][0]}'s "
            f"{columns[col]} is {got[row + 1][col]} here and {reference[row + 1][col]} there"
        )


RECORDINGS = {path.parent.name: json.loads(path.read_text()) for path in sorted(FIXTURES.glob("*/recorded.json"))}


def record(folder: Path, name: str, rows: list[list[str]], capability: str) -> None:
    """Write one case's metrics and the kernels and code they were recorded with (``FEDRUN_RECORD=<folder>``)."""
    folder.mkdir(parents=True, exist_ok=True)
    csv.writer((folder / name).open("w", newline="")).writerows(rows)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=FIXTURES)
    kernels = {"cpu_capability": capability, "onednn_isa": onednn_isa(), "torch": torch.__version__}
    (folder / "recorded.json").write_text(json.dumps({**kernels, "code": head.stdout.strip()}))


def describe() -> str:
    return "; ".join(
        f"{name}: {kernels['cpu_capability']}, {kernels.get('onednn_isa', 'oneDNN ISA without AMX')}"
        for name, kernels in RECORDINGS.items()
    )


def frame(rows: list[list[str]]) -> np.ndarray:
    return pd.DataFrame(rows[1:], columns=rows[0]).replace("", "nan").astype(float).to_numpy()


def close(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.isclose(a, b, rtol=1e-5, atol=0, equal_nan=True)


def first_difference(got: list[list[str]], expected: list[list[str]]) -> str:
    for mine, theirs in zip(got, expected):
        for name, a, b in zip(got[0], mine, theirs):
            if a != b:
                return f"round {mine[0]}, {name}: {a} (now) vs {b} (recorded)"
    return f"{len(got)} rows now vs {len(expected)} recorded"
