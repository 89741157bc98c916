import copy
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import DictConfig, OmegaConf

from fedrun.datasets import FederatedData

FEDRUN = str(Path(sys.executable).parent / "fedrun")  # the installed console script, as a user runs it
CONF = Path(__file__).parents[1] / "conf"


# The slow tier's longest tests, started first so that the workers end together (each took 1-5 minutes of a
# worker at ba6dc8b, where CI's slow tier ended on one of them while the other worker sat idle).
LONGEST_FIRST = (
    "tests/e2e/test_reproduce.py::test_a_reproduction_runs_tiny_and_resumes",
    "tests/e2e/test_clusters.py::test_a_job_at_its_time_limit",
    "tests/e2e/test_docs_commands.py::test_every_metric",
    "tests/e2e/test_docs_commands.py::test_the_pages_commands_run_as_written[tutorial",
    "tests/e2e/test_study.py::test_a_study_killed_mid_trial",
    "tests/e2e/test_distributed.py::test_a_lost_rank",
    "tests/e2e/test_client_methods.py",  # two groups (one sweep a backend), about a minute each
    "tests/e2e/test_distributed.py::test_two_or_four_ranks",  # one group, its loop runs one sweep: 4-5 minutes
    "tests/e2e/test_reliability.py::test_a_run_killed_with_sigkill",  # one group and two alone: 4-5 minutes
    "tests/e2e/test_clusters.py",
    "tests/e2e/test_docs_commands.py",
)


def pytest_collection_modifyitems(config, items):
    """Run ``LONGEST_FIRST`` first, in its order (a stable sort: the rest keep theirs)."""

    def rank(item) -> int:
        return next((i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)), len(LONGEST_FIRST))

    items.sort(key=rank)


def pytest_configure(config):
    """Under pytest-xdist (``-n``), each worker process and every ``fedrun`` it starts keep to their own share of the
    cores: torch processes that each use every core slow each other far more than twice (the README's machine
    note), so worker k of n is pinned to cores k, k + n, ... (one of them when there are more workers than cores)
    and runs torch on that many threads. A run's default thread count is its usable cores, so the runs the tests
    start resolve one thread per core of their worker."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not count or not hasattr(os, "sched_setaffinity"):
        return
    cores, index, count = sorted(os.sched_getaffinity(0)), int(worker.removeprefix("gw")), int(count)
    mine = set(cores[index::count]) or {cores[index % len(cores)]}
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))


# A tiny federation for engine-level tests: 6 clients of 10 samples, 4 features, 3 classes, float64, seed 0.
_G = torch.Generator().manual_seed(0)
TINY_DATA = FederatedData(
    torch.randn(60, 4, generator=_G, dtype=torch.float64),
    torch.randint(0, 3, (60,), generator=_G),
    torch.randn(12, 4, generator=_G, dtype=torch.float64),
    torch.randint(0, 3, (12,), generator=_G),
    num_classes=3,
)
TINY_CLIENTS = [np.arange(10 * i, 10 * i + 10) for i in range(6)]


def composed(*overrides: str) -> DictConfig:
    """The real composed config of ``overrides``, as the CLI would see it: a copy of the one composition of these
    overrides in this process. Hydra reads and merges some 25 YAML files a composition (0.2-0.25 s here) and the fast
    tier asks for the same overrides again and again (every aggregator, by the personal, batch-norm and preset
    tests); a copy takes 5 ms, and a test may change its own."""
    if overrides not in _COMPOSED:
        with initialize_config_module(config_module="fedrun.conf", version_base="1.3"):
            _COMPOSED[overrides] = compose(config_name="config", overrides=list(overrides))
    return copy.deepcopy(_COMPOSED[overrides])


_COMPOSED: dict[tuple[str, ...], DictConfig] = {}


@pytest.fixture
def compose_config():
    """compose(overrides) -> the real composed config (``composed``)."""
    return composed


@pytest.fixture(scope="session")
def store(tmp_path_factory):
    """One SQLite store for every end-to-end test (a new store costs ~10 s of migrations)."""
    return tmp_path_factory.mktemp("mlflow") / "mlflow.db"


@pytest.fixture
def fedrun(tmp_path, store):
    """Run the real ``fedrun`` command in a fresh working directory with the shared store."""

    def _run(*args, experiment="e2e", check=True):
        cmd = [FEDRUN, *args, f"tracking.uri=sqlite:///{store}", f"tracking.experiment={experiment}", "device=cpu"]
        done = subprocess.run(
            cmd, cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "HYDRA_FULL_ERROR": "0"}
        )
        if check and done.returncode != 0:
            raise AssertionError(f"fedrun failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return done

    _run.cwd = tmp_path
    return _run


def mlflow_runs(store, experiment, uri=None):
    """(client, the experiment's job runs): a sweep's parent run (``sweep_runs``) and a study's trial runs are left
    out."""
    client, runs = all_runs(store, experiment, uri)
    return client, [r for r in runs if "fedrun.role" not in r.data.tags]


def sweep_runs(store, experiment, uri=None):
    """(client, the experiment's sweep parent runs)."""
    client, runs = all_runs(store, experiment, uri)
    return client, [r for r in runs if r.data.tags.get("fedrun.role") == "sweep"]


def all_runs(store, experiment, uri=None):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri or f"sqlite:///{store}")
    exp = client.get_experiment_by_name(experiment)
    return client, (client.search_runs([exp.experiment_id]) if exp else [])


def split_case(overrides: list[str]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """A run's overrides as (group, option) pairs and (key, value) pairs."""
    groups, keys = [], []
    for override in overrides:
        key, value = override.split("=", 1)
        (groups if (CONF / key).is_dir() else keys).append((key, value))
    return groups, keys


def as_case(overrides: list[str]) -> str:
    """A run's overrides as a config of a group of the test's own (``+case=<name>`` with ``hydra.searchpath`` on its
    folder), as the presets are written: a group's option as a defaults override, every other key set in the global
    package. Several cases then run as one sweep, in one process, their start-up paid once."""
    groups, keys = split_case(overrides)
    body = OmegaConf.to_yaml(OmegaConf.from_dotlist([f"{k}={v}" for k, v in keys])) if keys else ""
    defaults = "".join(f"  - override /{k}: {v}\n" for k, v in groups)
    return f"# @package _global_\ndefaults:\n{defaults}" + body


def config_can_say(overrides: list[str]) -> bool:
    """Whether a config of a group (``as_case``) can hold these overrides: not one that sets a list's entry by its
    index (``pipeline.stages.0.max_norm``), which a command line can say and a merged config cannot."""
    return not any(part.isdigit() for o in overrides for part in o.split("=", 1)[0].split("."))


def run_cases(root: Path, cases: dict[str, list[str]], *common: str) -> dict[str, Path]:
    """Every case (a name and its overrides) as one sweep of the real ``fedrun -m``: one process, the jobs one after
    another with the basic launcher, each seeded alone as a run is, the start-up (torch, MLflow, Hydra: about 7 s a
    process on CI's machine) paid once. Returns case -> its job's run dir. A case's overrides must be expressible in a
    config (``as_case``): not a list's entry by its index."""
    folder = root / "cases" / "case"
    folder.mkdir(parents=True, exist_ok=True)
    for name, overrides in cases.items():
        assert config_can_say(overrides), (name, overrides)
        (folder / f"{name}.yaml").write_text(as_case([o.removeprefix("+") for o in overrides]))
    out = root / "swept"
    done = subprocess.run(
        [FEDRUN, "-m", f"+case={','.join(cases)}", f"hydra.searchpath=[file://{folder.parent}]", *common]
        + [f"hydra.sweep.dir={out}"],
        cwd=root,
        capture_output=True,
        text=True,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    jobs = {}
    for job in (d for d in out.iterdir() if (d / ".hydra" / "overrides.yaml").exists()):
        (name,) = [
            o.split("=", 1)[1] for o in OmegaConf.load(job / ".hydra" / "overrides.yaml") if o.startswith("+case=")
        ]
        jobs[name] = job
    assert sorted(jobs) == sorted(cases), sorted(jobs)
    return jobs


def swept_once(tmp_path_factory, name: str, cases: dict[str, list[str]], *common: str):
    """A module fixture's getter, case -> run dir: ``run_cases`` on first call (a test that needs none of the cases,
    on a worker of its own, starts no sweep)."""
    done = {}

    def get(case: str) -> Path:
        if not done:
            done.update(run_cases(tmp_path_factory.mktemp(name), cases, *common))
        return done[case]

    return get
