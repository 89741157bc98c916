"""The extras resolve without downgrading anything: ``[dev]`` (the tests, the linters, the site) does not pull the Ray
launcher, whose ``cloudpickle<3`` pin made pip install older cloudpickle and joblib, and nothing in the closure of
``[dev]`` caps either package; the environment the tests run in is consistent (``pip check``); the wheel ``pip install .`` builds ships every
config group."""

import re
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import PackageNotFoundError, requires
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def closure(name: str, extras: frozenset[str] = frozenset()) -> dict[str, list[Requirement]]:
    """Each installed distribution that ``name[extras]`` requires, at any depth, with the requirements naming it."""
    found: dict[str, list[Requirement]] = {}
    todo = [(name, extras)]
    seen = set()
    while todo:
        dist, wanted = todo.pop()
        if (dist, wanted) in seen:
            continue
        seen.add((dist, wanted))
        try:
            lines = requires(dist) or []
        except PackageNotFoundError:
            continue  # a requirement of another platform or Python, not installed here
        for line in lines:
            req = Requirement(line)
            env = [{"extra": extra} for extra in wanted] or [{"extra": ""}]
            if req.marker is not None and not any(req.marker.evaluate(e) for e in env):
                continue
            key = canonicalize_name(req.name)
            found.setdefault(key, []).append(req)
            todo.append((key, frozenset(req.extras)))
    return found


def test_dev_does_not_pull_the_ray_launcher_nor_cap_cloudpickle_or_joblib():
    dev = closure("fedrun", frozenset({"dev"}))
    assert {"pytest", "sphinx", "hydra-joblib-launcher", "hydra-submitit-launcher"} <= set(dev)
    assert not {"ray", "hydra-ray-launcher"} & set(dev)
    # the releases the Ray launcher's pin kept out (cloudpickle 3, and joblib 1.6, which needs it): none excluded now
    for package, release in (("cloudpickle", "3.1.1"), ("joblib", "1.6.0")):
        caps = [str(r) for r in dev.get(package, []) if not r.specifier.contains(release, prereleases=True)]
        assert caps == [], f"{package} {release} is excluded by {caps}: installing [dev] would downgrade it"
    # the Ray launcher is its own extra, and what it pins is why
    ray = closure("fedrun", frozenset({"ray"}))
    assert "hydra-ray-launcher" in ray


def test_the_environment_is_consistent():
    done = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_wheel_ships_every_config_group_and_setuptools_names_them_all(tmp_path):
    """``pip install .`` (not editable) builds a wheel: every YAML of ``conf/`` must be in it as ``fedrun.conf``, and
    setuptools must not warn that a group's folder is "absent from the ``packages`` configuration" (it still ships
    such a folder's files today and says it will stop): a new config group is added to pyproject's ``packages``."""
    root = Path(__file__).resolve().parents[2]
    source = tmp_path / "source"  # the build writes build/ and *.egg-info beside pyproject.toml: not in the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, source / name)
    for name in ("fedrun", "conf", "hydra_plugins"):
        shutil.copytree(root / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-w", str(tmp_path / "wheel"), "-v"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = done.stdout + done.stderr
    absent = sorted(set(re.findall(r"Package '([\w.]+)' is absent from the `packages` configuration", log)))
    assert absent == [], f"list these in pyproject.toml's [tool.setuptools] packages: {absent}"
    (wheel,) = (tmp_path / "wheel").glob("fedrun-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    wanted = {f"fedrun/conf/{p.relative_to(root / 'conf').as_posix()}" for p in (root / "conf").rglob("*.yaml")}
    wanted |= {p.relative_to(root).as_posix() for p in (root / "fedrun").rglob("*.py")}
    wanted |= {p.relative_to(root).as_posix() for p in (root / "hydra_plugins").rglob("*.py")}
    assert len(wanted) > 200 and sorted(wanted - shipped) == []
