"""The extras resolve without downgrading anything: ``[dev]`` (the tests, the linters, the site) does not pull the Ray
launcher, whose ``cloudpickle<3`` pin made pip install older cloudpickle and joblib, and nothing in the closure of
``[dev]`` caps either package; the environment the tests run in is consistent (``pip check``)."""

import subprocess
import sys
from importlib.metadata import PackageNotFoundError, requires

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
