"""Every ```python block of README.md and docs/*.md runs in the test suite, as the reader would run it.

A block is what a reader copies, so it must run. The HTML comment on the line just before its fence
(invisible on the rendered page) says how; a block without one runs on its own:

- no comment: the block runs alone, in a fresh ``python3`` process whose working directory is an
  empty temporary directory, after the imports every page assumes (:data:`IMPORTS`: ``torch``,
  ``torch.nn.functional as F``, ``distrib as ds``).
- ``<!-- setup: model, optimizer, loader -->``: the block continues a script the page does not show;
  it runs after :data:`SETUP`, which defines every name the comment lists (checked) on a 2-replica
  ``MirroredStrategy`` over the CPU.
- ``<!-- launch: --workers 2 -->``: the block is a whole multi-process script; it runs under
  ``distrib launch`` with those arguments, and every task must succeed.
- ``<!-- tested: tests/PATH.py REASON -->``: another test runs the block and checks more than that it
  runs (the README's quickstart: that it learns); it is not run twice.
- ``<!-- fragment: REASON -->``: the block cannot run here (the reason says why and, where one
  exists, what runs it); it must still compile.

Each block's test id is its file and the line of its fence (``README.md:24``).
"""

from __future__ import annotations

import ast
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import run_bounded

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT = 120  # seconds for one block; each takes a few (most of it importing torch)

IMPORTS = "import torch\nimport torch.nn.functional as F\nimport distrib as ds\n"

SETUP = (
    IMPORTS
    + """
from torch.utils.data import DataLoader, TensorDataset

strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])  # 2 replicas: the docs' code meets a real split
GLOBAL_BATCH = 32
torch.manual_seed(0)
_x = torch.randn(256, 20)
_y = _x[:, :4].argmax(dim=1)
loader = DataLoader(TensorDataset(_x[:192], _y[:192]), batch_size=GLOBAL_BATCH)
test_loader = DataLoader(TensorDataset(_x[192:], _y[192:]), batch_size=GLOBAL_BATCH)
batches, test_batches, data = loader, test_loader, loader


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


with strategy.scope():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
logits, labels = model(_x[:8]), _y[:8]
"""
)

FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
MARK = re.compile(r"^<!--\s*(fragment|setup|launch|tested):(.*?)-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    code: str
    kind: str  # "run", "fragment", "setup" or "launch"
    note: str  # the marker's text: the reason, the names, or the launch arguments

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    """Every ```python block of the docs, with the marker on the line before its fence."""
    found = []
    for path in DOCS:
        text = path.read_text()
        lines = text.splitlines()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            marker = MARK.match(lines[line - 2]) if line >= 2 else None
            kind, note = (marker.group(1), marker.group(2).strip()) if marker else ("run", "")
            found.append(Block(path, line, match.group(1), kind, note))
    return found


BLOCKS = blocks()


def block_env() -> dict[str, str]:
    """This environment with ``src`` importable and no cluster variables: a block that finds no cluster
    runs as one process (and ``distrib launch`` sets its own), whatever ran the tests."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key
        not in ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    return env


def run_script(code: str, cwd: Path, *launch_args: str) -> None:
    """Run ``code`` as ``cwd/block.py`` with ``python3`` (or under ``distrib launch LAUNCH_ARGS``); it must exit 0."""
    (cwd / "block.py").write_text(code)
    command = [sys.executable, "-m", "distrib.app.cli", "launch", *launch_args] if launch_args else [sys.executable]
    returncode, out, _ = run_bounded([*command, "block.py"], timeout=TIMEOUT, cwd=cwd, env=block_env())
    assert returncode == 0, out


def setup_names() -> set[str]:
    """The names :data:`SETUP` binds at its top level (assignments, imports, functions)."""
    names: set[str] = set()
    for node in ast.parse(SETUP).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
        else:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    names.add(sub.id)
    return names


def test_the_docs_have_python_blocks_and_every_marker_is_known():
    assert len(BLOCKS) >= 9, [b.id for b in BLOCKS]  # the collection itself works
    for path in DOCS:  # a misspelt marker would silently make a block "run alone" or be ignored
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"^<!--\s*(fragment|setup|launch|tested|skip|norun|no-run)\b", line):
                assert MARK.match(line), f"{path.name}:{number}: malformed marker {line!r}"


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_block_runs(block: Block, tmp_path: Path):
    compile(block.code, block.id, "exec")  # every block is valid Python, fragments included
    if block.kind == "fragment":
        assert len(block.note) >= 10, f"{block.id}: a fragment says why it cannot run"
    elif block.kind == "tested":
        path = ROOT / block.note.split()[0]
        assert path.is_file() and "```python" in path.read_text(), f"{block.id}: {path} does not run doc blocks"
    elif block.kind == "run":
        run_script(IMPORTS + block.code, tmp_path)
    elif block.kind == "setup":
        wanted = {n.strip() for n in block.note.split(",") if n.strip()}
        assert wanted, f"{block.id}: <!-- setup: ... --> lists the names the block takes from SETUP"
        assert wanted <= setup_names(), f"SETUP does not define {sorted(wanted - setup_names())}"
        run_script(SETUP + "\n" + block.code, tmp_path)
    else:
        run_script(IMPORTS + block.code, tmp_path, *block.note.split())
