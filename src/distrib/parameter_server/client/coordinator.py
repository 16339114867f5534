"""``ClusterCoordinator``: schedules functions on the workers of a ``ParameterServerStrategy``.

Two state machines run it:

* each scheduled function's :class:`~distrib.coordinator.RemoteValue` (see
  :mod:`~distrib.parameter_server.client.remote_value` for the transitions: PENDING,
  RUNNING, READY, FAILED, CANCELLED);
* each worker, driven by one coordinator thread (CONNECTING, IDLE, BUSY, DOWN; see
  :mod:`~distrib.parameter_server.client.dispatch`), whose failures a
  :class:`~distrib.parameter_server.client.failure_policy.FailurePolicy` turns into a retry
  on another worker or an error raised by ``join``.

The worker threads share a
:class:`~distrib.parameter_server.client.dispatch_state.DispatchState` (the queue, the
failure policy, batching, datasets) that the coordinator owns and hands to each; they call
its public methods and know nothing else of the coordinator.

A function is pickled once (see :mod:`~distrib.parameter_server.transport.pickling`) and sent
to each worker once; later calls send only its digest and arguments. Short functions
share a round trip (batches of up to 2 ms of expected work).

Example::

    >>> import distrib as ds, torch
    >>> resolver = ds.testing.create_in_process_cluster(num_workers=2, num_ps=1)
    >>> strategy = ds.ParameterServerStrategy(resolver)
    >>> coordinator = ds.coordinator.ClusterCoordinator(strategy)
    >>> values = [coordinator.schedule(lambda i: i * i, args=(i,)) for i in range(4)]
    >>> coordinator.join()
    >>> coordinator.fetch(values)
    [0, 1, 4, 9]
    >>> ds.testing.stop_in_process_cluster(resolver)
"""

from __future__ import annotations

import collections
import threading
import uuid
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch.utils._pytree as pytree

from distrib.parameter_server.client.dispatch import PerWorkerIterator, WorkerThread, fetch_remote_values
from distrib.parameter_server.client.dispatch_state import Closure, DispatchState
from distrib.parameter_server.client.failure_policy import FailurePolicy
from distrib.parameter_server.client.remote_value import RemoteValue, RemoteValueStatus
from distrib.parameter_server.errors import PeerUnavailableError
from distrib.parameter_server.transport import pickling
from distrib.parameter_server.transport.rpc import Connection

if TYPE_CHECKING:
    from distrib.parameter_server.strategy import ParameterServerStrategy

__all__ = [
    "ClusterCoordinator",
    "RemoteValue",
    "RemoteValueStatus",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "FailurePolicy",
    "DEFAULT_HEARTBEAT_TIMEOUT",
]

#: seconds a busy worker may leave heartbeats unanswered before it is marked down
DEFAULT_HEARTBEAT_TIMEOUT = 10.0


class PerWorkerDataset:
    """A dataset built on every worker by ``create_per_worker_dataset``; ``iter()`` it for the functions.

    A worker that comes back after a failure builds its dataset again (from the start).
    An iterator the coordinator no longer references is dropped by the workers too.
    Made by ``ClusterCoordinator.create_per_worker_dataset``, not by hand.

    Args:
        dataset_id: the name the coordinator and the workers know the dataset function by.
        on_release: called with an iterator's id when the coordinator drops that iterator (the workers then
            drop theirs); None: never.
    """

    def __init__(self, dataset_id: str, on_release: Callable[[str], None] | None = None) -> None:
        self.dataset_id = dataset_id
        self._on_release = on_release

    def __iter__(self) -> PerWorkerIterator:
        return PerWorkerIterator(self.dataset_id, self._on_release)


class _OnePerStrategy(type):
    """Makes ``ClusterCoordinator(strategy)`` return the strategy's coordinator when it already has one.

    TF keeps one coordinator per strategy with ``__new__`` returning the existing one; but
    Python then runs ``__init__`` again on what ``__new__`` returned, so each ``__init__``
    must detect that it already ran. Deciding in the class's ``__call__`` (this metaclass)
    instead means the existing coordinator is returned untouched and ``__init__`` runs
    exactly once per coordinator. A factory function or classmethod alone would not do:
    the public constructor ``ClusterCoordinator(strategy)`` must keep TF's semantics. The
    registry is the strategy's public ``cluster_coordinator`` attribute (TF's
    ``strategy._cluster_coordinator``): it lives and dies with the strategy, and
    ``close()`` clears it. A lock makes two threads constructing at once get one
    coordinator (TF leaves that as a TODO).
    """

    _lock = threading.Lock()

    def __call__(cls, strategy: Any, *args: Any, **kwargs: Any) -> Any:
        with _OnePerStrategy._lock:
            existing = getattr(strategy, "cluster_coordinator", None)
            if not isinstance(existing, cls):
                return super().__call__(strategy, *args, **kwargs)
        if args or kwargs:
            warnings.warn(
                f"ClusterCoordinator(strategy, ...): this strategy already has a coordinator, which is "
                f"returned as it is; the options {sorted(kwargs) or list(args)} are ignored. Call "
                "close() on it first to make one with other options",
                stacklevel=2,
            )
        return existing


class ClusterCoordinator(metaclass=_OnePerStrategy):
    """Schedules functions on the workers (``tf.distribute.experimental.coordinator.ClusterCoordinator``).

    One per strategy: creating a second one for the same strategy returns the first (as
    in TF; options given to that second call are ignored, with a warning).

    The heartbeat bounds how long a worker that runs a function may stay silent: while a call is out the
    coordinator asks the worker for its health every ``heartbeat_interval`` seconds, and a worker that has
    answered none of them for ``heartbeat_timeout`` seconds (hung, SIGSTOPped, a cable pulled) is marked
    down: its functions go back to the queue for the other workers at once, and it is used again
    when it answers. A worker that dies outright is noticed as soon as its connection
    breaks. A function taken from a hung worker may still finish there later (it ran
    at least once; its result and metric updates are then ignored).

    Metrics (``ds.metrics.*``, or a ``torchmetrics.Metric``) that a scheduled function
    updates are copied to the workers; what each call adds to them comes back with its
    result and is added to the coordinator's metric before the call's RemoteValue is
    ready. Each completed call is counted exactly once: a call lost with its worker and
    run again elsewhere counts only in the run whose result is kept, and a call that
    raises adds nothing. So after ``join()``, ``metric.result()`` covers every call that
    completed.

    A ``torch.amp.GradScaler`` works the same way: each call runs torch's scaler on a copy
    that starts from the coordinator's scale, and the outcome of each ``update()`` (inf
    found or not) is replayed on the coordinator's scaler, once per completed call, in the
    order results arrive (see :mod:`distrib.parameter_server.scaler`).

    See the module docstring for a runnable example.

    Args:
        strategy: the coordinator's (the chief's) ``ParameterServerStrategy``.
        failure_policy: decides whether a failed function is retried on another worker or fails; None: TF's
            (see :class:`~distrib.parameter_server.client.failure_policy.FailurePolicy`).
        probe_interval: how often, in seconds, an unreachable worker is asked whether it is back.
        connect: makes the connection to each worker (a fake one in the dispatch tests).
        heartbeat_timeout: seconds a worker running a function may leave every health query unanswered
            before it is marked down (default 10); None: no heartbeat (a worker is lost only when its
            connection breaks).
        heartbeat_interval: seconds between health queries; None: a third of ``heartbeat_timeout``, at most 1 s.

    Raises:
        ValueError: ``strategy`` is not the coordinator's ``ParameterServerStrategy``, or ``heartbeat_timeout``
            or ``heartbeat_interval`` is not a positive number or None.
    """

    def __init__(
        self,
        strategy: ParameterServerStrategy,
        failure_policy: FailurePolicy | None = None,
        probe_interval: float = 0.25,
        connect: Callable[..., Connection] = Connection,
        *,
        heartbeat_timeout: float | None = DEFAULT_HEARTBEAT_TIMEOUT,
        heartbeat_interval: float | None = None,
    ) -> None:
        if not getattr(strategy, "should_use_with_coordinator", False) or not strategy.on_coordinator:
            raise ValueError(
                f"ClusterCoordinator(strategy) needs the coordinator's ParameterServerStrategy, got {strategy!r}"
            )
        for name, value in (("heartbeat_timeout", heartbeat_timeout), ("heartbeat_interval", heartbeat_interval)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"ClusterCoordinator({name}={value!r}): must be a positive number of seconds or None")
        self.strategy = strategy
        # Short functions share a round trip: a worker takes several at once while their
        # estimated run time (a moving average of what each function took) fits 2 ms; and a
        # worker whose batch is expected to end within 50 ms is sent its next one ahead.
        self._dispatch = DispatchState(
            failure_policy or FailurePolicy(),
            probe_interval=probe_interval,
            heartbeat_timeout=None if heartbeat_timeout is None else float(heartbeat_timeout),
            heartbeat_interval=float(heartbeat_interval or min(1.0, (heartbeat_timeout or 3.0) / 3)),
            batch_seconds=0.002,
            max_batch=64,
            ahead_seconds=0.05,
        )
        self._functions: collections.OrderedDict[Any, pickling.Payload] = collections.OrderedDict()
        addresses = strategy.cluster_spec.job_tasks("worker")
        self._workers = [WorkerThread(self._dispatch, strategy, i, a, connect) for i, a in enumerate(addresses)]
        strategy.cluster_coordinator = self

    def __reduce__(self) -> tuple:
        raise TypeError(
            "a scheduled function cannot capture the ClusterCoordinator; schedule from the coordinator only"
        )

    # ------------------------------------------------------------------ scheduling
    def _payload(self, fn: Callable[..., Any]) -> pickling.Payload:
        try:
            key: Any = fn
            hash(key)
        except TypeError:
            key = id(fn)
        payload = self._functions.get(key)
        if payload is None:
            try:
                payload = pickling.dumps(fn, self.strategy.persistent_id)
            except Exception as e:
                raise TypeError(
                    f"cannot send {getattr(fn, '__qualname__', fn)!r} to the workers: {e}. A scheduled "
                    "function and everything it refers to must be picklable by cloudpickle"
                ) from e
            self._functions[key] = payload
            if len(self._functions) > 256:
                self._functions.popitem(last=False)
        else:
            self._functions.move_to_end(key)
        return payload

    def schedule(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict | None = None) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` to run on some worker; returns its :class:`RemoteValue` at once.

        ``fn`` and what it captures are sent once (a snapshot: later changes to
        captured Python values are not seen). Arguments go with every call: tensors,
        numbers, strings, nested lists/tuples/dicts, per-worker iterators, and
        RemoteValues (fetched first).

        Args:
            fn: the function; it runs under the strategy on a worker, reading and updating the variables on the
                ps tasks.
            args: its positional arguments.
            kwargs: its keyword arguments; None: none.

        Returns:
            The call's :class:`RemoteValue`, PENDING: ``fetch()`` it (or ``coordinator.fetch``) for the result.

        Raises:
            TypeError: ``fn`` (or what it captures) cannot be pickled.
            ValueError: an argument is a per-worker iterator of another coordinator.
            ScheduledFunctionError: the error of an earlier failed function that ``join`` has not raised yet.
        """
        closure = Closure(self._payload(fn), tuple(args), dict(kwargs or {}))
        self._check_iterators((closure.args, closure.kwargs))
        self._dispatch.put(closure)
        return closure.value

    def _check_iterators(self, structure: Any) -> None:
        for x in pytree.tree_leaves(structure):
            if isinstance(x, PerWorkerIterator) and not self._dispatch.has_dataset(x.dataset_id):
                raise ValueError(
                    "a per-worker iterator from another ClusterCoordinator was passed to schedule(); "
                    "call create_per_worker_dataset on this coordinator and iterate that"
                )

    def join(self, timeout: float | None = None) -> None:
        """Wait until every scheduled function has finished; raise the first error among them.

        Once a function's error reaches the coordinator, no function queued starts: each
        one not started is cancelled (its RemoteValue is CANCELLED and ``fetch()`` raises
        ClosureCancelledError), including one already sent ahead to a busy worker that
        has not started there. The error is raised (by ``join``, ``done``, ``schedule`` and
        the failed function's ``fetch()``) once every worker has answered that it dropped
        what it was sent ahead, so nothing queued starts after it is seen. Functions already
        running on other workers finish (a running Python function cannot be interrupted
        safely; TF cancels them too) and keep their results; ``join`` waits for them, raises
        the error once, and then scheduling works again, as in TF.

        Args:
            timeout: the most seconds to wait (a distrib extension); None: as long as it takes.

        Raises:
            TimeoutError: ``timeout`` passed with functions still pending or running (the message gives the
                counts and each worker's state).
            ScheduledFunctionError: the first error a scheduled function raised on a worker (also an instance
                of its builtin class: a ``ValueError`` there is one here), with the worker's traceback.
            ParameterServerUnavailableError: a ps task was lost (the cluster must be restarted and restored).
        """
        state = self._dispatch
        if not state.wait(timeout):
            raise TimeoutError(
                f"join(): {state.pending_count} function(s) pending and {state.inflight_count} "
                f"running after {timeout}s; workers: {self.worker_states()}"
            )

    def done(self) -> bool:
        """Whether every scheduled function has finished, without waiting.

        Returns:
            True when nothing is pending or running.

        Raises:
            ScheduledFunctionError: the first error a scheduled function raised, as :meth:`join` does.
        """
        return self._dispatch.done()

    def fetch(self, val: Any) -> Any:
        """``val`` with every RemoteValue in it (nested in lists, tuples, dicts) replaced by its result.

        Args:
            val: a :class:`RemoteValue`, or a structure of them (and of other values, kept as they are).

        Returns:
            The same structure with each RemoteValue's result, waiting for those not ready yet.

        Raises:
            ScheduledFunctionError: a function's RemoteValue FAILED (its error on the worker).
            ClosureCancelledError: a function's RemoteValue was CANCELLED (an earlier function failed).
        """
        return fetch_remote_values(val)

    def create_per_worker_dataset(self, dataset_fn: Any) -> PerWorkerDataset:
        """Build a dataset on every worker: ``dataset_fn()`` or ``dataset_fn(input_context)``, or a dataset from
        ``strategy.distribute_datasets_from_function``/``experimental_distribute_dataset``.

        ``input_context`` has ``input_pipeline_id`` = the worker's index and
        ``num_input_pipelines`` = the number of workers (to shard or seed the data).

        Args:
            dataset_fn: makes one worker's dataset (an iterable of batches) on that worker, called with no
                argument or with an ``InputContext``; or a distributed dataset of the strategy.

        Returns:
            A :class:`PerWorkerDataset`: ``iter()`` of it gives a :class:`PerWorkerIterator` to pass to the
            scheduled functions, each of which then reads the next element of its own worker's iterator.

        Raises:
            TypeError: ``dataset_fn`` cannot be pickled.
        """
        dataset_id = uuid.uuid4().hex[:16]
        try:
            payload = pickling.dumps(dataset_fn, self.strategy.persistent_id)
        except Exception as e:
            raise TypeError(
                f"cannot send the dataset function to the workers: {e}. It must be picklable by "
                "cloudpickle (build the dataset inside the function rather than capturing it)"
            ) from e
        self._dispatch.add_dataset(dataset_id, payload)
        return PerWorkerDataset(dataset_id, self._dispatch.release_iterator)

    # ------------------------------------------------------------------ introspection
    def worker_states(self) -> dict[str, str]:
        """Each worker's state as the coordinator sees it.

        Returns:
            Task name (``/job:worker/replica:0/task:0``) -> ``"connecting"``, ``"idle"``, ``"busy"`` or ``"down"``.
        """
        return {w.task: w.state.value for w in self._workers}

    def worker_stats(self) -> list[dict]:
        """Each worker's health reply, asked now (a call to every worker, at most 5 s each).

        Returns:
            One dict per worker: its task, the functions it holds, the bytes it sent to and received from the
            ps tasks; ``{"task": ..., "ok": False}`` for a worker that cannot be reached.
        """
        stats = []
        for w in self._workers:
            try:
                stats.append(w.health(timeout=5.0))
            except PeerUnavailableError:
                stats.append({"task": w.task, "ok": False})
        return stats

    @property
    def num_workers(self) -> int:
        """How many worker tasks the cluster has (those down included)."""
        return len(self._workers)

    def close(self) -> None:
        """Stop the coordinator's threads (functions still running finish on their workers)."""
        self._dispatch.close()
        for w in self._workers:
            w.stop(timeout=5)
        if self.strategy.cluster_coordinator is self:
            self.strategy.cluster_coordinator = None
