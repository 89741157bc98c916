"""Convert FedScale's device capacities into a profiles file for ``devices=trace``.

FedScale ships ``client_device_capacity``: a pickle of {client id: {"computation": ms per sample of inference,
"communication": kbps}} (from AI Benchmark and MobiPerf). It is read by an unpickler that builds plain
containers and numbers only, so a crafted file cannot run code (``fedrun.devices.read_fedscale``); each client
becomes one row: speed = 3 x computation / 1000 seconds per training sample-pass (FedScale's own completion time
counts a training sample as 3 inferences), up = down = communication / 8000 megabytes per second. FedScale's ids
are renumbered 0 .. n - 1 in their order and kept in a ``fedscale_id`` column.

With ``--behaviour client_behave_trace --availability windows.csv`` it converts FedScale's availability traces too
(``fedrun.devices.fedscale_windows``): each client's (active, inactive) pairs become its windows, repeating over its
own ``finish_time`` (a ``period`` column), its id mapped as in the profiles.

Usage:
    python scripts/fedscale_profiles.py client_device_capacity profiles.csv     # or profiles.parquet
    python scripts/fedscale_profiles.py client_device_capacity profiles.csv --behaviour client_behave_trace \
        --availability windows.csv
    fedrun devices=trace devices.profiles=profiles.csv devices.availability=windows.csv ...
"""

import argparse
import sys
from pathlib import Path

from fedrun.devices import fedscale_ids, fedscale_profiles, fedscale_windows, read_fedscale, read_fedscale_behaviour
from fedrun.errors import ConfigError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("capacity", type=Path, help="FedScale's client_device_capacity pickle")
    parser.add_argument("out", type=Path, help="the profiles file to write (.csv, or .parquet)")
    parser.add_argument("--behaviour", type=Path, help="FedScale's client_behave_trace pickle (availability)")
    parser.add_argument("--availability", type=Path, help="the windows file to write from --behaviour")
    args = parser.parse_args()
    if (args.behaviour is None) != (args.availability is None):
        parser.error("--behaviour and --availability go together")
    try:
        capacity = read_fedscale(args.capacity)
        table = fedscale_profiles(capacity)
        windows = None
        if args.behaviour is not None:
            windows = fedscale_windows(read_fedscale_behaviour(args.behaviour), fedscale_ids(capacity))
    except ConfigError as exc:
        sys.exit(f"fedscale_profiles: {exc}")
    write(table, args.out)
    print(f"wrote {args.out}: {len(table)} clients, speed {table['speed'].median():.4g} s a pass (median)")
    if windows is not None:
        write(windows, args.availability)
        print(f"wrote {args.availability}: {len(windows)} windows of {windows['client'].nunique()} clients")


def write(table, path: Path) -> None:
    if path.suffix == ".parquet":
        table.to_parquet(path, index=False)
    else:
        table.to_csv(path, index=False)


if __name__ == "__main__":
    main()
