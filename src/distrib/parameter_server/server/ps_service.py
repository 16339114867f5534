"""What a ``ps`` task serves: variable shards, the optimizer state beside each, and versions.

Each shard carries a version that grows with every update, the version of its last
dense change (a dense gradient or an assignment), and, for shards with rows, the
version at which each row last changed. A reader that says which version it has
gets back nothing (unchanged), only the rows changed since (after sparse updates),
or the whole shard. Updates from different workers to one shard are serialized by
the shard's lock; different shards update in parallel. Nothing synchronizes the
workers with each other: training is asynchronous, as in TF. A push carries the
optimizer's current options (learning rate, ...) as the coordinator last set them;
they replace the shard optimizer's before its step.

Optimizer classes arrive pickled (cloudpickle) from the coordinator. That is the
only unpickling a ps does, and only for calls that passed the cluster-token check.
"""

from __future__ import annotations

import inspect
import threading
import traceback
from typing import Any, Callable, Optional

import cloudpickle
import torch

from distrib import context

from distrib.parameter_server.transport import wire

__all__ = ["ParameterStore"]


class UnknownVariable(KeyError):
    """A shard key this ps does not hold (the ps was restarted, or the key is wrong)."""


class _Shard:
    __slots__ = ("value", "version", "dense_version", "row_version", "lock")

    def __init__(self, value: torch.Tensor) -> None:
        self.value = torch.nn.Parameter(value.clone(), requires_grad=value.is_floating_point() or value.is_complex())
        self.version = 1
        self.dense_version = 1
        self.row_version = torch.zeros(value.shape[0], dtype=torch.int64) if value.dim() else None
        self.lock = threading.Lock()

    def read(self, since: int) -> dict:
        """The reply that brings a copy at version ``since`` up to date (call with the lock held)."""
        if since == self.version:
            return {"v": self.version}
        if since > 0 and since >= self.dense_version and self.row_version is not None:
            rows = (self.row_version > since).nonzero().squeeze(1)
            if 2 * rows.numel() <= self.row_version.numel():
                return {"v": self.version, "rows": rows, "vals": self.value.detach().index_select(0, rows)}
        return {"v": self.version, "full": self.value.detach().clone()}

    def changed(self, rows: Optional[torch.Tensor]) -> None:
        self.version += 1
        if rows is None or self.row_version is None:
            self.dense_version = self.version
        else:
            self.row_version[rows] = self.version


def _build_optimizer(cls: type, param: torch.nn.Parameter, options: dict[str, Any]) -> torch.optim.Optimizer:
    accepted = inspect.signature(cls).parameters
    kwargs = {k: v for k, v in options.items() if k in accepted}
    # detached: with an in-process cluster, a strategy scope open on the coordinator's thread
    # must not capture the optimizers this ps builds
    with context.detached():
        optimizer: torch.optim.Optimizer = cls([{"params": [param], **options}], **kwargs)
    return optimizer


class ParameterStore:
    """The ps service: ``handlers()`` maps RPC method names to ``bytes -> bytes`` functions."""

    def __init__(self) -> None:
        self._shards: dict[str, _Shard] = {}
        self._optimizers: dict[tuple[str, str], torch.optim.Optimizer] = {}
        self._lock = threading.Lock()

    def handlers(self) -> dict[str, Callable[[bytes], bytes]]:
        methods = {"Health": self.health, "Create": self.create, "Pull": self.pull, "Push": self.push,
                   "Assign": self.assign, "CreateOptimizer": self.create_optimizer,
                   "GetOptimizerState": self.get_optimizer_state, "SetOptimizerState": self.set_optimizer_state}
        return {name: _guarded(fn) for name, fn in methods.items()}

    def _shard(self, key: str) -> _Shard:
        shard = self._shards.get(key)
        if shard is None:
            raise UnknownVariable(f"no variable shard {key!r} on this ps")
        return shard

    # ------------------------------------------------------------------ methods
    def health(self, request: dict) -> dict:
        return {"ok": True, "role": "ps", "shards": len(self._shards)}

    def create(self, request: dict) -> dict:
        for item in request["vars"]:
            shard = _Shard(item["value"])
            with self._lock:
                self._shards[item["key"]] = shard
        return {}

    def assign(self, request: dict) -> dict:
        for item in request["vars"]:
            shard = self._shard(item["key"])
            with shard.lock, torch.no_grad():
                if shard.value.shape != item["value"].shape:
                    raise ValueError(f"shard {item['key']} has shape {tuple(shard.value.shape)}; "
                                     f"got a value of shape {tuple(item['value'].shape)}")
                shard.value.copy_(item["value"])
                shard.changed(None)
        return {}

    def pull(self, request: dict) -> dict:
        replies = []
        for key, since in zip(request["keys"], request["since"]):
            shard = self._shard(key)
            with shard.lock:
                replies.append(shard.read(since))
        return {"shards": replies}

    def push(self, request: dict) -> dict:
        opt_id = request["opt"]
        options, groups = request.get("options"), request.get("groups") or [0] * len(request["keys"])
        replies = []
        for key, grad, since, group in zip(request["keys"], request["grads"], request["since"], groups):
            shard = self._shard(key)
            with shard.lock:
                if grad is None:
                    replies.append(shard.read(since))
                    continue
                optimizer = self._optimizers.get((opt_id, key))
                if optimizer is None:
                    raise UnknownVariable(f"no optimizer {opt_id!r} for shard {key!r} on this ps")
                if options:
                    _update_options(optimizer, options[group])
                up_to_date = since == shard.version
                rows = grad.indices()[0] if grad.is_sparse else None
                shard.value.grad = grad.to(shard.value.dtype)
                try:
                    # sparse gradients were built from coalesced, in-range rows: skip torch's checks (and warning)
                    with torch.sparse.check_sparse_tensor_invariants(enable=False):
                        optimizer.step()
                finally:
                    shard.value.grad = None
                shard.changed(rows)
                if up_to_date and rows is not None and shard.row_version is not None:
                    # the pusher had everything else: the rows it touched are all that changed
                    replies.append({"v": shard.version, "rows": rows, "vals": shard.value.detach().index_select(0, rows)})
                else:
                    replies.append(shard.read(since))
        return {"shards": replies}

    def create_optimizer(self, request: dict) -> dict:
        cls = cloudpickle.loads(request["factory"])
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise TypeError(f"optimizer factory must be a torch.optim.Optimizer subclass, got {cls!r}")
        for key, options in zip(request["keys"], request["options"]):
            shard = self._shard(key)
            with shard.lock:
                self._optimizers[(request["opt"], key)] = _build_optimizer(cls, shard.value, options)
        return {}

    def get_optimizer_state(self, request: dict) -> dict:
        states = []
        for key in request["keys"]:
            shard = self._shard(key)
            with shard.lock:
                optimizer = self._optimizer(request["opt"], key)
                state = optimizer.state_dict()["state"].get(0, {})
                states.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()})
        return {"states": states}

    def set_optimizer_state(self, request: dict) -> dict:
        for key, state in zip(request["keys"], request["states"]):
            shard = self._shard(key)
            with shard.lock:
                optimizer = self._optimizer(request["opt"], key)
                sd = optimizer.state_dict()
                sd["state"] = {0: state} if state else {}
                sd["param_groups"][0].update({k: v for k, v in request["options"].items() if k != "params"})
                optimizer.load_state_dict(sd)
        return {}

    def _optimizer(self, opt_id: str, key: str) -> torch.optim.Optimizer:
        optimizer = self._optimizers.get((opt_id, key))
        if optimizer is None:
            raise UnknownVariable(f"no optimizer {opt_id!r} for shard {key!r} on this ps")
        return optimizer


def _update_options(optimizer: torch.optim.Optimizer, options: dict) -> None:
    """Give the shard's optimizer the coordinator's current options (a learning-rate schedule's lr)."""
    group = optimizer.param_groups[0]
    for k, v in options.items():
        if k != "params" and (isinstance(v, torch.Tensor) or group.get(k) != v):
            group[k] = v


def _guarded(fn: Callable[[Any], dict]) -> Callable[[bytes], bytes]:
    """Decode the request, run ``fn``, encode its reply; errors become ``{"error": ...}`` replies."""

    def handler(request: bytes) -> bytes:
        try:
            return wire.encode(fn(wire.decode(request)))
        except Exception as e:  # noqa: BLE001 - reported to the caller, who raises it
            return wire.encode({"error": {"type": type(e).__name__, "message": str(e),
                                          "traceback": traceback.format_exc()}})

    return handler
