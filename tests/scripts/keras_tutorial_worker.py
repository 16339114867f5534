"""TF's "Multi-worker training with Keras" and "Custom training loop with Keras and MultiWorkerMirroredStrategy"
tutorials (tensorflow/docs site/en/tutorials/distribute/multi_worker_with_keras.ipynb, multi_worker_with_ctl.ipynb),
ported line by line as a TF user would: main.py's fit, then both tutorials' chief-only saving with the
non-chief's temporary directories and their cleanup, kept as the tutorials write them.

    distrib launch --workers 2 tests/scripts/keras_tutorial_worker.py WORK_DIR [STEPS_PER_EPOCH]

The tutorials' paths (/tmp/keras-model, /tmp/ckpt, util.get_temp_dir()) are under WORK_DIR; MNIST is replaced
by random images of its shape, so that the run needs no data. Each save prints the path it returned and
whether it exists on this worker; the script ends with "DONE".
"""

import json
import os
import shutil
import sys

import torch
from torch import nn

import distrib as ds
from distrib.app.train import TensorBatches

work = sys.argv[1]
steps_per_epoch = int(sys.argv[2]) if len(sys.argv) > 2 else 70


# --- mnist_setup.py -------------------------------------------------------------------------------
def mnist_dataset(batch_size):
    g = torch.Generator().manual_seed(0)  # tf.keras.datasets.mnist.load_data(), / 255, int64 labels
    x_train = torch.rand(1024, 28, 28, generator=g)
    y_train = torch.randint(0, 10, (1024,), generator=g)
    # from_tensor_slices((x, y)).shuffle(60000).repeat().batch(batch_size): seeded, read again every epoch
    return TensorBatches(x_train, y_train, batch_size=batch_size, shuffle=True, seed=0)


def build_and_compile_cnn_model():
    model = nn.Sequential(
        nn.Unflatten(1, (1, 28)),  # InputLayer(input_shape=(28, 28)), Reshape(target_shape=(28, 28, 1)): channels first
        nn.Conv2d(1, 32, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 26 * 26, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )
    # compile(loss=SparseCategoricalCrossentropy(from_logits=True), optimizer=SGD(learning_rate=0.001), ["accuracy"])
    return model, torch.optim.SGD(model.parameters(), lr=0.001)


# --- main.py ---------------------------------------------------------------------------------------
per_worker_batch_size = 64
tf_config = json.loads(os.environ["TF_CONFIG"])
num_workers = len(tf_config["cluster"]["worker"])

strategy = ds.MultiWorkerMirroredStrategy()

global_batch_size = per_worker_batch_size * num_workers
multi_worker_dataset = mnist_dataset(global_batch_size)

with strategy.scope():
    # Model building/compiling need to be within `strategy.scope()`.
    multi_worker_model, optimizer = build_and_compile_cnn_model()

ds.fit(
    multi_worker_model,
    multi_worker_dataset,
    optimizer=optimizer,
    loss="sparse_categorical_crossentropy",
    metrics=["accuracy"],
    epochs=3,
    steps_per_epoch=steps_per_epoch,
)


# --- "Model saving and loading" ---------------------------------------------------------------------
model_path = os.path.join(work, "keras-model")


def _is_chief(task_type, task_id):
    return (task_type == "worker" and task_id == 0) or task_type is None


def _get_temp_dir(dirpath, task_id):
    base_dirpath = "workertemp_" + str(task_id)
    temp_dir = os.path.join(dirpath, base_dirpath)
    os.makedirs(temp_dir, exist_ok=True)  # tf.io.gfile.makedirs(temp_dir)
    return temp_dir


def write_filepath(filepath, task_type, task_id):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not _is_chief(task_type, task_id):
        dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


task_type, task_id = (strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id)
write_model_path = write_filepath(model_path, task_type, task_id)

saved = ds.Checkpoint(model=multi_worker_model).write(write_model_path)  # multi_worker_model.save(write_model_path)
print(f"model saved {saved} exists={os.path.isfile(saved + '.pt')}", flush=True)

if not _is_chief(task_type, task_id):
    shutil.rmtree(os.path.dirname(write_model_path))  # tf.io.gfile.rmtree

loaded_model, _ = build_and_compile_cnn_model()  # tf.keras.models.load_model(model_path)
ds.Checkpoint(model=loaded_model).read(model_path)
same = all(
    torch.equal(a, b) for a, b in zip(loaded_model.state_dict().values(), multi_worker_model.state_dict().values())
)
print(f"loaded the chief's model: same={same}", flush=True)

# --- "Checkpoint saving and restoring" -------------------------------------------------------------
checkpoint_dir = os.path.join(work, "ckpt")
checkpoint = ds.Checkpoint(model=multi_worker_model)
write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id)
checkpoint_manager = ds.CheckpointManager(checkpoint, directory=write_checkpoint_dir, max_to_keep=1)

saved = checkpoint_manager.save()
print(f"manager saved {saved} exists={os.path.isfile(saved + '.pt')}", flush=True)
if not _is_chief(task_type, task_id):
    shutil.rmtree(write_checkpoint_dir)  # tf.io.gfile.rmtree

latest_checkpoint = ds.latest_checkpoint(checkpoint_dir)
checkpoint.restore(latest_checkpoint)
ds.fit(
    multi_worker_model,
    multi_worker_dataset,
    optimizer=optimizer,
    loss="sparse_categorical_crossentropy",
    metrics=["accuracy"],
    epochs=2,
    steps_per_epoch=steps_per_epoch,
)


# --- multi_worker_with_ctl: a CheckpointManager per worker, saved and cleaned up every epoch ---------
def _is_chief_ctl(task_type, task_id, cluster_spec):
    return (
        task_type is None
        or task_type == "chief"
        or (task_type == "worker" and task_id == 0 and "chief" not in cluster_spec.as_dict())
    )


def write_filepath_ctl(filepath, task_type, task_id, cluster_spec):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not _is_chief_ctl(task_type, task_id, cluster_spec):
        dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


epoch = torch.tensor(0)
step_in_epoch = torch.tensor(0)
cluster_spec = ds.ClusterSpec(tf_config["cluster"])
ctl_dir = os.path.join(work, "ctl", "ckpt")  # os.path.join(util.get_temp_dir(), 'ckpt')
checkpoint = ds.Checkpoint(model=multi_worker_model, epoch=epoch, step_in_epoch=step_in_epoch)
write_checkpoint_dir = write_filepath_ctl(ctl_dir, task_type, task_id, cluster_spec)
checkpoint_manager = ds.CheckpointManager(checkpoint, directory=write_checkpoint_dir, max_to_keep=1)

latest_checkpoint = ds.latest_checkpoint(ctl_dir)
if latest_checkpoint:
    checkpoint.restore(latest_checkpoint)

while int(epoch) < 2:
    step_in_epoch.fill_(steps_per_epoch)  # the tutorial's train_step loop (fit above trained the model)
    saved = checkpoint_manager.save()
    print(f"epoch {int(epoch)} saved {saved} exists={os.path.isfile(saved + '.pt')}", flush=True)
    if not _is_chief_ctl(task_type, task_id, cluster_spec):
        shutil.rmtree(write_checkpoint_dir)  # tf.io.gfile.rmtree
    epoch += 1
    step_in_epoch.zero_()

print("DONE", flush=True)
