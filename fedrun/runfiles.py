"""Files fedrun writes in a run dir, never through a link, whenever the link was made.

A run dir may be shared, copied with ``cp -al`` or prepared by someone else, and a resume takes minutes: a check of
its links when it starts cannot cover a link made while it trains. So no write of fedrun's opens an existing name:

- a whole file (a checkpoint, ``summary.csv``, a plot, a spilled client state) is written to a new file of an
  unpredictable name in the same folder (``tempfile.mkstemp``: ``O_CREAT | O_EXCL``, which neither follows a link
  nor reuses a name) and renamed over its own name (``os.replace``), which replaces a link of either kind at that
  name instead of writing to what it points at;
- an appended file (``metrics.csv``, a per-client series) is opened without following a symbolic link
  (``O_NOFOLLOW``) and refused, in one line, when it is no regular file or has another name (a hard link: its
  content is also a file elsewhere).
"""

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

MODE = 0o644  # what a file fedrun writes may be read by: mkstemp's own 0o600 would hide a run from a colleague


class RunFileError(RuntimeError):
    """A file of a run dir fedrun will not use, found while the run trains: the run stops in one line, FAILED."""


class LinkedFile(RunFileError):
    """A file fedrun appends to in a run dir became a link (or something other than a regular file)."""

    def __init__(self, path: Path, what: str):
        self.path = path
        super().__init__(f"{path} is {what}: fedrun does not write through it (a link made in the run dir)")


class BadFile(RunFileError):
    """A file fedrun wrote in a run dir and reads back holds something else (a crafted or damaged file)."""

    def __init__(self, path: Path, what: str):
        self.path = path
        super().__init__(f"{path} is not {what}")


def own_file(path: Path) -> bool:
    """Whether ``path`` may be a file fedrun wrote: a regular file, not a link of either kind (``lstat``)."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_nlink == 1


@contextlib.contextmanager
def replaced(path: Path, mode: str = "w", **kwargs) -> Iterator:
    """A handle to a new file that replaces ``path`` when the block ends without an error (and is removed when
    it does not): the rename is atomic, and a link at ``path`` is replaced, never written through.

    Args:
        path: The file to write.
        mode: ``"w"`` or ``"wb"``.
        **kwargs: Passed to ``open`` (``newline=""`` for a CSV file).
    """
    path = Path(path)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, MODE)
        with os.fdopen(fd, mode, **kwargs) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def write_text(path: Path, text: str) -> None:
    """``path.write_text(text)`` without writing through a link (``replaced``)."""
    with replaced(path) as handle:
        handle.write(text)


def appended(path: Path, binary: bool = False, **kwargs):
    """``path`` opened to append text (bytes when ``binary``; created when absent), never through a symbolic link,
    and refused (``LinkedFile``) when it is no regular file or has another name (a hard link)."""
    path = Path(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, MODE)
    except OSError as error:
        if path.is_symlink():  # ELOOP: O_NOFOLLOW met a symbolic link
            raise LinkedFile(path, "a symbolic link") from None
        raise error
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        raise LinkedFile(path, "a hard link" if stat.S_ISREG(info.st_mode) else "not a regular file")
    return os.fdopen(fd, "ab" if binary else "a", **kwargs)


def linked(entry: os.DirEntry) -> bool:
    """Whether a folder's entry is a link of either kind: a symbolic link, or a regular file with another name
    (hard links pass ``is_symlink``; fedrun would write through them into the file elsewhere)."""
    if entry.is_symlink():
        return True
    return entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_nlink > 1
