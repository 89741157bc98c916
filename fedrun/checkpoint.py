"""Checkpoints and clean stops: what lets a killed run continue exactly where it was.

An engine hands ``Checkpoint.save`` everything its loop carries between rounds (the global model, the
server optimizer and aggregator objects with their state, every stateful random generator, the metrics
rows so far, an asynchronous run's event heap and buffer); ``load`` gives it back. Mini-batch order,
heterogeneity and client speeds come from streams keyed by (round, client), so they need no state.

A checkpoint holds plain data only (``fedrun.state``) and is read with ``torch.load(weights_only=True)``: a
checkpoint that names any other code (a crafted pickle in a shared run dir) is refused in one line, and nothing
in it runs.

Writes are atomic: a temporary file in the same directory, flushed and fsynced, then renamed over the
previous checkpoint (and the directory fsynced), so a kill during a write leaves the previous checkpoint.

A ``StopSignals`` context turns the first SIGTERM, SIGINT, SIGUSR2 or SIGHUP into a request the engine honours
after the current round (checkpoint, then ``Stopped``); a second one stops at once, but for SIGHUP, which a closed
terminal sends twice (the kernel to the foreground job, then the shell to each of its jobs). From a SIGHUP on, what
fedrun prints goes to ``terminal.log`` in the run dir where it went to a terminal or a pipe, both gone with it; a
write that finds its terminal or pipe gone (EIO, EPIPE: ``fedrun ... | head``) does the same and stops the run as
SIGHUP or SIGPIPE would, instead of failing it.

One process writes a run dir at a time: ``lock`` holds an exclusive ``flock`` on ``fedrun.lock`` in it for as long
as the process lives (or until ``unlock``), and a second process is refused in one line naming the holder's pid.
The kernel drops the lock when its process dies, however it dies (kill -9 included), so a stale lock never blocks
a resume; the file stays, with the last holder's pid.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import pickle
import signal
import stat
import sys
import time
from pathlib import Path

from fedrun.errors import ConfigError, check
from fedrun.lazy import torch
from fedrun.runfiles import RunFileError, appended, replaced
from fedrun.state import decode, encode, load_plain

FILE = "checkpoint.pt"
TERMINAL_LOG = "terminal.log"  # what fedrun printed after a SIGHUP, where it went to a terminal or a pipe
RUN_FILE = "run.json"  # the run's MLflow run id, title, thread count and CPUs, from its start: a run killed before its first checkpoint reopens them
# A run that diverged leaves its reason here: it is a result (the same config and seed would diverge again at the
# same round), so a resumed sweep skips the job, and ``resume=`` refuses the run, instead of making a second FAILED run.
DIVERGED = "diverged.txt"


def read(path: Path) -> dict:
    """The state saved in the checkpoint file ``path``, read without running anything that it names."""
    try:
        return decode(load_plain(path))
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, KeyError, TypeError) as exc:
        # a refused global, a truncated or foreign file: torch's message is a page; the line that says what was
        # refused, else its first
        lines = str(exc).splitlines() or [type(exc).__name__]
        reason = next((line.strip() for line in lines if "Unsupported" in line), lines[0])
        raise ConfigError(
            "checkpoint",
            str(path),
            f"a checkpoint of plain tensors, numbers and strings, which torch.load(weights_only=True) "
            f"reads; this one is not, and nothing in it was run ({reason[:160]}). One written by fedrun before "
            f"2026-11 that you trust: python -m fedrun.upgrade {Path(path).parent}",
        ) from None


def diverged(directory: Path) -> str | None:
    """Why the run in ``directory`` diverged, or None when it did not."""
    path = Path(directory) / DIVERGED
    return path.read_text().strip() if path.is_file() else None


LOCK_FILE = "fedrun.lock"
_held: dict[Path, int] = {}  # run dir -> the descriptor of the lock this process holds on it


def lock(directory: Path, key: str, value) -> None:
    """Hold ``directory``'s lock (see the module docstring); a ConfigError for ``key``=``value`` when another
    process holds it, naming that process's pid."""
    directory = Path(directory)
    if directory in _held:
        return
    path = directory / LOCK_FILE
    try:
        # O_NOFOLLOW: a lock file that is a symbolic link (a crafted dir's, to a file of yours) is never written
        # through; no O_TRUNC: the holder's pid stays readable to the process it refuses.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ConfigError(key, str(value), f"a run dir whose {LOCK_FILE} fedrun can open ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode) or os.fstat(fd).st_nlink > 1:  # a hard link: its content is elsewhere
        os.close(fd)
        raise ConfigError(key, str(value), f"a run dir whose {LOCK_FILE} is a plain file with no other name")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown (starting)"
        os.close(fd)
        raise ConfigError(
            key,
            str(value),
            f"a run dir no other process is writing (process {holder} holds {path}: let it finish or stop it, "
            "then run this again)",
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[directory] = fd


def unlock(directory: Path) -> None:
    """Release ``directory``'s lock if this process holds it (a sweep's process runs many jobs, one at a time)."""
    fd = _held.pop(Path(directory), None)
    if fd is not None:
        os.close(fd)


def held() -> set[Path]:
    """The run dirs whose lock this process holds."""
    return set(_held)


def _forget_locks_in_child() -> None:
    # A forked child (a worker process) shares the lock's open file: closing its copy keeps a child that outlives a
    # killed parent from holding the run dir (closing never unlocks the parent's: only LOCK_UN or the last close does).
    for fd in _held.values():
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_forget_locks_in_child)


VERSION = 2  # {part: state} + the loop's variables; fedrun.upgrade.migrate reads the unversioned ones before it


def snapshot(engine: str, round_: int, finished: bool, parts, loop: dict, rows: list) -> dict:
    """The state a checkpoint keeps, the same form for both engines: each part's ``state_dict()`` by name
    (``fedrun.parts.Parts``), the engine's own loop variables and the metrics rows so far."""
    return {
        "format": VERSION,
        "engine": engine,
        "round": round_,
        "finished": finished,
        "parts": parts.state_dict(),
        "loop": loop,
        "rows": rows,
    }


SLOW_ROUND_S = 10.0  # the default: a checkpoint every round when rounds take longer than this, else every 10


class Stopped(Exception):
    """The run stopped at a signal's request after a checkpoint (``round`` is the last one completed)."""

    def __init__(self, signal_name: str, round_: int):
        self.signal_name, self.round = signal_name, round_
        super().__init__(f"stopped by {signal_name} after round {round_}")


class Checkpoint:
    """Where and how often an engine checkpoints.

    Args:
        directory: The run's output directory (the file is ``checkpoint.pt`` in it).
        every: Rounds (aggregations) between checkpoints; null = every round when a round takes over 10 s,
            else every 10. A checkpoint is also written at the end and when a stop is requested.
        resume: Start from the checkpoint in ``directory``.
    """

    def __init__(self, directory: Path, every: int | None = None, resume: bool = False):
        check(
            every is None or (isinstance(every, int) and every >= 1),
            "checkpoint.every",
            every,
            "null or an integer >= 1",
        )
        self.path, self.every, self.resume = Path(directory) / FILE, every, resume
        self.source = self.path  # the file a resume reads (a distributed run's other ranks read rank 0's)
        self.stop_requested: str | None = None  # the name of the signal that asked for a stop
        self.saved_round = 0
        self.extra: dict = {}  # saved with every state (the CLI keeps the MLflow run id here)
        self.before_save: list = []  # called before each save (the CLI's Tracker.flush: MLflow has every round saved)
        self._state: dict | None = None

    def restored(self) -> dict | None:
        """The saved state when resuming (read once), else None."""
        if not self.resume:
            return None
        if self._state is None:
            self._state = read(self.source)
            self.saved_round = self._state["round"]
        return self._state

    def due(self, round_: int, round_wall_s: float, last: bool = False) -> bool:
        """Whether to checkpoint after ``round_`` (which may have jumped several rounds since the last call)."""
        if last or self.stop_requested:
            return True
        every = self.every if self.every is not None else (1 if round_wall_s > SLOW_ROUND_S else 10)
        return round_ // every > self.saved_round // every

    def save(self, state: dict) -> None:
        """Write ``state`` (with its ``round``) atomically."""
        for call in self.before_save:
            call()
        plain = encode({**state, "extra": self.extra})  # before any file is opened: an object in it leaves nothing
        with replaced(self.path, "wb") as handle:  # a new file of its own name, renamed over: never through a link
            torch.save(plain, handle)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        self.saved_round = state["round"]

    def after_round(self, round_: int, round_wall_s: float, last: bool, state) -> None:
        """Checkpoint when due (``state()`` builds the state), then raise ``Stopped`` if a stop was requested (on
        any rank of a distributed run: every rank stops after the same round)."""
        self.stop_requested = agreed(self.stop_requested)
        if self.due(round_, round_wall_s, last):
            self.save(state())
        if self.stop_requested and not last:
            raise Stopped(self.stop_requested, round_)


class RankLost(Stopped):
    """Another rank is gone (killed, out of memory, its machine lost): this one stops as if signalled, its run KILLED
    and resumable from the last checkpoint (``torchrun`` sends the survivors SIGTERM as well)."""

    def __init__(self, error: BaseException):
        Stopped.__init__(self, "SIGTERM", -1)
        self.args = (f"stopped: another rank was lost ({type(error).__name__}: {str(error).splitlines()[0][:200]})",)

    def __str__(self) -> str:
        return self.args[0]


def exchanged(collective, *args, **kwargs):
    """Run a collective of ``torch.distributed``; a peer that is gone raises ``RankLost`` instead of gloo's or
    NCCL's error."""
    try:
        return collective(*args, **kwargs)
    except RuntimeError as exc:  # torch.distributed.DistError is one
        raise RankLost(exc) from exc


class FollowerCheckpoint(Checkpoint):
    """The checkpoint of a rank > 0 of a distributed run (``fedrun.distributed``): it resumes from rank 0's file
    (``source``) and never writes one; ``directory`` is its own (where its part may spill personal state)."""

    def __init__(self, directory: Path, source: Path | None = None):
        super().__init__(directory, None, resume=source is not None and (Path(source) / FILE).is_file())
        if source is not None:
            self.source = Path(source) / FILE

    def save(self, state: dict) -> None:
        self.saved_round = state["round"]


def agreed(stop_requested: str | None) -> str | None:
    """In a distributed run (``torch.distributed`` initialised), the stop some rank was asked for, the same on every
    rank (a signal reaches the ranks at different moments); else ``stop_requested`` itself."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return stop_requested
    code = STOP_NAMES.index(stop_requested) + 1 if stop_requested in STOP_NAMES else 0
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    flag = torch.tensor([code], device=device)
    exchanged(dist.all_reduce, flag, op=dist.ReduceOp.MAX)
    return STOP_NAMES[int(flag.item()) - 1] if int(flag.item()) else None


class StopSignals:
    """While active, the first SIGTERM, SIGINT, SIGUSR2 or SIGHUP sets ``checkpoint.stop_requested``; a second one
    acts at once (SIGINT raises KeyboardInterrupt, the others terminate), but for SIGHUP. Only in the main thread;
    elsewhere it does nothing.

    SIGHUP is a closed terminal (an SSH session lost, a window closed): the run stops as for SIGTERM, resumable, its
    MLflow run KILLED, and what fedrun prints from then on goes to ``terminal.log`` in the run dir instead of the
    terminal or pipe it went to (``_hung_up``). A terminal's hang-up comes twice (the kernel's to the foreground job,
    then bash's to each of its jobs), so SIGHUP never stops at once. Where SIGHUP was ignored when the run started
    (``nohup``), it stays ignored: the run goes on.

    A write can find the terminal gone before the signal comes (a write blocked on a full terminal, as over a
    stalled SSH connection, wakes with EIO) and a pipe's reader can leave (``fedrun ... | head``: EPIPE, Python
    ignoring SIGPIPE): ``sys.stdout`` and ``sys.stderr`` are wrapped (``Surviving``) so that such a write moves the
    output as a hang-up does, asks for the stop (SIGHUP for EIO, SIGPIPE for EPIPE) and is written again there."""

    # SIGUSR2: a cluster's warning before its time limit (SLURM's --signal=USR2@<seconds>, as submitit asks for it).
    SIGNALS = (signal.SIGTERM, signal.SIGINT) + tuple(
        getattr(signal, name) for name in ("SIGUSR2", "SIGHUP") if hasattr(signal, name)
    )

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint, self.previous, self.log, self.terminal, self.moved = checkpoint, {}, None, [], []
        self.streams = ()  # sys.stdout and sys.stderr as they were before the run's stand-ins (``Surviving``)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if name == "SIGHUP":
            self._hung_up(self.terminal)  # as they were at the start: a hung-up terminal is no longer one to isatty
            if self.checkpoint.stop_requested:  # a hang-up again, or after another signal: never at once
                return
        elif self.checkpoint.stop_requested:  # the second signal: stop now
            self.__exit__()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            os.kill(os.getpid(), signum)
            time.sleep(1)
            return
        self._stop(name, "received")

    def _stop(self, name: str, why: str) -> None:
        self.checkpoint.stop_requested = name
        again = "send it again to stop at once" if name not in LOSSES.values() else "SIGTERM stops at once"
        with contextlib.suppress(OSError, RuntimeError):  # RuntimeError: a handler inside a write to the same stream
            print(f"\nfedrun: {name} {why}: stopping after this round with a checkpoint ({again})", flush=True)

    def _lost(self, fd: int, error: OSError) -> None:
        """A write to ``fd`` found its terminal or pipe gone (``Surviving``): that output moves as for SIGHUP, and
        the run stops after this round as if the signal had come (a blocked write can wake before the signal)."""
        self._hung_up([fd])
        if not self.checkpoint.stop_requested:
            self._stop(LOSSES[error.errno], f"({errno.errorcode[error.errno]}: the terminal or pipe is gone)")

    def _hung_up(self, fds: list[int]) -> None:
        """Send what fedrun prints from here on to the descriptors ``fds`` (of 1 and 2: a terminal or a pipe, gone
        with the terminal; a write there fails, EIO or EPIPE, and would fail the run) to ``terminal.log`` in the run
        dir; a regular file stays. A terminal still there is told first."""
        gone = [fd for fd in fds if fd not in self.moved]
        if not gone:
            return
        path = self.checkpoint.path.parent / TERMINAL_LOG
        told = set()  # once a terminal or pipe: stdout and stderr are most often the same one
        for fd in gone:  # straight to the descriptor: the handler may be inside a buffered write
            with contextlib.suppress(OSError):
                if (same := _identity(fd)) not in told:
                    told.add(same)
                    os.write(
                        fd, f"\nfedrun: stopping after this round; what fedrun prints here goes to {path}\n".encode()
                    )
        if self.log is None:
            try:
                self.log = appended(path, binary=True)
            except (OSError, RunFileError):  # no run dir to write (a link there): nowhere, rather than a failed run
                self.log = open(os.devnull, "wb")  # kept open: the process's output from here
        for fd in gone:
            os.dup2(self.log.fileno(), fd)
            self.moved.append(fd)

    def __enter__(self) -> StopSignals:
        self.terminal = [fd for fd in (1, 2) if _lost_with_terminal(fd)]
        try:
            for signum in self.SIGNALS:
                if signum == getattr(signal, "SIGHUP", None) and signal.getsignal(signum) == signal.SIG_IGN:
                    continue  # nohup: the run was asked to outlive its terminal
                self.previous[signum] = signal.signal(signum, self._handle)
        except ValueError:  # not the main thread
            self.previous = {}
            return self
        self.streams = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = (
            Surviving(s, functools.partial(self._lost, _fd(s))) if _fd(s) in self.terminal else s for s in self.streams
        )  # fmt: skip
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}
        if self.streams:
            sys.stdout, sys.stderr = self.streams
            self.streams = ()


# A write that finds its terminal gone (EIO) or its pipe's reader gone (EPIPE), and the stop it stands for.
LOSSES = {errno.EIO: "SIGHUP", errno.EPIPE: "SIGPIPE"}


class Surviving:
    """A text stream (``sys.stdout``, ``sys.stderr``) whose write or flush, failing because its terminal or pipe is
    gone (``LOSSES``), calls ``lost(error)`` (which moves the descriptor elsewhere) and is done again, instead of
    raising into the run. Anything else is the stream's own."""

    def __init__(self, stream, lost):
        self._stream, self._on_lost = stream, lost

    def _guarded(self, call, *args):
        try:
            return call(*args)
        except OSError as error:
            if error.errno not in LOSSES:
                raise
            self._on_lost(error)
            return call(*args)

    def write(self, text):
        return self._guarded(self._stream.write, text)

    def flush(self):
        return self._guarded(self._stream.flush)

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def close(self) -> None:
        """Nothing: the stream is the process's own. A logging handler made while this stood in for ``sys.stderr``
        (absl's, when dp-accounting is first imported in a run) closes its stream once that is no longer
        ``sys.stderr``: closing the real one would leave the rest of a sweep without stderr."""


def _fd(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # pytest's capture, a closed stream
        return None


def _identity(fd: int) -> tuple[int, int]:
    """What ``fd`` is open on (a terminal, a pipe), the same for two descriptors on one."""
    status = os.fstat(fd)
    return status.st_dev, status.st_ino


def _lost_with_terminal(fd: int) -> bool:
    """Whether the file descriptor ``fd`` is a terminal or a pipe (what a hang-up takes away), not a file. Asked
    before the hang-up: after it, ``isatty`` fails on the terminal (its ioctl gets EIO)."""
    try:
        return os.isatty(fd) or stat.S_ISFIFO(os.fstat(fd).st_mode)
    except OSError:  # closed
        return False


# What ``checkpoint.stop_requested`` may name (``agreed`` sends it between ranks as an index): the signals
# ``StopSignals`` catches, and a study's pruner (``fedrun.study.PRUNED``).
STOP_NAMES = tuple(signum.name for signum in StopSignals.SIGNALS) + ("SIGPIPE", "pruned")
