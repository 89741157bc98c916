"""Run dirs written by an older fedrun still resume (issue 35): each dir under ``tests/data/ckpt_968a63f/`` was
written by commit 968a63f and stopped by SIGTERM after a checkpoint (``scripts/make_968a63f_checkpoints.sh``
regenerates them). Today's ``fedrun resume=<copy>`` must finish it exactly as today's code runs the same command
uninterrupted: the guard for the checkpoint-format refactor and its migration of older checkpoints."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import FEDRUN, config_can_say, swept_once

from e2e.test_reliability import deterministic
from fedrun.tracking import PER_CLIENT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FIXTURES = Path(__file__).parents[1] / "data" / "ckpt_968a63f"
CASES = ["sync", "async", "central", "local", "importance"]  # what each one covers: the script's comments


def test_every_fixture_dir_is_a_case():
    assert sorted(p.name for p in FIXTURES.iterdir()) == sorted(CASES)


def holds(today, old) -> bool:
    """Whether ``today``'s config has every key of ``old`` with its value, at any depth (in a hybrid's list of
    phases too): today's may add keys (an aggregator's ``trim``), never change or drop one."""
    if isinstance(old, dict):
        return isinstance(today, dict) and all(k in today and holds(today[k], v) for k, v in old.items())
    if isinstance(old, list):
        return isinstance(today, list) and len(today) == len(old) and all(map(holds, today, old))
    return today == old


def after(frame: pd.DataFrame, round_: int) -> pd.DataFrame:
    return frame[frame["round"] > round_].reset_index(drop=True)


def old_command(case: str) -> list[str]:
    """The old run's command line (its overrides)."""
    return yaml.safe_load((FIXTURES / case / ".hydra" / "overrides.yaml").read_text())


# The cases a config can say (not a list's entry by index: sync's hybrid phase and clip stage): today's uninterrupted
# runs of them as one sweep, in one process (conftest.run_cases), on the worker that resumes them (one xdist group).
SWEPT = [c for c in CASES if config_can_say(old_command(c))]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """case -> the run dir of today's uninterrupted run of its command, every case of ``SWEPT`` in one sweep."""
    cases = {c: old_command(c) for c in SWEPT}
    return swept_once(tmp_path_factory, "uninterrupted_today", cases, "tracking.enabled=false")


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=[pytest.mark.xdist_group("today")] if c in SWEPT else []) for c in CASES]
)
def test_a_run_dir_written_by_968a63f_resumes_and_equals_an_uninterrupted_run_of_today(tmp_path, uninterrupted, case):
    fixture, resumed_dir = FIXTURES / case, tmp_path / "resumed"
    shutil.copytree(fixture, resumed_dir)  # the resume rewrites its files: never the committed ones
    old_config = yaml.safe_load((fixture / "config.yaml").read_text())
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    whole = None
    if case in SWEPT:
        whole_dir = uninterrupted(case)
    else:
        whole_dir = tmp_path / "whole"
        whole = subprocess.Popen(  # beside the resume
            [FEDRUN, *old_command(case), f"hydra.run.dir={whole_dir}"],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
    resumed = subprocess.run([FEDRUN, f"resume={resumed_dir}"], cwd=tmp_path, capture_output=True, text=True, env=env)
    if whole is not None:
        whole_err = whole.communicate()[1]
        assert whole.returncode == 0, whole_err[-3000:]
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    found = re.search(r"resuming \S+ after round (\d+)", resumed.stderr)
    assert found, resumed.stderr[-3000:]  # from its checkpoint, not restarted from round 1
    saved, rounds = int(found.group(1)), old_config["schedule"]["rounds"]
    assert len(pd.read_csv(fixture / "metrics.csv")) == saved < rounds  # the stop came after its round's checkpoint

    # the same config: every key the old run saved has its value in today's run (today's may add keys)
    assert holds(yaml.safe_load((whole_dir / "config.yaml").read_text()), old_config)

    # the rounds up to the checkpoint are the old run's, kept; those after it equal today's uninterrupted run
    resumed_rows, whole_rows = deterministic(resumed_dir), deterministic(whole_dir)
    assert resumed_rows["round"].tolist() == whole_rows["round"].tolist() == list(range(1, rounds + 1))
    old_rows = deterministic(fixture)
    # (on the old run's columns: today's may log one more, NaN in the old rows, e.g. FedAvg's alpha_distance under
    # local DP, whose mechanism is now a stage before FedAvg rather than FedAvg's replacement)
    kept = resumed_rows[resumed_rows["round"] <= saved].reset_index(drop=True)
    pd.testing.assert_frame_equal(kept[old_rows.columns], old_rows)
    # (a column today's code adds comes last in the resumed file, whose header the old run wrote)
    pd.testing.assert_frame_equal(after(resumed_rows, saved), after(whole_rows, saved), check_like=True)
    # and today's code computes the old run's rounds as 968a63f did: the refactor changed no number
    pd.testing.assert_frame_equal(
        whole_rows[whole_rows["round"] <= saved].reset_index(drop=True)[old_rows.columns], old_rows
    )
    for name in PER_CLIENT:
        if (whole_dir / f"{name}.csv").exists():
            pd.testing.assert_frame_equal(
                after(pd.read_csv(resumed_dir / f"{name}.csv"), saved),
                after(pd.read_csv(whole_dir / f"{name}.csv"), saved),
            )
