#!/usr/bin/env bash
# Builds the documentation site (mkdocs.yml: README.md, docs/*.md and the API reference that mkdocstrings renders
# from the docstrings) into site/, with every warning an error (a broken link, an unknown cross-reference, a
# docstring that documents a parameter the signature lacks), and prints how many pages it has. The README's
# test command (scripts/test.sh) runs it; open site/index.html to read the result. tests/test_site_layout.py
# builds the site again and renders every page in headless Chromium, failing where something runs past its column.
#
#   bash scripts/docs.sh
#
# It runs in the project's environment (scripts/setup.sh installs mkdocs with the test extra); the `docs` extra
# of pyproject.toml installs the same tools alone.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
python3 -m mkdocs build --strict 2>&1 | { grep -v "^INFO" || true; }
echo "docs: $(find site -name '*.html' ! -name '404.html' ! -path 'site/search/*' | wc -l) pages in site/"
