"""A Keras 3 model (torch backend) compiled in ``strategy.scope()`` and trained with ``ds.fit``, for the equality tests.

    distrib launch --workers 2 tests/scripts/keras_fit.py --strategy multi-worker --optimizer keras --out OUT

The model is compiled as TF's Keras tutorials compile it (``optimizer``, ``loss="sparse_categorical_crossentropy"``
on softmax outputs, ``metrics=["accuracy"]``); ``ds.fit`` trains it two epochs of ``STEPS`` global batches of
``GLOBAL_BATCH`` (each split over the workers, then each worker's replicas), then ``ds.evaluate`` and ``ds.predict``
run over the same batches (validation: the first 4 batches after each epoch). ``train("none", "keras")`` is Keras' own ``model.fit`` / ``evaluate`` / ``predict`` in one
process on the same batches: the result every strategy must give. With ``--optimizer torch`` the model is compiled
without an optimizer and ``ds.fit`` is given ``torch.optim.Adam(model.parameters())``. The chief writes the result
to OUT.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import torch  # noqa: E402

import distrib as ds  # noqa: E402

GLOBAL_BATCH = 16
STEPS = 24
EPOCHS = 2
LEARNING_RATE = 1e-2


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable images: the label's row is bright."""
    g = torch.Generator().manual_seed(5)
    images = torch.randn(GLOBAL_BATCH * STEPS, 12, 12, 1, generator=g)
    labels = torch.randint(0, 10, (GLOBAL_BATCH * STEPS,), generator=g)
    images[torch.arange(len(labels)), labels + 1] += 2.0
    return images, labels


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    images, labels = dataset()
    return list(zip(images.split(GLOBAL_BATCH), labels.split(GLOBAL_BATCH)))


def create_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((12, 12, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


def make_strategy(name: str) -> ds.Strategy | None:
    if name == "none":
        return None
    if name == "one-device":
        return ds.OneDeviceStrategy("cpu")
    if name == "mirrored2":
        return ds.MirroredStrategy(["cpu:0", "cpu:1"])
    if name == "multi-worker":
        return ds.MultiWorkerMirroredStrategy(communication_options=ds.CommunicationOptions(timeout_seconds=60))
    raise ValueError(name)


def build(optimizer_kind: str) -> tuple[keras.Model, torch.optim.Optimizer | None]:
    model = create_model()
    torch_optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE) if optimizer_kind == "torch" else None
    keras_optimizer = keras.optimizers.Adam(learning_rate=LEARNING_RATE) if optimizer_kind == "keras" else None
    model.compile(optimizer=keras_optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model, torch_optimizer


def train(strategy_name: str, optimizer_kind: str, callbacks: list[ds.callbacks.Callback] | None = None) -> dict:
    """Two epochs, then evaluate and predict; the trainable variables, the history and the global results."""
    strategy = make_strategy(strategy_name)
    if strategy is None and optimizer_kind == "keras":  # Keras' own loop, one process
        model, _ = build(optimizer_kind)
        x, y = dataset()
        history = model.fit(
            x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0, validation_data=(x[:64], y[:64])
        ).history
        evaluated = model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)
        predicted = torch.as_tensor(model.predict(x, batch_size=GLOBAL_BATCH, verbose=0))
    else:
        with strategy.scope() if strategy is not None else _nothing():
            model, torch_optimizer = build(optimizer_kind)
        data = batches()
        history = ds.fit(
            model, data, optimizer=torch_optimizer, epochs=EPOCHS, steps_per_epoch=STEPS, verbose=0,
            callbacks=callbacks or [], validation_data=data[:4],
        ).history  # fmt: skip
        evaluated = ds.evaluate(model, data, verbose=0)
        predicted = ds.predict(model, [x for x, _ in data])
    return {
        "weights": [v.value.detach().clone() for v in model.trainable_weights],
        "history": {k: [float(v) for v in values] for k, values in history.items()},
        "evaluate": [float(v) for v in evaluated],
        "predict": predicted.detach().clone(),
        "chief": strategy is None or strategy.is_chief,
    }


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="multi-worker")
    p.add_argument("--optimizer", choices=["keras", "torch"], default="keras")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    result = train(args.strategy, args.optimizer)
    with ds.MultiWorkerMirroredStrategy().scope() if args.strategy == "multi-worker" else _nothing():
        model, _ = build(args.optimizer)
    try:  # Keras' own fit would train each worker on its batch alone: an error naming ds.fit
        model.fit(*dataset(), batch_size=GLOBAL_BATCH, verbose=0)
        result["own_fit"] = "ran"
    except NotImplementedError as e:
        result["own_fit"] = str(e)
    if result["chief"]:
        torch.save(result, args.out)
