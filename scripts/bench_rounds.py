"""Seconds per round of a real ``fedrun`` run: runs the command in a scratch directory and reads metrics.csv.

Usage:
    python scripts/bench_rounds.py [--tracking] -- dataset=mnist partition=shards partition.num_clients=50 schedule.rounds=5
"""

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tracking", action="store_true", help="keep MLflow on (off by default: rounds only)")
    parser.add_argument("overrides", nargs="*", help="fedrun overrides, after --")
    args = parser.parse_args()
    fedrun = str(Path(sys.executable).parent / "fedrun")
    extra = [] if args.tracking else ["tracking.enabled=false"]
    with tempfile.TemporaryDirectory() as scratch:
        start = time.perf_counter()
        subprocess.run([fedrun, *args.overrides, *extra], cwd=scratch, check=True, stderr=subprocess.DEVNULL)
        total = time.perf_counter() - start
        [csv] = Path(scratch, "outputs").rglob("metrics.csv")
        metrics = pd.read_csv(csv)
    rounds = metrics["round_wall_s"]
    print(f"overrides: {' '.join(args.overrides) or '(defaults)'}")
    print(
        f"rounds: {len(rounds)}  s/round: mean {rounds.mean():.2f}  median {rounds.median():.2f}  "
        f"min {rounds.min():.2f}  max {rounds.max():.2f}"
    )
    print(f"whole command: {total:.1f} s  final test accuracy: {metrics['test_accuracy'].dropna().iloc[-1]:.4f}")


if __name__ == "__main__":
    main()
