"""``TFConfigClusterResolver``: the cluster described by the ``TF_CONFIG`` variable, as in TF.

``TF_CONFIG`` is checked completely when the resolver is made, so that a mistake is a
``TFConfigError`` naming the field at fault in every process, at once, instead of a
rendezvous that waits for a task that will never come: unknown or misspelt keys
(``"idx"``), duplicate keys, unknown task types, malformed addresses (a space in a host,
an empty host, a port out of range), bad sparse indices (``{"-1": ...}``, ``{"a": ...}``,
``{"1": ..., "01": ...}``), two tasks on one address, an index out of range.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from distrib.cluster.resolver import ClusterResolver, format_master_url
from distrib.cluster.spec import TASK_TYPES, ClusterSpec, parse_address, parse_task_index

__all__ = ["TFConfig", "TFConfigClusterResolver", "TFConfigError", "parse_tf_config"]

#: Top-level keys: TF's own, and ``job`` that Google Cloud's training services add (ignored).
_TOP_KEYS = ("cluster", "task", "rpc_layer", "session_master", "environment", "job")
#: Task keys: TF's own, and ``trial``/``cloud`` that Google Cloud's training services add (ignored).
_TASK_KEYS = ("type", "index", "trial", "cloud")
_EXAMPLE = '{"cluster": {"worker": ["host0:2222", "host1:2222"]}, "task": {"type": "worker", "index": 0}}'


class TFConfigError(ValueError):
    """``TF_CONFIG`` is malformed; the message names the field at fault and what to write instead.

    A ``ValueError``, so ``except ValueError`` catches it too.

    Example::

        >>> try:
        ...     TFConfigClusterResolver(environ={"TF_CONFIG": '{"cluster": {"worker": ["w 0:2222"]}}'})
        ... except TFConfigError as e:
        ...     print(str(e)[:73])
        TF_CONFIG field 'cluster.worker[0]': the host 'w 0' has invalid character
    """


class _Object(dict[str, Any]):
    """A JSON object that remembers the keys it was given more than once."""

    duplicates: list[str]


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object(pairs)
    obj.duplicates = [key for i, (key, _) in enumerate(pairs) if key in (k for k, _ in pairs[:i])]
    return obj


def _no_constant(name: str) -> Any:
    raise TFConfigError(f"TF_CONFIG is not valid JSON: {name} is not a JSON value")


def _hint(key: str, known: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.5) if isinstance(key, str) else []
    return f"; did you mean {close[0]!r}?" if close else f"; expected one of {', '.join(map(repr, known))}"


def _check_object(value: Any, field: str, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TFConfigError(f"TF_CONFIG field '{field}' must be an object {what}, got {value!r}")
    for key in getattr(value, "duplicates", ()):
        raise TFConfigError(f"TF_CONFIG field '{field}' has the key {key!r} twice; give each key once")
    return value


@dataclass(frozen=True)
class TFConfig:
    """A validated ``TF_CONFIG``."""

    cluster_spec: ClusterSpec
    task_type: str | None
    task_id: int | None
    rpc_layer: str | None
    session_master: str | None
    environment: str | None


def parse_tf_config(text: str) -> TFConfig:
    """Validate a ``TF_CONFIG`` string; a ``TFConfigError`` names the first field at fault.

    Example::

        >>> config = parse_tf_config('{"cluster": {"worker": {"0": "w0:2222", "3": "w3:2222"}}, '
        ...                          '"task": {"type": "worker", "index": "3"}}')
        >>> config.cluster_spec.task_indices("worker"), config.task_type, config.task_id
        ([0, 3], 'worker', 3)
        >>> parse_tf_config('{"cluster": {"worker": ["w0:2222"]}, "task": {"type": "worker", "idx": 0}}')
        Traceback (most recent call last):
        ...
        distrib.cluster.tf_config.TFConfigError: TF_CONFIG field 'task.idx' is not a known key; did you mean 'index'?
    """
    try:
        config = json.loads(text, object_pairs_hook=_object, parse_constant=_no_constant)
    except TFConfigError:
        raise
    except json.JSONDecodeError as e:
        raise TFConfigError(
            f"TF_CONFIG is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): "
            f"{text[:200]!r}; expected e.g. {_EXAMPLE}"
        ) from None
    except (ValueError, RecursionError) as e:
        raise TFConfigError(f"TF_CONFIG is not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(config, Mapping):
        raise TFConfigError(f"TF_CONFIG must be a JSON object like {_EXAMPLE}, got {text[:200]!r}")
    for key in getattr(config, "duplicates", ()):
        raise TFConfigError(f"TF_CONFIG has the key {key!r} twice; give each key once")
    for key in config:
        if key not in _TOP_KEYS:
            raise TFConfigError(f"TF_CONFIG field {key!r} is not a known key{_hint(key, _TOP_KEYS)}")
    spec = _parse_cluster(config.get("cluster", {}))
    task_type, task_id = _parse_task(config.get("task", {}), spec)
    strings = {}
    for key in ("rpc_layer", "session_master", "environment"):
        value = config.get(key)
        if value is not None and not isinstance(value, str):
            raise TFConfigError(f"TF_CONFIG field '{key}' must be a string, got {value!r}")
        strings[key] = value
    return TFConfig(spec, task_type, task_id, strings["rpc_layer"], strings["session_master"], strings["environment"])


def _parse_cluster(cluster: Any) -> ClusterSpec:
    cluster = _check_object(cluster, "cluster", "of task type -> list of 'host:port' addresses")
    seen: dict[tuple[str, int], str] = {}
    for job, tasks in cluster.items():
        if job not in TASK_TYPES:
            raise TFConfigError(f"TF_CONFIG field 'cluster.{job}': unknown task type {job!r}{_hint(job, TASK_TYPES)}")
        if isinstance(tasks, Mapping):
            _check_object(tasks, f"cluster.{job}", "{index: address}")
            items: list[tuple[int, Any]] = []
            for key, address in tasks.items():
                if not isinstance(key, str) or not key.isascii() or not key.isdigit():
                    raise TFConfigError(
                        f"TF_CONFIG field 'cluster.{job}': the task index {key!r} is not a "
                        'non-negative integer; a sparse job is {"0": "host:port", "3": ...}'
                    )
                index = _wrap(parse_task_index, key, f"cluster.{job}")
                if index in dict(items):
                    raise TFConfigError(
                        f"TF_CONFIG field 'cluster.{job}': the task index {index} is given twice "
                        f"(as {key!r} and another spelling); give each index once"
                    )
                items.append((index, address))
        elif isinstance(tasks, list):
            items = list(enumerate(tasks))
        else:
            raise TFConfigError(
                f"TF_CONFIG field 'cluster.{job}' must be a list of 'host:port' addresses "
                f"(or an object {{index: address}}), got {tasks!r}"
            )
        if job in ("chief", "evaluator") and len(items) > 1:
            raise TFConfigError(
                f"TF_CONFIG field 'cluster.{job}' lists {len(items)} tasks; a cluster has at most one {job}"
            )
        for index, address in items:
            host, port = _wrap(parse_address, address, f"cluster.{job}[{index}]")
            key = (host.lower(), port)
            if key in seen:
                raise TFConfigError(
                    f"TF_CONFIG field 'cluster.{job}[{index}]': the address {address!r} is also used by "
                    f"{seen[key]}; every task needs its own host:port"
                )
            seen[key] = f"cluster.{job}[{index}]"
    try:
        return ClusterSpec(cluster)
    except (TypeError, ValueError) as e:
        raise TFConfigError(f"TF_CONFIG field {e}") from None


def _parse_task(task: Any, spec: ClusterSpec) -> tuple[str | None, int | None]:
    task = _check_object(task, "task", 'like {"type": "worker", "index": 0}')
    for key in task:
        if key not in _TASK_KEYS:
            raise TFConfigError(f"TF_CONFIG field 'task.{key}' is not a known key{_hint(key, _TASK_KEYS)}")
    task_type = task.get("type")
    if task_type is None:
        if task.get("index") is not None:
            raise TFConfigError(
                "TF_CONFIG field 'task.type' is missing while 'task.index' is given; "
                'write e.g. "task": {"type": "worker", "index": 0}'
            )
        return None, None
    if not isinstance(task_type, (str, int)) or isinstance(task_type, bool):
        raise TFConfigError(f"TF_CONFIG field 'task.type' must be a task type string, got {task_type!r}")
    task_type = str(task_type)  # TF casts the type to a string
    if task_type not in TASK_TYPES:
        raise TFConfigError(
            f"TF_CONFIG field 'task.type': unknown task type {task_type!r}{_hint(task_type, TASK_TYPES)}"
        )
    in_cluster = task_type in spec.jobs and spec.num_tasks(task_type) > 0
    if not in_cluster and task_type != "evaluator":  # TF runs an evaluator outside the cluster
        raise TFConfigError(
            f"TF_CONFIG field 'task.type': {task_type!r} has no tasks in 'cluster' "
            f"(jobs: {', '.join(spec.jobs) or 'none'})"
        )
    if "index" not in task or task["index"] is None:
        raise TFConfigError(
            f'TF_CONFIG field \'task.index\' is missing; write e.g. "task": {{"type": {task_type!r}, "index": 0}}'
        )
    task_id = _wrap(parse_task_index, task["index"], "TF_CONFIG field 'task.index'")
    if in_cluster and task_id not in spec.task_indices(task_type):
        indices = spec.task_indices(task_type)
        dense = indices == list(range(len(indices)))
        allowed = f"0..{len(indices) - 1}" if dense else ", ".join(map(str, indices))
        raise TFConfigError(
            f"TF_CONFIG field 'task.index': {task_id} is out of range; cluster.{task_type} has "
            f"{len(indices)} task(s), so the index must be one of {allowed}"
        )
    return task_type, task_id


def _wrap(parse: Any, value: Any, where: str) -> Any:
    """``parse(value, where)``, its ValueError (``"where: why"``) raised as ``TFConfigError`` naming the field."""
    try:
        return parse(value, where)
    except ValueError as e:
        message = str(e)
        if not message.startswith("TF_CONFIG"):
            message = (
                f"TF_CONFIG field '{where}'{message[len(where) :]}"
                if message.startswith(where)
                else f"TF_CONFIG field {message}"
            )
        raise TFConfigError(message) from None


class TFConfigClusterResolver(ClusterResolver):
    """Reads ``TF_CONFIG`` (``{"cluster": {...}, "task": {"type": ..., "index": ...}}``), as TF.

    ``master()`` is TF's (this task's address prefixed ``rpc_layer://``, or ``session_master``, or ``""``
    for a one-task cluster); ``rendezvous_address()`` is where workers meet. ``TF_CONFIG`` is read and
    checked once, here; without it (or blank) the cluster is empty: one process.

    Args:
        task_type: this task's type (``"worker"``, ``"chief"``, ``"ps"``, ...); None: ``TF_CONFIG``'s.
        task_id: this task's index in its job; None: ``TF_CONFIG``'s.
        rpc_layer: the protocol ``master()`` prefixes (``"grpc"``); None: ``TF_CONFIG``'s.
        environment: TF's environment name (``"google"``), kept for ``environment``; nothing reads it.
        environ: the variables to read ``TF_CONFIG`` from (distrib's); None: ``os.environ``.

    Raises:
        TFConfigError: ``TF_CONFIG`` is malformed (a ``ValueError``; the message names the field at fault).
        ValueError: ``task_type`` / ``task_id`` name a task the cluster does not have.

    Example::

        >>> env = {"TF_CONFIG": '{"cluster": {"worker": ["localhost:12345", "localhost:23456"]}, '
        ...                     '"task": {"type": "worker", "index": "1"}, "rpc_layer": "grpc"}'}
        >>> r = TFConfigClusterResolver(environ=env)
        >>> r.task_type, r.task_id, r.is_chief, r.master(), r.rendezvous_address()
        ('worker', 1, False, 'grpc://localhost:23456', 'localhost:12345')
    """

    def __init__(
        self,
        task_type: str | None = None,
        task_id: int | str | None = None,
        rpc_layer: str | None = None,
        environment: str | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        text = env.get("TF_CONFIG", "")
        config = parse_tf_config(text) if text.strip() else TFConfig(ClusterSpec({}), None, None, None, None, None)
        self._spec = config.cluster_spec
        self._session_master = config.session_master
        self.task_type = task_type if task_type is not None else config.task_type
        self.task_id = task_id if task_id is not None else config.task_id
        self._rpc_layer = rpc_layer if rpc_layer is not None else config.rpc_layer
        self._environment = environment
        if (task_type is not None or task_id is not None) and self.task_type not in (None, "evaluator"):
            if self.task_type not in self._spec.jobs or self.task_id not in self._spec.task_indices(self.task_type):
                raise ValueError(
                    f"TFConfigClusterResolver(task_type={task_type!r}, task_id={task_id!r}): task "
                    f"{self.task_type} {self.task_id} is not in the cluster {self._spec!r}"
                )

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> TFConfigClusterResolver:
        """This resolver read from ``environ``, as ``resolve()`` builds it.

        Args:
            environ: the variables to read; None: ``os.environ``.

        Returns:
            ``TFConfigClusterResolver(environ=environ)``.

        Raises:
            TFConfigError: ``TF_CONFIG`` is malformed.
        """
        return cls(environ=environ)

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> bool:
        """Whether ``environ`` describes a cluster with ``TF_CONFIG`` (how ``resolve()`` picks this resolver).

        Args:
            environ: the variables to look at; None: ``os.environ``.

        Returns:
            True when ``TF_CONFIG`` is set and not blank (whether or not it is valid).
        """
        return bool((os.environ if environ is None else environ).get("TF_CONFIG", "").strip())

    def cluster_spec(self) -> ClusterSpec:
        return self._spec

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        """TF's session master: the address a TF client would connect to.

        Args:
            task_type: the task whose address to give; None: this task's.
            task_id: its index; None: this task's.
            rpc_layer: the protocol to prefix; None: this resolver's ``rpc_layer``.

        Returns:
            ``session_master`` if ``TF_CONFIG`` has one; ``""`` for a cluster of at most one task; else the
            task's address, prefixed ``rpc_layer://`` when there is an rpc layer.

        Raises:
            ValueError: neither the arguments nor ``TF_CONFIG`` name a task.
        """
        if self._session_master is not None:
            return self._session_master
        spec = self._spec
        if not spec.jobs or (len(spec.jobs) == 1 and len(spec.job_tasks(spec.jobs[0])) == 1):
            return ""
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        if task_type is None or task_id is None:
            raise ValueError(
                "master(): TF_CONFIG names no task for this process and none was given; "
                'pass master(task_type, task_id) or add "task" to TF_CONFIG'
            )
        return format_master_url(
            spec.task_address(task_type, task_id), rpc_layer if rpc_layer is not None else self.rpc_layer
        )

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: object = None
    ) -> dict[str, int]:
        """This machine's GPUs (see ``ClusterResolver.num_accelerators``).

        Args:
            task_type: accepted for TF's signature, ignored (default: this task's).
            task_id: accepted for TF's signature, ignored (default: this task's).
            config_proto: accepted for TF's signature, ignored.

        Returns:
            ``{"GPU": n}`` with the number of CUDA devices this process sees, ``{}`` when there are none.
        """
        return super().num_accelerators(
            task_type if task_type is not None else self.task_type,
            task_id if task_id is not None else self.task_id,
            config_proto,
        )
