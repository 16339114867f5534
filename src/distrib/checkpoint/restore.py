"""Restoring is all or nothing: validate every object against the file, then change them.

:func:`validate` checks, before any object changes, what would make a ``load_state_dict``
fail halfway: names, shapes and dtypes of tracked tensors, a module's keys and shapes, an
optimizer's parameter groups. :func:`apply` then loads each object; should one still fail
(a custom ``load_state_dict``), the objects already loaded are put back from what they held
just before, so a failed restore leaves every object as it was.

What a restore holds beyond the live state, for a sharded job whose memory is tight: the states
read (once), a copy of each module's and tensor's state (``load_state_dict`` writes into the live
tensors), and nothing for an optimizer (torch's ``load_state_dict`` adopts the tensors read and
leaves the old ones as they were: they are the rollback). Each state read is dropped once loaded.

:class:`LoadStatus` is what ``restore``/``read`` return, TF's ``CheckpointLoadStatus``.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch.nn.parameter import is_lazy

from distrib.checkpoint.errors import CheckpointError
from distrib.integrations import keras_models
from distrib.torch_patches import has_load_state_dict_pre_hooks, optimizer_load_replaces_state

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["LoadStatus", "validate", "apply"]

_SHOWN = 8


def _names(keys: Sequence[Any]) -> str:
    keys = list(keys)
    more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return ", ".join(repr(k) for k in keys[:_SHOWN]) + more


# --------------------------------------------------------------- validation
def _validate_tensor(where: str, obj: torch.Tensor, state: Any) -> None:
    if not isinstance(state, torch.Tensor):
        raise CheckpointError(f"{where} is a tensor here but the file holds a {type(state).__name__}")
    if state.shape != obj.shape:
        raise CheckpointError(f"{where} has shape {tuple(obj.shape)} but the file holds shape {tuple(state.shape)}")
    if state.dtype != obj.dtype:
        raise CheckpointError(
            f"{where} has dtype {obj.dtype} but the file holds {state.dtype}; create the tensor "
            f"with dtype={state.dtype} (tracked tensors are restored in place, without casting)"
        )


def _validate_module(where: str, module: torch.nn.Module, state: Any) -> None:
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{where} is a module here but the file holds a {type(state).__name__}")
    if has_load_state_dict_pre_hooks(module):
        return  # a pre-hook may rename or convert keys: load_state_dict itself decides (rollback covers it)
    current = module.state_dict(keep_vars=True)
    missing = [k for k in current if k not in state]
    unexpected = [k for k in state if k not in current]
    if missing or unexpected:
        raise CheckpointError(
            f"{where} does not match the module saved: missing from the file: [{_names(missing)}]; in the file "
            f"but not in the module: [{_names(unexpected)}]. Build the same architecture that was saved.{_keras_hint(module)}"
        )
    for key, value in current.items():
        saved = state[key]
        if not isinstance(value, torch.Tensor) or is_lazy(value):
            continue
        if not isinstance(saved, torch.Tensor):
            raise CheckpointError(
                f"{where}: {key!r} is a tensor in the module but the file holds a {type(saved).__name__}"
            )
        if saved.shape != value.shape:
            raise CheckpointError(
                f"{where}: {key!r} has shape {tuple(value.shape)} in the module but "
                f"{tuple(saved.shape)} in the file. Build the same architecture that was saved."
            )
        if saved.is_complex() and not value.is_complex():
            raise CheckpointError(f"{where}: {key!r} is {value.dtype} in the module but {saved.dtype} in the file")


def _keras_hint(module: torch.nn.Module) -> str:
    """For a Keras model: its keys are its variables' paths, which hold the layers' names."""
    if not keras_models.is_keras_layer(module):
        return ""
    return (
        " A Keras model's keys hold its layers' names, which Keras numbers per process (sequential_1/dense_1): "
        "build it as when saved, in a fresh process or after keras.utils.clear_session(), or name the model "
        "and its layers (name=...)."
    )


def _validate_optimizer(where: str, optimizer: torch.optim.Optimizer, state: Any) -> None:
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    if not (
        isinstance(groups, list)
        and isinstance(state.get("state"), Mapping)
        and all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups)
    ):
        raise CheckpointError(f"{where} is an optimizer here but the file does not hold an optimizer's state_dict")
    live = optimizer.param_groups
    if len(groups) != len(live):
        raise CheckpointError(
            f"{where}: the file holds {len(groups)} parameter group(s) but the optimizer has "
            f"{len(live)}. Build the optimizer with the same parameter groups that were saved."
        )
    for i, (saved, group) in enumerate(zip(groups, live)):
        if len(saved["params"]) != len(group["params"]):
            raise CheckpointError(
                f"{where}: parameter group {i} holds {len(saved['params'])} parameter(s) in the "
                f"file but {len(group['params'])} in the optimizer. Build the optimizer over the "
                "same parameters, in the same order, as when it was saved."
            )
    ids = {p for g in groups for p in g["params"]}
    unknown = [k for k in state["state"] if k not in ids]
    if unknown:
        raise CheckpointError(
            f"{where}: the file holds optimizer state for parameter id(s) [{_names(unknown)}] "
            "that no parameter group lists; the file is damaged or not an optimizer's state_dict"
        )


def validate(objects: Mapping[str, Any], stored: Mapping[str, Any], data_file: str) -> None:
    """Raise :class:`CheckpointError` if any tracked object could not take its state from the file.

    Duck-typed objects (anything with ``state_dict``/``load_state_dict``) cannot be checked
    here; :func:`apply` rolls them back if their ``load_state_dict`` fails.
    """
    for name, obj in objects.items():
        where = f"Checkpoint {data_file!r}: {name!r}"
        if isinstance(obj, torch.Tensor):
            _validate_tensor(where, obj, stored[name])
        elif isinstance(obj, torch.nn.Module):
            _validate_module(where, obj, stored[name])
        elif isinstance(obj, torch.optim.Optimizer):
            _validate_optimizer(where, obj, stored[name])


# --------------------------------------------------------------- applying, with rollback
def _copy_state(state: Any) -> Any:
    """A CPU copy of ``state`` that shares nothing with the live object."""
    out = pytree.tree_map(
        lambda x: x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else copy.deepcopy(x), state
    )
    if hasattr(state, "_metadata"):
        out._metadata = copy.deepcopy(state._metadata)
    return out


def _load(strategy: Strategy, obj: Any, state: Any) -> None:
    if isinstance(obj, torch.Tensor):
        with torch.no_grad():
            obj.copy_(state)
    else:
        strategy.restore_checkpoint_state(obj, state)


def _rollback(strategy: Strategy, obj: Any) -> Any:
    """What ``obj`` holds now, such that loading it puts ``obj`` back (a sharded strategy's shards: nothing gathered)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    state = strategy.local_checkpoint_state(obj)
    if isinstance(obj, torch.optim.Optimizer) and optimizer_load_replaces_state(obj):
        # the load builds new state and group dicts from the tensors read; this state_dict's dicts and tensors
        # stay as they are, unreferenced by the optimizer, and are the rollback (Adam's moments: not copied)
        return state
    return _copy_state(state)


def apply(strategy: Strategy, objects: Mapping[str, Any], stored: MutableMapping[str, Any], data_file: str) -> None:
    """Load every object's state; on a failure put back those already changed, then raise CheckpointError.

    Takes ``stored``'s entries for ``objects`` out of it as they are loaded, so that a state read is freed once it
    is in its object (a module's was copied into the live tensors; an optimizer's tensors are now its state).
    """
    done: list[tuple[str, Any, Any]] = []
    for name, obj in objects.items():
        done.append((name, obj, _rollback(strategy, obj)))
        try:
            _load(strategy, obj, stored.pop(name))
        except Exception as e:
            failed = []
            for other, target, state in reversed(done):
                try:
                    _load(strategy, target, state)
                except Exception as again:  # an object that refuses even its own earlier state
                    failed.append(f"{other!r} ({type(again).__name__}: {again})")
            outcome = (
                "every object was put back as it was"
                if not failed
                else f"putting back {', '.join(failed)} also failed: those objects are partly restored"
            )
            raise CheckpointError(
                f"Restoring {name!r} from {data_file!r} failed ({type(e).__name__}: {e}); {outcome}"
            ) from e


# --------------------------------------------------------------- the status
def _warn_unused(path: str, unused: tuple[str, ...], silenced: list[bool]) -> None:
    if silenced[0]:
        return
    warnings.warn(
        f"Checkpoint {path!r} was restored partially: {_names(unused)} in the file "
        "are not tracked by this Checkpoint and were not used. If that is intended (e.g. "
        "restoring only the model for evaluation), call expect_partial() on the load status, "
        "e.g. ds.Checkpoint(model=model).restore(path).expect_partial(), to silence this "
        "warning; use assert_consumed() to make it an error.",
        UserWarning,
        stacklevel=2,
    )


class LoadStatus:
    """What ``Checkpoint.restore``/``read`` matched (TF's ``CheckpointLoadStatus``).

    The restore itself already happened (there is no deferred restoration). When the file
    holds objects this ``Checkpoint`` does not track (an optimizer, when only the model is
    restored), a warning is shown once the status is discarded, unless
    :meth:`expect_partial` was called; :meth:`assert_consumed` makes it an error.

    Example::

        >>> import tempfile, torch
        >>> from distrib.checkpoint import Checkpoint
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> path = Checkpoint(model=model, optimizer=opt).save(tempfile.mkdtemp() + "/ckpt")
        >>> status = Checkpoint(model=torch.nn.Linear(2, 1)).restore(path).expect_partial()
        >>> status.unused
        ['optimizer']
    """

    def __init__(self, path: str | None, restored: Sequence[str] = (), unused: Sequence[str] = ()) -> None:
        self._path = path
        self._restored = list(restored)
        self._unused = list(unused)
        self._silenced = [False]
        if self._unused and path is not None:
            weakref.finalize(self, _warn_unused, path, tuple(self._unused), self._silenced).atexit = False

    @property
    def restored(self) -> list[str]:
        """Names of the objects restored from the file."""
        return list(self._restored)

    @property
    def unused(self) -> list[str]:
        """Names in the file that no tracked object took."""
        return list(self._unused)

    def _nothing(self) -> AssertionError:
        return AssertionError("No checkpoint specified (save_path=None); nothing is being restored.")

    def expect_partial(self) -> LoadStatus:
        """Silence the warning about names in the file that were not used; returns self."""
        self._silenced[0] = True
        return self

    def assert_consumed(self) -> LoadStatus:
        """AssertionError unless every object in the file was restored into a tracked object; returns self."""
        self._silenced[0] = True
        if self._path is None:
            raise self._nothing()
        if self._unused:
            raise AssertionError(
                f"Unused attributes in checkpoint {self._path!r}: {_names(self._unused)} "
                f"(restored: {_names(self._restored)}). Track them in the Checkpoint, or call "
                "expect_partial() if a partial restore is intended."
            )
        return self

    def assert_existing_objects_matched(self) -> LoadStatus:
        """Every tracked object took a value from the file (always so after a successful restore); returns self."""
        if self._path is None:
            raise self._nothing()
        return self

    def assert_nontrivial_match(self) -> LoadStatus:
        """AssertionError if nothing at all was restored; returns self."""
        if self._path is None or not self._restored:
            raise (
                self._nothing()
                if self._path is None
                else AssertionError(f"Nothing was restored from {self._path!r}: no tracked object matched")
            )
        return self

    def run_restore_ops(self, session: Any = None) -> None:
        """Nothing to run: the restore already happened (TF graph mode only)."""

    def initialize_or_restore(self, session: Any = None) -> None:
        """Nothing to run: the restore already happened, or there was nothing to restore."""
