"""The rules docs/architecture.md states about the tree, checked on the source.

* No module reads another object's private member (``x._name``, ``from m import _name``) unless
  the name belongs to its own folder: a folder's objects may see each other's privates, the rest
  of distrib uses public, typed members. (torch's privates have their own rule:
  tests/test_torch_privates.py.)
* Nothing outside ``strategies/`` branches on a strategy's class (``isinstance``, ``issubclass``,
  ``type(x) is``, ``type(x).__name__ == "..."``); the loop, checkpoints and the app ask a
  strategy's public members instead. Inside ``strategies/``, no strategy branches on a resolver's
  class either (``resolver.spans_hosts`` and the like say what a strategy needs).

Each scan is shown catching a planted violation, so a scan that stopped seeing would fail.
"""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "distrib"
#: underscore names that are public API of the standard library or of namedtuples
PUBLIC_UNDERSCORE = {"_exit", "_getframe", "_replace", "_asdict", "_fields", "_make"}


def _defined_privates(root: pathlib.Path) -> dict[pathlib.Path, set[str]]:
    """Per folder: the private names its modules define (methods, classes, functions, attributes, globals)."""
    defined: dict[pathlib.Path, set[str]] = defaultdict(set)
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = None
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = node.name
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                name = node.attr
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                name = node.id
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Attribute):
                name = node.target.attr
            if name and name.startswith("_") and not name.startswith("__"):
                defined[path.parent].add(name)
    return defined


def private_reads(root: pathlib.Path, package: str = "distrib") -> list[tuple[str, int, str]]:
    """``(file, line, expression)`` of every read of a private name that the reading file's folder does not define."""
    defined = _defined_privates(root)
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "torch_patches.py":
            continue  # the one module that reads torch's privates (tests/test_torch_privates.py)
        mine = defined[path.parent]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                    continue
                if node.attr in mine or node.attr in PUBLIC_UNDERSCORE:
                    continue
                found.append((path.relative_to(root).as_posix(), node.lineno, ast.unparse(node)))
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == package:
                target = root.parent.joinpath(*node.module.split("."))
                folder = target if target.is_dir() else target.parent
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__") and folder != path.parent:
                        found.append(
                            (path.relative_to(root).as_posix(), node.lineno, f"from {node.module} import {alias.name}")
                        )
    return found


def _strategy_classes(root: pathlib.Path) -> set[str]:
    """The names of every strategy class distrib defines (subclasses of Strategy, transitively)."""
    bases: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
    found = {"Strategy"}
    while True:
        more = {name for name, parents in bases.items() if parents & found} - found
        if not more:
            return found
        found |= more


def _resolver_classes(root: pathlib.Path) -> set[str]:
    names = {"ClusterResolver"}
    for path in (root / "cluster").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and node.name.endswith("ClusterResolver"):
                names.add(node.name)
    return names


def _class_tests(tree: ast.AST, classes: set[str]) -> list[ast.AST]:
    """isinstance/issubclass against one of ``classes``; ``type(x) is C``; ``type(x).__name__ == "C"``."""
    hits: list[ast.AST] = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("isinstance", "issubclass")
            and len(node.args) == 2
        ):
            named = [n for n in ast.walk(node.args[1]) if isinstance(n, (ast.Name, ast.Attribute))]
            if any((n.id if isinstance(n, ast.Name) else n.attr) in classes for n in named):
                hits.append(node)
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            is_type = any(
                isinstance(s, ast.Call) and isinstance(s.func, ast.Name) and s.func.id == "type" for s in sides
            )
            names_class = any(isinstance(s, ast.Name) and s.id in classes for s in sides)
            type_name = any(isinstance(s, ast.Attribute) and s.attr == "__name__" for s in sides)
            names_string = any(isinstance(s, ast.Constant) and s.value in classes for s in sides) or any(
                isinstance(s, (ast.Tuple, ast.List, ast.Set))
                and any(isinstance(e, ast.Constant) and e.value in classes for e in s.elts)
                for s in sides
            )
            if (is_type and names_class) or (type_name and names_string):
                hits.append(node)
    return hits


def class_branching(root: pathlib.Path) -> list[tuple[str, int, str]]:
    """Branches on a strategy's class outside ``strategies/``, and on a resolver's class inside it."""
    strategies, resolvers = _strategy_classes(root), _resolver_classes(root)
    found = []
    for path in sorted(root.rglob("*.py")):
        inside = path.parent.name == "strategies"
        for node in _class_tests(ast.parse(path.read_text(), str(path)), resolvers if inside else strategies):
            found.append((path.relative_to(root).as_posix(), node.lineno, ast.unparse(node)))
    return found


def test_no_private_member_is_read_outside_its_folder() -> None:
    assert private_reads(SRC) == []


def test_the_private_scan_finds_planted_reads(tmp_path: pathlib.Path) -> None:
    (tmp_path / "distrib" / "strategies").mkdir(parents=True)
    (tmp_path / "distrib" / "keras").mkdir()
    (tmp_path / "distrib" / "strategies" / "base.py").write_text(
        "class Strategy:\n    def __init__(self):\n        self._engine = 1\n    def _merge(self):\n        pass\n"
    )
    (tmp_path / "distrib" / "strategies" / "engine.py").write_text(
        "def f(strategy):\n    return strategy._engine  # same folder: allowed\n"
    )
    (tmp_path / "distrib" / "keras" / "loop.py").write_text(
        "from distrib.strategies.base import _helper\n"
        "def fit(strategy):\n    strategy._merge()\n    return strategy._engine, self._own, os._exit\n"
    )
    found = sorted(expr for _, _, expr in private_reads(tmp_path / "distrib"))
    assert found == ["from distrib.strategies.base import _helper", "strategy._engine", "strategy._merge"], found


def test_nothing_outside_strategies_branches_on_a_strategy_class() -> None:
    assert class_branching(SRC) == []


def test_the_class_branching_scan_finds_planted_branches(tmp_path: pathlib.Path) -> None:
    (tmp_path / "strategies").mkdir()
    (tmp_path / "cluster").mkdir()
    (tmp_path / "keras").mkdir()
    (tmp_path / "strategies" / "base.py").write_text("class Strategy:\n    pass\n")
    (tmp_path / "strategies" / "mine.py").write_text(
        "class MineStrategy(Strategy):\n    pass\n"
        "def f(resolver):\n    return isinstance(resolver, TorchrunClusterResolver)\n"
    )
    (tmp_path / "cluster" / "torchrun.py").write_text("class TorchrunClusterResolver:\n    pass\n")
    (tmp_path / "keras" / "loop.py").write_text(
        "def fit(s, data):\n"
        "    if isinstance(s, (ds.MineStrategy, int)):\n        pass\n"
        "    if type(s).__name__ in ('MineStrategy', 'Other'):\n        pass\n"
        "    if type(s) is MineStrategy:\n        pass\n"
        "    if isinstance(data, list) or s.num_workers > 1:  # not a strategy class: fine\n        pass\n"
    )
    found = sorted((file, line) for file, line, _ in class_branching(tmp_path))
    assert found == [("keras/loop.py", 2), ("keras/loop.py", 4), ("keras/loop.py", 6), ("strategies/mine.py", 4)], found
