"""The seam between ``ClusterCoordinator`` and its worker threads: ``DispatchState``'s public methods.

Real threads play the worker threads (no network): they take batches with ``next_batch``, put some back
with ``requeue`` (a lost worker), ``finish`` or ``fail`` the rest through the failure policy, as
``WorkerThread`` does. What is pinned: every function runs exactly once (a requeued one once more),
a function error cancels what has not started and is raised once, a fatal error fails everything,
``close`` wakes every waiting thread, and the worker threads' modules touch no other object's privates.
"""

from __future__ import annotations

import ast
import collections
import pathlib
import threading
import time
from collections.abc import Callable

import pytest

import distrib.parameter_server.client as client_pkg
from distrib.parameter_server.client.dispatch_state import Closure, DispatchState
from distrib.parameter_server.client.failure_policy import Decision, FailureKind, FailurePolicy
from distrib.parameter_server.client.remote_value import RemoteValueStatus
from distrib.parameter_server.errors import (
    ClosureCancelledError,
    ParameterServerUnavailableError,
    WorkerUnavailableError,
)
from distrib.parameter_server.transport import pickling


def _square(i: int) -> int:
    return i * i


_PAYLOAD = pickling.dumps(_square, lambda obj: None)


def _state(policy: FailurePolicy | None = None) -> DispatchState:
    return DispatchState(policy or FailurePolicy(), probe_interval=0.01, heartbeat_timeout=None, heartbeat_interval=1.0)


def _closures(state: DispatchState, n: int) -> list[Closure]:
    closures = [Closure(_PAYLOAD, (i,), {}) for i in range(n)]
    for c in closures:
        state.put(c)
    return closures


class _Workers:
    """Threads that play worker threads; the errors they raise are kept for ``stop`` to report."""

    def __init__(
        self, state: DispatchState, count: int, handle: Callable[[Closure], None], batches: list[int] | None = None
    ) -> None:
        self.state, self.handle, self.batches = state, handle, batches if batches is not None else []
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._main, daemon=True) for _ in range(count)]
        for t in self.threads:
            t.start()

    def _main(self) -> None:
        """What WorkerThread does with the state: take a batch (and one ahead, as a busy worker does), settle each."""
        state = self.state
        try:
            while not state.closed:
                batch = state.next_batch()
                if not batch:
                    return
                batch += state.next_batch(block=False)
                self.batches.append(len(batch))
                if not state.may_send():  # an error came since they were taken: they are cancelled, not run
                    for closure in reversed(batch):
                        state.requeue(closure)
                    continue
                for closure in batch:
                    self.handle(closure)
        except BaseException as e:  # noqa: BLE001 - reported by stop(), not lost in a thread
            self.errors.append(e)

    def stop(self) -> None:
        self.state.close()  # wakes every thread blocked in next_batch
        for t in self.threads:
            t.join(timeout=10)
        assert not any(t.is_alive() for t in self.threads), "close() left a worker thread waiting"
        assert not self.errors, self.errors


def test_every_closure_runs_exactly_once_and_a_requeued_one_runs_again_under_concurrent_threads():
    state = _state()
    ran: collections.Counter[int] = collections.Counter()
    lost: set[int] = set()
    lock = threading.Lock()

    def handle(closure: Closure) -> None:
        (i,) = closure.args
        with lock:
            lose = i % 7 == 0 and i not in lost
            lost.add(i)
        if lose:  # its worker was lost: the policy retries it, at the front of the queue
            assert state.decide(FailureKind.WORKER_LOST, closure) is Decision.RETRY
            state.settle(closure, WorkerUnavailableError("w:1", "lost", "/job:worker/task:0"), Decision.RETRY)
            return
        with lock:
            ran[i] += 1
        state.observe(closure, 1e-5)  # short: later batches take several
        state.finish(closure, _square(i))

    batches: list[int] = []
    closures = _closures(state, 300)
    workers = _Workers(state, 4, handle, batches)
    assert state.wait(timeout=30)
    assert state.pending_count == 0 and state.inflight_count == 0
    assert ran == collections.Counter(range(300))  # each exactly once, none lost
    for c in closures:
        (i,) = c.args
        assert c.value.status is RemoteValueStatus.READY and c.value.fetch() == i * i
        assert c.value.attempts == (2 if i % 7 == 0 else 1)
    assert max(batches) > 1  # observed run times let a worker take several short functions at once
    workers.stop()
    assert state.next_batch() == []  # closed: a thread asking again ends


def test_a_function_error_cancels_what_has_not_started_and_is_raised_once():
    state = _state()
    started: collections.Counter[int] = collections.Counter()
    lock = threading.Lock()

    def handle(closure: Closure) -> None:
        (i,) = closure.args
        with lock:
            started[i] += 1
        time.sleep(0.002)
        if i == 3:
            error = ValueError("function 3 failed")
            state.settle(closure, error, state.decide(FailureKind.FUNCTION_ERROR, closure))
        else:
            state.finish(closure, i)

    closures = _closures(state, 200)
    workers = _Workers(state, 2, handle)
    with pytest.raises(ValueError, match="function 3 failed"):
        state.wait(timeout=30)
    assert state.wait(timeout=1) and state.done()  # raised once, then forgotten (TF)
    statuses = collections.Counter(c.value.status for c in closures)
    assert statuses[RemoteValueStatus.FAILED] == 1 and statuses[RemoteValueStatus.CANCELLED] > 0
    assert set(statuses) <= {RemoteValueStatus.READY, RemoteValueStatus.FAILED, RemoteValueStatus.CANCELLED}
    for c in closures:
        (i,) = c.args
        if c.value.status is RemoteValueStatus.CANCELLED:
            assert started[i] == 0  # cancellation drained it before any thread took it
            with pytest.raises(ClosureCancelledError, match="function 3 failed"):
                c.value.fetch()
        else:
            assert started[i] == 1
    state.put(Closure(_PAYLOAD, (7,), {}))  # scheduling works again
    assert state.wait(timeout=10)
    workers.stop()


def test_an_error_cancels_the_queue_atomically_then_what_was_taken_and_not_sent_or_given_back():
    state = _state()
    seen: list = []
    state.on_error(
        lambda: (
            seen.append(("hook", state.pending_count, closures[4].value.status)) or (lambda: seen.append("finished"))
        )
    )
    state.on_error(lambda: seen.append("second hook") and None)
    closures = _closures(state, 5)
    failing, also, taken, lost = (state.next_batch() for _ in range(4))  # each alone: never run before
    assert state.may_send()
    state.settle(failing[0], ValueError("boom"), state.decide(FailureKind.FUNCTION_ERROR, failing[0]))
    # the queue was emptied with the error recorded; then every hook was started, then finished
    assert seen == [("hook", 0, RemoteValueStatus.CANCELLED), "second hook", "finished"]
    state.settle(also[0], ValueError("boom too"), state.decide(FailureKind.FUNCTION_ERROR, also[0]))
    assert len(seen) == 3 and also[0].value.status is RemoteValueStatus.FAILED  # nothing new to cancel: no hooks
    assert not state.may_send()  # taken before the error and not sent: its thread gives it back...
    state.requeue(taken[0])  # ...and it is cancelled (RUNNING -> CANCELLED), as is a lost worker's function (TF)
    state.settle(lost[0], WorkerUnavailableError("w:1", "lost", "/job:worker/task:1"), Decision.RETRY)
    assert state.pending_count == 0 and state.inflight_count == 0
    for c in (taken[0], lost[0], closures[4]):
        assert c.value.status is RemoteValueStatus.CANCELLED
        with pytest.raises(ClosureCancelledError, match="boom"):
            c.value.fetch()
    with pytest.raises(ValueError, match="boom"):
        state.wait(timeout=1)
    assert state.may_send()  # raised: the coordinator is usable again
    again = Closure(_PAYLOAD, (5,), {})
    state.put(again)
    [taken_again] = state.next_batch()
    state.finish(taken_again, 25)
    assert state.wait(timeout=1) and again.value.fetch() == 25


def test_a_fatal_error_fails_the_rest_and_every_later_call():
    state = _state()
    gone = ParameterServerUnavailableError("p:1", "gone", "/job:ps/task:0")
    closures = _closures(state, 3)
    first, second = state.next_batch(), state.next_batch()
    assert [c.args for c in first + second] == [(0,), (1,)]
    state.settle(first[0], gone, state.decide(FailureKind.PS_LOST, first[0]))  # RAISE_FATAL
    assert closures[2].value.status is RemoteValueStatus.FAILED  # not started, failed with it
    state.requeue(second[0])  # its worker was lost meanwhile: nothing will run it any more
    assert second[0].value.status is RemoteValueStatus.FAILED
    for call in (lambda: state.wait(timeout=1), state.done, lambda: state.put(Closure(_PAYLOAD, (9,), {}))):
        with pytest.raises(ParameterServerUnavailableError):
            call()


def test_the_failure_policy_bounds_retries_of_a_lost_worker_s_function():
    state = _state(FailurePolicy(max_attempts=2))
    (closure,) = _closures(state, 1)
    lost = WorkerUnavailableError("w:1", "lost", "/job:worker/task:0")
    for attempt in (1, 2):
        (taken,) = state.next_batch()
        assert taken is closure and closure.value.attempts == attempt
        state.settle(taken, lost, state.decide(FailureKind.WORKER_LOST, taken))
    assert closure.value.status is RemoteValueStatus.FAILED
    with pytest.raises(WorkerUnavailableError):
        state.wait(timeout=1)


def test_close_wakes_every_thread_waiting_for_a_function():
    state = _state()
    workers = _Workers(state, 3, lambda c: state.finish(c, None))
    time.sleep(0.05)  # all three wait in next_batch on an empty queue
    workers.stop()


def test_released_iterators_are_handed_to_each_worker_once():
    state = _state()
    threads = [threading.Thread(target=state.release_iterator, args=(f"it{i}",)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    told = 5
    released = state.released_since(told)
    assert len(released) == 15 and state.released_count == 20
    assert sorted(state.released_since(0)) == sorted(f"it{i}" for i in range(20))
    assert state.released_since(told + len(released)) == []


def test_the_worker_threads_modules_read_no_other_object_s_private_members():
    """parameter_server/client/ talks through public methods: no ``x._name`` but on self, cls or its own classes."""
    folder = pathlib.Path(client_pkg.__file__).parent
    owned = ("coordinator.py", "dispatch.py", "dispatch_state.py", "remote_value.py", "failure_policy.py")
    found = []
    for name in owned:
        tree = ast.parse((folder / name).read_text())
        own_classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in {"self", "cls", *own_classes})
            ):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found
