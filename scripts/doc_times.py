"""How long each command of the documentation takes, and on what: the times the README, the tutorial and the how-to
guides state come from this table.

    python scripts/doc_times.py docs/how-to/personalization.md docs/tutorial.md   # run the pages, then the table
    FEDRUN_DOC_TIMES=times.jsonl pytest -m slow -k pages_commands                 # the slow tier records them too
    python scripts/doc_times.py --from times.jsonl                                # the table of recorded times

Pages run with ``docs/_ext/doc_commands.py``, the runner of the slow tier's test of every page, one page after
another in a temporary folder each. The table gives each block's wall seconds with the cores the runner could use
and the 1-minute load average before and after it: a time measured beside other work (the slow tier runs two
pages at once on two cores) says so, and is not comparable with one measured on an idle machine.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

import doc_commands  # noqa: E402  (docs/_ext, not a package)


def table(records: list[dict]) -> str:
    """A markdown table of the recorded blocks, in page and line order."""
    lines = [
        "| page:line | command | seconds | cores | load before, after | date |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in sorted(records, key=lambda r: (r["page"], r["line"])):
        command = r["command"].replace("|", "\\|")
        failed = "" if r.get("ok", True) else " (failed)"
        lines.append(
            f"| {r['page']}:{r['line']} | `{command}` | {r['seconds']:.0f}{failed} | {r['cores']} | "
            f"{r['load_before']:.1f}, {r['load_after']:.1f} | {r['date']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", type=Path, help="pages to run and time (docs/tutorial.md, ...)")
    parser.add_argument("--from", dest="source", type=Path, help="a JSON-lines file of recorded times instead")
    args = parser.parse_args(argv)
    if args.source is None and not args.pages:
        parser.error("name pages to run, or --from a file of recorded times")
    if args.source is not None:
        records = [json.loads(line) for line in args.source.read_text().splitlines() if line.strip()]
    else:
        with tempfile.TemporaryDirectory() as scratch:
            times = Path(scratch) / "times.jsonl"
            for page in args.pages:
                workdir = Path(tempfile.mkdtemp(prefix="fedrun-doc-", dir=scratch))
                try:
                    doc_commands.run_page(page.resolve(), workdir, times=times)
                except RuntimeError as error:
                    print(error, file=sys.stderr)
                    break
            records = [json.loads(line) for line in times.read_text().splitlines()] if times.exists() else []
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
