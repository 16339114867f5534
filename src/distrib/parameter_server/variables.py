"""Parameters that live on the parameter servers, and the client that reads and updates them.

A parameter built under ``ParameterServerStrategy.scope()`` becomes a *variable*:
its :class:`VariableSpec` names the shards it is split into along dim 0 and the ps
task holding each. The coordinator and every worker keep a *local copy* of each
variable they use (:class:`LocalVariable`) together with the version of every shard
it reflects, and the :class:`ParameterClient` keeps those copies fresh:

* ``pull`` asks each ps, in one call per ps task and all ps tasks at once, for the
  shards that changed since the local versions. A shard untouched since then costs
  a few bytes; a shard that only had sparse (row) updates sends just those rows.
* ``push`` sends gradients (dense, or for ``nn.Embedding(sparse=True)`` only the
  touched rows) with the optimizer to apply; each ps applies the update to its
  shards and answers with their new values in the same call, so a worker's next
  step sees its own update without another round trip.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from distrib.parameter_server.transport import wire
from distrib.parameter_server.errors import ParameterServerUnavailableError
from distrib.parameter_server.partitioners import shard_offsets
from distrib.parameter_server.transport.rpc import PS_SERVICE, Connection, TLSConfig

__all__ = ["ShardSpec", "VariableSpec", "Placer", "LocalVariable", "ParameterClient"]



@dataclass(frozen=True)
class ShardSpec:
    """Rows ``[start, stop)`` of a variable, stored under ``key`` on ps task ``ps``."""

    key: str
    ps: int
    start: int
    stop: int


@dataclass(frozen=True)
class VariableSpec:
    """Where one parameter lives: its shards, in row order (one shard when not partitioned)."""

    var_id: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    shards: tuple[ShardSpec, ...]
    requires_grad: bool = True

    @property
    def torch_dtype(self) -> torch.dtype:
        return wire.DTYPES[self.dtype]

    def shard_view(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        """The rows of ``tensor`` (a whole value of this variable) that shard ``index`` holds."""
        if not self.shape:
            return tensor
        s = self.shards[index]
        return tensor[s.start:s.stop]


class Placer:
    """Decides the shards of each new variable and puts them on ps tasks round robin (TF's rule).

    Every shard takes the next ps task in turn, so an unpartitioned variable goes
    where the previous variable's last shard did not.
    """

    def __init__(self, num_ps: int, partitioner: Optional[Callable[..., Sequence[int]]], prefix: str) -> None:
        self.num_ps = num_ps
        self.partitioner = partitioner
        self.prefix = prefix
        self._count = 0
        self._variables = 0

    def place(self, name: str, value: torch.Tensor) -> VariableSpec:
        shape = tuple(value.shape)
        num_shards = 1
        if self.partitioner is not None and shape:
            parts = list(self.partitioner(shape, value.dtype))
            if not parts or parts[0] < 1 or any(p != 1 for p in parts[1:]):
                raise ValueError(f"variable_partitioner must return [n, 1, 1, ...] with n >= 1 (shards along dim 0); "
                                 f"{self.partitioner!r} returned {parts} for {name} of shape {shape}")
            num_shards = min(parts[0], shape[0]) if shape[0] else 1
        offsets = shard_offsets(shape[0], num_shards) if shape else [0, 0]
        var_id = f"{self.prefix}/v{self._variables}"
        self._variables += 1
        shards = []
        for i in range(num_shards):
            shards.append(ShardSpec(f"{var_id}/part_{i}", self._count % self.num_ps, offsets[i], offsets[i + 1]))
            self._count += 1
        dtype = str(value.dtype).removeprefix("torch.")
        if dtype not in wire.DTYPES:
            raise TypeError(f"parameter {name} has dtype {value.dtype}, which cannot be placed on a parameter server")
        return VariableSpec(var_id, name, shape, dtype, tuple(shards), bool(value.requires_grad))


class LocalVariable:
    """A process's copy of a variable and the shard versions it reflects (0: never read)."""

    __slots__ = ("spec", "tensor", "versions")

    def __init__(self, spec: VariableSpec, tensor: torch.Tensor) -> None:
        self.spec = spec
        self.tensor = tensor
        self.versions = [0] * len(spec.shards)

    def apply(self, index: int, reply: dict) -> None:
        """Bring shard ``index`` of the local copy to the value a ps sent."""
        view = self.spec.shard_view(self.tensor.data, index)
        with torch.no_grad():
            if "full" in reply:
                view.copy_(reply["full"])
            elif "rows" in reply:
                view.index_copy_(0, reply["rows"], reply["vals"].to(view.dtype))
        self.versions[index] = reply["v"]

    def invalidate(self) -> None:
        self.versions = [0] * len(self.spec.shards)


def split_gradient(spec: VariableSpec, grad: torch.Tensor) -> list[Optional[torch.Tensor]]:
    """Per-shard parts of a whole gradient; sparse gradients keep only each shard's touched rows."""
    if not grad.is_sparse:
        return [spec.shard_view(grad, i) for i in range(len(spec.shards))]
    grad = grad.coalesce()
    rows, values = grad.indices()[0], grad.values()
    if len(spec.shards) == 1:
        s = spec.shards[0]
        return [torch.sparse_coo_tensor(rows.unsqueeze(0), values, (s.stop - s.start, *spec.shape[1:]),
                                        check_invariants=False, is_coalesced=True)]
    parts: list[Optional[torch.Tensor]] = []
    for s in spec.shards:
        mask = (rows >= s.start) & (rows < s.stop)
        if not bool(mask.any()):
            parts.append(None)
            continue
        parts.append(torch.sparse_coo_tensor((rows[mask] - s.start).unsqueeze(0), values[mask],
                                             (s.stop - s.start, *spec.shape[1:]), check_invariants=False,
                                             is_coalesced=True))
    return parts


class ParameterClient:
    """Calls to every ps task; requests to several ps tasks go out together."""

    def __init__(self, ps_addresses: Sequence[str], token: str, tls: Optional[TLSConfig] = None) -> None:
        self._conns = [Connection(a, PS_SERVICE, token, tls, task=f"/job:ps/task:{i}",
                                  unavailable=ParameterServerUnavailableError) for i, a in enumerate(ps_addresses)]

    @property
    def num_ps(self) -> int:
        return len(self._conns)

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in self._conns)

    @property
    def bytes_received(self) -> int:
        return sum(c.bytes_received for c in self._conns)

    def wait_ready(self, timeout: float) -> None:
        """Return once every ps task answers; ParameterServerUnavailableError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        for conn in self._conns:
            left = max(0.1, deadline - time.monotonic())
            try:
                conn.call("Health", wire.encode({}), timeout=left, wait_for_ready=True)
            except ParameterServerUnavailableError as e:
                raise ParameterServerUnavailableError(conn.address, f"did not answer within {timeout:.0f}s ({e})",
                                                      conn.task) from None

    def _fanout(self, method: str, requests: dict[int, Any]) -> dict[int, Any]:
        futures = {i: self._conns[i].future(method, wire.encode(r)) for i, r in requests.items()}
        replies = {}
        for i, f in futures.items():
            reply = wire.decode(self._conns[i].result(f))
            if isinstance(reply, dict) and "error" in reply:
                self._raise(i, reply["error"])
            replies[i] = reply
        return replies

    def _raise(self, ps: int, error: dict) -> None:
        conn = self._conns[ps]
        if error.get("type") == "UnknownVariable":
            raise ParameterServerUnavailableError(conn.address, f"it lost its variables ({error.get('message')}); "
                                                  "it was probably restarted", conn.task)
        raise RuntimeError(f"{conn.task} ({conn.address}) failed: {error.get('type')}: {error.get('message')}")

    # ------------------------------------------------------------------ variables
    def create(self, items: Sequence[tuple[VariableSpec, torch.Tensor]]) -> None:
        """Store the initial value of every shard of every variable on its ps task."""
        requests: dict[int, list] = {}
        for spec, value in items:
            for i, s in enumerate(spec.shards):
                requests.setdefault(s.ps, []).append({"key": s.key, "value": spec.shard_view(value, i)})
        self._fanout("Create", {ps: {"vars": v} for ps, v in requests.items()})

    def pull(self, variables: Iterable[LocalVariable]) -> None:
        """Refresh local copies: only shards (or rows) changed since their versions travel."""
        requests: dict[int, dict] = {}
        targets: dict[int, list[tuple[LocalVariable, int]]] = {}
        for var in variables:
            for i, s in enumerate(var.spec.shards):
                req = requests.setdefault(s.ps, {"keys": [], "since": []})
                req["keys"].append(s.key)
                req["since"].append(var.versions[i])
                targets.setdefault(s.ps, []).append((var, i))
        for ps, reply in self._fanout("Pull", requests).items():
            for (var, i), shard_reply in zip(targets[ps], reply["shards"]):
                var.apply(i, shard_reply)

    def push(self, optimizer_id: str, items: Sequence[tuple[LocalVariable, torch.Tensor, int]],
             options: Optional[Sequence[dict]] = None) -> None:
        """Apply gradients with the ps-side optimizer ``optimizer_id``; refresh the local copies.

        ``items`` are ``(variable, gradient, param group index)``; ``options`` (one dict per
        group, e.g. the learning rate the coordinator's schedule set) replace the ps-side
        optimizer's options before the update.
        """
        requests: dict[int, dict] = {}
        targets: dict[int, list[tuple[LocalVariable, int]]] = {}
        for var, grad, group in items:
            for i, part in enumerate(split_gradient(var.spec, grad)):
                s = var.spec.shards[i]
                req = requests.setdefault(s.ps, {"opt": optimizer_id, "keys": [], "grads": [], "since": [],
                                                 "groups": [], "options": options})
                req["keys"].append(s.key)
                req["grads"].append(part)  # None: no row of this shard was touched; just refresh it
                req["since"].append(var.versions[i])
                req["groups"].append(group)
                targets.setdefault(s.ps, []).append((var, i))
        for ps, reply in self._fanout("Push", requests).items():
            for (var, i), shard_reply in zip(targets[ps], reply["shards"]):
                var.apply(i, shard_reply)

    def assign(self, items: Sequence[tuple[VariableSpec, torch.Tensor]]) -> None:
        """Overwrite variables with whole values (restoring a checkpoint)."""
        requests: dict[int, list] = {}
        for spec, value in items:
            if tuple(value.shape) != spec.shape:
                raise ValueError(f"cannot assign a value of shape {tuple(value.shape)} to {spec.name} of shape {spec.shape}")
            for i, s in enumerate(spec.shards):
                requests.setdefault(s.ps, []).append({"key": s.key, "value": spec.shard_view(value, i)})
        self._fanout("Assign", {ps: {"vars": v} for ps, v in requests.items()})

    # ------------------------------------------------------------------ optimizer state
    def create_optimizer(self, optimizer_id: str, factory: bytes,
                         entries: Sequence[tuple[VariableSpec, dict]]) -> None:
        """Create, beside every shard, an optimizer of the pickled class ``factory`` with its group's options."""
        requests: dict[int, dict] = {}
        for spec, options in entries:
            for s in spec.shards:
                req = requests.setdefault(s.ps, {"opt": optimizer_id, "factory": factory, "keys": [], "options": []})
                req["keys"].append(s.key)
                req["options"].append(options)
        self._fanout("CreateOptimizer", requests)

    def optimizer_state(self, optimizer_id: str, spec: VariableSpec) -> list[dict]:
        """The optimizer state of every shard of ``spec``, in shard order."""
        replies = self._fanout("GetOptimizerState", {
            ps: {"opt": optimizer_id, "keys": [s.key for s in spec.shards if s.ps == ps]}
            for ps in {s.ps for s in spec.shards}})
        by_key: dict[str, dict[str, Any]] = {}
        for ps, reply in replies.items():
            by_key.update(zip([s.key for s in spec.shards if s.ps == ps], reply["states"]))
        return [by_key[s.key] for s in spec.shards]

    def set_optimizer_state(self, optimizer_id: str, spec: VariableSpec, states: Sequence[dict], options: dict) -> None:
        requests: dict[int, dict] = {}
        for s, state in zip(spec.shards, states):
            req = requests.setdefault(s.ps, {"opt": optimizer_id, "keys": [], "states": [], "options": options})
            req["keys"].append(s.key)
            req["states"].append(state)
        self._fanout("SetOptimizerState", requests)

    def close(self) -> None:
        for c in self._conns:
            c.close()
