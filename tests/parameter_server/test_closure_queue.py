"""TF's ``CoordinatedClosureQueueTest`` (tensorflow/python/distribute/coordinator/cluster_coordinator_test.py),
ported against distrib's ``ClosureQueue``: the queue of scheduled functions behind ``ClusterCoordinator``.

TF's ``_CoordinatedClosureQueue`` is internal, as distrib's ``ClosureQueue`` is (it lives in the coordinator's
dispatch state, parameter_server/client/dispatch_state.py), so these ports live beside the other dispatch tests
rather than in tests/conformance/test_cluster_coordinator.py (which ports the public API). ``get`` / ``put_back`` /
``mark_finished`` / ``mark_failed`` are ``take`` / ``requeue`` / ``finish`` / ``fail``; ``wait`` and ``done`` are
the same (what ``ClusterCoordinator.join`` and ``done`` call), and ``stop`` is ``close``. Every call goes through
the queue's public methods, as the worker threads' do. Not ported: testPutGetWithTag (distrib's queue has no tags).
"""

from __future__ import annotations

import collections
import threading
import time

import pytest

from distrib.parameter_server.client.dispatch_state import Closure, ClosureQueue
from distrib.parameter_server.client.remote_value import RemoteValueStatus
from distrib.parameter_server.errors import ClosureCancelledError
from distrib.parameter_server.transport import pickling


def _closure(fn=lambda: 1.0) -> Closure:
    return Closure(pickling.dumps(fn, lambda obj: None), (), {})


def _take(queue: ClosureQueue) -> Closure:
    (closure,) = queue.take(lambda c: 1.0, 0.0, 1)
    return closure


def test_queue_basic():
    """TF: cluster_coordinator_test.py, CoordinatedClosureQueueTest.testBasic."""
    queue = ClosureQueue()
    closure1 = _closure()
    queue.put(closure1)
    assert _take(queue) is closure1
    assert not queue.done()
    queue.requeue(closure1)
    assert _take(queue) is closure1
    queue.finish(closure1, 1.0)
    assert queue.done()
    queue.wait()


def test_queue_process_at_least_once():
    """TF: cluster_coordinator_test.py, CoordinatedClosureQueueTest.testProcessAtLeaseOnce."""
    queue = ClosureQueue()
    labels = ["A", "B", "C", "D", "E"]
    processed = collections.Counter()
    errors = []

    def process_queue():
        try:
            put_back = False
            while True:
                batch = queue.take(lambda c: 1.0, 0.0, 1)
                if not batch:
                    return
                if not put_back:
                    put_back = True
                    queue.requeue(batch[0])
                    continue
                time.sleep(0.05)
                processed[batch[0].args[0]] += 1
                queue.finish(batch[0], None)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    for label in labels:
        queue.put(Closure(_closure().payload, (label,), {}))
    threads = [threading.Thread(target=process_queue, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    for _ in range(4):  # several waits are fine
        queue.wait()
    assert processed == collections.Counter(labels) and not errors
    queue.close()
    for t in threads:
        t.join(timeout=10)


def test_queue_notify_before_wait():
    """TF: cluster_coordinator_test.py, CoordinatedClosureQueueTest.testNotifyBeforeWait."""
    queue = ClosureQueue()
    queue.put(_closure())
    t = threading.Thread(target=lambda: queue.finish(_take(queue), None))
    t.start()
    t.join()
    queue.wait()  # waiting once the function was processed does not block


def test_queue_wait_raise_error_after_mark_failure():
    """TF: cluster_coordinator_test.py, CoordinatedClosureQueueTest.testWaitRaiseErrorAfterMarkFailure."""
    queue = ClosureQueue()
    queue.put(_closure())
    closure = _take(queue)
    failed = threading.Event()

    def mark_failed():
        time.sleep(0.2)
        failed.set()
        queue.fail(closure, ValueError("Some error."), fatal=False)

    t = threading.Thread(target=mark_failed)
    t.start()
    with pytest.raises(ValueError):
        queue.wait()  # does not return before the running function is settled
    assert failed.is_set()
    t.join()
    assert queue.done()


def _two_closures_one_taken() -> tuple[ClosureQueue, Closure, Closure]:
    queue = ClosureQueue()
    closure1, closure2 = _closure(), _closure()
    queue.put(closure1)
    queue.put(closure2)
    assert _take(queue) is closure1
    return queue, closure1, closure2


def test_queue_put_raise_error():
    """TF: cluster_coordinator_test.py, CoordinatedClosureQueueTest.testPutRaiseError."""
    queue, closure1, closure2 = _two_closures_one_taken()
    queue.fail(closure1, ValueError(), fatal=False)
    with pytest.raises(ValueError):
        queue.put(_closure())
    assert queue.done()
    with pytest.raises(ClosureCancelledError, match="not run because an earlier scheduled function failed"):
        closure2.value.fetch()
    queue.put(_closure())  # the error is cleared


def test_queue_wait_raise_error():
    """TF: cluster_coordinator_test.py, CoordinatedClosureQueueTest.testWaitRaiseError."""
    queue, closure1, closure2 = _two_closures_one_taken()
    queue.fail(closure1, ValueError(), fatal=False)
    with pytest.raises(ValueError):
        queue.wait()
    assert queue.done()
    with pytest.raises(ClosureCancelledError):
        closure2.value.fetch()
    queue.wait()  # the error is cleared


def test_queue_done_raise_error():
    """TF: cluster_coordinator_test.py, CoordinatedClosureQueueTest.testDoneRaiseError."""
    queue, closure1, _ = _two_closures_one_taken()
    assert not queue.done()
    queue.fail(closure1, ValueError(), fatal=False)
    with pytest.raises(ValueError):
        queue.done()


@pytest.mark.parametrize("call_wait", [True, False], ids=["Wait", "Put"])
def test_queue_raise_error_after_cancel_closure(call_wait):
    """TF: cluster_coordinator_test.py, CoordinatedClosureQueueTest.testWaitRaiseErrorAfterCancelClosure and
    testPutRaiseErrorAfterCancelClosure."""
    queue, closure1, closure2 = _two_closures_one_taken()
    queue.put(_closure())
    assert _take(queue) is closure2
    assert queue.inflight_count == 2 and queue.pending_count == 1
    queue.fail(closure1, ValueError("Some error."), fatal=False)
    assert queue.inflight_count == 1 and queue.pending_count == 0  # the one not started is cancelled
    closure3 = _closure()

    def fake_cancellation():
        time.sleep(0.2)
        queue.fail(closure2, ValueError("Fake cancellation error."), fatal=False)

    t = threading.Thread(target=fake_cancellation)
    t.start()
    with pytest.raises(ValueError, match="Some error."):  # the first error, not the later one
        if call_wait:
            queue.wait()
        else:
            t.join()
            queue.put(closure3)
    t.join()
    assert queue.idle() and queue.error is None
    with pytest.raises(ValueError, match="Some error."):
        closure1.value.fetch()
    if not call_wait:
        assert closure3.value.status is RemoteValueStatus.PENDING  # refused by put: it was never queued
    with pytest.raises(ValueError, match="Fake cancellation error."):
        closure2.value.fetch()
    test_queue_basic()  # the queue is clear


def test_queue_state_is_restored_after_join_is_called():
    """TF: cluster_coordinator_test.py, CoordinatedClosureQueueTest.testStateIsRestoredAfterJoinIsCalled."""
    queue, closure1, _ = _two_closures_one_taken()
    assert queue.inflight_count == 1
    queue.fail(closure1, ValueError("test error"), fatal=False)
    with pytest.raises(ValueError):
        queue.put(_closure())
    assert queue.error is None
    queue.put(_closure())
    assert queue.error is None


def test_queue_thread_safety():
    """TF: cluster_coordinator_test.py, CoordinatedClosureQueueTest.testThreadSafey."""
    queue = ClosureQueue()
    thread_count, action_count = 10, 20

    def func():
        for i in range(action_count):
            closure = _take(queue)
            if i % 2 == 0:
                queue.requeue(closure)
            else:
                queue.finish(closure, None)

    threads = [threading.Thread(target=func) for _ in range(thread_count)]
    for t in threads:
        t.start()
    for _ in range(thread_count * action_count // 2):
        queue.put(_closure())
    queue.wait()
    assert queue.done()
    for t in threads:
        t.join(timeout=10)
