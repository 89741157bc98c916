"""Hydra's composition errors through the real ``fedrun`` command: one line and exit 2 (the lines themselves:
tests/config/test_config.py's HYDRA_ERRORS)."""

import pytest
from config.test_config import HYDRA_ERRORS


def _one_line_through_fedrun(fedrun, overrides, line):
    done = fedrun(*overrides, check=False)
    assert (done.returncode, done.stderr.splitlines()) == (2, [f"fedrun: error: {line}"]), done.stderr[-2000:]


FAST = {"compression.k=0.1"}  # the example; the rest through fedrun in the slow tier (seconds each)


@pytest.mark.parametrize(
    "overrides,line",
    [c for c in HYDRA_ERRORS if " ".join(c[0]) in FAST],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_a_hydra_error_through_fedrun_is_one_line_and_exit_2(fedrun, overrides, line):
    _one_line_through_fedrun(fedrun, overrides, line)


# The formatting of the others is tested in tests/config/test_config.py, without a process each.
SLOW = {"a=[", "hydra.job.chdir=maybe"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides,line",
    [c for c in HYDRA_ERRORS if " ".join(c[0]) in SLOW]
    + [
        (["-m", "hydra/launcher=bogus", "seed=0,1"], HYDRA_ERRORS[8][1]),  # a sweep's composition
        (["-m", "compression.k=0.1,0.2", "tracking.enabled=false"], HYDRA_ERRORS[0][1].replace("0.1 ", "'0.1,0.2' ")),
        (  # resolved in the job, before any work (fedrun.cli.entry.check_resolves)
            ["schedule.rounds=${nothing}"],
            "schedule.rounds='${nothing}' is invalid: allowed is an interpolation to a key the config has "
            "(Interpolation key 'nothing' not found)",
        ),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_every_kind_of_hydra_error_through_fedrun_is_one_line_and_exit_2(fedrun, overrides, line):
    _one_line_through_fedrun(fedrun, overrides, line)


@pytest.mark.slow
def test_fedruns_own_output_is_unchanged_around_the_one_line_errors(fedrun):
    shown = fedrun("--cfg", "job", "compression=topk")
    assert shown.returncode == 0 and "compression:\n  _target_: fedrun.compression.TopK" in shown.stdout
    swept = fedrun(
        "-m", "seed=0,1", "schedule.rounds=1", "model=logistic", "tracking.enabled=false", "hydra.sweep.dir=s"
    )
    assert swept.returncode == 0 and "#1 : seed=1" in swept.stdout + swept.stderr
