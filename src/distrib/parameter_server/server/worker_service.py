"""What a ``worker`` task serves: it runs the functions the coordinator schedules.

A worker keeps, by digest, every function it was sent, with the variables that
function uses; per-worker datasets by id, and their iterators, created on first
use. One function runs at a time. Before a function runs, the worker refreshes
the local copies of its variables from the ps tasks (only what changed travels);
inside it, ``optimizer.step()`` sends the gradients to the ps tasks, which apply
them and answer with the new values.

A ``Run`` call carries a batch of calls (several short functions share one round
trip; the coordinator sizes batches from how long each function took before), and
the ids of per-worker iterators the coordinator no longer holds (dropped here).

Each ``Run`` is named by the coordinator (``run``), which sends the next batch while the
current one runs (``after``: the batch it follows). A batch sent ``after`` another starts after
it (it waits up to ``_AFTER_WAIT`` seconds for that one to arrive: the two calls may arrive in
either order). Cancellation, as TF promises it (once a scheduled function's error reaches the
coordinator, no function queued after it starts):

* a batch sent ``after`` one whose call failed here does not start: the coordinator is
  about to cancel it, and this worker knows of the error first;
* ``Cancel`` (``{"runs": [...]}``, sent by the coordinator when it records an error) drops
  each named batch that has not started here, now or when it arrives later (the reply lists
  them: ``{"dropped": [...]}``, the coordinator cancels their functions at once); a batch
  that has started runs no call after the current one.

A batch that did not run all its calls because of either answers with the replies of the
calls that ran and ``"cancelled": true``.

Metrics a function captured arrive as copies, one per metric, kept by the metric's
id. Before each call their state is reset; after a call that returned, the state
(what that call added) goes back with its reply, and the coordinator adds it to its
own metric.

A coordinator's ``torch.amp.GradScaler`` a function captured arrives as this worker's copy
(torch's own scaler, see :mod:`distrib.parameter_server.scaler`). Each ``Run`` request carries
the coordinator's scale; before a call the copy starts from it (plus this worker's outcomes the
coordinator had not replayed yet), and the outcomes of the call's ``update()`` calls go back
with its reply.

The reply says, per call that ran: ``ok`` (with the result and the seconds it took),
``error`` (the function raised: type, message, traceback), or ``ps_unavailable`` (a
parameter server could not be reached); calls after a failed one do not run. Or,
for the whole batch, ``need``: this worker lacks a function or dataset (it was
restarted); the coordinator sends them and calls again (under the same ``run``).
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from distrib import context
from distrib.cluster import ClusterSpec
from distrib.input import InputContext
from distrib.parameter_server.datasets import call_dataset_fn
from distrib.parameter_server.errors import ParameterServerUnavailableError
from distrib.parameter_server.scaler import WorkerScalers
from distrib.parameter_server.transport import pickling, wire
from distrib.parameter_server.transport.rpc import TLSConfig
from distrib.parameter_server.variables import LocalVariable, ParameterClient, VariableSpec
from distrib.parameter_server.worker_device import to_worker_device

if TYPE_CHECKING:
    from distrib.parameter_server.worker_strategy import ParameterServerWorkerStrategy

__all__ = ["WorkerService", "RemoteOptimizer"]

_MAX_FUNCTIONS = 512
_MAX_RUNS = 1024  # the latest batches whose state is kept (a coordinator has at most 2 out per worker)
_AFTER_WAIT = 5.0  # seconds a batch waits for the one it follows to arrive (e.g. this worker restarted between)
log = logging.getLogger("distrib.parameter_server.worker")


class RemoteOptimizer:
    """A coordinator's optimizer, as seen inside a scheduled function on a worker.

    ``step()`` sends the gradients of its parameters to the ps tasks, where the
    optimizer state lives beside each shard; the update is applied there and the
    new values come back. ``param_groups`` shows the options the coordinator's
    optimizer had when this call was scheduled (a learning-rate schedule stepped on
    the coordinator reaches the ps tasks with the next scheduled call).
    """

    def __init__(
        self,
        optimizer_id: str,
        groups: list[tuple[dict, list[LocalVariable]]],
        client: ParameterClient,
        current_options: dict[str, list[dict]],
    ) -> None:
        self._id = optimizer_id
        self._client = client
        self._current = current_options
        self._variables = [(v, g) for g, (_, vs) in enumerate(groups) for v in vs]
        self.param_groups = [{**options, "params": [v.tensor for v in vs]} for options, vs in groups]
        self.state: dict = {}

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        options = self._current.get(self._id)
        if options is not None and len(options) == len(self.param_groups):
            for group, new in zip(self.param_groups, options):
                group.update(new)
        items = [(v, v.tensor.grad, g) for v, g in self._variables if v.tensor.grad is not None]
        if items:
            self._client.push(
                self._id, items, [{k: x for k, x in g.items() if k != "params"} for g in self.param_groups]
            )
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for v, _ in self._variables:
            g = v.tensor.grad
            if g is None:
                continue
            if set_to_none or g.is_sparse:
                v.tensor.grad = None
            else:
                g.detach_().zero_()

    def state_dict(self) -> dict:
        raise RuntimeError(
            "the optimizer state lives on the ps tasks; call optimizer.state_dict() on the "
            "coordinator (outside scheduled functions), e.g. through ds.Checkpoint"
        )

    def load_state_dict(self, state_dict: dict) -> None:
        self.state_dict()

    def __repr__(self) -> str:
        return f"RemoteOptimizer(id={self._id!r}, params={len(self._variables)})"


@dataclass
class _Function:
    fn: Callable[..., Any]
    variables: list[LocalVariable] = field(default_factory=list)
    metrics: list[tuple[str, Any]] = field(default_factory=list)
    scalers: list[tuple[str, Any]] = field(default_factory=list)  # (key, this worker's GradScaler copy)


def _reset_metric(metric: Any) -> None:
    (metric.reset_state if hasattr(metric, "reset_state") else metric.reset)()


def _metric_deltas(metric: Any) -> dict[str, Any] | None:
    """What a call added to a worker's copy of a metric (its state after a reset), or None if nothing."""
    if hasattr(metric, "metric_state"):  # torchmetrics
        return dict(metric.metric_state) if getattr(metric, "update_called", True) else None
    state = metric.state_dict()
    return state if any(bool(torch.as_tensor(v).any()) for v in state.values()) else None


@dataclass(frozen=True)
class IteratorRef:
    """An argument standing for this worker's iterator ``iterator_id`` over dataset ``dataset_id``."""

    iterator_id: str
    dataset_id: str


class WorkerService:
    """The worker service: ``handlers()`` maps RPC method names to ``bytes -> bytes`` functions."""

    def __init__(
        self,
        cluster_spec: ClusterSpec,
        task_index: int,
        token: str,
        tls: TLSConfig | None = None,
        max_message: int | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.task = f"/job:worker/replica:0/task:{task_index}"
        #: where scheduled functions compute: the variables' copies, captured tensors, arguments and batches
        self.device = device if device is not None else torch.device("cpu")
        self._spec = cluster_spec
        self._index = task_index
        self._ps = ParameterClient(cluster_spec.job_tasks("ps"), token, tls, max_message)
        self._incarnation = uuid.uuid4().hex
        self._variables: dict[str, LocalVariable] = {}
        # by digest, least recently used first; an evicted function is asked for again ("need")
        self._functions: collections.OrderedDict[str, _Function] = collections.OrderedDict()
        self._datasets: dict[str, Any] = {}
        self._iterators: dict[str, Iterator[Any]] = {}
        self._metrics: dict[str, Any] = {}  # the coordinator's metrics by id: this worker's copies
        self._scalers = WorkerScalers(self._incarnation)  # the coordinator's GradScalers: this worker's copies
        self._run_lock = threading.Lock()
        # the latest batches by the coordinator's run id: "started", "stopping" (cancelled while it ran),
        # "ok", "failed" (a call did not return), "cancelled" (dropped before it started)
        self._runs: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._runs_lock = threading.Condition()  # notified whenever a batch's state changes
        self._optimizer_options: dict[str, list[dict]] = {}  # the coordinator's, as of the last Run
        self.decoded = 0  # request bodies decoded (reported by Health)
        self._strategy: ParameterServerWorkerStrategy | None = None

    def handlers(self) -> dict[str, Callable[[bytes], bytes]]:
        return {"Health": self._health, "Run": self._run, "Cancel": self._cancel}

    # ------------------------------------------------------------------ resolution
    def _variable(self, spec: VariableSpec) -> LocalVariable:
        var = self._variables.get(spec.var_id)
        if var is None:
            tensor = torch.nn.Parameter(
                torch.zeros(spec.shape, dtype=spec.torch_dtype, device=self.device), requires_grad=spec.requires_grad
            )
            var = self._variables[spec.var_id] = LocalVariable(spec, tensor)
        return var

    def _worker_strategy(self) -> ParameterServerWorkerStrategy:
        if self._strategy is None:
            from distrib.parameter_server.worker_strategy import ParameterServerWorkerStrategy

            self._strategy = ParameterServerWorkerStrategy(self._spec, self._index, self.device)
        return self._strategy

    def _load(
        self,
        data: bytes,
        used: list[LocalVariable],
        metrics: list[tuple[str, Any]] | None = None,
        scalers: list[tuple[str, Any]] | None = None,
        device: torch.device | None = None,
    ) -> Any:
        """Unpickle a function (tensors it captured by value go to ``device``) or a dataset function."""

        def resolve(pid: tuple) -> Any:
            kind = pid[0]
            if kind == "scaler":
                scaler = self._scalers.copy(pid[1], pid[2])
                if scalers is not None and all(k != pid[1] for k, _ in scalers):
                    scalers.append((pid[1], scaler))
                return scaler
            if kind == "metric":
                metric = self._metrics.setdefault(pid[1], pid[2])
                if isinstance(metric, torch.nn.Module):  # torchmetrics: its state beside the values it is given
                    metric.to(self.device)
                if metrics is not None and all(k != pid[1] for k, _ in metrics):
                    metrics.append((pid[1], metric))
                return metric
            if kind == "var":
                var = self._variable(pid[1])
                if var not in used:
                    used.append(var)
                return var.tensor
            if kind == "opt":
                groups = []
                for options, specs in pid[2]:
                    vs = [self._variable(s) for s in specs]
                    used.extend(v for v in vs if v not in used)
                    groups.append((options, vs))
                return RemoteOptimizer(pid[1], groups, self._ps, self._optimizer_options)
            if kind == "strategy":
                return self._worker_strategy()
            raise _unknown_persistent_id(pid)

        return pickling.loads(data, resolve, device)

    def _iterator(self, ref: IteratorRef) -> Iterator[Any]:
        it = self._iterators.get(ref.iterator_id)
        if it is None:
            dataset_fn = self._datasets[ref.dataset_id]
            num_workers = self._spec.num_tasks("worker")
            context = InputContext(
                num_input_pipelines=num_workers, input_pipeline_id=self._index, num_replicas_in_sync=1
            )
            dataset = call_dataset_fn(dataset_fn, context)
            it = iter(dataset)
            if self.device.type != "cpu":  # the dataset is made on the host; its batches go to the device
                it = map(functools.partial(to_worker_device, device=self.device), it)
            self._iterators[ref.iterator_id] = it
        return it

    # ------------------------------------------------------------------ methods
    def _health(self, request: bytes) -> bytes:
        return wire.encode(
            {
                "ok": True,
                "role": "worker",
                "task": self.task,
                "incarnation": self._incarnation,
                "functions": len(self._functions),
                "iterators": len(self._iterators),
                "decoded": self.decoded,
                "ps_bytes_sent": self._ps.bytes_sent,
                "ps_bytes_received": self._ps.bytes_received,
            }
        )

    def _run(self, request: bytes) -> bytes:
        """Run a batch of calls in order; stop after the first that fails.

        Replies ``{"status": "need", ...}`` without running anything when a function or
        dataset is missing, else ``{"results": [reply, ...]}`` with one encoded reply per
        call that ran (a failed call's reply is the last), and ``"cancelled": true`` when
        the batch was cancelled before all its calls ran (see the module docstring).
        """
        try:
            self.decoded += 1
            message = wire.decode(request, decode_ref=_iterator_ref)
            if (
                not isinstance(message, dict)
                or not isinstance(message.get("calls"), list)
                or not all(
                    isinstance(c, dict)
                    and isinstance(c.get("fn"), str)
                    and isinstance(c.get("args"), (list, tuple))
                    and isinstance(c.get("kwargs"), dict)
                    for c in message["calls"]
                )
            ):
                raise wire.WireError("malformed Run request: 'calls' must be a list of {fn, args, kwargs}")
            run, after = message.get("run"), message.get("after")
            if not isinstance(run, (str, type(None))) or not isinstance(after, (str, type(None))):
                raise wire.WireError("malformed Run request: 'run' and 'after' must be strings")
            if after is not None:  # the batch this one follows starts first (the calls may arrive swapped)
                with self._runs_lock:
                    self._runs_lock.wait_for(lambda: after in self._runs, timeout=_AFTER_WAIT)
            with self._run_lock:
                need = self._register(message)
                if need is not None:
                    return wire.encode(need)
                if not self._begin(run, after):
                    return wire.encode({"results": [], "cancelled": True})
                results: list[bytes] = []
                outcome = "failed"
                try:
                    for i, call in enumerate(message["calls"]):
                        if i and self._stopping(run):
                            outcome = "cancelled"
                            return wire.encode({"results": results, "cancelled": True})
                        reply = self._execute(call)
                        try:
                            results.append(wire.encode(reply))
                        except wire.WireError as e:  # the function returned something that cannot be sent
                            reply = _error_reply(e)
                            results.append(wire.encode(reply))
                        if reply["status"] != "ok":
                            return wire.encode({"results": results})
                    outcome = "ok"
                    return wire.encode({"results": results})
                finally:
                    self._end(run, outcome)
        except ModuleNotFoundError as e:  # the function was pickled by reference to a module we lack
            reply = _error_reply(e)
            reply["message"] += (
                f"; the scheduled function (or what it captures) refers to module {e.name!r}, "
                "which this worker cannot import: install it on the workers, or on the "
                f"coordinator call cloudpickle.register_pickle_by_value({e.name}) to send its code"
            )
            return wire.encode(reply)
        except Exception as e:  # noqa: BLE001 - a malformed request
            return wire.encode(_error_reply(e))

    def _cancel(self, request: bytes) -> bytes:
        """Drop the batches named that have not started (they never will); stop the named ones running after their current call."""
        try:
            self.decoded += 1
            message = wire.decode(request)
            runs = message.get("runs") if isinstance(message, dict) else None
            if not isinstance(runs, list) or not all(isinstance(r, str) for r in runs):
                raise wire.WireError("malformed Cancel request: 'runs' must be a list of run ids")
            dropped = []
            with self._runs_lock:
                for run in runs:
                    state = self._runs.get(run)
                    if state is None or state == "cancelled":  # not arrived yet, or waiting: it will not start
                        self._remember(run, "cancelled")
                        dropped.append(run)
                    elif state == "started":
                        self._remember(run, "stopping")
            return wire.encode({"dropped": dropped})
        except Exception as e:  # noqa: BLE001 - a malformed request
            return wire.encode(_error_reply(e))

    def _begin(self, run: str | None, after: str | None) -> bool:
        """Whether batch ``run`` starts (False: it was cancelled, or the batch it follows failed); marks it started."""
        if run is None:  # a coordinator that does not name its batches: nothing can cancel them
            return True
        with self._runs_lock:
            if self._runs.get(run) == "cancelled" or (after is not None and self._runs.get(after) == "failed"):
                self._remember(run, "cancelled")
                return False
            self._remember(run, "started")
            return True

    def _stopping(self, run: str | None) -> bool:
        with self._runs_lock:
            return run is not None and self._runs.get(run) == "stopping"

    def _end(self, run: str | None, outcome: str) -> None:
        if run is not None:
            with self._runs_lock:
                self._remember(run, outcome)

    def _remember(self, run: str, state: str) -> None:
        """Record batch ``run``'s state (call with ``_runs_lock`` held), forgetting the oldest beyond ``_MAX_RUNS``."""
        self._runs[run] = state
        self._runs.move_to_end(run)
        while len(self._runs) > _MAX_RUNS:
            self._runs.popitem(last=False)
        self._runs_lock.notify_all()

    def _register(self, message: dict) -> dict | None:
        """Load the functions and datasets sent along; the ``need`` reply if some are still missing."""
        for iterator_id in message.get("release") or ():
            self._iterators.pop(iterator_id, None)
        self._optimizer_options.update(message.get("options") or {})
        self._scalers.receive(message.get("scalers"))
        for digest, payload in (message.get("payloads") or {}).items():
            if digest not in self._functions:
                used: list[LocalVariable] = []
                metrics: list[tuple[str, Any]] = []
                scalers: list[tuple[str, Any]] = []
                fn = self._load(payload, used, metrics, scalers, self.device)
                self._functions[digest] = _Function(fn, used, metrics, scalers)
                while len(self._functions) > _MAX_FUNCTIONS:
                    self._functions.popitem(last=False)
        for ds_id, payload in (message.get("datasets") or {}).items():
            if ds_id not in self._datasets:
                self._datasets[ds_id] = self._load(payload, [])
        refs = [
            x
            for x in pytree.tree_leaves([(c["args"], c["kwargs"]) for c in message["calls"]])
            if isinstance(x, IteratorRef)
        ]
        functions = sorted({c["fn"] for c in message["calls"] if c["fn"] not in self._functions})
        datasets = sorted({r.dataset_id for r in refs if r.dataset_id not in self._datasets})
        return {"status": "need", "functions": functions, "datasets": datasets} if functions or datasets else None

    def _execute(self, call: dict) -> dict:
        entry = self._functions[call["fn"]]
        self._functions.move_to_end(call["fn"])
        start = time.perf_counter()
        mark: int | None = None
        try:
            if entry.scalers:  # GradScaler copies start from the coordinator's scale
                mark = self._scalers.prepare(entry.scalers)
            args, kwargs = pytree.tree_map(
                lambda x: self._iterator(x) if isinstance(x, IteratorRef) else x, (call["args"], call["kwargs"])
            )
            if self.device.type != "cpu":
                args, kwargs = to_worker_device((args, kwargs), self.device)
            for var in entry.variables:
                var.tensor.grad = None
            for _, metric in entry.metrics:
                _reset_metric(metric)
            self._ps.pull(entry.variables)
            with context.detached():  # an in-process cluster: the coordinator's open scope is not ours
                result = entry.fn(*args, **kwargs)
            reply = {"status": "ok", "result": result, "seconds": time.perf_counter() - start}
            metrics = {key: d for key, d in ((key, _metric_deltas(m)) for key, m in entry.metrics) if d is not None}
            if metrics:
                reply["metrics"] = metrics
            if mark is not None and (outcomes := self._scalers.finish(mark, entry.scalers)) is not None:
                reply["scaler"] = outcomes
            return reply
        except ParameterServerUnavailableError as e:
            self._discard_scaler_outcomes(mark)
            for var in entry.variables:
                var.invalidate()
            return {"status": "ps_unavailable", "address": e.address, "task": e.task or "", "message": str(e)}
        except Exception as e:  # noqa: BLE001 - the user's error, reported with its traceback
            self._discard_scaler_outcomes(mark)
            return _error_reply(e)

    def _discard_scaler_outcomes(self, mark: int | None) -> None:
        if mark is not None:  # a failed call's update() outcomes are never replayed on the coordinator
            self._scalers.discard(mark)


def _iterator_ref(ref: Any) -> IteratorRef:
    if not (isinstance(ref, list) and len(ref) == 3 and ref[0] == "iter" and all(isinstance(x, str) for x in ref[1:])):
        raise wire.WireError(f"malformed Run request: unknown reference {ref!r:.100}")
    return IteratorRef(ref[1], ref[2])


def _error_reply(e: BaseException) -> dict:
    return {"status": "error", "type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}


def _unknown_persistent_id(pid: Any) -> Exception:
    return TypeError(
        f"unknown persistent object {pid!r} in a scheduled function (coordinator and worker run "
        "different distrib versions?)"
    )
