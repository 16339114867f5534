"""Deferred initialisation: a sharded model is built without its data, then initialised shard by shard.

Under ``ShardedStrategy.scope()`` with several workers, no worker may hold the whole model, yet the
initial weights must equal a plain build's with the same seed, whatever the user's ``__init__`` does
(``nn.Linear``'s ``reset_parameters``, ``nn.init.normal_(self.fc.weight, std=0.02)``,
``nn.Parameter(torch.randn(n, m) * 0.02)``, a positional-encoding buffer computed in place).
torch's meta device alone cannot give that: ``nn.init`` skips meta tensors (``if tensor.is_meta:
return tensor``), so a meta build is silently uninitialised, and its random ops do not advance the
generator, so every later draw would differ from a plain build's.

What this module does instead (the approach of torchdistx's ``deferred_init``, in Python):

* **Record.** While the scope is open, a dispatch mode turns the CPU ``torch.empty`` family (which is
  how every ``torch.nn`` layer allocates its parameters) into :class:`DeferredTensor`\\ s: tensors that
  report the CPU device, hold no data, and record every aten op that touches them, in order (views
  and ``.data`` included: aliasing is tracked through their meta storage). A random op is also run
  once on a throwaway real tensor of the same size and strides, so torch's generator advances exactly
  as in a plain build, and the generator's state from just before it is kept for the replay. A real
  tensor an op reads (``w.copy_(torch.randn(...))``) is kept, cloned. A tensor registered already
  real (``nn.Parameter(torch.randn(...))``) stays real: it exists whole once, as in a plain build.
* **Answer data questions exactly.** An op whose result needs the values (``.item()``, ``bool(t)``,
  ``t.tolist()``, an op with no meta kernel, a random op that reads deferred values) replays the
  history of its inputs on the CPU, runs for real (the generator advancing as in a plain build) and
  records the values it wrote; ``nn.init.trunc_normal_``'s rejection loop works this way.
* **Replay, one tensor at a time** (``deferred_log.replay``, driven by ``deferred_materialise``'s plan
  from ``ShardedStrategy.distribute_module`` after ``fully_shard`` of the meta module and ``to_empty``):
  the log is replayed in order on the CPU, restoring each random op's generator state (and the
  current state at the end); ops whose results are
  overwritten before anyone reads them are skipped (``model.apply(init_weights)`` redraws every weight:
  the first draw is never replayed), each tensor is freed after its last use, and each parameter's whole
  value, once final, gives this worker its rows (``distribute_tensor(..., src_data_rank=None)``, FSDP2's
  ``Shard(0)``) and is freed. Peak: the largest tensor's history, not the model.
* **The chief's values.** Every worker replays the same log with the same generator states, so with the
  same seed the values agree without a broadcast; a digest per tensor is compared over the workers, and
  a tensor whose digest differs from the chief's (workers seeded differently) is replayed again and
  broadcast from the chief, one tensor at a time, as ``take_chiefs_values`` did for the whole model.

Nothing is ever silently wrong: what cannot be recorded is run for real (above); a ``DeferredTensor``
whose data is asked for after the model was distributed still evaluates, and one written then is an
error naming the fix; ``numpy()`` (memory shared in a plain build) is refused. Only building defers: not
inside a module's forward, a backward pass or ``strategy.run``. ``ShardedStrategy(deferred_init=False)``
builds whole, as before.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from distrib import context, torch_patches
from distrib.strategies.deferred_log import Const, Entry, Node, Ref, Scratch, replay, view_of

__all__ = ["DeferredTensor", "BuildRecorder", "Session", "recorder_of", "pause_recording"]

log = logging.getLogger("distrib.strategies")

aten = torch.ops.aten
CPU = torch.device("cpu")
META = torch.device("meta")
#: what allocates a layer's parameters (``torch.empty``, ``new_empty`` and friends reach these)
_EMPTY_FACTORIES = {aten.empty.memory_format, aten.empty_strided.default}
#: ops that write every element of their first argument without reading it: what came before is dead
_OVERWRITING = {
    aten.uniform_,
    aten.normal_,
    aten.fill_,
    aten.zero_,
    aten.copy_,
    aten.random_,
    aten.bernoulli_,
    aten.exponential_,
    aten.log_normal_,
    aten.cauchy_,
    aten.geometric_,
}
_TENSOR_RETURNS = {"Tensor", "Tensor[]", "Tensor?", "Tensor?[]"}


def _map(x: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``x`` (an op's arguments or result, nested) with ``fn`` applied to every tensor."""
    return pytree.tree_map_only(torch.Tensor, fn, x)


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors ``func`` writes, from its schema (``Tensor(a!)``)."""
    out = []
    for i, arg in enumerate(torch_patches.op_schema(func).arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            out += [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    return out


class DeferredTensor(torch.Tensor):
    """A tensor of a deferred build: the CPU device, size, strides and dtype of the plain build's, no data.

    Every aten op on it goes to its :class:`Session`, which records it (or, where values are needed,
    evaluates it). ``nn.Parameter(deferred)`` is a parameter (torch's path for tensor subclasses).
    """

    __torch_function__ = torch_patches.DISABLED_TORCH_FUNCTION  # type: ignore[assignment]
    _session: Session
    _inner: torch.Tensor

    @staticmethod
    def __new__(cls, session: Session, inner: torch.Tensor, requires_grad: bool = False) -> DeferredTensor:
        t = torch_patches.wrapper_tensor(cls, inner, CPU, requires_grad)
        t._session, t._inner = session, inner
        return t

    def __init__(self, session: Session, inner: torch.Tensor, requires_grad: bool = False) -> None:
        super().__init__()

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Any = None,
    ) -> Any:
        sessions = {
            id(t._session): t._session
            for t in pytree.tree_leaves([args, kwargs or {}])
            if isinstance(t, DeferredTensor)
        }
        if len(sessions) != 1:
            raise RuntimeError(
                f"{func} mixes tensors of {len(sessions)} deferred builds (two ShardedStrategy scopes); "
                "build each model inside one strategy.scope()"
            )
        return next(iter(sessions.values())).dispatch(func, args, dict(kwargs or {}))

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A recorded clone (``nn.TransformerEncoder`` deep-copies its layer), a parameter if this one is."""
        if id(self) not in memo:
            with torch.no_grad():
                copy = self.clone()
            memo[id(self)] = (
                nn.Parameter(copy, self.requires_grad)
                if isinstance(self, nn.Parameter)
                else copy.requires_grad_(self.requires_grad)
            )
        return memo[id(self)]

    def tolist(self) -> Any:
        """The values, as a plain build has them (replayed; torch refuses ``tolist`` on a subclass itself)."""
        with self._session.owner.paused():
            env = replay(self._session, {self.ref().node}, keep=True)
            return view_of(env[self.ref().node], self.ref()).tolist()

    def numpy(self, *, force: bool = False) -> Any:
        """Refused: a plain build's ``numpy()`` shares memory, and writes through it could not be recorded."""
        raise RuntimeError(
            "numpy() of a tensor built under ShardedStrategy.scope() (deferred initialisation): use "
            "torch ops on it, or .tolist(), or build with ShardedStrategy(deferred_init=False)"
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # no replay to print
        return f"DeferredTensor(shape={tuple(self.shape)}, dtype={self.dtype}, node={self.ref().node})"

    def ref(self) -> Ref:
        """This tensor as a view of its node."""
        return Ref(
            self._session.node_of(self._inner),
            tuple(self._inner.size()),
            tuple(self._inner.stride()),
            int(self._inner.storage_offset()),
        )


class Session:
    """The log of one deferred build (one outermost scope): nodes, entries, and the ops' dispatch."""

    def __init__(self, owner: BuildRecorder) -> None:
        self.owner = owner
        self.nodes: list[Node] = []
        self.entries: list[Entry] = []
        self._by_storage: dict[int, int] = {}
        self.closed = False
        self._eager_reasons: set[str] = set()
        self.scratch = Scratch()

    # ---------------------------------------------------------------- nodes
    def node_of(self, meta: torch.Tensor) -> int:
        found = self._by_storage.get(id(meta.untyped_storage()))
        if found is None:
            raise RuntimeError("a deferred tensor's storage is not in its build's log (a bug in deferred_record)")
        return found

    def new_node(self, meta: torch.Tensor, kind: str) -> int:
        """A node for ``meta``'s storage (a new ``torch.empty``, or an op's new output)."""
        storage = meta.untyped_storage()
        layout = Ref(len(self.nodes), tuple(meta.size()), tuple(meta.stride()), int(meta.storage_offset()))
        self.nodes.append(Node(meta.dtype, storage.nbytes() // meta.element_size(), kind, meta, layout))
        self._by_storage[id(storage)] = len(self.nodes) - 1
        return len(self.nodes) - 1

    def empty(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> DeferredTensor:
        """``torch.empty(...)`` on the CPU, as a deferred tensor with no history (uninitialised)."""
        meta = func(*args, **{**kwargs, "device": META, "pin_memory": None})
        self.new_node(meta, "empty")
        return DeferredTensor(self, meta)

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Record ``func`` on deferred tensors, or evaluate it where values are needed."""
        with self.owner.paused():
            reason = self._needs_values(func, args, kwargs)
            if reason is None:
                try:
                    return self._record(func, args, kwargs)
                except (NotImplementedError, RuntimeError) as e:  # no meta kernel, data-dependent shape, ...
                    reason = f"{func} has no meta kernel ({str(e).splitlines()[0][:120]})"
            return self._evaluate_op(func, args, kwargs, reason)

    def _needs_values(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        if self.closed:
            return "the build is over"
        if any(str(r.type) not in _TENSOR_RETURNS for r in torch_patches.op_schema(func).returns):
            return f"{func} returns values"
        written = _written(func, args, kwargs)
        if any(not isinstance(t, DeferredTensor) for t in written):
            return f"{func} writes a real tensor"
        device = kwargs.get("device")
        if device is not None and torch.device(device).type not in ("cpu", "meta"):
            return f"{func} moves to {device}"
        if torch.Tag.nondeterministic_seeded in func.tags and not func.overloadpacket.__name__.endswith("_like"):
            written_ids = {id(t) for t in written}
            if any(
                isinstance(t, DeferredTensor) and id(t) not in written_ids for t in pytree.tree_leaves([args, kwargs])
            ):
                return f"{func} draws random numbers from deferred values"
        for t in pytree.tree_leaves([args, kwargs]):
            if isinstance(t, DeferredTensor) and t._inner.dtype != self.nodes[self.node_of(t._inner)].dtype:
                return f"{func} reads a view of another dtype"
        return None

    def _record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        by_inner = {id(t._inner): t for t in pytree.tree_leaves([args, kwargs]) if isinstance(t, DeferredTensor)}

        def to_meta(t: torch.Tensor) -> torch.Tensor:
            if isinstance(t, DeferredTensor):
                return t._inner
            return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=META)

        meta_kwargs = _map(kwargs, to_meta)
        if "device" in kwargs and kwargs["device"] is not None:
            meta_kwargs["device"] = META
        result = func(*_map(args, to_meta), **meta_kwargs)
        written = _written(func, args, kwargs)
        rng = (
            self._advance_generator(func, args, kwargs, {id(t) for t in written})
            if torch.Tag.nondeterministic_seeded in func.tags
            else None
        )

        def to_log(t: torch.Tensor) -> Any:
            if isinstance(t, DeferredTensor):
                return t.ref()
            return Const(t.detach().clone())

        log_args, log_kwargs = _map(args, to_log), _map(kwargs, to_log)
        writes = {t.ref().node for t in written if isinstance(t, DeferredTensor)}
        reads = {r.node for r in pytree.tree_leaves([log_args, log_kwargs]) if isinstance(r, Ref)}
        overwrites: set[int] = set()
        if func.overloadpacket in _OVERWRITING and isinstance(args[0], DeferredTensor):
            first = args[0].ref()
            if first.covers(self.nodes[first.node].numel):
                overwrites.add(first.node)
        others = [r.node for r in pytree.tree_leaves([log_args[1:], log_kwargs]) if isinstance(r, Ref)]
        reads = (reads - overwrites) | set(others)  # an overwritten node is read only if another argument is it
        outputs: list[int | None] = []

        def wrap(meta: torch.Tensor) -> Any:
            if id(meta) in by_inner:  # an in-place op returns its argument
                outputs.append(None)
                return by_inner[id(meta)]
            if id(meta.untyped_storage()) in self._by_storage:  # a view of a deferred tensor
                outputs.append(None)
            else:
                outputs.append(self.new_node(meta, "output"))
            return DeferredTensor(self, meta)

        wrapped = _map(result, wrap)
        if torch.Tag.inplace_view in func.tags:  # t_(), unsqueeze_(): the wrapper's own size and strides change too
            torch_patches.apply_inplace_view(func, args, kwargs)
        self.entries.append(
            Entry(func, log_args, log_kwargs, rng, outputs, frozenset(reads), frozenset(writes), frozenset(overwrites))
        )
        return wrapped

    def _advance_generator(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], written: set[int]
    ) -> tuple[torch.Generator, torch.Tensor]:
        """Run random ``func`` once on throwaway real tensors (the same sizes and strides) so the generator moves
        on as in a plain build; the generator's state before it, for the replay."""
        generator = kwargs.get("generator") or torch.default_generator
        state = generator.get_state()

        used: list[torch.Tensor] = []

        def throwaway(t: torch.Tensor) -> torch.Tensor:
            if isinstance(t, DeferredTensor):
                used.append(self.scratch.take(tuple(t.size()), tuple(t.stride()), t.dtype))
                return used[-1]
            return t

        func(*_map(args, throwaway), **_map(kwargs, throwaway))
        for t in used:
            self.scratch.give(t)
        return generator, state

    def _evaluate_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], reason: str) -> Any:
        """Run ``func`` for real: its deferred inputs replayed, whatever it wrote into them recorded as values."""
        deferred = [t for t in pytree.tree_leaves([args, kwargs]) if isinstance(t, DeferredTensor)]
        written = [t for t in _written(func, args, kwargs) if isinstance(t, DeferredTensor)]
        if written and self.closed:
            raise RuntimeError(
                f"{func} writes a tensor built under ShardedStrategy.scope() after its model was sharded; write to "
                "the module's parameters (they are the shards now), or build with ShardedStrategy(deferred_init=False)"
            )
        if reason not in self._eager_reasons:  # once per reason; a write keeps that tensor whole until sharded
            self._eager_reasons.add(reason)
            log.log(
                logging.INFO if written else logging.DEBUG,
                "deferred init: evaluated on the CPU because %s%s",
                reason,
                "; the values it wrote are kept whole until the model is sharded" if written else "",
            )
        env = replay(self, {t.ref().node for t in deferred}, keep=True)
        real_of = {id(t): view_of(env[t.ref().node], t.ref()) for t in deferred}
        real_args = _map(args, lambda t: real_of.get(id(t), t))
        real_kwargs = _map(kwargs, lambda t: real_of.get(id(t), t))
        result = func(*real_args, **real_kwargs)
        for node in {t.ref().node for t in written}:
            whole = env[node].as_strided((self.nodes[node].numel,), (1,), 0)
            self.entries.append(
                Entry(
                    aten.copy_.default,
                    (Ref(node, (whole.numel(),), (1,), 0), Const(whole)),
                    {},
                    None,
                    [None],
                    frozenset(),
                    frozenset({node}),
                    frozenset({node}),
                )
            )
        back = {id(real_of[id(t)]): t for t in deferred}
        views = {id(env[n].untyped_storage()) for n in env}

        def unwrap(t: torch.Tensor) -> Any:
            if id(t) in back:
                return back[id(t)]
            if id(t.untyped_storage()) in views and not self.closed:
                raise RuntimeError(
                    f"{func} returns a view of a deferred tensor and cannot be recorded ({reason}); "
                    "build this model with ShardedStrategy(deferred_init=False)"
                )
            return t

        return _map(result, unwrap)


# --------------------------------------------------------------------------- recording in a scope


class _EmptyFactories(torch_patches.TorchDispatchMode):
    """While a deferring scope is open on this thread: CPU ``torch.empty`` (and ``empty_strided``) make
    :class:`DeferredTensor`\\ s; every other op runs as usual (ops on deferred tensors reach their session)."""

    def __init__(self, owner: BuildRecorder) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if (
            func in _EMPTY_FACTORIES
            and kwargs.get("layout") in (None, torch.strided)
            and not kwargs.get("pin_memory")
            and torch.device(kwargs.get("device") or torch.get_default_device()).type == "cpu"
        ):
            session = self.owner.building()
            if session is not None:
                return session.empty(func, args, kwargs)
        return func(*args, **kwargs)


class BuildRecorder:
    """Records the build a strategy defers (``deferred_init=True``): opened and closed with its scope (``capture.py``).

    Only building defers: not while the strategy shards or replays (:meth:`paused`: FSDP's own
    ``torch.empty`` must be real), nor inside a module's forward, a backward pass or ``strategy.run``
    (a forward of an already sharded model inside the scope all-gathers into real buffers). The state
    is per thread, as torch's dispatch modes are; nested scopes share one session.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def _get(self, name: str, default: Any) -> Any:
        return getattr(self._local, name, default)

    @property
    def session(self) -> Session | None:
        """This thread's session while its scope is open."""
        return self._get("session", None)

    def open(self) -> None:
        """A scope opened: start recording (a new session at the outermost scope of this thread)."""
        depth = self._get("depth", 0) + 1
        self._local.depth = depth
        if depth == 1:
            self._local.session = Session(self)
            self._local.forward = 0
            self._local.mode = _EmptyFactories(self)
            self._local.hooks = [
                register_module_forward_pre_hook(self._enter_forward),
                register_module_forward_hook(self._leave_forward, always_call=True),
            ]
            self._local.mode.__enter__()

    def close(self) -> None:
        """A scope closed: at the outermost, stop recording; the session lives on in its deferred tensors."""
        self._local.depth = self._get("depth", 1) - 1
        if self._local.depth == 0 and self._get("mode", None) is not None:
            mode, self._local.mode = self._local.mode, None
            for handle in self._local.hooks:
                handle.remove()
            mode.__exit__(None, None, None)
            if self._local.session is not None:
                self._local.session.closed = True
                self._local.session.scratch = Scratch()  # its buffer freed
            self._local.session = None

    def _enter_forward(self, module: nn.Module, args: Any) -> None:
        self._local.forward = self._get("forward", 0) + 1

    def _leave_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._local.forward = max(0, self._get("forward", 0) - 1)

    def building(self) -> Session | None:
        """The session that a ``torch.empty`` here joins, or None: not building now."""
        session = self.session
        if (
            session is None
            or self.is_paused
            or self._get("forward", 0)
            or context.current_replica() is not None
            or torch_patches.in_backward()
        ):
            return None
        return session

    @property
    def is_paused(self) -> bool:
        return bool(self._get("paused", 0) > 0)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops in the block are real (sharding, replaying, evaluating)."""
        self._local.paused = self._get("paused", 0) + 1
        try:
            yield
        finally:
            self._local.paused -= 1


def recorder_of(strategy: Any) -> BuildRecorder | None:
    """The strategy's :class:`BuildRecorder` (``ShardedStrategy`` with several workers), else None: only such a
    strategy defers; every other one builds as it always did."""
    found = getattr(strategy, "build_recorder", None)
    return found if isinstance(found, BuildRecorder) else None


@contextlib.contextmanager
def pause_recording(strategy: Any) -> Iterator[None]:
    """The strategy's recording paused in the block (its recorder's :meth:`BuildRecorder.paused`; nothing to
    pause: the block as is)."""
    recorder = recorder_of(strategy)
    with recorder.paused() if recorder is not None else contextlib.nullcontext():
        yield
