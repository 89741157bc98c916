#!/usr/bin/env bash
# The GPU check, one call on a machine with CUDA: what needs a GPU to be shown, in some five minutes.
#
#   bash scripts/device_check.sh [OUT]      # OUT: where logs and run files go (default: $OUT, else ./device_check)
#
# Needs fedrun installed (pip install -e ., or --no-deps where torch is there already) and MNIST under $FEDRUN_DATA.
# It runs: the CUDA tests (every client program and solver on vmap and the loop equal to the CPU loop in float64)
# with the deferral and start-up tests; a refused value through the command, timed (torch stays deferred); the real
# command on CUDA for SCAFFOLD, FedDyn and MOON on the loop and vmap; SCAFFOLD over two torchrun ranks on one GPU,
# compared with the one-process vmap run (equal, bit for bit; the loop on a CPU); then scripts/bench.py --device cuda.
# First run of it: 2026-11-30 on an H200 (Python 3.12.3), docs/results/benchmarks.md. A dry run on a CPU (the runs
# shrunk, no bench): DEVICE=cpu RUN_ARGS="schedule.rounds=1 partition.num_clients=4" BENCH=0 bash scripts/device_check.sh
set -uo pipefail
out="${1:-${OUT:-device_check}}"
mkdir -p "$out" && out="$(realpath "$out")"
device="${DEVICE:-cuda}"
export PYTHONUNBUFFERED=1
runs="$(mktemp -d)"
t0=$(date +%s)
stamp() { echo "=== $1 at $(($(date +%s) - t0)) s"; }
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
timeout 300 python3 -m pytest -p no:cacheprovider -q -n 8 tests/unit/test_backends.py tests/config/test_lazy_torch.py \
    tests/e2e/test_cli_start.py 2>&1 | tail -8 | tee "$out/pytest.log"
stamp tests
start=$(date +%s.%N)
fedrun aggregator=fedsoftmax aggregator.temperature=-1 2>&1 | tail -1
python3 -c "print(f'refused in {$(date +%s.%N) - $start:.2f} s')"
# shellcheck disable=SC2206  # RUN_ARGS: overrides, split on spaces
common=(dataset=mnist partition=shards schedule.rounds=3 partition.num_clients=20 schedule.clients_per_round=0.5
    tracking.enabled=false device="$device" device.threads=1 ${RUN_ARGS:-})  # one thread: equal on a CPU too
for spec in "scaffold loop" "scaffold vmap" "feddyn vmap" "moon vmap" "moon loop"; do
    set -- $spec
    timeout 150 fedrun "${common[@]}" client="$1" device.backend="$2" hydra.run.dir="$runs/$1_$2" 2>&1 | tail -1
    stamp "$1 on $2"
done
# each rank trains its block as one process would: vmap on a GPU (a block's batched products give the whole cohort's
# bits there), the loop on a CPU (where a batched product's bits depend on its batch: docs/explanation/runs.md)
inner=$([ "$device" = cuda ] && echo vmap || echo loop)
timeout 200 python3 -m torch.distributed.run --standalone --nproc_per_node=2 -m fedrun "${common[@]}" client=scaffold \
    device.backend=distributed device.inner="$inner" hydra.run.dir="$runs/scaffold_distributed" 2>&1 | tail -1
python3 - "$runs" "$inner" <<'PY'
import sys, pandas as pd
def table(name):
    frame = pd.read_csv(f"{sys.argv[1]}/{name}/metrics.csv")
    return frame[[c for c in frame.columns if not c.endswith("_wall_s")]]
print(f"two ranks equal one process on {sys.argv[2]}:", table("scaffold_distributed").equals(table(f"scaffold_{sys.argv[2]}")))
PY
stamp distributed
(cd "$runs" && tar czf "$out/runs.tgz" */metrics.csv */config.yaml */run.json 2>/dev/null)
if [ "${BENCH:-1}" = 1 ]; then
    timeout 300 python3 scripts/bench.py --device "$device" --repeats 1 2>&1 | grep -v Warning | tee "$out/bench.log"
    stamp bench
fi
