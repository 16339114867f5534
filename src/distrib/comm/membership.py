"""Fault-tolerant membership: the workers that lose a peer agree on who is left and go on in a new group.

:class:`FaultTolerantCommunicator` is a :class:`~distrib.comm.process_group.ProcessGroupCommunicator`
whose membership may shrink while training runs (``MultiWorkerMirroredStrategy(fault_tolerant=True)``).
It meets the other workers through a ``torch.distributed`` ``TCPStore`` that outlives any one of them:
``distrib launch --fault-tolerant`` hosts it in the launcher and names it in
``DISTRIB_FAULT_TOLERANT_STORE`` (so the chief's death does not take the store with it), and writes
there when a task exits (``dead/ID``) or is stopped (``stopped/ID``, a SIGSTOP the launcher sees in
``/proc``).

Generations. Generation 0 is every worker; until the first ``strategy.run`` its collectives (the
chief's values, sent while every worker builds its model) wait as long as its making, at least
60 s, for workers that start seconds apart; from the first step on, the timeout applies. When a
collective fails (a peer died: gloo's closed
connection; a peer hung: the collective's timeout), each worker that sees it

1. destroys its process group, so that a peer still waiting in it fails at once instead of at its timeout
   (a thread of each worker also aborts the group as soon as the launcher records a member's exit: a
   collective waiting for a live member that itself waits for the dead one fails then too);
2. writes its state (:class:`WorkerState`: steps applied, whether it holds the fully reduced
   gradients of the step in flight, where it was) under ``g{N+1}/state/ID``;
3. waits, at most the communicator's timeout, until every member of generation N has written its
   state or is dead or stopped by the launcher's account; a member that does neither is left out;
4. proposes the members that wrote, and takes whichever proposal reached the store first
   (``compare_set``): every worker then holds the same membership;
5. makes a new gloo group of those members through a ``PrefixStore`` of generation N+1 (ranks in
   the order of the workers' first ranks); a failure there starts generation N+2.

A worker left out of the new membership (stopped past the timeout, then continued) raises
:class:`MembershipLost`: it never trains on alone. What each worker does next is decided from
everyone's state by :func:`plan`, the same pure function on every worker: apply the step whose
gradients it holds (another member applied it), redo the step, or repeat a collective that failed
outside a step.

Collectives outside ``strategy.run`` (``strategy.reduce`` of a step's loss) are repeated in the
new group when every member failed at the same one; their result then lacks the lost workers'
share, which a warning says. Where members stopped at different points, every member raises the
same :class:`~distrib.comm.communicator.CollectiveError`.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from distrib.comm.communicator import CollectiveError
from distrib.comm.options import CommunicationOptions
from distrib.comm.process_group import ProcessGroupCommunicator, _shutdown
from distrib.comm.rendezvous import connect_store

__all__ = [
    "STORE_VARIABLE",
    "FaultTolerantCommunicator",
    "MembershipLost",
    "WorkerState",
    "plan",
    "store_key",
]

log = logging.getLogger("distrib.comm")

T = TypeVar("T")

#: the environment variable that names the store (``host:port``) ``distrib launch --fault-tolerant`` hosts
STORE_VARIABLE = "DISTRIB_FAULT_TOLERANT_STORE"
#: every key distrib writes in that store starts with this
ROOT = "distrib/ft"
#: the first group's making waits at least this long for every worker (processes start seconds apart)
FIRST_JOIN_SECONDS = 60.0
#: how often a recovering worker looks at the store
POLL_SECONDS = 0.01
#: how often every worker looks for exits the launcher recorded
WATCH_SECONDS = 0.05


def store_key(*parts: object) -> str:
    """A key of the fault-tolerance store: ``store_key("dead", 2)`` is ``"distrib/ft/dead/2"``."""
    return "/".join([ROOT, *map(str, parts)])


class MembershipLost(CollectiveError):
    """This worker is no longer a member: the others went on without it (it was stopped or cut off too long)."""


@dataclass(frozen=True)
class WorkerState:
    """What a worker tells the others when a collective failed.

    Attributes:
        applied: the optimizer steps it applied so far.
        in_step: whether it was inside ``strategy.run`` (else between steps, in a collective of its own).
        held: inside a step, whether it holds the gradients of step ``applied + 1`` reduced over every member
            (it reached the commit gate).
        outside_done: between steps, the collectives it completed since its last applied step.
    """

    applied: int
    in_step: bool
    held: bool = False
    outside_done: int = 0


def plan(states: dict[int, WorkerState], me: int) -> str:
    """What worker ``me`` does once the members (``states``: each member's) agreed, the same rule on every member.

    Returns ``"apply"`` (apply the held step: another member applied it), ``"redo"`` (run the step in
    flight again over the new membership) or ``"retry"`` (repeat the collective that failed between steps).

    Raises:
        CollectiveError: the members stopped at different points that cannot be lined up (every member raises it).

    Example::

        >>> plan({0: WorkerState(5, True, held=True), 1: WorkerState(6, True)}, 0)
        'apply'
        >>> plan({0: WorkerState(5, True), 1: WorkerState(5, True, held=True)}, 1)
        'redo'
    """
    target = max(s.applied for s in states.values())

    def next_collective(s: WorkerState) -> tuple[str, int] | None:
        if s.in_step and s.applied == target:
            return ("step", 0)
        if s.in_step and s.held and s.applied == target - 1:
            # applies, then meets the others wherever they are: no member can have passed a collective after the
            # step it holds, since each needed this member
            return None
        if not s.in_step and s.applied == target:
            return ("between", s.outside_done)
        raise CollectiveError(
            f"after a fault the workers are more than one step apart ({_describe(states)}): this cannot happen "
            "unless a step applied without the commit gate; restart from the last checkpoint"
        )

    ahead = {next_collective(s) for s in states.values()} - {None}
    if len(ahead) > 1:
        raise CollectiveError(
            f"a worker was lost while the others were at different points ({_describe(states)}): a collective "
            "outside strategy.run (strategy.reduce, a metric's result, a barrier) completed on some workers and "
            "not on others, so none can be repeated alike. Reduce the step's values inside the step function, "
            "or restart from the last checkpoint"
        )
    mine = states[me]
    if mine.in_step:
        return "apply" if mine.applied < target else "redo"
    return "retry"


def _describe(states: dict[int, WorkerState]) -> str:
    return "; ".join(
        f"worker {m}: {s.applied} steps applied, "
        + (("holding the next" if s.held else "in a step") if s.in_step else f"{s.outside_done} collectives after")
        for m, s in sorted(states.items())
    )


class FaultTolerantCommunicator(ProcessGroupCommunicator):
    """A process-group communicator whose membership shrinks when a worker dies or hangs (see the module docstring).

    ``store_address``: the store that outlives the workers (``host:port``, what ``distrib launch
    --fault-tolerant`` sets in ``DISTRIB_FAULT_TOLERANT_STORE``); ``member_id``: this worker's rank in
    the full cluster, its name in the store for good. ``rank`` and ``world_size`` are this worker's
    place in the current membership; :attr:`members` and :attr:`lost` name the workers by member id.

    Raises:
        ValueError: a backend other than gloo is asked for (NCCL cannot be rebuilt this way yet).
    """

    def __init__(
        self, store_address: str, member_id: int, world_size: int, options: CommunicationOptions, uses_cuda: bool
    ) -> None:
        backend = options.backend(uses_cuda)
        if backend != "gloo":
            raise ValueError(
                "MultiWorkerMirroredStrategy(fault_tolerant=True) runs over gloo (CPU tensors); this worker would "
                f"use {backend!r}: train on the CPU (devices=['cpu']) or leave fault_tolerant off"
            )
        if dist.is_initialized():
            raise ValueError(
                "MultiWorkerMirroredStrategy(fault_tolerant=True) makes its own process groups, one per membership, "
                "but torch.distributed is already initialised: do not call init_process_group in the script"
            )
        host, _, port = store_address.rpartition(":")
        self._host = host.strip("[]")
        self._timeout = options.timeout
        join = max(options.timeout, FIRST_JOIN_SECONDS)
        self._store = connect_store(self._host, int(port), world_size, time.monotonic() + join)
        self._store.set_timeout(datetime.timedelta(seconds=join))
        self._id = member_id
        self._members = list(range(world_size))
        self._lost: list[int] = []
        self._generation = 0
        self._applied = 0
        self._in_step = False
        self._held = False
        self._outside_done = 0
        self._recovering = False
        # until the first step the group's collectives (the chief's values, sent while every worker builds its
        # model) wait as long as the first join, for workers that start seconds apart; then the timeout applies
        self._armed = False
        self._fingerprint = 0  # the checksum of the step's global batch, compared at the gate
        self._depth = 0  # nested collectives of one call (all_gather_object's all_gather): only the outer one retries
        self._retried_warning: int | None = None
        #: the collective failure seen inside the current step (the step guard recovers from it)
        self.step_failure: CollectiveError | None = None
        self._form_group(0, self._members, join)
        self._store.set_timeout(datetime.timedelta(seconds=options.timeout))
        super().__init__(f"{host}:{port}", member_id, world_size, options)  # takes the group just made
        atexit.register(_shutdown)
        self._group_lock = threading.Lock()  # the death watcher's abort and a recovery's group swap exclude each other
        self._closing = threading.Event()
        self._watcher = threading.Thread(
            target=self._watch_deaths, args=(self._host, int(port)), name="distrib-death-watch", daemon=True
        )
        self._watcher.start()
        atexit.register(self._stop_watching)
        log.info("worker %d joined the fault-tolerant group of %d (store %s)", member_id, world_size, store_address)

    # ------------------------------------------------------------------ what the strategy reads
    @property
    def member_id(self) -> int:
        """This worker's rank in the full cluster: its name in the store whatever its current rank."""
        return self._id

    @property
    def members(self) -> tuple[int, ...]:
        """The member ids of the current membership, in rank order."""
        return tuple(self._members)

    @property
    def lost(self) -> tuple[int, ...]:
        """The member ids left out so far, in the order they were lost."""
        return tuple(self._lost)

    @property
    def generation(self) -> int:
        """How many times the membership changed."""
        return self._generation

    @property
    def applied_steps(self) -> int:
        """The optimizer steps this worker applied through the commit gate."""
        return self._applied

    def __repr__(self) -> str:
        return (
            f"FaultTolerantCommunicator(rank={self._rank}, world_size={self._world_size}, "
            f"members={self._members}, generation={self._generation})"
        )

    # ------------------------------------------------------------------ steps
    def begin_step(self, fingerprint: int = 0) -> None:
        """A ``strategy.run`` starts: a collective failing from now on is the step's to recover from.
        ``fingerprint``: a checksum of the step's global batch, compared across the members at the commit gate."""
        self._in_step, self._held, self.step_failure = True, False, None
        self._fingerprint = fingerprint
        if not self._armed:  # the first step: from now on a peer that does not answer within the timeout is lost
            self._armed = True
            self._set_group_timeout(self._timeout)

    def end_step(self) -> None:
        """The ``strategy.run`` is over (returned or raised)."""
        self._in_step, self._held = False, False

    def commit(self) -> bool:
        """The commit gate of a step whose gradients were reduced: True where every member reduced them (apply).

        One all-reduce of two numbers per member (a row each: present, the global batch's checksum). Where it
        fails, the members agree on the new membership, and this returns True if another member applied the step
        (this worker then applies the gradients it holds, which equal that member's), False if nobody did (the
        step is redone).

        Raises:
            CollectiveError: the members' global batches differ (every member raises it).
        """
        self._held = True
        rows = torch.zeros(self._world_size, 2, dtype=torch.int64)
        rows[self._rank] = torch.tensor([1, self._fingerprint])
        try:
            self.all_reduce([rows])
        except MembershipLost:
            raise
        except CollectiveError:
            if self.recover_step() == "redo":
                return False
        else:
            if bool((rows[:, 1] != rows[0, 1]).any()):
                raise CollectiveError(
                    f"global batch {self._applied} differs between the workers {list(self._members)} (checksums "
                    f"{rows[:, 1].tolist()}): every worker must read the same global batches (same data, same "
                    "order, same shuffle seed) for the survivors of a fault to take over a lost worker's share. "
                    "Data drawn at random differs on every worker unless its generator is seeded alike: call "
                    "torch.manual_seed(SEED) (or give a seeded torch.Generator) before drawing it"
                )
        self._applied += 1
        self._outside_done = 0
        return True

    def recover_step(self) -> str:
        """After a collective failed inside a step: agree on the members, then ``"apply"`` or ``"redo"``."""
        self.step_failure = None  # an error of the recovery itself is the step's outcome, not a fault to recover from
        return self._recover(WorkerState(self._applied, True, held=self._held))

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensors: Sequence[torch.Tensor]) -> None:
        def reduce() -> None:
            if len(tensors) != 1:
                super(FaultTolerantCommunicator, self).all_reduce(tensors)  # through a flat copy already
                return
            flat = tensors[0].detach().clone()  # a failed all-reduce may leave partial sums in its tensor
            super(FaultTolerantCommunicator, self).all_reduce([flat])
            with torch.no_grad():
                tensors[0].copy_(flat)

        self._between_steps("all-reduce", reduce)

    def all_gather(self, tensor: torch.Tensor, axis: int = 0) -> torch.Tensor:
        return self._between_steps(
            "all-gather", lambda: super(FaultTolerantCommunicator, self).all_gather(tensor, axis)
        )

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self._between_steps("all-gather", lambda: super(FaultTolerantCommunicator, self).all_gather_object(obj))

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        self._between_steps("broadcast", lambda: super(FaultTolerantCommunicator, self).broadcast(tensors, src))

    def reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._between_steps(
            "reduce-scatter", lambda: super(FaultTolerantCommunicator, self).reduce_scatter(tensor)
        )

    def verify_same(self, signature: str, what: str) -> None:
        self._between_steps(what, lambda: super(FaultTolerantCommunicator, self).verify_same(signature, what))

    def barrier(self, timeout: float | None = None) -> None:
        self._between_steps("barrier", lambda: super(FaultTolerantCommunicator, self).barrier(timeout))

    def _between_steps(self, what: str, call: Callable[[], T]) -> T:
        """``call()`` (one of this communicator's collectives, whose inputs it makes from the rank of the moment);
        between steps, a fault is recovered from and the whole call repeated in the new group, where every member
        failed at the same collective (:func:`plan`). Inside a step, or inside another such call, it is raised."""
        if self._in_step or self._recovering or self._depth:
            return call()
        self._depth += 1
        try:
            while True:
                try:
                    result = call()
                    break
                except MembershipLost:
                    raise
                except CollectiveError:
                    self._recover(WorkerState(self._applied, False, outside_done=self._outside_done))
                    self._warn_retried(what)
        finally:
            self._depth -= 1
        self._outside_done += 1
        return result

    def _guard(self, what: str, fn: Callable[[], T], timeout: float | None = None, mixed: bool = False) -> T:
        try:
            return super()._guard(what, fn, timeout, mixed)
        except CollectiveError as error:
            if self._in_step:
                self.step_failure = self.step_failure or error
            raise

    def _warn_retried(self, what: str) -> None:
        if self._retried_warning == self._generation:
            return
        self._retried_warning = self._generation
        warnings.warn(
            f"{what} between steps failed when worker(s) {self._lost} were lost; it was repeated over the "
            f"{self._world_size} remaining worker(s), so its result lacks the lost workers' share (a loss summed "
            "with strategy.reduce counts only the remaining workers' examples for this one step)",
            RuntimeWarning,
            stacklevel=4,
        )

    # ------------------------------------------------------------------ recovery
    def _recover(self, state: WorkerState) -> str:
        """Agree on the next membership with the other survivors, make its group, and say what this worker does."""
        with self._group_lock:
            self._recovering = True
        try:
            old = list(self._members)
            started = time.monotonic()
            while True:
                generation = self._generation + 1
                _destroy_group()
                self._store.set(store_key(f"g{generation}", "state", self._id), json.dumps(asdict(state)))
                members = self._agree(generation, old)
                lost = [m for m in old if m not in members]
                if self._id not in members:
                    raise MembershipLost(
                        f"worker {self._id} is no longer a member of the job: the other workers {members} went on "
                        f"without it (generation {generation}), because it did not answer within the "
                        f"{self._timeout:g}s timeout (stopped, hung or cut off). It stops here and never trains on "
                        "alone; its work continues on the others"
                    )
                self._generation, self._members = generation, members
                self._lost.extend(m for m in lost if m not in self._lost)
                states = {
                    m: WorkerState(**json.loads(self._store.get(store_key(f"g{generation}", "state", m))))
                    for m in members
                }
                try:
                    self._form_group(generation, members, self._timeout)
                except (RuntimeError, ValueError) as e:  # another member failed while the group was made
                    log.warning(
                        "worker %d: generation %d could not be made (%s); trying again", self._id, generation, e
                    )
                    old = members
                    continue
                log.warning(
                    "worker %d: worker(s) %s lost; generation %d is %s (%d worker(s)), %.3fs after the fault was seen",
                    self._id,
                    lost,
                    generation,
                    members,
                    len(members),
                    time.monotonic() - started,
                )
                return plan(states, self._id)
        finally:
            with self._group_lock:
                self._recovering = False

    def _watch_deaths(self, host: str, port: int) -> None:
        """A thread: when the launcher records a member's exit, abort the group, so that a collective waiting for
        that member (or for a member waiting for it) fails now rather than at the timeout."""
        try:
            client = connect_store(host, port, 1, time.monotonic() + self._timeout)
        except (RuntimeError, ValueError, TimeoutError):
            return
        seen: set[int] = set()
        while not self._closing.wait(WATCH_SECONDS):
            members = list(self._members)
            try:
                dead = [m for m in members if m not in seen and client.check([store_key("dead", m)])]
            except (RuntimeError, ValueError):  # the launcher, and its store, are gone
                return
            if not dead:
                continue
            seen.update(dead)
            with self._group_lock:
                if self._recovering or not set(dead) & set(self._members) or not dist.is_initialized():
                    continue
                log.info("worker %d: the launcher saw worker(s) %s exit; aborting the group", self._id, dead)
                if dist.group.WORLD is not None:
                    dist.group.WORLD.abort()

    def _stop_watching(self) -> None:
        self._closing.set()
        self._watcher.join(timeout=1.0)

    def _agree(self, generation: int, old: list[int]) -> list[int]:
        """The members of ``generation``: the old members that wrote their state before the timeout, as first
        proposed by any worker (the store's ``compare_set`` keeps the first proposal)."""
        decided = store_key(f"g{generation}", "members")
        deadline = time.monotonic() + self._timeout
        while True:
            if self._store.check([decided]):
                break
            joined = [m for m in old if self._store.check([store_key(f"g{generation}", "state", m)])]
            gone = [
                m
                for m in old
                if m not in joined
                and (self._store.check([store_key("dead", m)]) or self._store.check([store_key("stopped", m)]))
            ]
            if len(joined) + len(gone) == len(old) or time.monotonic() > deadline:
                self._store.compare_set(decided, "", json.dumps(joined))
                break
            time.sleep(POLL_SECONDS)
        return [int(m) for m in json.loads(self._store.get(decided))]

    def _form_group(self, generation: int, members: list[int], timeout: float) -> None:
        """The default process group of ``members`` (this worker's rank: its place among them), through a prefix
        store of ``generation``."""
        rank = members.index(self._id)
        store = dist.PrefixStore(store_key(f"g{generation}", "pg") + "/", self._store)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=len(members), timeout=datetime.timedelta(seconds=timeout)
        )
        self._set_group_timeout(timeout)
        self._rank, self._world_size = rank, len(members)

    def _set_group_timeout(self, seconds: float) -> None:
        if dist.group.WORLD is not None and hasattr(dist.group.WORLD, "set_timeout"):
            dist.group.WORLD.set_timeout(datetime.timedelta(seconds=seconds))


def _destroy_group() -> None:
    """Destroy the default group (a peer in it is dead or hung): a member still waiting in it fails at once."""
    if not dist.is_initialized():
        return
    try:
        if dist.group.WORLD is not None:
            dist.group.WORLD.abort()  # gloo closes its connections: a peer waiting on this worker fails now
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - a group with a dead peer may complain while it goes
        log.debug("destroying the failed group: %s", e)
