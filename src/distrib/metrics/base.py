"""The base of every metric: named additive states, summed over the workers of one strategy.

A metric keeps a few additive state tensors (a total, a count). Replicas of one process
update the same object (they take turns, so updates never race); ``result()`` first sums
the state over the workers through the strategy's communicator (a collective: every
worker calls it), then computes the value.

Which strategy's workers: the one whose scope the metric was built under, else the first
strategy it is updated under (inside ``run`` or a ``scope()``). A metric built outside
every scope and updated inside ``run`` on several workers therefore still reports the
value over every worker, as one built under the scope does.

Sample weights follow Keras' ``Reduce`` metric: a weight of rank one more than the
values loses its last dimension of size 1, a weight of rank one less gains one; then a
scalar weight, or one of the values' rank whose dimensions are 1 or equal, is broadcast;
otherwise the values are first reduced (mean, or sum for ``Sum``) over their trailing
dimensions down to the weight's rank.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

from distrib import context

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["Metric", "weighted_total", "divide_no_nan"]


def divide_no_nan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a / b``, and 0 where ``b`` is 0 (a metric that has seen nothing reports 0, as Keras)."""
    return torch.where(b != 0, a / torch.where(b != 0, b, torch.ones_like(b)), torch.zeros_like(a))


def _as_float(value: Any, device: torch.device | None = None) -> torch.Tensor:
    return torch.as_tensor(value, device=device).to(torch.float64)


def _resolve_dtype(dtype: Any) -> torch.dtype:
    """The state dtype: float64 by default; a torch dtype or its name (``"float32"``, as Keras takes)."""
    if dtype is None:
        return torch.float64
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"dtype must be a torch dtype or its name (e.g. 'float64'), got dtype={dtype!r}")
    return resolved


def _adjust_weight_rank(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Keras' ``squeeze_or_expand_dimensions`` for a weight: rank +1 loses its last dim, rank -1 gains one."""
    if weight.dim() == 0:
        return weight
    diff = weight.dim() - values.dim()
    if diff == 1:
        if weight.shape[-1] != 1:
            raise ValueError(
                f"sample_weight of shape {list(weight.shape)} does not fit values of shape "
                f"{list(values.shape)}: its last dimension must be 1 to be squeezed; give one weight "
                "per example (shape [batch]) or the values' shape"
            )
        return weight.squeeze(-1)
    if diff == -1:
        return weight.unsqueeze(-1)
    return weight


def _broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    try:
        return torch.Size(torch.broadcast_shapes(shape, target)) == target
    except RuntimeError:
        return False


def weighted_total(values: Any, sample_weight: Any = None, reduce: str = "mean") -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of values x weights, sum of weights)`` with Keras' weight rules (module docstring).

    ``reduce`` (``"mean"`` or ``"sum"``) is how values are reduced to the weight's rank
    when the weight cannot be broadcast to them. Without a weight the count is the
    number of values.

    Example::

        >>> total, count = weighted_total(torch.tensor([[1.0], [5.0]]), torch.tensor([1.0, 0.2]))
        >>> round(float(total), 4), round(float(count), 4)
        (2.0, 1.2)
    """
    v = _as_float(values)
    if sample_weight is None:
        # torch.full, not torch.tensor(..., device=...): a fill on the device, not a copy from the host (which a
        # CUDA graph of the step, ds.function, could not replay)
        return v.sum(), torch.full((), float(v.numel()), dtype=torch.float64, device=v.device)
    w = _adjust_weight_rank(v, _as_float(sample_weight, v.device))
    broadcastable = w.dim() == 0 or (w.dim() == v.dim() and all(a in (1, b) for a, b in zip(w.shape, v.shape)))
    if not broadcastable:
        if w.dim() < v.dim():  # Keras: reduce the values over their trailing dimensions to the weight's rank
            trailing = list(range(w.dim(), v.dim()))
            v = v.sum(trailing) if reduce == "sum" else v.mean(trailing)
        if w.dim() != v.dim() or not _broadcasts_to(w.shape, v.shape):
            raise ValueError(
                f"sample_weight of shape {list(w.shape)} does not fit values of shape "
                f"{list(_as_float(values).shape)}: give one weight per example (shape [batch]) or "
                "the values' shape"
            )
    w = torch.broadcast_to(w, v.shape)
    return (v * w).sum(), w.sum()


class Metric:
    """Base of distrib's metrics: named additive states, summed over workers on ``result()``.

    Subclasses declare ``_state_names`` and implement ``deltas(...)``, which returns how
    much each state grows for the given inputs without touching the state (so a
    parameter-server worker can compute it and the coordinator add it), and
    ``_compute(state)``.

    Example (a metric of your own: its states must add up over replicas and workers)::

        >>> class Positives(Metric):
        ...     _state_names = ("positives",)
        ...     def deltas(self, values):
        ...         return {"positives": (torch.as_tensor(values) > 0).sum()}
        ...     def _compute(self, state):
        ...         return state["positives"]
        >>> p = Positives()
        >>> p.update_state([1.0, -2.0, 3.0])
        >>> p.result()
        tensor(2.)

    Args:
        name: the metric's name in the logs; None: the class's ``default_name``, else its lower-cased name.
        dtype: the dtype the state accumulates in (a ``torch.dtype`` or its name, ``"float32"``); None: float64.

    Raises:
        ValueError: ``dtype`` is neither a torch dtype nor the name of one.
    """

    _state_names: tuple[str, ...] = ()
    #: the Keras name a metric gets when none is given (``"sparse_categorical_accuracy"``)
    default_name: str = ""

    def __init__(self, name: str | None = None, dtype: Any = None) -> None:
        self.name = name or self.default_name or type(self).__name__.lower()
        self.dtype = _resolve_dtype(dtype)
        self._strategy = context.get_strategy()
        device = self._strategy.local_devices[0]
        state_dtype = self.dtype if self.dtype.is_floating_point else torch.float64
        self._state = {k: torch.zeros((), dtype=state_dtype, device=device) for k in self._state_names}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ which workers
    @property
    def strategy(self) -> Strategy:
        """The strategy whose workers ``result()`` sums over (the default strategy: this process only)."""
        return self._strategy

    def set_strategy(self, strategy: Strategy) -> None:
        """Sum this metric over ``strategy``'s workers from now on, as building it under its scope would.

        Done automatically when the metric is updated inside ``strategy.run`` or
        ``strategy.scope()``; ``ds.fit`` does it for the metric objects it is given.
        A metric already tied to another (non-default) strategy raises ValueError.

        Args:
            strategy: the strategy whose workers ``result()`` sums over.

        Raises:
            ValueError: the metric is already tied to another (non-default) strategy.
        """
        if strategy is self._strategy or strategy is context.default_strategy():
            return
        if self._strategy is not context.default_strategy():
            raise ValueError(
                f"metric {self.name!r} was created under {self._strategy!r} and is now used under {strategy!r}: "
                f"a metric sums its state over the workers of one strategy. Create it under the scope of the "
                f"strategy that updates it (`with strategy.scope(): metric = ...`), one metric per strategy"
            )
        with self._lock:
            device = strategy.local_devices[0]
            if device is not None:
                self._state = {k: v.to(device) for k, v in self._state.items()}
            self._strategy = strategy

    # ------------------------------------------------------------------ state
    def _add(self, **deltas: torch.Tensor) -> None:
        with self._lock, torch.no_grad():
            for k, v in deltas.items():
                state = self._state[k]
                if state.device != v.device and v.device.type != "cpu" and self._strategy.local_devices[0] is None:
                    # a strategy that places nothing (the default): the state follows the values to their device
                    # at the first update, so that a GPU step adds on the GPU (and ds.function can capture it)
                    state = self._state[k] = state.to(v.device)
                state.add_(v.detach().to(state.device, state.dtype))

    def deltas(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """How much each state grows for these inputs (``update_state``'s arguments); the state is untouched.

        Args:
            *args: ``update_state``'s positional arguments.
            **kwargs: ``update_state``'s keyword arguments.

        Returns:
            State name -> how much it grows.
        """
        raise NotImplementedError

    def update_state(self, *args: Any, **kwargs: Any) -> None:
        """Accumulate the inputs (Keras' argument order, e.g. ``y_true, y_pred, sample_weight=None``).

        Args:
            *args: the inputs (``values`` for ``Mean``; ``y_true, y_pred`` for the accuracies).
            **kwargs: ``sample_weight=`` and the like.
        """
        self.set_strategy(context.get_strategy())
        self._add(**self.deltas(*args, **kwargs))

    def merge_deltas(self, deltas: dict[str, torch.Tensor]) -> None:
        """Add state deltas computed elsewhere (by ``deltas``) into this metric.

        Args:
            deltas: state name -> how much it grows, as ``deltas`` returns.
        """
        self._add(**deltas)

    def __getstate__(self) -> dict[str, Any]:
        # a copy sent to another process computes deltas only: no lock, no strategy, fresh state
        state = {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_strategy", "_state")}
        state["_state"] = {k: torch.zeros_like(v, device="cpu") for k, v in self._state.items()}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._strategy = context.default_strategy()

    def _compute(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def result(self) -> torch.Tensor:
        """The metric over everything seen by every replica of every worker since the last reset (0-d float32, CPU).

        Under several workers this is a collective: every worker must call it.

        Returns:
            The metric's value, the same on every worker.
        """
        with self._lock:
            state = {k: v.clone() for k, v in self._state.items()}
        if self._strategy.num_workers > 1:
            self._strategy.communicator.all_reduce(list(state.values()))
        return self._compute(state).to(torch.float32).cpu()

    def local_result(self) -> torch.Tensor:
        """The metric over this worker's replicas only: no collective, for per-step progress display.

        Returns:
            The metric's value over this worker's updates.
        """
        with self._lock:
            state = {k: v.clone() for k, v in self._state.items()}
        return self._compute(state).to(torch.float32).cpu()

    def reset_state(self) -> None:
        """Forget everything seen so far."""
        with self._lock:
            for v in self._state.values():
                v.zero_()

    reset_states = reset_state  # the TF < 2.5 spelling used by the tutorials

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``update_state(...)`` then the result, as Keras metrics do.

        Inside ``strategy.run`` the value returned is this worker's (``local_result``): no
        collective is started from a replica function, which other workers might not
        reach as often. ``result()`` outside ``run`` gives the value over every worker.
        """
        self.update_state(*args, **kwargs)
        return self.local_result() if context.current_replica() is not None else self.result()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The state tensors (this worker's, on the CPU): what ``ds.Checkpoint`` saves.

        Returns:
            State name -> a copy of its tensor.
        """
        return {k: v.detach().cpu().clone() for k, v in self._state.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore the state tensors saved by :meth:`state_dict`.

        Args:
            state: what ``state_dict()`` returned.

        Raises:
            ValueError: ``state`` lacks one of this metric's states.
        """
        missing = set(self._state) - set(state)
        if missing:
            raise ValueError(f"metric {self.name!r}: the saved state lacks {sorted(missing)}")
        with self._lock:
            for k in self._state:
                self._state[k].copy_(state[k])

    def __getattr__(self, name: str) -> torch.Tensor:
        """A state by name (``mean.total``, ``mean.count``): this worker's value, as Keras exposes its variables."""
        state = self.__dict__.get("_state")
        if state is not None and name in state:
            return state[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def get_config(self) -> dict[str, Any]:
        """What rebuilds this metric with :meth:`from_config` (Keras' config: ``name``, ``dtype``, options).

        Returns:
            ``{"name": ..., "dtype": ...}`` and the metric's own options.
        """
        return {"name": self.name, "dtype": str(self.dtype).replace("torch.", "")}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Metric:
        """A new metric (empty state) from :meth:`get_config`'s dictionary.

        Args:
            config: what ``get_config()`` returned.

        Returns:
            A new metric of this class.
        """
        return cls(**config)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
