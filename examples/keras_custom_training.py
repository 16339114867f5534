"""Custom training with distrib strategies, keeping the tutorial's Keras code: TF's "Custom training with
tf.distribute.Strategy" (the Fashion-MNIST CNN) with Keras 3 on PyTorch.

The tutorial's code line for line, with ``tf.keras`` -> ``keras`` and ``tf.distribute`` -> ``ds``. What differs:
the gradient lines (``model.zero_grad()``, ``loss.backward()``, ``v.value.grad``, ``optimizer.apply``, as Keras'
guide "Writing a training loop from scratch in PyTorch" writes them), the data (read from the local IDX files,
batched by ``TensorBatches``: there is no ``tf.data``), the model's input shape (a Keras model needs it when the
scope closes, to be distributed), Keras 3's names (``reduction=None``, ``reset_state``) and ``float()`` around
printed tensors.

    KERAS_BACKEND=torch python examples/keras_custom_training.py                 # MirroredStrategy, local devices
    python examples/keras_custom_training.py --replicas 2 --epochs 1             # two logical CPU replicas
    python examples/keras_custom_training.py --data-dir DIR                      # IDX files somewhere else
"""

import argparse

# Import TensorFlow
import os

os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is imported: Keras 3 on PyTorch

import keras  # noqa: E402

# Helper libraries
import numpy as np  # noqa: E402
import torch  # noqa: E402

import distrib as ds  # noqa: E402
from distrib.app.datasets import load_fashion_mnist  # noqa: E402
from distrib.app.train import TensorBatches  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--replicas", type=int, default=None)
parser.add_argument("--data-dir", default=None, help="Fashion-MNIST IDX files (default: Debian's package)")
parser.add_argument("--checkpoint-dir", default="./training_checkpoints")
args = parser.parse_args()


class fashion_mnist:  # keras.datasets.fashion_mnist downloads; this reads the same data from the IDX files
    @staticmethod
    def load_data():
        (x_train, y_train), (x_test, y_test) = load_fashion_mnist(args.data_dir)

        def uint8(x):
            return (x.squeeze(1) * 255).round().to(torch.uint8).numpy()

        return (uint8(x_train), y_train.numpy()), (uint8(x_test), y_test.numpy())


print(keras.__version__)

(train_images, train_labels), (test_images, test_labels) = fashion_mnist.load_data()

# Adding a dimension to the array -> new shape == (28, 28, 1)
# We are doing this because the first layer in our model is a convolutional
# layer and it requires a 4D input (batch_size, height, width, channels).
# batch_size dimension will be added later on.
train_images = train_images[..., None]
test_images = test_images[..., None]

# Getting the images in [0, 1] range.
train_images = train_images / np.float32(255)
test_images = test_images / np.float32(255)

# If the list of devices is not specified in the
# `ds.MirroredStrategy` constructor, it will be auto-detected.
strategy = ds.MirroredStrategy(None if args.replicas is None else [f"cpu:{i}" for i in range(args.replicas)])

print("Number of devices: {}".format(strategy.num_replicas_in_sync))  # noqa: UP032 (the tutorial's line)

BUFFER_SIZE = len(train_images)

BATCH_SIZE_PER_REPLICA = 64
GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync

EPOCHS = args.epochs

train_dataset = TensorBatches(
    torch.from_numpy(train_images), torch.from_numpy(train_labels), batch_size=GLOBAL_BATCH_SIZE, shuffle=True
)
test_dataset = TensorBatches(torch.from_numpy(test_images), torch.from_numpy(test_labels), batch_size=GLOBAL_BATCH_SIZE)

train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)


def create_model():
    model = keras.Sequential(
        [
            keras.Input(shape=(28, 28, 1)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )

    return model


# Create a checkpoint directory to store the checkpoints.
checkpoint_dir = args.checkpoint_dir
checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt")

with strategy.scope():
    # Set reduction to `none` so we can do the reduction afterwards and divide by
    # global batch size.
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def compute_loss(labels, predictions):
        per_example_loss = loss_object(labels, predictions)
        return ds.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)


with strategy.scope():
    test_loss = keras.metrics.Mean(name="test_loss")

    train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
    test_accuracy = keras.metrics.SparseCategoricalAccuracy(name="test_accuracy")

# model, optimizer, and checkpoint must be created under `strategy.scope`.
with strategy.scope():
    model = create_model()

    optimizer = keras.optimizers.Adam()

    # ds.Checkpoint does not take a Keras optimizer yet (TypeError): the model's weights only
    checkpoint = ds.Checkpoint(model=model)


def train_step(inputs):
    images, labels = inputs

    predictions = model(images, training=True)
    loss = compute_loss(labels, predictions)

    model.zero_grad()
    loss.backward()
    gradients = [v.value.grad for v in model.trainable_variables]
    with torch.no_grad():
        optimizer.apply(gradients, model.trainable_variables)

    train_accuracy.update_state(labels, predictions)
    return loss


def test_step(inputs):
    images, labels = inputs

    predictions = model(images, training=False)
    t_loss = loss_object(labels, predictions)

    test_loss.update_state(t_loss)
    test_accuracy.update_state(labels, predictions)


# `run` replicates the provided computation and runs it
# with the distributed input.
@ds.function
def distributed_train_step(dataset_inputs):
    per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
    return strategy.reduce(ds.ReduceOp.SUM, per_replica_losses, axis=None)


@ds.function
def distributed_test_step(dataset_inputs):
    return strategy.run(test_step, args=(dataset_inputs,))


for epoch in range(EPOCHS):
    train_dataset.set_epoch(epoch)  # tf.data's shuffle reshuffles every epoch
    # TRAIN LOOP
    total_loss = 0.0
    num_batches = 0
    for x in train_dist_dataset:
        total_loss += distributed_train_step(x)
        num_batches += 1
    train_loss = total_loss / num_batches

    # TEST LOOP
    for x in test_dist_dataset:
        distributed_test_step(x)

    if epoch % 2 == 0:
        checkpoint.save(checkpoint_prefix)

    template = "Epoch {}, Loss: {}, Accuracy: {}, Test Loss: {}, Test Accuracy: {}"
    print(
        template.format(
            epoch + 1,
            float(train_loss),
            float(train_accuracy.result() * 100),
            float(test_loss.result()),
            float(test_accuracy.result() * 100),
        )
    )

    test_loss.reset_state()
    train_accuracy.reset_state()
    test_accuracy.reset_state()

eval_accuracy = keras.metrics.SparseCategoricalAccuracy(name="eval_accuracy")

keras.backend.clear_session()  # ds.Checkpoint matches a Keras model by its layers' names: number them from 0 again
new_model = create_model()
new_optimizer = keras.optimizers.Adam()

test_dataset = TensorBatches(torch.from_numpy(test_images), torch.from_numpy(test_labels), batch_size=GLOBAL_BATCH_SIZE)


@ds.function
def eval_step(images, labels):
    predictions = new_model(images, training=False)
    eval_accuracy(labels, predictions)


checkpoint = ds.Checkpoint(model=new_model)
checkpoint.restore(ds.latest_checkpoint(checkpoint_dir))

for images, labels in test_dataset:
    eval_step(images, labels)

print("Accuracy after restoring the saved model without strategy: {}".format(float(eval_accuracy.result() * 100)))  # noqa: UP032

for _ in range(EPOCHS):
    total_loss = 0.0
    num_batches = 0
    train_iter = iter(train_dist_dataset)

    for _ in range(10):
        total_loss += distributed_train_step(next(train_iter))
        num_batches += 1
    average_train_loss = total_loss / num_batches

    template = "Epoch {}, Loss: {}, Accuracy: {}"
    print(template.format(epoch + 1, float(average_train_loss), float(train_accuracy.result() * 100)))
    train_accuracy.reset_state()


@ds.function
def distributed_train_epoch(dataset):
    total_loss = 0.0
    num_batches = 0
    for x in dataset:
        per_replica_losses = strategy.run(train_step, args=(x,))
        total_loss += strategy.reduce(ds.ReduceOp.SUM, per_replica_losses, axis=None)
        num_batches += 1
    return total_loss / num_batches


for epoch in range(EPOCHS):
    train_loss = distributed_train_epoch(train_dist_dataset)

    template = "Epoch {}, Loss: {}, Accuracy: {}"
    print(template.format(epoch + 1, float(train_loss), float(train_accuracy.result() * 100)))

    train_accuracy.reset_state()
