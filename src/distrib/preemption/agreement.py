"""How the workers agree on the step to save at, with nothing on a step's path until a notice comes.

TF's design (``failure_handling.py``), over a small key-value store instead of TF's
coordination service: the chief hosts a ``torch.distributed.TCPStore`` of the handler's
own (a free port, told to the others once, when the handler is made), and every worker
runs a watcher thread that asks the store every ``poll`` seconds (0.1) whether a step was
proposed. A training step itself does no communication for the handler: it reads one
attribute.

The worker that gets the notice proposes ``total_run_calls + 1`` at its next ``run``
(``compare_set``: the first proposal wins; a later one learns the winner's step), then
waits until every other worker's watcher has acknowledged it before it runs another step.
That is enough because synchronous training keeps the workers within one step of each
other: every step all-reduces, so no worker can finish step ``n + 1`` before the proposer
runs it. Each worker saves when its count reaches the agreed step, so all save the same
step. A worker that finds itself already past the agreed step (a loop whose steps do not
all communicate) gets an error rather than an inconsistent checkpoint.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["StepAgreement", "store_host"]

log = logging.getLogger("distrib.preemption")

_STEP = "distrib/preemption/step"
_ACK = "distrib/preemption/ack"


class StepAgreement:
    """The store, the watcher thread and the proposal of one handler on one worker of several.

    Made on every worker at once (the chief's port is broadcast: a collective).
    ``on_step(step)`` is called from the watcher thread once a step is proposed.
    """

    def __init__(
        self, strategy: Strategy, host: str, on_step: Callable[[int], None], poll: float = 0.1, timeout: float = 60.0
    ) -> None:
        from distrib.comm.rendezvous import tcp_store  # imports torch.distributed: only when a cluster is there

        self.rank, self.world_size = strategy.worker_index, strategy.num_workers
        self._on_step = on_step
        self._poll = poll
        server: Any = tcp_store(host, 0, self.world_size, True, timeout) if self.rank == 0 else None
        port = strategy.communicator.broadcast_object(server.port if server is not None else None)
        self._server = server  # the chief keeps its server alive as long as the handler
        self._store: Any = server if server is not None else tcp_store(host, int(port), self.world_size, False, timeout)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="distrib-preemption-watcher", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self._poll):
            try:
                if not self._store.check([_STEP]):
                    continue
                step = int(self._store.get(_STEP))
                self._on_step(step)
                self._store.set(f"{_ACK}/{self.rank}", "1")
                log.info("worker %d: the cluster saves after step %d (acknowledged)", self.rank, step)
            except Exception as e:  # noqa: BLE001 - the chief's store is gone: the job is ending anyway
                log.debug("preemption watcher of worker %d stops: %s", self.rank, e)
            return

    def propose(self, step: int, timeout: float) -> int:
        """Propose ``step``; return the step agreed (an earlier proposal wins) once every worker knows it.

        Raises ``TimeoutError`` when some worker did not acknowledge within ``timeout`` seconds.
        """
        agreed = int(self._store.compare_set(_STEP, "", str(step)))
        others = [f"{_ACK}/{r}" for r in range(self.world_size) if r != self.rank]
        deadline = time.monotonic() + timeout
        # polled from Python, not store.wait(): that call keeps the GIL, so this process's own watcher could not
        # acknowledge a peer that is proposing at the same moment (a notice to every worker at once)
        while True:
            try:
                if self._store.check(others):
                    return agreed
            except Exception as e:  # noqa: BLE001 - the chief's store is gone
                raise TimeoutError(f"the step to save at ({agreed}) could not be agreed: {e}") from e
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"not every worker acknowledged the step to save at ({agreed}) within {timeout:.1f}s"
                )
            time.sleep(0.002)

    def close(self) -> None:
        """Stop the watcher (it sleeps in Python between looks: joined within ``poll``)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._poll + 2.0)

    @property
    def watching(self) -> bool:
        return self._thread.is_alive()

    def __repr__(self) -> str:
        return f"StepAgreement(rank={self.rank}, world_size={self.world_size}, watching={self.watching})"


def store_host(strategy: Strategy) -> str | None:
    """Where the chief's store is reached: the host of the cluster's rendezvous address, else ``MASTER_ADDR``."""
    import os

    resolver = strategy.cluster_resolver
    if resolver is not None:
        try:
            address = resolver.rendezvous_address()
        except (KeyError, ValueError, AttributeError):
            address = ""
        host = address.rpartition(":")[0].strip("[]")
        if host:
            return host
    return os.environ.get("MASTER_ADDR")
