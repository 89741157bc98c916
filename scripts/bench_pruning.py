"""Time one seed job's per-round reports against a study of 20 finished trials x 3 seeds x R rounds: python scripts/bench_pruning.py <source root> <R> <accuracy reported>."""

import sys
import tempfile
import time

import optuna
from optuna.distributions import FloatDistribution

sys.path.insert(0, sys.argv[1])
from fedrun.study import SeedReport, mean_curve, open_storage
from hydra_plugins.fedrun_optuna_sweeper.optuna_sweeper import make_pruner

R = int(sys.argv[2])
d = tempfile.mkdtemp()
storage = open_storage(None, d)
study = optuna.create_study(storage=storage, study_name="s", direction="maximize")
space = {"x": FloatDistribution(0, 1)}
for k in range(20):
    attrs = {f"fedrun:value:{s}:{r}": 0.5 + 0.01 * k + 0.001 * r / R for s in range(3) for r in range(1, R + 1)}
    study.add_trial(
        optuna.trial.create_trial(
            params={"x": 0.01 * k},
            distributions=space,
            value=0.5,
            intermediate_values=mean_curve(attrs),
            system_attrs=attrs,
        )
    )
trial = study.ask(space)
job = SeedReport(storage, "s", trial.number, 0, make_pruner("median"), last_round=R + 1)
start = time.perf_counter()
pruned = None
for r in range(1, R + 1):
    pruned = job.report(r, {"test_accuracy": float(sys.argv[3])})
print(f"R={R}: {time.perf_counter() - start:.2f} s for {R} reports, pruned={pruned}")
