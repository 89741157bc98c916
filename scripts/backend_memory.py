"""Peak memory of one fedrun run with its whole process tree: the ``processes`` backend's parent and workers
against ``device.backend=distributed``'s torchrun ranks.

Resident set sizes count a page shared by several processes once per process (the workers forked from the
parent share its dataset tensors copy-on-write), so the figure here is the proportional set size (PSS,
``/proc/<pid>/smaps_rollup``: a shared page split between its sharers), summed over the tree and sampled every
0.1 s; the peak of that sum is what the run takes from the machine. Linux only.

    python scripts/backend_memory.py                  # MNIST, 50 clients, 3 rounds, both backends, 2 workers/ranks
    python scripts/backend_memory.py --overrides dataset=fmnist schedule.rounds=5
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    found, frontier = [root], [root]
    while frontier:
        pid = frontier.pop()
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        found += [int(c) for c in children]
        frontier += [int(c) for c in children]
    return found


def pss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def peak(command: list[str], cwd: str) -> tuple[float, float]:
    """(peak summed PSS in MB, wall seconds) of ``command`` and its descendants."""
    started, top = time.perf_counter(), 0.0
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while process.poll() is None:
        top = max(top, sum(pss_mb(pid) for pid in tree(process.pid)))
        time.sleep(0.1)
    if process.returncode:
        raise SystemExit(f"failed ({process.returncode}): {' '.join(command)}\n{process.stderr.read()[-2000:]}")
    return top, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="worker processes and ranks (default 2)")
    parser.add_argument(
        "--overrides",
        nargs="*",
        default=["dataset=mnist", "partition.num_clients=50", "schedule.rounds=3"],
        help="fedrun overrides of both runs",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        common = [*args.overrides, "device=cpu", "device.threads=1", "tracking.enabled=false"]
        runs = {
            f"processes ({args.workers} workers)": [
                str(BIN / "fedrun"),
                "device.backend=processes",
                f"device.workers={args.workers}",
                *common,
                f"hydra.run.dir={scratch}/processes",
            ],
            f"distributed ({args.workers} ranks)": [
                str(BIN / "torchrun"),
                "--standalone",
                f"--nproc_per_node={args.workers}",
                "-m",
                "fedrun",
                "device.backend=distributed",
                *common,
                f"hydra.run.dir={scratch}/distributed",
            ],
        }
        for name, command in runs.items():
            top, wall = peak(command, scratch)
            print(f"{name}: peak PSS {top:.0f} MB, {wall:.1f} s wall", flush=True)
    print(f"overrides: {' '.join(args.overrides)}; commit {os.popen('git rev-parse --short HEAD').read().strip()}")


if __name__ == "__main__":
    main()
