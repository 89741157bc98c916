"""How long each command of the documentation takes, and on what: the times the README, the tutorial and the how-to
guides state come from this table.

    python scripts/doc_times.py docs/how-to/personalization.md docs/tutorial.md   # run the pages, then the table
    FEDRUN_DOC_TIMES=times.jsonl pytest -m slow -k pages_commands                 # the slow tier records them too
    python scripts/doc_times.py --from times.jsonl                                # the table of recorded times
    python scripts/doc_times.py --from times.jsonl --page docs/reference/doc-times.md   # the page the docs cite

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


PAGE = """# How long the documentation's commands take

The times the README, the tutorial and the how-to guides give come from this table: each block of commands as
`docs/_ext/doc_commands.py` ran it (the slow tier's test of every page, with `FEDRUN_DOC_TIMES` set; `.ci/run`
prints the same table for every CI run), in wall seconds, with the cores the runner could use and the 1-minute
load average before and after the block. A load above the cores means the block shared them with other work, and
took longer than it would on an idle machine. Regenerate: `python scripts/doc_times.py --from <times.jsonl> --page
docs/reference/doc-times.md`.

{note}

{table}
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", type=Path, help="pages to run and time (docs/tutorial.md, ...)")
    parser.add_argument("--from", dest="source", type=Path, help="a JSON-lines file of recorded times instead")
    parser.add_argument(
        "--page", type=Path, help="write the table as the docs' reference page (docs/reference/doc-times.md)"
    )
    parser.add_argument("--note", default="", help="a line on how the times were taken, for --page")
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
    if args.page is not None:
        args.page.write_text(PAGE.format(note=args.note, table=table(records)))
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
