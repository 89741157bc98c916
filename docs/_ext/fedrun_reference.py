"""Sphinx extension: the config reference and the CLI page, generated from ``conf/`` and the code at every build.

For every config group (a folder of ``conf/``, ``hydra/launcher`` included) it writes ``reference/config/<group>.md``:
the group's overview (hand-written, ``reference/groups/<group>.md``), then one section per option (one YAML file):
its leading comment, the class its ``_target_`` builds with that class's docstring, and a table of every key with
its default as the YAML file writes it and its meaning. A key's meaning is the YAML file's own comment on that key,
else the entry for that argument in the ``Args:`` section of the class's Google-style docstring (parsed by Sphinx's
napoleon; a ``See ``Base``.`` entry is followed up the class's bases). ``reference/config/index.md`` lists the
groups and the root config's keys (``conf/config.yaml``), ``reference/cli.md`` the commands' ``--help``. The pages
are written into the source tree before Sphinx reads it and are not kept in git, so they cannot drift from ``conf/``.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from sphinx.ext.napoleon.docstring import GoogleDocstring

DOCS = Path(__file__).resolve().parents[1]
CONF = DOCS.parent / "conf"
OUT = DOCS / "reference" / "config"
GROUPS = DOCS / "reference" / "groups"
NO_MEANING = "—"

# The root config's groups in conf/config.yaml's defaults order come first; then the rest alphabetically.
_SECTION_ENDS = re.compile(r"^(Args|Arguments|Attributes|Returns|Raises|Yields|Example|Examples|Note|Notes):\s*$")


def groups() -> list[str]:
    """Every config group: each folder of conf/ holding YAML files (``hydra/launcher`` included), root order first."""
    found = sorted(str(p.parent.relative_to(CONF)) for p in CONF.rglob("*.yaml") if p.parent != CONF)
    found = list(dict.fromkeys(found))
    order = [_default_group(entry) for entry in _load(CONF / "config.yaml")["defaults"]]
    return [g for g in order if g in found] + [g for g in found if g not in order]


def options(group: str) -> list[str]:
    """The options of a group: its YAML files' stems, sorted."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def default_option(group: str) -> str | None:
    """The option conf/config.yaml selects for ``group`` (None: the group is off by default or not in the root)."""
    for entry in _root_defaults(CONF):
        if isinstance(entry, dict) and group in entry:
            return entry[group]
    return None


@functools.cache
def _root_defaults(conf: Path) -> list:
    """conf/config.yaml's defaults list, read once per conf tree (every option's section asks for it)."""
    return list(_load(conf / "config.yaml")["defaults"])


def _default_group(entry) -> str | None:
    return next(iter(entry)) if isinstance(entry, dict) else None


def _load(path: Path):
    yaml = YAML()  # round-trip: keeps the comments, which are the keys' meanings
    return yaml.load(path.read_text())


def _leading_comment(path: Path) -> str:
    """The comment block at the top of a YAML file (``# @package`` lines left out), as prose."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith("# @package"):
            lines.append(line[1:].strip())
    return " ".join(line for line in lines if line).strip()


def _comment(node, key) -> str:
    """The end-of-line comment on ``key`` of a ruamel mapping (or index of a sequence), '' when none."""
    tokens = node.ca.items.get(key) if hasattr(node, "ca") else None
    if not tokens:
        return ""
    for token in tokens[1:3]:  # [2]: the comment after a scalar value; [1]/[3]: after a key whose value is a block
        if token is not None:
            value = token if isinstance(token, str) else getattr(token, "value", "")
            text = value.strip().split("\n")[0].lstrip("#").strip()
            if text:
                return text
    if len(tokens) > 3 and tokens[3]:
        for token in tokens[3]:
            text = getattr(token, "value", "").strip().split("\n")[0].lstrip("#").strip()
            if text:
                return text
    return ""


def _args(cls) -> dict[str, str]:
    """``{argument: meaning}`` from the ``Args:`` sections of ``cls`` and its bases (nearest first); an entry that
    only says ``See X`` gives way to a base's own entry; continuation lines are joined."""
    found: dict[str, str] = {}
    for klass in inspect.getmro(cls):
        if klass is object:
            continue
        docs = [klass.__doc__]
        if "__init__" in vars(klass):
            docs.append(klass.__init__.__doc__)
        for doc in docs:
            if not doc:
                continue
            current = None
            for line in GoogleDocstring(inspect.cleandoc(doc)).lines():
                match = re.match(r":param (?P<names>[^:]+):\s*(?P<text>.*)", line)
                if match:
                    current = [n.strip().strip("*") for n in match["names"].split(",")]
                    text = match["text"].strip()
                    for name in current:
                        if name not in found or (found[name].startswith("See ") and not text.startswith("See ")):
                            found[name] = text
                        elif found[name] != text:
                            current = [n for n in current if n != name]
                elif current and line.startswith("   ") and line.strip():
                    for name in current:
                        found[name] = f"{found[name]} {line.strip()}"
                elif not line.strip() or line.startswith(":"):
                    current = None
    return found


def _summary(cls) -> str:
    """The class docstring before its first Google section, as Markdown paragraphs."""
    doc = inspect.getdoc(cls) or ""
    kept = []
    for line in doc.splitlines():
        if _SECTION_ENDS.match(line.strip()):
            break
        kept.append(line)
    return "\n".join(kept).strip()


def _locate(target: str):
    module, _, name = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _value(value) -> str:
    """A YAML value as the file writes it, for a table cell."""
    if isinstance(value, CommentedMap | dict):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, CommentedSeq | list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _code(text: str) -> str:
    """Text for a code span in a Markdown table cell: only pipes and newlines escaped."""
    return str(text).replace("\n", " ").replace("|", "\\|")


def _cell(text: str) -> str:
    """Text for a Markdown table cell: pipes and newlines escaped, and outside code spans the characters Markdown
    would read as emphasis (``_target_`` in a comment is a name, not italics)."""
    parts = re.split(r"(`+[^`]*`+)", text.replace("\n", " "))
    return "".join(part if part.startswith("`") else re.sub(r"([_*])", r"\\\1", part) for part in parts).replace(
        "|", "\\|"
    )


def _raw_comment(raw: str, key: str) -> str:
    """The comment on the one line of the file that sets ``key`` (ruamel attaches some comments, e.g. the first
    key's after a ``defaults`` list, to the node before it); '' when none or when the key is set on several lines."""
    found = re.findall(rf"^\s*{re.escape(key)}:[^#\n]*#\s*(.*)$", raw, flags=re.M)
    sets = re.findall(rf"^\s*{re.escape(key)}:", raw, flags=re.M)
    return found[0].strip() if len(found) == 1 and len(sets) == 1 else ""


def keys(node, cls=None, prefix: str = "", raw: str = "") -> list[tuple[str, str, str]]:
    """``(dotted key, default, meaning)`` for every key of a YAML node, descending into nested mappings and into
    list items that build a class of their own."""
    rows = []
    cls = _locate(node["_target_"]) if isinstance(node, CommentedMap) and "_target_" in node else cls
    meanings = _args(cls) if cls else {}
    items = node.items() if isinstance(node, CommentedMap) else enumerate(node)
    for key, value in items:
        if key in ("defaults", "_target_", "_partial_", "_convert_"):
            continue
        dotted = f"{prefix}{key}"
        own = _comment(node, key) or (_raw_comment(raw, str(key)) if raw else "")
        if isinstance(value, CommentedMap) and value:
            nested_cls = _locate(value["_target_"]) if "_target_" in value else None
            meaning = own or meanings.get(str(key), "")
            if meaning:  # a mapping without a meaning of its own is its keys' prefix only
                rows.append((dotted, "(mapping)", meaning))
            rows += keys(value, nested_cls, f"{dotted}.", raw)
        elif (
            isinstance(value, CommentedSeq)
            and value
            and all(isinstance(v, CommentedMap) and "_target_" in v for v in value)
        ):
            rows.append((dotted, f"a list of {len(value)}", own or meanings.get(str(key), "")))
            rows += keys(value, None, f"{dotted}.", raw)
        else:
            rows.append((dotted, _value(value), own or meanings.get(str(key), "")))
    return rows


def option_section(group: str, option: str) -> str:
    """One option's section of its group's page."""
    path = CONF / group / f"{option}.yaml"
    data = _load(path) or CommentedMap()
    text = path.read_text()
    out = [f"## {option}", ""]
    facts = [f"`conf/{group}/{option}.yaml`"]
    if default_option(group) == option:
        facts.insert(0, "**default**")
    target = data.get("_target_") if isinstance(data, CommentedMap) else None
    cls = _locate(target) if target else None
    if target:
        facts.append(f"builds `{target}`")
    extends = [_value(e) for e in data.get("defaults", [])] if isinstance(data, CommentedMap) else []
    if extends:
        facts.append("defaults: " + ", ".join(f"`{e}`" for e in extends))
    out += [" · ".join(facts), ""]
    if lead := _leading_comment(path):
        out += [lead, ""]
    if cls and (summary := _summary(cls)):
        out += ["\n".join(f"> {line}" if line else ">" for line in summary.splitlines()), ""]
    global_package = text.startswith("# @package _global_") or group in ("experiment", "sweep", "method", "defence")
    rows = keys(data, raw=text) if isinstance(data, CommentedMap) else []
    if global_package:
        body = "\n".join(line for line in text.splitlines() if not line.startswith("#")).strip()
        out += ["It sets keys of the whole config (their meanings: each group's page):", "", "```yaml", body, "```", ""]
    elif rows:
        key_prefix = "" if group.startswith("hydra/") else f"{group}."
        if group.startswith("hydra/"):
            key_prefix = "hydra.launcher."
        out += ["| key | default | meaning |", "| --- | --- | --- |"]
        out += [f"| `{key_prefix}{k}` | `{_code(v)}` | {_cell(m) or NO_MEANING} |" for k, v, m in rows]
        out.append("")
    elif not extends:
        out += ["No keys: choosing it is the whole setting.", ""]
    return "\n".join(out)


def group_page(group: str) -> str:
    """The whole page of one group."""
    title = f"`{group}` group"
    overview = GROUPS / f"{group.replace('/', '_')}.md"
    opts = options(group)
    default = default_option(group)
    out = [f"# {title}", ""]
    if overview.exists():
        out += [overview.read_text().strip(), ""]
    usage = (
        f"Choose with `fedrun -m {group}=<option> ...`; the file's keys become `hydra.launcher.<key>`."
        if group.startswith("hydra/")
        else f"Choose with `fedrun {group}=<option>`; change a key with `fedrun {group}.<key>=<value>`."
    )
    if default is None and not group.startswith("hydra/"):
        usage += " Off unless chosen."
    out += [usage, ""]
    listed = ", ".join(f"[`{o}`](#{_slug(o)})" + (" (default)" if o == default else "") for o in opts)
    out += [f"Options: {listed}.", ""]
    out += [option_section(group, option) for option in opts]
    return "\n".join(out)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading, as MyST makes it (myst_heading_anchors)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def index_page() -> str:
    root = _load(CONF / "config.yaml")
    out = [
        "# Config groups and keys",
        "",
        "Generated from `conf/` at every build: each option is one YAML file in `conf/<group>/` whose `_target_` "
        "names the class it builds, and whose keys are that class's constructor arguments. A key's meaning is the "
        "YAML file's comment on it, else the class docstring's entry for that argument.",
        "",
        "| group | default | options |",
        "| --- | --- | --- |",
    ]
    for group in groups():
        page = group.replace("/", "_")
        default = default_option(group)
        opts = ", ".join(f"[`{o}`]({page}.md#{_slug(o)})" for o in options(group))
        out.append(f"| [`{group}`]({page}.md) | {f'`{default}`' if default else '(none)'} | {opts} |")
    out += ["", "## Top-level keys", "", "The root config, `conf/config.yaml`, besides the groups:", ""]
    out += ["| key | default | meaning |", "| --- | --- | --- |"]
    plain = CommentedMap((k, v) for k, v in root.items() if k not in ("defaults", "hydra"))
    for key in plain:
        plain.ca.items[key] = root.ca.items.get(key)
    out += [
        f"| `{k}` | `{_code(v)}` | {_cell(m) or NO_MEANING} |"
        for k, v, m in keys(plain, raw=(CONF / "config.yaml").read_text())
    ]
    out += ["", "```{toctree}", ":hidden:", ""] + [g.replace("/", "_") for g in groups()] + ["```", ""]
    return "\n".join(out)


def cli_page() -> str:
    """The commands and their ``--help``: fedrun's from the installed console script (Hydra renders it), the others
    from their parsers (``build_parser``), as their ``--help`` prints them."""
    from fedrun import importer, report, ui, upgrade

    done = subprocess.run([str(Path(sys.executable).parent / "fedrun"), "--help"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"fedrun --help exited {done.returncode}: {done.stderr[-500:]}")
    helps = [
        ("fedrun", "Runs one experiment, or a sweep with `-m`.", done.stdout),
        ("fedrun-report", "Tables, plots and robustness matrices from runs.", report.build_parser().format_help()),
        ("fedrun-import", "A run dir into MLflow, as a new run.", importer.build_parser().format_help()),
        ("fedrun-ui", "MLflow's UI on fedrun's store, opened on the runs.", ui.build_parser().format_help()),
        (
            "python -m fedrun.upgrade",
            "Run dirs written before November 2026 converted once.",
            upgrade.build_parser().format_help(),
        ),
    ]
    out = ["# Commands", "", "Each command's `--help`, as the command prints it (generated at every build).", ""]
    for name, what, text in helps:
        out += [f"## {name}", "", what, "", "```text", text.rstrip(), "```", ""]
    return "\n".join(out)


def generate(app=None) -> list[Path]:
    """Write the generated pages (only those whose text changed, so Sphinx rebuilds what changed)."""
    OUT.mkdir(parents=True, exist_ok=True)
    generated = DOCS / "reference" / "_generated"
    generated.mkdir(exist_ok=True)
    pages = {
        OUT / "index.md": index_page(),
        DOCS / "reference" / "cli.md": cli_page(),
        generated / "checks.md": checks_page(),
        generated / "compat.md": compat_page(),
    }
    pages.update({OUT / f"{g.replace('/', '_')}.md": group_page(g) for g in groups()})
    for stale in (set(OUT.glob("*.md")) | set(generated.glob("*.md"))) - set(pages):
        stale.unlink()
    for path, text in pages.items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    return list(pages)


def setup(app):
    app.connect("builder-inited", generate)
    return {"parallel_read_safe": True, "version": "1"}


def _literal_text(node, source: str) -> str:
    """A message argument as a reader would see it: a string, or an f-string with its ``{...}`` fields kept as
    written; other expressions as their source."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(
            part.value if isinstance(part, ast.Constant) else "{" + ast.get_source_segment(source, part.value) + "}"
            for part in node.values
        )
    if isinstance(node, ast.Lambda):
        return _literal_text(node.body, source)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _literal_text(node.left, source) + _literal_text(node.right, source)
    return ast.get_source_segment(source, node) or ""


def checks_page() -> str:
    """Every value check in fedrun's code (``check(ok, key, value, allowed)`` of ``fedrun.errors``), found by
    parsing the modules, and every row of the compatibility table (``fedrun/compat.py``'s ``RULES``)."""
    package = DOCS.parent / "fedrun"
    rows = []
    for path in sorted(package.rglob("*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", None)) == "check"
                and len(node.args) == 4
            ):
                key, allowed = _literal_text(node.args[1], source), _literal_text(node.args[3], source)
                rows.append((str(path.relative_to(DOCS.parent)), key, allowed))
    out = [
        "| module | key | allowed |",
        "| --- | --- | --- |",
        *(f"| `{m}` | `{_code(k)}` | {_cell(a)} |" for m, k, a in sorted(set(rows))),
        "",
        f"{len(set(rows))} checks. A key is relative to the group that builds the class (`temperature` is reported as "
        "`aggregator.temperature`); `{...}` is filled in from the run.",
        "",
    ]
    return "\n".join(out)


def compat_page() -> str:
    """The compatibility table's rows, parsed from ``fedrun/compat.py``."""
    path = DOCS.parent / "fedrun" / "compat.py"
    source = path.read_text()
    tree = ast.parse(source)
    rules = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "RULES"
    )
    out = ["| parts | refused key | allowed |", "| --- | --- | --- |"]
    for call in rules.elts:
        needs = ", ".join(ast.literal_eval(call.args[0]))
        key, allowed = _literal_text(call.args[2], source), _literal_text(call.args[4], source)
        out.append(f"| {needs} | `{_code(key)}` | {_cell(allowed)} |")
    out += ["", f"{len(rules.elts)} rules, checked in this order; the first that applies is the run's one line.", ""]
    return "\n".join(out)


if __name__ == "__main__":
    for page in generate():
        print(page)
