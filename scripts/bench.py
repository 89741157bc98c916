"""Seconds per round of fedrun's engine against two references measured in the same run.

Workloads, on synthetic tensors (no files needed), the papers' CNN (``CNN`` of fedrun.models), FedAvg:

- ``papers``: MNIST-shaped, 50 clients x 200 samples, full participation, E = 2, batch 64, a 10,000-image
  test evaluation every round (paper 000's protocol).
- ``cross-device``: 1,000 clients x 50 samples, cohort 50, E = 1, batch 10, evaluation every 10 rounds.
- ``1000-clients`` and ``10000-clients``: 1,000 or 10,000 clients x 50 samples, cohort 100, E = 1, batch 10,
  evaluation every 10 rounds. Clients index a pool of 50,000 samples (client c has samples 50c .. 50c+49
  modulo the pool), so the two differ only in the population: what grows with it is fedrun's own.
  ``1000000-clients``: the same with a million clients. Clients are made when a round asks for them
  (``fedrun.partitions.LazyClients``), for every population alike, so what grows with it is fedrun's own.
- ``async-1000``, ``async-10000`` and ``async-1000000``: FedBuff (buffer 10) on the asynchronous engine with
  ``concurrency=100``, the same clients, compute times uniform in [1, 10]; a "round" is an aggregation.
- ``femnist`` and ``shakespeare``: LEAF-shaped (``experiment=femnist`` and ``experiment=shakespeare``'s protocol):
  3,400 writers of 200 28x28 images over 62 classes with LEAF's CNN, 10 a round, E = 1, batch 20; 715 roles of
  100 sequences of 80 symbols with LEAF's LSTM, 10 a round, E = 1, batch 4; an evaluation every 5 rounds on
  2,000 test samples. Clients index the pool as above (at most 50,000 distinct samples).
- ``cifar10-pfl``: pfl-research's CIFAR-10 benchmark setting (1,000 clients x 50 samples of 3x32x32, 10
  classes, 50 per round, batch 10, E = 1), the same CNN on CIFAR-shaped inputs. For GPUs (``--device cuda``).

Seconds per round, after a warm-up of one evaluation period, by the same estimator as the floor's (the fastest of
its timed rounds): the fastest round without an evaluation, plus the evaluated rounds' extra time (their mean
minus that fastest round) divided by ``eval_every``, so an evaluation every 10 rounds counts a tenth; the fastest
round where every round is evaluated (papers). Noise on a shared machine only ever adds time, and a mean over
ten rounds against the floor's fastest round counted that noise against fedrun alone (until 2026-11-30). The
mean over the measured rounds is kept too (``mean_s_per_round``, and ``mean`` in the printed line).

For each: fedrun's seconds per round with the backend ``device.backend=auto`` picks, split into local
training, loss pass, aggregation, evaluation and logging (a real Tracker writing the CSV files and MLflow to a
scratch SQLite store, or the CSV files alone where mlflow is not installed), and each backend's figure (CPU: ``loop``, ``processes``; CUDA: ``loop``, ``vmap``;
``--backends`` to choose); ``naive``, the loop a researcher writes first (a state_dict loaded into the
model per client, a DataLoader, evaluation in batches of 1000, the per-client loss pass); and the compute
``floor``: the same forward/backward sample-passes as one centrally trained model at the same batch size in its
fastest layout: one process on the run's threads (contiguous or channels_last) or, on a CPU, the sample-passes
split over one-thread worker processes, one a core (two one-thread processes beat two threads at batch 10), plus
the same forward-only passes (test set and train_loss pass on evaluated rounds), the fastest of ``FLOOR_ROUNDS``
timed rounds. The asynchronous and scale workloads have no references (null).

Every figure is measured in its own process, so the peak RSS (and on CUDA the peak GPU memory) of fedrun's
is fedrun's alone; ``--repeats`` times, the measurements interleaved, and the fastest counts (noise on a
shared machine only ever adds time); each repeat's ratio of fedrun to the floor is printed beside the ratio of the
fastest (the two of a repeat are measured a minute apart, so a slow phase of the machine moves both). The last
line is JSON.

``--backends distributed`` starts each measurement under ``torchrun`` (one rank a core on a CPU, each on one
thread; ``--ranks``), rank 0 reporting.

Usage:
    python scripts/bench.py [--workloads papers cross-device 10000-clients] [--device cpu|cuda]
                            [--backends loop processes vmap distributed] [--rounds N] [--repeats 2] [--threads N]
                            [--ranks N]
"""

import argparse
import functools
import importlib.util
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn.functional import cross_entropy
from torch.utils.data import DataLoader, TensorDataset

from fedrun import distributed
from fedrun.aggregators import FedAvg, FedBuff
from fedrun.async_engine import AsyncEngine
from fedrun.backends import Device, pass_cost, usable_cores
from fedrun.datasets import FederatedData
from fedrun.engine import Schedule, run
from fedrun.leaf import SEQUENCE
from fedrun.metrics import run_summary
from fedrun.models import CNN, CharLSTM, LeafCNN
from fedrun.partitions import LazyClients
from fedrun.parts import Parts
from fedrun.tracking import Tracker

MNIST, CIFAR = (1, 28, 28), (3, 32, 32)
# FedBuff on the asynchronous engine: the async-<clients> workloads differ in the population alone.
ASYNC = dict(samples=50, concurrency=100, buffer=10, epochs=1, batch=10, test=10_000, eval_every=10, references=False)
WORKLOADS = {
    "papers": dict(clients=50, samples=200, cohort=50, epochs=2, batch=64, test=10_000, eval_every=1),
    "cross-device": dict(clients=1_000, samples=50, cohort=50, epochs=1, batch=10, test=10_000, eval_every=10),
    "1000-clients": dict(
        clients=1_000, samples=50, cohort=100, epochs=1, batch=10, test=10_000, eval_every=10, references=False
    ),
    "10000-clients": dict(clients=10_000, samples=50, cohort=100, epochs=1, batch=10, test=10_000, eval_every=10),
    "1000000-clients": dict(
        clients=1_000_000, samples=50, cohort=100, epochs=1, batch=10, test=10_000, eval_every=10, references=False
    ),
    **{f"async-{n}": dict(ASYNC, clients=n) for n in (1_000, 10_000, 1_000_000)},
    "femnist": dict(
        clients=3_400,
        samples=200,
        cohort=10,
        epochs=1,
        batch=20,
        test=2_000,
        eval_every=5,
        model="leaf_cnn",
        classes=62,
    ),
    "shakespeare": dict(
        clients=715, samples=100, cohort=10, epochs=1, batch=4, test=2_000, eval_every=5, model="char_lstm", classes=80
    ),
    "cifar10-pfl": dict(
        clients=1_000, samples=50, cohort=50, epochs=1, batch=10, test=10_000, eval_every=10, shape=CIFAR
    ),
}
DEFAULT = {
    "cpu": ["papers", "cross-device", "1000-clients", "10000-clients", "async-1000", "async-10000"],
    "cuda": ["papers", "cross-device", "cifar10-pfl"],
}
BACKENDS = {"cpu": ["loop", "processes"], "cuda": ["loop", "vmap"]}
POOL = 50_000  # distinct training samples at most; larger populations share them (see the module docstring)
LR = 0.05
MLFLOW = (
    importlib.util.find_spec("mlflow") is not None
)  # without it (a bare GPU machine), logging is the CSV files alone


class PoolClients(LazyClients):
    """Client c holds samples 50c .. 50c+49 of the pool (modulo its size), made when asked for."""

    def __init__(self, num_clients: int, samples: int, pool: int):
        self.samples, self.pool = samples, pool
        self.sizes = np.broadcast_to(np.int64(samples), (num_clients,))

    def __getitem__(self, c) -> np.ndarray:
        return np.arange(int(c) * self.samples, (int(c) + 1) * self.samples) % self.pool


def make_model(spec: dict) -> nn.Module:
    """The workload's model: the papers' CNN, or LEAF's CNN or LSTM."""
    classes = spec.get("classes", 10)
    if spec.get("model") == "leaf_cnn":
        return LeafCNN(MNIST, classes)
    if spec.get("model") == "char_lstm":
        return CharLSTM((SEQUENCE,), classes)
    return CNN(spec.get("shape", MNIST), classes)


def synthetic(spec: dict, device: torch.device, seed: int = 0) -> tuple[FederatedData, PoolClients]:
    """Inputs whose label shifts a class pattern, so training has something to learn; on ``device``. For the
    LSTM, symbol sequences whose next symbol is their last one plus one."""
    g = torch.Generator().manual_seed(seed)
    n = min(POOL, spec["clients"] * spec["samples"])
    clients = PoolClients(spec["clients"], spec["samples"], n)
    if spec.get("model") == "char_lstm":
        classes = spec["classes"]
        x, x_test = (torch.randint(0, classes, (size, SEQUENCE), generator=g) for size in (n, spec["test"]))
        data = FederatedData(
            x.to(device),
            ((x[:, -1] + 1) % classes).to(device),
            x_test.to(device),
            ((x_test[:, -1] + 1) % classes).to(device),
            num_classes=classes,
        )
        return data, clients
    shape, classes = spec.get("shape", MNIST), spec.get("classes", 10)
    patterns = torch.randn(classes, *shape, generator=g)
    y, y_test = torch.randint(0, classes, (n,), generator=g), torch.randint(0, classes, (spec["test"],), generator=g)
    x, x_test = torch.randn(n, *shape, generator=g), torch.randn(spec["test"], *shape, generator=g)
    for c in range(classes):  # class by class: no temporary the size of the data
        x[y == c] += patterns[c]
        x_test[y_test == c] += patterns[c]
    data = FederatedData(x.to(device), y.to(device), x_test.to(device), y_test.to(device), num_classes=classes)
    return data, clients


def bench_fedrun(spec: dict, data: FederatedData, clients: list[np.ndarray], rounds: int, device: Device) -> dict:
    torch.manual_seed(0)
    model = make_model(spec)
    schedule = Schedule(
        rounds=rounds,
        local_epochs=spec["epochs"],
        batch_size=spec["batch"],
        eval_every=spec["eval_every"],
        cohort=spec.get("cohort"),  # the asynchronous workloads: concurrency instead
    )
    rows, logging = [], []
    with tempfile.TemporaryDirectory() as scratch:
        tracker = Tracker(Path(scratch) / "run", len(clients), MLFLOW, f"sqlite:///{scratch}/mlflow.db", "bench")
        tracker.start({}, {}, "bench")

        def on_round(row, per_client):
            start = time.perf_counter()
            tracker.log_round(row, per_client)
            logging.append(time.perf_counter() - start)
            rows.append(row)

        optimizer = functools.partial(torch.optim.SGD, lr=LR)
        if "concurrency" in spec:
            engine = AsyncEngine(
                [{"name": "all", "clients": None, "distribution": "uniform", "low": 1.0, "high": 10.0}],
                concurrency=spec["concurrency"],
            )
            engine(
                model,
                data,
                clients,
                Parts(FedBuff(buffer_size=spec["buffer"])),
                optimizer,
                schedule,
                device,
                0,
                on_round=on_round,
            )
        else:
            run(model, data, clients, Parts(FedAvg()), optimizer, schedule, device, 0, on_round=on_round)
        tracker.finish("FINISHED", *run_summary(tracker.rows, (0.6, 0.9)))  # the summary a run logs, as fedrun does
    total = [r["round_wall_s"] + log for r, log in zip(rows, logging)]
    parts = {  # each from the rounds the total's estimate takes, so that they add up to it
        k: per_round(spec, [r[f"{k}_wall_s"] for r in rows], total)
        for k in ("train", "loss", "aggregate", "eval")
        if f"{k}_wall_s" in rows[0]
    }
    parts["logging"] = per_round(spec, logging, total)
    return {
        "s_per_round": per_round(spec, total),
        "mean_s_per_round": statistics.fmean(total[spec["eval_every"] :]),
        "parts": parts,
        "final_accuracy": rows[-1]["test_accuracy"],
    }


def per_round(spec: dict, seconds: list[float], totals: list[float] | None = None) -> float:
    """Seconds per round after a warm-up of one evaluation period (so one-time kernel set-up of every shape is left
    out), by the floor's estimator (the module's docstring): the fastest round without an evaluation plus the
    evaluated rounds' extra over it, divided by ``eval_every``; the fastest round where every round is evaluated.
    ``totals``: the rounds' whole times, which choose the fastest round (a part of the round is taken from the
    rounds its total's estimate takes, so that the parts add up to it); default ``seconds`` themselves."""
    totals = seconds if totals is None else totals
    every, n = spec["eval_every"], len(seconds)
    measured = range(every, n)  # round i + 1, as the engine counts them; evaluated as ``Schedule.evaluates`` says
    evaluated = [i for i in measured if (i + 1) % every == 0 or i + 1 == n]
    plain = [i for i in measured if i not in evaluated]
    if not plain:  # every round evaluated
        return seconds[min(evaluated, key=totals.__getitem__)]
    fastest = min(plain, key=totals.__getitem__)  # the last round is always evaluated: ``evaluated`` is never empty
    return seconds[fastest] + (statistics.fmean(seconds[i] for i in evaluated) - seconds[fastest]) / every


def naive_model(shape) -> nn.Module:
    side = (shape[1] - 2) // 2
    return nn.Sequential(
        nn.Conv2d(shape[0], 32, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * ((side - 2) // 2) ** 2, 10),
    )


def bench_naive(spec: dict, data: FederatedData, clients: list[np.ndarray], rounds: int) -> float:
    """The plain loop: state_dict per client, DataLoader, per-client loss pass, evaluation in batches of 1000."""
    torch.manual_seed(0)
    device = data.x_train.device
    model = naive_model(spec.get("shape", MNIST)).to(device)
    rng = np.random.default_rng(0)
    times = []
    for t in range(1, rounds + 1):
        start = time.perf_counter()
        cohort = rng.choice(len(clients), size=spec["cohort"], replace=False)
        global_state = {k: v.clone() for k, v in model.state_dict().items()}
        new_state = {k: torch.zeros_like(v) for k, v in global_state.items()}
        total = sum(len(clients[c]) for c in cohort)
        for c in cohort:
            index = torch.as_tensor(clients[c], device=device)
            dataset = TensorDataset(data.x_train[index], data.y_train[index])
            model.load_state_dict(global_state)
            with torch.no_grad():  # the loss pass: each client's loss of the global model
                for xb, yb in DataLoader(dataset, batch_size=1000):
                    cross_entropy(model(xb), yb)
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
            for _ in range(spec["epochs"]):
                for xb, yb in DataLoader(dataset, batch_size=spec["batch"], shuffle=True):
                    optimizer.zero_grad()
                    cross_entropy(model(xb), yb).backward()
                    optimizer.step()
            for k, v in model.state_dict().items():
                new_state[k] += v * (len(clients[c]) / total)
        model.load_state_dict(new_state)
        correct = 0
        if t % spec["eval_every"] == 0 or t == rounds:
            with torch.no_grad():
                for xb, yb in DataLoader(TensorDataset(data.x_test, data.y_test), batch_size=1000):
                    correct += (model(xb).argmax(1) == yb).sum().item()
        _sync(device)
        times.append(time.perf_counter() - start)
    return per_round(spec, times)


def bench_floor(spec: dict, data: FederatedData) -> float:
    """One central model, the same sample-passes per round at the same batch size, in its fastest layout;
    plus the same forward-only passes (on an evaluated round, once every ``eval_every``: the test set, and
    the cohort's training samples, whose loss under the round's model fedrun logs as train_loss)."""
    layouts = [torch.contiguous_format] + ([torch.channels_last] if data.x_train.dim() == 4 else [])
    floors = [_floor(spec, data, memory_format) for memory_format in layouts]
    if data.x_train.device.type == "cpu" and usable_cores() > 1:
        floors.append(_floor(spec, data, layouts[-1], workers=usable_cores()))
    return min(floors)


def _train_passes(model, x, y, passes: int, batch: int) -> None:
    """``passes`` forward/backward sample-passes of one model at ``batch``, wrapping around the data."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for done in range(0, passes, batch):
        lo = done % (len(x) - batch + 1)  # wraps around: E epochs over the data
        optimizer.zero_grad(set_to_none=True)
        cross_entropy(model(x[lo : lo + batch]), y[lo : lo + batch]).backward()
        optimizer.step()


def _worker_passes(model, x, y, passes, batch, start, results) -> None:
    """One worker of the process layout: one thread, a warm-up, then its share of the passes after ``start``."""
    torch.set_num_threads(1)
    _train_passes(model, x, y, min(passes, 4 * batch), batch)  # warm-up
    start.wait()
    clock = time.perf_counter()
    _train_passes(model, x, y, passes, batch)
    results.put(time.perf_counter() - clock)


def _process_train(model, x, y, passes: int, batch: int, workers: int) -> float:
    """Wall seconds of ``passes`` split over ``workers`` forked one-thread processes, each with its own model copy,
    from a common start to the last one done."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    start, results = context.Barrier(workers + 1), context.Queue()
    share = -(-passes // workers // batch) * batch  # whole batches each
    procs = [
        context.Process(target=_worker_passes, args=(model, x, y, share, batch, start, results)) for _ in range(workers)
    ]
    for p in procs:
        p.start()
    start.wait()
    clock = time.perf_counter()
    for _ in procs:
        results.get()
    wall = time.perf_counter() - clock
    for p in procs:
        p.join()
    return wall


# The floor's round is timed this many times after a warm-up and the fastest counts (noise only ever adds time): one
# timed round, as until 2026-11-30, gave cross-device floors of 0.65 and 0.41 s in two runs minutes apart here, while
# fedrun's own figure (a mean over ten rounds) moved by 1%.
FLOOR_ROUNDS = 5


def _floor(spec: dict, data: FederatedData, memory_format: torch.memory_format, workers: int = 1) -> float:
    passes = spec["cohort"] * spec["samples"] * spec["epochs"]
    torch.manual_seed(0)
    device = data.x_train.device
    model = (
        make_model(spec).to(device).to(memory_format=memory_format)
    )  # the CNN: ReLU after pooling, the cheaper order
    x, y = data.x_train.contiguous(memory_format=memory_format), data.y_train
    x_test = data.x_test.contiguous(memory_format=memory_format)
    timings = []
    for _ in range(1 + FLOOR_ROUNDS):  # the first is a warm-up
        start = time.perf_counter()
        if workers > 1:
            train = _process_train(model, x, y, passes, spec["batch"], workers)
        else:
            _train_passes(model, x, y, passes, spec["batch"])
            _sync(device)
            train = time.perf_counter() - start
        forward = []
        for chunk in (64, 256, 1024):  # the fastest chunk size counts (64 on the CPUs measured so far)
            start = time.perf_counter()
            with torch.inference_mode():  # evaluated rounds: the test set, and the cohort's data for train_loss
                for lo in range(0, len(x_test), chunk):
                    model(x_test[lo : lo + chunk]).argmax(1)
                for lo in range(0, spec["cohort"] * spec["samples"], chunk):
                    model(x[lo : lo + chunk]).argmax(1)
            _sync(device)
            forward.append(time.perf_counter() - start)
        timings.append(train + min(forward) / spec["eval_every"])
    return min(timings[1:])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(name: str, what: str, kind: str, rounds: int | None) -> dict:
    """One figure of one workload in this process: a backend's run, ``naive`` or ``floor``."""
    spec = WORKLOADS[name]
    rounds = rounds or (4 if spec["eval_every"] == 1 else 2 * spec["eval_every"])
    device = Device(kind, backend=what if what not in ("naive", "floor") else "auto")
    if what == "distributed":
        torch.set_num_threads(1)  # each rank one thread, as each worker of the processes backend
    data, clients = synthetic(spec, device.torch)
    if device.torch.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if what == "naive":
        result = {"s_per_round": bench_naive(spec, data, clients, rounds)}
    elif what == "floor":
        result = {"s_per_round": bench_floor(spec, data)}
    else:
        result = bench_fedrun(spec, data, clients, rounds, device)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if device.torch.type == "cuda":
        result["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return result


def workload(name: str, kind: str, backends: list[str], args) -> dict:
    """Every figure of a workload, each in a child process, ``args.repeats`` times interleaved; the fastest counts."""
    spec = WORKLOADS[name]
    if "concurrency" in spec:
        backends = ["loop"]  # the asynchronous engine trains one arriving client at a time
    references = spec.get("references", True) and "concurrency" not in spec
    # The naive loop is written for the papers' CNN; the floor takes any model.
    whats = backends + (["naive"] if references and "model" not in spec else []) + (["floor"] if references else [])
    runs = {what: [] for what in whats}
    for _ in range(args.repeats):  # interleaved, so a slow phase of a shared machine hits every figure alike
        for what in whats:
            start = [sys.executable]
            if what == "distributed":  # one process a rank, each on one thread (torchrun's OMP_NUM_THREADS)
                ranks = args.ranks or (usable_cores() if kind == "cpu" else 1)
                start = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={ranks}"]
            cmd = [*start, __file__, "--child", name, what, "--device", kind]
            cmd += (["--rounds", str(args.rounds)] if args.rounds else []) + (
                ["--threads", str(args.threads)] if args.threads else []
            )
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"{name} / {what} failed:\n{out.stderr[-3000:]}")
            runs[what].append(json.loads(out.stdout.strip().splitlines()[-1]))
    best = {what: min(results, key=lambda r: r["s_per_round"]) for what, results in runs.items()}
    passes = spec.get("cohort", spec.get("concurrency", 1)) * spec["samples"] * spec["epochs"]
    if spec.get("model") == "char_lstm":  # as Device.trainer counts it: a recurrent pass once per step (pass_cost)
        passes *= pass_cost(make_model(spec), torch.zeros(1, SEQUENCE, dtype=torch.long))
    chosen = Device(kind).chosen_backend(passes, vmap_ok=True)
    chosen = chosen if chosen in backends else backends[0]
    fedrun = best[chosen]
    result = {
        "workload": name,
        "device": kind,
        "s_per_round": round(fedrun["s_per_round"], 4),
        "mean_s_per_round": round(min(r["mean_s_per_round"] for r in runs[chosen]), 4),  # the estimate until 2026-11-30
        "naive_s_per_round": round(best["naive"]["s_per_round"], 4) if "naive" in best else None,
        "floor_s_per_round": round(best["floor"]["s_per_round"], 4) if "floor" in best else None,
        "peak_rss_mb": round(max(r["peak_rss_mb"] for r in runs[chosen]), 1),
        "backend": chosen,
        "parts": {k: round(v, 4) for k, v in fedrun["parts"].items()},
        "final_accuracy": fedrun["final_accuracy"],
    }
    if "floor" in runs:  # each repeat's own ratio: its fedrun and its floor a minute apart, a slow phase moves both
        result["floor_ratios"] = [
            round(f["s_per_round"] / g["s_per_round"], 3) for f, g in zip(runs[chosen], runs["floor"])
        ]
    for backend in backends:
        result[f"{backend}_s_per_round"] = round(best[backend]["s_per_round"], 4)
        if "peak_gpu_mb" in best[backend]:
            result[f"{backend}_peak_gpu_mb"] = round(max(r["peak_gpu_mb"] for r in runs[backend]), 1)
    return result


def describe(result: dict) -> str:
    parts = ", ".join(f"{k} {v:.3f}" for k, v in result["parts"].items())
    others = ", ".join(
        f"{k[: -len('_s_per_round')]} {v:.3f}"
        for k, v in result.items()
        if k.endswith("_s_per_round") and k not in ("naive_s_per_round", "floor_s_per_round", "mean_s_per_round")
    )
    line = (
        f"{result['workload']}: fedrun {result['s_per_round']:.3f} s/round (mean {result['mean_s_per_round']:.3f}) "
        f"with backend {result['backend']} ({parts}; {others})"
    )
    for reference in ("naive", "floor"):
        value = result[f"{reference}_s_per_round"]
        if value is not None:
            line += f"; {reference} {value:.3f} ({result['s_per_round'] / value:.2f}x"
            if reference == "floor" and len(result.get("floor_ratios", [])) > 1:
                line += "; each repeat's " + ", ".join(f"{r:.2f}x" for r in result["floor_ratios"])
            line += ")"
    gpu = ", ".join(f"{k[: -len('_peak_gpu_mb')]} {v:.0f} MB" for k, v in result.items() if k.endswith("_peak_gpu_mb"))
    line += f"; peak RSS {result['peak_rss_mb']:.0f} MB" + (f"; peak GPU memory {gpu}" if gpu else "")
    return line + ("" if MLFLOW else " (mlflow not installed: logging is the CSV files only)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--workloads",
        nargs="+",
        choices=list(WORKLOADS),
        help="default: " + "; ".join(f"{k}: {' '.join(v)}" for k, v in DEFAULT.items()),
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--backends",
        nargs="+",
        choices=["loop", "processes", "vmap", "distributed"],
        help="default: loop processes on cpu, loop vmap on cuda; distributed: torchrun with one rank per core (CPU) "
        "or --ranks",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="rounds per measurement, the first eval_every of them a warm-up (default: 4, or two evaluation periods)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="measurements of each figure, interleaved; the fastest counts (default: 2)",
    )
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--ranks", type=int, help="ranks of the distributed backend (default: the usable cores)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        measured = measure(*args.child, args.device, args.rounds)
        if distributed.rank() == 0:  # under torchrun, rank 0 alone reports
            print(json.dumps(measured))
        distributed.close()
        return
    results = []
    for name in args.workloads or DEFAULT[args.device]:
        result = workload(name, args.device, args.backends or BACKENDS[args.device], args)
        print(describe(result), flush=True)
        results.append(result)
    pairs = [("1000-clients", "10000-clients"), ("1000-clients", "1000000-clients")]
    pairs += [("async-1000", "async-10000"), ("async-1000", "async-1000000")]
    for small, large in pairs:
        found = {r["workload"]: r for r in results}
        if small in found and large in found:
            print(
                f"{large} / {small}: {found[large]['s_per_round'] / found[small]['s_per_round']:.2f}x seconds per round, "
                f"{found[large]['peak_rss_mb'] / found[small]['peak_rss_mb']:.2f}x peak RSS",
                flush=True,
            )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
