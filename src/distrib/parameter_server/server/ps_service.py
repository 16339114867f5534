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

Every request is validated whole before anything changes: unknown keys, wrong field
types, shapes or dtypes, sparse rows outside a shard (checked when the message is
decoded, with torch's sparse invariant checks on) get an error reply and leave the
store as it was.

Optimizer classes arrive pickled (cloudpickle) from the coordinator. That is the
only unpickling a ps does, and only for calls that passed the cluster-token check.
"""

from __future__ import annotations

import inspect
import threading
import traceback
from collections.abc import Callable
from typing import Any

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

    def changed(self, rows: torch.Tensor | None) -> None:
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


class InvalidRequest(ValueError):
    """A request that names unknown fields, wrong types, shapes or dtypes; it changed nothing."""


def _field(request: Any, name: str, kind: type, what: str) -> Any:
    if not isinstance(request, dict):
        raise InvalidRequest(f"a request must be a dict, got {type(request).__name__}")
    value = request.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidRequest(f"request field {name!r} must be {what}, got {type(value).__name__}")
    return value


def _list_of(request: dict, name: str, kind: type, what: str, length: int | None = None) -> list:
    items = _field(request, name, list, f"a list of {what}")
    for x in items:
        if not isinstance(x, kind) or (isinstance(x, int) and (isinstance(x, bool) or x < 0)):
            raise InvalidRequest(f"request field {name!r} must hold {what}, got an item of type {type(x).__name__}")
    if length is not None and len(items) != length:
        raise InvalidRequest(f"request field {name!r} has {len(items)} items; 'keys' has {length}")
    return items


def _dense(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        raise InvalidRequest(f"{what} must be a dense tensor, got {type(value).__name__}")
    return value


def _check_value(shard: _Shard, value: Any, key: str) -> torch.Tensor:
    value = _dense(value, f"the value for shard {key!r}")
    if value.shape != shard.value.shape or value.dtype != shard.value.dtype:
        raise InvalidRequest(
            f"shard {key!r} is {shard.value.dtype} of shape {tuple(shard.value.shape)}; got a value "
            f"{value.dtype} of shape {tuple(value.shape)}"
        )
    return value


def _check_gradient(shard: _Shard, grad: Any, key: str) -> torch.Tensor:
    if not isinstance(grad, torch.Tensor):
        raise InvalidRequest(f"the gradient for shard {key!r} must be a tensor or None, got {type(grad).__name__}")
    if not shard.value.requires_grad:
        raise InvalidRequest(f"shard {key!r} ({shard.value.dtype}) takes no gradients")
    if grad.dtype != shard.value.dtype:  # a gradient has its parameter's dtype, as torch requires of .grad
        raise InvalidRequest(f"the gradient for shard {key!r} is {grad.dtype}; the shard is {shard.value.dtype}")
    if grad.shape != shard.value.shape:
        raise InvalidRequest(
            f"the gradient for shard {key!r} has shape {tuple(grad.shape)}; the shard has {tuple(shard.value.shape)}"
        )
    if grad.is_sparse and grad.sparse_dim() != 1:
        raise InvalidRequest(
            f"a sparse gradient for shard {key!r} must index rows (1 sparse dim), got {grad.sparse_dim()}"
        )
    if grad.layout not in (torch.strided, torch.sparse_coo):
        raise InvalidRequest(f"the gradient for shard {key!r} has layout {grad.layout}")
    return grad


def _plain(v: Any) -> bool:
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    return isinstance(v, (tuple, list)) and len(v) <= 16 and all(isinstance(x, (int, float)) for x in v)


def _check_options(optimizer: torch.optim.Optimizer, options: Any, key: str) -> dict:
    """Options the coordinator sends keep the type an existing option has; new ones (a scheduler's
    ``initial_lr``) must be plain numbers, strings, booleans or short tuples of numbers."""
    if not isinstance(options, dict):
        raise InvalidRequest(f"optimizer options for shard {key!r} must be a dict, got {type(options).__name__}")
    group = optimizer.param_groups[0]
    for k, v in options.items():
        if k == "params":
            continue
        if not isinstance(k, str):
            raise InvalidRequest(f"optimizer option names must be strings, got {k!r:.50}")
        if k not in group:
            if not _plain(v):
                raise InvalidRequest(
                    f"new optimizer option {k!r} for shard {key!r} must be a number, string, "
                    f"boolean or tuple of numbers, got {type(v).__name__}"
                )
            continue
        old = group[k]
        numbers = (int, float)
        same = (
            isinstance(v, type(old))
            or (isinstance(old, numbers) and isinstance(v, numbers))
            or old is None
            or v is None
        )
        if (
            not same
            or isinstance(v, bool) != isinstance(old, bool)
            or (isinstance(v, torch.Tensor) and v.shape != old.shape)
        ):
            raise InvalidRequest(
                f"optimizer option {k!r} for shard {key!r} must be {type(old).__name__} like the "
                f"optimizer's, got {type(v).__name__}"
            )
    return options


class ParameterStore:
    """The ps service: ``handlers()`` maps RPC method names to ``bytes -> bytes`` functions.

    Every method validates its whole request (fields, keys, shapes, dtypes, sparse rows)
    before it changes anything, so a malformed or hostile request from a peer holding
    the token gets an error reply and leaves every shard and optimizer as it was.
    ``decoded`` counts the request bodies this service has decoded (reported by Health).
    """

    def __init__(self) -> None:
        self._shards: dict[str, _Shard] = {}
        self._optimizers: dict[tuple[str, str], torch.optim.Optimizer] = {}
        self._lock = threading.Lock()
        self.decoded = 0

    def handlers(self) -> dict[str, Callable[[bytes], bytes]]:
        methods = {
            "Health": self.health,
            "Create": self.create,
            "Pull": self.pull,
            "Push": self.push,
            "Assign": self.assign,
            "CreateOptimizer": self.create_optimizer,
            "GetOptimizerState": self.get_optimizer_state,
            "SetOptimizerState": self.set_optimizer_state,
        }
        return {name: _guarded(fn, self._count) for name, fn in methods.items()}

    def _count(self) -> None:
        with self._lock:
            self.decoded += 1

    def _shard(self, key: Any) -> _Shard:
        shard = self._shards.get(key) if isinstance(key, str) else None
        if shard is None:
            raise UnknownVariable(f"no variable shard {key!r:.200} on this ps")
        return shard

    def _optimizer(self, opt_id: Any, key: str) -> torch.optim.Optimizer:
        optimizer = self._optimizers.get((opt_id, key)) if isinstance(opt_id, str) else None
        if optimizer is None:
            raise UnknownVariable(f"no optimizer {opt_id!r:.100} for shard {key!r} on this ps")
        return optimizer

    # ------------------------------------------------------------------ methods
    def health(self, request: Any) -> dict:
        return {"ok": True, "role": "ps", "shards": len(self._shards), "decoded": self.decoded}

    def create(self, request: Any) -> dict:
        items = _list_of(request, "vars", dict, "{'key': str, 'value': tensor} items")
        new: dict[str, torch.Tensor] = {}
        for item in items:
            key = item.get("key")
            if not isinstance(key, str) or not key or key in new:
                raise InvalidRequest(f"each variable needs a distinct non-empty string 'key', got {key!r:.100}")
            if key in self._shards:
                raise InvalidRequest(
                    f"variable shard {key!r} already exists on this ps; it is never overwritten (use Assign)"
                )
            new[key] = _dense(item.get("value"), f"the value of {key!r}")
        shards = {key: _Shard(value) for key, value in new.items()}
        with self._lock:
            clash = sorted(set(shards) & set(self._shards))
            if clash:
                raise InvalidRequest(f"variable shard {clash[0]!r} was created meanwhile")
            self._shards.update(shards)
        return {}

    def assign(self, request: Any) -> dict:
        items = _list_of(request, "vars", dict, "{'key': str, 'value': tensor} items")
        checked = [(self._shard(item.get("key")), item) for item in items]
        values = [(shard, _check_value(shard, item.get("value"), item["key"])) for shard, item in checked]
        for shard, value in values:
            with shard.lock, torch.no_grad():
                shard.value.copy_(value)
                shard.changed(None)
        return {}

    def pull(self, request: Any) -> dict:
        keys = _list_of(request, "keys", str, "shard keys")
        since = _list_of(request, "since", int, "versions (ints >= 0)", len(keys))
        shards = [self._shard(key) for key in keys]
        replies = []
        for shard, v in zip(shards, since):
            with shard.lock:
                replies.append(shard.read(v))
        return {"shards": replies}

    def push(self, request: Any) -> dict:
        opt_id = _field(request, "opt", str, "an optimizer id")
        keys = _list_of(request, "keys", str, "shard keys")
        grads = _field(request, "grads", list, "a list of gradients")
        since = _list_of(request, "since", int, "versions (ints >= 0)", len(keys))
        groups = request.get("groups") or [0] * len(keys)
        options = request.get("options")
        if len(grads) != len(keys):
            raise InvalidRequest(f"request field 'grads' has {len(grads)} items; 'keys' has {len(keys)}")
        if (
            not isinstance(groups, list)
            or len(groups) != len(keys)
            or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in groups)
        ):
            raise InvalidRequest("request field 'groups' must be a list of group indices, one per key")
        if options is not None and not isinstance(options, list):
            raise InvalidRequest("request field 'options' must be a list of dicts (one per group) or None")
        plan: list[tuple[_Shard, torch.Tensor | None, torch.optim.Optimizer | None, int, dict | None]] = []
        for key, grad, v, group in zip(keys, grads, since, groups):
            shard = self._shard(key)
            if grad is None:
                plan.append((shard, None, None, v, None))
                continue
            grad = _check_gradient(shard, grad, key)
            optimizer = self._optimizer(opt_id, key)
            group_options = None
            if options:
                if group >= len(options):
                    raise InvalidRequest(f"group {group} of shard {key!r} has no options ({len(options)} groups)")
                group_options = _check_options(optimizer, options[group], key)
            plan.append((shard, grad, optimizer, v, group_options))
        replies = []
        for shard, grad, opt, v, group_options in plan:
            with shard.lock:
                if grad is None or opt is None:
                    replies.append(shard.read(v))
                    continue
                if group_options:
                    _update_options(opt, group_options)
                up_to_date = v == shard.version
                rows = grad.indices()[0] if grad.is_sparse else None
                shard.value.grad = grad
                try:
                    # sparse gradients were checked (in range, coalesced) when the request was decoded
                    with torch.sparse.check_sparse_tensor_invariants(enable=False):
                        opt.step()
                finally:
                    shard.value.grad = None
                shard.changed(rows)
                if up_to_date and rows is not None and shard.row_version is not None:
                    # the pusher had everything else: the rows it touched are all that changed
                    replies.append(
                        {"v": shard.version, "rows": rows, "vals": shard.value.detach().index_select(0, rows)}
                    )
                else:
                    replies.append(shard.read(v))
        return {"shards": replies}

    def create_optimizer(self, request: Any) -> dict:
        opt_id = _field(request, "opt", str, "an optimizer id")
        factory = _field(request, "factory", bytes, "a pickled optimizer class")
        keys = _list_of(request, "keys", str, "shard keys")
        options = _list_of(request, "options", dict, "option dicts", len(keys))
        shards = [self._shard(key) for key in keys]
        cls = cloudpickle.loads(factory)  # authenticated peers only (the token interceptor ran first)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise TypeError(f"optimizer factory must be a torch.optim.Optimizer subclass, got {cls!r:.200}")
        built = []
        for key, shard, group in zip(keys, shards, options):
            with shard.lock:
                built.append(((opt_id, key), _build_optimizer(cls, shard.value, group)))
        with self._lock:
            self._optimizers.update(built)
        return {}

    def get_optimizer_state(self, request: Any) -> dict:
        opt_id = _field(request, "opt", str, "an optimizer id")
        keys = _list_of(request, "keys", str, "shard keys")
        pairs = [(self._shard(key), self._optimizer(opt_id, key)) for key in keys]
        states = []
        for shard, optimizer in pairs:
            with shard.lock:
                state = optimizer.state_dict()["state"].get(0, {})
                states.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()})
        return {"states": states}

    def set_optimizer_state(self, request: Any) -> dict:
        opt_id = _field(request, "opt", str, "an optimizer id")
        keys = _list_of(request, "keys", str, "shard keys")
        states = _list_of(request, "states", dict, "state dicts", len(keys))
        options = _field(request, "options", dict, "a dict of optimizer options")
        plan = []
        for key, state in zip(keys, states):
            shard, optimizer = self._shard(key), self._optimizer(opt_id, key)
            for name, value in state.items():
                if not isinstance(name, str):
                    raise InvalidRequest(f"optimizer state names must be strings, got {name!r:.50}")
                if isinstance(value, torch.Tensor) and (
                    value.layout != torch.strided or (value.dim() and value.shape != shard.value.shape)
                ):
                    raise InvalidRequest(
                        f"optimizer state {name!r} of shard {key!r} has shape {tuple(value.shape)}; "
                        f"it must be a number or of the shard's shape {tuple(shard.value.shape)}"
                    )
            plan.append((shard, optimizer, state, _check_options(optimizer, options, key)))
        for shard, optimizer, state, group_options in plan:
            with shard.lock:
                sd = optimizer.state_dict()
                sd["state"] = {0: state} if state else {}
                sd["param_groups"][0].update({k: v for k, v in group_options.items() if k != "params"})
                optimizer.load_state_dict(sd)
        return {}


def _update_options(optimizer: torch.optim.Optimizer, options: dict) -> None:
    """Give the shard's optimizer the coordinator's current options (a learning-rate schedule's lr)."""
    group = optimizer.param_groups[0]
    for k, v in options.items():
        if k != "params" and (isinstance(v, torch.Tensor) or group.get(k) != v):
            group[k] = v


def _guarded(fn: Callable[[Any], dict], count: Callable[[], None]) -> Callable[[bytes], bytes]:
    """Decode the request, run ``fn``, encode its reply; errors become ``{"error": ...}`` replies."""

    def handler(request: bytes) -> bytes:
        try:
            count()
            return wire.encode(fn(wire.decode(request)))
        except Exception as e:  # noqa: BLE001 - reported to the caller, who raises it
            return wire.encode(
                {"error": {"type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}}
            )

    return handler
