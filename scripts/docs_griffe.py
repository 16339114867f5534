"""griffe extension (mkdocs.yml's mkdocstrings ``extensions``): the docstrings' reST idioms render as code.

The docstrings are Google style, rendered as Markdown, but many also use two reST idioms that Markdown shows
literally. Before griffe parses a docstring, this rewrites them (on the site only: the code is untouched):

- a role, ``:class:`Strategy```, ``:meth:`run```, ``:mod:`~distrib.graphs.signature``` (``:attr:``,
  ``:func:``, ``:data:``, ``:exc:``, ``:obj:``, with or without ``py:``) becomes the inline code
  `` `Strategy` ``; ``~a.b.C`` shows ``C`` and ``title <target>`` shows ``title``, as Sphinx does;
- a literal block, a paragraph ending in ``::`` followed by an indented block (``Example::``), becomes the
  paragraph ending in ``:`` (``::`` alone, or after a space, is dropped) and a fenced code block: ``python``
  when the block parses as Python, ``pycon`` for a ``>>>`` session, else plain text. The fences sit at the
  ``::`` line's indentation, so that inside a Google section (``Examples:``) they are dedented with its text.

Existing fenced blocks (```` ``` ````) are left as they are.
"""

from __future__ import annotations

import ast
import re
import textwrap
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|attr|func|meth|mod|data|exc|obj|const):`([^`]+)`")
FENCE = re.compile(r"^\s*(```|~~~)")


def _role_text(match: re.Match[str]) -> str:
    target = match.group(1)
    titled = re.fullmatch(r"(.*?)\s*<([^>]+)>", target)
    if titled:
        target = titled.group(1)
    elif target.startswith("~"):
        target = target[1:].rsplit(".", 1)[-1]
    return f"`{target}`"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _language(block: str) -> str:
    if block.lstrip().startswith(">>>"):
        return "pycon"
    try:
        ast.parse(block)
    except SyntaxError:
        return "text"
    return "python"


def literal_blocks(text: str) -> str:
    """Each reST literal block (``para::`` then an indented block) as ``para:`` and a fenced code block."""
    lines = text.splitlines()
    out: list[str] = []
    fenced = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if FENCE.match(line):
            fenced = not fenced
        stripped = line.rstrip()
        if fenced or not stripped.endswith("::"):
            out.append(line)
            i += 1
            continue
        indent = _indent(line)
        start = i + 1
        while start < len(lines) and not lines[start].strip():
            start += 1
        if start == len(lines) or _indent(lines[start]) <= indent:
            out.append(line)  # no indented block follows: not a literal block
            i += 1
            continue
        end = start
        while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > indent):
            end += 1
        while not lines[end - 1].strip():
            end -= 1
        block = textwrap.dedent("\n".join(lines[start:end]))
        head = stripped[:-2]
        if head.strip():
            out.append(head.rstrip() if head.endswith(" ") else head + ":")
            out.append("")
        margin = " " * indent
        out.append(f"{margin}```{_language(block)}")
        out.extend(f"{margin}{code}" if code.strip() else "" for code in block.splitlines())
        out.append(f"{margin}```")
        i = end
    return "\n".join(out)


def render_as_markdown(text: str) -> str:
    return ROLE.sub(_role_text, literal_blocks(text))


class ReSTIdioms(griffe.Extension):
    """Rewrites every docstring griffe loads (module, class, function, attribute) with :func:`render_as_markdown`."""

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any = None, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = render_as_markdown(obj.docstring.value)
