"""Run one config many times at once, under a CPU hog, and say whether (and where) the runs part.

Every run is the real ``fedrun`` command in its own dir (its own MLflow store), started together with the others
while ``--hog`` busy processes compete for the cores. Each run also writes, per call, a hash of what each stage of a
round produced (``stages.csv``): the cohort's updates after local training (``train``), the loss pass (``losses``),
the updates after the pipeline's stages (``stages``), the aggregate (``aggregate``) and the model after the server
step (``server``); with ``--backend distributed`` every rank writes its own. Runs are compared with the first one:
``metrics.csv`` column by column (timings aside), then the stage hashes in call order, so a difference is located
at the first stage, call and round where two runs part.

Usage:
    python scripts/stress_determinism.py --backend processes --runs 20 --concurrent 2 --hog 2
    python scripts/stress_determinism.py --backend distributed --ranks 2 --runs 6 --concurrent 2 --hog 1
    python scripts/stress_determinism.py --backend loop --runs 4 -- aggregator=fedavg schedule.rounds=4
    python scripts/stress_determinism.py --env OMP_DYNAMIC=true --runs 10 ...   # a hypothesis: set it in every run

The default config is the reliability test's ``[sync]`` case (MVR, server Adam, 6 clients, 8 rounds); arguments
after ``--`` replace or extend it. Exit status 0 when every run matches the first bit for bit, 1 otherwise.
"""

import argparse
import csv
import hashlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SYNC = ("aggregator=mvr", "server=adam", "schedule.rounds=8", "partition.num_clients=6")
HOG = "import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    sum(range(10000))\n"


def digest(tensor) -> str:
    import torch

    return hashlib.sha256(tensor.detach().to("cpu", torch.float64).contiguous().numpy().tobytes()).hexdigest()[:16]


def install_hooks(path: Path) -> None:
    """Wrap each stage's entry point so that every outermost call writes (stage, call, hash) to ``path``."""
    import numpy as np

    import fedrun.aggregators.base as base
    import fedrun.backends as backends
    import fedrun.distributed as distributed
    import fedrun.pipeline as pipeline
    import fedrun.servers as servers
    import fedrun.trainer as trainer
    import fedrun.vmap as vmap

    calls, depth, lock = itertools.count(), threading.local(), threading.Lock()
    out = path.open("a", newline="")
    writer = csv.writer(out)

    def wrap(cls, name, stage, of):
        original = cls.__dict__[name]

        def hooked(*args, **kwargs):
            depth.n = getattr(depth, "n", 0) + 1
            try:
                result = original(*args, **kwargs)
            finally:
                depth.n -= 1
            if depth.n == 0:
                with lock:
                    writer.writerow([stage, next(calls), of(result)])
                    out.flush()
            return result

        setattr(cls, name, hooked)

    def subclasses(root):
        seen, todo = [], [root]
        while todo:
            cls = todo.pop()
            seen.append(cls)
            todo.extend(cls.__subclasses__())
        return seen

    import fedrun.aggregators  # noqa: F401  (every rule's class, so that each is wrapped)
    import fedrun.privacy  # noqa: F401

    del backends, distributed, vmap  # imported for their Trainer subclasses

    for cls in subclasses(trainer.Trainer):
        if "__call__" in cls.__dict__:
            wrap(cls, "__call__", "train", lambda r: digest(r.deltas))
        if "losses" in cls.__dict__:
            wrap(cls, "losses", "losses", lambda r: digest(__import__("torch").as_tensor(np.asarray(r.mean))))
    wrap(pipeline.Pipeline, "__call__", "stages", lambda r: digest(r[0]))
    for cls in subclasses(base.Aggregator):
        if "aggregate" in cls.__dict__:
            wrap(cls, "aggregate", "aggregate", lambda r: digest(r.update))
    for cls in subclasses(servers.ServerOptimizer):
        if "step" in cls.__dict__:
            wrap(cls, "step", "server", lambda r: digest(r))


def child(args: list[str]) -> None:
    """Inside one run: hooks on, then the real ``fedrun`` entry point (Hydra reads ``sys.argv``)."""
    rank = os.environ.get("RANK", "0")
    install_hooks(Path(os.environ["FEDRUN_STRESS_DIR"]) / f"stages.{rank}.csv")
    from fedrun.cli import main

    sys.argv = ["fedrun", *args]
    main()


def command(backend: str, ranks: int, workers: int, out: Path, overrides: list[str]) -> list[str]:
    me = [str(Path(__file__).resolve()), "--child"]
    if backend == "distributed":
        torchrun = str(Path(sys.executable).parent / "torchrun")
        start = [torchrun, "--standalone", f"--nproc_per_node={ranks}", *me]
    else:
        start = [sys.executable, *me]
    device = ["device=cpu", f"device.backend={backend}"]
    if backend == "processes":
        device.append(f"device.workers={workers}")
    return [
        *start,
        *device,
        *overrides,
        f"hydra.run.dir={out}",
        f"tracking.uri=sqlite:///{out.parent}/{out.name}.db",  # beside the dir: a store inside would log itself
        "tracking.experiment=stress",
    ]


def compare(first: Path, other: Path) -> list[str]:
    """Where ``other`` parts from ``first``: differing metrics columns and the first differing stage hash."""
    import pandas as pd

    found = []
    left, right = pd.read_csv(first / "metrics.csv"), pd.read_csv(other / "metrics.csv")
    if len(left) != len(right):  # one stopped early (diverged, or its target reached): the rounds both ran compared
        found.append(f"metrics.csv: {len(left)} rounds vs {len(right)}")
        left, right = left.iloc[: len(right)], right.iloc[: len(left)]
    columns = [c for c in left.columns if not c.endswith("_wall_s")]
    for column in columns:
        if column not in right or not left[column].equals(right[column]):
            rows = (left[column] != right[column]).to_numpy().nonzero()[0] if column in right else []
            where = f" from round {int(left['round'].iloc[rows[0]])}" if len(rows) else ""
            found.append(f"metrics.csv {column}{where}")
    for mine in sorted(first.glob("stages.*.csv")):
        theirs = other / mine.name
        a = list(csv.reader(mine.open())) if mine.exists() else []
        b = list(csv.reader(theirs.open())) if theirs.exists() else []
        for row_a, row_b in zip(a, b):
            if row_a != row_b:
                found.append(f"{mine.name}: first difference at call {row_a[1]} ({row_a[0]} vs {row_b[0]})")
                break
        else:
            if len(a) != len(b):
                found.append(f"{mine.name}: {len(a)} calls vs {len(b)}")
    # Other thread counts or kernels sum in another order: a difference of the machine's, not of fedrun's.
    ran = [{k: v for k, v in json.loads((run / "run.json").read_text()).items() if k in ("threads", "cpus")}
           for run in (first, other)]  # fmt: skip
    if found and ran[0] != ran[1]:
        found.append(f"run.json: the runs ran at other thread counts or on other CPUs ({ran[0]} vs {ran[1]})")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["loop", "processes", "distributed"], default="processes")
    parser.add_argument("--runs", type=int, default=20, help="runs in all (default 20)")
    parser.add_argument("--concurrent", type=int, default=2, help="runs at once (default 2)")
    parser.add_argument("--hog", type=int, default=2, help="busy processes beside the runs (default 2)")
    parser.add_argument("--workers", type=int, default=2, help="device.workers of the processes backend")
    parser.add_argument("--ranks", type=int, default=2, help="torchrun ranks of the distributed backend")
    parser.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE", help="environment of every run")
    parser.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary dir)")
    parser.add_argument("overrides", nargs="*", help="fedrun overrides after --: replace the [sync] case's")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="fedrun-stress-"))
    overrides = args.overrides or list(SYNC)
    env = {**os.environ, **dict(e.split("=", 1) for e in args.env), "HYDRA_FULL_ERROR": "1"}
    hogs = [
        subprocess.Popen([sys.executable, "-c", HOG.format(seconds=24 * 3600)], stdout=subprocess.DEVNULL)
        for _ in range(args.hog)
    ]
    dirs, failed = [out / f"run{i:03d}" for i in range(args.runs)], 0
    started = time.perf_counter()
    try:
        for lo in range(0, args.runs, args.concurrent):
            batch = []
            for run_dir in dirs[lo : lo + args.concurrent]:
                run_dir.mkdir(parents=True)
                cmd = command(args.backend, args.ranks, args.workers, run_dir, overrides)
                log = (run_dir / "stress.log").open("w")
                batch.append(
                    (
                        run_dir,
                        subprocess.Popen(cmd, env={**env, "FEDRUN_STRESS_DIR": str(run_dir)}, stdout=log, stderr=log),
                    )
                )
            for run_dir, process in batch:
                if process.wait() != 0:
                    print(f"{run_dir.name}: exit {process.returncode} (see {run_dir / 'stress.log'})")
                    failed += 1
    finally:
        for hog in hogs:
            hog.kill()
    ran = [d for d in dirs if (d / "metrics.csv").exists()]
    parted = 0
    for other in ran[1:]:
        if differences := compare(ran[0], other):
            parted += 1
            print(f"{other.name} parts from {ran[0].name}: " + "; ".join(differences))
    print(
        f"{len(ran)} runs ({args.backend}, {args.concurrent} at once, {args.hog} hogs, "
        f"{time.perf_counter() - started:.0f} s): {len(ran) - 1 - parted} of {len(ran) - 1} equal the first bit for "
        f"bit; {failed} failed · {out}"
    )
    return 0 if parted == 0 and failed == 0 and ran else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2:])
    else:
        sys.exit(main())
