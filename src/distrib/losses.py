"""Loss scaling for synchronous training (``tf.nn.compute_average_loss`` and friends).

Each replica sees only its share of the global batch, and ``optimizer.step()``
*sums* gradients over replicas. For the sum to equal the gradient of the mean
loss over the global batch, each replica divides its summed per-example loss by
the *global* batch size, not by its own batch size. Averaging per replica
(``loss.mean()``) would be wrong as soon as replicas get unequal shares.

Per-example loss functions by Keras name (``"mse"``, ``"sparse_categorical_crossentropy"``,
...) live here too, in one registry that ``fit`` (losses) and ``ds.metrics.get``
(``"mse"``, ``"mae"`` as metrics) share.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from distrib import context

__all__ = [
    "LogitsWarning",
    "compute_average_loss",
    "scale_regularization_loss",
    "per_example_loss",
    "LossLike",
    "PER_EXAMPLE_LOSSES",
    "mean_squared_error",
    "mean_absolute_error",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
LossLike = str | torch.nn.Module | LossFn


def _replicas_in_sync(caller: str) -> int:
    """Replicas in sync for a loss helper called in a replica (or with no strategy); records the call."""
    if context.in_cross_replica_context():
        raise RuntimeError(
            f"You are calling `{caller}` in cross replica context (inside strategy.scope() but outside "
            f"strategy.run): it scales one replica's loss. Call it inside the function given to strategy.run"
        )
    ctx = context.get_replica_context()
    assert ctx is not None, "outside a cross-replica context there is always a replica context"
    ctx.record_scaled_loss()
    return ctx.num_replicas_in_sync


def compute_average_loss(
    per_example_loss: torch.Tensor | Sequence[float],
    sample_weight: torch.Tensor | float | Sequence[float] | None = None,
    global_batch_size: int | None = None,
) -> torch.Tensor:
    """Sum of the (weighted) per-example losses divided by the global batch size.

    ``global_batch_size`` defaults to this replica's batch size times
    ``num_replicas_in_sync``. A replica with an empty batch contributes 0. The losses
    must have a batch dimension (rank >= 1): a scalar is usually a loss already
    averaged per replica (PyTorch's default ``reduction="mean"``), which would make
    gradients ``num_replicas_in_sync`` times too large. Called in a cross-replica
    context (inside ``scope()``, outside ``run``) it raises, as in TF.

    Example::

        >>> compute_average_loss(torch.tensor([2.0, 3.0]), global_batch_size=4)
        tensor(1.2500)

    Args:
        per_example_loss: one loss per example of this replica's batch (``reduction="none"``), rank >= 1.
        sample_weight: a weight per example (or one for all), multiplied in before the sum; None: 1.
        global_batch_size: the number of examples in the global batch; None: this replica's batch size
            times ``num_replicas_in_sync``.

    Returns:
        A 0-d tensor: this replica's share of the global mean loss (summed over replicas, it is the mean).

    Raises:
        ValueError: ``per_example_loss`` is a scalar, ``sample_weight`` does not broadcast to it, or
            ``global_batch_size`` is not a positive integer.
        TypeError: ``global_batch_size`` is not an int.
        RuntimeError: called in a cross-replica context.
    """
    if not isinstance(per_example_loss, torch.Tensor):
        per_example_loss = torch.as_tensor(per_example_loss, dtype=torch.get_default_dtype())
    if per_example_loss.dim() == 0:
        raise ValueError(
            "Invalid value passed for `per_example_loss`. Expected a tensor with at least rank 1, got a scalar: "
            "pass the per-example losses (e.g. cross_entropy(..., reduction='none')), not their mean"
        )
    replicas = _replicas_in_sync("compute_average_loss")
    if sample_weight is not None:
        weight = torch.as_tensor(sample_weight, dtype=per_example_loss.dtype, device=per_example_loss.device)
        try:
            torch.broadcast_shapes(weight.shape, per_example_loss.shape)
        except RuntimeError:
            raise ValueError(
                f"Incompatible shapes: sample_weight {list(weight.shape)} vs per_example_loss "
                f"{list(per_example_loss.shape)}: give one weight, or one per example"
            ) from None
        per_example_loss = per_example_loss * weight
    if global_batch_size is None:
        global_batch_size = per_example_loss.shape[0] * replicas
        if global_batch_size == 0:
            return per_example_loss.sum()
    else:
        global_batch_size = _check_global_batch_size(global_batch_size)
    return per_example_loss.sum() / global_batch_size


def _check_global_batch_size(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(f"global_batch_size must be scalar, got a tensor of shape {list(value.shape)}")
        if value.is_floating_point() or value.is_complex():
            raise TypeError(f"global_batch_size must be an int, got a {value.dtype} tensor")
        value = int(value)
    if isinstance(value, (list, tuple)):
        raise ValueError(f"global_batch_size must be scalar, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"global_batch_size must be an int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"global_batch_size must be a positive integer, got {value}")
    return value


def scale_regularization_loss(regularization_loss: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of ``regularization_loss`` divided by ``num_replicas_in_sync``: summed over replicas, it counts once.

    A tensor of several losses, or a list of them, is summed first (as TF). Called in a
    cross-replica context it raises, as in TF.

    Example::

        >>> scale_regularization_loss(torch.tensor([1.0, 2.0]))
        tensor(3.)

    Args:
        regularization_loss: a loss tensor (summed if it holds several) or a list of them.

    Returns:
        A 0-d tensor: the sum divided by ``num_replicas_in_sync``.

    Raises:
        RuntimeError: called in a cross-replica context.
    """
    if isinstance(regularization_loss, (list, tuple)):
        total = torch.stack([torch.as_tensor(x) for x in regularization_loss]).sum()
    else:
        total = torch.as_tensor(regularization_loss).sum()
    return total / _replicas_in_sync("scale_regularization_loss")


def _per_example(values: torch.Tensor) -> torch.Tensor:
    """Mean over every dimension but the first: one value per example."""
    return values.reshape(values.shape[0], -1).mean(1) if values.dim() > 1 else values


def mean_squared_error(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    """Per-example mean squared error (Keras' argument order)."""
    return _per_example((y_pred - y_true.to(y_pred.dtype)).pow(2))


def mean_absolute_error(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    """Per-example mean absolute error (Keras' argument order)."""
    return _per_example((y_pred - y_true.to(y_pred.dtype)).abs())


def _sparse_categorical_crossentropy(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(y_pred, y_true.reshape(-1).long(), reduction="none")


def _cross_entropy(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(y_pred, y_true.long(), reduction="none")


def _binary_crossentropy(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    return _per_example(F.binary_cross_entropy_with_logits(y_pred, y_true.to(y_pred.dtype), reduction="none"))


#: Keras names -> per-example loss ``fn(y_true, y_pred)`` (logits for the cross-entropies).
PER_EXAMPLE_LOSSES: dict[str, LossFn] = {
    "mse": mean_squared_error,
    "mean_squared_error": mean_squared_error,
    "mae": mean_absolute_error,
    "mean_absolute_error": mean_absolute_error,
    "sparse_categorical_crossentropy": _sparse_categorical_crossentropy,
    "cross_entropy": _cross_entropy,
    "binary_crossentropy": _binary_crossentropy,
}


_LOGIT_LOSSES = ("sparse_categorical_crossentropy", "cross_entropy", "binary_crossentropy")


class LogitsWarning(UserWarning):
    """A loss that takes logits (PyTorch's convention) got what looks like probabilities."""


def _warn_if_probabilities(name: str, pred: torch.Tensor) -> None:
    with torch.no_grad():
        p = pred.detach()
        if p.numel() == 0 or not p.is_floating_point() or p.min() < 0 or p.max() > 1:
            return
        if name != "binary_crossentropy" and p.dim() > 1 and not torch.allclose(p.sum(-1), torch.ones(()), atol=1e-3):
            return
    warnings.warn(
        f"loss {name!r} takes logits, as PyTorch's losses do, but the model's outputs look like probabilities "
        "(in [0, 1]" + ("" if name == "binary_crossentropy" else ", summing to 1") + "). Keras' loss of the same "
        "name takes probabilities by default: remove the final softmax/sigmoid from the model (or use a torch loss "
        "on probabilities, e.g. F.nll_loss(torch.log(p), y, reduction='none')).",
        LogitsWarning,
        stacklevel=4,
    )


def per_example_loss(loss: LossLike) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``fn(y_pred, y_true) -> losses of shape [batch]`` from a Keras name, a torch loss module or a function.

    The cross-entropy names take logits (PyTorch's convention; Keras' default is
    probabilities): a first batch of outputs that look like probabilities gives a
    :class:`LogitsWarning`.

    A function is called as PyTorch losses are, ``loss(y_pred, y_true)``, and must
    return per-example values (``reduction="none"``).

    Example::

        >>> per_example_loss("mse")(torch.tensor([[1.0], [3.0]]), torch.tensor([[1.0], [1.0]]))
        tensor([0., 4.])
    """
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    if isinstance(loss, str):
        by_name = PER_EXAMPLE_LOSSES.get(loss.lower())
        if by_name is None:
            raise ValueError(
                f"unknown loss {loss!r}: use one of {sorted(PER_EXAMPLE_LOSSES)}, a torch loss module or a function"
            )
        fn = lambda p, y: by_name(y, p)  # noqa: E731 - Keras order (y_true, y_pred) inside
    elif isinstance(loss, torch.nn.Module) and isinstance(getattr(loss, "reduction", None), str):  # torch's losses
        module: Any = loss  # torch's _Loss base is private: a module with a `reduction` string is a loss

        def fn(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            saved, module.reduction = module.reduction, "none"
            try:
                result: torch.Tensor = module(p, y)
                return result
            finally:
                module.reduction = saved
    elif callable(loss):
        fn = loss
    else:
        raise TypeError(f"loss must be a name, a torch loss module or a function, got {type(loss).__name__}")

    first = [isinstance(loss, str) and loss.lower() in _LOGIT_LOSSES]

    def checked(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if first[0]:  # once: a Keras model ending in softmax/sigmoid gives probabilities, not logits
            first[0] = False
            _warn_if_probabilities(str(loss), p)
        values = fn(p, y)
        if values.dim() == 0:
            raise ValueError(
                "the loss returned a scalar; fit needs per-example losses to scale them by the "
                "global batch (use reduction='none')"
            )
        return _per_example(values)

    return checked
