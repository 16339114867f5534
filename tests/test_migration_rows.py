"""The docs/migration.md rows a port leans on are true: what ``load_fashion_mnist`` returns, what each
mapped Keras layer gives on the input its row names, the losses' shapes and values, the optimizers'
defaults and updates, and the signatures whose defaults a row copies from TF.

TensorFlow is not installed here, so Keras' side is written out from its documented formulas (output
shapes of 'valid' convolutions and pooling, the update rules in Keras' optimizer sources), each with
the row it checks. Every test also checks that its row still says what is tested, so a row edited
without its test (or the reverse) fails here.
"""

from __future__ import annotations

import ast
import inspect
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import write_idx
from torch import nn

import distrib as ds
from distrib.app.datasets import DEFAULT_FASHION_MNIST_DIR, load_fashion_mnist
from distrib.app.models import fashion_mnist_optimizer, keras_init_

MIGRATION = (Path(__file__).resolve().parents[1] / "docs" / "migration.md").read_text()


def row(first_cell: str) -> str:
    """The one table row of migration.md whose first cell starts with ``first_cell``, followed by the notes
    under its table that the row refers to (a cell keeps a short text and ends with "(note 2)"; the long
    reason is item 2 of the numbered list under the table)."""
    lines = MIGRATION.splitlines()
    found = [i for i, line in enumerate(lines) if line.startswith("| " + first_cell)]
    assert len(found) == 1, f"{len(found)} rows of migration.md start with {first_cell!r}"
    text = lines[found[0]]
    after = lines[found[0] + 1 :]
    table_end = next(i for i, line in enumerate(after + [""]) if not line.startswith("|"))
    notes: dict[str, str] = {}
    for line in after[table_end:]:
        if line.startswith(("|", "#")):
            break  # the next table or section: its notes are its own
        item = re.match(r"(\d+)\. (.*)", line)
        if item:
            notes[item.group(1)] = item.group(2)
    for number in re.findall(r"\(note (\d+)\)", text):
        assert number in notes, f"the row {first_cell!r} refers to note {number}, which is not under its table"
        text += " " + notes[number]
    return text


# -- data loading --------------------------------------------------------------------------------------------


def test_load_fashion_mnist_gives_float32_in_0_1_channels_first_and_int64_labels(tmp_path):
    text = row("`tf.keras.datasets.mnist.load_data()`")
    assert "float32 in [0, 1]" in text and "`(N, 1, 28, 28)`" in text and "labels `int64`, shape `(N,)`" in text
    rng = np.random.default_rng(0)
    images = {"train": rng.integers(0, 256, (6, 28, 28)), "t10k": rng.integers(0, 256, (4, 28, 28))}
    images["train"][0, 0, :2] = [0, 255]  # both ends of the range
    labels = {"train": np.arange(6) % 10, "t10k": np.arange(4)}
    for prefix in ("train", "t10k"):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", images[prefix])
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", labels[prefix])

    (x_train, y_train), (x_test, y_test) = load_fashion_mnist(tmp_path)  # unpacks as Keras' load_data()

    assert x_train.dtype == torch.float32 and x_train.shape == (6, 1, 28, 28) and x_test.shape == (4, 1, 28, 28)
    assert y_train.dtype == torch.int64 and y_train.shape == (6,) and y_test.tolist() == [0, 1, 2, 3]
    assert (x_train[0, 0, 0, 0], x_train[0, 0, 0, 1]) == (0.0, 1.0)  # divided by 255 already
    expected = torch.from_numpy(images["train"].astype(np.float32) / np.float32(255))  # the tutorial's own scaling
    torch.testing.assert_close(x_train[:, 0], expected, rtol=0, atol=1e-7)


@pytest.mark.skipif(
    not Path(DEFAULT_FASHION_MNIST_DIR).is_dir(), reason="Debian's dataset-fashion-mnist is not installed"
)
def test_the_real_fashion_mnist_has_the_shapes_the_row_states():
    train, test = load_fashion_mnist()
    assert train.images.shape == (60000, 1, 28, 28) and test.images.shape == (10000, 1, 28, 28)
    assert train.images.dtype == torch.float32 and 0.0 == float(train.images.min()) and float(train.images.max()) == 1.0
    assert train.labels.dtype == torch.int64 and sorted(train.labels.unique().tolist()) == list(range(10))


# -- layer mappings: the tutorials' models, layer by layer ---------------------------------------------------


def channels_first(keras_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Keras' ``(N, H, W, C)`` as PyTorch's ``(N, C, H, W)``; other ranks unchanged."""
    if len(keras_shape) == 4:
        n, h, w, c = keras_shape
        return (n, c, h, w)
    return keras_shape


def conv_valid(size: int, kernel: int) -> int:
    return size - kernel + 1  # Keras' Conv2D default padding="valid", strides=1


def pool_valid(size: int) -> int:
    return size // 2  # Keras' MaxPooling2D() default pool_size=(2, 2), strides=pool_size, padding="valid"


N = 3
# (row's first cell, what the row maps it to, the torch layer, the input shape, Keras' output shape (NHWC))
LAYERS: list[tuple[str, str, Callable[[], Any], tuple[int, ...], tuple[int, ...]]] = [
    (
        "`tf.keras.layers.Reshape(target_shape=(28, 28, 1))`",
        "`nn.Unflatten(1, (1, 28))`",
        lambda: nn.Unflatten(1, (1, 28)),
        (N, 28, 28),
        (N, 28, 28, 1),
    ),
    (
        "`tf.keras.layers.Reshape(target_shape=(28, 28, 1))`",
        "`x.unsqueeze(1)`",
        lambda: lambda x: x.unsqueeze(1),
        (N, 28, 28),
        (N, 28, 28, 1),
    ),
    (
        "`tf.keras.layers.Reshape(target_shape=(28, 28, 1))`",
        "`nn.Unflatten(1, (1, 28, 28))`",
        lambda: nn.Unflatten(1, (1, 28, 28)),
        (N, 784),
        (N, 28, 28, 1),
    ),
    (
        "`tf.keras.layers.Reshape(target_shape=(28, 28, 1))`",
        "`x.view(-1, 1, 28, 28)`",
        lambda: lambda x: x.view(-1, 1, 28, 28),
        (N, 1, 28, 28),
        (N, 28, 28, 1),
    ),
    (
        '`tf.keras.layers.Conv2D(32, 3, activation="relu")`',
        "`nn.Conv2d(1, 32, 3)` then `nn.ReLU()`",
        lambda: nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU()),
        (N, 1, 28, 28),
        (N, conv_valid(28, 3), conv_valid(28, 3), 32),
    ),
    (
        "`tf.keras.layers.MaxPooling2D()`",
        "`nn.MaxPool2d(2)`",
        lambda: nn.MaxPool2d(2),
        (N, 32, 26, 26),
        (N, pool_valid(26), pool_valid(26), 32),
    ),
    (
        "`tf.keras.layers.MaxPooling2D()`",
        "`nn.MaxPool2d(2)`",  # the tutorial's second pooling: an odd size floors
        lambda: nn.MaxPool2d(2),
        (N, 64, 11, 11),
        (N, pool_valid(11), pool_valid(11), 64),
    ),
    ("`tf.keras.layers.Flatten()`", "`nn.Flatten()`", lambda: nn.Flatten(), (N, 64, 5, 5), (N, 5 * 5 * 64)),
    (
        '`tf.keras.layers.Dense(128, activation="relu")`',
        "`nn.Linear(in, 128)` then `nn.ReLU()`",
        lambda: nn.Sequential(nn.Linear(5408, 128), nn.ReLU()),
        (N, 5408),
        (N, 128),
    ),
    ("`tf.keras.layers.Dense(1, input_shape=(1,))`", "`nn.Linear(1, 1)`", lambda: nn.Linear(1, 1), (N, 1), (N, 1)),
]


@pytest.mark.parametrize(
    "first_cell, mapping, make, in_shape, keras_out", LAYERS, ids=[f"{m}-{s}" for _, m, _, s, _ in LAYERS]
)
def test_each_mapped_layer_gives_the_shape_keras_gives(first_cell, mapping, make, in_shape, keras_out):
    assert mapping in row(first_cell)
    with torch.no_grad():
        out = make()(torch.rand(in_shape))
    assert tuple(out.shape) == channels_first(keras_out)


def test_unflatten_1_28_28_refuses_the_tutorials_input_as_the_reshape_row_warns():
    assert "is a RuntimeError" in row("`tf.keras.layers.Reshape(target_shape=(28, 28, 1))`")
    with pytest.raises(RuntimeError, match="unflatten"):
        nn.Unflatten(1, (1, 28, 28))(torch.rand(N, 28, 28))


def test_the_tutorials_models_run_end_to_end_on_the_row_mappings():
    """Seed 001's model on Keras' (N, 28, 28) input and seed 000's on load_fashion_mnist's (N, 1, 28, 28):
    the rows' layers chained give Keras' logits shape (N, 10)."""
    seed_001 = nn.Sequential(
        nn.Unflatten(1, (1, 28)),
        nn.Conv2d(1, 32, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 26 * 26, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )
    seed_000 = nn.Sequential(
        nn.Conv2d(1, 32, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 5 * 5, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )
    with torch.no_grad():
        assert seed_001(torch.rand(N, 28, 28)).shape == (N, 10)
        assert seed_000(torch.rand(N, 1, 28, 28)).shape == (N, 10)


def test_flatten_orders_features_channel_first_where_keras_orders_them_channel_last():
    assert "flattens `[C, H, W]`, where Keras flattens `[H, W, C]`" in row("`tf.keras.layers.Flatten()`")
    nhwc = torch.arange(2 * 3 * 3 * 4, dtype=torch.float32).reshape(2, 3, 3, 4)
    keras = nhwc.reshape(2, -1)
    torch_ = nn.Flatten()(nhwc.permute(0, 3, 1, 2))  # the same activations, channels first
    assert not torch.equal(keras, torch_) and torch.equal(keras.sort().values, torch_.sort().values)


def test_keras_init_gives_glorot_uniform_weights_and_zero_biases_where_torch_defaults_differ():
    assert "`nn.init.xavier_uniform_(conv.weight)` and `nn.init.zeros_(conv.bias)`" in row(
        '`tf.keras.layers.Conv2D(32, 3, activation="relu")`'
    )
    torch.manual_seed(0)
    conv = nn.Conv2d(32, 64, 3)
    fan_in, fan_out = 32 * 9, 64 * 9
    conv.requires_grad_(False)
    assert float(conv.bias.abs().max()) > 0  # torch's default: uniform biases
    assert float(conv.weight.abs().max()) <= 1 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)): 1/sqrt(fan_in)
    keras_init_(conv)
    glorot = math.sqrt(6 / (fan_in + fan_out))
    assert float(conv.bias.abs().max()) == 0.0
    assert 0.95 * glorot < float(conv.weight.abs().max()) <= glorot


# -- losses --------------------------------------------------------------------------------------------------


def test_sparse_categorical_crossentropy_from_logits_none_is_cross_entropy_per_example():
    assert '`F.cross_entropy(logits, labels, reduction="none")`' in row(
        "`tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=NONE)`"
    )
    logits, labels = torch.randn(5, 10, dtype=torch.float64), torch.tensor([0, 3, 9, 3, 1])
    per_example = F.cross_entropy(logits, labels, reduction="none")
    keras = -(logits - logits.exp().sum(-1, keepdim=True).log()).gather(1, labels[:, None])[:, 0]  # -log softmax
    assert per_example.shape == (5,)
    torch.testing.assert_close(per_example, keras)


@pytest.mark.parametrize("shape", [(5, 1), (5, 3)])
def test_binary_crossentropy_from_logits_none_gives_one_value_per_example(shape):
    assert '`F.binary_cross_entropy_with_logits(logits, labels, reduction="none").mean(-1)`' in row(
        "`tf.keras.losses.BinaryCrossentropy(from_logits=True, reduction=NONE)`"
    )
    x, z = torch.randn(shape, dtype=torch.float64), torch.randint(0, 2, shape).double()
    ours = F.binary_cross_entropy_with_logits(x, z, reduction="none").mean(-1)
    # tf.nn.sigmoid_cross_entropy_with_logits' documented form, then Keras' mean over the last axis
    keras = (x.clamp(min=0) - x * z + torch.log1p(torch.exp(-x.abs()))).mean(-1)
    assert ours.shape == (5,)
    torch.testing.assert_close(ours, keras)


# -- optimizers: the defaults each row states, and the updates its mapping gives -----------------------------


def defaults(cls: type, *args: Any) -> dict[str, Any]:
    return cls([nn.Parameter(torch.zeros(1))], *args).defaults


def test_torch_optimizer_defaults_are_those_the_rows_contrast_with_keras():
    assert "torch's `lr` 1e-3" in row("`tf.keras.optimizers.SGD()`")
    assert defaults(torch.optim.SGD)["lr"] == 1e-3
    adam = defaults(torch.optim.Adam)
    assert "torch's `eps` 1e-8" in row("`tf.keras.optimizers.Adam()`")
    assert (adam["lr"], adam["betas"], adam["eps"]) == (1e-3, (0.9, 0.999), 1e-8)
    rmsprop = defaults(torch.optim.RMSprop)
    assert "torch's `alpha` 0.99; `epsilon` 1e-7 against 1e-8" in row("`tf.keras.optimizers.RMSprop(")
    assert "torch's `lr` 0.01" in row("`tf.keras.optimizers.RMSprop(")
    assert (rmsprop["alpha"], rmsprop["eps"], rmsprop["lr"]) == (0.99, 1e-8, 0.01)
    adagrad = defaults(torch.optim.Adagrad)
    assert "accumulator at 0.1 (torch 0)" in row("`tf.keras.optimizers.Adagrad(") and "(torch 1e-10)" in row(
        "`tf.keras.optimizers.Adagrad("
    )
    assert (adagrad["initial_accumulator_value"], adagrad["eps"], adagrad["lr"]) == (0, 1e-10, 0.01)


def test_distrib_train_uses_keras_adam_epsilon():
    assert "`distrib train` spells Keras' value" in row("`tf.keras.optimizers.Adam()`")
    assert fashion_mnist_optimizer(nn.Linear(2, 2).parameters()).defaults["eps"] == 1e-7


def one_step(
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], grads: list[torch.Tensor], start: torch.Tensor
) -> torch.Tensor:
    p = nn.Parameter(start.clone())
    opt = optimizer([p])
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def test_the_adagrad_mapping_is_keras_adagrad_update():
    assert "`torch.optim.Adagrad(params, lr=0.05, initial_accumulator_value=0.1, eps=1e-7)`" in row(
        "`tf.keras.optimizers.Adagrad("
    )
    start = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    grads = [torch.tensor([0.3, -0.1, 2.0], dtype=torch.float64), torch.tensor([-0.2, 0.4, 1e-3], dtype=torch.float64)]
    ours = one_step(lambda ps: torch.optim.Adagrad(ps, lr=0.05, initial_accumulator_value=0.1, eps=1e-7), grads, start)
    # Keras' Adagrad: accumulator starts at 0.1; accumulator += g**2; var -= lr * g / (sqrt(accumulator) + epsilon)
    var, acc = start.clone(), torch.full_like(start, 0.1)
    for g in grads:
        acc += g**2
        var -= 0.05 * g / (acc.sqrt() + 1e-7)
    torch.testing.assert_close(ours, var, rtol=1e-12, atol=1e-12)


def keras_adam(start: torch.Tensor, grads: list[torch.Tensor], lr: float = 1e-3, epsilon: float = 1e-7) -> torch.Tensor:
    """Keras' Adam: ``alpha = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)``,
    ``var -= alpha * m / (sqrt(v) + epsilon)``."""
    var, m, v = start.clone(), torch.zeros_like(start), torch.zeros_like(start)
    for t, g in enumerate(grads, 1):
        m += (g - m) * (1 - 0.9)
        v += (g * g - v) * (1 - 0.999)
        var -= lr * math.sqrt(1 - 0.999**t) / (1 - 0.9**t) * m / (v.sqrt() + epsilon)
    return var


def test_the_adam_mapping_is_keras_adam_except_where_sqrt_v_is_near_epsilon():
    text = row("`tf.keras.optimizers.Adam()`")
    assert "`torch.optim.Adam(params, lr=1e-3, eps=1e-7)`" in text and '"epsilon hat"' in text
    start = torch.zeros(2, dtype=torch.float64)
    ordinary = [torch.tensor([0.5, -1.5], dtype=torch.float64)] * 3
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-3, eps=1e-7)  # noqa: E731
    torch.testing.assert_close(one_step(adam, ordinary, start), keras_adam(start, ordinary), rtol=1e-5, atol=0)
    tiny = [torch.tensor([1e-8, -1e-8], dtype=torch.float64)]  # sqrt(v) ~ 3e-10 after the first step
    ours, keras = one_step(adam, tiny, start), keras_adam(start, tiny)
    assert (ours.abs() > 2 * keras.abs()).all()  # eps after the bias correction: a step many times Keras'


# -- signatures whose defaults a row copies from TF ----------------------------------------------------------


def call_parameters(call: str) -> dict[str, Any]:
    """``name(a, b=1, *, c="x")`` as ``{"a": inspect.Parameter.empty, "b": 1, "c": "x"}``; a default that is
    not a literal (``rank=r``) maps to ``...``."""
    node = ast.parse(call.replace("*, ", ""), mode="eval").body
    assert isinstance(node, ast.Call), call
    params: dict[str, Any] = {}
    for arg in node.args:
        assert isinstance(arg, ast.Name), call
        params[arg.id] = inspect.Parameter.empty
    for kw in node.keywords:
        try:
            params[str(kw.arg)] = ast.literal_eval(kw.value)
        except ValueError:
            params[str(kw.arg)] = ...
    return params


# (the row's first cell, the call in that row that states the signature, distrib's callable)
SIGNATURES: list[tuple[str, str, Callable[..., Any]]] = [
    ("`tf.keras.callbacks.ModelCheckpoint(", "tf.keras.callbacks.ModelCheckpoint(", ds.callbacks.ModelCheckpoint),
    ("`tf.keras.callbacks.BackupAndRestore(", "tf.keras.callbacks.BackupAndRestore(", ds.callbacks.BackupAndRestore),
    ("`tf.keras.callbacks.CSVLogger(", "tf.keras.callbacks.CSVLogger(", ds.callbacks.CSVLogger),
    (
        "`tf.keras.callbacks.LearningRateScheduler(",
        "tf.keras.callbacks.LearningRateScheduler(",
        ds.callbacks.LearningRateScheduler,
    ),
    ("`tf.train.checkpoints_iterator(", "tf.train.checkpoints_iterator(", ds.checkpoints_iterator),
    (
        "`SimpleClusterResolver(",
        "ds.cluster_resolver.SimpleClusterResolver(",
        ds.cluster_resolver.SimpleClusterResolver,
    ),
    ("DDP `powerSGD_hook.PowerSGDState(", "ds.PowerSGD(", ds.PowerSGD),
    ("`tf.distribute.experimental.CommunicationOptions(...)` |", "ds.CommunicationOptions(", ds.CommunicationOptions),
    ("a barrier", "strategy.barrier(", ds.MirroredStrategy.barrier),
    ("`tf.distribute.Server(cluster, job_name, task_index)`", "ds.Server(", ds.Server),
    ("a hung worker", "ClusterCoordinator(", ds.coordinator.ClusterCoordinator.__init__),
    ("`tf.keras.callbacks.CSVLogger` / a metrics file", "ds.callbacks.JsonlLogger(", ds.callbacks.JsonlLogger),
    ("an in-process cluster", "ds.testing.create_in_process_cluster(", ds.testing.create_in_process_cluster),
    (
        "`tf.distribute.experimental.PreemptionCheckpointHandler(",
        "ds.experimental.PreemptionCheckpointHandler(",
        ds.experimental.PreemptionCheckpointHandler,
    ),
    (
        "`tf.distribute.experimental.TerminationConfig(",
        "ds.experimental.TerminationConfig(",
        ds.experimental.TerminationConfig,
    ),
]


@pytest.mark.parametrize("first_cell, call, target", SIGNATURES, ids=[c.rstrip("(") for _, c, _ in SIGNATURES])
def test_the_signature_a_row_states_is_distribs(first_cell, call, target):
    found = re.search("`(" + re.escape(call) + r"[^`]*\))`", row(first_cell))
    assert found, f"the row {first_cell!r} no longer spells `{call}...)`"
    params = inspect.signature(target).parameters
    for name, default in call_parameters("f(" + found.group(1)[len(call) :]).items():
        assert name in params, f"{found.group(1)}: distrib's {target.__qualname__} has no parameter {name!r}"
        if default is not inspect.Parameter.empty and default is not ...:
            assert params[name].default == default, (
                f"{found.group(1)}: distrib's {name} defaults to {params[name].default!r}"
            )


def test_communication_options_defaults_and_spellings():
    assert "`timeout_seconds=None`, the default, means 300 s" in row(
        "`tf.distribute.experimental.CommunicationOptions(...)` |"
    )
    assert "reads back as the lower-case string" in row("`tf.distribute.experimental.CommunicationImplementation")
    options = ds.CommunicationOptions()
    assert (options.timeout_seconds, options.timeout) == (None, 300.0)
    with pytest.raises(ValueError, match="timeout_seconds"):
        ds.CommunicationOptions(timeout_seconds=0)
    spellings = ["NCCL", "Ring", "gloo", ds.CommunicationImplementation.NCCL, ds.CommunicationImplementation.AUTO]
    assert [ds.CommunicationOptions(implementation=s).implementation for s in spellings] == [
        "nccl",
        "ring",
        "gloo",
        "nccl",
        "auto",
    ]


# -- metrics, reduce and input: the return forms the rows state ----------------------------------------------


def test_metric_results_state_and_default_names():
    text = row("`tf.keras.metrics.Mean/Sum/Accuracy/")
    assert "`result()` is a 0-d float32 CPU tensor" in text and "The state is float64 by default" in text
    expected = {
        "Mean": "mean",
        "Sum": "sum",
        "Accuracy": "accuracy",
        "BinaryAccuracy": "binary_accuracy",
        "CategoricalAccuracy": "categorical_accuracy",
        "SparseCategoricalAccuracy": "sparse_categorical_accuracy",
        "TopKCategoricalAccuracy": "top_k_categorical_accuracy",
        "SparseTopKCategoricalAccuracy": "sparse_top_k_categorical_accuracy",
    }
    for cls, name in expected.items():
        metric = getattr(ds.metrics, cls)()
        assert metric.name == name and metric.total.dtype == torch.float64, cls
    assert ds.metrics.BinaryAccuracy().threshold == 0.5 and ds.metrics.TopKCategoricalAccuracy().k == 5
    accuracy = ds.metrics.SparseCategoricalAccuracy()
    accuracy.update_state(torch.tensor([0, 1]), torch.tensor([[2.0, 1.0], [3.0, 0.0]]))
    result = accuracy.result()
    assert (result.dtype, result.shape, result.device.type, float(result)) == (torch.float32, (), "cpu", 0.5)
    per_example = ds.metrics.sparse_categorical_accuracy(torch.tensor([0, 1]), torch.tensor([[2.0, 1.0], [3.0, 0.0]]))
    assert per_example.dtype == torch.float64 and per_example.tolist() == [1.0, 0.0]


def test_reduce_of_a_python_number_and_the_uneven_split_the_rows_show():
    assert "returns `tensor(1.)`" in row('`strategy.reduce("SUM", 1., axis=None)`')
    assert repr(ds.get_strategy().reduce("SUM", 1.0, axis=None)) == "tensor(1.)"
    assert "| `[0, 1], [2], [3]` |" in row("rebatching: `range(8).batch(4)` over 3 replicas")
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    first = next(iter(strategy.experimental_distribute_dataset([torch.arange(4), torch.arange(4, 8)])))
    assert [v.tolist() for v in first.values] == [[0, 1], [2], [3]]


def test_tensor_batches_shuffle_is_a_function_of_seed_and_epoch():
    assert "`TensorBatches.set_epoch(e)` makes the order a function of (seed, epoch)" in row(
        "`dataset.shuffle(N).batch(B)`"
    )
    from distrib.app.train import TensorBatches

    x = torch.arange(10)

    def order(seed: int, epoch: int) -> list[list[int]]:
        batches = TensorBatches(x, x * 10, batch_size=4, shuffle=True, seed=seed)
        batches.set_epoch(epoch)
        return [b[0].tolist() for b in batches]

    first = order(0, 0)
    assert [len(b) for b in first] == [4, 4, 2] and sorted(sum(first, [])) == list(range(10))
    assert order(0, 0) == first  # every worker reads the same global batches
    assert order(0, 1) != first and order(1, 0) != first


def test_fit_and_evaluate_default_as_keras_where_the_rows_leave_them_out():
    """Keras' ``fit(epochs=1, steps_per_epoch=None, validation_data=None, validation_steps=None)`` and
    ``evaluate(steps=None)``: the seeds' ``model.fit(..., epochs, steps_per_epoch)`` row ports them as they are."""
    assert "`ds.fit(model, data, optimizer=..., loss=..., epochs, steps_per_epoch)`" in row(
        "`model.fit(dataset, epochs, steps_per_epoch)`"
    )
    fit = inspect.signature(ds.fit).parameters
    assert {n: fit[n].default for n in ("epochs", "steps_per_epoch", "validation_data", "validation_steps")} == {
        "epochs": 1,
        "steps_per_epoch": None,
        "validation_data": None,
        "validation_steps": None,
    }
    assert inspect.signature(ds.evaluate).parameters["steps"].default is None


# -- the Keras loop a port uses: evaluate's return form, verbose, the callback API ---------------------------


def _linear_fit_data() -> tuple[nn.Module, torch.optim.Optimizer, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    x = torch.randn(8, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), [(x[:4], x[:4, :1]), (x[4:], x[4:, :1])]


def test_evaluate_returns_what_its_rows_say():
    for first_cell in ("`loss, acc = model.evaluate(x)`", "`model.evaluate(dataset)`"):
        assert "list `[loss, *metrics]`" in row(first_cell) and "float" in row(first_cell)
    assert 'the dict `{"loss": ..., "accuracy": ...}` with `return_dict=True`' in row("`loss, acc = model.evaluate(x)`")
    evaluate = inspect.signature(ds.evaluate).parameters
    assert (evaluate["return_dict"].default, evaluate["verbose"].default) == (False, "auto")  # Keras' defaults
    model, _, data = _linear_fit_data()
    loss, mae = ds.evaluate(model, data, loss="mse", metrics=["mae"], verbose=0)
    assert type(loss) is float and type(mae) is float
    assert ds.evaluate(model, data, loss="mse", metrics=["mae"], return_dict=True, verbose=0) == {
        "loss": loss,
        "mae": mae,
    }
    assert ds.evaluate(model, data, loss="mse", verbose=0) == loss


def test_verbose_auto_shows_progress_on_a_worker_that_is_not_the_chief(capsys):
    assert "1, or 2 (one line per epoch) under ParameterServerStrategy, on every worker" in row(
        '`model.fit(verbose="auto")`'
    )
    from distrib import context
    from distrib.strategies import DefaultStrategy

    class NotChief(DefaultStrategy):  # what fit asks of the strategy: this process is not the chief
        is_chief = False

    model, optimizer, data = _linear_fit_data()
    context.set_owner(model, NotChief())
    ds.fit(model, data, optimizer=optimizer, loss="mse", epochs=2)
    out = capsys.readouterr().out
    assert "Epoch 2/2" in out and re.search(r"^2/2 - \S+ - loss: ", out, re.M), out


def test_a_custom_callback_reaches_the_optimizer_and_its_rate_as_its_row_says(capsys):
    text = row("a custom `tf.keras.callbacks.Callback`")
    assert "`self.learning_rate` (the first parameter group's rate, a float; assigning it sets every group's)" in text
    assert "`self.optimizer` (the `torch.optim.Optimizer` given to `ds.fit`)" in text

    class PrintLR(ds.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            assert self.optimizer is optimizer
            print(f"Learning rate for epoch {epoch + 1} is {self.learning_rate}")
            self.learning_rate = self.learning_rate / 10

    model, optimizer, data = _linear_fit_data()
    ds.fit(model, data, optimizer=optimizer, loss="mse", epochs=2, verbose=0, callbacks=[PrintLR()])
    assert capsys.readouterr().out.splitlines() == [
        "Learning rate for epoch 1 is 0.1",
        "Learning rate for epoch 2 is 0.01",
    ]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.001)


def test_every_hook_gets_a_dict_of_logs_and_model_stop_training_stops_as_the_rows_say():
    assert "each given a dict of logs as in Keras (`{}` before there is anything to log" in row(
        "a custom `tf.keras.callbacks.Callback`"
    )
    assert "`fit` reads too and sets back to False when a `fit` starts" in row("`self.model.stop_training = True`")

    class Keys(ds.callbacks.Callback):
        def __init__(self) -> None:
            self.seen: list[tuple[str, list[str]]] = []

        def on_train_begin(self, logs=None):
            self.seen.append(("train_begin", list(logs.keys())))

        def on_epoch_begin(self, epoch, logs=None):
            self.seen.append(("epoch_begin", list(logs.keys())))

        def on_epoch_end(self, epoch, logs=None):
            self.seen.append(("epoch_end", list(logs.keys())))
            self.model.stop_training = True  # Keras' spelling

    model, optimizer, data = _linear_fit_data()
    keys = Keys()
    history = ds.fit(model, data, optimizer=optimizer, loss="mse", epochs=5, verbose=0, callbacks=[keys])
    assert history.epoch == [0]
    assert keys.seen == [("train_begin", []), ("epoch_begin", []), ("epoch_end", ["loss"])]
    assert model.stop_training is True  # left set, as Keras leaves it; the next fit starts afresh
    assert ds.fit(model, data, optimizer=optimizer, loss="mse", epochs=2, verbose=0).epoch == [0, 1]


def test_keras_arrays_form_is_refused_and_older_batch_hooks_are_called_as_the_rows_say():
    assert "is a ValueError naming the fix (`[(x_val, y_val)]`" in row("`model.fit(x_array, y_array")
    assert "Keras' older `on_batch_begin`/`on_batch_end` too" in row("a custom `tf.keras.callbacks.Callback`")
    model, optimizer, data = _linear_fit_data()
    ((x, y),) = data[:1]
    for kwargs in ({"validation_data": (x, y)}, {}):
        with pytest.raises(ValueError, match=r"looks like Keras' arrays form .*Give \[\(x, y\)\] for one batch"):
            ds.fit(model, data if kwargs else (x, y), optimizer=optimizer, loss="mse", verbose=0, **kwargs)
    with pytest.raises(ValueError, match="looks like Keras' arrays form"):
        ds.evaluate(model, (x, y), loss="mse", verbose=0)

    class Older(ds.callbacks.Callback):
        def __init__(self) -> None:
            self.calls: list[str] = []

        def on_batch_begin(self, batch, logs=None):
            self.calls.append(f"begin {batch}")

        def on_batch_end(self, batch, logs=None):
            self.calls.append(f"end {batch} {sorted(logs)}")

    older = Older()
    ds.fit(model, data, optimizer=optimizer, loss="mse", verbose=0, callbacks=[older])
    assert older.calls == ["begin 0", "end 0 ['loss']", "begin 1", "end 1 ['loss']"]


def test_the_checkpoint_guide_rows_read_a_file_with_torch_load_and_refuse_an_iterator(tmp_path):
    assert '`torch.load(path + ".pt", weights_only=True)["objects"]`' in row("`tf.train.load_checkpoint(path)`")
    assert "passing one is a `TypeError`" in row("`tf.train.Checkpoint(..., iterator=iter(dataset))`")
    assert "`Checkpoint` inside a `Checkpoint` is a `TypeError`" in row("nested `tf.train.Checkpoint(")
    net = nn.Sequential()
    net.l1 = nn.Linear(1, 5)
    opt = torch.optim.Adam(net.parameters(), 0.1)
    manager = ds.CheckpointManager(ds.Checkpoint(step=torch.tensor(1), optimizer=opt, net=net), tmp_path)
    path = manager.save()
    objects = torch.load(path + ".pt", weights_only=True)["objects"]
    assert sorted(objects) == ["net", "optimizer", "step"] and sorted(objects["net"]) == ["l1.bias", "l1.weight"]
    torch.testing.assert_close(objects["net"]["l1.bias"], net.l1.bias.detach())
    with pytest.raises(TypeError, match="'iterator' has type list_iterator, which cannot be checkpointed"):
        ds.Checkpoint(net=net, iterator=iter([1, 2]))
    with pytest.raises(TypeError, match="'l1' has type Checkpoint, which cannot be checkpointed"):
        ds.Checkpoint(net=ds.Checkpoint(l1=ds.Checkpoint(bias=torch.zeros(5))))
