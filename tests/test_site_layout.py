"""Every page of the documentation site reads in a browser: nothing runs past its column or is cut off.

The site (mkdocs.yml) is built afresh from the working tree into a temporary directory, then each of its pages
is opened in one headless Chromium (tests/browser.py: the DevTools protocol over a pipe) at 1280 px, a common
laptop width. A script in the page looks, in the text column and in the contents sidebar, for

- an element whose box reaches past the column's edge with no scrollable box around it (a wide table the
  theme cuts off at the page's edge, with no way to reach its last columns), and
- an element whose content is wider than its own box where that box does not scroll (text clipped, or
  spilling over its neighbour),
- a table row taller than 60 % of the window (900 px high): cells that hold whole paragraphs, which belong in
  numbered notes under the table,

and the page as a whole being wider than the window. A table that scrolls sideways inside the column
(docs/stylesheets/extra.css) passes: its box fits, and its content can be reached.

Skipped with the reason where Chromium is not installed (scripts/setup.sh installs Debian's ``chromium`` as
root) or mkdocs is missing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from browser import Browser, find_browser

pytest.importorskip("mkdocs")
pytestmark = pytest.mark.skipif(
    find_browser() is None,
    reason="no Chromium to render the site with: install Debian's chromium (scripts/setup.sh does, as root)",
)

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 1280  # px: a laptop's window; the site must also hold at wider ones, where tables only get more room
HEIGHT = 900  # px
TALLEST_ROW = 0.6  # of the window's height: a taller table row holds paragraphs that belong in a note
STYLESHEET = ROOT / "docs" / "stylesheets" / "extra.css"

#: Run in a page: one line per problem, naming the element, its text, the heading above it and the measure.
OVERFLOW_CHECK = r"""
(() => {
  const TALLEST_ROW = @TALLEST_ROW@;
  const columns = [...document.querySelectorAll('[role="main"], .bs-sidebar')];
  const headings = [...document.querySelectorAll('h1, h2, h3, h4, h5, h6')];
  const headingAbove = (el) => {
    const above = headings.filter((h) => h.compareDocumentPosition(el) & Node.DOCUMENT_POSITION_FOLLOWING);
    return above.length ? above[above.length - 1].textContent.replace('¶', '').trim() : '(top)';
  };
  const describe = (el) => {
    const text = (el.innerText || el.textContent || '').trim().replace(/\s+/g, ' ').slice(0, 60);
    return `<${el.tagName.toLowerCase()}> "${text}" under "${headingAbove(el)}"`;
  };
  const scrolls = (el) => ['auto', 'scroll'].includes(getComputedStyle(el).overflowX);
  const insideScrollingBox = (el, column) => {
    for (let box = el.parentElement; box && box !== column.parentElement; box = box.parentElement) {
      if (scrolls(box)) return true;
    }
    return false;
  };
  const problems = [];
  for (const column of columns) {
    const edge = column.getBoundingClientRect();
    const reported = [];
    for (const el of column.querySelectorAll('*')) {
      if (reported.some((outer) => outer.contains(el))) continue;
      const box = el.getBoundingClientRect();
      if (box.width === 0 || box.height === 0 || getComputedStyle(el).visibility === 'hidden') continue;
      const past = box.right > edge.right + 1 || box.left < edge.left - 1;
      const spills = el.clientWidth > 0 && el.scrollWidth > el.clientWidth + 1 && !scrolls(el);
      if ((past || spills) && !insideScrollingBox(el, column)) {
        reported.push(el);
        problems.push(past
          ? `${describe(el)}: its right edge at ${Math.round(box.right)} px, the column's at ${Math.round(edge.right)} px`
          : `${describe(el)}: content ${el.scrollWidth} px wide in a box of ${el.clientWidth} px that does not scroll`);
      }
    }
  }
  // a table row taller than most of the window: cells that hold whole paragraphs (their place is a note under the
  // table, which the cell names)
  for (const row of document.querySelectorAll('[role="main"] tr')) {
    const height = row.getBoundingClientRect().height;
    if (height > TALLEST_ROW * innerHeight) {
      problems.push(`${describe(row)}: a table row ${Math.round(height)} px tall in a ${innerHeight} px window`);
    }
  }
  const page = document.documentElement;
  if (page.scrollWidth > innerWidth + 1) problems.push(`the page is ${page.scrollWidth} px wide in a ${innerWidth} px window`);
  return problems;
})()
""".replace("@TALLEST_ROW@", repr(TALLEST_ROW))


def overflows(browser: Browser, page: Path) -> list[str]:
    browser.open(page)
    return browser.evaluate(OVERFLOW_CHECK)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built from the working tree (what ``bash scripts/docs.sh`` builds into site/)."""
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    return out


def test_no_page_of_the_site_runs_past_its_column_or_is_cut_off(site: Path) -> None:
    pages = sorted(p for p in site.rglob("*.html") if "search" not in p.relative_to(site).parts)
    assert len(pages) >= 20, f"the site has only {len(pages)} pages: {pages}"  # the guides and the reference
    found: dict[str, list[str]] = {}
    with Browser(width=WIDTH, height=HEIGHT) as browser:
        for page in pages:
            found[page.relative_to(site).as_posix()] = overflows(browser, page)
    print("\n".join(f"{name}: {len(problems)}" for name, problems in found.items()))  # the count per page
    bad = {name: problems for name, problems in found.items() if problems}
    assert not bad, f"at {WIDTH} px:\n" + "\n".join(
        f"{name}:\n  " + "\n  ".join(problems) for name, problems in bad.items()
    )


def _page(tmp_path: Path, table_cell: str, stylesheet: Path | None = None) -> Path:
    """A page laid out as the theme lays out its text column (600 px, the page clips what runs past it),
    holding one paragraph and one table of three columns."""
    link = f'<link rel="stylesheet" href="{stylesheet.as_uri()}">' if stylesheet else ""
    page = tmp_path / f"page{len(list(tmp_path.iterdir()))}.html"
    page.write_text(
        f"""<!doctype html><html><head>{link}</head><body style="overflow-x: hidden; margin: 0">
        <div role="main" style="width: 600px"><h2>Strategies</h2><p>A short paragraph.</p>
        <table><tr><td>tf.distribute.get_strategy()</td><td>ds.get_strategy()</td><td>{table_cell}</td></tr></table>
        </div></body></html>"""
    )
    return page


def test_the_check_finds_a_table_the_page_cuts_off_and_passes_it_once_it_scrolls(tmp_path: Path) -> None:
    wide = '<code style="white-space: nowrap">' + "every_local_gpu_else_the_cpu_" * 30 + "</code>"
    with Browser(width=WIDTH, height=HEIGHT) as browser:
        assert overflows(browser, _page(tmp_path, "every local GPU, else the CPU")) == []
        cut_off = overflows(browser, _page(tmp_path, wide))
        assert len(cut_off) == 2, cut_off  # the table, and the page wider than the window
        assert cut_off[0].startswith('<table> "tf.distribute.get_strategy()') and 'under "Strategies"' in cut_off[0]
        assert "the column's at 600 px" in cut_off[0] and "px wide in a 1280 px window" in cut_off[1]
        # the site's stylesheet: the same table scrolls inside the column
        assert overflows(browser, _page(tmp_path, wide, STYLESHEET)) == []


def test_the_check_finds_text_clipped_by_a_box_that_does_not_scroll(tmp_path: Path) -> None:
    clipped = '<div style="width: 100px; overflow: hidden; white-space: nowrap">a line far wider than its box</div>'
    with Browser(width=WIDTH, height=HEIGHT) as browser:
        problems = overflows(browser, _page(tmp_path, clipped))
    assert len(problems) == 1 and "in a box of 100 px that does not scroll" in problems[0], problems


def test_the_check_finds_a_table_row_that_holds_a_paragraph(tmp_path: Path) -> None:
    paragraph = "A reason that belongs in a note under the table, not in its cell. " * 40
    with Browser(width=WIDTH, height=HEIGHT) as browser:
        problems = overflows(browser, _page(tmp_path, paragraph, STYLESHEET))
    assert len(problems) == 1 and "a table row" in problems[0] and "in a 900 px window" in problems[0], problems
