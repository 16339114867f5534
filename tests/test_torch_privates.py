"""No torch or torchmetrics private is read or written outside ``torch_patches.py``.

Scans distrib's source: an attribute whose name is a private (``_x``, not dunder) of a
``GradScaler``, an ``Optimizer``, an ``nn.Module`` or a torchmetrics ``Metric`` (taken from live
objects of this torch), reached through anything but ``self``/``cls``, or any ``torch._x``. Such
reads go through a small function in torch_patches, where ``test_torch_assumptions.py`` pins them.
"""

from __future__ import annotations

import ast
import pathlib

import torch

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "distrib"
PATCH_MODULE = SRC / "torch_patches.py"
#: reads not yet routed, each with the reason it is still there (empty it, do not grow it)
PENDING: dict[tuple[str, str], str] = {}


def _private_names() -> set[str]:
    objects: list[object] = [
        torch.amp.GradScaler("cpu"),
        torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1),
        torch.nn.Linear(1, 1),
        torch.zeros(1),
    ]
    try:
        import torchmetrics

        objects.append(torchmetrics.MeanMetric())
    except ImportError:  # pragma: no cover - torchmetrics is a test extra
        pass
    return {n for o in objects for n in set(dir(o)) | set(vars(o)) if n.startswith("_") and not n.startswith("__")}


#: names distrib binds torch's packages to (``import torch.distributed as dist``)
TORCH_ROOTS = {"torch", "dist", "torchmetrics"}


def _root_name(node: ast.AST) -> str:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else ""


def violations(root: pathlib.Path, names: set[str]) -> list[tuple[str, int, str]]:
    """``(file relative to root, line, expression)`` of every private torch access outside the patch module."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.resolve() == PATCH_MODULE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            on_torch = _root_name(node) in TORCH_ROOTS  # torch._x, torch.nn.modules.loss._Loss, dist.group._x
            on_object = node.attr in names and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            )
            if on_torch or on_object:
                found.append((path.relative_to(root).as_posix(), node.lineno, ast.unparse(node)))
    return found


def test_no_torch_private_outside_the_patch_module() -> None:
    found = [v for v in violations(SRC, _private_names()) if (v[0], v[2].rsplit(".", 1)[-1]) not in PENDING]
    assert found == [], f"route these through distrib/torch_patches.py: {found}"


def test_the_scan_finds_a_planted_violation(tmp_path: pathlib.Path) -> None:
    (tmp_path / "planted.py").write_text(
        "def f(scaler, metric, opt):\n    scaler._scale.fill_(1)\n"
        "    metric._update_count += 1\n    torch._amp_update_scale_()\n"
        "    return self._scale, opt._optimizer_step_code\n"
        "def g(t):\n    torch.autograd.Variable._execution_engine.queue_callback(t)\n"
        "    return t._indices(), dist.group.WORLD._get_backend(t)\n"
    )
    found = violations(tmp_path, _private_names())
    assert sorted(expr for _, _, expr in found) == [
        "dist.group.WORLD._get_backend",
        "metric._update_count",
        "opt._optimizer_step_code",
        "scaler._scale",
        "t._indices",
        "torch._amp_update_scale_",
        "torch.autograd.Variable._execution_engine",
    ], found
