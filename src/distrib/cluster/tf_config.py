"""``TFConfigClusterResolver``: the cluster described by the ``TF_CONFIG`` variable, as in TF."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

from distrib.cluster.resolver import ClusterResolver
from distrib.cluster.spec import TASK_TYPES, ClusterSpec, parse_address

__all__ = ["TFConfigClusterResolver", "TFConfigError", "parse_tf_config"]


class TFConfigError(ValueError):
    """``TF_CONFIG`` is malformed; the message names the field at fault."""


def parse_tf_config(text: str) -> tuple[ClusterSpec, Optional[str], Optional[int], Optional[str]]:
    """Validate a ``TF_CONFIG`` string; return ``(cluster_spec, task_type, task_id, rpc_layer)``."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise TFConfigError(f"TF_CONFIG is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): {text[:200]!r}") from None
    if not isinstance(config, Mapping):
        raise TFConfigError(f"TF_CONFIG must be a JSON object with 'cluster' and 'task', got {type(config).__name__}")
    unknown = set(config) - {"cluster", "task", "rpc_layer", "environment"}
    if unknown:
        raise TFConfigError(f"TF_CONFIG has unknown field(s) {sorted(unknown)}; expected 'cluster' and 'task'")
    cluster: Any = config.get("cluster", {})
    if not isinstance(cluster, Mapping):
        raise TFConfigError(f"TF_CONFIG field 'cluster' must be an object of task type -> addresses, got {cluster!r}")
    for job in cluster:
        if job not in TASK_TYPES:
            raise TFConfigError(f"TF_CONFIG field 'cluster.{job}': unknown task type {job!r}; use one of {', '.join(TASK_TYPES)}")
    if len(cluster.get("chief", [])) > 1:
        raise TFConfigError(f"TF_CONFIG field 'cluster.chief' lists {len(cluster['chief'])} tasks; a cluster has at most one chief")
    try:
        spec = ClusterSpec(cluster)
    except ValueError as e:
        raise TFConfigError(f"TF_CONFIG field {e}") from None
    seen: dict[tuple[str, int], str] = {}
    for job, tasks in spec.as_dict().items():
        for i, address in enumerate(tasks):
            host, port = parse_address(address, f"cluster.{job}[{i}]")
            key = (host.lower(), port)
            if key in seen:
                raise TFConfigError(
                    f"TF_CONFIG field 'cluster.{job}[{i}]': address {address!r} is also used by {seen[key]}; "
                    "every task needs its own host:port")
            seen[key] = f"cluster.{job}[{i}]"
    task: Any = config.get("task", {})
    if not isinstance(task, Mapping):
        raise TFConfigError(f"TF_CONFIG field 'task' must be an object like {{\"type\": \"worker\", \"index\": 0}}, got {task!r}")
    task_type, task_id = task.get("type"), task.get("index", 0)
    if task_type is not None:
        if task_type not in TASK_TYPES:
            raise TFConfigError(f"TF_CONFIG field 'task.type': unknown task type {task_type!r}; use one of {', '.join(TASK_TYPES)}")
        if not spec.num_tasks(task_type):
            raise TFConfigError(f"TF_CONFIG field 'task.type': {task_type!r} has no tasks in 'cluster' (jobs: {', '.join(spec.jobs)})")
        if isinstance(task_id, bool) or not isinstance(task_id, int):
            raise TFConfigError(f"TF_CONFIG field 'task.index' must be an integer, got {task_id!r}")
        if not 0 <= task_id < spec.num_tasks(task_type):
            raise TFConfigError(
                f"TF_CONFIG field 'task.index': {task_id} is out of range; cluster.{task_type} has "
                f"{spec.num_tasks(task_type)} task(s), so the index must be in 0..{spec.num_tasks(task_type) - 1}")
    return spec, task_type, (task_id if task_type is not None else None), config.get("rpc_layer", "grpc")


class TFConfigClusterResolver(ClusterResolver):
    """Reads ``TF_CONFIG`` (``{"cluster": {...}, "task": {"type": ..., "index": ...}}``).

    Example::

        >>> os.environ["TF_CONFIG"] = '{"cluster": {"worker": ["localhost:12345", "localhost:23456"]}, "task": {"type": "worker", "index": 0}}'
        >>> r = TFConfigClusterResolver()
        >>> r.task_type, r.task_id, r.is_chief
        ('worker', 0, True)
    """

    def __init__(self, task_type: Optional[str] = None, task_id: Optional[int] = None,
                 environ: Optional[Mapping[str, str]] = None) -> None:
        env = os.environ if environ is None else environ
        text = env.get("TF_CONFIG", "")
        if text.strip():
            self._spec, t_type, t_id, self.rpc_layer = parse_tf_config(text)
        else:
            self._spec, t_type, t_id = ClusterSpec({}), None, None
        self.task_type = task_type if task_type is not None else t_type
        self.task_id = task_id if task_id is not None else t_id

    @staticmethod
    def detect(environ: Optional[Mapping[str, str]] = None) -> bool:
        return bool((os.environ if environ is None else environ).get("TF_CONFIG", "").strip())

    def cluster_spec(self) -> ClusterSpec:
        return self._spec
