"""``ds.Server``: the process (or thread) behind a ``ps`` or ``worker`` task (``tf.distribute.Server``).

Under ``ParameterServerStrategy`` the chief runs the user's script as the
coordinator; every ``ps`` and ``worker`` task only runs a server and waits::

    server = ds.Server(cluster_resolver.cluster_spec(), job_name="ps", task_index=0)
    server.join()

``python -m distrib.parameter_server`` does exactly this from ``TF_CONFIG``, and
``distrib launch --ps M --workers N script.py`` starts one such process per task.

A started server keeps serving until :meth:`Server.stop`, even when the program
keeps no reference to it (TF's in-process-cluster recipe creates servers and drops
them): this module holds every running server (:func:`running_servers`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from distrib.cluster import ClusterSpec
from distrib.cluster.hosts import is_loopback, resolve, route_source
from distrib.cluster.spec import parse_address
from distrib.parameter_server.server.ps_service import ParameterStore
from distrib.parameter_server.server.worker_service import WorkerService
from distrib.parameter_server.transport import rpc
from distrib.parameter_server.transport.rpc import PS_SERVICE, WORKER_SERVICE, TLSConfig
from distrib.parameter_server.worker_device import resolve_worker_device

__all__ = ["BIND_ADDRESS_ENV", "Server", "listen_address", "routed_address", "running_servers"]

#: where a server listens when ``Server(bind_address=None)``: e.g. ``0.0.0.0`` (every interface)
BIND_ADDRESS_ENV = "DISTRIB_BIND_ADDRESS"

log = logging.getLogger("distrib.parameter_server.server.server")

# every started, not yet stopped server: a gRPC server whose last reference goes away stops serving
_running: set[Server] = set()
_running_lock = threading.Lock()


def listen_address(address: str, bind_address: str | None = None, where: str = "bind_address") -> str:
    """The ``host:port`` a server for the task at ``address`` listens on.

    ``bind_address`` None: ``address`` itself (distrib's default: only the interface of the spec's
    address). Else a host, an address, or ``host:port`` (``[v6]:port``): ``"0.0.0.0"`` is every
    IPv4 interface (TF's servers listen so), ``"::"`` or ``"[::]"`` every interface, IPv6 and IPv4;
    without a port the task's port in the spec is kept. Behind NAT or a Kubernetes Service the
    spec's address is the one clients reach, not an address of the task's host: listen on
    every interface. ``where`` names the source in errors.

    Example::

        >>> listen_address("ps-0.svc:2222"), listen_address("ps-0.svc:2222", "0.0.0.0")
        ('ps-0.svc:2222', '0.0.0.0:2222')
        >>> listen_address("ps-0.svc:2222", "::"), listen_address("ps-0.svc:2222", "[::]:3333")
        ('[::]:2222', '[::]:3333')
    """
    _, port = parse_address(address, "the task's address")
    if bind_address is None:
        return address
    text = bind_address.strip() if isinstance(bind_address, str) else bind_address
    if not isinstance(text, str) or not text:
        raise ValueError(
            f"{where}={bind_address!r}: expected a host or 'host:port', e.g. '0.0.0.0' to listen on every interface"
        )
    if text.count(":") > 1 and not text.startswith("["):  # a bare IPv6 address: "::", "fd00::2"
        text = f"[{text}]"
    if text.endswith("]") or ":" not in text:
        text = f"{text}:{port}"
    try:
        host, bound_port = parse_address(text, where)
    except ValueError as e:
        raise ValueError(f"{e}; e.g. '0.0.0.0' (every interface) or '0.0.0.0:{port}'") from None
    return f"[{host}]:{bound_port}" if ":" in host else f"{host}:{bound_port}"


def routed_address(
    address: str,
    other_hosts: Iterable[str],
    *,
    resolve: Callable[[str], list[str]] = resolve,
    route: Callable[[str], str | None] = route_source,
) -> str | None:
    """Where else a task at ``address`` must listen for the other hosts to reach it, or None.

    Debian's ``/etc/hosts`` maps a host's own name to ``127.0.1.1``: a task whose address is
    ``node2:2222`` then listens on a loopback address, and the tasks of the other hosts, for whom
    ``node2`` is a routable address, are refused. When the task's host resolves here only to
    loopback addresses while some other task's host does not, this is the local address that
    routes to that host, at the task's port; the server listens there too (the same interface
    it would have listened on with a routable name, and the token still guards it).

    Example (``node2`` is 127.0.1.1 here, ``node1`` is 10.0.0.1, reached from 10.0.0.2)::

        >>> routed_address("node2:2222", ["node1", "node2"], resolve=lambda h: {"node1": ["10.0.0.1"]}.get(h,
        ...                ["127.0.1.1"]), route=lambda a: "10.0.0.2")
        '10.0.0.2:2222'
        >>> routed_address("10.0.0.2:2222", ["node1"], resolve=lambda h: [h], route=lambda a: "10.0.0.2") is None
        True
    """
    host, port = parse_address(address, "the task's address")
    own = resolve(host)
    if not own or not all(is_loopback(a) for a in own):
        return None
    for other in dict.fromkeys(h for h in other_hosts if h != host):
        for remote in resolve(other):
            if is_loopback(remote):
                continue
            local = route(remote)
            if local is not None and not is_loopback(local):
                return f"[{local}]:{port}" if ":" in local else f"{local}:{port}"
    return None


def running_servers() -> list[Server]:
    """The servers of this process that are serving now (started, not stopped)."""
    with _running_lock:
        return sorted(_running, key=lambda server: (server.job_name, server.task_index, server.address))


class Server:
    """Serves one ``ps`` or ``worker`` task of a cluster on that task's address.

    A ``ps`` task holds variables (in host memory, as TF's do) and applies updates to them; a ``worker``
    task runs the functions the coordinator schedules, reading and updating the variables on the ps tasks.
    Every call needs the cluster token; the server listens on exactly the address the cluster spec gives the
    task unless ``bind_address`` says otherwise. When the spec's name resolves on this host only to loopback
    (Debian's ``/etc/hosts`` maps the host's own name to 127.0.1.1) while other tasks' hosts do not, it also
    listens on this host's address that routes to them (``also_listening``; see :func:`routed_address`). A
    started server serves until :meth:`stop`, whether or not the program keeps a reference to it.

    Args:
        cluster_spec: the cluster (a ``ClusterSpec`` or its dict, ``{"ps": [...], "worker": [...]}``); it
            must have at least one ``ps`` task.
        job_name: ``"ps"`` or ``"worker"`` (the chief runs the user's script, not a server).
        task_index: the task's index in its job.
        token: the cluster's shared secret (at least 16 characters); None: ``DISTRIB_CLUSTER_TOKEN``.
        tls: certificates for TLS; None: from the ``DISTRIB_TLS_*`` variables (see
            :mod:`distrib.parameter_server.transport.rpc`), else plaintext.
        start: start serving at once; False: call :meth:`start` later.
        config: TF's ``ConfigProto``: accepted for TF compatibility and ignored.
        protocol: ``"grpc"`` or None (the same).
        max_workers: threads serving calls; None: 16 for a ps task, 4 for a worker task.
        max_message_bytes: requests larger than this are refused; None: ``DISTRIB_MAX_MESSAGE_BYTES``, else
            1 GiB.
        bind_address: where to listen; None: ``DISTRIB_BIND_ADDRESS``, else the spec's address. ``"0.0.0.0"``
            listens on every interface at the task's port, as TF's servers do (see :func:`listen_address`):
            needed behind NAT or a Kubernetes Service, where the spec's address is not one of the host's.
        device: where a ``worker`` task computes; None: ``DISTRIB_WORKER_DEVICE``, else its GPU when it has
            one, else its CPU (see :mod:`distrib.parameter_server.worker_device`). A ps task takes only
            None or ``"cpu"``.

    Raises:
        ValueError: ``protocol`` is not ``"grpc"``, ``job_name`` is not ``"ps"`` or ``"worker"``, the cluster has
            no ps task, a ps task is given a device, or the token, ``bind_address``, ``max_message_bytes`` or
            a worker's device is unusable (each message says what to give instead).
        OSError: ``start`` is True and the address is taken or not this host's.

    Example::

        >>> import distrib as ds
        >>> resolver = ds.testing.create_in_process_cluster(num_workers=1, num_ps=1)  # doctest: +SKIP
        >>> # the same, by hand, for one task:
        >>> server = ds.Server(resolver.cluster_spec(), job_name="ps", task_index=0)  # doctest: +SKIP
        >>> server.join()  # blocks until server.stop()  # doctest: +SKIP
    """

    def __init__(
        self,
        cluster_spec: ClusterSpec | Mapping[str, Sequence[str]],
        job_name: str,
        task_index: int = 0,
        *,
        token: str | None = None,
        tls: TLSConfig | None = None,
        start: bool = True,
        config: Any = None,
        protocol: str | None = None,
        max_workers: int | None = None,
        max_message_bytes: int | None = None,
        bind_address: str | None = None,
        device: str | Any | None = None,
    ) -> None:
        if protocol not in (None, "grpc"):
            raise ValueError(f"Server(protocol={protocol!r}): only 'grpc' is supported (TLS: pass tls=TLSConfig(...))")
        spec = ClusterSpec(cluster_spec)
        if job_name not in ("ps", "worker"):
            raise ValueError(
                f"Server(job_name={job_name!r}): only 'ps' and 'worker' tasks run a server; the 'chief' runs your "
                "script, which creates ParameterServerStrategy and ClusterCoordinator (the coordinator)"
            )
        if "ps" not in spec.jobs or not spec.num_tasks("ps"):
            raise ValueError(
                f"Server: the cluster has no 'ps' task ({spec}); ParameterServerStrategy needs at least one"
            )
        if job_name == "ps" and device is not None and str(device) != "cpu":
            raise ValueError(
                f"Server(job_name='ps', device={device!r}): a ps task keeps its variables in host memory, as TF's "
                "do; device= is where a worker task computes"
            )
        self.cluster_spec = spec
        self.job_name = job_name
        self.task_index = task_index
        #: where the other tasks reach this one (the cluster spec's address)
        self.address = spec.task_address(job_name, task_index)
        where = "bind_address"
        if bind_address is None and os.environ.get(BIND_ADDRESS_ENV, "").strip():
            bind_address, where = os.environ[BIND_ADDRESS_ENV], BIND_ADDRESS_ENV
        #: where this server listens: ``address``, or what ``bind_address`` asked for (e.g. ``0.0.0.0:port``)
        self.bind_address = listen_address(self.address, bind_address, where)
        #: where it also listens: the routable address of this host when ``address`` resolves here only to
        #: loopback (Debian's 127.0.1.1) and other hosts must reach it (see :func:`routed_address`)
        self.also_listening: list[str] = []
        if bind_address is None:
            others = [
                spec.task_address(job, i).rpartition(":")[0].strip("[]")
                for job in spec.jobs
                for i in spec.task_indices(job)
            ]
            routed = routed_address(self.address, others)
            if routed is not None:
                self.also_listening.append(routed)
        #: where a worker task computes (``cpu`` for a ps task)
        self.device = resolve_worker_device(device) if job_name == "worker" else torch.device("cpu")
        self._token = rpc.cluster_token(token)
        self._tls = tls if tls is not None else TLSConfig.from_env()
        self._max_workers = max_workers or (16 if job_name == "ps" else 4)
        self.max_message_bytes = rpc.max_message_bytes(max_message_bytes)
        self._grpc: Any = None
        self._stopped = threading.Event()
        if start:
            self.start()

    @property
    def target(self) -> str:
        """``grpc://host:port`` of this task, as TF prints it."""
        return f"grpc://{self.address}"

    def start(self) -> None:
        """Listen on the task's address (or ``bind_address``); OSError if it is taken or not this host's."""
        if self._grpc is not None:
            return
        if self.job_name == "ps":
            service: Any = ParameterStore()
            name = PS_SERVICE
        else:
            service = WorkerService(
                self.cluster_spec, self.task_index, self._token, self._tls, self.max_message_bytes, self.device
            )
            name = WORKER_SERVICE
        self._service = service
        self._grpc = rpc.make_server(
            self.bind_address,
            name,
            service.handlers(),
            self._token,
            self._tls,
            self._max_workers,
            self.max_message_bytes,
            also=self.also_listening,
        )
        self._stopped.clear()
        with _running_lock:
            _running.add(self)
        log.info(
            "started /job:%s/task:%d on %s%s%s%s",
            self.job_name,
            self.task_index,
            self.address,
            f" (listening on {self.bind_address})" if self.bind_address != self.address else "",
            f" and on {', '.join(self.also_listening)}: {self.address} resolves to loopback here (Debian's "
            "127.0.1.1?) and the other hosts reach this one there"
            if self.also_listening
            else "",
            " (TLS)" if self._tls else "",
        )
        if self.job_name == "worker":
            log.info("/job:worker/task:%d computes on %s", self.task_index, self.device)

    def join(self, timeout: float | None = None) -> bool:
        """Block until the server stops (or ``timeout`` seconds pass): what a task's main program ends with.

        Args:
            timeout: the most seconds to wait; None: until :meth:`stop` is called.

        Returns:
            True once the server has stopped; False when ``timeout`` passed first.
        """
        return self._stopped.wait(timeout)

    def stop(self, grace: float | None = None) -> None:
        """Stop serving (and release :meth:`join`); a stopped server can be started again with :meth:`start`.

        Args:
            grace: seconds the calls in progress get to finish; None: they are cancelled at once.
        """
        if self._grpc is not None:
            self._grpc.stop(grace).wait()
            self._grpc = None
        with _running_lock:
            _running.discard(self)
        self._stopped.set()

    def __repr__(self) -> str:
        listening = f", listening on {self.bind_address}" if self.bind_address != self.address else ""
        listening += "".join(f" and {a}" for a in self.also_listening)
        return f"Server(/job:{self.job_name}/task:{self.task_index}, {self.address}{listening})"
