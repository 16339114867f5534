"""The coordinator's dispatch state: what its worker threads share, behind public methods.

A :class:`~distrib.parameter_server.client.coordinator.ClusterCoordinator` owns one
:class:`DispatchState` and hands it to each of its
:class:`~distrib.parameter_server.client.dispatch.WorkerThread` s; the threads know the
coordinator only through it. It holds:

* the :class:`ClosureQueue`: functions not yet run, the number running, and the error
  ``join`` raises (TF's ``_CoordinatedClosureQueue``). Its methods move each function's
  :class:`~distrib.parameter_server.client.remote_value.RemoteValue` through its life
  cycle: ``take`` (PENDING -> RUNNING), ``requeue`` (RUNNING -> PENDING, to the front;
  CANCELLED once an error is recorded), ``finish`` (-> READY), ``fail`` (-> FAILED, and
  the functions not started are cancelled, or failed too if the error is fatal);
* the error hooks: what each worker thread does when an error is recorded (ask its
  worker to drop the batches sent ahead that have not started), called by ``fail``;
* how short functions are batched: a moving average of each function's run time, so
  that a free worker takes several short ones at once within a budget of expected work;
* the :class:`~distrib.parameter_server.client.failure_policy.FailurePolicy` (retry a
  lost worker's function elsewhere, or raise);
* the datasets the coordinator created and the per-worker iterators it dropped, which
  each worker is sent once;
* the heartbeat and probe settings the threads time their worker with.

Example::

    >>> from distrib.parameter_server.transport import pickling
    >>> state = DispatchState(FailurePolicy(), probe_interval=0.25, heartbeat_timeout=None, heartbeat_interval=1.0)
    >>> closure = Closure(pickling.dumps(len, lambda obj: None), ([1, 2],), {})
    >>> state.put(closure)
    >>> [taken] = state.next_batch()          # what a worker thread does
    >>> state.finish(taken, 2)
    >>> state.wait(timeout=1.0), closure.value.fetch()
    (True, 2)
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from distrib.parameter_server.client.failure_policy import Decision, FailureKind, FailurePolicy
from distrib.parameter_server.client.remote_value import RemoteValue, RemoteValueStatus
from distrib.parameter_server.errors import ClosureCancelledError
from distrib.parameter_server.transport import pickling

__all__ = ["Closure", "ClosureQueue", "DispatchState"]


class Closure:
    """One scheduled call: the pickled function, its arguments, and the RemoteValue its result goes to."""

    __slots__ = ("payload", "args", "kwargs", "value")

    def __init__(self, payload: pickling.Payload, args: tuple, kwargs: dict) -> None:
        self.payload, self.args, self.kwargs = payload, args, kwargs
        self.value = RemoteValue()


class ClosureQueue:
    """Functions not yet run, functions running, and the error to raise from ``join``.

    Every method is safe to call from any thread. Worker threads ``take`` functions and
    settle each one with ``requeue``, ``finish`` or ``fail``; the coordinator ``put`` s them
    and ``wait`` s (``join``) or asks ``done``. A function error is raised once, by the next
    ``put``, ``wait`` or ``done``, and then forgotten, as in TF; a fatal error (a lost
    parameter server) is raised by every later call.

    Cancellation, as TF promises it: ``fail`` records the error and cancels every function
    not taken in one step under the queue's lock, so no ``take`` can get one in between;
    a worker thread asks ``may_send`` (under the same lock) before it sends what it took,
    and a function taken before the error but not sent (or put back by ``requeue``) is
    cancelled instead. Until ``join`` has raised the error (it waits for the functions
    running), nothing can be queued: so after an error nothing queued starts. Functions
    already running on their workers finish; a batch already sent to a worker but not
    started there is the worker threads' to cancel (see
    :meth:`DispatchState.on_error`).

    [Note: the error is recorded before it is published] A batch sent to a worker ahead of
    time can start there until the worker hears of the error. So ``fail`` records the error
    (the queue stops handing out functions at once) but, with ``hold``, keeps it from the
    user: the failed function's RemoteValue, and ``put``/``wait``/``done``, wait until
    ``publish`` is called, which :meth:`DispatchState.fail` does once every worker has
    answered which of its batches it dropped. A function that started did so before the
    error could be seen; none starts after.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: collections.deque[Closure] = collections.deque()
        self._inflight = 0
        self._idle_workers = 0  # worker threads waiting in take() for a function
        self._error: BaseException | None = None
        self._fatal: BaseException | None = None
        self._closed = False
        # the failures recorded and not yet published (see the note in the class docstring): while it is not
        # empty, the workers are being told to drop what they were sent ahead, and no caller sees an error
        self._unpublished: list[tuple[Closure, BaseException]] = []

    # ------------------------------------------------------------------ what the coordinator calls
    def put(self, closure: Closure) -> None:
        """Queue ``closure`` (raises an earlier function error not raised yet, instead of queueing it)."""
        with self._cond:
            self._raise_error(clear=True)
            self._pending.append(closure)
            self._cond.notify()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is pending or running; raise the first error. False if ``timeout`` passed first.

        A fatal error ends the wait at once (the functions still running cannot change it).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (not self._idle() and self._fatal is None) or self._unpublished:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            self._raise_error(clear=True)
        return True

    def done(self) -> bool:
        """Whether nothing is pending or running; raises the first error (as ``wait`` does)."""
        with self._cond:
            self._raise_error(clear=True)
            return self._idle()

    def close(self) -> None:
        """Wake every worker thread waiting in ``take``: from now on it returns ``[]`` (the threads end)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ------------------------------------------------------------------ what the worker threads call
    @property
    def closed(self) -> bool:
        """Whether ``close`` was called: a worker thread that sees it stops."""
        return self._closed

    def take(
        self, estimate: Callable[[Closure], float], budget: float, limit: int, block: bool = True
    ) -> list[Closure]:
        """The next functions for one worker: one, and more while their estimated run time fits ``budget``.

        Waits for a function when ``block``; otherwise (a busy worker asking for its next batch
        ahead of time) returns ``[]`` if none is queued, or if an idle worker waits for one:
        queued work goes to idle workers first. Returns ``[]`` once the queue is closed.
        The functions taken go RUNNING (one more attempt each).
        """
        with self._cond:
            while block and not self._pending and not self._closed:
                self._idle_workers += 1
                try:
                    self._cond.wait()
                finally:
                    self._idle_workers -= 1
            if self._closed or not self._pending or (not block and self._idle_workers):
                return []
            batch = [self._pending.popleft()]
            total = estimate(batch[0])
            while self._pending and len(batch) < limit:
                total += estimate(self._pending[0])
                if total > budget:
                    break
                batch.append(self._pending.popleft())
            self._inflight += len(batch)
            for closure in batch:
                closure.value.transition(RemoteValueStatus.RUNNING)
            return batch

    def may_send(self) -> bool:
        """Whether a worker thread may send the functions it took: False once an error is recorded.

        Asked right before sending; False means an error came since they were taken (while
        functions are taken the error cannot have been raised and cleared): the thread
        ``requeue`` s them, which cancels them.
        """
        with self._cond:
            return self._error is None and self._fatal is None

    def requeue(self, closure: Closure) -> None:
        """A taken function did not run (its worker was lost, or it was never sent or started): back to the front.

        PENDING again, unless an error is recorded: then it is CANCELLED (as TF's
        ``put_back``), or FAILED with a fatal error: nothing queued runs after an error.
        """
        with self._cond:
            self._inflight -= 1
            if self._fatal is not None:
                closure.value.transition(RemoteValueStatus.FAILED, error=self._fatal)
            elif self._error is not None:
                closure.value.transition(RemoteValueStatus.CANCELLED, error=self._cancelled(self._error))
            else:
                closure.value.transition(RemoteValueStatus.PENDING)
                self._pending.appendleft(closure)
            self._cond.notify_all()

    def finish(self, closure: Closure, value: Any) -> None:
        """A taken function returned ``value``: READY."""
        with self._cond:
            self._inflight -= 1
            closure.value.transition(RemoteValueStatus.READY, value=value)
            self._cond.notify_all()

    def fail(self, closure: Closure, error: BaseException, fatal: bool, hold: bool = False) -> bool:
        """A taken function failed with ``error``: FAILED, and every function not taken is cancelled.

        Recording the error and emptying the queue happen under one lock: no worker thread
        takes a function in between. ``fatal`` (a parameter server is gone): the functions not
        started fail with ``error`` too, and every later ``put``, ``wait`` and ``done`` raises it.
        ``hold``: if this is the first error recorded, keep it unpublished until :meth:`publish`
        (``closure`` stays RUNNING, ``put``, ``wait`` and ``done`` wait, and a failure recorded
        meanwhile waits with it). Returns whether this is the first error recorded (none was
        waiting to be raised).
        """
        with self._cond:
            first = self._error is None and self._fatal is None
            self._inflight -= 1
            if (first and hold) or self._unpublished:
                self._unpublished.append((closure, error))
            else:
                closure.value.transition(RemoteValueStatus.FAILED, error=error)
            if fatal:
                self._fatal = self._fatal or error
            elif self._error is None:
                self._error = error
            cancelled = self._cancelled(error)
            while self._pending:
                pending = self._pending.popleft()
                pending.value.transition(
                    RemoteValueStatus.FAILED if fatal else RemoteValueStatus.CANCELLED,
                    error=error if fatal else cancelled,
                )
            self._cond.notify_all()
            return first

    def publish(self) -> None:
        """The workers were told of the recorded error: the failed functions go FAILED, and the error can be raised."""
        with self._cond:
            for closure, error in self._unpublished:
                closure.value.transition(RemoteValueStatus.FAILED, error=error)
            self._unpublished.clear()
            self._cond.notify_all()

    # ------------------------------------------------------------------ introspection
    def idle(self) -> bool:
        """Whether nothing is pending or running (raises nothing, unlike ``done``)."""
        with self._cond:
            return self._idle()

    @property
    def pending_count(self) -> int:
        """How many functions wait to be taken."""
        return len(self._pending)

    @property
    def inflight_count(self) -> int:
        """How many functions were taken and not settled yet."""
        return self._inflight

    @property
    def error(self) -> BaseException | None:
        """The function error the next ``put``/``wait``/``done`` raises (None once raised), or the fatal one."""
        return self._fatal or self._error

    # ------------------------------------------------------------------ internals (call with _cond held)
    @staticmethod
    def _cancelled(error: BaseException) -> ClosureCancelledError:
        return ClosureCancelledError(f"not run because an earlier scheduled function failed: {error}")

    def _idle(self) -> bool:
        return not self._pending and self._inflight == 0

    def _raise_error(self, clear: bool) -> None:
        """Raise the fatal error, or the first function error (forgotten once raised if ``clear``).

        Before a function error is raised and forgotten, the functions still running are
        waited for: their own errors, if any, stay on their RemoteValues, and the error is
        raised once, as TF's closure queue does, never again by a later ``join`` or ``schedule``.
        """
        while self._unpublished:  # the workers are being told of an error: it is raised once they know
            self._cond.wait()
        if self._fatal is not None:
            raise self._fatal
        if self._error is not None:
            if clear:
                while self._inflight > 0 and self._fatal is None:
                    self._cond.wait()
                if self._fatal is not None:
                    raise self._fatal
            error = self._error
            if error is None:  # another thread raised it meanwhile
                return
            if clear:
                self._error = None
            raise error


class DispatchState:
    """What a coordinator shares with its worker threads: the queue, batching, the failure policy, the data.

    ``probe_interval``: seconds between health checks of an unreachable worker.
    ``heartbeat_timeout`` (None: no heartbeat) and ``heartbeat_interval``: how long a worker
    that runs a function may stay silent, and how often it is asked for its health meanwhile.
    ``batch_seconds`` and ``max_batch``: a free worker takes queued functions while their
    expected run time fits ``batch_seconds``, at most ``max_batch`` of them; a function never
    seen before counts as a whole budget (it runs alone). ``ahead_seconds``: a busy worker is
    sent its next batch ahead of time only while its current one is expected to end within
    that many seconds (see :meth:`may_send_ahead`).
    """

    def __init__(
        self,
        failure_policy: FailurePolicy,
        *,
        probe_interval: float,
        heartbeat_timeout: float | None,
        heartbeat_interval: float,
        batch_seconds: float = 0.002,
        max_batch: int = 64,
        ahead_seconds: float = 0.05,
    ) -> None:
        self.failure_policy = failure_policy
        self.probe_interval = probe_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.heartbeat_interval = heartbeat_interval
        self.batch_seconds = batch_seconds
        self.max_batch = max_batch
        self.ahead_seconds = ahead_seconds
        self._queue = ClosureQueue()
        self._seconds: dict[str, float] = {}  # function digest -> moving average of its run time
        self._datasets: dict[str, pickling.Payload] = {}
        # Per-worker iterators the coordinator dropped, in order. Appended to by weakref finalizers,
        # which may run in any thread while it holds any lock: so no lock here (list.append and
        # slicing are atomic), and each worker remembers how many of them it was told of.
        self._released: list[str] = []
        self._error_hooks: list[Callable[[], Callable[[], None] | None]] = []

    # ------------------------------------------------------------------ the queue (the coordinator's side)
    def put(self, closure: Closure) -> None:
        """Queue a scheduled function (raises an earlier function error not raised yet)."""
        self._queue.put(closure)

    def wait(self, timeout: float | None = None) -> bool:
        """What ``join`` waits for: see :meth:`ClosureQueue.wait`."""
        return self._queue.wait(timeout)

    def done(self) -> bool:
        """What ``done`` answers: see :meth:`ClosureQueue.done`."""
        return self._queue.done()

    def close(self) -> None:
        """Stop handing out functions: every worker thread ends at its next ``next_batch``."""
        self._queue.close()

    @property
    def pending_count(self) -> int:
        return self._queue.pending_count

    @property
    def inflight_count(self) -> int:
        return self._queue.inflight_count

    # ------------------------------------------------------------------ the queue (the worker threads' side)
    @property
    def closed(self) -> bool:
        """Whether the coordinator closed: a worker thread that sees it ends."""
        return self._queue.closed

    def next_batch(self, block: bool = True) -> list[Closure]:
        """The next functions for a free worker (see :meth:`ClosureQueue.take`), batched by expected run time."""
        return self._queue.take(self._estimate, self.batch_seconds, self.max_batch, block=block)

    def requeue(self, closure: Closure) -> None:
        """A taken function did not run: back to the front of the queue (see :meth:`ClosureQueue.requeue`)."""
        self._queue.requeue(closure)

    def finish(self, closure: Closure, value: Any) -> None:
        """A taken function returned ``value``: READY."""
        self._queue.finish(closure, value)

    def may_send(self) -> bool:
        """Whether a worker thread may send what it took (see :meth:`ClosureQueue.may_send`)."""
        return self._queue.may_send()

    def fail(self, closure: Closure, error: BaseException, fatal: bool) -> None:
        """A taken function failed for good: see :meth:`ClosureQueue.fail`; then the error hooks run.

        The queue is cancelled first (at once, under its lock); then, for the first error
        recorded (later ones until ``join`` raises it find nothing new to cancel: nothing is
        sent meanwhile), every hook registered with :meth:`on_error` is started, and then
        each is finished: the worker threads ask their workers, all at once, to drop the
        batches sent ahead that have not started. Only then is the error published (see
        :class:`ClosureQueue`): whoever sees it sees no queued function start afterwards.
        """
        if not self._queue.fail(closure, error, fatal, hold=True):
            return
        try:
            finishers = [finish for finish in (hook() for hook in list(self._error_hooks)) if finish is not None]
            for finish in finishers:
                finish()
        finally:  # every worker answered (or could not be asked): the error can be seen
            self._queue.publish()

    def on_error(self, hook: Callable[[], Callable[[], None] | None]) -> None:
        """Call ``hook()`` in the thread that records each function error, after the queue was cancelled.

        ``hook`` starts what it does without waiting and may return a callable that waits for
        it: all hooks are started before any is waited for. A worker thread's hook asks its
        worker to drop the batches it was sent and has not started (a worker thread sends its
        next batch while the current one runs), and cancels their functions.
        """
        self._error_hooks.append(hook)

    def decide(self, kind: FailureKind, closure: Closure) -> Decision:
        """The failure policy's decision on a failure of ``kind`` of ``closure``'s latest attempt."""
        return self.failure_policy.decide(kind, closure.value.attempts)

    def settle(self, closure: Closure, error: BaseException, decision: Decision) -> None:
        """Carry out ``decision`` on a failed ``closure``: requeue it (RETRY) or fail it with ``error``."""
        if decision is Decision.RETRY:
            self.requeue(closure)
        else:
            self.fail(closure, error, fatal=decision is Decision.RAISE_FATAL)

    # ------------------------------------------------------------------ batching
    def _estimate(self, closure: Closure) -> float:
        """Expected run time of a closure; unknown functions count as a whole batch budget (run alone)."""
        return self._seconds.get(closure.payload.digest, self.batch_seconds)

    def may_send_ahead(self, running: list[Closure]) -> bool:
        """Whether a worker that runs ``running`` may be sent its next batch now, to start when ``running`` ends.

        Only when every function in ``running`` was seen before and together they are expected
        to take at most ``ahead_seconds``. A batch sent ahead is taken from the queue now but
        starts later, when the current one ends; an error recorded meanwhile reaches that
        worker only with the coordinator's ``Cancel``. Behind a short batch that gap is short
        (and a round trip saved there is worth most); behind a long or unknown one the next
        function stays in the queue, where an error cancels it at once, as TF's queue does,
        and its worker waits one round trip for it (about a millisecond, against a batch of
        more than ``ahead_seconds``).
        """
        total = 0.0
        for closure in running:
            seconds = self._seconds.get(closure.payload.digest)
            if seconds is None:
                return False
            total += seconds
        return total <= self.ahead_seconds

    def observe(self, closure: Closure, seconds: float) -> None:
        """``closure``'s function ran for ``seconds`` on its worker: update its expected run time."""
        digest = closure.payload.digest
        old = self._seconds.get(digest)
        self._seconds[digest] = seconds if old is None else 0.8 * old + 0.2 * seconds

    # ------------------------------------------------------------------ datasets and iterators
    def add_dataset(self, dataset_id: str, payload: pickling.Payload) -> None:
        """Record a dataset function the coordinator created, to send to each worker that needs it."""
        self._datasets[dataset_id] = payload

    def has_dataset(self, dataset_id: str) -> bool:
        """Whether ``dataset_id`` was created by this coordinator."""
        return dataset_id in self._datasets

    def dataset(self, dataset_id: str) -> pickling.Payload:
        """The pickled dataset function of ``dataset_id``."""
        return self._datasets[dataset_id]

    def release_iterator(self, iterator_id: str) -> None:
        """The coordinator dropped a per-worker iterator: each worker drops its own with its next call."""
        self._released.append(iterator_id)

    @property
    def released_count(self) -> int:
        """How many per-worker iterators were released so far (a worker's starting point when it is fresh)."""
        return len(self._released)

    def released_since(self, count: int) -> list[str]:
        """The iterators released after the first ``count`` (what a worker told of ``count`` has yet to drop)."""
        return self._released[count:]
