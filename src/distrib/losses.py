"""Loss scaling for synchronous training (``tf.nn.compute_average_loss`` and friends).

Each replica sees only its share of the global batch, and ``optimizer.step()``
*sums* gradients over replicas. For the sum to equal the gradient of the mean
loss over the global batch, each replica divides its summed per-example loss by
the *global* batch size, not by its own batch size. Averaging per replica
(``loss.mean()``) would be wrong as soon as replicas get unequal shares.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from distrib import context

__all__ = ["compute_average_loss", "scale_regularization_loss"]


def _replicas_in_sync() -> int:
    ctx = context.get_replica_context()
    return ctx.num_replicas_in_sync if ctx is not None else context.get_strategy().num_replicas_in_sync


def compute_average_loss(
    per_example_loss: torch.Tensor,
    sample_weight: Optional[Union[torch.Tensor, float]] = None,
    global_batch_size: Optional[int] = None,
) -> torch.Tensor:
    """Sum of the (weighted) per-example losses divided by the global batch size.

    ``global_batch_size`` defaults to this replica's batch size times
    ``num_replicas_in_sync``. A replica with an empty batch contributes 0.

    Example::

        >>> compute_average_loss(torch.tensor([2.0, 3.0]), global_batch_size=4)
        tensor(1.2500)
    """
    if not isinstance(per_example_loss, torch.Tensor):
        per_example_loss = torch.as_tensor(per_example_loss, dtype=torch.get_default_dtype())
    if sample_weight is not None:
        per_example_loss = per_example_loss * sample_weight
    if global_batch_size is None:
        if per_example_loss.dim() == 0:
            raise ValueError(
                "compute_average_loss got a scalar loss and no global_batch_size; pass the per-example "
                "losses (shape [batch, ...], e.g. cross_entropy(..., reduction='none')) or global_batch_size"
            )
        global_batch_size = per_example_loss.shape[0] * _replicas_in_sync()
        if global_batch_size == 0:
            return per_example_loss.sum()
    elif isinstance(global_batch_size, bool) or int(global_batch_size) <= 0:
        raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")
    return per_example_loss.sum() / global_batch_size


def scale_regularization_loss(regularization_loss: Union[torch.Tensor, Sequence[torch.Tensor]]) -> torch.Tensor:
    """``regularization_loss / num_replicas_in_sync``, so that summing over replicas counts it once.

    A list of losses is summed first.
    """
    if isinstance(regularization_loss, (list, tuple)):
        regularization_loss = torch.stack([torch.as_tensor(x) for x in regularization_loss]).sum()
    return regularization_loss / _replicas_in_sync()
