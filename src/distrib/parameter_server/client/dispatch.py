"""How scheduled functions reach the workers: the queue, and one thread per worker.

Each worker is driven by one coordinator thread, a small state machine::

    CONNECTING --answers--> IDLE <--> BUSY --call fails (unreachable)--> DOWN --answers--> IDLE

A thread in IDLE takes the next functions from the shared :class:`ClosureQueue` and
calls its worker (BUSY). While a call is out, the thread sends the worker a heartbeat
(a ``Health`` call) every ``heartbeat_interval`` seconds; a worker that has not answered
one for ``heartbeat_timeout`` seconds (hung, stopped with SIGSTOP, or cut off without
the connection closing) is marked DOWN at once, its calls are cancelled and their
functions run elsewhere. Every failure is classified (:class:`FailureKind`) and the
coordinator's :class:`FailurePolicy` decides: a lost worker's functions go back to
the front of the queue, for any worker, and the thread probes its worker until it
answers again (DOWN -> IDLE), then sends it functions and datasets afresh (a
restarted worker has none). A function error fails that function and cancels the
ones not started; a lost parameter server fails everything for good.

Short functions travel in batches: a free worker takes several queued functions at
once while their expected run time (a moving average of what each took before) fits
the coordinator's budget, so a no-op does not cost a whole round trip; a function
that takes longer goes alone, which keeps load balancing and retries fine-grained.
And each worker has one batch waiting beside the one it runs, so it never idles
for a round trip to the coordinator between two functions.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
import uuid
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch.utils._pytree as pytree

from distrib.parameter_server.transport import pickling, wire
from distrib.parameter_server.errors import (ClosureCancelledError, ParameterServerUnavailableError,
                                             PeerUnavailableError, RemoteProtocolError, WorkerUnavailableError,
                                             scheduled_function_error)
from distrib.parameter_server.client.failure_policy import Decision, FailureKind
from distrib.parameter_server.client.remote_value import RemoteValue, RemoteValueStatus
from distrib.parameter_server.scaler import Acknowledgements
from distrib.parameter_server.transport.rpc import WORKER_SERVICE, CallPending, Connection

if TYPE_CHECKING:
    from distrib.parameter_server.client.coordinator import ClusterCoordinator

__all__ = ["WorkerState", "Closure", "ClosureQueue", "PerWorkerIterator", "WorkerThread", "fetch_remote_values"]

log = logging.getLogger("distrib.parameter_server.client.coordinator")


class WorkerState(enum.Enum):
    CONNECTING = "connecting"
    IDLE = "idle"
    BUSY = "busy"
    DOWN = "down"


class Closure:
    __slots__ = ("payload", "args", "kwargs", "value")

    def __init__(self, payload: pickling.Payload, args: tuple, kwargs: dict) -> None:
        self.payload, self.args, self.kwargs = payload, args, kwargs
        self.value = RemoteValue()


class ClosureQueue:
    """Functions not yet run, functions running, and the error to raise from ``join``."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.pending: collections.deque[Closure] = collections.deque()
        self.inflight = 0
        self.idle_workers = 0  # worker threads waiting in take() for a function
        self.error: Optional[BaseException] = None
        self.fatal: Optional[BaseException] = None
        self.closed = False

    def raise_error(self, clear: bool) -> None:
        """Raise the fatal error, or the first function error (forgotten once raised if ``clear``).

        Before a function error is raised and forgotten, the functions still running are
        waited for (call with ``cond`` held): their own errors, if any, stay on their
        RemoteValues, and the error is raised once, as TF's closure queue does, never again
        by a later ``join`` or ``schedule``.
        """
        if self.fatal is not None:
            raise self.fatal
        if self.error is not None:
            if clear:
                while self.inflight > 0 and self.fatal is None:
                    self.cond.wait()
                if self.fatal is not None:
                    raise self.fatal
            error = self.error
            if error is None:  # another thread raised it meanwhile
                return
            if clear:
                self.error = None
            raise error

    def put(self, closure: Closure) -> None:
        with self.cond:
            self.raise_error(clear=True)
            self.pending.append(closure)
            self.cond.notify()

    def take(self, estimate: Callable[[Closure], float], budget: float, limit: int, block: bool = True) -> list[Closure]:
        """The next functions for one worker: one, and more while their estimated run time fits ``budget``.

        Waits for a function when ``block``; otherwise (a busy worker asking for its next batch
        ahead of time) returns ``[]`` if none is queued, or if an idle worker waits for one:
        queued work goes to idle workers first.
        """
        with self.cond:
            while block and not self.pending and not self.closed:
                self.idle_workers += 1
                try:
                    self.cond.wait()
                finally:
                    self.idle_workers -= 1
            if self.closed or not self.pending or (not block and self.idle_workers):
                return []
            batch = [self.pending.popleft()]
            total = estimate(batch[0])
            while self.pending and len(batch) < limit:
                total += estimate(self.pending[0])
                if total > budget:
                    break
                batch.append(self.pending.popleft())
            self.inflight += len(batch)
            for closure in batch:
                closure.value._transition(RemoteValueStatus.RUNNING)
            return batch

    def requeue(self, closure: Closure) -> None:
        with self.cond:
            self.inflight -= 1
            if self.fatal is not None:
                closure.value._transition(RemoteValueStatus.FAILED, error=self.fatal)
            else:
                closure.value._transition(RemoteValueStatus.PENDING)
                self.pending.appendleft(closure)
            self.cond.notify_all()

    def finish(self, closure: Closure, value: Any) -> None:
        with self.cond:
            self.inflight -= 1
            closure.value._transition(RemoteValueStatus.READY, value=value)
            self.cond.notify_all()

    def fail(self, closure: Closure, error: BaseException, fatal: bool) -> None:
        with self.cond:
            self.inflight -= 1
            closure.value._transition(RemoteValueStatus.FAILED, error=error)
            if fatal:
                self.fatal = self.fatal or error
            elif self.error is None:
                self.error = error
            cancelled = ClosureCancelledError(f"not run because an earlier scheduled function failed: {error}")
            while self.pending:
                pending = self.pending.popleft()
                pending.value._transition(RemoteValueStatus.FAILED if fatal else RemoteValueStatus.CANCELLED,
                                          error=error if fatal else cancelled)
            self.cond.notify_all()

    def idle(self) -> bool:
        return not self.pending and self.inflight == 0


class PerWorkerIterator:
    """``iter(per_worker_dataset)``: pass it to scheduled functions; each worker uses its own iterator.

    When the object is garbage-collected on the coordinator, ``on_release(iterator_id)``
    is called, and the workers drop their iterators with the next call they get.
    """

    def __init__(self, dataset_id: str, on_release: Optional[Callable[[str], None]] = None) -> None:
        self.dataset_id = dataset_id
        self.iterator_id = uuid.uuid4().hex[:16]
        if on_release is not None:
            weakref.finalize(self, on_release, self.iterator_id)

    def __iter__(self) -> "PerWorkerIterator":
        return self

    def __next__(self) -> Any:
        raise TypeError("a per-worker iterator is read on the workers: pass it to coordinator.schedule(fn, "
                        "args=(iterator,)) and call next(iterator) inside fn")

    def __reduce__(self) -> tuple:
        raise TypeError("a per-worker iterator cannot be captured by a scheduled function; pass it in args=(...)")


class WorkerThread:
    """One worker task and the coordinator thread that feeds it."""

    def __init__(self, coordinator: "ClusterCoordinator", index: int, address: str,
                 connect: Callable[..., Connection] = Connection) -> None:
        self.index = index
        self.task = f"/job:worker/replica:0/task:{index}"
        self.coordinator = coordinator
        strategy = coordinator.strategy
        self.conn = connect(address, WORKER_SERVICE, strategy.cluster_token, strategy.tls, task=self.task,
                            unavailable=WorkerUnavailableError)
        self.state = WorkerState.CONNECTING
        self.sent_functions: set[str] = set()
        self.sent_datasets: set[str] = set()
        self.released = 0  # how many of the coordinator's released iterators this worker was told of
        self.scaler_acks = Acknowledgements()  # this worker's GradScaler outcomes replayed on the coordinator
        self.thread = threading.Thread(target=self._main, name=f"distrib-coordinator-worker-{index}", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        coordinator = self.coordinator
        queue = coordinator._queue
        while not queue.closed:
            if self.state in (WorkerState.CONNECTING, WorkerState.DOWN):
                self._probe()
                continue
            batch = queue.take(coordinator._estimate, coordinator._batch_seconds, coordinator._max_batch)
            if not batch:
                return
            self.state = WorkerState.BUSY
            self._pipeline(batch)
            batch = []  # drop the finished closures (and the iterators they hold) before waiting for more
            if self.state is WorkerState.BUSY:
                self.state = WorkerState.IDLE

    def _pipeline(self, batch: list[Closure]) -> None:
        """Run ``batch`` and whatever is queued after it, keeping one more batch on the worker.

        While one batch runs there, the next is already sent, so the worker never waits
        for a round trip to the coordinator between two functions.
        """
        coordinator = self.coordinator
        current = self._send(batch)
        while current is not None:
            following = None
            if self.state is WorkerState.BUSY:
                more = coordinator._queue.take(coordinator._estimate, coordinator._batch_seconds,
                                               coordinator._max_batch, block=False)
                following = self._send(more) if more else None
            self._finish(*current)
            current = following  # if the worker was lost, this one fails too and is requeued

    def _probe(self) -> None:
        try:
            self.conn.call("Health", wire.encode({}), timeout=2.0)
        except (PeerUnavailableError, RemoteProtocolError):
            time.sleep(self.coordinator._probe_interval)
            return
        except Exception as e:  # noqa: BLE001 - e.g. a refused token: keep trying, say why
            log.error("%s (%s) refused the health check: %s", self.task, self.conn.address, e)
            time.sleep(max(self.coordinator._probe_interval, 2.0))
            return
        if self.state is WorkerState.DOWN:
            log.info("%s (%s) is back; scheduling functions on it again", self.task, self.conn.address)
        self.sent_functions.clear()
        self.sent_datasets.clear()
        self.released = len(self.coordinator._released)  # a fresh or restarted worker holds none of them
        self.state = WorkerState.IDLE

    # ------------------------------------------------------------------ one batch
    def _request(self, batch: list[Closure], force: bool) -> bytes:
        """The Run request for ``batch``, with the functions and datasets this worker may lack."""
        datasets: set[str] = set()

        def encode_ref(x: Any) -> Any:
            if isinstance(x, PerWorkerIterator):
                datasets.add(x.dataset_id)
                return ["iter", x.iterator_id, x.dataset_id]
            return None

        calls = [{"fn": c.payload.digest, "args": fetch_remote_values(c.args), "kwargs": fetch_remote_values(c.kwargs)}
                 for c in batch]
        payloads = {c.payload.digest: c.payload.data for c in batch if force or c.payload.digest not in self.sent_functions}
        released = self.coordinator._released
        request: dict[str, Any] = {"calls": calls, "options": self.coordinator.strategy.optimizer_options(),
                                   "payloads": payloads, "release": released[self.released:]}
        self.released = len(released)
        scalers = self.coordinator.strategy.scaler_snapshot(self.scaler_acks)
        if scalers is not None:  # the scale each GradScaler's next steps start from
            request["scalers"] = scalers
        body = wire.encode(request, encode_ref=encode_ref)
        needed = {d: self.coordinator._datasets[d].data for d in datasets if force or d not in self.sent_datasets}
        if needed:
            request["datasets"] = needed
            body = wire.encode(request, encode_ref=encode_ref)
        # counted as sent now: a request sent right after this one need not carry them again
        self.sent_functions.update(c.payload.digest for c in batch)
        self.sent_datasets.update(datasets)
        return body

    def _send(self, batch: list[Closure]) -> Optional[tuple[list[Closure], Any]]:
        """Start the call for ``batch``; None if it could not even be sent (then it has been failed)."""
        for closure in batch:
            closure.value.worker = self.task
        try:
            return batch, self.conn.future("Run", self._request(batch, force=False))
        except Exception as e:  # noqa: BLE001 - unsendable arguments, a failed RemoteValue argument
            self._fail(batch, 0, e, self.coordinator._failure_policy.decide(FailureKind.PROTOCOL,
                                                                            batch[0].value.attempts))
            return None

    def _await(self, future: Any) -> bytes:
        """The reply of a call, sending heartbeats while it runs; WorkerUnavailableError if they stop."""
        coordinator = self.coordinator
        timeout, interval = coordinator._heartbeat_timeout, coordinator._heartbeat_interval
        if timeout is None:
            return self.conn.result(future)
        last_answer = time.monotonic()
        while True:
            if self.state is not WorkerState.DOWN:  # DOWN: the batch before this one found the worker lost
                try:
                    return self.conn.result(future, timeout=interval)
                except CallPending:
                    pass
            silent = time.monotonic() - last_answer
            if self.state is not WorkerState.DOWN and silent < timeout:
                try:
                    self.conn.call("Health", wire.encode({}), timeout=max(0.05, min(interval, timeout - silent)))
                    last_answer = time.monotonic()
                except (PeerUnavailableError, RemoteProtocolError):
                    pass
                silent = time.monotonic() - last_answer
            if self.state is WorkerState.DOWN or silent >= timeout:
                self.conn.cancel(future)
                raise WorkerUnavailableError(self.conn.address, f"no answer to heartbeats for {silent:.1f}s (hung, "
                                             f"stopped or cut off; heartbeat_timeout={timeout}s)", self.task)

    def _receive(self, batch: list[Closure], future: Any) -> list[dict]:
        reply = wire.decode(self._await(future))
        for _ in range(2):
            if reply.get("status") != "need":
                break
            self.sent_functions.clear()  # the worker forgot (it was restarted): send everything again
            self.sent_datasets.clear()
            self.released = len(self.coordinator._released)
            reply = wire.decode(self._await(self.conn.future("Run", self._request(batch, force=True))))
        if reply.get("status") == "need":
            raise RemoteProtocolError(f"{self.task} keeps asking for the functions and datasets it was sent")
        if "results" not in reply:
            raise RemoteProtocolError(f"{self.task} failed to run a batch: {reply.get('type')}: "
                                      f"{reply.get('message')}\n{reply.get('traceback', '')}")
        return [wire.decode(r) for r in reply["results"]]

    def _finish(self, batch: list[Closure], future: Any) -> None:
        """Wait for the call of ``batch``; settle every closure in it (ready, failed, or back in the queue)."""
        queue, policy = self.coordinator._queue, self.coordinator._failure_policy
        try:
            replies = self._receive(batch, future)
        except WorkerUnavailableError as e:
            if self.state is not WorkerState.DOWN:
                log.warning("%s (%s) is unavailable; its functions go to another worker", self.task, self.conn.address)
            self.state = WorkerState.DOWN
            for closure in reversed(batch):  # back to the front of the queue, in their order
                if policy.decide(FailureKind.WORKER_LOST, closure.value.attempts) is Decision.RETRY:
                    queue.requeue(closure)
                else:
                    queue.fail(closure, e, fatal=False)
            return
        except Exception as e:  # noqa: BLE001 - refused token, an incompatible worker
            self._fail(batch, 0, e, policy.decide(FailureKind.PROTOCOL, batch[0].value.attempts))
            return
        for i, (closure, reply) in enumerate(zip(batch, replies)):
            status = reply.get("status")
            if status == "ok":
                self.coordinator._observe(closure, reply.get("seconds", 0.0))
                try:  # a function's metric updates and scaler outcomes count once: from the run kept
                    self.coordinator._merge_metrics(reply.get("metrics"))
                    self._merge_scaler_outcomes(reply.get("scaler"))
                except Exception as e:  # noqa: BLE001 - a metric that cannot take the deltas
                    self._fail(batch, i, e, Decision.RAISE)
                    return
                queue.finish(closure, reply.get("result"))
                continue
            if status == "ps_unavailable":
                error: BaseException = ParameterServerUnavailableError(reply["address"], f"seen from {self.task}",
                                                                       reply.get("task") or None)
                kind = FailureKind.PS_LOST
            elif status == "error":
                error = scheduled_function_error(reply["type"], reply["message"], reply["traceback"], self.task)
                kind = FailureKind.FUNCTION_ERROR
            else:
                error, kind = RemoteProtocolError(f"{self.task} answered {reply!r}"), FailureKind.PROTOCOL
            self._fail(batch, i, error, policy.decide(kind, closure.value.attempts))
            return
        if len(replies) < len(batch):
            self._fail(batch, len(replies), RemoteProtocolError(f"{self.task} ran {len(replies)} of "
                                                                f"{len(batch)} functions and said nothing more"),
                       Decision.RAISE)

    def _merge_scaler_outcomes(self, info: Any) -> None:
        """Replay a completed call's GradScaler ``update()`` outcomes on the coordinator's scalers."""
        if info is not None:
            self.coordinator.strategy.merge_scaler_outcomes(info, self.scaler_acks)

    def _fail(self, batch: list[Closure], index: int, error: BaseException, decision: Decision) -> None:
        """Closure ``index`` failed: the ones after it did not run and go back to the queue first."""
        queue = self.coordinator._queue
        for closure in reversed(batch[index + 1:]):
            queue.requeue(closure)
        if decision is Decision.RETRY:
            queue.requeue(batch[index])
        else:
            queue.fail(batch[index], error, fatal=decision is Decision.RAISE_FATAL)


def fetch_remote_values(structure: Any) -> Any:
    """``structure`` with every RemoteValue in it replaced by its result (blocks until known)."""
    return pytree.tree_map(lambda x: x.fetch() if isinstance(x, RemoteValue) else x, structure)
