"""Checkpoints (fedrun/checkpoint.py): a lock file that is a symbolic link is never written through, a torn write
leaves the previous checkpoint, a foreign pickle is refused in one line, when one is due; a closed terminal's SIGHUP
stops the run as SIGTERM does and moves its output into the run dir."""

import io
import signal
import subprocess
import sys
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


def test_sighup_stops_after_the_round_never_at_once_and_stays_ignored_under_nohup(tmp_path, monkeypatch):
    """A closed terminal's SIGHUP is a stop request as SIGTERM is; the shell sends it again to its jobs, so a
    second one (or one after SIGTERM) never stops at once; where it was ignored (nohup) the run keeps it so."""
    killed = []
    monkeypatch.setattr(checkpoint.os, "kill", lambda pid, signum: killed.append(signum))
    monkeypatch.setattr(checkpoint.time, "sleep", lambda s: None)
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        for first in (signal.SIGHUP, signal.SIGTERM):
            stops = checkpoint.StopSignals(Checkpoint(tmp_path))
            monkeypatch.setattr(stops, "_hung_up", lambda fds: None)  # the output's move: its own test, in a process
            with stops:
                assert signal.getsignal(signal.SIGHUP) == stops._handle
                stops._handle(first, None)
                stops._handle(signal.SIGHUP, None)
                stops._handle(signal.SIGHUP, None)
                assert stops.checkpoint.stop_requested == signal.Signals(first).name and killed == []
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL
        with checkpoint.StopSignals(Checkpoint(tmp_path)) as stops:  # SIGTERM twice: at once, as before
            stops._handle(signal.SIGTERM, None)
            stops._handle(signal.SIGTERM, None)
        assert killed == [signal.SIGTERM]
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup
        with checkpoint.StopSignals(Checkpoint(tmp_path)):
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


HUNG_UP = """
import os, signal, sys
from pathlib import Path
from fedrun.checkpoint import Checkpoint, StopSignals
with StopSignals(Checkpoint(Path(sys.argv[1]))) as stops:
    print("before", flush=True)
    os.kill(os.getpid(), signal.SIGHUP)
    print("after on stdout", flush=True)
    print("after on stderr", file=sys.stderr, flush=True)
    print("stop", stops.checkpoint.stop_requested, file=sys.stderr, flush=True)
"""


@pytest.mark.parametrize("stdout", ["pipe", "file"])
def test_after_a_sighup_what_went_to_a_pipe_or_terminal_goes_to_terminal_log_and_a_file_stays(tmp_path, stdout):
    """A hang-up takes the terminal and the pipes of its pipeline (a write there fails: EIO, EPIPE): fedrun's output
    from then on is in the run dir's terminal.log; a regular file it was redirected to keeps it."""
    run = tmp_path / "run"
    run.mkdir()
    with open(tmp_path / "out.txt", "w") as out:
        done = subprocess.run(
            [sys.executable, "-c", HUNG_UP, str(run)],
            stdout=subprocess.PIPE if stdout == "pipe" else out,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    assert done.returncode == 0, done.stderr
    log = (run / checkpoint.TERMINAL_LOG).read_text()
    before = done.stdout if stdout == "pipe" else (tmp_path / "out.txt").read_text()
    assert before.startswith("before\n")
    assert (
        done.stderr.strip()
        == f"fedrun: stopping after this round; what fedrun prints here goes to {run / checkpoint.TERMINAL_LOG}"
    )
    assert "after on stderr\nstop SIGHUP\n" in log  # stderr was a pipe in both
    moved, stayed = (log, before) if stdout == "pipe" else (before, log)  # the stop's own line is on stdout
    for line in ("SIGHUP received: stopping after this round with a checkpoint", "after on stdout"):
        assert line in moved and line not in stayed


def test_a_sighup_tells_a_terminal_or_pipe_that_is_both_stdout_and_stderr_once(tmp_path):
    """``fedrun ... 2>&1 | tee``, or a terminal: one descriptor's file behind both, told once where the output goes."""
    run = tmp_path / "run"
    run.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", HUNG_UP, str(run)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120
    )
    assert done.returncode == 0, done.stdout
    assert done.stdout.decode().count("what fedrun prints here goes to") == 1, done.stdout
    assert "after on stdout" in (run / checkpoint.TERMINAL_LOG).read_text()


LEFT = """
import sys
from pathlib import Path
from fedrun.checkpoint import Checkpoint, StopSignals
with StopSignals(Checkpoint(Path(sys.argv[1]))) as stops:
    print("before", flush=True)
    sys.stdin.readline()  # the reader of stdout has gone
    for line in range(3):
        print("after", line, flush=True)
    print("stop", stops.checkpoint.stop_requested, file=sys.stderr, flush=True)
"""


def test_a_write_to_a_pipe_whose_reader_left_moves_that_output_to_terminal_log_and_asks_for_the_stop(tmp_path):
    """``fedrun ... | head``: Python ignores SIGPIPE, so a write to the pipe raises EPIPE (and failed the run). That
    output goes to terminal.log from there, the run stops after its round as SIGPIPE would stop it, and the other
    stream, whose reader is still there, keeps its own (the same for EIO: a terminal gone under a blocked write)."""
    run = tmp_path / "run"
    run.mkdir()
    child = subprocess.Popen(
        [sys.executable, "-c", LEFT, str(run)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline() == "before\n"
    child.stdout.close()
    _, err = child.communicate("go\n", timeout=120)
    assert child.returncode == 0, err
    assert err.splitlines()[-1] == "stop SIGPIPE"
    log = (run / checkpoint.TERMINAL_LOG).read_text()
    assert "SIGPIPE (EPIPE: the terminal or pipe is gone): stopping after this round with a checkpoint" in log
    assert "after 0\nafter 1\nafter 2\n" in log and "stop SIGPIPE" not in log  # stderr's reader stayed


def test_a_handler_closing_the_stream_it_took_while_the_run_trained_leaves_the_real_one_open():
    """absl's logging handler, made when dp-accounting is first imported inside a run, keeps the ``sys.stderr`` of
    that moment (the run's ``Surviving`` stand-in) and closes it once it is no longer ``sys.stderr``: the real
    stream must stay open (a sweep's next job lost its stderr)."""
    real = io.StringIO()
    stand_in = checkpoint.Surviving(real, lambda error: None)
    stand_in.write("kept\n")
    stand_in.close()
    assert not real.closed and real.getvalue() == "kept\n"
