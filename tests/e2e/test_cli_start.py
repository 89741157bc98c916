"""``fedrun`` answers before it imports torch or MLflow: ``--help``, ``--cfg``, ``--info``, every composition error
and the root keys' checks (issue 53; ``scripts/bench_cli_start.py`` times them). Each case runs the real entry
point in a fresh interpreter and reads back which modules it imported."""

import subprocess
import sys

import pytest

from fedrun.cli.entry import did_you_mean

pytestmark = pytest.mark.e2e

PROBE = """
import sys
from fedrun.cli import main
sys.argv = ["fedrun", *sys.argv[1:]]
code = 0
try:
    main()
except SystemExit as exc:
    code = exc.code
# torch is registered to import on first use (fedrun.lazy): "imported" means its code ran
print("imported:", *(m for m in ("torch", "mlflow", "pandas", "numpy") if m in sys.modules and type(sys.modules[m]) is type(sys)), file=sys.stderr)
sys.exit(code)
"""


def answer(tmp_path, *args) -> tuple[int, list[str], set[str]]:
    """Exit status, stderr lines and the heavy modules imported by ``fedrun <args>`` run through its entry point."""
    done = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=tmp_path, capture_output=True, text=True)
    lines = done.stderr.strip().splitlines()
    heavy = set(lines[-1].split()[1:])
    return done.returncode, lines[:-1], heavy


@pytest.mark.parametrize(
    "args, said",
    [
        (["aggregator=fedsoftmx"], "; did you mean fedsoftmax or fedmax or fedsoftbetter?"),
        (["schedule.round=3"], "_target_, rounds, local_epochs"),  # the keys of schedule=default
        (["agregator=fedavg"], "; did you mean aggregator?"),
        (["agregator/x=fedavg"], "allowed is a config group: aggregator, attack"),
        (["+agregator/x=fedavg"], "; did you mean aggregator?"),  # a new key no part reads: once ran FedAvg silently
        (["+mykey=3"], "mykey=3 is invalid: allowed is a key of the config (engine, dataset,"),
        (
            ["device=trace"],
            "device='trace' is invalid: allowed is an option of device: auto, cpu, cuda; trace is an option of devices",
        ),
        (["metrics.r_targets=[2]"], "metrics.r_targets=[2] is invalid: allowed is a list of accuracies in (0, 1]"),
        (["optimizer.lr=nan"], "optimizer.lr=nan is invalid: allowed is a finite number"),
        (["seed=[1,2]"], "seed=[1, 2] is invalid"),  # a list where a number goes: composition
        (  # a key of the swept options only: Hydra checks it against the defaults first (FedAvg, the sync engine)
            ["-m", "aggregator=fedbuff,fedstaleweight", "engine.concurrency=10"],
            "in a sweep over aggregator, Hydra first checks every other override against the defaults, so a key that "
            "only the swept options have is set with ++ (++engine.concurrency=10)",
        ),
    ],
)
def test_an_error_answers_before_torch_or_mlflow(tmp_path, args, said):
    code, lines, heavy = answer(tmp_path, *args)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("fedrun: error: ") and said in lines[0], lines
    assert not heavy & {"torch", "mlflow"}, heavy
    assert not list(tmp_path.rglob("mlflow.db")) and not list(tmp_path.rglob("metrics.csv"))  # no run was opened


@pytest.mark.parametrize(
    "args, said",
    [
        (
            ["aggregator=fedsoftmax", "aggregator.temperature=-1"],
            "aggregator.temperature=-1 is invalid: allowed is a number > 0",
        ),
        (
            ["aggregator=fedsoftmax", "aggregator.temperature=abc"],
            "aggregator.temperature='abc' is invalid: allowed is a number",
        ),
        (["partition=dirichlet", "partition.alpha=0"], "partition.alpha=0 is invalid: allowed is a concentration > 0"),
        (["attack=sign_flip", "attack.fraction=2"], "attack.fraction=2 is invalid"),
        (["engine=async", "personalization=fedper"], "engine='async' is invalid: allowed is sync with a client state"),
    ],
)
def test_a_parts_refusal_answers_before_torch_or_mlflow(tmp_path, args, said):
    """A value a part's constructor refuses, or a combination of parts ``fedrun.compat`` refuses: every part is
    built before torch is imported (``fedrun.lazy``), 1.2-1.3 s here idle against 2.7 s when it needed torch
    (``scripts/bench_cli_start.py``)."""
    code, lines, heavy = answer(tmp_path, *args)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("fedrun: error: ") and said in lines[0], lines
    assert not heavy & {"torch", "mlflow", "pandas"}, heavy
    assert not list(tmp_path.rglob("mlflow.db")) and not list(tmp_path.rglob("metrics.csv"))


def test_the_solvers_refusal_is_torchs_own_and_imports_torch_alone(tmp_path):
    """The local solver is torch's class (``torch.optim.SGD``, or fedrun's subclasses of torch's): its arguments are
    checked by building it, which needs torch (1.3-1.9 s here), but neither MLflow nor pandas."""
    code, lines, heavy = answer(tmp_path, "optimizer.lr=-1")
    assert code == 2 and lines == [
        "fedrun: error: optimizer.lr=-1 is invalid: allowed is a value torch.optim.SGD accepts (Invalid learning rate: -1)"
    ]
    assert "torch" in heavy and not heavy & {"mlflow", "pandas"}, heavy


@pytest.mark.parametrize("args", [["--help"], ["--cfg", "job"], ["--info"]])
def test_help_cfg_and_info_import_neither(tmp_path, args):
    done = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip()
    heavy = set(done.stderr.strip().splitlines()[-1].split()[1:])
    assert not heavy & {"torch", "mlflow", "pandas"}, heavy


def test_did_you_mean():
    assert did_you_mean("fedsoftmx", ["fedavg", "fedsoftmax", "median"]) == "; did you mean fedsoftmax?"
    assert did_you_mean("round", ["rounds", "batch_size", "tail"]) == "; did you mean rounds?"
    assert did_you_mean("zzz", ["rounds", "tail"]) == ""  # nothing near: nothing guessed
    assert did_you_mean("tail", ["tail", "rounds"]) == ""  # the word itself is not a suggestion
    # at most three, closest first (difflib's ratio: 2 * matches / total length)
    options = ["afl", "fedavg", "fedmax", "fedsoftbetter", "fedsoftmax", "median"]
    assert did_you_mean("fedsoftmx", options) == "; did you mean fedsoftmax or fedmax or fedsoftbetter?"


@pytest.mark.parametrize("module", ["fedrun.report", "fedrun.ui"])
def test_the_report_and_the_ui_import_no_torch(module):
    """``fedrun-report`` reads runs and ``fedrun-ui`` starts MLflow's server: neither trains, so neither pays torch's
    import (1.8 s on CI's machine; the report is run a dozen times by the slow tier and the docs)."""
    probe = f"import sys, {module}; print(*(m for m in ('torch', 'torchvision') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "", (done.stdout, done.stderr[-2000:])
