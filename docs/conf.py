"""The documentation site's one config: ``python -m sphinx -W --keep-going -b html docs docs/_build/html``.

Sphinx with MyST (Markdown pages) and the Furo theme. The config reference (``reference/config/``) and the CLI
page are generated at every build from ``conf/`` and the classes' docstrings (``_ext/fedrun_reference.py``), so a
new YAML file appears there without anyone editing a page.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "fedrun"
author = "fedrun's developers"
copyright = "2026, fedrun's developers"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "fedrun_reference"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "**/README.md", "reference/groups", "reference/_generated"]

# GitHub's anchors for headings (`page.md#a-heading`), so links written for GitHub's renderer work here too and
# every `#anchor` a page links to is checked (a missing one is a warning, and warnings fail the build).
myst_heading_anchors = 4
myst_enable_extensions = ["dollarmath", "deflist", "colon_fence", "attrs_inline"]
suppress_warnings = []
nitpicky = False  # signatures name torch and numpy types, which have no pages here

html_theme = "furo"
html_title = "fedrun"
html_static_path = []
html_copy_source = False
html_show_sourcelink = False
