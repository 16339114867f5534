"""The docs keep their promises: every TF name of the seed tutorials is in docs/migration.md, and
relative links between the docs lead to files that exist."""

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
    broken = [target for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
              if "://" not in target and not target.startswith("mailto:") and not (path.parent / target).exists()]
    assert not broken, f"{doc} links to missing files: {broken}"
