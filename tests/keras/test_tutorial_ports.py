"""TF's Keras tutorials ported line by line, as a TF user would, behave as the tutorials show.

- site/en/tutorials/distribute/keras.ipynb (MirroredStrategy, two CPU replicas here): the ``decay`` schedule,
  the ``PrintLR`` callback reading the optimizer's learning rate, TensorBoard with its graph, ModelCheckpoint,
  and ``eval_loss, eval_acc = model.evaluate(eval_dataset)``;
- site/en/guide/keras/custom_callback.ipynb: every hook gets a dict of logs with Keras' keys, an early stopper sets
  ``self.model.stop_training``, a learning-rate scheduler reads and sets the optimizer's rate;
- site/en/guide/migrate/fault_tolerance.ipynb: ``BackupAndRestore(save_freq=30)`` with a callback that overrides
  Keras' older ``on_batch_begin`` / ``on_batch_end`` resumes at the backed-up step;
- site/en/tutorials/distribute/multi_worker_with_keras.ipynb and multi_worker_with_ctl.ipynb (two real workers
  under ``distrib launch``, tests/scripts/keras_tutorial_worker.py): ``fit`` shows progress on every worker, and the
  chief-only saving with the non-chief's temporary directories and their cleanup runs as written.

MNIST is replaced by random images of its shape (nothing to download); the values the tests check do not
depend on the data.
"""

from __future__ import annotations

import os
import pathlib
import re

import pytest
import torch
from helpers import SCRIPTS, launch
from torch import nn

import distrib as ds
from distrib.app.train import TensorBatches


def test_distributed_keras_tutorial_on_two_replicas(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    print(f"Number of devices: {strategy.num_replicas_in_sync}")
    BATCH_SIZE_PER_REPLICA = 16
    BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
    g = torch.Generator().manual_seed(0)
    images, labels = torch.rand(160, 1, 28, 28, generator=g), torch.randint(0, 10, (160,), generator=g)
    train_dataset = TensorBatches(images[:96], labels[:96], batch_size=BATCH_SIZE, shuffle=True, seed=0)
    eval_dataset = TensorBatches(images[96:], labels[96:], batch_size=BATCH_SIZE)

    with strategy.scope():
        model = nn.Sequential(
            nn.Conv2d(1, 32, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 13 * 13, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=0.001)

    checkpoint_dir = str(tmp_path / "training_checkpoints")
    checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch:04d}")

    def decay(epoch):
        if epoch < 3:
            return 1e-3
        elif epoch >= 3 and epoch < 7:
            return 1e-4
        else:
            return 1e-5

    class PrintLR(ds.callbacks.Callback):  # model.optimizer.learning_rate.numpy(): self.learning_rate
        def on_epoch_end(self, epoch, logs=None):
            print(f"\nLearning rate for epoch {epoch + 1} is {self.learning_rate}")

    callbacks = [
        ds.callbacks.TensorBoard(log_dir=str(tmp_path / "logs")),
        ds.callbacks.ModelCheckpoint(filepath=checkpoint_prefix, save_weights_only=True),
        ds.callbacks.LearningRateScheduler(decay),
        PrintLR(),
    ]
    EPOCHS = 12
    ds.fit(
        model,
        train_dataset,
        optimizer=optimizer,
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        epochs=EPOCHS,
        callbacks=callbacks,
    )

    latest_checkpoint = sorted(pathlib.Path(checkpoint_dir).glob("*"))[-1]
    ds.Checkpoint(model=model).read(latest_checkpoint)  # model.load_weights(latest_checkpoint)
    eval_loss, eval_acc = ds.evaluate(model, eval_dataset, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    print(f"Eval loss: {eval_loss}, Eval accuracy: {eval_acc}")

    out = capsys.readouterr().out
    assert re.findall(r"Learning rate for epoch (\d+) is (\S+)", out) == [
        (str(epoch + 1), str(decay(epoch))) for epoch in range(EPOCHS)
    ]
    assert latest_checkpoint.name == "ckpt_0012.pt"
    # two numbers, the ones evaluate's dict holds (a literal port once unpacked the keys 'loss' and 'accuracy')
    assert isinstance(eval_loss, float) and isinstance(eval_acc, float)
    logs = ds.evaluate(
        model, eval_dataset, loss="sparse_categorical_crossentropy", metrics=["accuracy"], return_dict=True, verbose=0
    )
    assert (eval_loss, eval_acc) == (logs["loss"], logs["accuracy"])
    with torch.no_grad():
        assert eval_acc == pytest.approx(float((model(images[96:]).argmax(1) == labels[96:]).float().mean()))
    assert f"Eval loss: {eval_loss}, Eval accuracy: {eval_acc}" in out
    assert re.search(r"^2/2 - \S+ - loss: [\d.]+ - accuracy: [\d.]+ - ", out, re.M)  # evaluate's progress line
    # TensorBoard: the scalars and, with Keras' default write_graph=True, the model's graph
    train = EventAccumulator(str(tmp_path / "logs" / "train")).Reload()
    assert train.Tags()["graph"] and {"epoch_loss", "epoch_accuracy"} <= set(train.Tags()["scalars"])
    ops = [node.op for node in train.Graph().node]
    assert ops.count("aten::_convolution") + ops.count("aten::conv2d") == 1 and ops.count("aten::linear") == 2, ops


def test_multi_worker_keras_tutorials_on_two_workers_show_progress_everywhere_and_keep_only_the_chief_s_files(tmp_path):
    code, out, _ = launch("--workers", "2", str(SCRIPTS / "keras_tutorial_worker.py"), str(tmp_path), "2", timeout=240)
    assert code == 0, out  # before: FileNotFoundError in the non-chief's rmtree, CollectiveError on the chief
    for worker in (0, 1):
        lines = [
            line[len(f"[worker {worker}] ") :] for line in out.splitlines() if line.startswith(f"[worker {worker}] ")
        ]
        # verbose="auto": every worker shows fit's progress, as tf.keras (before: the chief alone)
        assert [line for line in lines if line.startswith("Epoch ")] == [
            "Epoch 1/3",
            "Epoch 2/3",
            "Epoch 3/3",
            "Epoch 1/2",
            "Epoch 2/2",
        ], out
        assert len([line for line in lines if re.match(r"2/2 - \S+ - loss: [\d.]+ - accuracy: ", line)]) == 5, out
        assert "loaded the chief's model: same=True" in lines and lines[-1] == "DONE", out
    # every save returned a path that exists on the worker that got it: the chief's files, and the
    # non-chief's own copies in the temporary directories the tutorials give it (before: never written)
    assert f"[worker 0] model saved {tmp_path / 'keras-model'} exists=True" in out, out
    assert f"[worker 1] model saved {tmp_path / 'workertemp_1' / 'keras-model'} exists=True" in out, out
    assert f"[worker 1] manager saved {tmp_path / 'workertemp_1' / 'ckpt' / 'ckpt-1'} exists=True" in out, out
    for epoch in (0, 1):
        assert (
            f"[worker 1] epoch {epoch} saved {tmp_path / 'ctl' / 'workertemp_1' / 'ckpt' / f'ckpt-{epoch + 1}'}"
            " exists=True"
        ) in out, out
    # after the tutorials' cleanup only the chief's files remain (the tutorials leave workertemp_1 itself, empty)
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert files == [
        "ckpt/checkpoint",
        "ckpt/ckpt-1.pt",
        "ctl/ckpt/checkpoint",
        "ctl/ckpt/ckpt-2.pt",
        "keras-model.pt",
    ], files


def test_custom_callback_guide(capsys):
    """site/en/guide/keras/custom_callback.ipynb, its callbacks as written (only the model's API is PyTorch's)."""

    def get_model():
        torch.manual_seed(0)
        model = nn.Linear(784, 1)
        return model, torch.optim.RMSprop(model.parameters(), lr=0.1, alpha=0.9, eps=1e-7)

    g = torch.Generator().manual_seed(0)
    x_train, y_train = torch.rand(512, 784, generator=g), torch.randint(0, 10, (512, 1), generator=g).float()

    def batches(x, y, b):
        return [(x[i : i + b], y[i : i + b]) for i in range(0, len(x), b)]

    class CustomCallback(ds.callbacks.Callback):
        def on_train_begin(self, logs=None):
            keys = list(logs.keys())
            print(f"Starting training; got log keys: {keys}")

        def on_train_end(self, logs=None):
            keys = list(logs.keys())
            print(f"Stop training; got log keys: {keys}")

        def on_epoch_begin(self, epoch, logs=None):
            keys = list(logs.keys())
            print(f"Start epoch {epoch} of training; got log keys: {keys}")

        def on_epoch_end(self, epoch, logs=None):
            keys = list(logs.keys())
            print(f"End epoch {epoch} of training; got log keys: {keys}")

        def on_test_begin(self, logs=None):
            keys = list(logs.keys())
            print(f"Start testing; got log keys: {keys}")

        def on_test_end(self, logs=None):
            keys = list(logs.keys())
            print(f"Stop testing; got log keys: {keys}")

        def on_predict_begin(self, logs=None):
            keys = list(logs.keys())
            print(f"Start predicting; got log keys: {keys}")

        def on_predict_end(self, logs=None):
            keys = list(logs.keys())
            print(f"Stop predicting; got log keys: {keys}")

        def on_train_batch_begin(self, batch, logs=None):
            keys = list(logs.keys())
            print(f"...Training: start of batch {batch}; got log keys: {keys}")

        def on_train_batch_end(self, batch, logs=None):
            keys = list(logs.keys())
            print(f"...Training: end of batch {batch}; got log keys: {keys}")

        def on_test_batch_begin(self, batch, logs=None):
            keys = list(logs.keys())
            print(f"...Evaluating: start of batch {batch}; got log keys: {keys}")

        def on_test_batch_end(self, batch, logs=None):
            keys = list(logs.keys())
            print(f"...Evaluating: end of batch {batch}; got log keys: {keys}")

        def on_predict_batch_begin(self, batch, logs=None):
            keys = list(logs.keys())
            print(f"...Predicting: start of batch {batch}; got log keys: {keys}")

        def on_predict_batch_end(self, batch, logs=None):
            keys = list(logs.keys())
            print(f"...Predicting: end of batch {batch}; got log keys: {keys}")

    model, optimizer = get_model()
    ds.fit(
        model,
        batches(x_train[:256], y_train[:256], 128),
        optimizer=optimizer,
        loss="mean_squared_error",
        metrics=["mean_absolute_error"],
        epochs=1,
        verbose=0,
        validation_data=batches(x_train[256:384], y_train[256:384], 128),
        callbacks=[CustomCallback()],
    )
    res = ds.predict(model, batches(x_train[:128], y_train[:128], 128), callbacks=[CustomCallback()])
    metrics = "['loss', 'mean_absolute_error']"
    assert capsys.readouterr().out.splitlines() == [  # Keras' lines: a dict in every hook, validation unprefixed
        "Starting training; got log keys: []",
        "Start epoch 0 of training; got log keys: []",
        "...Training: start of batch 0; got log keys: []",
        f"...Training: end of batch 0; got log keys: {metrics}",
        "...Training: start of batch 1; got log keys: []",
        f"...Training: end of batch 1; got log keys: {metrics}",
        "Start testing; got log keys: []",
        "...Evaluating: start of batch 0; got log keys: []",
        f"...Evaluating: end of batch 0; got log keys: {metrics}",
        f"Stop testing; got log keys: {metrics}",
        "End epoch 0 of training; got log keys: ['loss', 'mean_absolute_error', 'val_loss', 'val_mean_absolute_error']",
        "Stop training; got log keys: ['loss', 'mean_absolute_error', 'val_loss', 'val_mean_absolute_error']",
        "Start predicting; got log keys: []",
        "...Predicting: start of batch 0; got log keys: []",
        "...Predicting: end of batch 0; got log keys: ['outputs']",
        "Stop predicting; got log keys: []",
    ]
    assert res.shape == (128, 1)

    class EarlyStoppingAtMinLoss(ds.callbacks.Callback):
        def __init__(self, patience=0):
            super().__init__()
            self.patience = patience
            self.best_weights = None

        def on_train_begin(self, logs=None):
            self.wait = 0
            self.stopped_epoch = 0
            self.best = float("inf")  # np.Inf

        def on_epoch_end(self, epoch, logs=None):
            current = logs.get("loss")
            if current < self.best:  # np.less(current, self.best)
                self.best = current
                self.wait = 0
                self.best_weights = {k: v.clone() for k, v in self.model.state_dict().items()}  # get_weights()
            else:
                self.wait += 1
                if self.wait >= self.patience:
                    self.stopped_epoch = epoch
                    self.model.stop_training = True
                    print("Restoring model weights from the end of the best epoch.")
                    self.model.load_state_dict(self.best_weights)  # set_weights(self.best_weights)

        def on_train_end(self, logs=None):
            if self.stopped_epoch > 0:
                print("Epoch %05d: early stopping" % (self.stopped_epoch + 1))

    class CustomLearningRateScheduler(ds.callbacks.Callback):
        def __init__(self, schedule):
            super().__init__()
            self.schedule = schedule

        def on_epoch_begin(self, epoch, logs=None):
            lr = float(self.learning_rate)  # tf.keras.backend.get_value(self.model.optimizer.learning_rate)
            scheduled_lr = self.schedule(epoch, lr)
            self.learning_rate = scheduled_lr  # tf.keras.backend.set_value(self.model.optimizer.lr, scheduled_lr)
            print("\nEpoch %05d: Learning rate is %6.4f." % (epoch, scheduled_lr))

    stopper = EarlyStoppingAtMinLoss()
    model, optimizer = get_model()
    history = ds.fit(
        model,
        batches(x_train, y_train, 64),
        optimizer=optimizer,
        loss="mean_squared_error",
        metrics=["mean_absolute_error"],
        steps_per_epoch=5,
        epochs=30,
        verbose=0,
        callbacks=[stopper, CustomLearningRateScheduler(lambda epoch, lr: 0.1 / (epoch + 1))],
    )
    out = capsys.readouterr().out
    assert 0 < stopper.stopped_epoch < 29 and history.epoch == list(range(stopper.stopped_epoch + 1)), out
    assert (
        out.count("Restoring model weights") == 1 and "Epoch %05d: early stopping" % (stopper.stopped_epoch + 1) in out
    )  # before: model.stop_training, an attribute of the module, was ignored and all 30 epochs ran
    assert all(torch.equal(v, stopper.best_weights[k]) for k, v in model.state_dict().items())
    assert re.findall(r"Learning rate is (\S+)\.", out) == ["%6.4f" % (0.1 / (e + 1)) for e in history.epoch]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / (stopper.stopped_epoch + 1))
    # a new fit starts with model.stop_training False again, as Keras' fit sets it
    assert (
        len(
            ds.fit(
                model,
                batches(x_train, y_train, 64),
                optimizer=optimizer,
                loss="mse",
                steps_per_epoch=2,
                epochs=3,
                verbose=0,
            ).epoch
        )
        == 3
    )


def test_fault_tolerance_migration_guide_interrupted_at_a_step_resumes_from_the_backup(tmp_path):
    """site/en/guide/migrate/fault_tolerance.ipynb, "BackupAndRestore ... save_freq": its InterruptAtStep overrides
    Keras' older hooks on_batch_begin / on_batch_end (before: never called, so training was never interrupted)."""

    def create_model():
        torch.manual_seed(0)
        # Dense(512) is Linear(784, 64) here: the hooks and the backup are what this checks, not the width
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10))

    g = torch.Generator().manual_seed(0)
    x_train, y_train = torch.rand(640, 28, 28, generator=g), torch.randint(0, 10, (640,), generator=g)
    x_test, y_test = x_train[:64], y_train[:64]
    train = TensorBatches(x_train, y_train, batch_size=32)  # x=x_train, y=y_train (batch_size=32)

    class InterruptAtStep(ds.callbacks.Callback):
        # A callback for artificially interrupting training.
        def __init__(self, interrupting_step=140):
            self.total_step_count = 0
            self.interrupting_step = interrupting_step

        def on_batch_begin(self, batch, logs=None):
            self.total_step_count += 1

        def on_batch_end(self, batch, logs=None):
            if self.total_step_count == self.interrupting_step:
                print("\nInterrupting at step count", self.total_step_count)
                raise RuntimeError("Interruption")

    class Steps(ds.callbacks.Callback):
        def __init__(self) -> None:
            self.seen: list[tuple[int, int]] = []

        def on_train_batch_begin(self, batch, logs=None):
            self.seen.append((int(self.loop.epoch), batch))

    log_dir_2 = str(tmp_path / "backup")
    backup_restore_callback = ds.callbacks.BackupAndRestore(backup_dir=log_dir_2, save_freq=30)
    model = create_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)  # compile(optimizer='adam')
    with pytest.raises(
        ValueError,
        match=r"validation_data=\(tensor, tensor\) looks like Keras' arrays form.*"
        r"Give \[\(x, y\)\] for one batch",
    ):
        ds.fit(
            model,
            train,
            optimizer=optimizer,
            loss="sparse_categorical_crossentropy",
            epochs=3,
            steps_per_epoch=100,
            validation_data=(x_test, y_test),
        )
    with pytest.raises(RuntimeError, match="Interruption"):
        ds.fit(
            model,
            train,
            optimizer=optimizer,
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
            epochs=3,
            steps_per_epoch=100,
            validation_data=[(x_test, y_test)],
            verbose=0,
            callbacks=[backup_restore_callback, InterruptAtStep()],
        )
    model = create_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)
    steps = Steps()
    history = ds.fit(
        model,
        train,
        optimizer=optimizer,
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        epochs=3,
        steps_per_epoch=100,
        validation_data=[(x_test, y_test)],
        verbose=0,
        callbacks=[ds.callbacks.BackupAndRestore(backup_dir=log_dir_2, save_freq=30), steps],
    )
    # the last backup before step 140 was at step 120: epoch 1 (from 0), its step 20
    assert steps.seen[0] == (1, 20) and len(steps.seen) == 180 and history.epoch == [1, 2]
