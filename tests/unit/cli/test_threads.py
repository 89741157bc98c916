"""fedrun.cli.job.settle_threads: a run's thread count is resolved once, when it starts, and a run that continues takes
the saved count whatever the machine, sweep or world size now (matrix products give other last bits at other thread
counts); a count read back from a run dir is checked."""

import json
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from fedrun.backends import Device, usable_cores
from fedrun.checkpoint import RUN_FILE, Checkpoint
from fedrun.cli.job import settle_threads
from fedrun.cli.resume import Job, opened_run
from fedrun.errors import ConfigError

SINGLE = SimpleNamespace(mode=None)  # Hydra's config of a single run (not RunMode.MULTIRUN)


def job(tmp_path, backend="loop", reopened=None) -> Job:
    cfg = OmegaConf.create({"device": {"backend": backend}})
    return Job(cfg, tmp_path, Checkpoint(tmp_path, 1), reopened=reopened)


@pytest.fixture(autouse=True)
def keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_new_run_resolves_its_cores_and_saves_the_counts(tmp_path):
    started, device = job(tmp_path), Device(kind="cpu", backend="loop")
    assert settle_threads(started, SINGLE, device) == usable_cores() == device.threads == torch.get_num_threads()
    assert started.checkpoint.extra == {"threads": usable_cores(), "cores": usable_cores()}


def test_a_distributed_run_defaults_to_one_thread_a_rank_whatever_the_ranks(tmp_path, monkeypatch):
    for ranks in ("1", "2", "3"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
        device = Device(kind="cpu", backend="loop")
        assert settle_threads(job(tmp_path, backend="distributed"), SINGLE, device) == 1
    device = Device(kind="cpu", backend="loop", threads=2)  # said in the config: kept
    assert settle_threads(job(tmp_path, backend="distributed"), SINGLE, device) == 2


def test_a_continued_run_takes_its_saved_counts_and_refuses_crafted_ones(tmp_path):
    (tmp_path / RUN_FILE).write_text(json.dumps({"threads": 3, "cores": 5, "mlflow_run_id": "x"}))
    restarted, device = job(tmp_path, reopened=opened_run(tmp_path)), Device(kind="cpu", backend="loop")
    assert settle_threads(restarted, SINGLE, device) == 3  # another machine's count, not this one's
    assert device.cores == 5 and restarted.checkpoint.extra == {"threads": 3, "cores": 5}
    for crafted in (10**9, 0, "2", None, 2.0, True):
        with pytest.raises(ConfigError) as refused:
            settle_threads(job(tmp_path, reopened={"threads": crafted, "cores": 2}), SINGLE, Device(kind="cpu"))
        line = str(refused.value)
        assert line.startswith(f"threads saved in {tmp_path}=") and line.endswith(
            " is invalid: allowed is an integer from 1 to 4096"
        )
