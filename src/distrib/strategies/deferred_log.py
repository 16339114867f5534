"""The log of a deferred build, and its replay: what ``deferred_record`` records and ``deferred_materialise`` runs.

A node is one storage of the build (a ``torch.empty``, or an op's output: a value computed for real
during the build is written into its node by a recorded ``copy_`` from a :class:`Const`);
an entry is one aten op with its arguments as :class:`Ref`\\ s (views of nodes), :class:`Const`\\ s
(real tensors it read) and plain values, and the generator state from just before it if it draws
random numbers. :func:`replay` runs what some nodes depend on, in order, on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

if TYPE_CHECKING:
    from distrib.strategies.deferred_record import Session

__all__ = ["Ref", "Const", "Node", "Entry", "Scratch", "replay", "view_of"]


@dataclass(frozen=True)
class Ref:
    """A deferred tensor as an op saw it: a view (size, stride, storage offset) of node ``node``'s storage."""

    node: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def covers(self, numel: int) -> bool:
        """Whether this view is the whole node, contiguous."""
        expected, running = [], 1
        for d in reversed(self.size):
            expected.append(running)
            running *= d
        return (
            self.offset == 0
            and running == numel
            and all(s == e for s, e, d in zip(self.stride, reversed(expected), self.size) if d > 1)
        )


@dataclass(frozen=True)
class Const:
    """A real tensor an op read (a clone: the user may change the original later)."""

    value: torch.Tensor


@dataclass
class Node:
    """One storage of the deferred build: ``empty`` (uninitialised) or an op's ``output``."""

    dtype: torch.dtype
    numel: int
    kind: str
    meta: torch.Tensor  # a meta tensor on the node's storage: keeps the storage (and so its id) alive
    layout: Ref  # the tensor that made it, as made (``meta`` may be changed in place later: ``t_()``)


@dataclass
class Entry:
    """One recorded aten op: its arguments (Refs, Consts, plain values), the generator state before it (random
    ops), and which nodes it reads, writes, wholly overwrites and creates."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: tuple[torch.Generator, torch.Tensor] | None
    outputs: list[int | None]
    reads: frozenset[int]
    writes: frozenset[int]
    overwrites: frozenset[int] = frozenset()


class Scratch:
    """One reusable buffer for the temporary whole tensors of a build (throwaway draws, replayed tensors).

    Each temporary is as large as one tensor of the model; allocating a fresh one for each would seem
    as cheap, but glibc's heap keeps a freed block, the small allocations that follow split it, and the
    next block goes above them: the resident memory grew by a tensor per tensor (measured: the whole
    model again). So the largest buffer asked for is kept and lent out, one borrower at a time; a second
    borrower gets a buffer of its own.
    """

    def __init__(self) -> None:
        self._storage: torch.UntypedStorage | None = None
        self._lent = False

    def take(self, size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of ``size``, ``stride`` and ``dtype`` (on the CPU); :meth:`give` it back."""
        extent = 1 + sum((d - 1) * st for d, st in zip(size, stride)) if all(size) else 0
        nbytes = extent * dtype.itemsize
        if self._lent:
            return torch.empty_strided(size, stride, dtype=dtype)
        if self._storage is None or self._storage.nbytes() < nbytes:
            self._storage = None  # freed before the larger one is allocated
            self._storage = torch.UntypedStorage(max(nbytes, 1))
        self._lent = True
        return torch.empty(0, dtype=dtype).set_(self._storage, 0, size, stride)

    def give(self, t: torch.Tensor) -> None:
        """``t`` (from :meth:`take`) is no longer used."""
        if self._storage is not None and t.untyped_storage().data_ptr() == self._storage.data_ptr():
            self._lent = False


def view_of(storage: torch.Tensor, ref: Ref) -> torch.Tensor:
    """``ref``'s view of a node's real storage."""
    return storage.as_strided(ref.size, ref.stride, ref.offset)


# --------------------------------------------------------------------------- replay


def replay(
    session: Session, wanted: set[int], keep: bool = False, on_final: Callable[[int, torch.Tensor], None] | None = None
) -> dict[int, torch.Tensor]:
    """Replay what ``wanted`` nodes depend on, in order, on the CPU; ``on_final(node, storage)`` once a wanted
    node is final (then it is freed), or, with ``keep``, the wanted nodes' storages returned.

    Entries whose results nobody reads later are skipped (backward liveness over the log), every other
    node is freed after its last use, and each random op runs from its recorded generator state; the
    generators' current states are restored at the end.
    """
    entries = session.entries
    needed, live = set(wanted), []
    for i in range(len(entries) - 1, -1, -1):
        e = entries[i]
        defines = e.writes | {o for o in e.outputs if o is not None}
        if not defines & needed:
            continue
        live.append(i)
        needed -= e.overwrites | {o for o in e.outputs if o is not None}
        needed |= e.reads | (e.writes - e.overwrites)
    live.reverse()
    last: dict[int, int] = {}
    for i in live:
        e = entries[i]
        for n in e.reads | e.writes | {o for o in e.outputs if o is not None}:
            last[n] = i
    env: dict[int, torch.Tensor] = {}
    scratch, ours = Scratch(), set()

    def storage(n: int) -> torch.Tensor:
        if n not in env:
            node = session.nodes[n]
            env[n] = scratch.take((node.numel,), (1,), node.dtype)
            ours.add(n)
        return env[n]

    def finish(n: int) -> None:
        if n in wanted and on_final is not None:
            on_final(n, env[n])
        if not (keep and n in wanted):
            freed = env.pop(n, None)
            if n in ours and freed is not None:
                scratch.give(freed)

    generators = {id(e.rng[0]): e.rng[0] for e in entries if e.rng is not None}
    generators[id(torch.default_generator)] = torch.default_generator
    saved = {k: g.get_state() for k, g in generators.items()}
    try:
        with torch.no_grad(), session.owner.paused():
            for i in live:
                e = entries[i]

                def real(x: Any) -> Any:
                    return view_of(storage(x.node), x) if isinstance(x, Ref) else x.value  # a Const

                args = pytree.tree_map_only((Ref, Const), real, e.args)
                kwargs = pytree.tree_map_only((Ref, Const), real, e.kwargs)
                if e.rng is not None:
                    e.rng[0].set_state(e.rng[1])
                result = e.func(*args, **kwargs)
                inputs = {
                    id(t.untyped_storage()) for t in pytree.tree_leaves([args, kwargs]) if isinstance(t, torch.Tensor)
                }
                outs = (
                    [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
                    if any(o is not None for o in e.outputs)
                    else []
                )
                for made, out in zip(e.outputs, outs):
                    if made is None:
                        continue
                    n = made
                    node = session.nodes[n]
                    if (
                        tuple(out.stride()) == node.layout.stride
                        and out.storage_offset() == node.layout.offset
                        and out.untyped_storage().nbytes() >= node.numel * out.element_size()
                        and id(out.untyped_storage()) not in inputs
                    ):
                        env[n] = out
                    else:  # laid out otherwise than by the meta kernel, or a view of a value: copied, meta layout
                        env[n] = torch.empty(node.numel, dtype=out.dtype)
                        view_of(env[n], node.layout).copy_(out)
                for n in [n for n, at in last.items() if at == i]:
                    finish(n)
            for n in wanted - set(last):  # never written: uninitialised, or a value
                storage(n)
                finish(n)
    finally:
        for k, g in generators.items():
            g.set_state(saved[k])
    return env
