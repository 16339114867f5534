"""What one ``strategy.run`` call is told, and what it warns about (TF's ``RunOptions``, ``ValueContext``)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["RunOptions", "ValueContext", "UnscaledLossWarning", "unscaled_loss_message", "UnscaledLossCheck"]


@dataclass(frozen=True)
class RunOptions:
    """Options of one ``strategy.run`` call (``tf.distribute.RunOptions``).

    Passed as ``strategy.run(step, args=(...), options=ds.RunOptions(...))``. TF's own options
    (``experimental_enable_dynamic_batch_size``, ...) have no PyTorch counterpart and are not taken.

    Attributes:
        loss_scaled_by_hand: the step divides its loss by the global batch itself, without
            ``ds.compute_average_loss``: do not warn (``UnscaledLossWarning``) that the loss looks unscaled
            when ``optimizer.step()`` runs with several replicas in sync.

    Example::

        >>> RunOptions(loss_scaled_by_hand=True).loss_scaled_by_hand
        True
    """

    loss_scaled_by_hand: bool = False


@dataclass(frozen=True)
class ValueContext:
    """What ``value_fn`` of ``experimental_distribute_values_from_function`` is told (``tf.distribute.ValueContext``).

    The strategy calls ``value_fn(ctx)`` once per local replica, and the function returns that replica's
    value (e.g. its slice of an array: ``data[ctx.replica_id_in_sync_group :: ctx.num_replicas_in_sync]``).

    Attributes:
        replica_id_in_sync_group: the replica's index among all replicas in sync (every worker's), from 0.
        num_replicas_in_sync: how many replicas are in sync.
    """

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1


class UnscaledLossWarning(UserWarning):
    """A step's loss was not scaled by the global batch while several replicas are in sync."""


def unscaled_loss_message(num_replicas_in_sync: int) -> str:
    """What :class:`UnscaledLossWarning` says: why an unscaled loss trains a wrong model, and the fix."""
    n = num_replicas_in_sync
    return (
        f"optimizer.step() ran in strategy.run without the loss being scaled by ds.compute_average_loss or "
        f"ds.scale_regularization_loss, with {n} replicas in sync. Gradients are "
        f"summed over replicas, so a loss averaged per replica (PyTorch's default reduction='mean') gives "
        f"gradients {n} times too large. Fix: loss = ds.compute_average_loss("
        "F.cross_entropy(logits, labels, reduction='none'), global_batch_size=GLOBAL_BATCH). If you already "
        "divide by the global batch yourself, pass options=ds.RunOptions(loss_scaled_by_hand=True) to run."
    )


class UnscaledLossCheck:
    """One strategy's :class:`UnscaledLossWarning`: said once, and never for a run whose options say the loss is
    scaled by hand. The replica engine and the sharded strategy each hold one and set :attr:`options` per run.

    Example::

        >>> check = UnscaledLossCheck()
        >>> check.options = RunOptions(loss_scaled_by_hand=True)
        >>> check.warn_if_unscaled([False, False], num_replicas_in_sync=2)  # scaled by hand: no warning
    """

    def __init__(self) -> None:
        #: the options of the ``strategy.run`` call in progress (or the last one)
        self.options = RunOptions()
        self._warned = False

    def warn_if_unscaled(self, scaled: Sequence[bool], num_replicas_in_sync: int, *, stacklevel: int = 1) -> None:
        """Warn once when some replica's loss was not scaled (``scaled``: each replica's
        ``ReplicaContext.scaled_loss_recorded``) while several replicas are in sync. ``stacklevel`` counts from
        the caller, as ``warnings.warn``'s does from its own caller."""
        if all(scaled) or num_replicas_in_sync == 1 or self._warned or self.options.loss_scaled_by_hand:
            return
        self._warned = True
        warnings.warn(unscaled_loss_message(num_replicas_in_sync), UnscaledLossWarning, stacklevel=stacklevel + 1)
