"""Seconds per round of fedrun's engine against two references measured in the same run.

Workloads, on synthetic MNIST-shaped tensors (1x28x28, 10 classes; no files needed), the papers' CNN, FedAvg:

- ``papers``: 50 clients x 200 samples, full participation, E = 2, batch 64, a 10,000-image test
  evaluation every round (paper 000's protocol).
- ``cross-device``: 1,000 clients x 50 samples, cohort 50, E = 1, batch 10, evaluation every 10 rounds.
- ``10000-clients``: 10,000 clients x 50 samples, cohort 100, E = 1, batch 10, evaluation every 10 rounds.

Seconds per round are the median over the rounds after a warm-up round (papers), or the mean over the
evaluation period after a warm-up period (the others), so an evaluation every 10 rounds counts a tenth.

For each: fedrun's seconds per round with the backend ``device.backend=auto``
picks, split into local training, loss pass, aggregation, evaluation and logging, and both backends' figures
(``loop``, ``processes``) (a real Tracker writing metrics.csv and MLflow to a scratch SQLite
store); ``naive``, the loop a researcher writes first (a state_dict loaded into the model per client,
a DataLoader, evaluation in batches of 1000, the per-client loss pass); and the compute ``floor``: the same
forward/backward sample-passes as one centrally trained model at the same batch size in its fastest layout
(contiguous or channels_last), plus the same forward-only passes (test set and train_loss pass on evaluated rounds).
Each workload runs in its own process so its peak RSS is its own. Every figure is measured ``--repeats``
times, the measurements interleaved, and the fastest counts (noise on a shared machine only ever adds time).
The last line is JSON.

Usage:
    python scripts/bench.py [--workloads papers cross-device 10000-clients] [--rounds 4] [--repeats 2] [--threads N]
"""

import argparse
import functools
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

from fedrun.aggregators import FedAvg
from fedrun.backends import Device
from fedrun.datasets import FederatedData
from fedrun.engine import Schedule, run
from fedrun.models import CNN
from fedrun.tracking import Tracker

WORKLOADS = {
    "papers": dict(clients=50, samples=200, cohort=50, epochs=2, batch=64, test=10_000, eval_every=1),
    "cross-device": dict(clients=1_000, samples=50, cohort=50, epochs=1, batch=10, test=10_000, eval_every=10),
    "10000-clients": dict(clients=10_000, samples=50, cohort=100, epochs=1, batch=10, test=10_000, eval_every=10),
}
LR = 0.05


def synthetic(spec: dict, seed: int = 0) -> tuple[FederatedData, list[np.ndarray]]:
    """MNIST-shaped inputs whose label shifts a class pattern, so training has something to learn."""
    g = torch.Generator().manual_seed(seed)
    n = spec["clients"] * spec["samples"]
    patterns = torch.randn(10, 1, 28, 28, generator=g)
    y, y_test = torch.randint(0, 10, (n,), generator=g), torch.randint(0, 10, (spec["test"],), generator=g)
    x = torch.randn(n, 1, 28, 28, generator=g).add_(patterns[y])
    x_test = torch.randn(spec["test"], 1, 28, 28, generator=g).add_(patterns[y_test])
    clients = list(np.arange(n).reshape(spec["clients"], spec["samples"]))
    return FederatedData(x, y, x_test, y_test, num_classes=10), clients


def bench_fedrun(spec: dict, data: FederatedData, clients: list[np.ndarray], rounds: int, device: Device) -> dict:
    torch.manual_seed(0)
    model = CNN((1, 28, 28), 10)
    schedule = Schedule(rounds=rounds, local_epochs=spec["epochs"], batch_size=spec["batch"],
                        clients_per_round=spec["cohort"] / spec["clients"], eval_every=spec["eval_every"])
    rows, logging = [], []
    with tempfile.TemporaryDirectory() as scratch:
        tracker = Tracker(Path(scratch) / "run", len(clients), True, f"sqlite:///{scratch}/mlflow.db", "bench")
        tracker.start({}, {}, "bench")

        def on_round(row, per_client):
            start = time.perf_counter()
            tracker.log_round(row, per_client)
            logging.append(time.perf_counter() - start)
            rows.append(row)

        run(model, data, clients, FedAvg(), functools.partial(torch.optim.SGD, lr=LR), schedule, device, 0, on_round=on_round)
        tracker.finish("FINISHED")
    parts = {k: per_round(spec, [r[f"{k}_wall_s"] for r in rows]) for k in ("train", "loss", "aggregate", "eval")}
    parts["logging"] = per_round(spec, logging)
    total = [r["round_wall_s"] + log for r, log in zip(rows, logging)]
    return {"s_per_round": per_round(spec, total), "parts": parts, "final_accuracy": rows[-1]["test_accuracy"]}


def per_round(spec: dict, seconds: list[float]) -> float:
    """Seconds per round after a warm-up of one evaluation period (so one-time kernel set-up of every shape
    is left out): the median when every round is evaluated, else the mean, so an evaluation counts its share."""
    measured = seconds[spec["eval_every"] :]
    return statistics.median(measured) if spec["eval_every"] == 1 else statistics.fmean(measured)


def bench_naive(spec: dict, data: FederatedData, clients: list[np.ndarray], rounds: int) -> float:
    """The plain loop: state_dict per client, DataLoader, per-client loss pass, evaluation in batches of 1000."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(1600, 10))
    rng = np.random.default_rng(0)
    times = []
    for t in range(1, rounds + 1):
        start = time.perf_counter()
        cohort = rng.choice(len(clients), size=spec["cohort"], replace=False)
        global_state = {k: v.clone() for k, v in model.state_dict().items()}
        new_state = {k: torch.zeros_like(v) for k, v in global_state.items()}
        total = sum(len(clients[c]) for c in cohort)
        for c in cohort:
            index = torch.as_tensor(clients[c])
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
        times.append(time.perf_counter() - start)
    return per_round(spec, times)


def bench_floor(spec: dict, data: FederatedData) -> float:
    """One central model, the same sample-passes per round at the same batch size, in its fastest layout;
    plus the same forward-only passes (on an evaluated round, once every ``eval_every``: the test set, and
    the cohort's training samples, whose loss under the round's model fedrun logs as train_loss)."""
    return min(_floor(spec, data, memory_format) for memory_format in (torch.contiguous_format, torch.channels_last))


def _floor(spec: dict, data: FederatedData, memory_format: torch.memory_format) -> float:
    passes = spec["cohort"] * spec["samples"] * spec["epochs"]
    torch.manual_seed(0)
    model = CNN((1, 28, 28), 10).to(memory_format=memory_format)  # ReLU after pooling: the cheaper exact order
    x, y = data.x_train.contiguous(memory_format=memory_format), data.y_train
    x_test = data.x_test.contiguous(memory_format=memory_format)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    timings = []
    for _ in range(2):  # the first is a warm-up
        start = time.perf_counter()
        for done in range(0, passes, spec["batch"]):
            lo = done % (len(x) - spec["batch"] + 1)  # wraps around: E epochs over the data
            optimizer.zero_grad(set_to_none=True)
            cross_entropy(model(x[lo : lo + spec["batch"]]), y[lo : lo + spec["batch"]]).backward()
            optimizer.step()
        train = time.perf_counter() - start
        start = time.perf_counter()
        with torch.inference_mode():  # evaluated rounds: the test set, and the cohort's data for train_loss
            for lo in range(0, len(x_test), 256):  # the fastest chunk size for this CNN on CPU
                model(x_test[lo : lo + 256]).argmax(1)
            for lo in range(0, spec["cohort"] * spec["samples"], 256):
                model(x[lo : lo + 256]).argmax(1)
        timings.append(train + (time.perf_counter() - start) / spec["eval_every"])
    return timings[-1]


def one(name: str, rounds: int | None, repeats: int) -> dict:
    spec = WORKLOADS[name]
    rounds = rounds or (4 if spec["eval_every"] == 1 else 2 * spec["eval_every"])
    data, clients = synthetic(spec)
    auto = Device("cpu")
    chosen = auto.chosen_backend(spec["cohort"] * spec["samples"] * spec["epochs"])
    runs = {"loop": [], "processes": [], "naive": [], "floor": []}
    for _ in range(repeats):  # interleaved, so a slow phase of a shared machine hits every figure alike
        for backend in ("loop", "processes"):
            runs[backend].append(bench_fedrun(spec, data, clients, rounds, Device("cpu", backend=backend)))
        runs["naive"].append(bench_naive(spec, data, clients, rounds))
        runs["floor"].append(bench_floor(spec, data))
    backends = {b: min(runs[b], key=lambda r: r["s_per_round"]) for b in ("loop", "processes")}
    fedrun = backends[chosen]
    naive, floor = min(runs["naive"]), min(runs["floor"])
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"workload": name, "s_per_round": round(fedrun["s_per_round"], 4), "naive_s_per_round": round(naive, 4),
            "floor_s_per_round": round(floor, 4), "peak_rss_mb": round(peak_mb, 1), "backend": chosen,
            "loop_s_per_round": round(backends["loop"]["s_per_round"], 4),
            "processes_s_per_round": round(backends["processes"]["s_per_round"], 4),
            "parts": {k: round(v, 4) for k, v in fedrun["parts"].items()}, "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, help="rounds per measurement, the first eval_every of them a warm-up (default: 4, or two evaluation periods)")
    parser.add_argument("--repeats", type=int, default=2, help="measurements of each figure, interleaved; the fastest counts (default: 2)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:  # one workload in this process, so its peak RSS is its own
        print(json.dumps(one(args.child, args.rounds, args.repeats)))
        return
    results = []
    for name in args.workloads:
        cmd = [sys.executable, __file__, "--child", name, "--repeats", str(args.repeats)] + (["--rounds", str(args.rounds)] if args.rounds else []) + (["--threads", str(args.threads)] if args.threads else [])
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        result = json.loads(out)
        parts = ", ".join(f"{k} {v:.3f}" for k, v in result["parts"].items())
        print(f"{name}: fedrun {result['s_per_round']:.3f} s/round with backend {result['backend']} ({parts}; loop "
              f"{result['loop_s_per_round']:.3f}, processes {result['processes_s_per_round']:.3f}); naive {result['naive_s_per_round']:.3f} "
              f"({result['s_per_round'] / result['naive_s_per_round']:.2f}x); floor {result['floor_s_per_round']:.3f} "
              f"({result['s_per_round'] / result['floor_s_per_round']:.2f}x); peak RSS {result['peak_rss_mb']:.0f} MB", flush=True)
        results.append(result)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
