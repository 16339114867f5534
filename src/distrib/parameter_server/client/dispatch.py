"""How scheduled functions reach the workers: one thread per worker, fed from the dispatch state.

Each worker is driven by one coordinator thread, a small state machine::

    CONNECTING --answers--> IDLE <--> BUSY --call fails (unreachable)--> DOWN --answers--> IDLE

A thread in IDLE takes the next functions from the coordinator's
:class:`~distrib.parameter_server.client.dispatch_state.DispatchState` (the queue, the
failure policy and the batching that every worker thread shares; a thread knows the
coordinator only through it) and calls its worker (BUSY). While a call is out, the
thread sends the worker a heartbeat (a ``Health`` call) every ``heartbeat_interval`` seconds; a worker that has not answered
one for ``heartbeat_timeout`` seconds (hung, stopped with SIGSTOP, or cut off without
the connection closing) is marked DOWN at once, its calls are cancelled and their
functions run elsewhere. Every failure is classified (:class:`FailureKind`) and the
dispatch state's :class:`FailurePolicy` decides: a lost worker's functions go back to
the front of the queue, for any worker, and the thread probes its worker until it
answers again (DOWN -> IDLE), then sends it functions and datasets afresh (a
restarted worker has none). A function error fails that function and cancels the
ones not started; a lost parameter server fails everything for good.

Cancellation: while a short batch runs (expected to end within the dispatch state's
``ahead_seconds``, 50 ms), a thread sends its worker the next batch (the worker starts it as
soon as the current one ends, without a round trip to the coordinator); behind a long batch,
or one never seen, the next one stays in the queue. Each batch is named (a run id); until its
reply is settled the thread keeps it among its unsettled batches. When any thread records a
function error, the queue is cancelled at once, and every thread asks its worker (``Cancel``)
to drop its unsettled batches that have not started there: those the worker dropped are
cancelled (their RemoteValues go CANCELLED; ``fetch()`` raises ClosureCancelledError), and a
batch sent right after one that failed on the same worker is dropped by the worker itself. A
thread also asks the queue (``may_send``) right before sending what it took, and cancels it
instead if an error came meanwhile. The error is published (the failed function's ``fetch()``,
``join``, ``done`` and ``schedule`` raise it) only once every worker has answered its
``Cancel``. So no queued function starts after the error can be seen: a function that starts
was taken from the queue before the error was recorded, as in TF; functions already running
on workers finish, and their results are kept.

Short functions travel in batches: a free worker takes several queued functions at
once while their expected run time (a moving average of what each took before) fits
the dispatch state's budget, so a no-op does not cost a whole round trip; a function
that takes longer goes alone, which keeps load balancing and retries fine-grained.
And each worker has one batch waiting beside the one it runs, so it never idles
for a round trip to the coordinator between two functions.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.utils._pytree as pytree

from distrib.parameter_server.client.dispatch_state import Closure, DispatchState
from distrib.parameter_server.client.failure_policy import Decision, FailureKind
from distrib.parameter_server.client.remote_value import RemoteValue
from distrib.parameter_server.errors import (
    ParameterServerUnavailableError,
    PeerUnavailableError,
    RemoteProtocolError,
    WorkerUnavailableError,
    scheduled_function_error,
)
from distrib.parameter_server.scaler import Acknowledgements
from distrib.parameter_server.transport import wire
from distrib.parameter_server.transport.rpc import WORKER_SERVICE, CallPending, Connection

if TYPE_CHECKING:
    from distrib.parameter_server.strategy import ParameterServerStrategy

__all__ = ["WorkerState", "PerWorkerIterator", "WorkerThread", "fetch_remote_values"]

log = logging.getLogger("distrib.parameter_server.client.coordinator")

# seconds an error hook waits for a worker's answer to Cancel without a heartbeat (with one: heartbeat_timeout, after
# which a silent worker counts as lost); the error is published after the answers
_CANCEL_TIMEOUT = 10.0


class WorkerState(enum.Enum):
    CONNECTING = "connecting"
    IDLE = "idle"
    BUSY = "busy"
    DOWN = "down"


class PerWorkerIterator:
    """``iter(per_worker_dataset)``: pass it to scheduled functions; each worker uses its own iterator.

    On the coordinator it is only a name (``next()`` of it raises ``TypeError``): a scheduled function
    that gets it in its arguments gets, on its worker, that worker's iterator over its own dataset, made on
    first use and kept across calls. When the object is garbage-collected on the coordinator,
    ``on_release(iterator_id)`` is called, and the workers drop their iterators with the next call they get.
    Made by ``iter(per_worker_dataset)``, not by hand.

    Args:
        dataset_id: the per-worker dataset it iterates.
        on_release: called with ``iterator_id`` when the object is garbage-collected; None: never.
    """

    def __init__(self, dataset_id: str, on_release: Callable[[str], None] | None = None) -> None:
        self.dataset_id = dataset_id
        self.iterator_id = uuid.uuid4().hex[:16]
        if on_release is not None:
            weakref.finalize(self, on_release, self.iterator_id)

    def __iter__(self) -> PerWorkerIterator:
        return self

    def __next__(self) -> Any:
        raise TypeError(
            "a per-worker iterator is read on the workers: pass it to coordinator.schedule(fn, "
            "args=(iterator,)) and call next(iterator) inside fn"
        )

    def __reduce__(self) -> tuple:
        raise TypeError("a per-worker iterator cannot be captured by a scheduled function; pass it in args=(...)")


class WorkerThread:
    """One worker task and the coordinator thread that feeds it.

    ``state`` is the coordinator's dispatch state (shared by all its worker threads);
    ``strategy`` gives the cluster's credentials, the optimizer options and GradScaler
    snapshots sent with each call, and takes back the metric updates and scaler outcomes
    of each completed one. The thread starts at once and ends when ``state`` is closed.
    """

    def __init__(
        self,
        state: DispatchState,
        strategy: ParameterServerStrategy,
        index: int,
        address: str,
        connect: Callable[..., Connection] = Connection,
    ) -> None:
        self.index = index
        self.task = f"/job:worker/replica:0/task:{index}"
        self.dispatch = state
        self.strategy = strategy
        self.conn = connect(
            address,
            WORKER_SERVICE,
            strategy.cluster_token,
            strategy.tls,
            task=self.task,
            unavailable=WorkerUnavailableError,
        )
        self.state = WorkerState.CONNECTING
        self.sent_functions: set[str] = set()
        self.sent_datasets: set[str] = set()
        self.released = 0  # how many of the coordinator's released iterators this worker was told of
        self.scaler_acks = Acknowledgements()  # this worker's GradScaler outcomes replayed on the coordinator
        # batches sent (or about to be) and not settled yet, by run id: whoever removes one (this thread
        # on its reply, or an error hook on the worker's word that it dropped it) settles its functions
        self._unsettled: dict[str, list[Closure]] = {}
        self._unsettled_lock = threading.Lock()
        state.on_error(self._cancel_unstarted)
        self.thread = threading.Thread(target=self._main, name=f"distrib-coordinator-worker-{index}", daemon=True)
        self.thread.start()

    def health(self, timeout: float = 5.0) -> dict:
        """The worker's health reply (task, functions held, bytes sent to/received from the ps tasks)."""
        return wire.decode(self.conn.call("Health", wire.encode({}), timeout=timeout))

    def stop(self, timeout: float = 5.0) -> None:
        """Wait (up to ``timeout`` s) for the thread to end after the dispatch state closed; close the connection."""
        self.thread.join(timeout=timeout)
        self.conn.close()

    def _main(self) -> None:
        state = self.dispatch
        while not state.closed:
            if self.state in (WorkerState.CONNECTING, WorkerState.DOWN):
                self._probe()
                continue
            batch = state.next_batch()
            if not batch:
                return
            self.state = WorkerState.BUSY
            self._pipeline(batch)
            batch = []  # drop the finished closures (and the iterators they hold) before waiting for more
            if self.state is WorkerState.BUSY:
                self.state = WorkerState.IDLE

    def _pipeline(self, batch: list[Closure]) -> None:
        """Run ``batch`` and whatever is queued after it, keeping one more batch on the worker.

        While a batch expected to be short runs there, the next is already sent, so the worker
        does not wait for a round trip to the coordinator between two short functions; behind a
        long one (or one never seen) the next stays in the queue (see
        :meth:`~distrib.parameter_server.client.dispatch_state.DispatchState.may_send_ahead`).
        """
        current = self._send(batch)
        while current is not None:
            following = None
            if self.state is WorkerState.BUSY and self.dispatch.may_send_ahead(current[0]):
                more = self.dispatch.next_batch(block=False)
                following = self._send(more, after=current[1]) if more else None
            self._finish(*current)
            current = following  # if the worker was lost, this one fails too and is requeued

    def _probe(self) -> None:
        try:
            self.conn.call("Health", wire.encode({}), timeout=2.0)
        except (PeerUnavailableError, RemoteProtocolError):
            time.sleep(self.dispatch.probe_interval)
            return
        except Exception as e:  # noqa: BLE001 - e.g. a refused token: keep trying, say why
            log.error("%s (%s) refused the health check: %s", self.task, self.conn.address, e)
            time.sleep(max(self.dispatch.probe_interval, 2.0))
            return
        if self.state is WorkerState.DOWN:
            log.info("%s (%s) is back; scheduling functions on it again", self.task, self.conn.address)
        self.sent_functions.clear()
        self.sent_datasets.clear()
        self.released = self.dispatch.released_count  # a fresh or restarted worker holds none of them
        self.state = WorkerState.IDLE

    # ------------------------------------------------------------------ one batch
    def _request(self, batch: list[Closure], run: str, after: str | None, force: bool) -> bytes:
        """The Run request for ``batch`` (named ``run``, sent to follow ``after``), with the functions and
        datasets this worker may lack."""
        datasets: set[str] = set()

        def encode_ref(x: Any) -> Any:
            if isinstance(x, PerWorkerIterator):
                datasets.add(x.dataset_id)
                return ["iter", x.iterator_id, x.dataset_id]
            return None

        calls = [
            {"fn": c.payload.digest, "args": fetch_remote_values(c.args), "kwargs": fetch_remote_values(c.kwargs)}
            for c in batch
        ]
        payloads = {
            c.payload.digest: c.payload.data for c in batch if force or c.payload.digest not in self.sent_functions
        }
        released = self.dispatch.released_since(self.released)
        request: dict[str, Any] = {
            "calls": calls,
            "options": self.strategy.optimizer_options(),
            "payloads": payloads,
            "release": released,
            "run": run,
        }
        if after is not None:
            request["after"] = after
        self.released += len(released)
        scalers = self.strategy.scaler_snapshot(self.scaler_acks)
        if scalers is not None:  # the scale each GradScaler's next steps start from
            request["scalers"] = scalers
        body = wire.encode(request, encode_ref=encode_ref)
        needed = {d: self.dispatch.dataset(d).data for d in datasets if force or d not in self.sent_datasets}
        if needed:
            request["datasets"] = needed
            body = wire.encode(request, encode_ref=encode_ref)
        # counted as sent now: a request sent right after this one need not carry them again
        self.sent_functions.update(c.payload.digest for c in batch)
        self.sent_datasets.update(datasets)
        return body

    def _send(self, batch: list[Closure], after: str | None = None) -> tuple[list[Closure], str, Any] | None:
        """Start the call for ``batch`` (to run after batch ``after``): ``(batch, run id, future)``.

        None if it was not sent: an error was recorded since it was taken (then it is
        cancelled), or it could not be sent (then it has been failed).
        """
        for closure in batch:
            closure.value.worker = self.task
        run = uuid.uuid4().hex[:16]
        with self._unsettled_lock:  # before may_send: an error recorded after it passed finds the batch here
            self._unsettled[run] = batch
        if not self.dispatch.may_send():
            if self._claim(run) is not None:
                self._requeue(batch)  # an error came since it was taken: cancelled
            return None
        try:
            return batch, run, self.conn.future("Run", self._request(batch, run, after, force=False))
        except Exception as e:  # noqa: BLE001 - unsendable arguments, a failed RemoteValue argument
            if self._claim(run) is not None:
                self._fail(batch, 0, e, self.dispatch.decide(FailureKind.PROTOCOL, batch[0]))
            return None

    def _claim(self, run: str) -> list[Closure] | None:
        """Take batch ``run`` out of the unsettled ones to settle it; None if someone else did already."""
        with self._unsettled_lock:
            return self._unsettled.pop(run, None)

    def _requeue(self, closures: list[Closure]) -> None:
        """Functions taken that did not start: back to the front of the queue in order (cancelled after an error)."""
        for closure in reversed(closures):
            self.dispatch.requeue(closure)

    def _cancel_unstarted(self) -> Callable[[], None] | None:
        """An error was recorded (the queue is cancelled): ask the worker to drop its batches that have not started.

        Starts the ``Cancel`` call and returns what waits for its reply and cancels the
        functions of the batches the worker dropped (or None: nothing is out). The worker
        stops a batch that has started after its current call. A worker that cannot be
        asked leaves things as they are: its batches settle when their replies come.
        """
        with self._unsettled_lock:
            runs = list(self._unsettled)
        if not runs:
            return None
        try:
            timeout = self.dispatch.heartbeat_timeout or _CANCEL_TIMEOUT
            future = self.conn.future("Cancel", wire.encode({"runs": runs}), timeout=timeout)
        except Exception as e:  # noqa: BLE001 - e.g. the channel is closed
            log.debug("could not ask %s to drop its batches: %s", self.task, e)
            return None

        def finish() -> None:
            try:
                reply = wire.decode(self.conn.result(future))
            except Exception as e:  # noqa: BLE001 - unreachable (its thread will see), or a worker without Cancel
                log.debug("%s did not answer the Cancel: %s", self.task, e)
                return
            for run in reply.get("dropped") or ():
                batch = self._claim(run) if isinstance(run, str) else None
                if batch is not None:
                    self._requeue(batch)

        return finish

    def _await(self, future: Any) -> bytes:
        """The reply of a call, sending heartbeats while it runs; WorkerUnavailableError if they stop."""
        timeout, interval = self.dispatch.heartbeat_timeout, self.dispatch.heartbeat_interval
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
                raise WorkerUnavailableError(
                    self.conn.address,
                    f"no answer to heartbeats for {silent:.1f}s (hung, "
                    f"stopped or cut off; heartbeat_timeout={timeout}s)",
                    self.task,
                )

    def _receive(self, batch: list[Closure], run: str, future: Any) -> tuple[list[dict], bool]:
        """The replies of the calls of ``batch`` that ran, and whether the worker cancelled the rest."""
        reply = wire.decode(self._await(future))
        for _ in range(2):
            if reply.get("status") != "need":
                break
            self.sent_functions.clear()  # the worker forgot (it was restarted): send everything again
            self.sent_datasets.clear()
            self.released = self.dispatch.released_count
            reply = wire.decode(self._await(self.conn.future("Run", self._request(batch, run, None, force=True))))
        if reply.get("status") == "need":
            raise RemoteProtocolError(f"{self.task} keeps asking for the functions and datasets it was sent")
        if "results" not in reply:
            raise RemoteProtocolError(
                f"{self.task} failed to run a batch: {reply.get('type')}: "
                f"{reply.get('message')}\n{reply.get('traceback', '')}"
            )
        return [wire.decode(r) for r in reply["results"]], reply.get("cancelled") is True

    def _finish(self, batch: list[Closure], run: str, future: Any) -> None:
        """Wait for the call of ``batch``; settle every closure in it (ready, failed, cancelled, or back in the queue).

        Nothing to do if the worker said it dropped the batch (an error hook cancelled it).
        """
        state = self.dispatch
        with self._unsettled_lock:
            if run not in self._unsettled:
                return
        try:
            replies, cancelled = self._receive(batch, run, future)
        except WorkerUnavailableError as e:
            if self.state is not WorkerState.DOWN:
                log.warning("%s (%s) is unavailable; its functions go to another worker", self.task, self.conn.address)
            self.state = WorkerState.DOWN
            if self._claim(run) is not None:
                for closure in reversed(batch):  # back to the front of the queue, in their order
                    state.settle(closure, e, state.decide(FailureKind.WORKER_LOST, closure))
            return
        except Exception as e:  # noqa: BLE001 - refused token, an incompatible worker
            if self._claim(run) is not None:
                self._fail(batch, 0, e, state.decide(FailureKind.PROTOCOL, batch[0]))
            return
        if self._claim(run) is None:  # the worker dropped it: cancelled already
            return
        for i, (closure, reply) in enumerate(zip(batch, replies)):
            status = reply.get("status")
            if status == "ok":
                state.observe(closure, reply.get("seconds", 0.0))
                try:  # a function's metric updates and scaler outcomes count once: from the run kept
                    self._merge_metrics(reply.get("metrics"))
                    self._merge_scaler_outcomes(reply.get("scaler"))
                except Exception as e:  # noqa: BLE001 - a metric that cannot take the deltas
                    self._fail(batch, i, e, Decision.RAISE)
                    return
                state.finish(closure, reply.get("result"))
                continue
            if status == "ps_unavailable":
                error: BaseException = ParameterServerUnavailableError(
                    reply["address"], f"seen from {self.task}", reply.get("task") or None
                )
                kind = FailureKind.PS_LOST
            elif status == "error":
                error = scheduled_function_error(reply["type"], reply["message"], reply["traceback"], self.task)
                kind = FailureKind.FUNCTION_ERROR
            else:
                error, kind = RemoteProtocolError(f"{self.task} answered {reply!r}"), FailureKind.PROTOCOL
            self._fail(batch, i, error, state.decide(kind, closure))
            return
        if len(replies) < len(batch):
            if cancelled:  # the worker did not start the rest (an error was recorded): cancelled
                self._requeue(batch[len(replies) :])
                return
            self._fail(
                batch,
                len(replies),
                RemoteProtocolError(f"{self.task} ran {len(replies)} of {len(batch)} functions and said nothing more"),
                Decision.RAISE,
            )

    def _merge_metrics(self, deltas: Any) -> None:
        """Add what a completed call added to the workers' copies of metrics into the coordinator's."""
        if deltas:
            merge = getattr(self.strategy, "merge_metric_deltas", None)
            if merge is None:
                raise RemoteProtocolError("a worker sent metric updates but the strategy cannot take them")
            merge(deltas)

    def _merge_scaler_outcomes(self, info: Any) -> None:
        """Replay a completed call's GradScaler ``update()`` outcomes on the coordinator's scalers."""
        if info is not None:
            self.strategy.merge_scaler_outcomes(info, self.scaler_acks)

    def _fail(self, batch: list[Closure], index: int, error: BaseException, decision: Decision) -> None:
        """Closure ``index`` failed: the ones after it did not run and go back to the queue first."""
        for closure in reversed(batch[index + 1 :]):
            self.dispatch.requeue(closure)
        self.dispatch.settle(batch[index], error, decision)


def fetch_remote_values(structure: Any) -> Any:
    """``structure`` with every RemoteValue in it replaced by its result (blocks until known)."""
    return pytree.tree_map(lambda x: x.fetch() if isinstance(x, RemoteValue) else x, structure)
