"""Every part's module and constructor runs without torch (``fedrun.lazy``): the ``fedrun`` command builds a config's
parts with torch deferred, so a refused value answers before torch's import (issue 53). This builds every option of
every group ``build_parts`` builds, and every preset, in a fresh interpreter that defers torch as the command does,
and checks torch was never imported. (``tests/e2e/test_cli_start.py`` runs a few refusals through the command.)"""

import importlib.util
import json
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


BROKEN_LAZY_LOADER = """
import importlib.util, sys, types

LazyModule = importlib.util._LazyModule


def reloading(self, attr):
    # CPython 3.12.3's order (gh-114763's thread-safe loading before gh-117178's mend): while the module loads, only
    # a dunder read passes; any other read, such as a module's code reading its own attribute, loads it again.
    spec = object.__getattribute__(self, "__spec__")
    state = spec.loader_state
    if object.__getattribute__(self, "__class__") is LazyModule:
        if state.get("is_loading") and attr.startswith("__") and attr.endswith("__"):
            return object.__getattribute__(self, attr)
        state["is_loading"] = True
        spec.loader.exec_module(self)
        self.__class__ = types.ModuleType
    return object.__getattribute__(self, attr)


LazyModule.__getattribute__ = reloading
"""

ON_A_BROKEN_LAZY_LOADER = """
import importlib.util, sys
exec(sys.argv[1])
spec = importlib.util.find_spec("numpy")  # torch's own failure, on a module that is not the one under test
spec.loader = importlib.util.LazyLoader(spec.loader)
module = importlib.util.module_from_spec(spec)
sys.modules["numpy"] = module
spec.loader.exec_module(module)
try:
    module.zeros
    print("numpy loaded lazily")
except RecursionError:
    print("numpy: RecursionError")
    for name in [name for name in sys.modules if name == "numpy" or name.startswith("numpy.")]:
        del sys.modules[name]

from fedrun import lazy
print("works", lazy.lazy_loading_works())
sys.argv = ["fedrun", "schedule.rounds=1", "tracking.enabled=false", "hydra.run.dir=" + sys.argv[2]]
from fedrun.cli import main
try:
    main()
except SystemExit as exc:
    print("exit", exc.code)
print("torch deferred", lazy.deferred("torch"))
"""


def test_an_interpreter_whose_lazy_loader_reloads_on_a_self_read_defers_nothing_and_runs(tmp_path):
    # CPython 3.12.3 (Ubuntu 24.04's Python; gh-117178): every `fedrun` run died in a RecursionError while torch,
    # deferred, imported itself. Here that loader is rebuilt on this interpreter: the probe sees it, nothing is deferred
    # and a whole run finishes through the command's entry point.
    done = subprocess.run(
        [sys.executable, "-c", ON_A_BROKEN_LAZY_LOADER, BROKEN_LAZY_LOADER, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "numpy: RecursionError"  # the rebuilt loader fails as 3.12.3's did
    assert lines[1] == "works False" and lines[-1] == "torch deferred False"
    assert "exit" not in done.stdout, done.stdout + done.stderr[-2000:]
    assert (tmp_path / "run" / "metrics.csv").read_text().count("\n") == 2  # header and the one round
    from fedrun import lazy

    assert lazy.lazy_loading_works()  # this interpreter's own loader (3.11.7 here) defers
