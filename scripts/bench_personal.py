"""Personal state at population scale: seconds per round and peak memory of a real ``fedrun`` run over a population
of a million clients, without personalisation, with FedPer's heads and with Ditto's whole personal models, in memory
and spilled to disk (``personalization.memory_mb``). Each variant runs in its own process (its peak RSS is its own).

Usage:
    python scripts/bench_personal.py [--rounds 30] [--cohort 10] [--clients 1000000]
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

VARIANTS = {
    "none": ["personalization=none"],
    "fedper": ["personalization=fedper"],
    "fedper, spilled (memory_mb=0.05)": ["personalization=fedper", "personalization.memory_mb=0.05"],
    "ditto": ["personalization=ditto"],
    "ditto, spilled (memory_mb=1)": ["personalization=ditto", "personalization.memory_mb=1"],
}


def run(overrides: list[str]) -> dict:
    fedrun = str(Path(sys.executable).parent / "fedrun")
    with tempfile.TemporaryDirectory() as scratch:
        code = (
            "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stderr=subprocess.DEVNULL); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, fedrun, *overrides, "tracking.enabled=false"],
            cwd=scratch,
            check=True,
            capture_output=True,
            text=True,
        )
        [csv] = Path(scratch, "outputs").rglob("metrics.csv")
        rounds = pd.read_csv(csv)["round_wall_s"]
        spilled = list(csv.parent.glob("personal/*.pt"))
        return {
            "s/round (median)": rounds.median(),
            "peak RSS MB": int(out.stdout.split()[-1]) / 1024,
            "files spilled": len(spilled),
            "MB on disk": sum(p.stat().st_size for p in spilled) / 1e6,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--cohort", type=int, default=10)
    parser.add_argument("--clients", type=int, default=1_000_000)
    args = parser.parse_args()
    base = [
        "partition=population",
        f"partition.num_clients={args.clients}",
        f"schedule.cohort={args.cohort}",
        f"schedule.rounds={args.rounds}",
        "schedule.eval_every=1000",  # the last round only: rounds measure training and personal state
        "device=cpu",
        "device.backend=loop",
        "device.threads=1",  # one core: the variants compare with each other, not with a run given every core
    ]
    print(f"population {args.clients:,}, cohort {args.cohort}, {args.rounds} rounds (digits, the CNN)")
    rows = {name: run(base + extra) for name, extra in VARIANTS.items()}
    print(pd.DataFrame(rows).T.round(3).to_string())


if __name__ == "__main__":
    main()
