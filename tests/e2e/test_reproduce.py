"""The reproduction commands of docs/results/ never rot: every command runs end to end with tiny settings (one seed,
two rounds, the first value of each list); every override of every sweep composes in tests/config/test_reproduce.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
import reproduce  # noqa: E402

pytestmark = pytest.mark.e2e
SCRIPT = Path(__file__).parents[2] / "scripts" / "reproduce.py"


# Run end to end: the paper whose chain covers everything the script does beyond composing commands (000: a
# temperature sweep whose choice the next commands use, a sensitivity check's own report, a view of a subset of the
# runs, a rerun that resumes and runs nothing twice). Every other paper's commands are composed point by point
# (tests/config/test_reproduce.py), their presets run shrunk in tests/e2e/test_cli.py, and the script prints each
# command it would run (--dry-run, below): running them all again took 10 minutes of CI and would show no failure
# this does not (002, which ran too until 0c613c0, adds 130 s and nothing 000 lacks).
RUN = ("000",)
# One part of each kind the chain has, not all eleven (the rest are the same kind with other overrides, composed in
# tests/config/test_reproduce.py): the tuning sweep whose T the next parts use, a table part of each aggregator (the
# paired report; the TNIID view's filter selects them) and both parts of a sensitivity check (its own paired report).
# All eleven took 306 s of the slow tier. The script runs a view once every table part has run; here the view's
# report is run on the table parts that did.
PARTS = {"000": ("temperature", "fedavg_shards", "fedsoftmax_shards", "lr_fedavg", "lr_fedsoftmax")}
# What the chain checks does not depend on the data's size: 20 samples a client instead of the preset's 200 (the
# script's --set, in every run's config) made each run's two rounds a tenth as long.
SHRUNK = ("--set", "partition.samples_per_client=20")


def reproduce_tiny(tmp_path, *args):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--tiny", "--out", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )


def test_every_reproduction_command_is_printed_for_every_paper(tmp_path):
    done = reproduce_tiny(tmp_path, "all", "--dry-run")
    assert done.returncode == 0, done.stderr[-3000:]
    for paper, spec in reproduce.PAPERS.items():
        assert f"# {paper}: {spec.title}" in done.stdout
        for part in spec.parts:
            assert f"{paper}/{part.name}" in done.stdout, (paper, part.name)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("FEDRUN_DATA"), reason="the presets use MNIST and Fashion-MNIST")
@pytest.mark.parametrize("paper", RUN)
def test_a_reproduction_runs_tiny_and_resumes(tmp_path, paper):
    done = reproduce_tiny(tmp_path, paper, "--parts", *PARTS[paper], *SHRUNK)
    assert done.returncode == 0, done.stderr[-3000:]
    spec = reproduce.PAPERS[paper]
    assert (tmp_path / paper / "report" / "report.md").is_file()
    for view in spec.views:  # not run by the script (not every table part ran): run here on the ones that did
        assert not (tmp_path / paper / f"report_{view.name}").exists()
        shown = subprocess.run(reproduce.view_report(paper, tmp_path, view, ("--paired", spec.paired)), cwd=tmp_path)
        assert shown.returncode == 0
        assert (tmp_path / paper / f"report_{view.name}" / "accuracy.png").is_file()
    sides = {part.side for part in spec.parts if part.name in PARTS[paper]}
    assert {"", "tuning", "check"} <= sides  # every kind of part, each with its report
    assert (tmp_path / paper / "check_report" / "report.md").is_file()
    for part in spec.parts:
        ran = (tmp_path / paper / part.name / "0" / "metrics.csv").is_file()
        assert ran == (part.name in PARTS[paper]), (paper, part.name)
    if any(part.name == "temperature" for part in spec.parts):
        assert "temperature chosen by the sweep" in done.stdout
    rerun = list(PARTS[paper][:2])  # the tuning sweep and a table part: each kind of resume
    again = reproduce_tiny(tmp_path, paper, "--parts", *rerun, *SHRUNK)
    assert again.returncode == 0, again.stderr[-3000:]
    # one job each in tiny mode: interrupted or not, a rerun resumes and nothing runs twice
    assert again.stderr.count("had finished: skipped") == len(rerun)
