"""The docs keep their promises: every TF name of the seed tutorials is in docs/migration.md,
relative links between the docs lead to files that exist, docs/architecture.md's layer listing
names every module under src/distrib (and none that is gone), and its patch table has a row for
every patch of torch_patches.py's table (the list) and none other."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SEEDS = ROOT.parent / "shared" / "seeds"
TF_NAME = re.compile(r"\btf\.[A-Za-z_][\w.]*[A-Za-z_\d]")


def seed_tf_names() -> set[str]:
    """Every dotted ``tf.`` name in the four tutorials (code and translated prose)."""
    return {m.group(0) for path in sorted(SEEDS.glob("*.txt")) for m in TF_NAME.finditer(path.read_text())}


@pytest.mark.skipif(not SEEDS.is_dir(), reason=f"the seed tutorials are not at {SEEDS}")
def test_every_tf_name_of_the_seed_tutorials_is_in_migration_md():
    names = seed_tf_names()
    assert len(names) > 50, names  # the extraction itself works: the seeds use about 70 names
    migration = (ROOT / "docs" / "migration.md").read_text()
    missing = sorted(n for n in names if n not in migration)
    assert not missing, f"docs/migration.md has no row for {missing}"


@pytest.mark.parametrize("doc", sorted(p.name for p in (ROOT / "docs").glob("*.md")) + ["../README.md"])
def test_relative_links_lead_to_files(doc):
    path = (ROOT / "docs" / doc).resolve()
    text = path.read_text()
    broken = [
        target
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
        if "://" not in target and not target.startswith("mailto:") and not (path.parent / target).exists()
    ]
    assert not broken, f"{doc} links to missing files: {broken}"


# --------------------------------------------------------------------------- docs/architecture.md against the tree

SRC = ROOT / "src" / "distrib"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
ENTRY = re.compile(r"^( {2}| {4})(\S+)(?: +(.*))?$")  # a listing line naming a module or folder (deeper: continued)
MODULE_NAME = re.compile(r"(?<![\w/.])(\w+\.py)\b")


def layer_listing(text: str) -> dict[str, str]:
    """architecture.md's tree under ``src/distrib/``: each entry's path (``strategies/``, ``context.py``) -> its text."""
    block = text.split("```\nsrc/distrib/\n", 1)[1].split("```", 1)[0]
    entries: dict[str, str] = {}
    folder = {2: "", 4: ""}  # the folder an entry of each indentation sits in
    current = ""
    for line in block.splitlines():
        match = ENTRY.match(line)
        if match:
            depth, name = len(match.group(1)), match.group(2)
            current = folder[depth] + name
            if depth == 2 and name.endswith("/"):
                folder[4] = current
            entries[current] = match.group(3) or ""
        elif line.strip():
            entries[current] += " " + line.strip()
    return entries


def named_modules(entries: dict[str, str]) -> set[str]:
    """The module files the listing names: a top-level entry itself, or ``x.py`` in a folder's text."""
    named = set()
    for path, text in entries.items():
        if path.endswith(".py"):
            named.add(path)
        else:
            named |= {path + name for name in MODULE_NAME.findall(text)}
    return named


def test_the_architecture_listing_names_every_module_and_only_modules_that_exist():
    named = named_modules(layer_listing(ARCHITECTURE.read_text()))
    modules = {p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")}
    folders = {m for m in modules if m.endswith("/__init__.py")}  # a folder's __init__: the folder is named
    missing = sorted(modules - folders - named)
    assert not missing, f"docs/architecture.md's layer listing leaves out {missing}"
    stale = sorted(named - modules)
    assert not stale, f"docs/architecture.md's layer listing names modules that do not exist: {stale}"


def test_the_listing_check_sees_a_left_out_module_and_a_stale_one():
    text = ARCHITECTURE.read_text().replace("sharded_objects.py", "sharded_object.py")
    named = named_modules(layer_listing(text))
    assert "checkpoint/sharded_objects.py" not in named and "checkpoint/sharded_object.py" in named
    assert {
        "context.py",
        "strategies/sharded.py",
        "parameter_server/client/dispatch.py",
        "parameter_server/__main__.py",
    } <= named


CODE = re.compile(r"``([^`]+)``|`([^`]+)`")  # reStructuredText's literal or Markdown's


def _code(cell: str) -> list[str]:
    return [rst or md for rst, md in CODE.findall(cell)]


def torch_patches_table() -> set[str]:
    """The code names in the patch column of torch_patches.py's docstring table (the list of patches)."""
    import ast

    doc = ast.get_docstring(ast.parse((SRC / "torch_patches.py").read_text())) or ""
    rules = [line for line in doc.splitlines() if re.fullmatch(r"=+( +=+)+", line)]
    assert len(rules) == 3, "torch_patches.py's docstring has one table: a rule, the header, a rule, rows, a rule"
    width = len(rules[0].split()[0])
    body = doc.split(rules[0] + "\n", 3)[2]  # before, the header, the rows, after
    return {name for line in body.splitlines() for name in _code(line[:width])}


def architecture_patch_table(text: str) -> set[str]:
    """The code names in the patch column of architecture.md's patch table."""
    table = text.split("| patch | applied | removed | why no public hook |", 1)[1].split("\n\n", 1)[0]
    rows = [line.strip() for line in table.splitlines()[2:] if line.strip().startswith("|")]
    return {name for row in rows for name in _code(row.split("|")[1])}


def test_architecture_md_has_a_row_for_every_patch_of_torch_patches_and_none_other():
    source, documented = torch_patches_table(), architecture_patch_table(ARCHITECTURE.read_text())
    assert {"GradScaler.unscale_/step/update", "TorchDispatchMode", "optimizer.load_state_dict"} <= source  # parsed
    assert source == documented, (
        f"torch_patches.py's table (the list of patches) and docs/architecture.md's "
        f"differ: only in torch_patches.py {sorted(source - documented)}, only in "
        f"architecture.md {sorted(documented - source)}"
    )


def test_the_patch_table_check_sees_a_missing_row():
    text = ARCHITECTURE.read_text()
    row = next(line for line in text.splitlines() if line.startswith("  | a dispatch mode"))
    assert "TorchDispatchMode" in architecture_patch_table(text)
    assert "TorchDispatchMode" not in architecture_patch_table(text.replace(row + "\n", ""))
