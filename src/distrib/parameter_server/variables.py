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

import math
import numbers
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from distrib import torch_patches
from distrib.parameter_server.errors import ParameterServerUnavailableError
from distrib.parameter_server.partitioners import shard_offsets
from distrib.parameter_server.transport import wire
from distrib.parameter_server.transport.rpc import (
    MESSAGE_MARGIN_BYTES,
    PS_SERVICE,
    Connection,
    TLSConfig,
    max_message_bytes,
)

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
        return tensor[s.start : s.stop]


def _num_shards(partitioner: Callable[..., Any], name: str, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The shard count ``partitioner`` gives; a ValueError that explains when its answer is unusable."""
    parts = partitioner(shape, dtype)
    valid = (
        isinstance(parts, (list, tuple))
        and len(parts) == len(shape)
        and all(isinstance(p, numbers.Integral) and not isinstance(p, bool) for p in parts)
    )
    if not valid or int(parts[0]) < 1 or any(int(p) != 1 for p in parts[1:]):
        raise ValueError(
            f"variable_partitioner {partitioner!r} returned {parts!r} for {name} of shape {shape}; it must return a "
            f"list of {len(shape)} int(s), [n, 1, ...] with n >= 1 shards along dim 0 (e.g. "
            f"{[2] + [1] * (len(shape) - 1)}). Partitioners are called as partitioner(shape, dtype), like "
            "ds.partitioners.MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2)"
        )
    return min(int(parts[0]), shape[0]) if shape[0] else 1


class Placer:
    """Decides the shards of each new variable and puts them on ps tasks round robin (TF's rule).

    Every shard takes the next ps task in turn, so an unpartitioned variable goes
    where the previous variable's last shard did not. A shard must fit in one message
    (``max_shard_bytes``: the cluster's message limit less a margin); a larger one is a
    ValueError that says how to partition the parameter.
    """

    def __init__(
        self,
        num_ps: int,
        partitioner: Callable[..., Sequence[int]] | None,
        prefix: str,
        max_shard_bytes: int | None = None,
    ) -> None:
        self.num_ps = num_ps
        self.partitioner = partitioner
        self.prefix = prefix
        self.max_shard_bytes = max_shard_bytes
        self._count = 0
        self._variables = 0

    def place(self, name: str, value: torch.Tensor) -> VariableSpec:
        shape = tuple(value.shape)
        num_shards = 1
        if self.partitioner is not None and shape:
            num_shards = _num_shards(self.partitioner, name, shape, value.dtype)
        offsets = shard_offsets(shape[0], num_shards) if shape else [0, 0]
        if self.max_shard_bytes is not None:
            row_bytes = value.element_size() * (math.prod(shape[1:]) if shape else 1)
            largest = max(b - a for a, b in zip(offsets, offsets[1:])) * row_bytes if shape else row_bytes
            if largest > self.max_shard_bytes:
                raise ValueError(
                    f"parameter {name} of shape {shape} would have a shard of {largest} bytes, more than the "
                    f"{self.max_shard_bytes} bytes a message to a ps may carry (DISTRIB_MAX_MESSAGE_BYTES less a margin). "
                    f"Partition it, e.g. ParameterServerStrategy(..., variable_partitioner="
                    f"ds.partitioners.MaxSizePartitioner(max_shard_bytes={self.max_shard_bytes // 2})), or raise "
                    "DISTRIB_MAX_MESSAGE_BYTES on every task"
                )
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
            elif "rows" in reply:  # index_copy_ wants the rows beside the copy (a worker's may be on its GPU)
                view.index_copy_(0, reply["rows"].to(view.device), reply["vals"].to(view.device, view.dtype))
        self.versions[index] = reply["v"]

    def invalidate(self) -> None:
        self.versions = [0] * len(self.spec.shards)


def split_gradient(spec: VariableSpec, grad: torch.Tensor) -> list[torch.Tensor | None]:
    """Per-shard parts of a whole gradient; sparse gradients keep only each shard's touched rows."""
    if not grad.is_sparse:
        return [spec.shard_view(grad, i) for i in range(len(spec.shards))]
    grad = grad.coalesce()
    rows, values = grad.indices()[0], grad.values()
    if len(spec.shards) == 1:
        s = spec.shards[0]
        return [
            torch.sparse_coo_tensor(
                rows.unsqueeze(0),
                values,
                (s.stop - s.start, *spec.shape[1:]),
                check_invariants=False,
                is_coalesced=True,
            )
        ]
    parts: list[torch.Tensor | None] = []
    for s in spec.shards:
        mask = (rows >= s.start) & (rows < s.stop)
        if not bool(mask.any()):
            parts.append(None)
            continue
        parts.append(
            torch.sparse_coo_tensor(
                (rows[mask] - s.start).unsqueeze(0),
                values[mask],
                (s.stop - s.start, *spec.shape[1:]),
                check_invariants=False,
                is_coalesced=True,
            )
        )
    return parts


def _nbytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    if t.is_sparse:
        return sum(_nbytes(part) for part in torch_patches.sparse_parts(t))
    return t.numel() * t.element_size()


def _shard_nbytes(spec: VariableSpec, index: int) -> int:
    s = spec.shards[index]
    rows = (s.stop - s.start) if spec.shape else 1
    return rows * math.prod(spec.shape[1:]) * spec.torch_dtype.itemsize


_ENTRY_OVERHEAD = 1024  # an entry's share of a message besides its tensors (key, version, JSON)


class ParameterClient:
    """Calls to every ps task; requests to several ps tasks go out together.

    A request that would exceed the cluster's message limit is split into several
    calls to the same ps (every single shard fits: the :class:`Placer` made sure).
    """

    def __init__(
        self, ps_addresses: Sequence[str], token: str, tls: TLSConfig | None = None, max_message: int | None = None
    ) -> None:
        self._conns = [
            Connection(
                a,
                PS_SERVICE,
                token,
                tls,
                task=f"/job:ps/task:{i}",
                unavailable=ParameterServerUnavailableError,
                max_message=max_message,
            )
            for i, a in enumerate(ps_addresses)
        ]
        limit = self._conns[0].max_message if self._conns else max_message_bytes(max_message)
        #: how many bytes of tensors one call carries at most
        self.budget = limit - MESSAGE_MARGIN_BYTES

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
                raise ParameterServerUnavailableError(
                    conn.address, f"did not answer within {timeout:.0f}s ({e})", conn.task
                ) from None

    def _fanout(
        self,
        method: str,
        common: dict[int, dict],
        entries: dict[int, list[tuple[int, dict]]],
        reply_field: str | None = None,
    ) -> dict[int, list]:
        """Send ``entries`` (``(bytes, fields)`` per item) to each ps, as few calls as the message limit allows.

        Each call carries ``common[ps]`` and, for every field, the list of its entries' values.
        Returns each ps's replies to ``reply_field`` concatenated in entry order.
        """
        calls: list[tuple[int, Any]] = []
        for ps, items in entries.items():
            chunk: list[dict] = []
            size = 0
            for nbytes, item in items + [(-1, {})]:
                if chunk and (nbytes < 0 or size + nbytes + _ENTRY_OVERHEAD > self.budget):
                    request = dict(common.get(ps, {}))
                    for field in chunk[0]:
                        request[field] = [c[field] for c in chunk]
                    calls.append((ps, self._conns[ps].future(method, wire.encode(request))))
                    chunk, size = [], 0
                if nbytes >= 0:
                    chunk.append(item)
                    size += nbytes + _ENTRY_OVERHEAD
        replies: dict[int, list] = {}
        for ps, f in calls:
            reply = wire.decode(self._conns[ps].result(f))
            if not isinstance(reply, dict):
                raise RuntimeError(f"{self._conns[ps].task} answered {method} with {type(reply).__name__}")
            if "error" in reply:
                self._raise(ps, reply["error"])
            replies.setdefault(ps, []).extend(reply.get(reply_field, []) if reply_field else [])
        return replies

    def _raise(self, ps: int, error: dict) -> None:
        conn = self._conns[ps]
        if error.get("type") == "UnknownVariable":
            raise ParameterServerUnavailableError(
                conn.address, f"it lost its variables ({error.get('message')}); it was probably restarted", conn.task
            )
        raise RuntimeError(f"{conn.task} ({conn.address}) failed: {error.get('type')}: {error.get('message')}")

    # ------------------------------------------------------------------ variables
    def create(self, items: Sequence[tuple[VariableSpec, torch.Tensor]]) -> None:
        """Store the initial value of every shard of every variable on its ps task."""
        entries: dict[int, list[tuple[int, dict]]] = {}
        for spec, value in items:
            for i, s in enumerate(spec.shards):
                view = spec.shard_view(value, i)
                entries.setdefault(s.ps, []).append((_nbytes(view), {"vars": {"key": s.key, "value": view}}))
        self._fanout("Create", {}, entries)

    def pull(self, variables: Iterable[LocalVariable]) -> None:
        """Refresh local copies: only shards (or rows) changed since their versions travel."""
        entries: dict[int, list[tuple[int, dict]]] = {}
        targets: dict[int, list[tuple[LocalVariable, int]]] = {}
        for var in variables:
            for i, s in enumerate(var.spec.shards):
                entries.setdefault(s.ps, []).append(
                    (_shard_nbytes(var.spec, i), {"keys": s.key, "since": var.versions[i]})
                )
                targets.setdefault(s.ps, []).append((var, i))
        for ps, shard_replies in self._fanout("Pull", {}, entries, "shards").items():
            for (var, i), shard_reply in zip(targets[ps], shard_replies):
                var.apply(i, shard_reply)

    def push(
        self,
        optimizer_id: str,
        items: Sequence[tuple[LocalVariable, torch.Tensor, int]],
        options: Sequence[dict] | None = None,
    ) -> None:
        """Apply gradients with the ps-side optimizer ``optimizer_id``; refresh the local copies.

        ``items`` are ``(variable, gradient, param group index)``; ``options`` (one dict per
        group, e.g. the learning rate the coordinator's schedule set) replace the ps-side
        optimizer's options before the update.
        """
        entries: dict[int, list[tuple[int, dict]]] = {}
        targets: dict[int, list[tuple[LocalVariable, int]]] = {}
        for var, grad, group in items:
            for i, part in enumerate(split_gradient(var.spec, grad)):
                s = var.spec.shards[i]
                # None: no row of this shard was touched; just refresh it
                nbytes = max(_nbytes(part), _shard_nbytes(var.spec, i))  # the reply may hold the whole shard
                entries.setdefault(s.ps, []).append(
                    (nbytes, {"keys": s.key, "grads": part, "since": var.versions[i], "groups": group})
                )
                targets.setdefault(s.ps, []).append((var, i))
        common = {ps: {"opt": optimizer_id, "options": options} for ps in entries}
        for ps, shard_replies in self._fanout("Push", common, entries, "shards").items():
            for (var, i), shard_reply in zip(targets[ps], shard_replies):
                var.apply(i, shard_reply)

    def assign(self, items: Sequence[tuple[VariableSpec, torch.Tensor]]) -> None:
        """Overwrite variables with whole values (restoring a checkpoint)."""
        entries: dict[int, list[tuple[int, dict]]] = {}
        for spec, value in items:
            if tuple(value.shape) != spec.shape:
                raise ValueError(
                    f"cannot assign a value of shape {tuple(value.shape)} to {spec.name} of shape {spec.shape}"
                )
            value = value.to(spec.torch_dtype)
            for i, s in enumerate(spec.shards):
                view = spec.shard_view(value, i)
                entries.setdefault(s.ps, []).append((_nbytes(view), {"vars": {"key": s.key, "value": view}}))
        self._fanout("Assign", {}, entries)

    # ------------------------------------------------------------------ optimizer state
    def create_optimizer(self, optimizer_id: str, factory: bytes, entries: Sequence[tuple[VariableSpec, dict]]) -> None:
        """Create, beside every shard, an optimizer of the pickled class ``factory`` with its group's options."""
        per_ps: dict[int, list[tuple[int, dict]]] = {}
        for spec, options in entries:
            for s in spec.shards:
                per_ps.setdefault(s.ps, []).append((0, {"keys": s.key, "options": options}))
        common = {ps: {"opt": optimizer_id, "factory": factory} for ps in per_ps}
        self._fanout("CreateOptimizer", common, per_ps)

    def optimizer_state(self, optimizer_id: str, spec: VariableSpec) -> list[dict]:
        """The optimizer state of every shard of ``spec``, in shard order."""
        per_ps: dict[int, list[tuple[int, dict]]] = {}
        for i, s in enumerate(spec.shards):
            per_ps.setdefault(s.ps, []).append((2 * _shard_nbytes(spec, i), {"keys": s.key}))
        replies = self._fanout("GetOptimizerState", {ps: {"opt": optimizer_id} for ps in per_ps}, per_ps, "states")
        by_key: dict[str, dict[str, Any]] = {}
        for ps, states in replies.items():
            by_key.update(zip([s.key for s in spec.shards if s.ps == ps], states))
        return [by_key[s.key] for s in spec.shards]

    def set_optimizer_state(self, optimizer_id: str, spec: VariableSpec, states: Sequence[dict], options: dict) -> None:
        per_ps: dict[int, list[tuple[int, dict]]] = {}
        for s, state in zip(spec.shards, states):
            nbytes = sum(_nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
            per_ps.setdefault(s.ps, []).append((nbytes, {"keys": s.key, "states": state}))
        self._fanout("SetOptimizerState", {ps: {"opt": optimizer_id, "options": options} for ps in per_ps}, per_ps)

    def read_shards(self, spec: VariableSpec) -> list[torch.Tensor]:
        """Every shard of ``spec`` as its ps task holds it now, in row order."""
        per_ps: dict[int, list[tuple[int, dict]]] = {}
        for i, s in enumerate(spec.shards):
            per_ps.setdefault(s.ps, []).append((_shard_nbytes(spec, i), {"keys": s.key, "since": 0}))
        replies = self._fanout("Pull", {}, per_ps, "shards")
        by_key: dict[str, torch.Tensor] = {}
        for ps, shards in replies.items():
            by_key.update(zip([s.key for s in spec.shards if s.ps == ps], (r["full"] for r in shards)))
        return [by_key[s.key].clone() for s in spec.shards]

    def close(self) -> None:
        for c in self._conns:
            c.close()
