"""Run the shell commands of a documentation page, as a reader would type them.

A page's fenced ``bash`` blocks run in order, in one working directory per page (a later block sees what an
earlier one wrote), each with ``bash -euo pipefail``. Two comments on the line right before a fence change that:

- ``<!-- not run: REASON -->``: the block is shown but not run (it needs a cluster, a server that stays up, files
  that are not here, or hours); the reason is required.
- a ``{code-block}`` with a ``:caption: PATH`` option is a file the reader writes: it is saved to PATH (relative to
  the page's working directory) before the blocks after it run.

Usage: ``python docs/_ext/doc_commands.py docs/tutorial.md [--workdir DIR] [--times FILE]`` (exit 1 on the first
block that fails). Tests run it on the tutorial and every how-to page (tests/e2e/test_docs_commands.py). Each block
run is timed; with ``--times`` (the tests: ``FEDRUN_DOC_TIMES``) a JSON line per block is appended to FILE: the page,
the block's line and first command, its wall seconds and the machine it ran on (the cores this process may use and
the load average before and after), which ``scripts/doc_times.py`` turns into the table the pages' times come from.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})\s*(?P<info>[^\n]*)$")
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(?P<reason>.*?)\s*-->$")


@dataclass
class Block:
    """One fenced block of a page: ``kind`` is ``run``, ``skip`` (with ``reason``) or ``file`` (with ``path``)."""

    kind: str
    text: str
    line: int
    reason: str = ""
    path: str = ""
    seconds: float | None = None  # a block run: its wall time
    stderr: str = ""  # a block run: what it wrote to its standard error


def machine() -> dict:
    """The cores this process may use and the 1-minute load average now: what a time measured here depends on."""
    return {"cores": len(os.sched_getaffinity(0)), "load": round(os.getloadavg()[0], 2)}


def blocks(page: Path) -> list[Block]:
    """The page's bash blocks and captioned files, in order. Blocks in other languages without a caption are prose."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i].strip())
        if not match:
            i += 1
            continue
        fence, info, start = match["fence"], match["info"].strip(), i
        body, i = [], i + 1
        while i < len(lines) and lines[i].strip() != fence:
            body.append(lines[i])
            i += 1
        i += 1
        options = {}
        while body and body[0].startswith(":") and info.startswith("{"):
            key, _, value = body.pop(0)[1:].partition(":")
            options[key.strip()] = value.strip()
        language = info.split("}", 1)[-1].strip() if info.startswith("{") else info.split(" ")[0]
        before = lines[start - 1].strip() if start else ""
        skipped = NOT_RUN.match(before)
        text = "\n".join(body).strip("\n") + "\n"
        if "caption" in options and info.startswith("{code-block}"):
            out.append(Block("file", text, start + 1, path=options["caption"]))
        elif language in ("bash", "sh", "shell", "console"):
            if skipped:
                out.append(Block("skip", text, start + 1, reason=skipped["reason"]))
            else:
                out.append(Block("run", text, start + 1))
    return out


def run_page(
    page: Path, workdir: Path, timeout: float = 600, env: dict | None = None, times: Path | None = None
) -> list[Block]:
    """Run ``page``'s blocks in ``workdir``; raises ``RuntimeError`` naming the page and line of a block that fails.
    Returns the blocks (run, skipped and written), each block run with its wall ``seconds``; with ``times``, appends
    one JSON line per block run to that file."""
    found = blocks(page)
    for block in found:
        if block.kind == "skip" and not block.reason:
            raise RuntimeError(f"{page}:{block.line}: a block not run must say why (<!-- not run: REASON -->)")
        if block.kind == "file":
            target = workdir / block.path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.text)
        elif block.kind == "run":
            print(f"$ {page}:{block.line}\n{block.text}", file=sys.stderr, flush=True)
            before, start = machine(), time.perf_counter()
            done = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", block.text],
                cwd=workdir,
                env={**os.environ, **(env or {})},
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            block.seconds, block.stderr = time.perf_counter() - start, done.stderr
            if times is not None:
                after = machine()
                record = {
                    "page": page.name if page.parent.name == "docs" else f"{page.parent.name}/{page.name}",
                    "line": block.line,
                    "command": next((ln for ln in block.text.splitlines() if ln.strip()), "")[:120],
                    "seconds": round(block.seconds, 1),
                    "ok": done.returncode == 0,
                    "cores": before["cores"],
                    "load_before": before["load"],
                    "load_after": after["load"],
                    "date": datetime.date.today().isoformat(),
                }
                with times.open("a") as out:
                    out.write(json.dumps(record) + "\n")
            if done.returncode != 0:
                raise RuntimeError(
                    f"{page}:{block.line}: exit {done.returncode}\n{block.text}\n--- stdout\n{done.stdout[-3000:]}"
                    f"\n--- stderr\n{done.stderr[-3000:]}"
                )
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="+", type=Path)
    parser.add_argument("--workdir", type=Path, help="run here (default: a new temporary directory per page)")
    parser.add_argument("--times", type=Path, help="append a JSON line per block run (its wall time, the machine)")
    args = parser.parse_args(argv)
    for page in args.pages:
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fedrun-doc-"))
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            found = run_page(page.resolve(), workdir, times=args.times)
        except RuntimeError as error:
            print(error, file=sys.stderr)
            return 1
        counts = {kind: sum(b.kind == kind for b in found) for kind in ("run", "skip", "file")}
        print(
            f"{page}: {counts['run']} blocks run, {counts['skip']} not run, {counts['file']} files written in {workdir}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
