"""``ds.fit``, ``ds.evaluate``, ``ds.predict``: Keras' high-level loop, one loop under every strategy.

The model and optimizer are built under the strategy's scope as usual; these
functions find the strategy from the model (:func:`distrib.context.strategy_of`), and
ask it how a step executes (:meth:`~distrib.Strategy.step_executor`): at once over the
replicas of a synchronous strategy, or scheduled on the workers of a parameter-server
cluster. The loop knows no strategy by name: one step driver (:func:`_drive`) submits
the steps of ``fit``, ``evaluate`` and ``predict`` to the executor and takes the results
in step order, the end of a worker's data included (a typed
:data:`~distrib.strategies.execution.END_OF_DATA`). Everything else is the same everywhere: the loss is scaled by the true global batch
size of every step (so a short last batch counts right), loss and metrics cover
every replica and worker (a step returns its metric *deltas*, merged here as each
step completes, in step order), every callback hook fires, and every worker shows
progress, as Keras' (``verbose="auto"``: a bar, or one line per epoch under parameter
servers; pass ``verbose=0`` on the workers that should stay quiet).

Example::

    >>> import distrib as ds, torch
    >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> with strategy.scope():
    ...     model = torch.nn.Linear(2, 1)
    ...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> data = [(torch.ones(4, 2), torch.zeros(4, 1))] * 3
    >>> history = ds.fit(model, data, optimizer=optimizer, loss="mse", epochs=2, verbose=0)
    >>> len(history.history["loss"])
    2
    >>> loss, mae = ds.evaluate(model, data, loss="mse", metrics=["mae"], verbose=0)  # Keras' list
    >>> sorted(ds.evaluate(model, data, loss="mse", metrics=["mae"], verbose=0, return_dict=True))
    ['loss', 'mae']
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from distrib import context
from distrib.integrations import keras_fit
from distrib.keras.callback_base import Callback, CallbackList, History
from distrib.keras.progress import Progbar, data_length
from distrib.keras.tracked import TrackedValues
from distrib.keras.training import Loop, Training
from distrib.losses import LossLike, compute_average_loss, per_example_loss
from distrib.precision import Precision, backward_and_step
from distrib.strategies.execution import EndOfData, StepExecutor, StepFn

__all__ = ["fit", "evaluate", "predict"]

Logs = dict[str, float]
#: fit and evaluate compute in full precision unless told otherwise
FULL_PRECISION = Precision.parse("32")

#: what fit/evaluate read: an iterable of ``(x, y)`` batches, or (parameter servers) a per-worker dataset function
Data = Iterable[Any] | Callable[..., Iterable[Any]]


@dataclass
class _Driven:
    """What :func:`_drive` did: steps submitted, steps that ran, and whether a worker's data ended."""

    submitted: int = 0
    ran: int = 0
    ended: bool = False


def _drive(
    executor: StepExecutor,
    inputs: Iterable[Any],
    step: StepFn,
    *,
    begin: Callable[[int], None],
    done: Callable[[Any], None],
    first: int = 0,
    stop: Callable[[], bool] = lambda: False,
) -> _Driven:
    """The one step driver of ``fit``, ``evaluate`` and ``predict``: submit a step per input, settle results in order.

    ``begin(index)`` runs before step ``index`` (from ``first``) is submitted; ``done(result)``
    for each step that ran, in step order, as soon as the executor knows its result. Driving
    stops when the inputs end, when a step reports the end of its data
    (:class:`~distrib.strategies.execution.EndOfData`), or when ``stop()`` says so after a
    step; the steps already submitted are settled before it returns.
    """
    driven = _Driven()

    def settle(wait: bool) -> None:
        for result in executor.completed(wait):
            if isinstance(result, EndOfData):
                driven.ended = True
                continue
            driven.ran += 1
            done(result)

    for index, step_input in enumerate(inputs, start=first):
        begin(index)
        executor.submit(step, step_input)
        driven.submitted += 1
        settle(wait=False)
        if driven.ended or stop():
            break
    settle(wait=True)
    return driven


def _ran_out(done: str, consequence: str, steps_name: str | None, stacklevel: int) -> None:
    """Warn, as Keras does, that the data ended early: ``done`` says what ran, ``consequence`` what happens now."""
    lower = f"; or lower {steps_name}" if steps_name else ""
    warnings.warn(
        f"Your input ran out of data: {done}. {consequence}. Give data that can supply every step: a "
        f"list, a DataLoader or another iterable that can be read again (it is read again from the start "
        f"when a pass ends, as dataset.repeat() would), not a one-shot iterator or generator{lower}.",
        UserWarning,
        stacklevel=stacklevel + 1,
    )


def _has(data: Any, gave: int) -> str:
    length = data_length(data)
    return f"the data has {length} batches" if length is not None else f"the data gave {gave} batches"


def _no_data(what: str, data: Any) -> ValueError:
    length = data_length(data)
    given = type(data).__name__ + (f" of length {length}" if length is not None else "")
    return ValueError(
        f"{what}: the data gave no batch ({given}): expected a non-empty iterable of (x, y) batches "
        "(or, under parameter servers, a dataset function whose iterator gives batches)"
    )


def _check_batches(data: Any, what: str) -> None:
    """Refuse Keras' arrays form ``(x, y)`` (a tuple or list of whole tensors), naming the batches to give instead.

    ``fit``/``evaluate`` read an iterable of ``(x, y)`` batches; ``(x_val, y_val)`` would be read as
    two "batches" that are single tensors, which fails later with an error about something else.
    """
    if (
        isinstance(data, (tuple, list))
        and data
        and all(isinstance(b, torch.Tensor) and (b.dim() == 0 or b.shape[0] != 2) for b in data)
    ):
        raise ValueError(
            f"{what}=({', '.join('tensor' for _ in data)}) looks like Keras' arrays form "
            f"(x=..., y=..., validation_data=(x_val, y_val)): distrib's fit and evaluate read batches. "
            f"Give [(x, y)] for one batch, or DataLoader(TensorDataset(x, y), batch_size=32) for Keras' "
            "default batches"
        )


def _graphs_wanted(jit_compile: bool | str, strategy: Any, model: torch.nn.Module) -> bool:
    """``jit_compile``: ``"auto"`` is False (eager), as Keras 3 resolves it on the torch backend: a captured step is
    the user's choice (``jit_compile=True``), since its guards see the state the step names, not every way a step
    can reach state (see :mod:`distrib.graphs.guards`)."""
    if jit_compile == "auto":
        return False
    if not isinstance(jit_compile, bool):
        raise ValueError(f"jit_compile={jit_compile!r}: expected 'auto', True or False (Keras' name)")
    return jit_compile


def _verbosity(executor: StepExecutor, verbose: str | int) -> int:
    """Keras' ``verbose``: ``"auto"`` is 1 (a progress bar), 2 (a line per epoch) where steps are scheduled.

    As tf.keras (``Model._get_verbosity``: 2 under parameter servers), every worker shows what it
    is asked to, not the chief alone: a multi-worker job's logs each show training, as the TF
    tutorials' do.
    """
    if verbose == "auto":
        return 2 if executor.scheduled else 1
    if not isinstance(verbose, int) or verbose not in (0, 1, 2):  # bools are ints: True is 1, as in Keras
        raise ValueError(
            f"verbose={verbose!r}: expected 'auto', 0 (silent), 1 (progress bar) or 2 (one line per epoch), as Keras"
        )
    return int(verbose)


def _device_type(x: Any, model: torch.nn.Module) -> str:
    """Where a step computes (for ``torch.autocast``): the device of its input, else of the model."""
    if isinstance(x, torch.Tensor):
        return x.device.type
    param = next(model.parameters(), None)
    return param.device.type if param is not None else "cpu"


def _float(value: Any) -> Any:
    """A prediction back in float32 for the metrics (autocast leaves bfloat16/float16 outputs)."""
    if (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.dtype != torch.float32
        and value.dtype != torch.float64
    ):
        return value.float()
    return value


def fit(
    model: torch.nn.Module,
    data: Data,
    *,
    optimizer: Any = None,
    loss: LossLike | None = None,
    epochs: int = 1,
    steps_per_epoch: int | None = None,
    validation_data: Data | None = None,
    validation_steps: int | None = None,
    metrics: Sequence[Any] | None = None,
    callbacks: Sequence[Callback] = (),
    verbose: str | int = "auto",
    precision: str | int = "32",
    jit_compile: bool | str = "auto",
) -> History:
    """Train ``model`` on ``data`` (an iterable of global ``(x, y)`` batches); return the History.

    ``steps_per_epoch``: steps per epoch, reading ``data`` again from the start when it
    ends (default: one pass). Required under ParameterServerStrategy, where ``data`` may
    also be a function ``dataset_fn(input_context)`` returning an iterator, built on
    every worker. Data that gives no batch at all is a ValueError; data that ends
    before an epoch is done (a one-shot iterator) ends that epoch with a warning, and
    training stops at the first epoch that gets no batch, as Keras does.

    ``precision`` (Lightning's names): ``"32"``; ``"bf16-mixed"`` runs the forward pass and
    the loss under ``torch.autocast`` to bfloat16; ``"16-mixed"`` to float16, with a
    ``torch.amp.GradScaler`` (a step whose gradients overflow on any replica of any worker is
    skipped everywhere, see :mod:`distrib.strategies.amp`; under ParameterServerStrategy each
    scheduled step runs the scaler on its worker and the coordinator's scaler replays the outcomes,
    see :mod:`distrib.parameter_server.scaler`). Validation runs under the same autocast.

    ``verbose`` (Keras'): 0 silent, 1 a progress bar (on a pipe, a bar line every 10 s, see
    :mod:`distrib.keras.progress`), 2 one line per epoch; ``"auto"`` is 1, or 2 under
    ParameterServerStrategy. Every worker prints, as in tf.keras; pass
    ``verbose="auto" if strategy.is_chief else 0`` for the chief's output alone.

    ``jit_compile`` (Keras' name): each step, validation's too, runs as under ``ds.function``: captured once as a
    CUDA graph and replayed (:mod:`distrib.graphs`), with ``True`` (where no graph can be captured, the steps run
    eagerly and the first one says why). ``"auto"`` (the default) and ``False`` run eagerly: Keras 3 resolves
    ``"auto"`` to eager on the torch backend too.

    Args:
        model: the module to train, built under the strategy's ``scope()`` (or outside any: the default strategy).
        data: an iterable of global ``(x, y)`` batches (a ``DataLoader``, a list, a distributed dataset);
            under ParameterServerStrategy also ``dataset_fn(input_context)``.
        optimizer: the optimizer over ``model``'s parameters, built under the same scope (a Keras 3 model: a Keras
            optimizer too; None: the one ``model.compile`` was given, see :mod:`distrib.integrations.keras_fit`).
        loss: None (a compiled Keras model): its compiled loss, with Keras' meaning; else a Keras name (``"mse"``, ``"sparse_categorical_crossentropy"``, ...), a torch loss module or a
            function ``loss(y_pred, y_true)`` returning per-example values.
        epochs: how many epochs to train (counted from the epoch a restored backup resumes at).
        steps_per_epoch: steps per epoch, cycling through ``data``; None: one pass of ``data``.
        validation_data: batches to evaluate after each epoch (their metrics are logged with ``val_``).
        validation_steps: how many validation batches; None: all of them.
        metrics: Keras names (``"accuracy"``) or ``ds.metrics`` / torchmetrics objects, computed over every replica;
            None: a compiled Keras model's.
        callbacks: ``ds.callbacks.Callback`` objects; a ``History`` is added last.
        verbose: 0, 1, 2 or ``"auto"`` (above).
        precision: ``"32"``, ``"bf16-mixed"`` or ``"16-mixed"`` (above).
        jit_compile: ``"auto"``, True or False (above).

    Returns:
        The ``History`` callback: ``history.history["loss"]`` lists the epochs' losses, one key per log.

    Raises:
        ValueError: ``data`` (or ``validation_data``) gives no batch, a ``precision`` or ``verbose`` that is
            not one of the above, or (under ParameterServerStrategy) no ``steps_per_epoch``.
    """
    mixed = Precision.parse(precision)
    _check_batches(data, "data")
    _check_batches(validation_data, "validation_data")
    keras_fit.check_callbacks(callbacks)
    parts = keras_fit.fit_parts(model, optimizer, loss, metrics, precision, "fit")
    optimizer, keras_optimizer, loss, metrics = parts.optimizer, parts.keras_optimizer, parts.loss, parts.metrics
    train_kwargs = keras_fit.call_kwargs(model, True)
    strategy = context.strategy_of(model, *([optimizer] if optimizer is not None else []))
    executor = strategy.step_executor()
    graphs = _graphs_wanted(jit_compile, strategy, model)
    executor.use_graphs(graphs)
    devices = [d for d in strategy.local_devices if d is not None]
    scaler = mixed.grad_scaler(devices[0].type if devices else "cpu")
    slow = mixed.slow_here(devices[0].type if devices else "cpu")
    if slow:
        warnings.warn(f"fit(precision={precision!r}): {slow}", UserWarning, stacklevel=2)
    loss_fn = per_example_loss(loss)
    tracked = TrackedValues(strategy, metrics, loss)
    # the callbacks' optimizer (saved by ModelCheckpoint and BackupAndRestore): the torch one, or the Keras one
    loop = Loop(model, optimizer or keras_optimizer, strategy, steps_per_epoch, scheduled=executor.scheduled)
    loop.stop_training = False  # as Keras' fit: a model.stop_training left by an earlier fit does not stop this one
    run = Training(loop, callbacks)
    verbosity = _verbosity(executor, verbose)

    unchecked = [keras_optimizer is not None or bool(train_kwargs)]  # a Keras model's added losses: first step

    def train_step(x: torch.Tensor, y: Any, n: int) -> Any:
        model.train()
        with mixed.autocast(_device_type(x, model)):
            pred = model(x, **train_kwargs)
            per_example = loss_fn(pred, y)
        if unchecked[0]:
            keras_fit.refuse_added_losses(model)
            unchecked[0] = False
        loss = compute_average_loss(_float(per_example), global_batch_size=n)
        if keras_optimizer is not None:
            keras_fit.apply_keras_optimizer(loss, model, keras_optimizer)
        else:
            backward_and_step(loss, optimizer, scaler)
            optimizer.zero_grad()
        return tracked.deltas(_float(per_example.detach()), y, _float(pred.detach()))

    run.begin()
    logs: Logs = {}
    trained = 0  # steps run on real data by this call of fit
    warned = False
    for epoch in run.epochs(epochs):
        tracked.reset()
        if verbosity:
            print(f"Epoch {epoch + 1}/{epochs}", flush=True)
        bar = Progbar(steps_per_epoch or data_length(data), verbosity)
        first = run.resume_at
        if steps_per_epoch:
            inputs = executor.feed(
                data, start=epoch * steps_per_epoch + first, steps=steps_per_epoch - first, cycle=True, per_worker=True
            )
        else:
            if hasattr(data, "set_epoch"):
                data.set_epoch(epoch)
            inputs = executor.feed(data, start=first, per_worker=True)

        def trained_one(result: Any) -> None:
            tracked.merge(result)
            step_logs = tracked.logs(synced=False)
            batch = run.batch_end(step_logs)
            bar.update(batch + 1, step_logs)  # noqa: B023 (called within this epoch only)

        # a batch hook may stop training (TerminateOnNaN): no further step is submitted
        driven = _drive(
            executor,
            inputs,
            train_step,
            first=first,
            begin=run.batch_begin,
            done=trained_one,
            stop=lambda: loop.stop_training,
        )
        ran, submitted, ended = driven.ran, driven.submitted, driven.ended
        trained += ran
        short = steps_per_epoch is not None and first + submitted < steps_per_epoch and not loop.stop_training
        if ran == 0 and not loop.stop_training:
            if trained == 0:
                raise _no_data("fit", data)
            if not warned:
                _ran_out(
                    f"epoch {epoch + 1} of fit got no batch, after {trained} in the epochs before (a one-shot "
                    "iterator or generator is read once)",
                    "Training stops here",
                    None,
                    stacklevel=2,
                )
            break  # an epoch without a batch: training stops, no epoch of zeros is recorded
        if (short or ended) and not warned:
            warned = True
            _ran_out(
                f"epoch {epoch + 1} of fit ran {first + ran} of steps_per_epoch={steps_per_epoch} steps "
                f"({_has(data, first + ran)})",
                "The epoch ends here",
                "steps_per_epoch",
                stacklevel=2,
            )
        logs = tracked.logs()
        if validation_data is not None:
            logs.update(
                _evaluate(
                    model,
                    validation_data,
                    loss_fn,
                    tracked,
                    validation_steps,
                    run.callbacks,
                    verbosity=0,
                    graphs=graphs,
                    prefix="val_",
                    what="the validation of fit",
                    steps_name="validation_steps",
                    stacklevel=3,
                    precision=mixed,
                )
            )
        bar.update(int(loop.step_in_epoch), logs, finalize=True)
        run.end_epoch(epoch, logs)
    return run.end(logs)


def _evaluate(
    model: torch.nn.Module,
    data: Any,
    loss_fn: Any,
    tracked: TrackedValues,
    steps: int | None,
    cbs: CallbackList,
    verbosity: int,
    prefix: str = "",
    what: str = "evaluate",
    steps_name: str = "steps",
    stacklevel: int = 3,
    precision: Precision = FULL_PRECISION,
    graphs: bool = False,
) -> Logs:
    """The loss and metrics of ``model`` over ``data``; fires the test hooks. Resets ``tracked`` first, as Keras."""
    executor: StepExecutor = tracked.strategy.step_executor()
    executor.use_graphs(graphs)
    test_kwargs = keras_fit.call_kwargs(model, False)

    def test_step(x: torch.Tensor, y: Any, n: int) -> Any:
        with torch.no_grad(), precision.autocast(_device_type(x, model)):
            model.eval()
            pred = model(x, **test_kwargs)
            return tracked.deltas(_float(loss_fn(pred, y)), y, _float(pred))

    tracked.reset()
    cbs.on_test_begin()
    bar = Progbar(steps or data_length(data), verbosity)
    done = 0

    def tested_one(result: Any) -> None:
        nonlocal done
        tracked.merge(result)
        done += 1
        cbs.on_test_batch_end(done - 1, tracked.logs(synced=False))
        bar.update(done, tracked.logs(synced=False))

    driven = _drive(
        executor,
        executor.feed(data, steps=steps, cycle=steps is not None, per_worker=True),
        test_step,
        begin=cbs.on_test_batch_begin,
        done=tested_one,
    )
    submitted, ended = driven.submitted, driven.ended
    if done == 0:
        raise _no_data(what, data)
    if ended or (steps is not None and submitted < steps):
        _ran_out(
            f"{what} ran {done} of {steps_name}={steps} steps ({_has(data, done)})",
            "Evaluation stops here",
            steps_name,
            stacklevel,
        )
    logs = tracked.logs()
    bar.update(done, logs, finalize=True)
    cbs.on_test_end(logs)  # unprefixed, as Keras' evaluate gives them to on_test_end inside fit too
    return {prefix + k: v for k, v in logs.items()}


def evaluate(
    model: torch.nn.Module,
    data: Data,
    *,
    loss: LossLike | None = None,
    steps: int | None = None,
    metrics: Sequence[Any] | None = None,
    return_dict: bool = False,
    verbose: str | int = "auto",
    callbacks: Sequence[Callback] = (),
    precision: str | int = "32",
    jit_compile: bool | str = "auto",
) -> Any:
    """The loss and metrics of ``model`` over ``data`` (``steps`` batches, or all), over every replica.

    Returns what Keras' ``Model.evaluate`` returns: by default the list ``[loss, *metrics]``
    (floats, in the order given), so ``loss, acc = ds.evaluate(..., metrics=["accuracy"])``
    unpacks two numbers; the loss alone, a float, when there are no metrics.
    ``return_dict=True`` gives ``{"loss": ..., "<metric name>": ...}``. ``verbose`` as
    :func:`fit`'s (``"auto"``: a progress bar on every worker, as Keras). Under
    ParameterServerStrategy ``steps`` is required (workers cycle through their data). Data
    that gives no batch is a ValueError. ``precision``: as :func:`fit`'s (autocast only); ``jit_compile``: as
    :func:`fit`'s.

    Args:
        model: the module to evaluate.
        data: an iterable of global ``(x, y)`` batches (under ParameterServerStrategy also ``dataset_fn``).
        loss: as :func:`fit`'s (None: a compiled Keras model's).
        steps: how many batches; None: all of ``data`` (required under ParameterServerStrategy).
        metrics: as :func:`fit`'s.
        return_dict: return a dict of the logs instead of a list.
        verbose: as :func:`fit`'s.
        callbacks: ``ds.callbacks.Callback`` objects (their ``on_test_*`` hooks are called).
        precision: as :func:`fit`'s.
        jit_compile: as :func:`fit`'s.

    Returns:
        The loss (a float) when there are no metrics, else ``[loss, *metrics]``; with ``return_dict=True``
        ``{"loss": ..., "<metric>": ...}``.

    Raises:
        ValueError: ``data`` gives no batch, or an argument is not one of the values above.
    """
    mixed = Precision.parse(precision)
    _check_batches(data, "data")
    keras_fit.check_callbacks(callbacks)
    parts = keras_fit.fit_parts(model, None, loss, metrics, precision, "evaluate")
    loss, metrics = parts.loss, parts.metrics
    strategy = context.strategy_of(model)
    cbs = CallbackList(list(callbacks))
    cbs.set_loop(Loop(model, None, strategy))
    logs = _evaluate(
        model,
        data,
        per_example_loss(loss),
        TrackedValues(strategy, metrics, loss),
        steps,
        cbs,
        _verbosity(strategy.step_executor(), verbose),
        stacklevel=3,
        precision=mixed,
        graphs=_graphs_wanted(jit_compile, strategy, model),
    )
    if return_dict:
        return logs
    values = list(logs.values())
    return values[0] if len(values) == 1 else values


def predict(
    model: torch.nn.Module,
    data: Iterable[Any],
    steps: int | None = None,
    callbacks: Sequence[Callback] = (),
    precision: str | int = "32",
) -> torch.Tensor:
    """``model``'s outputs for every example of ``data`` (batches of ``x`` or ``(x, y)``), in order, on every worker.

    Data that gives no batch is a ValueError; fewer batches than ``steps`` a warning. ``precision``: as
    :func:`fit`'s (autocast only; the outputs are in the autocast dtype, as Lightning's).

    Args:
        model: the module to run.
        data: an iterable of batches of ``x`` or ``(x, y)`` (``y`` is ignored).
        steps: how many batches; None: all of ``data``.
        callbacks: ``ds.callbacks.Callback`` objects (their ``on_predict_*`` hooks are called).
        precision: as :func:`fit`'s.

    Returns:
        The outputs of every batch, gathered over the replicas and concatenated along the first dimension.

    Raises:
        ValueError: ``data`` gives no batch, or ``precision`` is not one of :func:`fit`'s.
    """
    mixed = Precision.parse(precision)
    keras_fit.check_callbacks(callbacks)
    call = keras_fit.call_kwargs(model, False)
    strategy = context.strategy_of(model)
    executor = strategy.step_executor()
    cbs = CallbackList(list(callbacks))
    cbs.set_loop(Loop(model, None, strategy))

    def predict_step(x: torch.Tensor, y: Any, n: int) -> torch.Tensor:
        with torch.no_grad(), mixed.autocast(_device_type(x, model)):
            model.eval()
            return model(x, **call)

    outputs: list[torch.Tensor] = []

    def predicted_one(result: Any) -> None:
        outputs.append(strategy.gather(result, axis=0))
        cbs.on_predict_batch_end(len(outputs) - 1, {"outputs": outputs[-1]})

    cbs.on_predict_begin()
    _drive(
        executor, executor.feed(data, steps=steps), predict_step, begin=cbs.on_predict_batch_begin, done=predicted_one
    )
    if not outputs:
        raise _no_data("predict", data)
    if steps is not None and len(outputs) < steps:
        _ran_out(
            f"predict ran {len(outputs)} of steps={steps} steps ({_has(data, len(outputs))})",
            "Prediction stops here",
            "steps",
            stacklevel=2,
        )
    cbs.on_predict_end()
    return torch.cat(outputs)
