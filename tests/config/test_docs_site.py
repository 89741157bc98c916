"""The documentation site builds with warnings as errors (so every internal link and anchor resolves), and its
config reference holds every option and key of ``conf/``, found here by globbing ``conf/`` on its own."""

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

ROOT = Path(__file__).parents[2]
DOCS, CONF = ROOT / "docs", ROOT / "conf"
sys.path.insert(0, str(DOCS / "_ext"))

import doc_commands  # noqa: E402  (docs/_ext, not a package)

pytestmark = pytest.mark.xdist_group("site")  # the site built once, on one worker


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once as CI builds it: ``-W --keep-going`` turns every warning (a page outside the toctree, a
    link or anchor that does not resolve, a docstring autodoc cannot read) into a failure. ``.ci/run`` builds it
    first, as the README says, and names it in ``FEDRUN_SITE``: the site is built once per CI run."""
    if built := os.environ.get("FEDRUN_SITE"):
        return Path(built)
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    return out


def test_a_group_keeps_to_one_worker(request):
    """Under ``--dist loadgroup`` (pyproject.toml's addopts) a grouped test's id carries its group, by which xdist
    gives the whole group to one worker; pytest 9.2 with pytest-xdist 3.8 drops it without a word
    (pytest-dev/pytest-xdist#1386), and every worker then builds the site, starts the server, runs the sweep."""
    if not request.config.getoption("loadgroup", False):
        pytest.skip("not on an xdist worker under --dist loadgroup")
    assert request.node.nodeid.endswith("@site"), request.node.nodeid


def _text(page: Path) -> str:
    """A built page's visible text (tags dropped, entities decoded)."""
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


def _headings(page: Path, level: int) -> list[str]:
    return [
        html.unescape(re.sub(r"<[^>]+>", "", h)).replace("¶", "").strip()
        for h in re.findall(rf"<h{level}>(.*?)</h{level}>", page.read_text(), flags=re.S)
    ]


def _groups() -> dict[str, list[str]]:
    """{group: options} from conf/ itself: every folder holding YAML files, hydra/launcher included."""
    found = {}
    for path in sorted(CONF.rglob("*.yaml")):
        if path.parent != CONF:
            found.setdefault(str(path.parent.relative_to(CONF)), []).append(path.stem)
    return found


def _keys(node, prefix=""):
    """Dotted keys of a YAML option, descending into mappings and into list items that build a class."""
    for key, value in node.items():
        if key in ("defaults", "_target_", "_partial_", "_convert_"):  # Hydra's instantiate flags, not arguments
            continue
        if isinstance(value, dict) and value:
            yield from _keys(value, f"{prefix}{key}.")
        elif isinstance(value, list) and value and all(isinstance(v, dict) and "_target_" in v for v in value):
            for i, item in enumerate(value):
                yield from _keys(item, f"{prefix}{key}.{i}.")
        else:
            yield f"{prefix}{key}"


def test_every_option_of_every_group_has_its_section_and_every_key_its_row(site):
    groups = _groups()
    assert {"aggregator", "attack", "dataset", "hydra/launcher", "experiment", "sweep"} <= set(groups)
    index = _text(site / "reference" / "config" / "index.html")
    for group, options in groups.items():
        page = site / "reference" / "config" / f"{group.replace('/', '_')}.html"
        assert page.exists(), f"no reference page for the group {group}"
        assert _headings(page, 2) == options, group  # one section per YAML file, in order
        text = _text(page)
        for option in options:
            assert option in index, (group, option)
            raw = (CONF / group / f"{option}.yaml").read_text()
            if raw.startswith("# @package _global_"):
                continue  # presets, sweeps, methods: shown as their YAML
            data = OmegaConf.to_container(OmegaConf.create(raw), resolve=False)
            prefix = "hydra.launcher." if group == "hydra/launcher" else f"{group}."
            for key in _keys(data):
                assert f"{prefix}{key}" in text, (group, option, key)


def test_every_key_in_the_reference_has_a_meaning(site):
    empty = []
    for page in (site / "reference" / "config").glob("*.html"):
        for row in re.findall(r"<tr[^>]*>(.*?)</tr>", page.read_text(), flags=re.S):
            cells = [_text_of(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.S)]
            if len(cells) == 3 and cells[2] in ("", "—"):
                empty.append(f"{page.stem}: {cells[0]}")
    assert not empty, "keys without a comment in their YAML or an Args entry in their class: " + ", ".join(empty)


def _text_of(cell: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", cell)).strip()


def test_a_new_yaml_file_appears_in_the_reference_without_editing_a_page(tmp_path, monkeypatch):
    import fedrun_reference

    conf = tmp_path / "conf"
    (conf / "aggregator").mkdir(parents=True)
    (conf / "config.yaml").write_text("defaults:\n  - aggregator: fedavg\nseed: 0  # the seed\n")
    (conf / "aggregator" / "fedavg.yaml").write_text((CONF / "aggregator" / "fedavg.yaml").read_text())
    (conf / "aggregator" / "mine.yaml").write_text(
        "_target_: fedrun.aggregators.FedSoftMax\ntemperature: 2.0  # my own T\n"
    )
    monkeypatch.setattr(fedrun_reference, "CONF", conf)
    page = fedrun_reference.group_page("aggregator")
    assert "## mine" in page and "| `aggregator.temperature` | `2.0` | my own T |" in page
    assert "builds `fedrun.aggregators.FedSoftMax`" in page


def test_a_key_without_a_comment_takes_its_meaning_from_the_class_docstring():
    import fedrun_reference

    from fedrun.aggregators import FedSoftMax

    meanings = fedrun_reference._args(FedSoftMax)
    assert meanings["temperature"] == "T (T0 when annealing), > 0."
    assert not meanings["fstar"].startswith("See ")  # followed up to LossWeighted's own entry


def test_the_help_points_at_pages_that_exist():
    done = subprocess.run([str(Path(sys.executable).parent / "fedrun"), "--help"], capture_output=True, text=True)
    assert done.returncode == 0
    pages = re.findall(r"\((docs/[^)#]+\.md)\)", done.stdout)
    assert len(pages) >= 8 and all((ROOT / p).exists() for p in pages), pages
    for command in ("fedrun-report", "fedrun-import"):
        done = subprocess.run(
            [str(Path(sys.executable).parent / command), "--help"], capture_output=True, text=True, check=True
        )
        linked = re.findall(r"(docs/\S+\.md)", done.stdout)
        assert linked and all((ROOT / p).exists() for p in linked), (command, linked)


def test_every_block_a_page_does_not_run_says_why():
    pages = [DOCS / "tutorial.md", *sorted((DOCS / "how-to").glob("*.md"))]
    assert len(pages) > 10
    ran = 0
    for page in pages:
        for block in doc_commands.blocks(page):
            assert block.kind != "skip" or block.reason.strip(), f"{page}:{block.line}"
            ran += block.kind == "run"
    assert ran >= 20  # the tutorial and the guides are mostly commands that run


SWEEP = re.compile(r"^\s*fedrun\s+(-m\b|(?!--cfg).*\bsweep=)", re.M)  # a command line that runs a sweep
TIME = re.compile(r"\b\d+(\.\d+)?\s*(s|seconds|min|minutes|hours?)\b")


def test_every_sweep_a_guide_runs_says_how_long_it_takes():
    """In the block's own comments or the prose right before or after it (up to the blocks or headings around it);
    the figures come from ``scripts/doc_times.py`` (or, for a sweep not run here, from the results page that ran
    it). The how-to index lists commands whose guides say it."""
    silent = []
    for page in [DOCS / "tutorial.md", *sorted(p for p in (DOCS / "how-to").glob("*.md") if p.name != "index.md")]:
        lines = page.read_text().splitlines()
        for block in doc_commands.blocks(page):
            if block.kind == "file" or not SWEEP.search(block.text):
                continue
            start, end = block.line - 1, block.line + len(block.text.splitlines()) + 1
            before = next((i for i in range(start - 2, -1, -1) if lines[i].startswith(("```", "#"))), -1)
            after = next((i for i in range(end + 1, len(lines)) if lines[i].startswith(("```", "#"))), len(lines))
            prose = "\n".join(lines[before + 1 : start] + lines[end:after]) + block.text
            if not TIME.search(prose):
                silent.append(f"{page.relative_to(DOCS)}:{block.line}")
    assert silent == []


def test_the_readme_is_one_screen_and_names_the_two_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    ci = (ROOT / ".ci" / "run").read_text()
    for command in ("pip install -e .", "fedrun aggregator=fedsoftmax partition=shards", 'pip install -e ".[dev]"'):
        assert command in readme and command in ci, command
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).exists(), link
