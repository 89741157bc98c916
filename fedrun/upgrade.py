"""Read what older fedruns wrote: checkpoints and run dirs, in today's form.

Two kinds of change. Those that need no code to run are done in memory each time a run resumes, so that the engines
and ``setup`` never branch on a dir's age: ``migrate`` turns a checkpoint's flat dict (before format 2, 2026-11) into
``{"parts": {name: state}, "loop": {...}}``, and ``migrate_config`` adds the config groups a dir predates (privacy,
sampler, compression) as the run ran without them. Run dirs written by 968a63f resume through them to the
same numbers as an uninterrupted run (tests/e2e/test_old_checkpoints.py).

The other kind is below: checkpoints written by fedrun before explicit state, converted once into today's plain
format.

Until November 2026 a checkpoint pickled numpy generators and whole objects (a hybrid's phase aggregators, the
asynchronous engine's speed streams); fedrun now reads checkpoints with ``torch.load(weights_only=True)`` and
refuses those, and a run dir whose config.yaml predates the ``pipeline`` group. If you trust a run dir (you
wrote it), convert it once:

    python -m fedrun.upgrade outputs/2026-11-20/10-00-00 outputs/multirun/2026-11-20/11-00-00/*

Each ``checkpoint.pt`` is read with ``weights_only=False`` (this runs whatever the file names: only for your own
files), its objects are turned into their state dicts, and it is written back atomically; a checkpoint already in
today's format is left alone.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from fedrun.checkpoint import FILE, VERSION, Checkpoint, lock, read, unlock
from fedrun.errors import ConfigError
from fedrun.lazy import torch
from fedrun.runfiles import replaced

# The loop variables of each engine's checkpoints before VERSION 2, old key -> new key (the rest were parts).
SYNC_LOOP = {"params": "params", "previous": "previous", "latest_accuracy": "latest_accuracy", "sampler": "rng"}
ASYNC_LOOP = {
    "w": "params",
    "version": "version",
    "jobs": "jobs",
    "buffer": "buffer",
    "pulled": "pulled",
    "events": "events",
    "sampler": "rng",
    "speed_rng": "speed_rng",
    "applied": "applied",
}


def migrate(state: dict) -> dict:
    """A checkpoint's state in today's form (``fedrun.checkpoint.snapshot``): a flat dict of the engine's variables
    and its parts' states (before VERSION 2, 2026-11) becomes ``{"parts": {name: state}, "loop": {...}}``. A part
    the checkpoint predates gets no entry (``Parts.load_state_dict`` starts it from {}). Plain data in, plain data
    out: nothing is run."""
    version = state.get("format", 1)  # (an asynchronous run's "version" is its model's)
    if version == VERSION:
        return state
    if not isinstance(version, int) or version > VERSION:
        raise ConfigError("checkpoint", f"format {version}", f"format {VERSION} or older (written by a newer fedrun)")
    synchronous = state.get("engine", "sync") != "async"
    names = SYNC_LOOP if synchronous else ASYNC_LOOP
    loop = {new: state[old] for old, new in names.items()}
    if synchronous:
        loop["fstar"] = state.get("fstar", {})
    parts = {"aggregator": state["aggregator"], "server": state["server"]}
    parts["pipeline"] = state.get("pipeline", {"stages": []})  # before the pipeline: no stage
    if "selection" in state:  # the sampler's own state (its draws' generator was the loop's "sampler")
        parts["sampler"] = state["selection"]
    if "privacy" in state:
        parts["privacy"] = state["privacy"]
    kept = {k: state[k] for k in ("round", "finished", "rows", "extra") if k in state}
    return {**kept, "format": VERSION, "engine": "sync" if synchronous else "async", "parts": parts, "loop": loop}


# The groups a config saved by an older fedrun lacks (it ran without them), as their ``none`` options give them.
ADDED_GROUPS = {
    "privacy": {"_target_": "fedrun.privacy.Privacy", "mechanism": "none"},  # before privacy (2026-11)
    "sampler": {"_target_": "fedrun.sampling.Uniform"},  # before samplers: the schedule's uniform draw
    "compression": {},  # before compression: dense updates
    "attack": {"_target_": "fedrun.attacks.Attack"},  # before attacks: every client honest
    "personalization": {"_target_": "fedrun.parts.ClientState"},  # before personalisation: the global model for all
    "client": {"_target_": "fedrun.programs.LocalSGD", "memory_mb": 1024},  # before client programs: local SGD
    "devices": {"_target_": "fedrun.devices.Unmodelled"},  # before devices: no virtual clock
}


def migrate_config(config: DictConfig) -> DictConfig:
    """A run dir's saved config with the groups it predates added as the run ran without them (in memory: the dir's
    file is left as it was), so that building a resumed run needs no "saved before X" branch."""
    missing = {group: node for group, node in ADDED_GROUPS.items() if group not in config}
    if not missing:
        return config
    return OmegaConf.merge(config, OmegaConf.create(missing))


def plain_state(value):
    """An old checkpoint's state with every object replaced by its attributes (as ``Stateful.state_dict`` gives them)."""
    if isinstance(value, dict):
        out = {k: plain_state(v) for k, v in value.items()}
        if isinstance(value.get("phases"), list) and all(
            isinstance(p, tuple) and hasattr(p[0], "__dict__") for p in value["phases"]
        ):
            out["phases"] = [
                plain_state(dict(vars(p[0]))) for p in value["phases"]
            ]  # Hybrid: (aggregator, until_round, until_accuracy)
        return out
    if isinstance(value, (list, tuple)):
        items = [plain_state(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if type(value).__module__.startswith("fedrun."):  # an object of fedrun's (the async engine's speed streams)
        return plain_state(dict(vars(value)))
    return value


def upgrade_config(directory: Path) -> bool:
    """Bring ``directory``'s config.yaml to today's groups: the ``pipeline`` group (none: no stage) added, and the
    schedule's class at its new place (fedrun.rounds). False when there was nothing to change."""
    path = Path(directory) / "config.yaml"
    if not path.is_file():
        return False
    config = OmegaConf.load(path)
    changed = False
    if "pipeline" not in config:
        config.pipeline = {"_target_": "fedrun.pipeline.Pipeline", "stages": []}
        changed = True
    if OmegaConf.select(config, "schedule._target_") == "fedrun.engine.Schedule":
        config.schedule._target_ = "fedrun.rounds.Schedule"
        changed = True
    if changed:
        with replaced(path) as handle:  # never through a link at the config's name
            OmegaConf.save(config, handle)
    return changed


def upgrade(directory: Path) -> bool:
    """Rewrite ``directory``'s checkpoint and config in today's format; False when they already were. Not while a
    run writes the dir (its lock, ``fedrun.checkpoint.lock``). The config is only read as YAML and rewritten, never
    built: a resume checks what it names (``fedrun.cli.resume``)."""
    lock(directory, "directory", directory)
    try:
        return _upgrade(directory)
    finally:
        unlock(directory)


def _upgrade(directory: Path) -> bool:
    changed = upgrade_config(directory)
    path = Path(directory) / FILE
    if not path.is_file():
        return changed
    try:
        read(path)
        return changed
    except ConfigError:
        pass
    state = plain_state(torch.load(path, weights_only=False))
    state.setdefault("pipeline", {"stages": []})  # before the update pipeline: no stage
    if state.get("engine") == "async":  # a buffered update now carries its stages' diagnostics (none then)
        state["buffer"] = [(*entry, {}) if len(entry) == 4 else entry for entry in state["buffer"]]
    checkpoint = Checkpoint(directory)
    checkpoint.extra = state.pop("extra", {})
    checkpoint.save(state)
    read(path)  # it loads safely now
    return True


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments (the docs' command reference prints its help)."""
    parser = argparse.ArgumentParser(
        prog="python -m fedrun.upgrade",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Documentation: docs/how-to/resume.md (how to), docs/reference/index.md (every command and option)",
    )
    parser.add_argument("directories", nargs="+", type=Path, help="run output dirs (each with a checkpoint.pt)")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    for directory in args.directories:
        try:
            print(f"{directory}: {'converted' if upgrade(directory) else 'nothing to do'}")
        except ConfigError as exc:
            print(f"python -m fedrun.upgrade: error: {exc}", file=sys.stderr)
            sys.exit(2)
        except (pickle.UnpicklingError, TypeError, AttributeError, RuntimeError) as exc:
            print(
                f"python -m fedrun.upgrade: error: {directory / FILE}: {type(exc).__name__}: {str(exc).splitlines()[0]}",
                file=sys.stderr,
            )
            sys.exit(2)


if __name__ == "__main__":
    main()
