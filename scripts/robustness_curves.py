"""The curves under a robustness matrix's numbers: one seed's test accuracy per round for a few rules under one
attack, read from the sweep's run dirs (their ``metrics.csv``), with the tail the report averages shaded.

    python scripts/robustness_curves.py <sweep dir> --attack label_flip --seed 0 \
        --rules fedavg fedsoftmax median fltrust --out docs/robustness/label_flip_curves.png
"""

import argparse
from pathlib import Path

import pandas as pd
import yaml


def runs(sweep: Path) -> dict[tuple[str, str, str], Path]:
    """(defence, attack, seed) -> the job dir, from each job's ``.hydra/overrides.yaml``."""
    found = {}
    for job in sweep.iterdir():
        overrides = job / ".hydra" / "overrides.yaml"
        if not overrides.is_file():
            continue
        chosen = dict(o.split("=", 1) for o in yaml.safe_load(overrides.read_text()) if "=" in o)
        found[(chosen.get("defence"), chosen.get("attack"), chosen.get("seed"))] = job
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--attack", default="label_flip")
    parser.add_argument("--seed", default="0")
    parser.add_argument("--rules", nargs="+", default=["fedavg", "fedsoftmax", "median", "fltrust"])
    parser.add_argument("--tail", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("curves.png"))
    args = parser.parse_args()

    from fedrun.plots import plt

    jobs = runs(args.sweep)
    fig, ax = plt.subplots(figsize=(8, 4.2), layout="constrained")
    last = 0
    for rule in args.rules:
        metrics = pd.read_csv(jobs[(rule, args.attack, args.seed)] / "metrics.csv")
        ax.plot(metrics["round"], metrics["test_accuracy"], marker="o", ms=3, label=rule)
        last = max(last, int(metrics["round"].max()))
    ax.axvspan(last - args.tail + 0.5, last + 0.5, color="grey", alpha=0.12, label=f"tail (last {args.tail} rounds)")
    ax.set(xlabel="round", ylabel="test accuracy", title=f"{args.attack}, seed {args.seed}: every round evaluated")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="lower left")
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
