#!/usr/bin/env bash
# Regenerates tests/data/ckpt_968a63f/<case>/: run dirs written by fedrun at commit 968a63f, stopped by SIGTERM after
# a checkpoint, which tests/e2e/test_old_checkpoints.py resumes with today's code (issue 35: the checkpoint-format
# refactor must keep them resumable).
#
#   scripts/make_968a63f_checkpoints.sh        # from the repository root, in its virtual environment
#
# What it does, per case:
#   1. a worktree of 968a63f ($OLD, default /tmp/old968; made if missing). conf/ is mapped into the package as
#      fedrun.conf by pyproject.toml, which only an install honours: the worktree gets the link fedrun/conf ->
#      ../conf, else the editable install of this checkout would serve today's conf/ to the old code.
#   2. PYTHONPATH=$OLD python -c 'from fedrun.cli import main; main()' <overrides> (what the fedrun console script
#      runs), in a scratch working directory, with checkpoint.every=1 and schedule.rounds=10.
#   3. SIGTERM once metrics.csv has STOP_AFTER rows: fedrun finishes the round it is in, checkpoints it and exits
#      143. The saved round is 2 or a little later (the test reads it from the checkpoint).
#   4. Only what a resume reads is kept: config.yaml, checkpoint.pt, run.json and the per-round CSV files
#      (metrics.csv, alpha.csv, local_steps.csv, selected.csv), plus .hydra/overrides.yaml, the command line the
#      test repeats for its uninterrupted run.
# The worktree is removed at the end when this script made it.
# .gitignore ignores every data/ folder: commit the result with git add -f tests/data/ckpt_968a63f.
set -euo pipefail

COMMIT=968a63f
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEST=$ROOT/tests/data/ckpt_$COMMIT
OLD=${OLD:-/tmp/old968}
STOP_AFTER=2
export OMP_NUM_THREADS=1

# Tiny and fast: the digits data set (in scikit-learn, nothing to download), a logistic model, six clients.
COMMON=(model=logistic partition.num_clients=6 schedule.rounds=10 schedule.local_epochs=1 checkpoint.every=1
    tracking.enabled=false device=cpu)
ADAPTIVE_CLIP=(pipeline=clip pipeline.stages.0.adaptive=true pipeline.stages.0.max_norm=0.05)
declare -A CASES=(
    # a stateful aggregator (the hybrid's F* estimates), server momentum, the adaptive clip norm, top-k's
    # error-feedback residuals and Power-of-Choice's draws
    [sync]="aggregator=hybrid +aggregator.phases.0.aggregator.fstar=estimate aggregator.phases.0.until_round=5
        server=momentum ${ADAPTIVE_CLIP[*]} compression=topk compression.k=0.2 sampler=power_of_choice
        sampler.candidates=5 schedule.clients_per_round=0.5"
    # the event heap, buffer, pulled versions and FedStaleWeight's staleness windows
    [async]="aggregator=fedstaleweight engine.concurrency=3"
    # the privacy ledger, Poisson sampling, the noise streams and adaptive clipping's clip norm
    [central]="privacy=central privacy.noise_multiplier=0.8 privacy.clip_norm=0.1 privacy.adaptive=true
        privacy.clip_count_noise=1.0 aggregator.weighting=uniform schedule.sampling=poisson
        schedule.clients_per_round=0.5"
    # each client's rounds in the ledger and its noise stream
    [local]="privacy=local privacy.noise_multiplier=0.8 privacy.clip_norm=0.1 aggregator.weighting=uniform
        schedule.clients_per_round=0.5"
    # the importance sampler's last-known norms and selection counts
    [importance]="sampler=importance schedule.clients_per_round=0.5"
)
KEEP=(config.yaml checkpoint.pt run.json metrics.csv alpha.csv local_steps.csv selected.csv)

made_worktree=false
if [[ ! -d $OLD ]]; then
    git -C "$ROOT" worktree add -f "$OLD" "$COMMIT"
    made_worktree=true
fi
[[ $(git -C "$OLD" rev-parse --short=7 HEAD) == "$COMMIT" ]] || { echo "$OLD is not at $COMMIT" >&2; exit 1; }
[[ -e $OLD/fedrun/conf ]] || ln -s ../conf "$OLD/fedrun/conf"
SCRATCH=$(mktemp -d)
cd "$SCRATCH"
imported=$(PYTHONPATH=$OLD python -c 'import fedrun, fedrun.conf; print(fedrun.__file__, *fedrun.conf.__path__)')
[[ $imported == "$OLD/fedrun/__init__.py $OLD/fedrun/conf" ]] || { echo "the old code is not the one imported: $imported" >&2; exit 1; }

rows() { [[ -f $1/metrics.csv ]] && echo $(($(wc -l <"$1/metrics.csv") - 1)) || echo 0; }

rm -rf "$DEST"
for case in "${!CASES[@]}"; do
    out=$SCRATCH/$case
    # shellcheck disable=SC2086  # a case's overrides are words
    PYTHONPATH=$OLD python -c 'import sys; from fedrun.cli import main; sys.exit(main())' \
        "${COMMON[@]}" ${CASES[$case]} "hydra.run.dir=$out" >"$SCRATCH/$case.err" 2>&1 &
    pid=$!
    until (($(rows "$out") >= STOP_AFTER)); do
        kill -0 "$pid" 2>/dev/null || { tail -20 "$SCRATCH/$case.err" >&2; exit 1; }
        sleep 0.02
    done
    kill -TERM "$pid"
    status=0
    wait "$pid" || status=$?
    ((status == 143)) || { echo "$case: exit $status, not a stop by SIGTERM" >&2; tail -20 "$SCRATCH/$case.err" >&2; exit 1; }
    mkdir -p "$DEST/$case/.hydra"
    for name in "${KEEP[@]}"; do
        [[ -f $out/$name ]] && cp "$out/$name" "$DEST/$case/"
    done
    cp "$out/.hydra/overrides.yaml" "$DEST/$case/.hydra/"
    echo "$case: stopped after round $(rows "$out") of 10"
done
rm -rf "$SCRATCH"
$made_worktree && git -C "$ROOT" worktree remove --force "$OLD"
du -sh "$DEST"
