"""mkdocs hook (mkdocs.yml's ``hooks``): the site keeps the repository's layout.

``docs_dir`` is docs/, but its pages are served under ``docs/`` (``docs/sharded.md`` -> ``docs/sharded.html``),
README.md is the home page (``index.md``), and examples/*.py are copied beside them: every relative link of
README.md and docs/*.md (``docs/sharded.md``, ``../examples/mnist.py``, ``security.md``) then resolves on the
site exactly as it does in the repository, with no copy of a page in git and no link rewritten.
"""

from __future__ import annotations

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
