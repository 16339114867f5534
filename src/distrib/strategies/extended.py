"""``strategy.extended``: the parts of TF's ``StrategyExtended`` that ported code uses, and the gradient seam.

Besides TF's members, ``extended`` is where other modules reach a strategy's gradient merge
(public and typed, as the architecture asks): :meth:`StrategyExtended.merges_optimizer_steps`,
:meth:`StrategyExtended.reduce_gradients_then`, :meth:`StrategyExtended.end_gradient_reduction`
and :meth:`StrategyExtended.warn_if_loss_unscaled`. ``strategies/amp.py`` uses them to make
``torch.amp.GradScaler`` agree over replicas and workers. They are answered by the strategy's
:class:`GradientMerge` (``strategy.gradient_merge``: the replica engine of the synchronous
strategies; None where no step is merged, as under parameter servers), through public members only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from distrib import context
from distrib.strategies.reduction import reduce_structure
from distrib.values import ReduceOp, map_leaves, parse_reduce_op

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["StrategyExtended", "GradientMerge"]

T = TypeVar("T")


class GradientMerge(Protocol):
    """How a strategy merges optimizer steps over replicas and workers (the replica engine is one).

    The members mean what :class:`StrategyExtended`'s methods of the same names say.
    """

    def merges_optimizer_steps(self, optimizer: Any) -> bool: ...

    def reduce_gradients_then(self, optimizer: torch.optim.Optimizer, then: Callable[[], T]) -> T: ...

    def end_gradient_reduction(self, optimizer: torch.optim.Optimizer) -> None: ...

    def warn_if_loss_unscaled(self, scaled: Sequence[bool]) -> None: ...


class StrategyExtended:
    """TF's ``strategy.extended``, over a distrib strategy.

    ``reduce_to(op, value, destinations)`` reduces ``value`` over every replica of every
    worker and puts the result on ``destinations`` (a device, a tensor whose device to
    use, or None: the first local device). ``should_checkpoint`` / ``should_save_summary``
    are True on the chief only, as TF's multi-worker strategies say.

    Example::

        >>> import distrib as ds, torch
        >>> s = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> v = s.run(lambda: torch.tensor(1.0 + ds.get_replica_context().replica_id_in_sync_group))
        >>> s.extended.reduce_to("sum", v, "cpu")
        tensor(3.)
    """

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any = None, options: Any = None) -> Any:
        """Reduce ``value`` (PerReplica, or any structure of them) to ``destinations``. ``options`` is ignored."""
        context.refuse_mixing(self._strategy, "extended.reduce_to")
        reduced = reduce_structure(self._strategy, parse_reduce_op(reduce_op), value, None)
        device = _device_of(destinations)
        if device is None:
            return reduced
        return map_leaves(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, reduced)

    def batch_reduce_to(
        self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Any]], options: Any = None
    ) -> list[Any]:
        """``reduce_to`` for each ``(value, destinations)`` pair, in order."""
        return [self.reduce_to(reduce_op, value, destinations) for value, destinations in value_destination_pairs]

    # ------------------------------------------------------------------ the gradient seam (distrib's own)
    def merges_optimizer_steps(self, optimizer: Any) -> bool:
        """Whether ``optimizer.step()`` is a merge point of this strategy: gradients summed over replicas and
        workers, one update applied everywhere. False for optimizers built outside its scope, and for one
        replica computing on the parameters themselves (nothing to merge)."""
        merge = self._strategy.gradient_merge
        return merge is not None and merge.merges_optimizer_steps(optimizer)

    def reduce_gradients_then(self, optimizer: torch.optim.Optimizer, then: Callable[[], T]) -> T:
        """Sum ``optimizer``'s gradients over every replica and worker into its parameters' ``.grad``, then
        return ``then()``; cross-replica (once per step, from a merge function).

        The sum is the strategy's own (buckets, comm hook), done at most once per step: a second call in
        the same step only calls ``then``. An ``optimizer.step()`` made inside ``then``, or later in the
        step, applies the update without summing again and refreshes the replicas' copies. A caller that
        inspects or rescales the sums before stepping (a ``GradScaler``'s ``unscale_``) runs that in
        ``then``; it ends the step with :meth:`end_gradient_reduction`.

        Example::

            >>> import distrib as ds, torch
            >>> s = ds.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> with s.scope():
            ...     layer = torch.nn.Linear(1, 1, bias=False)
            ...     opt = torch.optim.SGD(layer.parameters(), lr=0.0)
            >>> s.extended.merges_optimizer_steps(opt)
            True
            >>> def step(x):
            ...     layer(x).sum().backward()
            ...     ds.get_replica_context().merge_call(
            ...         lambda strategy: strategy.extended.reduce_gradients_then(opt, lambda: layer.weight.grad.item()))
            >>> _ = s.run(step, args=(s.experimental_distribute_values_from_function(
            ...     lambda ctx: torch.tensor([[1.0 + ctx.replica_id_in_sync_group]])),))
            >>> layer.weight.grad  # 1 + 2, summed over the two replicas
            tensor([[3.]])
            >>> s.extended.end_gradient_reduction(opt)
        """
        return self._merge("reduce_gradients_then").reduce_gradients_then(optimizer, then)

    def end_gradient_reduction(self, optimizer: torch.optim.Optimizer) -> None:
        """The step that used :meth:`reduce_gradients_then`'s sums is over (applied or skipped): the next
        step's gradients are summed anew. ``optimizer.zero_grad()`` does this too."""
        self._merge("end_gradient_reduction").end_gradient_reduction(optimizer)

    def warn_if_loss_unscaled(self, scaled: Sequence[bool]) -> None:
        """Warn once (``ds.UnscaledLossWarning``) when, with several replicas in sync, a replica's loss was not
        scaled by ``ds.compute_average_loss`` this step (``scaled``: each local replica's
        ``ReplicaContext.scaled_loss_recorded``), unless ``RunOptions(loss_scaled_by_hand=True)`` was given."""
        merge = self._strategy.gradient_merge
        if merge is not None:
            merge.warn_if_loss_unscaled(scaled)

    def _merge(self, api: str) -> GradientMerge:
        merge = self._strategy.gradient_merge
        if merge is None:
            raise RuntimeError(
                f"extended.{api}: {type(self._strategy).__name__} merges no optimizer steps (its "
                "updates are not summed over replicas); ask extended.merges_optimizer_steps first"
            )
        return merge

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """The devices of this process's replicas."""
        return tuple(str(d) if d is not None else "default" for d in self._strategy.local_devices)

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """Where parameters live (every replica's device, or the central one)."""
        return self._strategy.parameter_devices

    @property
    def should_checkpoint(self) -> bool:
        """Whether this worker should save checkpoints (distrib's ``Checkpoint`` writes on the chief anyway)."""
        return self._strategy.is_chief

    @property
    def should_save_summary(self) -> bool:
        """Whether this worker should write summaries (TensorBoard): the chief."""
        return self._strategy.is_chief

    @property
    def experimental_should_init(self) -> bool:
        """Whether this worker initialises variables: every worker does (the chief's values are broadcast)."""
        return True


def _device_of(destinations: Any) -> torch.device | None:
    if destinations is None:
        return None
    if isinstance(destinations, torch.Tensor):
        return destinations.device
    if isinstance(destinations, torch.device):
        return destinations
    if isinstance(destinations, str):
        from distrib.strategies.devices import parse_device

        return parse_device(destinations)
    return None  # a PerReplica or a variable: the value stays on the first local device
