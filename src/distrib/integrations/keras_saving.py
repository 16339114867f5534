"""Keras' own files (``model.save("x.keras")``, ``model.save_weights("x.weights.h5")``) from a multi-worker job.

TF's convention ("Multi-worker training with Keras", section "Model saving and loading"): every worker calls
``model.save``; the chief saves to the real path, each other worker to a temporary path of its own, which it deletes
afterwards. Under distrib every worker holds the same whole model (Mirrored, MultiWorkerMirrored), so the chief's
file is the model. :func:`save_model` and :func:`save_weights`, called on every worker with the same arguments:

* the chief writes the file, atomically (a temporary file beside it, then a rename), so a reader never sees half a
  file and a crash leaves the previous one;
* a worker given the chief's path writes nothing (two processes never write one file); a worker given a path of its
  own (TF's ``write_filepath``: a ``workertemp_<id>`` directory) writes its own copy there, as TF's workers do, so the
  tutorial's clean-up code runs as written;
* every worker then waits for the chief (``ds.Checkpoint``'s bound, ``$DISTRIB_CHECKPOINT_TIMEOUT``) and learns
  whether the write failed: a failed save is an error on every worker.

The file is Keras' own: ``keras.saving.load_model`` reads it without distrib. A Keras model a ``strategy.run`` step
calls under several workers has its ``save`` and ``save_weights`` routed here (:func:`route_saving`; instance
attributes, the class untouched), so the tutorial's plain ``model.save(path)`` on every worker is safe as well.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distrib import context
from distrib.checkpoint.core import meet, writes_here
from distrib.integrations import keras_models

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["save_model", "save_weights", "route_saving"]

#: the Keras models whose ``save`` / ``save_weights`` are routed already
_routed: weakref.WeakSet[Any] = weakref.WeakSet()


def _suffix(filepath: str, suffixes: tuple[str, ...]) -> str:
    return next((s for s in suffixes if filepath.endswith(s)), os.path.splitext(filepath)[1])


def _atomic(filepath: str, suffixes: tuple[str, ...], write: Callable[[str], None]) -> None:
    """``write(temporary path)`` beside ``filepath`` (with Keras' suffix, which it checks), then rename it there."""
    directory = os.path.dirname(os.path.abspath(filepath))
    os.makedirs(directory, exist_ok=True)
    fd, temporary = tempfile.mkstemp(
        prefix=f".{os.path.basename(filepath)}.tmp-", suffix=_suffix(filepath, suffixes), dir=directory
    )
    os.close(fd)
    try:
        write(temporary)
        os.replace(temporary, filepath)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _save(
    model: Any,
    filepath: str | os.PathLike[str],
    suffixes: tuple[str, ...],
    write: Callable[[str], None],
    strategy: Strategy | None,
    timeout: float | None,
) -> str:
    keras_models.check_backend()
    path = os.fspath(filepath)
    owner = strategy if strategy is not None else context.strategy_of(model)
    if not path.endswith(suffixes):
        if owner.num_workers <= 1:
            write(path)  # Keras' own answer (its error, or a legacy format): one process writes it
            return path
        raise ValueError(
            f"Saving Keras model {keras_models.describe(model)} to {path!r} on {owner.num_workers} workers: the "
            f"chief writes Keras' own formats ({' or '.join(suffixes)}) atomically; give a path ending so"
        )
    writes = writes_here(owner, path)
    error: BaseException | None = None
    if writes:
        try:
            _atomic(path, suffixes, write)
        except Exception as e:  # shared with the other workers, so that none waits in vain
            error = e
    meet(owner, timeout, error, path)
    return path


def save_model(
    model: Any,
    filepath: str | os.PathLike[str],
    *,
    strategy: Strategy | None = None,
    timeout: float | None = None,
    **kwargs: Any,
) -> str:
    """``model.save(filepath, **kwargs)`` on every worker of a job: the chief writes the ``.keras`` file, atomically.

    Args:
        model: a Keras 3 model (torch backend), the same on every worker.
        filepath: where to write, ending in ``.keras``; the chief's path, or (TF's convention) a path of this
            worker's own, where it writes its own copy.
        strategy: the job's strategy; None: the one distributing ``model`` (else the current one).
        timeout: seconds the other workers wait for the chief; None: ``$DISTRIB_CHECKPOINT_TIMEOUT``, else 1800.
        **kwargs: Keras' ``save`` arguments (``zipped``, ...).

    Returns:
        ``filepath``, as a string.

    Raises:
        ValueError: a path without ``.keras`` (Keras' own error in one process).
        CheckpointError: the chief's (or a worker's own) write failed, on every worker.
        CollectiveError: the chief died or did not finish within ``timeout``.
    """
    save = _original(model, "save")
    return _save(model, filepath, (".keras",), lambda path: save(path, **kwargs), strategy, timeout)


def save_weights(
    model: Any,
    filepath: str | os.PathLike[str],
    *,
    strategy: Strategy | None = None,
    timeout: float | None = None,
    **kwargs: Any,
) -> str:
    """``model.save_weights(filepath, **kwargs)`` on every worker: the chief writes the ``.weights.h5`` file.

    Args:
        model: a Keras 3 model (torch backend), the same on every worker.
        filepath: where to write, ending in ``.weights.h5`` (or ``.weights.json`` with sharding, Keras' rule).
        strategy: the job's strategy; None: the one distributing ``model`` (else the current one).
        timeout: seconds the other workers wait for the chief; None: ``$DISTRIB_CHECKPOINT_TIMEOUT``, else 1800.
        **kwargs: Keras' ``save_weights`` arguments.

    Returns:
        ``filepath``, as a string.

    Raises:
        ValueError: a path without ``.weights.h5`` (Keras' own error in one process).
        CheckpointError: the write failed, on every worker.
        CollectiveError: the chief died or did not finish within ``timeout``.
    """
    save = _original(model, "save_weights")
    suffixes = (".weights.h5", ".weights.json")
    return _save(model, filepath, suffixes, lambda path: save(path, **kwargs), strategy, timeout)


def _original(model: Any, name: str) -> Callable[..., Any]:
    """The class's ``save`` / ``save_weights`` bound to ``model`` (not a routed instance attribute)."""
    return getattr(type(model), name).__get__(model, type(model))


def route_saving(strategy: Strategy, model: Any) -> None:
    """Make ``model.save`` and ``model.save_weights`` :func:`save_model` and :func:`save_weights` under ``strategy``
    (several workers: otherwise Keras' own are right). Once per model."""
    if strategy.num_workers <= 1 or model in _routed:
        return
    _routed.add(model)

    def save(filepath: str | os.PathLike[str], *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError("model.save under several workers: give Keras' options by name (zipped=...)")
        save_model(model, filepath, strategy=strategy, **kwargs)

    def save_weights_here(filepath: str | os.PathLike[str], *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError("model.save_weights under several workers: give Keras' options by name")
        save_weights(model, filepath, strategy=strategy, **kwargs)

    object.__setattr__(model, "save", save)
    object.__setattr__(model, "save_weights", save_weights_here)
