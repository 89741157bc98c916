"""fedrun.cli.job.settle_threads: a run's thread count is resolved once, when it starts, and a run that continues takes
the saved count whatever the machine, sweep or world size now (matrix products give other last bits at other thread
counts); a count read back from a run dir is checked. The CPUs a run ran on are recorded beside it (other kernels sum
in another order): a run that continues on another says so."""

import json
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from fedrun.backends import Device, cpu_kernels, cpu_label, other_kernels, usable_cores
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
    assert started.checkpoint.extra == {"threads": usable_cores(), "cores": usable_cores(), "cpus": [cpu_kernels()]}


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
    assert device.cores == 5 and restarted.checkpoint.extra == {"threads": 3, "cores": 5, "cpus": [cpu_kernels()]}
    for crafted in (10**9, 0, "2", None, 2.0, True):
        with pytest.raises(ConfigError) as refused:
            settle_threads(job(tmp_path, reopened={"threads": crafted, "cores": 2}), SINGLE, Device(kind="cpu"))
        line = str(refused.value)
        assert line.startswith(f"threads saved in {tmp_path}=") and line.endswith(
            " is invalid: allowed is an integer from 1 to 4096"
        )


XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) 6975P-C
flags\t\t: fpu sse4_2 avx avx2 fma f16c hypervisor avx512f avx512_vnni amx_bf16 amx_tile avx10_1

processor\t: 1
model name\t: Intel(R) Xeon(R) 6975P-C
flags\t\t: fpu
"""


def test_cpu_kernels_reads_the_model_and_the_kernel_flags_of_the_first_processor():
    kernels = cpu_kernels(XEON)
    assert kernels == {
        "model": "Intel(R) Xeon(R) 6975P-C",
        "capability": torch.backends.cpu.get_cpu_capability(),
        "flags": "amx_bf16 amx_tile avx avx10_1 avx2 avx512_vnni avx512f f16c fma",  # not fpu, sse4_2, hypervisor
    }
    assert cpu_label(kernels) == f"Intel(R) Xeon(R) 6975P-C ({kernels['capability']}, AMX)"
    assert cpu_kernels("")["flags"] == "" and cpu_kernels("")["model"]  # elsewhere: platform's name, no flags
    epyc = {**kernels, "model": "AMD EPYC", "flags": "avx avx2 avx512f f16c fma"}
    assert other_kernels(kernels, dict(kernels)) == ""
    assert other_kernels(kernels, epyc) == (
        f"Intel(R) Xeon(R) 6975P-C ({kernels['capability']}, AMX), now on AMD EPYC ({kernels['capability']}) (flags "
        "only there: amx_bf16 amx_tile avx10_1 avx512_vnni; only here: none)"
    )


def test_a_run_continued_on_another_cpu_says_so_in_one_line_and_records_it(tmp_path, capsys):
    here, other = cpu_kernels(), {"model": "Elsewhere CPU", "capability": "DEFAULT", "flags": "avx"}
    (tmp_path / RUN_FILE).write_text(json.dumps({"threads": 1, "cores": 1, "cpus": [other]}))
    moved = job(tmp_path, reopened=opened_run(tmp_path))
    settle_threads(moved, SINGLE, Device(kind="cpu", backend="loop"))
    assert moved.checkpoint.extra["cpus"] == [other, here]
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"fedrun: warning: {tmp_path} started on Elsewhere CPU (DEFAULT), now on ")
    assert line.endswith(
        "may differ in their last bits from a run that never stopped (other CPU kernels sum in another order)"
    )
    (tmp_path / RUN_FILE).write_text(json.dumps({"threads": 1, "cores": 1, "cpus": [here]}))
    same = job(tmp_path, reopened=opened_run(tmp_path))
    settle_threads(same, SINGLE, Device(kind="cpu", backend="loop"))
    assert same.checkpoint.extra["cpus"] == [here] and capsys.readouterr().err == ""
    where = f"cpus saved in {tmp_path}"
    for crafted, said in (
        ({"model": "x"}, f"{where}={{'model': 'x'}}"),
        ([{"model": 1}], f"a CPU in {where}={{'model': 1}}"),
        ([here] * 65, f"{where}='65 CPUs'"),
    ):
        with pytest.raises(ConfigError) as refused:
            reopened = {"threads": 1, "cores": 1, "cpus": crafted}
            settle_threads(job(tmp_path, reopened=reopened), SINGLE, Device(kind="cpu"))
        assert (
            str(refused.value)
            == f"{said} is invalid: allowed is a list of at most 64 CPUs, each a mapping of names to strings"
        )
