"""scripts/docs_griffe.py (the griffe extension mkdocs.yml loads) renders the docstrings' reST idioms as
Markdown code on the site: roles (``:class:`X```) as inline code, literal blocks (``Example::``) as fenced
code blocks, and leaves fenced blocks and ordinary text alone."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("griffe")

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("docs_griffe", ROOT / "scripts" / "docs_griffe.py")
assert _spec is not None and _spec.loader is not None
docs_griffe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs_griffe)
render = docs_griffe.render_as_markdown


def test_roles_become_inline_code():
    text = ":class:`Strategy`, :meth:`Strategy.run`, :py:func:`f`, :mod:`~distrib.graphs.signature`, :attr:`x <a.b>`"
    assert render(text) == "`Strategy`, `Strategy.run`, `f`, `signature`, `x`"


def test_a_literal_block_becomes_a_fenced_code_block():
    text = textwrap.dedent(
        """\
        Summary.

        Example::

            >>> 1 + 1
            2

        Use it (it returns)::

            value = f(
                1,
            )

        A table ::

            a  ->  b

        Args:
            x: the thing.
        """
    )
    assert render(text) == textwrap.dedent(
        """\
        Summary.

        Example:

        ```pycon
        >>> 1 + 1
        2
        ```

        Use it (it returns):

        ```python
        value = f(
            1,
        )
        ```

        A table

        ```text
        a  ->  b
        ```

        Args:
            x: the thing."""
    )


def test_a_literal_block_in_a_section_keeps_its_indentation_and_fences_are_left_alone():
    text = "Examples:\n    Run it::\n\n        x = 1\n\n```python\ny = 2  # ::\n```\nnot a block::\nnext"
    assert render(text) == (
        "Examples:\n    Run it:\n\n    ```python\n    x = 1\n    ```\n\n```python\ny = 2  # ::\n```\n"
        "not a block::\nnext"
    )
