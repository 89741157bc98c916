"""Convert FedScale's device capacities into a profiles file for ``devices=trace``.

FedScale ships ``client_device_capacity``: a pickle of {client id: {"computation": ms per sample of inference,
"communication": kbps}} (from AI Benchmark and MobiPerf). It is read by an unpickler that builds plain
containers and numbers only, so a crafted file cannot run code (``fedrun.devices.read_fedscale``); each client
becomes one row: speed = 3 x computation / 1000 seconds per training sample-pass (FedScale's own completion time
counts a training sample as 3 inferences), up = down = communication / 8000 megabytes per second. FedScale's ids
are renumbered 0 .. n - 1 in their order and kept in a ``fedscale_id`` column.

Usage:
    python scripts/fedscale_profiles.py client_device_capacity profiles.csv     # or profiles.parquet
    fedrun devices=trace devices.profiles=profiles.csv ...
"""

import argparse
import sys
from pathlib import Path

from fedrun.devices import fedscale_profiles, read_fedscale
from fedrun.errors import ConfigError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("capacity", type=Path, help="FedScale's client_device_capacity pickle")
    parser.add_argument("out", type=Path, help="the profiles file to write (.csv, or .parquet)")
    args = parser.parse_args()
    try:
        table = fedscale_profiles(read_fedscale(args.capacity))
    except ConfigError as exc:
        sys.exit(f"fedscale_profiles: {exc}")
    if args.out.suffix == ".parquet":
        table.to_parquet(args.out, index=False)
    else:
        table.to_csv(args.out, index=False)
    print(f"wrote {args.out}: {len(table)} clients, speed {table['speed'].median():.4g} s a pass (median)")


if __name__ == "__main__":
    main()
