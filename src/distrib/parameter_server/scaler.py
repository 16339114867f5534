"""``torch.amp.GradScaler`` inside functions scheduled on parameter-server workers.

The coordinator's ``GradScaler`` is the one authority: one scale, as TF keeps the loss scale
of its ``LossScaleOptimizer`` in one variable. A scheduled function that captures it uses,
on the worker, a copy that is torch's own ``GradScaler`` (one replica per worker: torch's
``scale``, ``unscale_``, ``step`` and ``update`` as they are), so a step whose gradients hold an
inf or NaN is skipped there (``optimizer.step()``, the push to the ps tasks, does not happen),
and the scale backs off or grows as in plain PyTorch. Every ``update()`` the copy makes is
recorded as an *outcome* (an inf was found or not; or the new scale the user passed).

How the scale travels (:class:`ScalerAuthority` on the coordinator, :class:`WorkerScalers` on a
worker):

* every ``Run`` request carries a snapshot of each scaler's state (scale, growth tracker,
  growth/backoff factors, growth interval, enabled), taken when the request is sent;
* before a call, the worker's copy starts from the newest snapshot it got, plus the outcomes
  this worker produced that the coordinator had not replayed when it took that snapshot (the
  request names the ones it had: :class:`Acknowledgements`): with one worker, the copy's
  scale is exactly the scale of sequential single-device training, even while the next
  request is sent before the previous one's results are back;
* a completed call's outcomes come back with its result, and the coordinator replays them on
  its scaler, in the order results arrive, with torch's own arithmetic
  (``torch._amp_update_scale_``), so ``scaler.get_scale()`` and ``scaler.state_dict()`` on the
  coordinator are the scale every later function starts from (and what a checkpoint saves).
  A call that raises counts for nothing, and one retried elsewhere counts once, from the run
  whose result is kept (as metric updates do).

Training is asynchronous, as TF's with parameter servers: steps in flight on other workers
keep the scale they were sent with. With several workers, the coordinator's scale is every
outcome replayed in arrival order, so a growth interval counts clean steps of all workers
together, and each overflow seen by any worker backs the scale off once.

Example (the coordinator's side, replaying what workers reported)::

    >>> import torch
    >>> scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2)
    >>> authority = ScalerAuthority("session")
    >>> key = authority.key(scaler)
    >>> acks = Acknowledgements()
    >>> reply = {"worker": "w0", "outcomes": [[key, 1, "inf", 0.0], [key, 2, "inf", 0.0]], "acked": []}
    >>> authority.merge(reply, acks)
    >>> scaler.get_scale(), authority.snapshot(acks)["acks"]  # two clean steps: the scale grew once
    (16.0, ['w0', [1, 2]])
    >>> authority.merge({"worker": "w0", "outcomes": [[key, 3, "inf", 1.0]], "acked": [1, 2]}, acks)
    >>> scaler.get_scale(), acks.unconfirmed  # an overflow: backed off once
    (8.0, {3})
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.amp.grad_scaler import GradScaler

from distrib import torch_patches
from distrib.parameter_server.errors import RemoteProtocolError
from distrib.parameter_server.weak_names import WeakNames

__all__ = ["Acknowledgements", "ScalerAuthority", "WorkerScalers", "scaler_state", "replay"]

#: outcomes a worker keeps for the coordinator to acknowledge; older ones are forgotten (a hint only)
_MAX_PENDING = 4096
#: coordinators (strategy sessions) whose snapshots a worker keeps
_MAX_SESSIONS = 16
_KINDS = ("inf", "set")


def scaler_state(scaler: GradScaler) -> dict[str, Any]:
    """What a worker's copy starts from: ``state_dict()`` (scale, factors, interval, tracker) and ``enabled``."""
    return {"enabled": scaler.is_enabled(), **scaler.state_dict()}


def replay(scaler: GradScaler, kind: str, value: float) -> None:
    """Apply one ``update()`` outcome to ``scaler`` with torch's own arithmetic.

    ``kind`` ``"inf"``: ``update()`` after a step whose inf checks summed to ``value`` (0: clean):
    ``torch._amp_update_scale_`` backs off, or counts a clean step and grows every
    ``growth_interval`` clean steps. ``"set"``: ``update(new_scale=value)``.
    """
    if not scaler.is_enabled():
        return
    if kind == "set":
        torch_patches.set_scale(scaler, value)
    else:
        torch_patches.replay_scale_update(scaler, value)


class Acknowledgements:
    """What the coordinator's thread for one worker tells it of that worker's outcomes.

    ``worker``: the worker process (its incarnation) whose outcomes were replayed here;
    ``unconfirmed``: the numbers of those outcomes, replayed here but not yet known to the
    worker. Each request carries them with the snapshot (which includes them), so the worker
    stops adding them to the snapshot itself; the worker echoes them back, and they are dropped.

    Example::

        >>> acks = Acknowledgements()
        >>> acks.worker, acks.unconfirmed = "w0", {3, 1}
        >>> acks.for_request()  # what a request to that worker carries
        ['w0', [1, 3]]
    """

    def __init__(self) -> None:
        self.worker = ""
        self.unconfirmed: set[int] = set()

    def for_request(self) -> list[Any]:
        """``[worker, sorted outcome numbers]``, as a request carries it."""
        return [self.worker, sorted(self.unconfirmed)]


class ScalerAuthority:
    """The coordinator's GradScalers that scheduled functions use (weakly, by key), and their replays.

    ``key(scaler)`` names a scaler when a function capturing it is pickled; ``snapshot(acks)``
    is what a ``Run`` request to one worker carries; ``merge(info, acks)`` replays a completed
    call's outcomes (``acks``: that worker's :class:`Acknowledgements`, kept by the
    coordinator's thread for it). See the module docstring for an example.
    """

    def __init__(self, session: str) -> None:
        self._session = session
        self._lock = threading.Lock()
        self._scalers = WeakNames(f"{session}/scaler")
        self._stamp = 0

    def key(self, scaler: GradScaler) -> str:
        """The name ``scaler`` travels under (the same for the same scaler, for the function's digest)."""
        return self._scalers.name(scaler)

    def snapshot(self, acks: Acknowledgements) -> dict[str, Any] | None:
        """Every live scaler's state, for one worker's request (None while no function uses a scaler)."""
        with self._lock:
            states = {key: scaler_state(scaler) for key, scaler in self._scalers.live()}  # a dropped one: not sent
            if not states:
                return None
            self._stamp += 1  # the snapshot and acks.unconfirmed agree: both change only under this lock
            return {"session": self._session, "stamp": self._stamp, "acks": acks.for_request(), "states": states}

    def merge(self, info: Any, acks: Acknowledgements) -> None:
        """Replay a completed call's outcomes (``info`` from its reply, or None) in order; update ``acks``."""
        if info is None:
            return
        try:
            worker, outcomes, echoed = info["worker"], info["outcomes"], {int(n) for n in info["acked"]}
            checked = [(str(key), int(seq), str(kind), float(value)) for key, seq, kind, value in outcomes]
        except (KeyError, TypeError, ValueError) as e:
            raise RemoteProtocolError(f"a worker sent malformed GradScaler outcomes ({e}): {info!r:.200}") from e
        if not isinstance(worker, str) or any(kind not in _KINDS for _, _, kind, _ in checked):
            raise RemoteProtocolError(f"a worker sent malformed GradScaler outcomes: {info!r:.200}")
        with self._lock:
            for key, _seq, kind, value in checked:
                scaler = self._scalers.get(key)
                if scaler is not None:  # a scaler garbage-collected since is skipped
                    replay(scaler, kind, value)
            if acks.worker != worker:  # another worker process (restarted): its outcomes are numbered afresh
                acks.worker, acks.unconfirmed = worker, set()
            acks.unconfirmed -= echoed
            acks.unconfirmed |= {seq for _, seq, _, _ in checked}


class _WorkerScaler(GradScaler):
    """A worker's copy of a coordinator's GradScaler: torch's own, recording each ``update()``'s outcome."""

    def __init__(self, owner: WorkerScalers, key: str, device: str) -> None:
        super().__init__(device)
        self._owner = owner
        self._key = key

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if self.is_enabled():
            if new_scale is not None:
                self._owner.record(self._key, "set", float(new_scale))
            else:
                found = torch_patches.all_found_inf(self)
                if found:  # none: torch's update raises its own AssertionError below
                    self._owner.record(self._key, "inf", float(sum(float(f.item()) for f in found)))
        super().update(new_scale)


class WorkerScalers:
    """A worker's copies of the coordinator's GradScalers, the snapshots it was sent, its outcomes not yet replayed.

    ``copy(key, device)`` is what a captured scaler unpickles to; ``receive(bundle)`` takes a
    request's snapshot; ``prepare(copies)`` sets copies to the newest snapshot plus this
    worker's outcomes the coordinator has not replayed in it, and returns a mark;
    ``finish(mark, copies)`` is what the call's reply carries (the outcomes recorded since
    ``mark``, and the acknowledgements received, echoed); ``discard(mark)`` forgets the
    outcomes since ``mark`` (the call failed: they will never be replayed).

    Example::

        >>> workers = WorkerScalers("me")
        >>> copies = [("s/scaler0", workers.copy("s/scaler0", "cpu"))]
        >>> state = {"enabled": True, "scale": 4.0, "growth_factor": 2.0, "backoff_factor": 0.5,
        ...          "growth_interval": 1, "_growth_tracker": 0}
        >>> workers.receive({"session": "s", "stamp": 1, "acks": ["", []], "states": {"s/scaler0": state}})
        >>> mark = workers.prepare(copies)
        >>> workers.record("s/scaler0", "inf", 0.0)  # what the copy's update() records after a clean step
        >>> workers.finish(mark, copies)
        {'worker': 'me', 'outcomes': [['s/scaler0', 1, 'inf', 0.0]], 'acked': []}
        >>> _ = workers.prepare(copies)  # the next call: the snapshot, then that outcome
        >>> copies[0][1].get_scale()
        8.0
        >>> workers.receive({"session": "s", "stamp": 2, "acks": ["me", [1]], "states": {"s/scaler0": {
        ...     **state, "scale": 8.0}}})  # the coordinator replayed it
        >>> _ = workers.prepare(copies)
        >>> copies[0][1].get_scale()
        8.0
    """

    def __init__(self, incarnation: str) -> None:
        self._incarnation = incarnation
        self._copies: dict[str, _WorkerScaler] = {}
        self._bundles: dict[str, dict[str, Any]] = {}  # by session: the newest snapshot
        self._pending: list[tuple[int, str, str, float]] = []  # (number, key, kind, value), oldest first
        self._echo: dict[str, set[int]] = {}  # by session: acknowledgements to echo
        self._seq = 0

    def copy(self, key: str, device: str) -> GradScaler:
        """The worker's copy of the scaler named ``key`` (one per key, shared by every function using it)."""
        scaler = self._copies.get(key)
        if scaler is None:
            scaler = self._copies[key] = _WorkerScaler(self, key, device)
        return scaler

    def receive(self, bundle: Any) -> None:
        """Keep a request's snapshot if it is the newest of its coordinator; forget outcomes it includes."""
        if bundle is None:
            return
        acks = bundle.get("acks") if isinstance(bundle, dict) else None
        if not (
            isinstance(bundle, dict)
            and isinstance(bundle.get("session"), str)
            and isinstance(bundle.get("stamp"), int)
            and isinstance(bundle.get("states"), dict)
            and isinstance(acks, list)
            and len(acks) == 2
            and isinstance(acks[1], list)
        ):
            raise TypeError(f"malformed GradScaler snapshot in a Run request: {bundle!r:.200}")
        session = bundle["session"]
        current = self._bundles.get(session)
        if current is not None and current["stamp"] >= bundle["stamp"]:
            return  # requests overtook each other: keep the newer snapshot
        self._bundles.pop(session, None)
        self._bundles[session] = bundle
        while len(self._bundles) > _MAX_SESSIONS:
            self._echo.pop(next(iter(self._bundles)), None)
            del self._bundles[next(iter(self._bundles))]
        if acks[0] == self._incarnation and acks[1]:
            replayed = set(acks[1])
            self._pending = [p for p in self._pending if p[0] not in replayed]
            self._echo.setdefault(session, set()).update(replayed)

    def prepare(self, copies: list[tuple[str, GradScaler]]) -> int:
        """Set ``copies`` to where the coordinator's scalers are, as far as this worker knows; a mark."""
        for key, scaler in copies:
            state = self._bundles.get(_session(key), {}).get("states", {}).get(key)
            if state is None:
                raise RuntimeError(
                    f"the coordinator sent no state for its GradScaler {key!r} (the scheduled "
                    "function captured a scaler the coordinator no longer holds)"
                )
            torch_patches.set_enabled(scaler, bool(state["enabled"]))
            if scaler.is_enabled():
                scaler.load_state_dict({k: v for k, v in state.items() if k != "enabled"})
                for _, pending_key, kind, value in self._pending:
                    if pending_key == key:
                        replay(scaler, kind, value)
            torch_patches.forget_step(scaler)  # a step a failed call left half done
        return self._seq

    def record(self, key: str, kind: str, value: float) -> None:
        """One ``update()`` of the copy named ``key``."""
        self._seq += 1
        self._pending.append((self._seq, key, kind, value))
        if len(self._pending) > _MAX_PENDING:
            del self._pending[0]

    def finish(self, mark: int, copies: list[tuple[str, GradScaler]]) -> dict[str, Any] | None:
        """What a completed call's reply carries: its outcomes and the acknowledgements to echo (None: nothing)."""
        recorded = [[key, seq, kind, value] for seq, key, kind, value in self._pending if seq > mark]
        echoed: set[int] = set()
        for session in {_session(key) for key, _ in copies}:
            echoed |= self._echo.pop(session, set())
        if not recorded and not echoed:
            return None
        return {"worker": self._incarnation, "outcomes": recorded, "acked": sorted(echoed)}

    def discard(self, mark: int) -> None:
        """Forget the outcomes recorded since ``mark``: their call failed, the coordinator will not replay them."""
        self._pending = [p for p in self._pending if p[0] <= mark]


def _session(key: str) -> str:
    return key.rsplit("/", 1)[0]
