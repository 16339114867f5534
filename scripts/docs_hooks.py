"""mkdocs hook (mkdocs.yml's ``hooks``): the site keeps the repository's layout.

``docs_dir`` is docs/, but its pages are served under ``docs/`` (``docs/sharded.md`` -> ``docs/sharded.html``),
README.md is the home page (``index.md``), and examples/*.py are copied beside them: every relative link of
README.md and docs/*.md (``docs/sharded.md``, ``../examples/mnist.py``, ``security.md``) then resolves on the
site exactly as it does in the repository, with no copy of a page in git and no link rewritten.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]


def on_files(files: Files, config: MkDocsConfig) -> Files:
    moved = Files([])
    for file in files:
        if file.abs_src_path is not None and Path(file.abs_src_path).is_relative_to(ROOT / "docs"):
            moved.append(File.generated(config, f"docs/{file.src_uri}", abs_src_path=file.abs_src_path))
        else:  # the theme's own files
            moved.append(file)
    moved.append(File.generated(config, "index.md", abs_src_path=str(ROOT / "README.md")))
    for example in sorted((ROOT / "examples").glob("*.py")):
        moved.append(File.generated(config, f"examples/{example.name}", abs_src_path=str(example)))
    return moved


_CELL = re.compile(r"(<t[dh][^>]*>)(.*?)(</t[dh]>)", re.DOTALL)
_CODE = re.compile(r"(<code>)(.*?)(</code>)", re.DOTALL)
_BREAK_AFTER = re.compile(r"([./(,=])(?=\w)")


def _breakable(code: str) -> str:
    """Code with a line-break opportunity (``<wbr>``) after each dot, slash, comma, ``=`` and opening
    parenthesis that a name follows: ``tf.distribute.MultiWorkerMirroredStrategy()`` may wrap after a dot."""
    parts = re.split(r"(<[^>]*>)", code)  # tags (a link's, a cross-reference's) are left as they are
    return "".join(part if part.startswith("<") else _BREAK_AFTER.sub(r"\1<wbr>", part) for part in parts)


def on_page_content(html: str, **kwargs: object) -> str:
    """Long code in table cells may wrap at its dots and commas, not only at spaces.

    A signature or dotted name in a cell is one word to the browser, so the narrowest its column can be is that
    whole name: three such columns made the migration tables wider than the page. With break opportunities the
    columns share the text column's width, and a name wraps where a reader would split it, never mid-word."""

    def cell(match: re.Match[str]) -> str:
        inner = _CODE.sub(lambda code: code.group(1) + _breakable(code.group(2)) + code.group(3), match.group(2))
        return match.group(1) + inner + match.group(3)

    return _CELL.sub(cell, html)
