"""``ProcessGroupCommunicator``: the :class:`~distrib.comm.communicator.Communicator` over
``torch.distributed`` (gloo on CPU, NCCL on GPU).

With :mod:`~distrib.comm.rendezvous`, this is the only module of distrib that imports
``torch.distributed``. Joining is a rendezvous at the chief's ``host:port`` that waits
at most the configured timeout for every worker; every later collective fails with :class:`CollectiveError` within
the same timeout when a peer is dead or hung, instead of waiting for ever.

Clean exit. A gloo worker thread frees a finished work (and so the work's tensors)
a moment after the caller has seen it complete; freeing a tensor that Python has
seen takes the GIL. If the script ends within that moment, the thread asks for the
GIL while the interpreter finalizes, Python ends the thread, and the process aborts
(``terminate called without an active exception``, exit 134) at the end of a
correct job. So at exit, before the interpreter finalizes, :func:`_shutdown` waits
(at most 2 s) until gloo's threads are idle, then destroys the group.

Under torchrun, rank 0 and the others meet through a store of the attempt's own
(:mod:`distrib.comm.rendezvous`: torchrun's agent keeps its store across restarts,
pytorch#135712). gloo binds to the interface that routes to the chief
(:mod:`distrib.comm.interfaces`: a host name that resolves to ``127.0.1.1`` is refused
across hosts, naming ``GLOO_SOCKET_IFNAME``).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import pickle
import socket
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.futures import Future

from distrib import torch_patches
from distrib.comm.communicator import CollectiveError
from distrib.comm.failures import is_collective_failure
from distrib.comm.interfaces import InterfaceChoice, choose_interface, configure_interface
from distrib.comm.options import CommunicationOptions
from distrib.comm.rendezvous import attempt_store, connect_store, tcp_store, uses_agent_store
from distrib.comm.step_errors import StepErrorBoard, describe

__all__ = [
    "InterfaceChoice",
    "ProcessGroupCommunicator",
    "choose_interface",
    "current_group",
    "gpu_identity",
    "one_rank_group",
    "shared_gpus",
    "uses_agent_store",
]

log = logging.getLogger("distrib.comm")

T = TypeVar("T")


#: the largest flat buffer a broadcast makes (see ProcessGroupCommunicator.broadcast)
BROADCAST_BUCKET_BYTES = 16 * 1024 * 1024


class ProcessGroupCommunicator:
    """A communicator over the default ``torch.distributed`` process group.

    ``master_address`` is the chief's ``host:port``. When ``torch.distributed`` is
    already initialised with the same rank and world size, that group is used.
    The group is destroyed when the interpreter exits, after pending work is done,
    so that a finished job exits cleanly.
    """

    def __init__(
        self,
        master_address: str,
        rank: int,
        world_size: int,
        options: CommunicationOptions,
        uses_cuda: bool = False,
        hosts: Sequence[str] = (),
        across_hosts: bool | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.options = options
        self._rank, self._world_size = rank, world_size
        self._long_groups: dict[float, Any] = {}  # barrier timeout -> its gloo group (torch without set_timeout)
        self._board: StepErrorBoard | None = None  # the steps' errors, in the store joined through (none: a user's)
        self.backend = options.backend(uses_cuda)
        if dist.is_initialized():
            if dist.get_world_size() != world_size or dist.get_rank() != rank:
                raise CollectiveError(
                    f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                    f"{dist.get_world_size()}, but this cluster says rank {rank} of {world_size}: build the "
                    "strategy without a cluster_resolver to use the initialised group as the cluster, or "
                    "destroy the group (torch.distributed.destroy_process_group()) first"
                )
            self.backend = str(dist.get_backend())
            return
        host, _, port = master_address.rpartition(":")
        host = host.strip("[]")
        configure_interface(host, hosts, across_hosts, self.backend)
        log.info(
            "worker %d/%d joining at %s (%s, timeout %.0fs)",
            rank,
            world_size,
            master_address,
            self.backend,
            options.timeout,
        )
        self.backend, store = _join(
            self.backend,
            host,
            int(port),
            rank,
            world_size,
            options.timeout,
            master_address,
            agent_store=uses_agent_store(master_address),
            gpu=gpu_identity(device),
            nccl_asked=options.implementation.lower() == "nccl",
        )
        self._board = StepErrorBoard(store, rank, world_size, options.timeout)
        atexit.register(_shutdown)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def __repr__(self) -> str:
        return f"ProcessGroupCommunicator(rank={self._rank}, world_size={self._world_size}, backend={self.backend!r})"

    def _failed(self, what: str, error: BaseException, timeout: float | None = None) -> CollectiveError:
        """``what``'s failure: ``timeout`` is the bound the call had (None: the communicator's own). Where other
        workers' steps raised (their lines in the store), the error names them: the collective failed because
        they left it."""
        told = self._board.explain(what, error) if self._board is not None else None
        if told is not None:
            return CollectiveError(told)
        waited = self.options.timeout if timeout is None else timeout
        bound = "CommunicationOptions(timeout_seconds=...)" if timeout is None else "the timeout given for this call"
        return CollectiveError(
            f"{what} across {self._world_size} workers failed on worker {self._rank}: {error}. A peer died or did "
            f"not answer within {waited:g}s (the bound: {bound}); see the other workers' logs for why, and raise "
            "the bound if they were only slower than that"
        )

    def _guard(self, what: str, fn: Callable[[], T], timeout: float | None = None, mixed: bool = False) -> T:
        """``fn()``, its collectives' failures raised as CollectiveError. ``mixed``: ``fn`` runs other code around
        torch's collectives (the user's step): an error of that code is raised as itself
        (:func:`~distrib.comm.failures.is_collective_failure` tells which)."""
        try:
            return fn()
        except CollectiveError:
            raise  # distrib's own verdict, from a collective inside fn
        except (RuntimeError, ValueError) as e:  # gloo/NCCL errors, timeouts, a dead store
            if mixed and not is_collective_failure(e):
                raise
            raise self._failed(what, e, timeout) from e

    def _settable_gloo(self, timeout: float | None) -> Any:
        """The gloo backend whose timeout can be set for one call, or None: no timeout asked, NCCL (bounded by
        the group's own watchdog timeout), or an older torch (2.4 has no ProcessGroupGloo.set_timeout)."""
        if timeout is None or self.backend != "gloo":
            return None
        backend = torch_patches.group_backend(dist.group.WORLD, torch.device("cpu"))
        return backend if hasattr(backend, "set_timeout") else None

    def guarded(self, what: str, fn: Callable[[], T], timeout: float | None = None) -> T:
        return self._guarded(what, fn, timeout, mixed=True)

    def _guarded(self, what: str, fn: Callable[[], T], timeout: float | None, mixed: bool) -> T:
        backend = self._settable_gloo(timeout)
        if backend is None or timeout is None:
            return self._guard(what, fn, mixed=mixed)
        # gloo's timeout, raised for this call (e.g. while every worker writes its shards of a checkpoint)
        backend.set_timeout(datetime.timedelta(seconds=timeout))
        try:
            return self._guard(what, fn, timeout, mixed)
        finally:
            backend.set_timeout(datetime.timedelta(seconds=self.options.timeout))

    def report_step_error(self, error: BaseException | None) -> None:
        if self._board is None:
            return
        if error is None:
            self._board.withdraw()
            return
        self._board.report(f"worker {self._rank} raised {describe(error)}")

    def all_reduce(self, tensors: Sequence[torch.Tensor]) -> None:
        if not tensors:
            return
        if len(tensors) == 1:
            self._guard("all-reduce", lambda: dist.all_reduce(tensors[0]))
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self._guard("all-reduce", lambda: dist.all_reduce(flat))
        offset = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def all_reduce_async(self, tensor: torch.Tensor) -> Future[torch.Tensor]:
        def start() -> Future[torch.Tensor]:
            work = dist.all_reduce(tensor, async_op=True)
            assert work is not None
            # fut.value() re-raises a failed all-reduce: the chained future must fail too
            return work.get_future().then(lambda fut: (fut.value(), tensor)[1])

        return self._guard("all-reduce", start)

    def wait(self, future: Future[Any]) -> Any:
        return self._guard("all-reduce", future.wait)

    def all_gather(self, tensor: torch.Tensor, axis: int = 0) -> torch.Tensor:
        def gather() -> torch.Tensor:
            size = torch.tensor([tensor.shape[axis]], device=tensor.device)
            sizes = [torch.zeros_like(size) for _ in range(self._world_size)]
            dist.all_gather(sizes, size)
            longest = int(max(int(s.item()) for s in sizes))
            pad = list(tensor.shape)
            pad[axis] = longest - tensor.shape[axis]
            padded = torch.cat([tensor, tensor.new_zeros(pad)], dim=axis).contiguous()
            parts = [torch.empty_like(padded) for _ in range(self._world_size)]
            dist.all_gather(parts, padded)
            return torch.cat([p.narrow(axis, 0, int(s.item())) for p, s in zip(parts, sizes)], dim=axis)

        return self._guard("all-gather", gather)

    def all_gather_object(self, obj: Any) -> list[Any]:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        gathered = self.all_gather(data, 0)  # sizes differ: all_gather exchanges them first
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self._world_size)]
        size = torch.tensor([data.numel()])
        self._guard("all-gather", lambda: dist.all_gather(sizes, size))
        out, offset = [], 0
        for n in (int(s.item()) for s in sizes):
            out.append(pickle.loads(gathered[offset : offset + n].numpy().tobytes()))
            offset += n
        return out

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        # in buckets of BROADCAST_BUCKET_BYTES (per dtype run): one flat copy of a whole model would double its
        # memory at the moment a sharded strategy is about to shard it
        bucket: list[torch.Tensor] = []
        size = 0
        for t in tensors:
            if bucket and (
                t.dtype != bucket[0].dtype
                or t.device != bucket[0].device
                or size + t.numel() * t.element_size() > BROADCAST_BUCKET_BYTES
            ):
                self._broadcast_bucket(bucket, src)
                bucket, size = [], 0
            bucket.append(t)
            size += t.numel() * t.element_size()
        if bucket:
            self._broadcast_bucket(bucket, src)

    def _broadcast_bucket(self, tensors: list[torch.Tensor], src: int) -> None:
        flat = torch.cat([t.detach().reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].detach()
        flat = flat.contiguous()
        self._guard("broadcast", lambda: dist.broadcast(flat, src))
        if len(tensors) == 1 and flat.data_ptr() == tensors[0].data_ptr():
            return
        offset = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.all_gather_object(obj if self._rank == src else None)[src]

    def reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.shape[0] % self._world_size:
            raise ValueError(
                f"reduce_scatter needs dim 0 ({tensor.shape[0]}) divisible by the number of "
                f"workers ({self._world_size})"
            )
        out = tensor.new_empty((tensor.shape[0] // self._world_size, *tensor.shape[1:]))
        self._guard("reduce-scatter", lambda: dist.reduce_scatter_tensor(out, tensor.contiguous()))
        return out

    def verify_same(self, signature: str, what: str) -> None:
        # one small all-reduce: every worker fills its own row with a checksum of its signature
        rows = torch.zeros(self._world_size, 2, dtype=torch.int64)
        rows[self._rank] = torch.tensor([1, _crc(signature)])
        self._guard(what, lambda: dist.all_reduce(rows))
        if bool((rows[:, 0] == 1).all()) and bool((rows[:, 1] == rows[0, 1]).all()):
            return
        signatures = self.all_gather_object(signature)  # every worker found the mismatch: all take this path
        raise CollectiveError(
            f"{what} differs between workers ({_difference(signatures)}); every worker must "
            "call it with the same structure, shapes and dtypes"
        )

    def barrier(self, timeout: float | None = None) -> None:
        if timeout is None or self.backend != "gloo" or self._settable_gloo(timeout) is not None:
            # a barrier of its own length (e.g. while the chief writes a checkpoint): gloo's timeout, raised for it
            self._guarded("barrier", lambda: dist.barrier(), timeout, mixed=False)
            return
        # older torch (2.4 has no ProcessGroupGloo.set_timeout): a gloo group of the whole world made with
        # that timeout, once per length (new_group is collective, and every worker reaches this barrier
        # with the same length). monitored_barrier would not do: its waiting ranks keep the group's timeout.
        assert timeout is not None

        def long_barrier() -> None:  # the group's making waits for the others too: inside the guard
            if timeout not in self._long_groups:
                self._long_groups[timeout] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
            dist.barrier(group=self._long_groups[timeout])

        self._guard("barrier", long_barrier, timeout)


def current_group() -> tuple[int, int, str] | None:
    """``(rank, world_size, backend)`` of the default process group when one is initialised, else None.

    A group the user (``mp.spawn`` tutorials) or a framework initialised is the cluster
    ``MultiWorkerMirroredStrategy`` uses when it is given no resolver.
    """
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank(), dist.get_world_size(), str(dist.get_backend())


def one_rank_group(device: torch.device) -> str:
    """A default process group of this process alone (rank 0 of 1), for torch's mesh of a one-worker strategy.

    torch's ``init_device_mesh``, ``parallelize_module`` and ``fully_shard`` need an initialised group even
    where every axis holds one worker. The group meets through an in-process store (``HashStore``: no
    socket, no port; gloo on the loopback interface unless ``GLOO_SOCKET_IFNAME`` says otherwise): gloo for
    CPU tensors, and NCCL for CUDA ones (gloo cannot reduce-scatter them). An
    initialised group of one rank (the script's own) is used as it is. It is destroyed at exit, as a
    joined group is (``torch.distributed.destroy_process_group()`` ends it sooner).

    Args:
        device: the worker's device.

    Returns:
        The group's backend (``"gloo"``, ``"cpu:gloo,cuda:nccl"``, or the initialised group's).

    Raises:
        CollectiveError: a group of several ranks is initialised, or a CUDA device without NCCL.
    """
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise CollectiveError(
                f"a one-worker mesh needs a process group of one rank, but torch.distributed is initialised as "
                f"rank {dist.get_rank()} of {dist.get_world_size()}"
            )
        return str(dist.get_backend())
    backend = "gloo"
    if device.type == "cuda":
        if not dist.is_nccl_available():
            raise CollectiveError(
                f"a mesh on {device} needs NCCL (gloo cannot reduce-scatter CUDA tensors), which this torch "
                f"{torch.__version__} lacks: train on the CPU (devices=['cpu']) or install torch with NCCL"
            )
        backend = "cpu:gloo,cuda:nccl"
    configure_interface("127.0.0.1", ["127.0.0.1"], False, "gloo")  # one rank: nothing leaves the host
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    atexit.register(_shutdown)
    log.info("a one-rank process group (%s) for a one-worker mesh", backend)
    return backend


def gpu_identity(device: torch.device | None) -> str | None:
    """``host/GPU-uuid`` of a CUDA ``device`` (None for another device): two ranks with the same one share a GPU."""
    if device is None or device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return f"{socket.gethostname()}/{uuid if uuid is not None else f'cuda:{index}'}"


def shared_gpus(identities: Sequence[str | None]) -> dict[str, list[int]]:
    """The GPUs that several ranks use, each with its ranks (``identities``: :func:`gpu_identity` of each rank).

    >>> shared_gpus(["h/GPU-1", "h/GPU-1", "h/GPU-2"]), shared_gpus(["a/GPU-1", "b/GPU-1"])
    ({'h/GPU-1': [0, 1]}, {})
    """
    ranks: dict[str, list[int]] = {}
    for rank, key in enumerate(identities):
        if key is not None:
            ranks.setdefault(key, []).append(rank)
    return {key: r for key, r in ranks.items() if len(r) > 1}


def _nccl_or_gloo(store: Any, rank: int, world_size: int, gpu: str | None, nccl_asked: bool) -> str:
    """The backend to initialise where NCCL was chosen: NCCL refuses two ranks on one GPU.

    Every rank publishes its GPU in the store and reads the others'. Where ranks share a GPU
    (several processes per GPU, e.g. on a one-GPU machine), ``implementation="auto"`` falls back
    to gloo, which all-reduces CUDA tensors too, with a warning; ``implementation="nccl"`` is a
    CollectiveError naming the fix instead of NCCL's late ``Duplicate GPU detected``.
    Otherwise ``"cpu:gloo,cuda:nccl"``: NCCL for CUDA tensors, gloo for the small CPU
    collectives distrib makes (agreement checks, objects), which NCCL alone refuses.
    """
    store.set(f"distrib/gpu/{rank}", gpu or "")
    identities = [store.get(f"distrib/gpu/{r}").decode() or None for r in range(world_size)]
    shared = shared_gpus(identities)
    if not shared:
        return "cpu:gloo,cuda:nccl"
    described = "; ".join(f"ranks {ranks} share {key}" for key, ranks in shared.items())
    if nccl_asked:
        raise CollectiveError(
            f"NCCL cannot run two ranks on one GPU ({described}): give each worker its own GPU "
            "(devices=['cuda:N'], CUDA_VISIBLE_DEVICES), or use CommunicationOptions(implementation='ring') "
            "for gloo, which all-reduces CUDA tensors on a shared GPU"
        )
    if rank == 0:
        log.warning(
            "NCCL cannot run two ranks on one GPU (%s): using gloo instead (slower on GPUs); give each "
            "worker its own GPU to use NCCL",
            described,
        )
    return "gloo"


#: how long after the join's deadline torch's own error may take to come before distrib raises its own: every
#: wait of torch's is given what is left of the deadline, so its error comes at the deadline, saying what it waited for
JOIN_GRACE = 0.5
_ARRIVED = "distrib/arrived"


def _join(
    backend: str,
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout: float,
    address: str,
    agent_store: bool = False,
    gpu: str | None = None,
    nccl_asked: bool = False,
) -> tuple[str, Any]:
    """``init_process_group`` within one deadline, ``timeout`` from the call, whatever phase waits.

    Rank 0 hosts the store at ``host:port`` and the others connect to it, as torch's
    ``tcp://`` rendezvous does; under a torchrun agent that keeps its store
    (``agent_store``), the store is this attempt's own (:func:`~distrib.comm.rendezvous.attempt_store`).
    The phases (the store's connect, every worker's arrival at the store, NCCL's GPU check,
    the group's making: gloo's mesh) share the deadline: each is given what is left of it, not
    a fresh ``timeout`` (a store connect that took 1 s, then a group that waited its whole
    timeout, was 1 s over). Once joined, the group's collectives and the
    store get the whole ``timeout`` back. Returns the backend initialised (for ``"nccl"``,
    see :func:`_nccl_or_gloo`) and the store.
    """
    deadline = time.monotonic() + timeout
    outcome: dict[str, Any] = {"phase": f"connecting to the chief's store at {address}"}
    # torch 2.4 cannot change a group's timeout once made: there the group gets the whole timeout, and the
    # thread's join below is the bound
    settable = hasattr(dist.ProcessGroup, "set_timeout")
    decided = threading.Lock()  # the thread's success and the caller's giving up exclude each other

    def left() -> datetime.timedelta:
        return datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.1))

    def rendezvous() -> None:
        try:
            if agent_store:
                run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
                store = attempt_store(host, port, rank, world_size, deadline, run)
            elif rank == 0:
                store = tcp_store(host, port, world_size, True, left().total_seconds())
            else:
                store = connect_store(host, port, world_size, deadline)
            outcome["store"] = store
            outcome["phase"] = "waiting for every worker at the chief's store"
            # every worker's arrival, awaited here against the deadline: gloo's mesh waits for each peer's address
            # in turn, each wait with the group's whole timeout, so a late second worker pushed a missing third's
            # error past the deadline; and the keys name the workers that never came
            store.set(f"{_ARRIVED}/{rank}", "1")
            store.wait([f"{_ARRIVED}/{r}" for r in range(world_size)], left())
            outcome["phase"] = "every worker came; connecting to each other (gloo's mesh)"
            chosen = _nccl_or_gloo(store, rank, world_size, gpu, nccl_asked) if backend == "nccl" else backend
            group_timeout = left() if settable else datetime.timedelta(seconds=timeout)
            dist.init_process_group(chosen, store=store, rank=rank, world_size=world_size, timeout=group_timeout)
            if settable and dist.group.WORLD is not None:
                dist.group.WORLD.set_timeout(datetime.timedelta(seconds=timeout))
            store.set_timeout(datetime.timedelta(seconds=timeout))
            with decided:
                if outcome.get("abandoned"):  # joined just after the caller gave up: leave no group behind
                    dist.destroy_process_group()
                    return
                outcome["backend"] = chosen
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            outcome["error"] = e

    thread = threading.Thread(target=rendezvous, name="distrib-rendezvous", daemon=True)
    thread.start()
    thread.join(max(deadline - time.monotonic(), 0.0) + JOIN_GRACE)
    with decided:
        outcome["abandoned"] = "backend" not in outcome
    error = outcome.get("error")
    if isinstance(error, CollectiveError):  # distrib's own verdict (ranks sharing a GPU) says it all
        raise error
    if outcome["abandoned"]:
        raise CollectiveError(
            f"worker {rank} could not join the {world_size}-worker cluster at {address} within {timeout:g}s: "
            f"{_join_failure(outcome, rank, world_size, alive=thread.is_alive())}. Check that every worker is "
            "started with the same cluster and that the chief's address is reachable from this host, or give "
            "slow starters more time (CommunicationOptions(timeout_seconds=...) sets the bound)"
        ) from error
    return str(outcome["backend"]), outcome["store"]


def _join_failure(outcome: dict[str, Any], rank: int, world_size: int, alive: bool) -> str:
    """What the join waited for when its deadline passed: the phase, the workers that never came, torch's words."""
    error, store = outcome.get("error"), outcome.get("store")
    detail = f" ({error})" if error is not None else " (still waiting)"
    if store is None or alive:  # the store is still in use by the joining thread: ask it nothing
        return f"{outcome['phase']}{detail}"
    try:
        store.set_timeout(datetime.timedelta(seconds=1))
        missing = [r for r in range(world_size) if r != rank and not store.check([f"{_ARRIVED}/{r}"])]
    except (RuntimeError, ValueError):  # the chief, and its store, are gone
        return f"{outcome['phase']}{detail}"
    if missing:
        return f"waited for worker{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}, which never came"
    return f"{outcome['phase']}{detail}"


def _difference(signatures: list[str]) -> str:
    """Each worker's signature, or for long ``"; "``-separated ones the first entry where they differ."""
    items = [sig.split("; ") for sig in signatures]
    first = next((i for i in range(max(map(len, items))) if len({tuple(x[i : i + 1]) for x in items}) > 1), 0)
    if len(items[0]) > 1:
        described = [
            f"worker {w}: {x[first] if first < len(x) else f'nothing after {len(x)} entries'}"
            for w, x in enumerate(items)
        ]
        return f"entry {first}: " + "; ".join(described)
    return "; ".join(f"worker {w}: {sig[:300]}" for w, sig in enumerate(signatures))


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def _gloo_threads_busy() -> bool | None:
    """Whether a gloo worker thread of this process is running (None where /proc cannot tell)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if "gloo" not in f.read():
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
        if state not in ("S", "D"):
            return True
    return False


def _shutdown(limit: float = 2.0) -> None:
    """At exit: let gloo's threads finish freeing their last work while Python still runs, then destroy the group.

    Sleeping releases the GIL, so a gloo thread waiting for it gets it; three idle
    looks 10 ms apart mean every thread is back to waiting for work.
    """
    deadline = time.monotonic() + limit
    idle = 0
    while idle < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
        busy = _gloo_threads_busy()
        if busy is None:  # no /proc: a fixed pause instead
            time.sleep(0.2)
            break
        idle = 0 if busy else idle + 1
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer already gone: nothing left to clean
            pass
