"""One random stream per tensor-parallel group: what ``MeshStrategy`` draws its random numbers from.

The workers of one tensor-parallel group compute one replica together: an activation after a
``RowwiseParallel`` layer is whole, and the same, on each of them. A dropout mask (stochastic depth, a
random augmentation) drawn there must be the same on each too, or the group trains on inconsistent halves
and the parameters the layout map leaves whole drift apart between its workers. Users seed each process
(``torch.manual_seed(base + rank)``), or not at all, so the process's own generators cannot be trusted for
that: torchtitan and Megatron keep one stream per tensor-parallel group, seeded once for the group.

:class:`GroupRandomStream` is such a stream: the state of the generators a step draws from (torch's CPU
generator, the worker's CUDA device's, Python's ``random`` and NumPy's where it is installed), seeded from one
seed that every worker agrees on (the chief's ``torch.initial_seed()``, broadcast at the stream's first
use) and the worker's data-parallel index. Entering :meth:`GroupRandomStream.swapped` exchanges the
process's live state with the stream's; leaving exchanges them back, so the stream goes on where it
stopped and the process's own draws are untouched. The workers of one group enter at the same points of
the same program and draw the same values; the data-parallel replicas draw different ones.

``MeshStrategy`` keeps two: one for the model (every ``strategy.run``, so ``ds.fit`` too) and one for its
sharded ``DataLoader`` (the base seed of the loader's worker processes, and the transforms when it loads in
the main process). The sampler's shuffle stays on the process's generators: it must be the same on every
worker, and the input checks that it is.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["GroupRandomStream", "stream_seed"]


def stream_seed(seed: int, purpose: str, data_index: int) -> int:
    """The seed of one stream: distinct for each ``(seed, purpose, data_index)``, the same on every worker.

    >>> stream_seed(0, "model", 0) == stream_seed(0, "model", 0) != stream_seed(0, "model", 1)
    True
    """
    digest = hashlib.blake2b(f"{seed}:{purpose}:{data_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # below 2**63: every generator takes it


class GroupRandomStream:
    """The generators' state for one purpose (``"model"``, ``"input"``) of one tensor-parallel group.

    Args:
        purpose: what draws from it; streams of different purposes never coincide.
        data_index: this worker's data-parallel index (the same on every worker of its group).
        device: the worker's device; a CUDA device's generator is part of the stream.
        agree_seed: called once, at the first use, on every worker at the same point: returns the seed
            every worker agrees on (a collective).
    """

    def __init__(self, purpose: str, data_index: int, device: torch.device, agree_seed: Callable[[], int]) -> None:
        self.purpose = purpose
        self.data_index = data_index
        self.device = device
        self._agree_seed = agree_seed
        #: the agreed seed, None before the first use
        self.seed: int | None = None
        # the stream's state while it is not live; the process's while it is (one slot, exchanged)
        self._held: dict[str, Any] = {}
        #: whether the stream is the live state of the process's generators now
        self.live = False
        self._numpy: Any = None

    def _first_state(self) -> dict[str, Any]:
        """The stream's state before its first draw, from the agreed seed."""
        self.seed = int(self._agree_seed())
        seed = stream_seed(self.seed, self.purpose, self.data_index)
        state: dict[str, Any] = {
            "torch": torch.Generator().manual_seed(seed).get_state(),
            "python": random.Random(seed).getstate(),
        }
        if self.device.type == "cuda":
            state["cuda"] = torch.Generator(device=self.device).manual_seed(seed).get_state()
        # NumPy where it is imported (torch imports it when installed); the stream never imports it itself
        self._numpy = sys.modules.get("numpy")
        if self._numpy is not None:
            state["numpy"] = self._numpy.random.RandomState(seed % 2**32).get_state()
        return state

    def _exchange(self) -> None:
        """Put the held state into the generators and hold what they had."""
        if self.seed is None:
            self._held = self._first_state()
        live: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        torch.set_rng_state(self._held["torch"])
        random.setstate(self._held["python"])
        if self.device.type == "cuda":
            live["cuda"] = torch.cuda.get_rng_state(self.device)
            torch.cuda.set_rng_state(self._held["cuda"], self.device)
        if self._numpy is not None:
            live["numpy"] = self._numpy.random.get_state()
            self._numpy.random.set_state(self._held["numpy"])
        self._held = live
        self.live = not self.live

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """The stream live inside (or, entered while it is live, the process's own generators again)."""
        self._exchange()
        try:
            yield
        finally:
            self._exchange()

    def active(self) -> contextlib.AbstractContextManager[None]:
        """The stream live inside, whether or not it already was."""
        return contextlib.nullcontext() if self.live else self.swapped()

    def suspended(self) -> contextlib.AbstractContextManager[None]:
        """The process's own generators live inside, whether or not the stream was."""
        return self.swapped() if self.live else contextlib.nullcontext()
