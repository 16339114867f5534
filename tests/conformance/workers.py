"""Running a conformance script on a chief and a worker (TF's ``multi_worker_mirrored_2x1``) and reading
its ``RESULT {json}`` lines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from helpers import launch

TASKS = ("chief", "worker")


def run_worker_checks(script: Path) -> dict[tuple[str, str], Any]:
    """Run ``script`` under ``distrib launch --chief --workers 1``: ``{(check name, task type): value}``."""
    code, out, _ = launch("--chief", "--workers", "1", str(script), timeout=150)
    assert code == 0, out
    assert out.count("DONE") == 2, out
    results: dict[tuple[str, str], Any] = {}
    for line in out.splitlines():
        _, found, payload = line.partition("RESULT ")
        if found:
            record = json.loads(payload)
            results[(record["name"], record["task"])] = record["value"]
    return results


def on_workers(results: dict[tuple[str, str], Any], name: str) -> dict[str, Any]:
    """The value of check ``name`` on each task; a check that raised fails here with its error."""
    values = {task: results[(name, task)] for task in TASKS}
    for task, value in values.items():
        assert not (isinstance(value, dict) and "error" in value), f"{name} on the {task}: {value['error']}"
    return values
