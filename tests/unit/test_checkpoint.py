"""Checkpoints (fedrun/checkpoint.py): a lock file that is a symbolic link is never written through, a torn write
leaves the previous checkpoint, a foreign pickle is refused in one line, when one is due."""

from pathlib import Path

import pytest
import torch

import fedrun.checkpoint as checkpoint
from fedrun.checkpoint import Checkpoint
from fedrun.errors import ConfigError

# Read at use (not imported by name), so that each test fails for its own reason on a fedrun without them.
LOCK_FILE = "fedrun.lock"


def test_a_lock_file_that_is_a_symbolic_link_is_never_written_through(tmp_path):
    yours = tmp_path / "yours.txt"
    yours.write_text("keep me\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).symlink_to(yours)
    with pytest.raises(ConfigError, match=f"a run dir whose {LOCK_FILE} fedrun can open"):
        checkpoint.lock(run, "resume", run)
    assert yours.read_text() == "keep me\n"


def test_a_torn_checkpoint_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    checkpoint = Checkpoint(tmp_path, every=1)
    checkpoint.save({"round": 1, "params": torch.ones(3)})

    def torn(state, handle):  # the process dies half-way through writing the next one
        handle.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", torn)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save({"round": 2, "params": torch.zeros(3)})
    monkeypatch.undo()
    state = Checkpoint(tmp_path, resume=True).restored()
    assert state["round"] == 1 and torch.equal(state["params"], torch.ones(3))


def test_a_checkpoint_of_a_pickle_protocol_torch_does_not_write_is_refused_in_one_line_without_torch_s_warning(
    tmp_path,
):
    """A raw pickle (protocol 4, what ``pickle.dumps`` writes) of something that names code: refused, nothing run,
    and the refusal is the only thing said (torch warned about the protocol in two lines before it)."""
    import pickle
    import warnings

    (tmp_path / "checkpoint.pt").write_bytes(pickle.dumps({"round": 1, "run": print}))
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        with pytest.raises(ConfigError, match="nothing in it was run"):
            checkpoint.read(tmp_path / "checkpoint.pt")
    assert not warned, [str(w.message) for w in warned]


def test_checkpoints_are_due_every_n_rounds_at_the_end_and_on_a_stop(tmp_path):
    def saved_at(checkpoint, rounds, round_wall_s=0.1):
        saved = []
        for t in rounds:
            if checkpoint.due(t, round_wall_s):
                checkpoint.saved_round = t  # what save() records
                saved.append(t)
        return saved

    assert saved_at(Checkpoint(tmp_path, every=3), range(1, 10)) == [3, 6, 9]
    assert saved_at(Checkpoint(tmp_path, every=3), [2, 5, 7, 8, 10]) == [
        5,
        7,
        10,
    ]  # asynchronous instants jump past 3, 6, 9
    assert Checkpoint(tmp_path, every=3).due(4, 0.1, last=True)
    assert saved_at(Checkpoint(tmp_path), range(1, 21)) == [10, 20]
    assert saved_at(Checkpoint(tmp_path), range(1, 4), round_wall_s=11.0) == [1, 2, 3]  # slow rounds: every round


@pytest.mark.parametrize("case", ["sync", "async"])
def test_an_old_run_dirs_config_gains_every_group_added_since_as_the_run_ran_without_it(case):
    from omegaconf import OmegaConf

    from fedrun.tracking import CONFIG_GROUPS
    from fedrun.upgrade import migrate_config

    saved = OmegaConf.load(Path(__file__).parents[1] / "data" / "ckpt_968a63f" / case / "config.yaml")
    presets = {"method", "defence", "experiment"}  # they set other groups' keys: no node of their own
    missing = [g for g in CONFIG_GROUPS if g not in presets and g not in saved]
    assert missing, "the old config predates some groups: the test would check nothing"
    migrated = migrate_config(saved)
    assert [g for g in CONFIG_GROUPS if g not in presets and g not in migrated] == []
    assert OmegaConf.select(migrated, "devices._target_") == "fedrun.devices.Unmodelled"  # the newest: no clock
