"""``ClusterSpec``: the tasks of a cluster and their addresses (``tf.train.ClusterSpec``).

A job lists its tasks either densely (``["h0:2222", "h1:2222"]``: task *i* is the *i*-th
address) or sparsely (``{0: "h0:2222", 3: "h3:2222"}``: only some indices, kept as given),
exactly as TF allows. Unlike TF, every address is checked when the spec is made: a host
with a space, an empty host or a port out of range is a ``ValueError`` naming the task,
instead of a rendezvous that never completes.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ClusterSpec", "TASK_TYPES", "parse_address", "parse_task_index"]

#: The task types that distrib's strategies know (TF's ``multi_worker_util`` allows the same).
TASK_TYPES = ("chief", "worker", "ps", "evaluator")

_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_PORT = re.compile(r"[0-9]{1,5}")
_DIGITS = re.compile(r"[0-9]{1,9}")
_ZONE = re.compile(r"[A-Za-z0-9_.-]{1,64}")

Tasks = Sequence[str] | Mapping[Any, str]


def _check_host(host: str, where: str, address: str) -> None:
    """Raise ValueError unless ``host`` is a host name, an IPv4 address or a bracketed IPv6 address."""

    def bad(why: str) -> ValueError:
        return ValueError(
            f"{where}: {why} in the address {address!r}; expected 'host:port', e.g. 'worker0.example.com:2222'"
        )

    if host.startswith("["):
        inner, _, zone = host[1:-1].partition("%")
        if not host.endswith("]") or (zone and not _ZONE.fullmatch(zone)):
            raise bad("a malformed IPv6 address (write it as [addr]:port)")
        try:
            ipaddress.IPv6Address(inner)
        except ValueError:
            raise bad(f"{inner!r} is not an IPv6 address") from None
        return
    if not host:
        raise bad("an empty host")
    if ":" in host:
        raise bad("a host with ':' (an IPv6 address needs brackets, '[::1]:2222')")
    bad_chars = sorted({c for c in host if not (c.isascii() and (c.isalnum() or c in "._-"))})
    if bad_chars:
        raise bad(f"the host {host!r} has invalid character(s) {''.join(bad_chars)!r}")
    name = host[:-1] if host.endswith(".") and len(host) > 1 else host
    labels = name.split(".")
    if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise bad(
            f"the host {host!r} is not a valid host name (dot-separated labels of 1-63 letters, digits, "
            "'-' or '_', not starting or ending with '-')"
        )
    if all(label.isdigit() for label in labels):
        try:
            ipaddress.IPv4Address(name)
        except ValueError:
            raise bad(f"{host!r} is not an IPv4 address") from None


def parse_address(address: object, where: str) -> tuple[str, int]:
    """``(host, port)`` of ``"host:port"`` (or ``"[v6]:port"``); ValueError naming ``where`` when malformed.

    Example::

        >>> parse_address("[::1]:2222", "cluster.worker[0]")
        ('::1', 2222)
        >>> parse_address("worker 0:2222", "cluster.worker[0]")
        Traceback (most recent call last):
        ...
        ValueError: cluster.worker[0]: the host 'worker 0' has invalid character(s) ' ' in the address 'worker 0:2222'; expected 'host:port', e.g. 'worker0.example.com:2222'
    """
    if not isinstance(address, str):
        raise ValueError(f"{where}: expected an address 'host:port' (a string), got {address!r}")
    if "://" in address:
        raise ValueError(
            f"{where}: expected 'host:port' without a scheme, got {address!r} "
            "(the protocol goes in TF_CONFIG's 'rpc_layer', not in the address)"
        )
    host, colon, port = address.rpartition(":")
    if not colon:
        raise ValueError(f"{where}: expected an address 'host:port', got {address!r} (the port is missing)")
    if not _PORT.fullmatch(port) or not 0 < int(port) < 65536:
        raise ValueError(f"{where}: expected an address 'host:port' with a port in 1..65535, got {address!r}")
    _check_host(host, where, address)
    return host.strip("[]").partition("%")[0] if host.startswith("[") else host, int(port)


def parse_task_index(value: object, where: str) -> int:
    """A task index as TF casts it (``int(value)``), but only from an int or a string of digits.

    ``"1"`` and ``1.0`` become 1; ``True``, ``-1``, ``"1.5"`` and ``"one"`` are a ValueError naming ``where``.
    """
    if isinstance(value, bool):
        raise ValueError(f"{where}: expected a task index (a non-negative integer), got {value!r}")
    if isinstance(value, int):
        index = value
    elif isinstance(value, float) and value.is_integer():
        index = int(value)
    elif isinstance(value, str) and _DIGITS.fullmatch(value.strip()):
        index = int(value.strip())
    else:
        raise ValueError(f"{where}: expected a task index (a non-negative integer), got {value!r}")
    if not 0 <= index < 10**9:
        raise ValueError(f"{where}: expected a task index (a non-negative integer), got {value!r}")
    return index


class ClusterSpec:
    """Job name -> tasks, each ``"host:port"`` (``tf.train.ClusterSpec``).

    Jobs keep TF's two forms: a list (dense indices 0..n-1) or a dict ``{index: address}``
    (sparse: the indices are kept, ``task_indices`` lists them, ``job_tasks`` has ``None``
    in the holes). Asking for a job that is not in the cluster is a ValueError, as in TF.

    Example::

        >>> spec = ClusterSpec({"worker": ["localhost:12345", "localhost:23456"], "ps": {0: "ps0:2222", 3: "ps3:2222"}})
        >>> spec.num_tasks("worker"), spec.task_address("worker", 1)
        (2, 'localhost:23456')
        >>> spec.task_indices("ps"), spec.job_tasks("ps")
        ([0, 3], ['ps0:2222', None, None, 'ps3:2222'])
        >>> spec
        ClusterSpec({'ps': {0: 'ps0:2222', 3: 'ps3:2222'}, 'worker': ['localhost:12345', 'localhost:23456']})

    Args:
        cluster: job name -> its tasks, a list of ``"host:port"`` (indices 0..n-1) or a dict
            ``{index: "host:port"}`` (a sparse job); another ``ClusterSpec`` (copied); None: an empty cluster.

    Raises:
        TypeError: ``cluster`` is not a mapping, a job name is not a string, or a job's tasks are neither a
            list nor a dict.
        ValueError: an address is not ``"host:port"`` with a port in 1..65535, or a task index is not a
            non-negative integer or is given twice.
    """

    def __init__(self, cluster: Mapping[str, Tasks] | ClusterSpec | None = None) -> None:
        self._cluster_spec: dict[str, dict[int, str]] = {}
        if isinstance(cluster, ClusterSpec):
            self._cluster_spec = {job: dict(tasks) for job, tasks in cluster._cluster_spec.items()}
            return
        if cluster is None:
            return
        if not isinstance(cluster, Mapping):
            raise TypeError(
                f"ClusterSpec(cluster): expected a dict of job name -> list of 'host:port' addresses "
                f"(or -> {{index: address}}), got {type(cluster).__name__}"
            )
        for job, tasks in cluster.items():
            if not isinstance(job, str):
                raise TypeError(f"ClusterSpec(cluster): job name {job!r} must be a string")
            self._cluster_spec[job] = _job_tasks(job, tasks)

    @property
    def jobs(self) -> list[str]:
        """The job names, in the order given."""
        return list(self._cluster_spec)

    def _job(self, job_name: str) -> dict[int, str]:
        try:
            return self._cluster_spec[job_name]
        except (KeyError, TypeError):
            raise ValueError(
                f"No such job in cluster: {job_name!r} (jobs: {', '.join(map(repr, self.jobs)) or 'none'})"
            ) from None

    def num_tasks(self, job_name: str) -> int:
        """How many tasks ``job_name`` lists; ValueError if the cluster has no such job.

        Args:
            job_name: a job of the cluster (``"worker"``).

        Returns:
            The number of tasks the job lists (for a sparse job: the listed ones, not the highest index + 1).

        Raises:
            ValueError: the cluster has no job ``job_name``.
        """
        return len(self._job(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        """The task indices of ``job_name``, sorted (``[0, 3]`` for a sparse job).

        Args:
            job_name: a job of the cluster.

        Returns:
            The job's task indices in ascending order.

        Raises:
            ValueError: the cluster has no job ``job_name``.
        """
        return sorted(self._job(job_name))

    def task_address(self, job_name: str, task_index: int) -> str:
        """The address of one task; ValueError for an unknown job or an index it does not list.

        Args:
            job_name: a job of the cluster.
            task_index: the index of a task the job lists.

        Returns:
            The task's ``"host:port"``.

        Raises:
            ValueError: the cluster has no job ``job_name``, or the job lists no task ``task_index``.
        """
        job = self._job(job_name)
        try:
            return job[task_index]
        except (KeyError, TypeError):
            raise ValueError(
                f"No task with index {task_index!r} in job {job_name!r} (its indices: {sorted(job) or 'none'})"
            ) from None

    def job_tasks(self, job_name: str) -> list[Any]:
        """The addresses of ``job_name`` by index, ``None`` where a sparse job has a hole (as TF).

        Typed ``list[Any]`` (strings, or None in holes) so that code which needs every task
        can first check ``task_indices(job) == list(range(num_tasks(job)))``.

        Args:
            job_name: a job of the cluster.

        Returns:
            A list indexed by task index, up to the highest one: each task's address, None in the holes.

        Raises:
            ValueError: the cluster has no job ``job_name``.
        """
        job = self._job(job_name)
        tasks: list[str | None] = [None] * (max(job) + 1 if job else 0)
        for index, address in job.items():
            tasks[index] = address
        return tasks

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """Job -> a list when its indices are dense, else a dict ``{index: address}`` (an empty job gives ``{}``).

        Returns:
            A new dict, the form ``ClusterSpec(...)`` takes back (and TF's ``as_dict``).
        """
        result: dict[str, list[str] | dict[int, str]] = {}
        for job, tasks in self._cluster_spec.items():
            indices = sorted(tasks)
            if indices and indices[-1] + 1 == len(indices):
                result[job] = [tasks[i] for i in indices]
            else:
                result[job] = {i: tasks[i] for i in indices}
        return result

    def chief(self) -> tuple[str, int]:
        """The chief task: ``("chief", 0)`` if the cluster has a chief, else ``("worker", 0)``.

        Returns:
            ``(job, index)`` of the chief.

        Raises:
            ValueError: the cluster has neither a ``chief`` nor a ``worker`` job.
        """
        for job in ("chief", "worker"):
            if self._cluster_spec.get(job):
                return job, 0
        raise ValueError(f"the cluster has neither a 'chief' nor a 'worker' task: {self!r}")

    def __bool__(self) -> bool:
        return bool(self._cluster_spec)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClusterSpec):
            return NotImplemented
        return self._cluster_spec == other._cluster_spec

    __hash__ = None  # type: ignore[assignment]  # mutable-looking, compared by value, as TF

    def __repr__(self) -> str:
        as_dict = self.as_dict()
        return "ClusterSpec({" + ", ".join(f"{job!r}: {as_dict[job]!r}" for job in sorted(as_dict)) + "})"


def _job_tasks(job: str, tasks: object) -> dict[int, str]:
    """One job's tasks as ``{index: address}``, every index and address checked."""
    if isinstance(tasks, (list, tuple)):
        items = list(enumerate(tasks))
    elif isinstance(tasks, Mapping):
        items = []
        seen: dict[int, object] = {}
        for key in tasks:
            index = parse_task_index(key, f"cluster.{job}: task index {key!r}")
            if index in seen:
                raise ValueError(f"cluster.{job}: task index {index} is given twice (as {seen[index]!r} and {key!r})")
            seen[index] = key
            items.append((index, tasks[key]))
    else:
        raise TypeError(
            f"cluster.{job}: the tasks of a job must be a list of 'host:port' addresses or a dict "
            f"{{index: address}}, got {tasks!r}"
        )
    result: dict[int, str] = {}
    for index, address in sorted(items, key=lambda item: item[0]):
        parse_address(address, f"cluster.{job}[{index}]")
        result[index] = address
    return result
