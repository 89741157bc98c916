"""The commands of the tutorial and every how-to guide run as written, in a fresh directory per page, with the real
``fedrun`` (docs/_ext/doc_commands.py), and every metric a run logs is on the metrics page."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import FEDRUN, as_case, split_case
from omegaconf import OmegaConf

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

import doc_commands  # noqa: E402  (docs/_ext, not a package)

PAGES = [DOCS / "tutorial.md", *sorted(p for p in (DOCS / "how-to").glob("*.md") if p.name != "index.md")]


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_the_pages_commands_run_as_written(page, tmp_path):
    bin_dir = str(Path(sys.executable).parent)  # the installed fedrun, as the reader's shell finds it
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HYDRA_FULL_ERROR": "0"}
    times = Path(os.environ["FEDRUN_DOC_TIMES"]) if os.environ.get("FEDRUN_DOC_TIMES") else None  # doc_times.py
    found = doc_commands.run_page(page, tmp_path, timeout=600, env=env, times=times)
    assert all(b.kind != "skip" or b.reason for b in found)
    if page.name in CHECKS:
        CHECKS[page.name](tmp_path, [b for b in found if b.kind == "run"])


def check_privacy(workdir: Path, ran: list) -> None:
    """The page's private MNIST run learns at the epsilon it was calibrated to, and its runs on the digits with 2
    clients a round are warned once each, before round 1, and run all the same (README's private run, 20 rounds)."""
    metrics = pd.read_csv(workdir / "outputs" / "dp_mnist" / "metrics.csv")
    assert metrics["test_accuracy"].dropna().iloc[-1] > 0.5  # chance is 0.1
    assert metrics["epsilon"].iloc[-1] == pytest.approx(8.0, rel=0.01)
    dp_mnist = next(b for b in ran if "experiment=dp_mnist" in b.text)
    assert "noise swamps" not in dp_mnist.stderr
    central = next(b for b in ran if "hydra.run.dir=outputs/central" in b.text)
    warnings = [ln for ln in central.stderr.splitlines() if ln.startswith("fedrun: warning: the privacy noise")]
    assert len(warnings) == 1 and "58.5 times the clip norm" in warnings[0], central.stderr[-2000:]
    assert (workdir / "outputs" / "central" / "metrics.csv").is_file()


CHECKS = {"privacy.md": check_privacy}  # what a page's runs must show besides running (their outputs are the reader's)


# Runs that between them log every kind of metric: the loss-weighted family with client tests and a validation
# split, central privacy, a robust rule under attack, compression with selection and clipping, the asynchronous
# engine, FLTrust, centered clipping and a hybrid.
RUNS = [
    "aggregator=fedsoftmax dataset.client_test_fraction=0.2 dataset.val_fraction=0.1 aggregator.trim=1 "
    "personalization=fedper dataset.client_val_fraction=0.2",
    "privacy=central schedule.sampling=poisson schedule.clients_per_round=0.5",
    "aggregator=krum attack=sign_flip attack.fraction=0.2 aggregator.f=2",
    "compression=topk sampler=power_of_choice pipeline=clip schedule.clients_per_round=0.5",
    "aggregator=fedstaleweight",
    "aggregator=fltrust attack=loss_lie",
    "aggregator=centered_clip",
    "sampler=importance",
    "aggregator=hybrid aggregator.phases.0.until_round=2",
    "aggregator=geomed",
    "aggregator=norm_bound",
]


@pytest.mark.slow
def test_every_metric_a_run_logs_is_on_the_metrics_page(tmp_path):
    page = (DOCS / "reference" / "metrics.md").read_text()
    documented = set(re.findall(r"`([^`]+)`", re.sub(r"``.*?``", "", page)))  # single-backtick spans
    # One sweep, each run one option of a group written here (one process: the runs' start-up paid once), and the
    # hybrid alone on the command line (a list's entry is set by its index there, which a config cannot say).
    cases = tmp_path / "cases" / "case"
    cases.mkdir(parents=True)
    swept = [r for r in RUNS if "phases.0" not in r]
    for i, overrides in enumerate(swept):
        (cases / f"run{i}.yaml").write_text(as_case(overrides.split()))
    common = ["schedule.rounds=3", "tracking.enabled=false", "partition.num_clients=10", "device=cpu"]
    runs = [
        [
            FEDRUN,
            "-m",
            "+case=" + ",".join(f"run{i}" for i in range(len(swept))),
            f"hydra.searchpath=[file://{cases.parent}]",
        ]
        + [*common, f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        *([FEDRUN, *r.split(), *common, f"hydra.run.dir={tmp_path / 'alone'}"] for r in RUNS if r not in swept),
    ]
    for command in runs:
        done = subprocess.run(command + ["device.threads=1"], capture_output=True, text=True, cwd=tmp_path)
        assert done.returncode == 0, (command, done.stderr[-2000:])
    run_dirs = [tmp_path / "sweep" / str(i) for i in range(len(swept))] + [tmp_path / "alone"]
    for run_dir, overrides in zip(run_dirs, swept):  # each run took its case's options and keys, not the defaults
        chosen = OmegaConf.load(run_dir / ".hydra" / "hydra.yaml").hydra.runtime.choices
        saved = OmegaConf.load(run_dir / "config.yaml")
        groups, keys = split_case(overrides.split())
        for group, option in groups:
            assert chosen[group] == option, (overrides, group, chosen[group])
        for key, value in keys:
            assert OmegaConf.select(saved, key) == OmegaConf.from_dotlist([f"v={value}"]).v, (overrides, key)
    names = set()
    for run_dir in run_dirs:
        names |= set(pd.read_csv(run_dir / "metrics.csv").columns)
        names |= set(pd.read_csv(run_dir / "summary.csv").iloc[:, 0])
    generic = {
        re.compile(r"alpha/client_\d+"): "alpha/client_<id>",
        re.compile(r"(accuracy|weight_share)/(?!all$)\w+"): r"\1/<group>",
        re.compile(r"(topk|qsgd|sign)/(\w+)"): r"<compressor>/\2",
        re.compile(r"hybrid_phase_\d+_from_round"): "hybrid_phase_<n>_from_round",
    }
    missing = []
    for name in sorted(names):
        shown = name
        for pattern, template in generic.items():
            if pattern.fullmatch(name):
                shown = pattern.sub(template, name)
        if shown not in documented and name not in documented:
            missing.append(name)
    assert not missing, f"logged but not on docs/reference/metrics.md: {missing}"
