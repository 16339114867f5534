"""``PreemptionCheckpointHandler``: a termination notice becomes one agreed checkpoint, an exit, an exact resume.

TF's ``tf.distribute.experimental.PreemptionCheckpointHandler``, for distrib's strategies::

    handler = ds.experimental.PreemptionCheckpointHandler(strategy.cluster_resolver, checkpoint, "ckpt")
    for epoch in range(handler.total_run_calls // STEPS, EPOCHS):
        for step in range(handler.total_run_calls % STEPS, STEPS):
            handler.run(distributed_train_step, next(iterator))

Life cycle. Made on every worker (it is a collective under several workers), it restores
the newest checkpoint of its directory, with ``total_run_calls``, and installs a handler
for the notice's signal(s) (SIGTERM by default) that only records the notice. ``run(fn,
...)`` calls ``fn`` and counts the call; before the call it reads one attribute, so a step
costs nothing more until a notice comes. After a notice on any worker, every worker saves
at the same count (:mod:`distrib.preemption.agreement`) through the ``CheckpointManager``,
then calls ``exit_fn`` (``sys.exit(42)``), which ``distrib launch`` answers by restarting
the group without counting it against ``--max-restarts``. The restarted job's handler
restores that checkpoint, so training resumes at exactly that step.

Bounded: from the notice (or from learning of a peer's), a watchdog thread ends the process
with ``exit_code`` at ``TerminationConfig.deadline_seconds()``, a little before the kill,
when the save could not finish (a hung peer). Saves are atomic, so the last good checkpoint
stays the directory's latest.

Under ``ParameterServerStrategy`` only the coordinator runs the handler: it saves at the
next ``run`` after the notice, once the coordinator's in-flight functions are done
(``ClusterCoordinator.join()``), so every step ``run`` counted is in the checkpoint once.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from distrib import context
from distrib.checkpoint import Checkpoint, CheckpointError, CheckpointManager
from distrib.preemption.agreement import StepAgreement, store_host
from distrib.preemption.config import TerminationConfig

if TYPE_CHECKING:
    from distrib.cluster.resolver import ClusterResolver

__all__ = ["PreemptionCheckpointHandler"]

log = logging.getLogger("distrib.preemption")

T = TypeVar("T")

_ITERATION_VARIABLE = "checkpointed_runs"  # TF's name for the count saved with the checkpoint


class PreemptionCheckpointHandler:
    """Save one checkpoint at a step every worker agrees on when a termination notice comes, then exit.

    Made on every worker (a collective under several workers), it restores the newest checkpoint of its
    directory (``total_run_calls`` with it) and installs a handler for the notice's signal(s); see the module
    docstring for the life cycle. The checkpoint gains a tracked ``checkpointed_runs`` tensor, as in TF.

    Use a directory for the handler alone, as TF advises: a checkpoint there saved
    without the handler lacks ``checkpointed_runs`` and is refused at restore.

    Args:
        cluster_resolver: the strategy's (``strategy.cluster_resolver``); None for a single process.
        checkpoint_or_checkpoint_manager: a :class:`~distrib.Checkpoint` of the training state (then
            ``checkpoint_dir`` is required, and the handler manages it there, keeping one) or a
            :class:`~distrib.CheckpointManager` (its directory is used; ``checkpoint_dir`` is ignored).
        checkpoint_dir: where to save a ``Checkpoint``.
        termination_config: what a notice is, how to exit and how long there is; None:
            ``TerminationConfig()`` (SIGTERM, ``sys.exit(42)``, the launcher's grace period).

    Raises:
        TypeError: ``termination_config`` is not a ``TerminationConfig``, the second argument is neither a
            ``Checkpoint`` nor a ``CheckpointManager``, or the checkpoint tracks something else as
            ``checkpointed_runs``.
        ValueError: a ``Checkpoint`` without ``checkpoint_dir``, or several workers whose chief cannot be
            located (no cluster resolver and no ``MASTER_ADDR``).
        RuntimeError: made outside the main thread without a ``termination_watcher_fn`` (signal handlers
            are installed from the main thread only).
        CheckpointError: the directory's newest checkpoint was saved without the handler, or cannot be read.
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None,
        checkpoint_or_checkpoint_manager: Checkpoint | CheckpointManager,
        checkpoint_dir: str | None = None,
        termination_config: TerminationConfig | None = None,
    ) -> None:
        config = termination_config if termination_config is not None else TerminationConfig()
        if not isinstance(config, TerminationConfig):
            raise TypeError(f"termination_config must be a ds.experimental.TerminationConfig, got {config!r}")
        target = checkpoint_or_checkpoint_manager
        if isinstance(target, CheckpointManager):
            manager = target
        elif isinstance(target, Checkpoint):
            if not checkpoint_dir:
                raise ValueError(
                    "PreemptionCheckpointHandler(cluster_resolver, checkpoint): a Checkpoint needs a "
                    "checkpoint_dir to save in (or pass a CheckpointManager)"
                )
            manager = CheckpointManager(target, checkpoint_dir, max_to_keep=1)
        else:
            raise TypeError(
                f"checkpoint_or_checkpoint_manager must be a ds.Checkpoint or ds.CheckpointManager, "
                f"got {type(target).__qualname__}"
            )
        self._config = config
        self._manager = manager
        self._cluster_resolver = cluster_resolver
        checkpoint = manager.checkpoint
        counter = checkpoint.objects.get(_ITERATION_VARIABLE)
        if counter is None:
            counter = torch.zeros((), dtype=torch.int64)
            setattr(checkpoint, _ITERATION_VARIABLE, counter)
        elif not isinstance(counter, torch.Tensor) or counter.numel() != 1:
            raise TypeError(
                f"the checkpoint tracks {_ITERATION_VARIABLE!r} as {counter!r}: the handler keeps its "
                "count of run calls there; rename your object"
            )
        self._checkpointed_runs: torch.Tensor = counter
        self._strategy = context.strategy_of(*checkpoint.objects.values())
        self._restore()
        self._run_counter = int(self._checkpointed_runs)

        # the state a notice changes; run() reads only _pending
        self._pending = False
        self._notice: float | None = None  # time.monotonic() of this worker's own notice
        self._notice_name = ""
        self._step_to_save: int | None = None
        self._closed = False
        self._deadline_armed = threading.Event()
        self._deadline_from = 0.0
        self._done = threading.Event()

        self._parameter_servers = bool(getattr(self._strategy, "should_use_with_coordinator", False))
        self._agreement: StepAgreement | None = None
        if not self._parameter_servers and self._strategy.num_workers > 1:
            host = store_host(self._strategy)
            if not host:
                raise ValueError(
                    "PreemptionCheckpointHandler: cannot tell where the chief is (no cluster resolver "
                    "and no MASTER_ADDR): build the strategy with a cluster resolver"
                )
            self._agreement = StepAgreement(self._strategy, host, self._peer_step)
        threading.Thread(target=self._watchdog, name="distrib-preemption-deadline", daemon=True).start()
        self._previous: dict[int, Any] = {}
        self._poller: threading.Thread | None = None
        if config.termination_watcher_fn is not None:
            self._poller = threading.Thread(target=self._poll, name="distrib-preemption-poll", daemon=True)
            self._poller.start()
        elif threading.current_thread() is threading.main_thread():
            for sig in config.signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        else:
            raise RuntimeError(
                "PreemptionCheckpointHandler: signal handlers can only be installed from the main "
                "thread; make the handler there, or give TerminationConfig(termination_watcher_fn=...)"
            )
        atexit.register(self.close)
        log.info(
            "PreemptionCheckpointHandler ready on worker %d of %d at run %d (%s)",
            self._strategy.worker_index,
            self._strategy.num_workers,
            self._run_counter,
            config,
        )

    # ------------------------------------------------------------------ TF's API
    @property
    def total_run_calls(self) -> int:
        """Calls of :meth:`run` so far, those before a restart included (restored from the checkpoint)."""
        return self._run_counter

    def run(self, distributed_train_function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``distributed_train_function(*args, **kwargs)``, counted; after a notice, save at the agreed count and exit.

        Give it one training step (one ``strategy.run`` and its optimizer step): the save
        happens between two calls, and every worker must call it the same number of times.

        Args:
            distributed_train_function: one training step.
            *args: its positional arguments.
            **kwargs: its keyword arguments.

        Returns:
            What the step returned. After a notice, the call at the agreed count saves and exits (calls
            ``exit_fn``) before the step instead.
        """
        if self._pending:  # the one check on the path of a step without a notice
            self._check_preemption_and_maybe_checkpoint()
        result = distributed_train_function(*args, **kwargs)
        self._run_counter += 1
        return result

    def save_checkpoint_if_preempted(self, *args: Any, **kwargs: Any) -> None:
        """Call after each step instead of :meth:`run`: counts a call and saves (then exits) if preempted.

        ``args``/``kwargs`` go to ``CheckpointManager.save`` (or ``save_fn``).
        """
        if self._pending:
            self._check_preemption_and_maybe_checkpoint(*args, **kwargs)
        self._run_counter += 1

    @contextlib.contextmanager
    def watch_preemption_scope(self) -> Iterator[None]:
        """TF's scope for TPUStrategy; under distrib's strategies it only runs its body (TF does the same for
        ``MultiWorkerMirroredStrategy``), so code written for either runs unchanged.

        Yields:
            Nothing: the body runs as it would outside the scope.
        """
        yield

    # ------------------------------------------------------------------ notices
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler: records the notice, nothing else (it runs between two bytecodes of the main thread)."""
        self._own_notice(signal.Signals(signum).name)

    def _own_notice(self, what: str) -> None:
        if self._notice is not None or self._closed:
            return
        self._notice_name = what
        self._notice = time.monotonic()
        self._arm_deadline(self._notice)
        self._pending = True

    def _peer_step(self, step: int) -> None:
        """From the watcher thread: some worker proposed ``step``."""
        self._step_to_save = step
        self._arm_deadline(time.monotonic())
        self._pending = True

    def _poll(self) -> None:
        watcher = self._config.termination_watcher_fn
        assert watcher is not None
        while not self._done.wait(1.0):
            try:
                noticed = bool(watcher())
            except Exception as e:  # noqa: BLE001 - a failing watcher must not end training
                log.warning("termination_watcher_fn failed (ignored): %r", e)
                continue
            if noticed:
                self._own_notice("termination_watcher_fn")
                return

    def _arm_deadline(self, start: float) -> None:
        if not self._deadline_armed.is_set():
            self._deadline_from = start
            self._deadline_armed.set()

    def _watchdog(self) -> None:
        """Ends the process with ``exit_code`` at the deadline when the save and exit did not happen in time."""
        self._deadline_armed.wait()
        if self._done.wait(max(0.0, self._deadline_from + self._config.deadline_seconds() - time.monotonic())):
            return
        _force_exit(
            self._config.exit_code,
            f"PreemptionCheckpointHandler: no checkpoint saved within {self._config.deadline_seconds():.1f}s "
            f"of the termination notice (grace period {self._config.grace_seconds():g}s; a peer hung or the "
            f"save was too slow): exiting with {self._config.exit_code} before the kill; "
            + (
                f"the last complete checkpoint ({self._manager.latest_checkpoint}) stays the one a restart resumes from"
                if self._manager.latest_checkpoint
                else "no checkpoint yet: a restart starts from the beginning"
            ),
        )

    # ------------------------------------------------------------------ agreeing, saving, exiting
    def _remaining(self) -> float:
        return self._deadline_from + self._config.deadline_seconds() - time.monotonic()

    def _check_preemption_and_maybe_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        if self._closed:
            return
        if self._step_to_save is None and self._notice is not None:
            if self._agreement is None:
                self._step_to_save = self._run_counter  # one process: save now
            else:
                try:
                    self._step_to_save = self._agreement.propose(self._run_counter + 1, self._remaining())
                except TimeoutError as e:
                    _force_exit(
                        self._config.exit_code,
                        f"PreemptionCheckpointHandler: {e}; exiting with "
                        f"{self._config.exit_code} without a new checkpoint",
                    )
            log.warning(
                "worker %d: termination notice (%s) at run %d: every worker saves at run %d",
                self._strategy.worker_index,
                self._notice_name,
                self._run_counter,
                self._step_to_save,
            )
        step = self._step_to_save
        if step is None:
            return
        if self._run_counter > step:
            raise RuntimeError(
                f"PreemptionCheckpointHandler: worker {self._strategy.worker_index} is at run {self._run_counter}, "
                f"past the run {step} the workers agreed to save at: the workers' run() calls are not in step. "
                "Give run() one synchronous training step (one that all-reduces), called equally often everywhere"
            )
        if self._run_counter == step:
            self._save_and_exit(*args, **kwargs)

    def _save_and_exit(self, *args: Any, **kwargs: Any) -> None:
        start = time.monotonic()
        if self._parameter_servers:
            coordinator = getattr(self._strategy, "cluster_coordinator", None)
            if coordinator is not None:
                coordinator.join()  # every scheduled step finished (or failed over) before the count is saved
        self._checkpointed_runs.fill_(self._run_counter)
        if self._config.save_fn is not None:
            self._config.save_fn(*args, **kwargs)
            where = "save_fn"
        else:
            where = str(self._manager.save(*args, **kwargs))
        noticed = self._notice if self._notice is not None else self._deadline_from
        log.warning(
            "worker %d: preemption checkpoint at run %d saved (%s) in %.2fs, %.2fs after the notice; exiting",
            self._strategy.worker_index,
            self._run_counter,
            where,
            time.monotonic() - start,
            time.monotonic() - noticed,
        )
        self.close()
        self._config.exit_fn()
        log.warning(
            "PreemptionCheckpointHandler: exit_fn returned; training goes on and further notices are not "
            "handled (give an exit_fn that exits, e.g. lambda: sys.exit(42), for a restart)"
        )

    def _restore(self) -> None:
        try:
            path = self._manager.restore_or_initialize()
        except CheckpointError as e:
            if _ITERATION_VARIABLE in str(e):
                raise CheckpointError(
                    f"{e}\nPreemptionCheckpointHandler: the newest checkpoint in {self._manager.directory!r} was "
                    "not saved with a handler: give the handler a directory of its own (TF's advice too)"
                ) from e
            raise
        if path is not None:
            log.warning("PreemptionCheckpointHandler: restored %s (run %d)", path, int(self._checkpointed_runs))

    def close(self) -> None:
        """Stop watching: the threads end, the previous signal handlers come back. Also run at exit."""
        if self._closed:
            return
        self._closed = True
        self._pending = False
        self._done.set()
        self._deadline_armed.set()
        if self._agreement is not None:
            self._agreement.close()
        if self._previous and threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            self._previous = {}
        try:
            atexit.unregister(self.close)
        except Exception:  # noqa: BLE001 - interpreter shutting down
            pass

    def __repr__(self) -> str:
        return (
            f"PreemptionCheckpointHandler(total_run_calls={self._run_counter}, workers="
            f"{self._strategy.num_workers}, directory={self._manager.directory!r}, {self._config})"
        )


def _force_exit(code: int, message: str) -> None:
    """Log ``message`` and end the process now, skipping cleanup that could wait on a hung peer."""
    log.error("%s", message)  # unconfigured logging still prints an error (logging.lastResort, to stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)
