"""Keras 3 optimizers (``KERAS_BACKEND=torch``) in ``ds.Checkpoint``, as ``tf.train.Checkpoint(optimizer=...)``.

A Keras optimizer is no ``torch.optim.Optimizer`` and has no ``state_dict``: its state is its variables (the step
count ``iterations``, the learning rate, and the slots ``build`` makes for each trained variable: Adam's momentums
and velocities). :class:`KerasOptimizerState` gives a checkpoint that state as a ``state_dict``: the variables'
values in the optimizer's own order (the order Keras' own ``save_own_variables`` writes them), with their paths
for the error messages only, since a path names the model's layers (``adam/sequential_1_dense_kernel_momentum``)
and a model built again gets other names.

An optimizer that has not been built yet (restored before its first step, as a resumed job does) has no slots to
load the file's into. :func:`build_for_restore` builds it over the trainable variables of the Keras model the same
checkpoint tracks, as Keras' own ``load_model`` builds a loaded model's optimizer; without exactly one such model it
is an error naming the fix (``optimizer.build(model.trainable_variables)`` before restoring). Loading never skips a
variable: a count, shape or dtype that does not match is an error, never a partial restore.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from distrib.integrations import keras_models

__all__ = ["is_keras_optimizer", "KerasOptimizerState", "build_for_restore"]


def is_keras_optimizer(obj: object) -> bool:
    """Whether ``obj`` is a Keras optimizer; False while keras is not imported."""
    if not keras_models.keras_loaded():
        return False
    import keras

    return isinstance(obj, keras.optimizers.Optimizer)


def _tensor(variable: Any) -> torch.Tensor:
    """The torch tensor behind a Keras variable (torch backend)."""
    value = variable.value
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)


class KerasOptimizerState:
    """A Keras optimizer's variables as a ``state_dict``, so that ``ds.Checkpoint`` saves and restores them.

    ``ds.Checkpoint(optimizer=keras_optimizer)`` wraps the optimizer in one of these; ``ckpt.optimizer`` is still
    the Keras optimizer.

    Args:
        optimizer: a Keras 3 optimizer on the torch backend.
    """

    def __init__(self, optimizer: Any) -> None:
        keras_models.check_backend()
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        """``{"variables": [tensor, ...], "paths": [str, ...]}``, in the optimizer's order."""
        variables = list(self.optimizer.variables)
        return {"variables": [_tensor(v).detach() for v in variables], "paths": [str(v.path) for v in variables]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Assign every saved value to the variable at its place; nothing changes unless every one fits.

        Raises:
            ValueError: the state is not a Keras optimizer's, or its count, shapes or dtypes differ from the
                optimizer's (an optimizer not built yet: build it over the model's trainable variables first).
        """
        values, paths = state.get("variables"), state.get("paths")
        if not (isinstance(values, list) and isinstance(paths, list) and len(values) == len(paths)):
            raise ValueError("the file does not hold a Keras optimizer's state (its variables and their paths)")
        variables = list(self.optimizer.variables)
        name = keras_models.describe(self.optimizer)
        if len(values) != len(variables):
            built = "" if self.optimizer.built else " (it is not built yet)"
            raise ValueError(
                f"Keras optimizer {name} has {len(variables)} variables{built} but the file holds {len(values)} "
                f"({', '.join(paths[:4])}{', ...' if len(paths) > 4 else ''}); build it over the same trainable "
                "variables as when it was saved (optimizer.build(model.trainable_variables)) before restoring"
            )
        for variable, value, path in zip(variables, values, paths):
            live = _tensor(variable)
            if not isinstance(value, torch.Tensor) or value.shape != live.shape or value.dtype != live.dtype:
                found = f"{value.dtype}{tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value)
                raise ValueError(
                    f"Keras optimizer {name}: variable {variable.path!r} is {live.dtype}{tuple(live.shape)} but the "
                    f"file holds {found} for {path!r}; build the optimizer over the same trainable variables, in "
                    "the same order, as when it was saved"
                )
        with torch.no_grad():
            for variable, value in zip(variables, values):
                _tensor(variable).copy_(value)


def build_for_restore(objects: Mapping[str, Any], stored: Mapping[str, Any]) -> None:
    """Build each unbuilt Keras optimizer among ``objects`` whose saved state has slots, over the trainable
    variables of the one Keras model ``objects`` track (as Keras' ``load_model`` does); an error naming the fix when
    there is not exactly one.

    Args:
        objects: a checkpoint's tracked objects (Keras optimizers already wrapped).
        stored: the states read from the file, by name.

    Raises:
        ValueError: an unbuilt optimizer's saved state has slots and the checkpoint tracks no Keras model, or
            several.
    """
    for name, obj in objects.items():
        if not isinstance(obj, KerasOptimizerState) or obj.optimizer.built:
            continue
        saved = stored.get(name)
        count = len(saved.get("variables", [])) if isinstance(saved, Mapping) else 0
        if count <= len(obj.optimizer.variables):
            continue
        models = _keras_models(objects.values())
        if len(models) != 1:
            raise ValueError(
                f"Keras optimizer {keras_models.describe(obj.optimizer)} ({name!r}) is not built yet, and the "
                f"checkpoint tracks {len(models)} Keras models, so which variables it trains is unknown: call "
                f"{name}.build(model.trainable_variables) before restoring"
            )
        obj.optimizer.build(models[0].trainable_variables)


def _keras_models(objects: Iterable[Any]) -> list[Any]:
    """The Keras layers (models) among ``objects``, none inside another."""
    layers = [obj for obj in objects if keras_models.is_keras_layer(obj)]
    nested = keras_models.nested_layers(layers) if len(layers) > 1 else set()
    return [layer for layer in layers if id(layer) not in nested]
