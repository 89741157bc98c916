"""The reproduction commands of docs/results/ never rot: every override of every sweep composes, and every
command runs end to end with tiny settings (one seed, two rounds, the first value of each list)."""

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
import reproduce  # noqa: E402

pytestmark = pytest.mark.e2e
SCRIPT = Path(__file__).parents[2] / "scripts" / "reproduce.py"


@pytest.mark.parametrize("paper", list(reproduce.PAPERS))
def test_every_point_of_every_reproduction_sweep_composes(paper, compose_config):
    points = 0
    for part in reproduce.PAPERS[paper].parts:
        args = [a.format(seeds="0,1,2,3,4", temperature="1.0") for a in part.args]
        seeds = {int(v) for a in args if a.startswith("seed=") for v in a.partition("=")[2].split(",")}
        assert seeds, part.name
        assert seeds <= set(
            range(100, 102) if part.tuning and paper.startswith("000") else range(5)
        )  # 000 tunes T on seeds of its own

        # The seed changes no key but itself: each point is composed with the part's first seed (5x fewer compositions).
        def values(key, value):
            if value.startswith("["):  # a list value is one value
                return [value]
            return [str(min(seeds))] if key == "seed" else value.split(",")

        axes = [[f"{key}={v}" for v in values(key, value)] for key, _, value in (a.partition("=") for a in args)]
        for point in itertools.product(*axes):
            cfg = compose_config(*point)
            assert cfg.seed == min(seeds)
            points += len(seeds)  # the sweep points this composition stands for
    assert points >= 5


# Run end to end: the papers whose chain covers what the script does beyond composing commands (000: a temperature
# sweep whose choice the next commands use, a view of a subset of the runs; 002: a paper whose rerun resumes). Every
# other paper's commands are composed point by point above, their presets run shrunk in test_e2e, and the script
# prints each command it would run (--dry-run, below): running them all again took 10 minutes of CI and would show no
# failure these do not.
RUN = ("000", "002")


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
    done = reproduce_tiny(tmp_path, paper)
    assert done.returncode == 0, done.stderr[-3000:]
    spec = reproduce.PAPERS[paper]
    assert (tmp_path / paper / "report" / "report.md").is_file()
    for name, _ in spec.views:
        assert (tmp_path / paper / f"report_{name}" / "accuracy.png").is_file()
    for part in spec.parts:
        assert (tmp_path / paper / part.name / "0" / "metrics.csv").is_file(), (paper, part.name)
    if any(part.name == "temperature" for part in spec.parts):
        assert "temperature chosen by the sweep" in done.stdout
    again = reproduce_tiny(tmp_path, paper)
    assert again.returncode == 0, again.stderr[-3000:]
    # one job each in tiny mode: interrupted or not, a rerun resumes and nothing runs twice
    assert again.stderr.count("had finished: skipped") == len(spec.parts)


def test_parts_select_a_paper_s_sweeps_with_the_temperature_sweep_they_need():
    spec = reproduce.PAPERS["000"]
    assert [p.name for p in reproduce.selected(spec, ["fedavg_iid"])] == ["fedavg_iid"]  # FedAvg needs no T
    assert [p.name for p in reproduce.selected(spec, ["fedsoftmax_pool", "fedavg_iid"])] == [
        "temperature",
        "fedavg_iid",
        "fedsoftmax_pool",
    ]
    assert reproduce.selected(spec, None) == list(spec.parts)
    with pytest.raises(
        SystemExit, match="--parts 'nope' is not a part of this paper \\(its parts: temperature, fedavg_shards"
    ):
        reproduce.selected(spec, ["nope"])


def test_the_table_is_paired_once_its_baseline_part_has_run(tmp_path, capsys):
    assert [p.name for p in reproduce.PAPERS["002"].parts if reproduce.has_baseline(p, "method=fedavg")] == [
        "baselines"
    ]  # in a list
    assert [p.name for p in reproduce.PAPERS["001"].parts if reproduce.has_baseline(p, "aggregator=fedavg")] == [
        "fedavg"
    ]  # not the check's
    reproduce.reproduce("004", tmp_path, 1, tiny=True, dry_run=True, parts=["table"])
    assert "--paired aggregator=fedbuff" in capsys.readouterr().out
    reproduce.reproduce(
        "001", tmp_path, 1, tiny=True, dry_run=True, parts=["fedsoftbetter"]
    )  # FedAvg has not run: no pairs yet
    printed = capsys.readouterr().out
    assert "fedrun-report" in printed and "--paired" not in printed
    (tmp_path / "001" / "fedavg").mkdir(parents=True)
    (tmp_path / "001" / "fedavg" / "multirun.yaml").write_text("{}\n")  # FedAvg's sweep ran in an earlier call
    reproduce.reproduce("001", tmp_path, 1, tiny=True, dry_run=True, parts=["fedsoftbetter"])
    assert "--paired aggregator=fedavg" in capsys.readouterr().out
    reproduce.reproduce(
        "000", tmp_path, 1, tiny=True, dry_run=True, parts=["fedavg_iid"]
    )  # the TNIID view waits for its runs
    assert "report_tniid" not in capsys.readouterr().out
    reproduce.reproduce("000", tmp_path, 1, tiny=True, dry_run=True)
    assert "report_tniid" in capsys.readouterr().out


def test_the_temperature_is_chosen_on_the_paper_s_measure(tmp_path):
    # 000a picks T on the clients' accuracy (their measure): T = 0.1 reaches it first there, T = 0.2 on the test set.
    report = tmp_path / "report.csv"
    pd.DataFrame(
        {
            "aggregator.temperature": [0.2, 0.1, 0.05],
            "R90_median": [20, 25, 30],
            "client_R90_median": [14, 12, 12],
            "final_test_accuracy_mean": [0.8, 0.7, 0.75],
        }
    ).to_csv(report, index=False)
    assert reproduce.best_temperature(report) == "0.2"
    assert reproduce.best_temperature(report, "client_R90") == "0.05"  # tied at 12: the higher final accuracy
    assert reproduce.PAPERS["000a"].select_by == "client_R90" and reproduce.PAPERS["000"].select_by == "R90"
