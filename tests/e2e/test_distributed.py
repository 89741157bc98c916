"""device.backend=distributed through the real command under the real torchrun (2 ranks, gloo on the CPU): the same
metrics.csv as the loop's, rank 0 alone writing; the refusals."""

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import FEDRUN

pytestmark = pytest.mark.e2e

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
COMMON = ["schedule.rounds=3", "device=cpu", "device.threads=1", "tracking.experiment=distributed"]


def fedrun(cwd, out, *args, ranks: int | None = None) -> subprocess.CompletedProcess:
    command = [FEDRUN] if ranks is None else [TORCHRUN, "--standalone", f"--nproc_per_node={ranks}", "-m", "fedrun"]
    backend = [] if ranks is None else ["device.backend=distributed"]
    done = subprocess.run(
        [*command, *backend, *COMMON, *args, f"hydra.run.dir={out}"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def metrics(out: Path) -> pd.DataFrame:
    rows = pd.read_csv(out / "metrics.csv")
    return rows[[c for c in rows.columns if not c.endswith("wall_s")]]


CASES = {
    "fedavg": [],
    "fedsoftmax": ["aggregator=fedsoftmax"],  # per-client losses gathered from both ranks
    "topk_error_feedback": ["compression=topk"],  # each client's residual follows it, whichever rank trains it
    "central_dp": [  # the noise drawn once, the same on every rank
        "privacy=central",
        "aggregator.weighting=uniform",
        "schedule.sampling=poisson",
        "schedule.clients_per_round=0.5",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_give_the_loops_metrics(tmp_path, case):
    fedrun(tmp_path, tmp_path / "loop", "device.backend=loop", *CASES[case])
    fedrun(tmp_path, tmp_path / "ranks", *CASES[case], ranks=2)
    pd.testing.assert_frame_equal(metrics(tmp_path / "ranks"), metrics(tmp_path / "loop"), check_exact=True)
    assert (tmp_path / "ranks" / "config.yaml").is_file()  # rank 0 wrote its run dir; rank 1 left nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop", "outputs", "ranks"]


def test_the_distributed_backend_outside_torchrun_is_refused_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")}
    done = subprocess.run(
        [FEDRUN, "device.backend=distributed", "schedule.rounds=1", "tracking.enabled=false"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**env, "HYDRA_FULL_ERROR": "0"},
    )
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("fedrun: error: device.backend='distributed' is invalid: allowed is a command started by torchrun")
    )
