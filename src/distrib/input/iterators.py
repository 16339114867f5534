"""Iterating distributed input: TF's iterator API, and the copy of each step's parts to the replicas' devices
(with a prefetch of the next steps on a side CUDA stream, TF's ``experimental_per_replica_buffer_size``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from distrib.input.batches import spec_of, to_device
from distrib.values import regroup

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["DevicePrefetcher", "DistributedIterator", "OptionalValue", "OutOfRangeError", "place", "prefetching"]


class OutOfRangeError(StopIteration):
    """``get_next()`` at the end of the data (``tf.errors.OutOfRangeError``); a ``StopIteration`` too."""


class OptionalValue:
    """What ``get_next_as_optional()`` returns (``tf.experimental.Optional``): a value, or nothing at the end.

    A loop that must not raise at the end of the data (TF's ``while optional.has_value()`` idiom) checks
    :meth:`has_value` before it takes the element with :meth:`get_value`.

    Args:
        value: the element (a ``PerReplica`` structure, as ``get_next()`` returns); ignored without ``has_value``.
        has_value: whether there is an element; False (the default) is the empty optional of the end.
    """

    def __init__(self, value: Any = None, has_value: bool = False) -> None:
        self._value, self._has_value = value, has_value

    def has_value(self) -> bool:
        """Whether this optional holds an element.

        Returns:
            True before the end of the data, False at the end.
        """
        return self._has_value

    def get_value(self) -> Any:
        """The element.

        Returns:
            The element ``get_next()`` would have returned.

        Raises:
            OutOfRangeError: the optional is empty (the end of the data).
        """
        if not self._has_value:
            raise OutOfRangeError("the iterator is exhausted: check has_value() before get_value()")
        return self._value


class DistributedIterator:
    """``iter(distributed_dataset)``: ``next()``, and TF's ``get_next()``, ``get_next_as_optional()``, ``element_spec``.

    Example::

        >>> import distrib as ds, torch
        >>> it = iter(ds.MirroredStrategy(["cpu:0", "cpu:1"]).experimental_distribute_dataset([torch.arange(4.0)]))
        >>> it.element_spec
        TensorSpec(shape=(None,), dtype=torch.float32)
        >>> it.get_next().values
        (tensor([0., 1.]), tensor([2., 3.]))
        >>> it.get_next_as_optional().has_value()
        False
    """

    def __init__(self, elements: Iterator[Any], strategy: Strategy) -> None:
        self._elements = elements
        self._strategy = strategy
        self._peeked: list[Any] = []
        self._spec: Any = None

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        if self._peeked:
            return self._peeked.pop()
        element = next(self._elements)
        if self._spec is None:
            self._spec = spec_of(self._strategy.experimental_local_results(element)[0])
        return element

    def get_next(self) -> Any:
        """The next element; :class:`OutOfRangeError` at the end, as TF."""
        try:
            return next(self)
        except StopIteration:
            raise OutOfRangeError("End of sequence") from None

    def get_next_as_optional(self) -> OptionalValue:
        """The next element as an :class:`OptionalValue` (empty at the end), as TF."""
        try:
            return OptionalValue(next(self), True)
        except StopIteration:
            return OptionalValue()

    @property
    def element_spec(self) -> Any:
        """The :class:`TensorSpec` structure of one replica's element (reads ahead one element if none was read)."""
        if self._spec is None:
            self._peeked.append(next(self))
        return self._spec


def place(parts: Sequence[Any], devices: Sequence[torch.device | None], fetch_to_device: bool) -> Any:
    """The element ``strategy.run`` takes from the local replicas' ``parts``: each on its replica's device
    (unless ``fetch_to_device`` is False), grouped as a PerReplica structure when there are several."""
    if fetch_to_device:
        parts = [to_device(p, d, pin=True) for p, d in zip(parts, devices)]
    return parts[0] if len(parts) == 1 else regroup(list(parts))


class DevicePrefetcher:
    """The elements of ``parts`` (lists of the local replicas' host parts), ``depth`` steps ahead of the one
    returned: their copies to the CUDA replicas' devices are issued on a side stream per device, from pinned
    memory, while the current step computes (TF's ``experimental_per_replica_buffer_size``).

    Only the copies run ahead: reading the parts (and the workers' per-step agreement, a collective) stays in
    the caller's thread, in step order, so every worker issues its collectives in the same order. An element
    is handed out once its copies are ordered before the consumer's stream (``wait_event``), and its tensors are
    recorded on that stream so that their memory is not reused while the step still reads it.
    """

    def __init__(self, parts: Iterator[Sequence[Any]], devices: Sequence[torch.device | None], depth: int) -> None:
        self._parts = parts
        self._devices = list(devices)
        self._depth = depth
        self._ready: deque[tuple[list[Any], list[tuple[torch.device, Any]]]] = deque()
        self._ended = False
        self._streams = {d: torch.cuda.Stream(d) for d in self._devices if d is not None and d.type == "cuda"}

    def __iter__(self) -> DevicePrefetcher:
        return self

    def _start(self, parts: Sequence[Any]) -> tuple[list[Any], list[tuple[torch.device, Any]]]:
        moved, events = [], []
        for part, device in zip(parts, self._devices):
            stream = self._streams.get(device) if device is not None else None
            if stream is None or device is None:
                moved.append(to_device(part, device))
                continue
            with torch.cuda.stream(stream):
                moved.append(to_device(part, device, pin=True))
                event = torch.cuda.Event()
                event.record(stream)
            events.append((device, event))
        return moved, events

    def __next__(self) -> Any:
        while len(self._ready) <= self._depth and not self._ended:
            try:
                parts = next(self._parts)
            except StopIteration:
                self._ended = True
                break
            self._ready.append(self._start(parts))
        if not self._ready:
            raise StopIteration
        moved, events = self._ready.popleft()
        for device, event in events:
            consumer = torch.cuda.current_stream(device)
            consumer.wait_event(event)
            for part in moved:
                for leaf in pytree.tree_leaves(part):
                    if isinstance(leaf, torch.Tensor) and leaf.device == device:
                        leaf.record_stream(consumer)
        return moved[0] if len(moved) == 1 else regroup(moved)


def prefetching(
    parts: Iterator[Sequence[Any]], devices: Sequence[torch.device | None], fetch_to_device: bool, depth: int
) -> Iterator[Any]:
    """The elements of ``parts`` placed on ``devices``: through a :class:`DevicePrefetcher` where it helps (some
    device is a GPU, fetching is on, ``depth`` > 0), else one by one (on the CPU there is no copy to overlap)."""
    if fetch_to_device and depth > 0 and any(d is not None and d.type == "cuda" for d in devices):
        return DevicePrefetcher(parts, devices, depth)
    return (place(p, devices, fetch_to_device) for p in parts)
