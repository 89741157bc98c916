"""Every part's module and constructor runs without torch (``fedrun.lazy``): the ``fedrun`` command builds a config's
parts with torch deferred, so a refused value answers before torch's import (issue 53). This builds every option of
every group ``build_parts`` builds, and every preset, in a fresh interpreter that defers torch as the command does,
and checks torch was never imported. (``tests/e2e/test_cli_start.py`` runs a few refusals through the command.)"""

import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONF = Path(__file__).parents[2] / "conf"
GROUPS = (
    "privacy engine dataset partition aggregator server schedule heterogeneity devices device pipeline compression "
    "sampler attack personalization client method defence experiment"
).split()

SCRIPT = """
import json, sys
from fedrun import lazy
lazy.defer("torch")
from hydra import compose, initialize_config_module
from fedrun.cli.build import build_parts
from fedrun.cli.entry import check_run_keys
from fedrun.errors import ConfigError

built, refused, loaded_by = 0, [], None
with initialize_config_module(config_module="fedrun.conf", version_base="1.3"):
    for override in json.loads(sys.argv[1]):
        cfg = compose(config_name="config", overrides=[override])
        try:
            check_run_keys(cfg)  # as the command does first (a mandatory value left unset)
            build_parts(cfg)
            built += 1
        except ConfigError as exc:  # a refusal is an answer too: what matters is that it came without torch
            refused.append(f"{override}: {exc}")
        if loaded_by is None and not lazy.deferred("torch"):
            loaded_by = override
print(json.dumps({"built": built, "refused": refused, "torch_loaded_by": loaded_by}))
"""


@pytest.mark.slow  # some 120 compositions (0.2 s each): the fast tier runs five refusals through the command
def test_every_option_of_every_group_is_built_without_importing_torch():
    options = [f"{group}={p.stem}" for group in GROUPS for p in sorted((CONF / group).glob("*.yaml"))]
    assert len(options) > 100
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(options)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["torch_loaded_by"] is None, result
    # nearly every option builds alone with the defaults; the few refused are combinations the defaults cannot take
    assert result["built"] >= 0.8 * len(options), result["refused"]


DEVICE = """
import sys
from fedrun import lazy
lazy.defer("torch")
from fedrun.backends import Device
from fedrun.errors import ConfigError

device = Device(kind="cuda")  # the values alone while torch is deferred: the machine is asked next
print("built", lazy.deferred("torch"))
try:
    device.check_machine()
except ConfigError as exc:
    print("refused", exc)
"""


def test_a_device_asks_the_machine_once_torch_is_imported_and_at_once_outside_the_command():
    if importlib.util.find_spec("torch") is None or __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    done = subprocess.run([sys.executable, "-c", DEVICE], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "built True",
        "refused kind='cuda' is invalid: allowed is cpu or auto: this machine has no CUDA device",
    ]
    from fedrun.backends import Device
    from fedrun.errors import ConfigError

    with pytest.raises(ConfigError, match="no CUDA"):  # a script's Device (nothing deferred) refuses when built
        Device(kind="cuda")


SELF_EDITING = """
import sys
loads = getattr(sys, "loads", 0) + 1
sys.loads = loads
TensorBase = object
delattr(sys.modules[__name__], "TensorBase")  # as torch/__init__.py does while it runs
value = sys.modules[__name__].loads  # a read of its own attribute while it runs
"""

DEFER_ON = """
import importlib.util, sys
from fedrun import lazy

module = lazy.defer("self_editing")
assert lazy.deferred("self_editing") and getattr(sys, "loads", 0) == 0  # registered, its code not run
print(module.value, hasattr(module, "TensorBase"), sys.loads, lazy.deferred("self_editing"))
del sys.modules["self_editing"]
spec = importlib.util.find_spec("self_editing")  # the standard library's LazyLoader on the same module
spec.loader = importlib.util.LazyLoader(spec.loader)
stdlib = importlib.util.module_from_spec(spec)
sys.modules["self_editing"] = stdlib
spec.loader.exec_module(stdlib)
try:
    stdlib.value
    print("stdlib loaded")
except RecursionError:
    print("stdlib RecursionError")
"""


def interpreters() -> dict[str, str]:
    """Python 3.10 and newer on this machine (on PATH and pyenv's), by version: fedrun.lazy needs nothing else."""
    found = {}
    names = [f"python3.{minor}" for minor in range(10, 15)]
    candidates = [shutil.which(name) for name in names] + sorted(
        glob.glob(str(Path.home() / ".pyenv/versions/3.1*/bin/python3"))
    )
    for path in [sys.executable, *filter(None, candidates)]:
        done = subprocess.run([path, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True, text=True)
        if done.returncode == 0 and tuple(map(int, done.stdout.split(".")[:2])) >= (3, 10):
            found.setdefault(done.stdout.strip(), path)
    return found


def test_the_deferral_loads_a_module_that_edits_itself_while_it_runs_on_every_python_here(tmp_path):
    # torch/__init__.py deletes one of its own attributes while it runs; the standard library's LazyLoader recurses on
    # that from CPython 3.11.9, 3.12.3 and 3.13 (every `fedrun` run died so on the H200 machine's Python 3.12.3).
    # fedrun.lazy imports nothing but the standard library, so each interpreter here runs it on such a module.
    (tmp_path / "self_editing.py").write_text(SELF_EDITING)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{Path(__file__).parents[2]}"}
    found = interpreters()
    stdlib = {}
    for version, path in found.items():
        done = subprocess.run([path, "-c", DEFER_ON], capture_output=True, text=True, env=env, cwd=tmp_path)
        assert done.returncode == 0, (version, done.stderr[-2000:])
        ours, theirs = done.stdout.splitlines()
        assert ours == "1 False 1 False", (version, ours)  # run once, on the first read, into the same module
        stdlib[version] = theirs
    print(stdlib)  # here 3.10.13, 3.11.7 and 3.12.1 loaded; 3.13.0 raised RecursionError
    if any(tuple(map(int, v.split("."))) >= (3, 13) for v in found):
        assert "stdlib RecursionError" in stdlib.values()  # the failure this module is written against, seen here
