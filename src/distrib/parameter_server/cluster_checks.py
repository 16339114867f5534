"""TF's checks of a parameter-server cluster (``ParameterServerStrategy``'s constructor), with TF's messages."""

from __future__ import annotations

from distrib.cluster import ClusterSpec

__all__ = ["check_cluster"]


def check_cluster(spec: ClusterSpec, task_type: str | None) -> None:
    """TF's checks of a parameter-server cluster, with TF's messages and what to do."""
    allowed = ("chief", "worker", "ps", "evaluator")
    jobs = sorted(spec.jobs)
    unknown = [j for j in jobs if j not in allowed]
    if unknown:
        raise ValueError(
            f"Disallowed task type found in cluster spec: {unknown[0]!r}; a parameter-server cluster "
            f"has only {', '.join(repr(a) for a in allowed)} jobs ({spec})"
        )
    if task_type is not None and task_type not in allowed:
        raise ValueError(
            f"Unrecognized task_type: {task_type}; the coordinator is the 'chief' task (this process), "
            "and 'ps'/'worker' tasks run ds.Server"
        )

    def count(job: str) -> int:  # ClusterSpec.num_tasks raises for a job the cluster lacks (as TF)
        return spec.num_tasks(job) if job in spec.jobs else 0

    if count("chief") > 1:
        raise ValueError(f"There must be at most one 'chief' job; the cluster has {count('chief')} ({spec})")
    if not count("worker"):
        raise ValueError(
            f"There must be at least one worker. The cluster has no 'worker' task ({spec}); "
            "ParameterServerStrategy needs at least one 'ps' and one 'worker'"
        )
    if not count("ps"):
        raise ValueError(
            f"There must be at least one ps. The cluster has no 'ps' task ({spec}); "
            "ParameterServerStrategy needs at least one 'ps' and one 'worker'"
        )
