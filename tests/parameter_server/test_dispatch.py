"""The coordinator's dispatch state machine, driven by fake workers (no network, no processes).

Each fake worker answers the coordinator's calls from a script the test writes:
results, a lost connection, a function error, a lost parameter server. What is
checked is what the coordinator does with them: the RemoteValue transitions, retries
on another worker, probing a lost worker back into use, cancelling, failing for good.
The real workers are exercised in test_parameter_server*.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from distrib.cluster import ClusterSpec
from distrib.parameter_server.client.coordinator import ClusterCoordinator
from distrib.parameter_server.client.remote_value import RemoteValueStatus
from distrib.parameter_server.errors import (
    ClosureCancelledError,
    ParameterServerUnavailableError,
    PeerUnavailableError,
    ScheduledFunctionError,
)
from distrib.parameter_server.transport import wire

# what a fake worker does with call argument x: ("ok", value) | ("lost",) | ("error", message) | ("ps_lost",)
Script = Callable[["FakeWorker", int], tuple[Any, ...]]


class FakeStrategy:
    should_use_with_coordinator = True
    on_coordinator = True
    cluster_token = "token"
    tls = None

    def __init__(self, workers: int) -> None:
        self.cluster_spec = ClusterSpec({"worker": [f"w{i}:1" for i in range(workers)], "ps": ["p:1"]})
        self.cluster_coordinator: ClusterCoordinator | None = None

    def persistent_id(self, obj: Any) -> None:
        return None

    def optimizer_options(self) -> dict[str, Any]:
        return {}

    def scaler_snapshot(self, acks: Any) -> None:
        return None  # no GradScaler in these scripts

    def merge_scaler_outcomes(self, info: Any, acks: Any) -> None:
        raise AssertionError("no GradScaler in these scripts: no outcomes to merge")


class FakeWorker:
    def __init__(
        self,
        script: Script,
        address: str,
        service: str,
        token: str,
        tls: Any = None,
        task: str | None = None,
        unavailable: type[PeerUnavailableError] = PeerUnavailableError,
    ) -> None:
        self.script, self.address, self.task, self.unavailable = script, address, task, unavailable
        self.index = int(address[1:].split(":")[0])
        self.up = True
        self.ran: list[int] = []
        self.lock = threading.Lock()
        self.runs: dict[str, str] = {}  # run id -> "started" | "cancelled", as a worker keeps them
        self.runs_lock = threading.Lock()

    def _down(self) -> PeerUnavailableError:
        return self.unavailable(self.address, "connection refused", self.task)

    def call(self, method: str, payload: bytes, timeout: float | None = None, wait_for_ready: bool = False) -> bytes:
        if not self.up:
            raise self._down()
        if method == "Health":
            return wire.encode({"ok": True})
        return self.result(("Run", payload))

    def future(self, method: str, payload: bytes, timeout: float | None = None) -> Any:
        if method == "Cancel":  # answered at once: drops the batches that have not started
            if not self.up:
                raise self._down()
            dropped = []
            with self.runs_lock:
                for run in wire.decode(payload)["runs"]:
                    if self.runs.get(run, "cancelled") == "cancelled":
                        self.runs[run] = "cancelled"
                        dropped.append(run)
            return wire.encode({"dropped": dropped})
        return ("Run", payload)  # the call happens when its result is asked for: a batch sent ahead waits

    def cancel(self, payload: Any) -> None:
        pass

    def result(self, payload: Any, timeout: float | None = None) -> bytes:
        if not isinstance(payload, tuple):
            return payload  # a Cancel's reply
        payload = payload[1]
        if not self.up:
            raise self._down()
        run = wire.decode(payload).get("run")
        with self.runs_lock:
            if self.runs.get(run) == "cancelled":
                return wire.encode({"results": [], "cancelled": True})
            self.runs[run] = "started"
        results = []
        for call in wire.decode(payload)["calls"]:
            (x,) = call["args"]
            with self.lock:
                outcome = self.script(self, x)
            if outcome[0] == "lost":
                self.up = False
                raise self._down()
            if outcome[0] == "ok":
                self.ran.append(x)
                # 10 ms: over the batch budget (each function alone), within what is sent ahead to a busy worker
                results.append(wire.encode({"status": "ok", "result": outcome[1], "seconds": 0.01}))
                continue
            if outcome[0] == "error":
                reply = {"status": "error", "type": "ValueError", "message": outcome[1], "traceback": "Traceback..."}
            else:
                reply = {"status": "ps_unavailable", "address": "p:1", "task": "/job:ps/task:0", "message": "gone"}
            results.append(wire.encode(reply))
            break
        return wire.encode({"results": results})

    def close(self) -> None:
        pass


def _coordinator(
    script: Script, workers: int = 2, down: tuple[int, ...] = ()
) -> tuple[ClusterCoordinator, dict[int, FakeWorker]]:
    fakes: dict[int, FakeWorker] = {}

    def connect(*args: Any, **kwargs: Any) -> FakeWorker:
        fake = FakeWorker(script, *args, **kwargs)
        fake.up = fake.index not in down
        fakes[fake.index] = fake
        return fake

    coordinator = ClusterCoordinator(FakeStrategy(workers), probe_interval=0.01, connect=connect)  # type: ignore[arg-type]
    return coordinator, fakes


def _state(coordinator: ClusterCoordinator, worker: int) -> str:
    return coordinator.worker_states()[f"/job:worker/replica:0/task:{worker}"]


def _identity(x: int) -> int:
    return x


def _wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_every_function_runs_once_and_its_value_goes_pending_running_ready():
    coordinator, fakes = _coordinator(lambda w, x: ("ok", x * 10))
    values = [coordinator.schedule(_identity, args=(i,)) for i in range(20)]
    coordinator.join(timeout=10)
    assert coordinator.fetch(values) == [i * 10 for i in range(20)]
    assert sorted(fakes[0].ran + fakes[1].ran) == list(range(20))
    assert all(v.status is RemoteValueStatus.READY and v.attempts == 1 for v in values)
    coordinator.close()


def test_a_lost_worker_s_function_runs_again_on_another_and_the_worker_is_used_again_when_back():
    def script(worker: FakeWorker, x: int) -> tuple[Any, ...]:
        if worker.index == 0 and x == 3 and 3 not in lost:
            lost.add(3)
            return ("lost",)
        return ("ok", x)

    lost: set[int] = set()
    coordinator, fakes = _coordinator(script, down=(1,))  # only worker 0 takes the first functions
    assert _state(coordinator, 1) == "connecting"
    values = [coordinator.schedule(_identity, args=(i,)) for i in range(4)]
    _wait_for(lambda: not fakes[0].up)  # worker 0 was lost while running function 3
    assert _state(coordinator, 0) == "down"
    fakes[1].up = True
    coordinator.join(timeout=10)
    assert coordinator.fetch(values) == [0, 1, 2, 3]
    assert values[3].attempts == 2 and values[3].worker == "/job:worker/replica:0/task:1"
    fakes[0].up = True  # back: probed, then used again
    _wait_for(lambda: _state(coordinator, 0) == "idle")
    fakes[1].up = False
    more = [coordinator.schedule(_identity, args=(i,)) for i in range(10, 13)]
    coordinator.join(timeout=10)
    assert coordinator.fetch(more) == [10, 11, 12] and {10, 11, 12} <= set(fakes[0].ran)
    coordinator.close()


def test_a_function_error_fails_it_cancels_the_rest_and_join_raises_once():
    gate = threading.Event()

    def script(worker: FakeWorker, x: int) -> tuple[Any, ...]:
        if x == 0:
            gate.wait(5)  # hold worker 0 so that the error comes while others are queued
        return ("error", "bad input 2") if x == 2 else ("ok", x)

    coordinator, fakes = _coordinator(script, workers=1)
    values = [coordinator.schedule(_identity, args=(i,)) for i in range(6)]
    gate.set()
    with pytest.raises(ScheduledFunctionError, match="bad input 2") as raised:
        coordinator.join(timeout=10)
    assert isinstance(raised.value, ValueError)  # the builtin class of the remote error
    assert values[2].status is RemoteValueStatus.FAILED
    assert {values[i].status for i in range(3, 6)} == {RemoteValueStatus.CANCELLED}
    with pytest.raises(ClosureCancelledError):
        values[5].fetch()
    again = coordinator.schedule(_identity, args=(7,))  # the error was raised: scheduling works again
    coordinator.join(timeout=10)
    assert again.fetch() == 7
    coordinator.close()


def test_an_error_cancels_the_batch_sent_ahead_to_a_busy_worker_at_once_and_it_never_starts():
    gate, started = threading.Event(), threading.Event()

    def script(worker: FakeWorker, x: int) -> tuple[Any, ...]:
        if x == 0:
            started.set()
            gate.wait(10)  # worker 0 runs 0 while 1 waits there, sent ahead
        return ("error", "bad input 2") if x == 2 else ("ok", x)

    coordinator, fakes = _coordinator(script, workers=2, down=(0, 1))
    # the first call of a function runs alone: nothing is sent ahead behind a function of unknown length
    warm = coordinator.schedule(_identity, args=(10,))
    values = [coordinator.schedule(_identity, args=(i,)) for i in range(4)]
    fakes[0].up = True  # takes 10 alone, then 0, and 1 ahead (short so far, and no other worker waits for work)
    _wait_for(lambda: values[1].status is RemoteValueStatus.RUNNING)
    assert warm.fetch() == 10
    # RUNNING means sent: a batch the worker has not started yet may rightly be cancelled too, so
    # wait until worker 0 really runs function 0 (on a loaded machine, the send comes well before)
    assert started.wait(10)
    fakes[1].up = True  # takes 2 (and 3 ahead): 2 fails
    _wait_for(lambda: values[2].status is RemoteValueStatus.FAILED)
    # the queue and the batches sent ahead are cancelled at once, while worker 0 still runs function 0
    _wait_for(lambda: all(values[i].status is RemoteValueStatus.CANCELLED for i in (1, 3)), timeout=2)
    assert values[0].status is RemoteValueStatus.RUNNING and values[1].worker == "/job:worker/replica:0/task:0"
    gate.set()
    with pytest.raises(ScheduledFunctionError, match="bad input 2"):
        coordinator.join(timeout=10)
    assert values[0].fetch() == 0  # running when the error came: it finished
    with pytest.raises(ClosureCancelledError, match="bad input 2"):
        values[1].fetch()
    assert fakes[0].ran == [10, 0] and fakes[1].ran == []  # 1 and 3 never started
    again = coordinator.schedule(_identity, args=(5,))  # after join raised, scheduling works again
    coordinator.join(timeout=10)
    assert again.fetch() == 5
    coordinator.close()


def test_a_lost_worker_s_function_is_cancelled_not_run_again_after_an_error():
    gate, started = threading.Event(), threading.Event()

    def script(worker: FakeWorker, x: int) -> tuple[Any, ...]:
        if x == 0:
            started.set()
            gate.wait(10)
            return ("lost",)  # TF's put_back: after an error, a function given back is cancelled
        return ("error", "bad input 1") if x == 1 else ("ok", x)

    coordinator, fakes = _coordinator(script, workers=2, down=(1,))
    values = [coordinator.schedule(_identity, args=(0,))]
    assert started.wait(10)  # the worker runs it (not only sent): its loss, not a cancel, is what is tested
    fakes[1].up = True
    values.append(coordinator.schedule(_identity, args=(1,)))
    _wait_for(lambda: values[1].status is RemoteValueStatus.FAILED)
    gate.set()
    with pytest.raises(ScheduledFunctionError, match="bad input 1"):
        coordinator.join(timeout=10)
    assert values[0].status is RemoteValueStatus.CANCELLED and values[0].attempts == 1
    assert fakes[1].ran == []
    coordinator.close()


def test_a_lost_parameter_server_fails_the_coordinator_for_good():
    coordinator, _ = _coordinator(lambda w, x: ("ps_lost",) if x == 1 else ("ok", x), workers=1)
    values = [coordinator.schedule(_identity, args=(i,)) for i in range(3)]
    with pytest.raises(ParameterServerUnavailableError, match="restart the cluster"):
        coordinator.join(timeout=10)
    assert values[0].fetch() == 0 and values[1].status is RemoteValueStatus.FAILED
    with pytest.raises(ParameterServerUnavailableError):
        coordinator.schedule(_identity, args=(9,))
    coordinator.close()


def test_one_coordinator_per_strategy_built_once_and_made_anew_after_close():
    """TF's ``ClusterCoordinator(strategy)`` gives the strategy's coordinator; distrib's runs ``__init__`` once."""
    connects: list[str] = []

    def connect(*args: Any, **kwargs: Any) -> FakeWorker:
        connects.append(args[0])
        return FakeWorker(lambda w, x: ("ok", x), *args, **kwargs)

    strategy = FakeStrategy(2)
    built: list[ClusterCoordinator] = []
    barrier = threading.Barrier(4)

    def build() -> None:
        barrier.wait()  # four threads construct at once: one coordinator
        built.append(ClusterCoordinator(strategy, probe_interval=0.01, connect=connect))  # type: ignore[arg-type]

    with pytest.warns(UserWarning, match="already has a coordinator.*ignored"):  # the three that found it
        threads = [threading.Thread(target=build) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
    first = built[0]
    assert all(c is first for c in built) and strategy.cluster_coordinator is first
    assert ClusterCoordinator(strategy) is first  # type: ignore[arg-type]
    assert sorted(connects) == ["w0:1", "w1:1"]  # __init__ ran once: one connection per worker, no more
    assert first.fetch(first.schedule(_identity, args=(5,))) == 5
    first.close()
    assert strategy.cluster_coordinator is None
    second = ClusterCoordinator(strategy, probe_interval=0.01, connect=connect)  # type: ignore[arg-type]
    assert second is not first and strategy.cluster_coordinator is second and len(connects) == 4
    second.close()
