"""How long ``fedrun`` takes to answer before any work: ``--help``, ``--cfg job``, ``--info``, a misspelt option, a
misspelt key, a bad root key (``metrics.r_targets``), a value a part's constructor refuses (its module is imported
with torch deferred: ``fedrun.lazy``), a combination of parts refused, and a value torch's solver refuses (which
needs torch), each the median of ``--repeat`` fresh processes; then which heavy modules each path
imported (torch, mlflow, pandas) and the slowest imports of ``fedrun.cli`` by ``python -X importtime``.

    python scripts/bench_cli_start.py [--repeat 5]

Run it on an idle machine: the figures are wall-clock seconds of a process that mostly imports. The budget
(issue 53): every path under 3 s, and none but the solver's importing torch, none importing mlflow.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The fedrun beside this Python (its virtual environment's, activated or not), as a user's shell would find it.
FEDRUN = str(Path(sys.executable).parent / "fedrun")
CASES = {
    "--help": ["--help"],
    "--cfg job": ["--cfg", "job"],
    "--info": ["--info"],
    "misspelt option": ["aggregator=fedsoftmx"],
    "misspelt key": ["schedule.round=3"],
    "bad root key": ["metrics.r_targets=[2]"],
    "non-finite value": ["optimizer.lr=inf"],
    "constructor's refusal": ["aggregator=fedsoftmax", "aggregator.temperature=-1"],
    "refused combination": ["engine=async", "personalization=fedper"],
    "solver's refusal": ["optimizer.lr=-1"],
}

PROBE = """
import sys
from fedrun.cli import main
sys.argv = ["fedrun", *sys.argv[1:]]
try:
    main()
except SystemExit:
    pass
heavy = [m for m in ("torch", "mlflow", "pandas") if type(sys.modules.get(m)) is type(sys)]  # not only deferred
print("imported:", " ".join(heavy) or "none", file=sys.stderr)
"""


def timed(args: list[str], cwd: str) -> tuple[float, str]:
    """Seconds ``fedrun <args>`` takes in a fresh process, and its last line (the answer or the error)."""
    start = time.perf_counter()
    done = subprocess.run([FEDRUN, *args], cwd=cwd, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    lines = (done.stderr or done.stdout).strip().splitlines()
    return elapsed, lines[-1] if lines else ""


def imported(args: list[str], cwd: str) -> str:
    """Which of torch, mlflow and pandas the path imported."""
    done = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=cwd, capture_output=True, text=True)
    return next((line for line in done.stderr.splitlines() if line.startswith("imported:")), "imported: ?")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--top", type=int, default=8, help="slowest imports of fedrun.cli to list")
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; {args.repeat} runs each")
    print(f"{'path':<24} {'median s':>8} {'min s':>7}  imports / answer")
    with tempfile.TemporaryDirectory() as cwd:  # nothing of a run is written for any of these
        for name, case in CASES.items():
            times = [timed(case, cwd)[0] for _ in range(args.repeat)]
            _, answer = timed(case, cwd)
            print(f"{name:<24} {statistics.median(times):>8.2f} {min(times):>7.2f}  {imported(case, cwd)}")
            print(f"{'':<42}{answer[:110]}")
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", "import fedrun.cli"], cwd=cwd, capture_output=True, text=True
        )
    rows = []
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, cumulative, module = line.split("|")
            if cumulative.strip().isdigit():
                rows.append((int(cumulative), module.rstrip()))
    print(f"\nslowest imports of fedrun.cli (cumulative ms, -X importtime): total {max(rows)[0] / 1000:.0f} ms")
    for micros, module in sorted(rows, reverse=True)[1 : args.top + 1]:
        print(f"  {micros / 1000:>7.1f}  {module}")


if __name__ == "__main__":
    main()
