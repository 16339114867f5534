"""Cluster resolvers: who is in the cluster and which task this process is (TF's ``cluster_resolver``).

``ClusterResolver`` is the base, ``SimpleClusterResolver`` takes explicit values and
``UnionClusterResolver`` merges several, all with TF's semantics (see docs/migration.md
for the few differences). Two members are distrib's own:

- ``rendezvous_address()``: the chief's ``host:port`` without any ``rpc_layer`` prefix, where
  the workers of ``MultiWorkerMirroredStrategy`` meet. TF's ``master()`` is something else
  (the address of *this* task, or a session master, prefixed ``grpc://``), kept as TF has it.
- ``worker_rank(resolver)``: ``(rank, world_size)`` of this task among the chief and workers.
- ``spans_hosts``: whether the workers run on several hosts, where the resolver can tell.

A resolver that reads an environment (``TF_CONFIG``, torchrun's or Slurm's variables)
declares ``detect`` and ``from_environment``; :func:`resolve` asks the resolvers given
to :func:`register_resolver`, in order, and builds the first that detects its environment.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, TypeVar

from distrib.cluster.spec import ClusterSpec, parse_task_index

__all__ = [
    "ClusterResolver",
    "SimpleClusterResolver",
    "UnionClusterResolver",
    "UnionResolver",
    "format_master_url",
    "register_resolver",
    "registered_resolvers",
    "resolve",
    "worker_rank",
]


def format_master_url(master: str, rpc_layer: str | None = None) -> str:
    """``"grpc://host:port"`` for ``rpc_layer="grpc"``; ``master`` unchanged without a layer (as TF)."""
    return f"{rpc_layer}://{master}" if rpc_layer else master


def _task_type(value: object) -> str | None:
    return None if value is None else str(value)


def _task_id(value: object, where: str = "task_id") -> int | None:
    return None if value is None else parse_task_index(value, where)


class ClusterResolver(abc.ABC):
    """A cluster spec plus this process's task (``tf.distribute.cluster_resolver.ClusterResolver``).

    Subclasses implement ``cluster_spec()`` and set ``task_type``, ``task_id`` and
    ``rpc_layer``. ``rpc_layer`` is kept and used in ``master()`` as TF does, but chooses no
    transport: workers always talk through ``torch.distributed`` (gloo or NCCL) and
    parameter servers through gRPC.

    Example (a resolver of your own)::

        >>> class Fixed(ClusterResolver):
        ...     def cluster_spec(self):
        ...         return ClusterSpec({"worker": ["w0:2222", "w1:2222"]})
        >>> r = Fixed(); r.task_type, r.task_id = "worker", "1"
        >>> r.task_id, r.master(), r.rendezvous_address(), r.is_chief
        (1, 'w1:2222', 'w0:2222', False)
    """

    _task_type: str | None = None
    _task_id: int | None = None
    _rpc_layer: str | None = None
    _environment: str | None = ""

    @abc.abstractmethod
    def cluster_spec(self) -> ClusterSpec:
        """The cluster as a ``ClusterSpec``.

        Returns:
            Every job of the cluster and its tasks' addresses.
        """

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> bool:
        """Whether ``environ`` (default ``os.environ``) describes a cluster this resolver reads.

        :func:`resolve` asks each registered resolver in turn. The base reads no
        environment (it is given its values), so it detects nothing.

        Args:
            environ: the environment variables to read; None reads ``os.environ``.

        Returns:
            True when ``environ`` describes a cluster of this resolver's kind.
        """
        return False

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> ClusterResolver:
        """This resolver read from ``environ`` (default ``os.environ``): what :func:`resolve` returns once
        :meth:`detect` is True. A resolver that reads an environment overrides both.

        Args:
            environ: the environment variables to read; None reads ``os.environ``.

        Returns:
            A resolver of this class for the cluster that ``environ`` describes.

        Raises:
            NotImplementedError: the class reads no environment (the base, ``SimpleClusterResolver``).
        """
        raise NotImplementedError(f"{cls.__name__} reads no environment: build it from its values")

    @property
    def spans_hosts(self) -> bool | None:
        """Whether the chief and workers run on several hosts; None when this resolver cannot tell.

        Strategies use it to choose the network interface (see ``comm/process_group.py``);
        with None they judge from the hosts' addresses. distrib's own.
        """
        return None

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        """The address of the given task, default this process's task, prefixed ``rpc_layer://``; ``""``
        when neither is known (TF's Slurm and base semantics). Not where collectives meet: see
        ``rendezvous_address()``.

        Args:
            task_type: the job of the task to address (``"worker"``); None: this process's task.
            task_id: the task's index in its job; None: this process's task.
            rpc_layer: the protocol prefix (``"grpc"``); None: the resolver's ``rpc_layer``.

        Returns:
            ``"grpc://host:port"`` (or ``"host:port"`` without a layer), ``""`` when no task is known.
        """
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        if task_type is None or task_id is None:
            return ""
        return format_master_url(self.cluster_spec().task_address(task_type, task_id), rpc_layer or self.rpc_layer)

    def rendezvous_address(self) -> str:
        """``host:port`` of the chief (the ``chief`` task, else worker 0), where the workers of a
        synchronous strategy rendezvous. Never prefixed by ``rpc_layer``. distrib's own.

        Returns:
            The chief's ``"host:port"``.

        Raises:
            ValueError: the cluster has neither a ``chief`` nor a ``worker`` job.
        """
        spec = self.cluster_spec()
        return spec.task_address(*spec.chief())

    @property
    def task_type(self) -> str | None:
        """This process's job (``"chief"``, ``"worker"``, ``"ps"``, ``"evaluator"``), or None."""
        return self._task_type

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = _task_type(task_type)

    @property
    def task_id(self) -> int | None:
        """This process's index in its job, or None. Set from an int or a string of digits, as TF casts."""
        return self._task_id

    @task_id.setter
    def task_id(self, task_id: int | str | None) -> None:
        self._task_id = _task_id(task_id)

    @property
    def rpc_layer(self) -> str | None:
        """The protocol prefix ``master()`` puts before addresses (``"grpc"``), or None."""
        return self._rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    @property
    def environment(self) -> str | None:
        """The environment TF runs in (``""`` outside Google); kept as given."""
        return self._environment

    @property
    def is_chief(self) -> bool:
        """True for the chief task (the ``chief`` task, else worker 0), or for a process with no task."""
        if self.task_type is None:
            return True
        try:
            chief = self.cluster_spec().chief()
        except ValueError:  # no chief and no worker: an evaluator or ps alone is not the chief
            return False
        return (self.task_type, self.task_id or 0) == chief

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: object = None
    ) -> dict[str, int]:
        """The accelerators of this machine, ``{"GPU": n}`` (``{}`` without CUDA).

        TF asks the given task through a session; distrib can only see this process's machine,
        so ``task_type``, ``task_id`` and ``config_proto`` are accepted and ignored.

        Args:
            task_type: accepted for TF's signature, ignored.
            task_id: accepted for TF's signature, ignored.
            config_proto: accepted for TF's signature, ignored.

        Returns:
            ``{"GPU": n}`` with the number of CUDA devices this process sees, ``{}`` when there are none.
        """
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return {"GPU": count} if count else {}


def worker_rank(resolver: ClusterResolver) -> tuple[int, int]:
    """``(rank, world_size)`` of this task among the cluster's chief and worker tasks (chief first).

    ``(0, 1)`` for a cluster with no chief or worker (a single process). A sparse chief or
    worker job is refused: a synchronous strategy needs every worker listed.

    Example::

        >>> r = SimpleClusterResolver(ClusterSpec({"chief": ["c:1"], "worker": ["w0:1", "w1:1"]}), "worker", 1)
        >>> worker_rank(r)
        (2, 3)

    Args:
        resolver: the cluster and this process's task.

    Returns:
        ``(rank, world_size)``: this task's index among the chief and workers, and their number.

    Raises:
        ValueError: a chief or worker job is sparse (not every index 0..n-1 listed), this task is not a
            chief or worker (a ps, an evaluator), or it is not in the cluster.
    """
    spec = resolver.cluster_spec()
    jobs = [job for job in ("chief", "worker") if job in spec.jobs]
    tasks = [(job, index) for job in jobs for index in spec.task_indices(job)]
    if not tasks:
        return 0, 1
    for job in jobs:
        indices = spec.task_indices(job)
        if indices != list(range(len(indices))):
            raise ValueError(
                f"MultiWorkerMirroredStrategy needs every {job} task listed, but cluster.{job} has the indices "
                f"{indices}: list all of them (0..n-1) in every task's TF_CONFIG"
            )
    if resolver.task_type not in ("chief", "worker"):
        raise ValueError(
            f"MultiWorkerMirroredStrategy runs on 'chief' and 'worker' tasks, but this task is "
            f"{resolver.task_type!r}: check TF_CONFIG's 'task.type'"
        )
    task = (resolver.task_type, resolver.task_id or 0)
    if task not in tasks:
        raise ValueError(
            f"this task ({task[0]} {task[1]}) is not in the cluster {spec!r}: check TF_CONFIG's 'task.index'"
        )
    return tasks.index(task), len(tasks)


R = TypeVar("R", bound=type[ClusterResolver])

_REGISTERED: list[type[ClusterResolver]] = []


def register_resolver(resolver: R, *, first: bool = False) -> R:
    """Let :func:`resolve` find ``resolver`` (a class declaring ``detect`` and ``from_environment``).

    Resolvers are asked in registration order; ``first=True`` asks this one before
    the others (an environment of your own that also sets, say, ``TF_CONFIG``).
    distrib registers ``TF_CONFIG``'s, then torchrun's, then Slurm's. Registering a
    class again moves it. Usable as a decorator; returns ``resolver``.

    Args:
        resolver: a ``ClusterResolver`` subclass that declares ``detect`` and ``from_environment``.
        first: ask it before the resolvers already registered (default: after them).

    Returns:
        ``resolver`` itself, so that the function works as a class decorator.

    Raises:
        TypeError: ``resolver`` is not a ``ClusterResolver`` class, or does not declare ``detect``.
    """
    if not (isinstance(resolver, type) and issubclass(resolver, ClusterResolver)):
        raise TypeError(f"register_resolver takes a ClusterResolver class, got {resolver!r}")
    if resolver.detect.__func__ is ClusterResolver.detect.__func__:  # type: ignore[attr-defined]
        raise TypeError(f"{resolver.__name__} does not declare detect(environ): resolve() could never pick it")
    if resolver in _REGISTERED:
        _REGISTERED.remove(resolver)
    _REGISTERED.insert(0 if first else len(_REGISTERED), resolver)
    return resolver


def registered_resolvers() -> tuple[type[ClusterResolver], ...]:
    """The resolvers :func:`resolve` asks, in the order it asks them.

    Returns:
        The registered resolver classes, in the order :func:`resolve` asks them.
    """
    return tuple(_REGISTERED)


def resolve(environ: Mapping[str, str] | None = None) -> ClusterResolver | None:
    """The resolver for this process's environment (default ``os.environ``), or None outside any cluster.

    The first registered resolver whose ``detect(environ)`` is True is built with
    ``from_environment(environ)`` (its errors, e.g. a malformed ``TF_CONFIG``, propagate).

    Example::

        >>> type(resolve({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"})).__name__
        'TorchrunClusterResolver'
        >>> resolve({}) is None
        True

    Args:
        environ: the environment variables to read; None reads ``os.environ``.

    Returns:
        The first registered resolver that detects ``environ``, built from it; None when none does.
    """
    for resolver in _REGISTERED:
        if resolver.detect(environ):
            return resolver.from_environment(environ)
    return None


class SimpleClusterResolver(ClusterResolver):
    """A resolver from explicit values (``tf.distribute.cluster_resolver.SimpleClusterResolver``).

    Arguments after ``cluster_spec`` are best given by keyword, as TF's own tests do.
    Positionally, distrib's order is ``(cluster_spec, task_type, task_id)`` (TF's is
    ``(cluster_spec, master, task_type, ...)``); a ``task_type`` that is not a job of the
    cluster is a ValueError, so TF's positional ``master`` is caught, not misread.

    Example::

        >>> spec = ClusterSpec({"worker": ["localhost:1111", "localhost:2222"]})
        >>> r = SimpleClusterResolver(spec, task_type="worker", task_id=1, rpc_layer="grpc")
        >>> r.is_chief, r.master("worker", 0), r.rendezvous_address()
        (False, 'grpc://localhost:1111', 'localhost:1111')

    Args:
        cluster_spec: the cluster, as a ``ClusterSpec`` or the dict a ``ClusterSpec`` takes.
        task_type: this process's job (``"worker"``, ``"chief"``, ``"ps"``, ``"evaluator"``), or None.
        task_id: this process's index in its job (an int or a string of digits), or None.
        master: what ``master()`` returns when given no task (TF's session master).
        environment: TF's environment name, kept as given (``""``).
        num_accelerators: what ``num_accelerators()`` returns (``{"GPU": 2}``); None: ``{}``.
        rpc_layer: the protocol prefix that ``master()`` puts before addresses (``"grpc"``), or None.

    Raises:
        TypeError: ``master`` is not a string.
        ValueError: ``task_type`` is not a job of the cluster (TF's positional ``master`` lands there).
        KeyError: ``task_id`` is not an index of the ``task_type`` job.
    """

    def __init__(
        self,
        cluster_spec: ClusterSpec | Mapping[str, Any],
        task_type: str | None = None,
        task_id: int | None = None,
        *,
        master: str = "",
        environment: str = "",
        num_accelerators: dict[str, int] | None = None,
        rpc_layer: str | None = None,
    ) -> None:
        self._cluster_spec = cluster_spec if isinstance(cluster_spec, ClusterSpec) else ClusterSpec(cluster_spec)
        if not isinstance(master, str):
            raise TypeError(f"SimpleClusterResolver(master={master!r}): master must be a string")
        self.task_type, self.task_id = task_type, task_id
        if self.task_type is not None and self.task_type != "evaluator":
            if self.task_type not in self._cluster_spec.jobs:
                raise ValueError(
                    f"SimpleClusterResolver(task_type={task_type!r}): not a job of the cluster "
                    f"(jobs: {', '.join(self._cluster_spec.jobs) or 'none'}). distrib's positional order is "
                    "(cluster_spec, task_type, task_id); pass TF's master by keyword: master='grpc://host:port'"
                )
            self._cluster_spec.task_address(self.task_type, self.task_id or 0)  # the index must be listed
        self._master = master
        self._environment = environment
        self._num_accelerators = num_accelerators
        self._rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        return self._cluster_spec

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        """The given task's address, else the ``master`` given to the constructor (TF: the session
        master, ``""`` by default), prefixed ``rpc_layer://``.

        Args:
            task_type: the job of the task to address; None (or no ``task_id``): the constructor's ``master``.
            task_id: the task's index in its job.
            rpc_layer: the protocol prefix; None: the constructor's ``rpc_layer``.

        Returns:
            The address, prefixed ``rpc_layer://`` when there is a layer.
        """
        if task_type is not None and task_id is not None:
            address = self.cluster_spec().task_address(task_type, task_id)
        else:
            address = self._master
        return format_master_url(address, rpc_layer or self._rpc_layer)

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: object = None
    ) -> dict[str, int]:
        """The ``num_accelerators`` given to the constructor (``{}`` if none); nothing is detected, as TF.

        Args:
            task_type: accepted for TF's signature, ignored.
            task_id: accepted for TF's signature, ignored.
            config_proto: accepted for TF's signature, ignored.

        Returns:
            A copy of the constructor's ``num_accelerators``.
        """
        return dict(self._num_accelerators or {})


class UnionClusterResolver(ClusterResolver):
    """The union of several resolvers (``tf.distribute.cluster_resolver.UnionResolver``).

    ``cluster_spec()`` merges theirs: jobs given as lists by every resolver are concatenated in
    order; if any gives a job as a dict, all its parts are merged as dicts and a task index given
    twice is a ``KeyError`` (as TF). Task type, task id, rpc layer, environment and accelerators
    come from the first resolver unless overridden (``task_type=``, ``task_id=``, ``rpc_layer=``).

    Example::

        >>> workers = SimpleClusterResolver(ClusterSpec({"worker": ["w0:2222", "w1:2222"]}), "worker", 0)
        >>> ps = SimpleClusterResolver(ClusterSpec({"ps": ["ps0:2222"]}))
        >>> union = UnionClusterResolver(workers, ps, rpc_layer="grpc")
        >>> union.cluster_spec(), union.task_type, union.master("ps", 0)
        (ClusterSpec({'ps': ['ps0:2222'], 'worker': ['w0:2222', 'w1:2222']}), 'worker', 'grpc://ps0:2222')

    Args:
        *args: the resolvers to merge, at least one; the first gives the task and the rest of the defaults.
        **kwargs: ``rpc_layer``, ``task_type`` and ``task_id``, overriding the first resolver's.

    Raises:
        ValueError: no resolver, or a keyword other than those three.
        TypeError: an argument is not a ``ClusterResolver``.
    """

    def __init__(self, *args: ClusterResolver, **kwargs: Any) -> None:
        self._rpc_layer = kwargs.pop("rpc_layer", None)
        self._task_type = _task_type(kwargs.pop("task_type", None))
        self._task_id = _task_id(kwargs.pop("task_id", None))
        if kwargs:
            raise ValueError(
                f"UnionClusterResolver: unexpected keyword arguments {kwargs!r} "
                "(it takes rpc_layer, task_type and task_id)"
            )
        if not args:
            raise ValueError("UnionClusterResolver needs at least one ClusterResolver")
        for resolver in args:
            if not isinstance(resolver, ClusterResolver):
                raise TypeError(f"UnionClusterResolver: every argument must be a ClusterResolver, got {resolver!r}")
        self._cluster_resolvers = args

    def cluster_spec(self) -> ClusterSpec:
        """The merged cluster; ``KeyError`` when two resolvers give the same index of a job.

        Returns:
            The merged ``ClusterSpec``.

        Raises:
            KeyError: two resolvers give the same index of a job.
        """
        parts: dict[str, list[list[str] | dict[int, str]]] = {}
        for resolver in self._cluster_resolvers:
            for job, tasks in resolver.cluster_spec().as_dict().items():
                parts.setdefault(job, []).append(tasks)
        merged: dict[str, list[str] | dict[int, str]] = {}
        for job, tasks_list in parts.items():
            lists = [tasks for tasks in tasks_list if isinstance(tasks, list)]
            if len(lists) == len(tasks_list):
                merged[job] = [address for tasks in lists for address in tasks]
                continue
            as_dict: dict[int, str] = {}
            for tasks in tasks_list:
                part = dict(enumerate(tasks)) if isinstance(tasks, list) else dict(tasks)
                clash = set(part) & set(as_dict)
                if clash:
                    raise KeyError(
                        f"Duplicate keys detected when merging two ClusterSpecs: job {job!r} "
                        f"task index(es) {sorted(clash)} given twice"
                    )
                as_dict.update(part)
            merged[job] = as_dict
        return ClusterSpec(merged)

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        """The given task's address, else the first resolver's ``master(rpc_layer=...)`` (as TF).

        Args:
            task_type: the job of the task to address; None (or no ``task_id``): the first resolver's master.
            task_id: the task's index in its job.
            rpc_layer: the protocol prefix; None: this resolver's ``rpc_layer``.

        Returns:
            The address, prefixed ``rpc_layer://`` when there is a layer.
        """
        if task_type is not None and task_id is not None:
            return format_master_url(self.cluster_spec().task_address(task_type, task_id), rpc_layer or self._rpc_layer)
        return self._cluster_resolvers[0].master(rpc_layer=rpc_layer)

    @property
    def task_type(self) -> str | None:
        """This process's job: the ``task_type=`` given, else the first resolver's."""
        return self._task_type if self._task_type is not None else self._cluster_resolvers[0].task_type

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = _task_type(task_type)

    @property
    def task_id(self) -> int | None:
        """This process's index in its job: the ``task_id=`` given, else the first resolver's."""
        return self._task_id if self._task_id is not None else self._cluster_resolvers[0].task_id

    @task_id.setter
    def task_id(self, task_id: int | str | None) -> None:
        self._task_id = _task_id(task_id)

    @property
    def rpc_layer(self) -> str | None:
        """The ``rpc_layer=`` given, else the first resolver's."""
        return self._rpc_layer or self._cluster_resolvers[0].rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    @property
    def environment(self) -> str | None:
        """The first resolver's environment."""
        return self._cluster_resolvers[0].environment

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: object = None
    ) -> dict[str, int]:
        """The first resolver's accelerators (see ``ClusterResolver.num_accelerators``).

        Args:
            task_type: passed on to the first resolver.
            task_id: passed on to the first resolver.
            config_proto: passed on to the first resolver.

        Returns:
            The first resolver's ``num_accelerators(task_type, task_id, config_proto)``.
        """
        return self._cluster_resolvers[0].num_accelerators(task_type, task_id, config_proto)


#: TF exports ``UnionClusterResolver`` as ``tf.distribute.cluster_resolver.UnionResolver``.
UnionResolver = UnionClusterResolver
