"""Per-client tensors held only for the clients that have some, within a memory budget: what a personalisation
method (``fedrun.personal``) and a client program (``fedrun.programs``) keep per client between rounds.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from pathlib import Path

from fedrun.errors import ConfigError
from fedrun.lazy import torch
from fedrun.runfiles import BadFile, appended, own_file, replaced, write_text
from fedrun.state import load_plain

LOG = "written.log"  # the names of the files a store wrote in its folder, one a line: what a sweep may delete


class PersonalStore:
    """Per-client tensors, held only for the clients that have some.

    Up to ``budget_mb`` megabytes stay in memory (the most recently used); beyond it the least recently used are
    written to ``directory`` (one ``torch.save`` file per client and version, read back with
    ``weights_only=True``: a run dir's files never run code) and read back when the client is asked for. A file is
    never rewritten: a checkpoint names the files it holds, so the files a checkpoint names survive until a later
    checkpoint replaces it, and a kill between the two loses nothing.

    Args:
        budget_mb: Megabytes of tensors kept in memory.
        directory: Where spilled tensors go (None: nothing may spill; the budget is then only a bound on the tensors
            held, which a run without a directory never exceeds by refusing in ``put``).
    """

    def __init__(self, budget_mb: float, directory: Path | None = None):
        self.budget = int(budget_mb * 1e6)
        self.directory = Path(directory) if directory is not None else None
        self.memory: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.disk: dict[int, str] = {}  # client -> file name in directory
        self.written = 0  # files written so far: the next file's version
        self.bytes = 0
        self._files: set[str] = set()  # every file this store may still need or must delete
        self._saved: set[str] = set()  # the files the last checkpoint names
        self._swept = False  # whether files of an earlier attempt (a restart before any checkpoint) were deleted

    def __contains__(self, client: int) -> bool:
        return client in self.memory or client in self.disk

    def __len__(self) -> int:
        return len(self.memory) + len(self.disk)

    def get(self, client: int) -> torch.Tensor | None:
        """The client's tensor (read back from disk when spilled), or None when it has none."""
        client = int(client)
        if client in self.memory:
            self.memory.move_to_end(client)
            return self.memory[client]
        if client not in self.disk:
            return None
        path = self.directory / self.disk.pop(client)
        try:  # weights_only: a crafted pickle runs nothing; anything but fedrun's own record is one line
            value = load_plain(path) if own_file(path) else None
        except Exception as error:
            raise BadFile(path, f"a client state fedrun spilled ({type(error).__name__})") from None
        if not isinstance(value, dict) or not isinstance(value.get("value"), torch.Tensor):
            raise BadFile(path, "a client state fedrun spilled (a regular file holding {'value': tensor})")
        self._hold(client, value["value"])
        return value["value"]

    def put(self, client: int, value: torch.Tensor) -> None:
        client = int(client)
        if client in self.memory:
            self.bytes -= _nbytes(self.memory.pop(client))
        self.disk.pop(client, None)  # the file stays until no checkpoint names it
        self._hold(client, value.detach().clone())

    def _hold(self, client: int, value: torch.Tensor) -> None:
        self.memory[client] = value
        self.bytes += _nbytes(value)
        while self.bytes > self.budget and len(self.memory) > 1:
            self._spill(*self.memory.popitem(last=False))

    def _spill(self, client: int, value: torch.Tensor) -> None:
        if self.directory is None:
            raise MemoryError("personal state over its memory budget and no directory to spill it to")
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"{client}.{self.written}.pt"
        self.written += 1
        with appended(self.directory / LOG) as log:  # recorded before it exists: a kill between leaves a name only
            log.write(name + "\n")
        with replaced(self.directory / name, "wb") as handle:
            torch.save({"value": value.cpu()}, handle)
        self.bytes -= _nbytes(value)
        self.disk[client] = name
        self._files.add(name)

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the tensors in memory, the names of the spilled files. Files that neither this
        checkpoint nor the one before it names are deleted (the one before is on disk by now; this one may not be
        yet); at the first, so are the files of an attempt that ended before any checkpoint (no checkpoint names
        them and this store never wrote them)."""
        named = set(self.disk.values())
        if not self._swept:
            self._sweep(self._files)
        self._swept = True
        for name in self._files - named - self._saved:
            (self.directory / name).unlink(missing_ok=True)
        if self.directory is not None and (self.directory / LOG).exists():  # the record: what may still be deleted
            write_text(self.directory / LOG, "".join(f"{name}\n" for name in sorted(named | self._saved)))
        self._files, self._saved = named | self._saved, named
        return {"memory": dict(self.memory), "disk": dict(self.disk), "written": self.written}

    def load_state_dict(self, state: dict) -> None:
        self.memory = OrderedDict((int(c), v) for c, v in state.get("memory", {}).items())
        self.bytes = sum(_nbytes(v) for v in self.memory.values())
        self.disk = {int(c): str(n) for c, n in state.get("disk", {}).items()}
        for client, name in self.disk.items():  # a checkpoint from elsewhere names files: only this store's own
            if not re.fullmatch(rf"{client}\.\d+\.pt", name):
                raise ConfigError(
                    "checkpoint",
                    name,
                    f"a spilled state's file name as fedrun writes it ({client}.<version>.pt, inside the run dir's "
                    f"{self.directory.name if self.directory is not None else 'store'}/): a crafted checkpoint may not "
                    "name a file elsewhere",
                )
            if self.directory is not None and not own_file(self.directory / name):
                raise ConfigError(
                    "checkpoint",
                    name,
                    f"a spilled state's file in {self.directory} (missing, or a link of either kind)",
                )
        self.written = int(state.get("written", 0))
        self._files = self._saved = set(self.disk.values())
        self._swept = True
        self._sweep(self._files)  # written after the checkpoint: orphans

    def _sweep(self, keep: set[str]) -> None:
        """Delete the files this folder's stores recorded writing (``LOG``, a name a line, written before each file)
        that ``keep`` does not name: an attempt's files after its last checkpoint. Deletion is of what fedrun wrote,
        not of what a read of the folder finds: a recorded name must be of the store's form
        (``<client>.<version>.pt``) and a regular file with no other name, in a folder that is no link."""
        if self.directory is None or self.directory.is_symlink() or not own_file(self.directory / LOG):
            return
        recorded = [n for n in (self.directory / LOG).read_text().split() if re.fullmatch(r"\d+\.\d+\.pt", n)]
        for name in set(recorded) - keep:
            if own_file(self.directory / name):
                os.unlink(self.directory / name)
        write_text(self.directory / LOG, "".join(f"{name}\n" for name in dict.fromkeys(recorded) if name in keep))


def _nbytes(value: torch.Tensor) -> int:
    return value.numel() * value.element_size()
