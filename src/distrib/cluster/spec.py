"""``ClusterSpec``: the tasks of a cluster and their addresses (``tf.train.ClusterSpec``)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence, Union

__all__ = ["ClusterSpec", "TASK_TYPES", "parse_address"]

TASK_TYPES = ("chief", "worker", "ps", "evaluator")


def parse_address(address: str, where: str) -> tuple[str, int]:
    """``(host, port)`` of ``"host:port"``; ValueError naming ``where`` when malformed."""
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"{where}: expected an address 'host:port', got {address!r}")
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{where}: expected an address 'host:port' with a port in 1..65535, got {address!r}")
    return host, int(port)


class ClusterSpec:
    """Task type -> list of ``"host:port"`` addresses.

    Example::

        >>> spec = ClusterSpec({"worker": ["localhost:12345", "localhost:23456"]})
        >>> spec.num_tasks("worker"), spec.task_address("worker", 1)
        (2, 'localhost:23456')
    """

    def __init__(self, cluster: Union[Mapping[str, Sequence[str]], "ClusterSpec", None] = None) -> None:
        if isinstance(cluster, ClusterSpec):
            cluster = cluster.as_dict()
        cluster = cluster or {}
        if not isinstance(cluster, Mapping):
            raise ValueError(f"cluster: expected a mapping of task type to addresses, got {type(cluster).__name__}")
        self._jobs: dict[str, list[str]] = {}
        for job, given in cluster.items():
            tasks: Any = given
            if isinstance(tasks, Mapping):  # TF's sparse form {index: address}
                tasks = [tasks[k] for k in sorted(tasks, key=int)]
            if isinstance(tasks, str) or not isinstance(tasks, Sequence):
                raise ValueError(f"cluster.{job}: expected a list of 'host:port' addresses, got {tasks!r}")
            for i, address in enumerate(tasks):
                parse_address(address, f"cluster.{job}[{i}]")
            self._jobs[str(job)] = list(tasks)

    @property
    def jobs(self) -> list[str]:
        return list(self._jobs)

    def as_dict(self) -> dict[str, list[str]]:
        return {job: list(tasks) for job, tasks in self._jobs.items()}

    def num_tasks(self, job: str) -> int:
        return len(self._jobs.get(job, ()))

    def job_tasks(self, job: str) -> list[str]:
        if job not in self._jobs:
            raise ValueError(f"no job {job!r} in this cluster (jobs: {', '.join(self._jobs) or 'none'})")
        return list(self._jobs[job])

    def task_address(self, job: str, index: int) -> str:
        tasks = self.job_tasks(job)
        if not 0 <= index < len(tasks):
            raise ValueError(f"task index {index} out of range for job {job!r} with {len(tasks)} task(s)")
        return tasks[index]

    def chief(self) -> tuple[str, int]:
        """The chief task: ``("chief", 0)`` if the cluster has one, else ``("worker", 0)``."""
        if self.num_tasks("chief"):
            return "chief", 0
        if self.num_tasks("worker"):
            return "worker", 0
        raise ValueError("the cluster has neither a 'chief' nor a 'worker' task")

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSpec) and self._jobs == other._jobs

    def __repr__(self) -> str:
        return f"ClusterSpec({self._jobs!r})"
