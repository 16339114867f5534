"""Materialising a deferred build: a sharded root gets its values, one tensor at a time, never whole.

``ShardedStrategy.distribute_module`` takes a root built under deferred initialisation
(:mod:`distrib.strategies.deferred_record`) through a :class:`MaterialisePlan`: every worker checks that
it built the same thing; tensors built with values take the chief's (broadcast, as before); the
deferred parameters and buffers become meta tensors, which ``fully_shard`` shards; ``to_empty``
allocates the shards; then the recorded build is replayed on the CPU, and each tensor's whole value,
once final, gives this worker its rows (FSDP2's ``Shard(0)``: ``distribute_tensor(...,
src_data_rank=None)``, no communication) and is freed. A digest of every tensor is compared over the
workers: where one differs from the chief's (workers seeded differently), that tensor is replayed
again and broadcast from the chief, one at a time, so every worker ends with the chief's values, as
``take_chiefs_values`` gave them for a model built whole.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from distrib.strategies.deferred_log import Ref, replay, view_of
from distrib.strategies.deferred_record import CPU, META, DeferredTensor, Session

__all__ = ["MaterialisePlan", "plan_materialisation"]

log = logging.getLogger("distrib.strategies")


@dataclass
class _Binding:
    name: str  # the first qualified name of the tensor in the root
    ref: Ref
    is_param: bool


@dataclass
class MaterialisePlan:
    """A root's deferred parameters and buffers, and how to give each its values once the root is sharded."""

    root: nn.Module
    session: Session
    bindings: list[_Binding] = field(default_factory=list)
    real: list[tuple[str, bool]] = field(default_factory=list)  # names of tensors that were built real

    def signature(self) -> str:
        """Names, dtypes and shapes of every parameter and buffer: what every worker must have built alike."""
        named = [*self.root.named_parameters(), *self.root.named_buffers()]
        return "; ".join(f"{n}: {str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for n, t in named)

    def take_chiefs_real_values(self, communicator: Any, device: torch.device | None) -> None:
        """The tensors built with values (not deferred) take the chief's, as ``take_chiefs_values`` gives them
        (through copies on ``device``: NCCL broadcasts only CUDA tensors)."""
        tensors = [self._get(name, is_param).detach() for name, is_param in self.real]
        if tensors and communicator.world_size > 1:
            moved = [t.to(device or CPU) for t in tensors]
            communicator.broadcast(moved, src=0)
            with torch.no_grad():
                for t, m in zip(tensors, moved):
                    if m is not t:
                        t.copy_(m)

    def to_meta(self) -> None:
        """Swap every deferred parameter and buffer for a meta one (what ``fully_shard`` and ``to_empty`` take)."""
        swapped: dict[int, torch.Tensor] = {}
        for module in self.root.modules():
            for leaf, p in list(module.named_parameters(recurse=False)):
                if isinstance(p, DeferredTensor):
                    if id(p) not in swapped:
                        swapped[id(p)] = nn.Parameter(
                            torch.empty_strided(p.size(), p.stride(), dtype=p.dtype, device=META),
                            requires_grad=p.requires_grad,
                        )
                    setattr(module, leaf, swapped[id(p)])
            for leaf, b in list(module.named_buffers(recurse=False)):
                if isinstance(b, DeferredTensor):
                    if id(b) not in swapped:
                        swapped[id(b)] = torch.empty_strided(b.size(), b.stride(), dtype=b.dtype, device=META)
                    setattr(module, leaf, swapped[id(b)])

    def materialise(self, device: torch.device | None, communicator: Any) -> None:
        """After ``fully_shard``: allocate (``to_empty``), keep the real tensors' values, replay the deferred ones
        tensor by tensor into this worker's shards, then make every worker hold the chief's values."""
        kept = {name: _local(self._get(name, is_param)).detach() for name, is_param in self.real}
        tied = _tied(self.root)
        self.root.to_empty(device=device or CPU)
        for names in tied:  # to_empty makes a new parameter per module: tie them again, as they were
            first = self.root.get_parameter(names[0])
            for name in names[1:]:
                owner, _, leaf = name.rpartition(".")
                if self.root.get_parameter(name) is not first:
                    setattr(self.root.get_submodule(owner), leaf, first)
        with torch.no_grad():
            for name, is_param in self.real:
                _local(self._get(name, is_param)).copy_(kept.pop(name))
        by_node: dict[int, list[_Binding]] = {}
        for b in self.bindings:
            by_node.setdefault(b.ref.node, []).append(b)
        digests: dict[str, str] = {}

        def fill(node: int, storage: torch.Tensor) -> None:
            for b in by_node[node]:
                whole = view_of(storage, b.ref)
                digests[b.name] = _digest(whole)
                self._place(b, whole)

        replay(self.session, set(by_node), on_final=fill)
        self._realise_attributes()
        if communicator.world_size > 1:
            everyone = communicator.all_gather_object([digests[b.name] for b in self.bindings])
            differ = [b for i, b in enumerate(self.bindings) if any(d[i] != everyone[0][i] for d in everyone)]
            if differ:
                log.warning(
                    "deferred init: the workers built %d of %d tensors with different values (seeded "
                    "differently?), e.g. %s; every worker takes the chief's",
                    len(differ),
                    len(self.bindings),
                    differ[0].name,
                )
            for b in differ:  # one tensor at a time, the same order everywhere
                replay(self.session, {b.ref.node}, on_final=self._chiefs(b, communicator, device))

    def _realise_attributes(self) -> None:
        """Tensors the build kept as plain attributes (``self.table = torch.empty(n).fill_(...)``, not a buffer)
        become real CPU tensors with their values, as in a plain build; deferred, every use after the build would
        replay their history again."""
        for module in self.root.modules():
            for attr, value in list(vars(module).items()):
                if isinstance(value, DeferredTensor) and value._session is self.session:
                    ref = value.ref()
                    real = view_of(replay(self.session, {ref.node}, keep=True)[ref.node], ref)
                    setattr(module, attr, real.requires_grad_(value.requires_grad) if real.is_leaf else real)

    def _chiefs(
        self, b: _Binding, communicator: Any, device: torch.device | None
    ) -> Callable[[int, torch.Tensor], None]:
        """What replaying ``b`` ends with: the chief's whole value broadcast (on ``device``: NCCL broadcasts only
        CUDA tensors), this worker's part of it kept."""

        def broadcast(node: int, storage: torch.Tensor) -> None:
            whole = view_of(storage, b.ref).contiguous().to(device or CPU)
            communicator.broadcast([whole], src=0)
            self._place(b, whole)

        return broadcast

    def _get(self, name: str, is_param: bool) -> torch.Tensor:
        return self.root.get_parameter(name) if is_param else self.root.get_buffer(name)

    def _place(self, b: _Binding, whole: torch.Tensor) -> None:
        """This worker's part of ``whole`` into the (sharded) parameter or buffer ``b``."""
        target = self._get(b.name, b.is_param)
        with torch.no_grad():
            if _is_dtensor(target):
                from distrib.strategies import fsdp  # imported with the sharded strategy, not at import distrib

                rows = fsdp.shard_state(whole, target).to_local()
                local = _local(target)
                if rows.shape != local.shape:
                    raise RuntimeError(
                        f"deferred init: {b.name}'s rows here are {list(rows.shape)} but its shard is "
                        f"{list(local.shape)} (a bug: FSDP's sharding changed)"
                    )
                local.copy_(rows)
            else:
                target.copy_(whole)


def _tied(root: nn.Module) -> list[list[str]]:
    """The qualified names of each parameter that several modules hold (weight tying), when there are such."""
    names: dict[int, list[str]] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [n for n in names.values() if len(n) > 1]


def _is_dtensor(t: Any) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "placements")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t  # type: ignore[attr-defined]


def _digest(t: torch.Tensor) -> str:
    """An exact digest of ``t``'s bytes: equal values give equal digests, on every worker."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(data.data, digest_size=16).hexdigest()


def plan_materialisation(root: nn.Module) -> MaterialisePlan | None:
    """The plan for ``root`` when it holds deferred tensors (built in a deferring scope), else None."""
    session, bindings, real, seen = None, [], [], set()
    for kind, named in (("param", root.named_parameters()), ("buffer", root.named_buffers())):
        for name, t in named:
            if id(t) in seen:
                continue
            seen.add(id(t))
            if isinstance(t, DeferredTensor):
                if session is not None and t._session is not session:
                    raise RuntimeError(
                        f"{type(root).__name__}.{name} was built in another strategy.scope() block "
                        "than the rest of the model; build the whole model inside one scope block"
                    )
                session = t._session
                bindings.append(_Binding(name, t.ref(), kind == "param"))
            elif t.is_meta:
                raise ValueError(
                    f"{type(root).__name__}.{name} was built on the meta device inside ShardedStrategy."
                    "scope(), which already builds without data and initialises shard by shard; build "
                    "it on the CPU (drop the torch.device('meta') block / init_empty_weights)"
                )
            else:
                real.append((name, kind == "param"))
    if session is None:
        return None
    if real:
        log.info(
            "deferred init: %s holds %d tensor(s) built with values (e.g. %s): they were whole on every "
            "worker until sharded",
            type(root).__name__,
            len(real),
            real[0][0],
        )
    return MaterialisePlan(root, session, bindings, real)
