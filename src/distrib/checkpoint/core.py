"""``Checkpoint``: save, write, restore and read a named group of objects (``tf.train.Checkpoint``).

The strategy contract: a checkpoint asks the strategy that owns its objects for each one's
whole state (``strategy.checkpoint_state``) on every worker; the chief writes; then every
worker meets at ``strategy.barrier(timeout=...)`` with the checkpoint's own, longer timeout
(:func:`~distrib.checkpoint.errors.checkpoint_timeout`), and learns whether every write
succeeded. Restoring loads the file on every worker and hands each state to
``strategy.restore_checkpoint_state``.

Where the other workers write: every worker is given a path, as in TF. A worker given the
chief's path (distrib's idiom: every worker calls ``save`` with the same arguments) writes
nothing, so no two processes write one file. A worker given a path of its own (the TF
tutorials' ``write_filepath``: a ``workertemp_<id>`` directory that the tutorial deletes
afterwards) writes its own copy there, as a TF worker does, so what ``save`` returns exists on
every worker and the tutorials' cleanup code runs as written.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from distrib import context
from distrib.checkpoint import format as fmt
from distrib.checkpoint import index as idx
from distrib.checkpoint import sharded_objects
from distrib.checkpoint.errors import TIMEOUT_ENV, CheckpointError, checkpoint_timeout
from distrib.checkpoint.fileio import atomic_write, describe_os_error, remove_stale_temp_files
from distrib.checkpoint.restore import LoadStatus, apply, validate
from distrib.comm.communicator import CollectiveError
from distrib.integrations import keras_checkpoint

if TYPE_CHECKING:
    from distrib.strategies.base import Strategy

__all__ = ["Checkpoint"]

_ACCEPTED = (
    "torch.nn.Module, torch.optim.Optimizer, a Keras optimizer, torch.Tensor, or any object "
    "with state_dict() and load_state_dict() methods"
)


def _tracked(obj: Any) -> Any:
    """What the checkpoint keeps for ``obj``: a Keras optimizer as its variables' state (keras_checkpoint.py)."""
    return keras_checkpoint.KerasOptimizerState(obj) if keras_checkpoint.is_keras_optimizer(obj) else obj


def _user_object(obj: Any) -> Any:
    """The object the user tracked (a Keras optimizer rather than its state)."""
    return obj.optimizer if isinstance(obj, keras_checkpoint.KerasOptimizerState) else obj


# --------------------------------------------------------------- the strategy contract
def _strategy(objects: Mapping[str, Any]) -> Strategy:
    """The strategy whose chief owns the files of a checkpoint of ``objects`` (:func:`distrib.context.strategy_of`)."""
    return context.strategy_of(*objects.values())


def _sharded(objects: Mapping[str, Any]) -> bool:
    """Whether a checkpoint of ``objects`` is in the sharded format: they are distributed by a strategy whose
    ``checkpoint_format`` is ``"sharded"``. Objects nobody distributes are whole: the plain format (a model
    built outside the scope, e.g. to evaluate a checkpoint on the chief alone)."""
    owner = context.distributor_of(*objects.values())
    return owner is not None and owner.checkpoint_format == "sharded"


def _state(strategy: Strategy, obj: Any) -> Any:
    """The whole, plain state of one tracked object, as the strategy gathers it."""
    if isinstance(obj, torch.Tensor):
        return obj
    return strategy.checkpoint_state(obj)


def _cpu_leaf(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    t = x.detach().cpu()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _to_cpu(obj: Any) -> Any:
    """Every tensor of ``obj`` detached to the CPU; views become whole, compact tensors."""
    out = pytree.tree_map(_cpu_leaf, obj)
    if hasattr(obj, "_metadata"):  # a module state_dict's versions, used by load_state_dict
        out._metadata = obj._metadata
    return out


def _check_trackable(name: str, obj: Any) -> None:
    if not name.isidentifier() or name.startswith("_") or hasattr(Checkpoint, name):
        raise ValueError(
            f"Checkpoint name {name!r} must be a valid identifier that "
            "does not start with '_' or shadow a Checkpoint method"
        )
    if keras_checkpoint.is_keras_optimizer(obj):
        return
    if not isinstance(obj, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)) and not (
        callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
    ):
        hint = (
            (
                " (for a list or dict of tensors use torch.nn.ParameterList / ParameterDict, or track each "
                "tensor under its own name)"
            )
            if isinstance(obj, (list, tuple, dict))
            else ""
        )
        raise TypeError(
            f"Checkpoint argument {name!r} has type {type(obj).__qualname__}, "
            f"which cannot be checkpointed; accepted: {_ACCEPTED}{hint}"
        )


def chief_path(strategy: Strategy, path: str) -> str:
    """The chief's ``path``, absolute, on every worker (a collective when there are several)."""
    here = os.path.abspath(path)
    if strategy.num_workers <= 1:
        return here
    return strategy.communicator.broadcast_object(here if strategy.is_chief else None)


def writes_here(strategy: Strategy, path: str) -> bool:
    """Whether this worker writes ``path``: the chief always; another worker when ``path`` is not the chief's.

    Called on every worker (a collective when there are several: :func:`chief_path`). See the
    module docstring for why a worker given a path of its own writes there.
    """
    if strategy.num_workers <= 1:
        return strategy.is_chief
    chief = chief_path(strategy, path)  # first: the chief takes part in the broadcast too
    return strategy.is_chief or chief != os.path.abspath(path)


def finish_write(
    strategy: Strategy,
    path: str,
    timeout: float | None,
    writes: bool,
    keep: str,
    write: Callable[[], None] | None,
    after: Callable[[], None] | None,
) -> None:
    """The end of every save, on every worker: where ``writes``, ``write`` (None: nothing left to write),
    remove the other format's checkpoint of that name (found first otherwise; ``keep``: this one's suffix)
    and run ``after``; then all :func:`meet`, so that a failure here is an error on every worker."""
    error: BaseException | None = None
    if writes:
        try:
            if write is not None:
                write()
            idx.remove(path, keep=keep)
            if after is not None:
                after()
        except Exception as e:  # shared with the other workers so that none waits in vain
            error = e
    meet(strategy, timeout, error, path)


def meet(strategy: Strategy, timeout: float | None, error: BaseException | None, path: str = "") -> None:
    """Every worker waits (checkpoint timeout) for the writes, then learns whether any failed.

    The chief's failure is a :class:`CheckpointError` on every other worker; so is the failure
    of a worker writing a copy of its own, so that no worker goes on alone to wait in vain at
    the next collective. The worker that failed raises its own error. A writer that died or
    hung past the timeout is a :class:`~distrib.CollectiveError` naming the checkpoint and its bound.
    """
    bound = checkpoint_timeout(timeout)
    try:
        strategy.barrier(timeout=bound)
    except CollectiveError as e:
        raise CollectiveError(
            f"Checkpoint {path!r}: every worker waits at most {bound:g}s for the workers that write it (the chief) "
            f"to finish, and one died or did not finish in time (save(timeout=...) or ${TIMEOUT_ENV} sets the "
            f"bound; raise it for a slow disk or a large model). {e}"
        ) from e
    if strategy.num_workers > 1:
        errors = strategy.communicator.all_gather_object(None if error is None else str(error))
        if error is None and errors[0] is not None:
            raise CheckpointError(f"The chief could not write the checkpoint: {errors[0]}")
        failed = [(i, e) for i, e in enumerate(errors) if e is not None]
        if error is None and failed:
            raise CheckpointError(
                f"Worker {failed[0][0]} could not write its own copy of the checkpoint (it was "
                f"given a path other than the chief's): {failed[0][1]}"
            )
    if error is not None:
        raise error


# --------------------------------------------------------------- Checkpoint
class Checkpoint:
    """Groups modules, optimizers, tensors and stateful objects for save/restore.

    Tensors are restored in place (``copy_``), so references you hold see the
    restored value; modules and optimizers via strict ``load_state_dict``. Tracked
    objects are also attributes (``ckpt.epoch``); assigning one (``ckpt.step = t``)
    tracks it. Restoring is all or nothing, and the file's checksums are verified first.
    Under a strategy every worker makes the same ``Checkpoint`` and calls the same methods: the chief
    writes (or, for sharded state, every worker writes its own shards), and every worker restores.

    Args:
        **objects: what to track, by name: modules, optimizers, tensors (restored in place), and any object
            with ``state_dict()`` and ``load_state_dict()`` (an LR scheduler, a ``GradScaler``, a metric).

    Raises:
        ValueError: a name is not an identifier, starts with ``_`` or shadows a method of ``Checkpoint``.
        TypeError: an object is none of the kinds above (a list or dict of tensors: the message says how
            to track it).

    Example::

        >>> import tempfile, torch
        >>> from distrib.checkpoint import latest_checkpoint
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> epoch = torch.tensor(3)
        >>> ckpt = Checkpoint(model=model, optimizer=opt, epoch=epoch)
        >>> d = tempfile.mkdtemp()
        >>> path = ckpt.save(f"{d}/ckpt")
        >>> path.endswith("ckpt-1")
        True
        >>> _ = epoch.fill_(0)
        >>> _ = ckpt.restore(latest_checkpoint(d)).assert_consumed()
        >>> int(epoch)
        3
    """

    def __init__(self, **objects: Any) -> None:
        for name, obj in objects.items():
            _check_trackable(name, obj)
        self._objects: dict[str, Any] = {name: _tracked(obj) for name, obj in objects.items()}
        self._save_counter = 0

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return _user_object(objects[name])
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        _check_trackable(name, value)
        self._objects[name] = _tracked(value)

    @property
    def objects(self) -> dict[str, Any]:
        """The tracked objects by name."""
        return {name: _user_object(obj) for name, obj in self._objects.items()}

    @property
    def save_counter(self) -> int:
        """Number of successful ``save`` calls, carried through save/restore (not ``write``/``read``)."""
        return self._save_counter

    # ------------------------------------------------------------------ writing
    def save(self, file_prefix: str | os.PathLike[str], *, timeout: float | None = None) -> str:
        """Write ``<file_prefix>-<n>`` (n = save_counter + 1), make it the directory's latest, return it.

        A failed write raises :class:`CheckpointError` on every worker and leaves the counter and the
        previous checkpoints as they were.

        On a worker other than the chief the path returned is always a checkpoint that
        exists: given the chief's ``file_prefix``, the chief's file (which this worker did not
        write: on another host it is on the chief's disk, or shared storage); given a
        ``file_prefix`` of its own (the TF tutorials' temporary directory), this worker's own
        copy, written there as TF writes it (see the module docstring).

        Args:
            file_prefix: the path without its number (``"ckpt_dir/ckpt"``); the directory is made if missing.
            timeout: seconds the other workers wait for the chief to write; None:
                ``$DISTRIB_CHECKPOINT_TIMEOUT``, else 1800.

        Returns:
            The path written, ``<file_prefix>-<n>`` (the data file adds ``.pt``, or ``.dcp`` for sharded state).

        Raises:
            ValueError: ``timeout`` (or ``$DISTRIB_CHECKPOINT_TIMEOUT``) is not a positive number.
            CheckpointError: the write failed (the message names the file and the cause), on every worker.
            CollectiveError: a worker that writes died or did not finish within ``timeout``.
        """
        path = f"{os.fspath(file_prefix)}-{self._save_counter + 1}"
        return self.save_as(path, timeout=timeout, on_written=lambda: idx.record(path))

    def save_as(
        self,
        path: str | os.PathLike[str],
        *,
        timeout: float | None = None,
        on_written: Callable[[], None] | None = None,
    ) -> str:
        """Write exactly ``<path>.pt`` as the next save, and return ``path``: the one write of every save.

        What :meth:`save` and ``CheckpointManager.save`` do with the path they choose. The
        file holds ``save_counter + 1``, which becomes ``save_counter`` once every worker
        knows the write succeeded. ``on_written`` runs where the file was written (the chief,
        and a worker given a path of its own), right after it is: what must succeed with the
        write (recording it in an index); its error is the save's error on every worker. A
        failed save leaves ``save_counter`` as it was. Under several workers, every worker calls it.

        Args:
            path: the path to write, without ``.pt``.
            timeout: seconds the other workers wait for the chief to write; None:
                ``$DISTRIB_CHECKPOINT_TIMEOUT``, else 1800.
            on_written: run where the file was written, right after it is; None: nothing.

        Returns:
            ``path``.

        Raises:
            ValueError: ``timeout`` is not a positive number.
            CheckpointError: the write or ``on_written`` failed, on every worker.
            CollectiveError: a worker that writes died or did not finish within ``timeout``.
        """
        path = os.fspath(path)
        n = self._save_counter + 1
        self._write(path, n, timeout, after=on_written)
        self._save_counter = n
        return path

    def write(
        self, file_prefix: str | os.PathLike[str], *, timeout: float | None = None, update_latest: bool = False
    ) -> str:
        """Write exactly ``<file_prefix>.pt`` and return ``file_prefix``; the save counter does not change.

        ``update_latest=True`` also makes it its directory's latest checkpoint, so that
        :func:`~distrib.checkpoint.latest_checkpoint` finds it (what Keras' ``save_weights``
        and ``ModelCheckpoint`` do); by default the index is left alone, as TF's ``write``.
        Under several workers, as :meth:`save`: the chief writes, and a worker given a path of
        its own writes its own copy there.

        Args:
            file_prefix: the path to write, without ``.pt``.
            timeout: seconds the other workers wait for the chief to write; None:
                ``$DISTRIB_CHECKPOINT_TIMEOUT``, else 1800.
            update_latest: record it in its directory's index as the latest checkpoint.

        Returns:
            ``file_prefix``, as a string.

        Raises:
            ValueError: ``timeout`` is not a positive number.
            CheckpointError: the write failed, on every worker.
            CollectiveError: a worker that writes died or did not finish within ``timeout``.
        """
        path = os.fspath(file_prefix)
        self._write(path, self._save_counter, timeout, after=(lambda: idx.record(path)) if update_latest else None)
        return path

    def _payload(self, strategy: Strategy, writes: bool) -> dict[str, Any]:
        """Every tracked object's whole state, on the CPU where it is written (gathered on every worker:
        a strategy may need all of them to assemble a sharded value)."""
        states = {name: _state(strategy, obj) for name, obj in self._objects.items()}
        return {name: _to_cpu(state) for name, state in states.items()} if writes else states

    def _write(self, path: str, counter: int, timeout: float | None, after: Callable[[], None] | None = None) -> None:
        """Gather on every worker; the chief writes ``path.pt`` (then runs ``after``), and so does a worker
        given a path other than the chief's; all meet."""
        strategy = _strategy(self._objects)
        checkpoint_timeout(timeout)  # a bad timeout is an error before anything is written
        if _sharded(self._objects):
            self._write_sharded(strategy, path, counter, timeout, after)
            return
        writes = writes_here(strategy, path)
        payload = self._payload(strategy, writes)
        finish_write(strategy, path, timeout, writes, ".pt", lambda: write_data_file(path, counter, payload), after)

    def _write_sharded(
        self, strategy: Strategy, path: str, counter: int, timeout: float | None, after: Callable[[], None] | None
    ) -> None:
        """Every worker writes its own shards into ``<path>.dcp`` (sharded_objects.py), in parallel, with no
        gather; the chief then runs ``after``; all meet. Every worker writes into the chief's directory."""
        path = chief_path(strategy, path)
        states = {
            name: obj if isinstance(obj, torch.Tensor) else strategy.local_checkpoint_state(obj)
            for name, obj in self._objects.items()
        }
        failed = sharded_objects.write(strategy, path, counter, states, timeout)
        if failed is not None:  # every worker has it already (or lost its group): nothing to agree on
            raise failed
        finish_write(strategy, path, timeout, strategy.is_chief, sharded_objects.SUFFIX, None, after)

    # ------------------------------------------------------------------ reading
    def restore(self, save_path: str | os.PathLike[str] | None) -> LoadStatus:
        """Load ``save_path`` (as returned by ``save``) into the tracked objects and the save counter.

        The file may hold more objects than are tracked (restoring only the model from a
        file that also holds an optimizer): the status returned warns about them unless
        ``.expect_partial()`` is called. Tracked names the file lacks are an error. Nothing
        changes unless everything can be restored. ``save_path=None`` (no checkpoint yet)
        restores nothing and returns a status whose assertions fail, as in TF.

        Args:
            save_path: a path ``save`` returned (or ``latest_checkpoint(directory)``), without ``.pt``; None:
                restore nothing.

        Returns:
            A ``LoadStatus``: ``assert_consumed()`` checks that everything in the file was restored,
            ``expect_partial()`` silences the warning about objects in the file that are not tracked.

        Raises:
            CheckpointError: the file is missing, damaged (a checksum fails) or unsafe, lacks a tracked name,
                or a state does not fit its object (a shape, a missing key).
        """
        if save_path is None:
            return LoadStatus(None)
        return self._load(os.fspath(save_path), restore_counter=True)

    def read(self, save_path: str | os.PathLike[str]) -> LoadStatus:
        """Like :meth:`restore`, but the save counter keeps its value (pair with :meth:`write`).

        Args:
            save_path: a path ``write`` returned, without ``.pt``.

        Returns:
            A ``LoadStatus``, as :meth:`restore`'s.

        Raises:
            TypeError: ``save_path`` is None.
            CheckpointError: as :meth:`restore`.
        """
        if save_path is None:
            raise TypeError("Checkpoint.read(None): give the path that write() returned")
        return self._load(os.fspath(save_path), restore_counter=False)

    def _load(self, path: str, restore_counter: bool) -> LoadStatus:
        data_file = idx.data_file(path)
        strategy = _strategy(self._objects)
        if not os.path.isdir(data_file):
            data = fmt.load(data_file)
        elif _sharded(self._objects):  # each worker reads its own shards (a collective)
            data = sharded_objects.read_like(data_file, self._objects, strategy)
        else:
            data = sharded_objects.read_whole(data_file)
        stored, counter = data["objects"], int(data.get("save_counter", 0))
        missing = sorted(set(self._objects) - set(stored))
        if missing:
            raise CheckpointError(
                f"Checkpoint {data_file!r} does not hold {missing}, which this Checkpoint tracks (the file holds "
                f"{sorted(stored)}; in the file but not tracked: {sorted(set(stored) - set(self._objects))}). "
                "Track only names the file holds (e.g. Checkpoint(model=model) to restore just the model), "
                "with the names used to save."
            )
        try:
            keras_checkpoint.build_for_restore(self._objects, stored)
        except ValueError as e:
            raise CheckpointError(f"Checkpoint {data_file!r}: {e}") from e
        validate(self._objects, stored, data_file)
        unused = sorted(set(stored) - set(self._objects))
        del data  # apply takes each state out of ``stored`` as it loads it: nothing else may keep it alive
        apply(strategy, self._objects, stored, data_file)
        if restore_counter:
            self._save_counter = counter
        return LoadStatus(
            data_file, restored=list(self._objects) + (["save_counter"] if restore_counter else []), unused=unused
        )


def write_data_file(path: str, counter: int, payload: dict[str, Any]) -> None:
    """Atomically write the data file ``<path>.pt``; remove what crashed saves left beside it first."""
    directory = os.path.dirname(path) or "."
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise CheckpointError(
            f"Cannot write checkpoint {path!r}: creating directory {directory!r} failed: {describe_os_error(e)}"
        ) from e
    remove_stale_temp_files(directory)
    data = fmt.encode(counter, payload)
    atomic_write(path + ".pt", lambda f: torch.save(data, f))
