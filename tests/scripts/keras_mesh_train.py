"""A Keras 3 model (Dense layers, torch backend) trained under ds.experimental.keras_distribution, against one process.

Run by ``distrib launch --workers N``. --mode model_parallel: Keras' ModelParallel on a (N/2, 2) mesh
("batch", "model"; one worker: (1, 1)), the layout map as keras.io's distribution guide writes it (the first Dense's kernel
split over its outputs, ``(None, "model")``, its bias too; the second Dense's kernel over its inputs,
``("model", None)``; the last Dense replicated). --mode data_parallel: Keras' DataParallel on a (N,) mesh.
--keys unanchored writes the layout map's keys without
the model's name in front (``"dense_up.*kernel"``), which match no variable path. --optimizer torch (torch.optim.Adam over model.parameters()) or keras (keras.optimizers.Adam, applied to the
gradients as Keras' guide for custom loops on the torch backend writes it).

Each worker builds the model in the strategy's scope from the same Keras seed, trains --steps steps on the
global batches (the loss: Keras' SparseCategoricalCrossentropy with reduction=None, averaged over the global
batch by ds.compute_average_loss), and the chief also trains the same model in one process on each whole
global batch. The chief writes to --out (JSON): the largest difference of any variable, the losses of both,
each worker's local shape of the first kernel and whether its local part equals the matching columns of the
initial kernel (Keras' ``(in, out)`` orientation: the outputs are the columns). --outside: one backward outside strategy.run instead of training (the chief writes its error).
--checkpoint DIR then saves the
trained model with ds.Checkpoint and restores it into a model built again in the scope (laid out the same way) and,
on the chief, into a plain one-process model, writing the largest difference of each to the trained variables.
"""

import argparse
import json
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import torch  # noqa: E402

import distrib as ds  # noqa: E402
from distrib.integrations import keras_distribution as kdist  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--mode", choices=["model_parallel", "data_parallel"], default="model_parallel")
p.add_argument("--optimizer", choices=["torch", "keras"], default="torch")
p.add_argument("--steps", type=int, default=20)
p.add_argument("--outside", action="store_true", help="one backward outside strategy.run: write its error and stop")
p.add_argument("--checkpoint", default="", help="a directory: save, then restore into a laid-out and a plain model")
p.add_argument("--keys", choices=["matching", "unanchored"], default="matching")
args = p.parse_args()

IN, HIDDEN, CLASSES, GLOBAL, LR, SEED = 12, 16, 5, 8, 1e-2, 7
world = int(os.environ.get("WORLD_SIZE", "1"))
chief = int(os.environ.get("RANK", "0")) == 0


def build() -> keras.Model:
    keras.utils.set_random_seed(SEED)
    return keras.Sequential(
        [
            keras.Input((IN,)),
            keras.layers.Dense(HIDDEN, activation="relu", name="dense_up"),
            keras.layers.Dense(HIDDEN, activation="tanh", name="dense_down"),
            keras.layers.Dense(CLASSES, name="head"),
        ],
        name="mlp",
    )


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(GLOBAL, IN, generator=g), torch.randint(0, CLASSES, (GLOBAL,), generator=g))
        for _ in range(args.steps)
    ]


loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def make_optimizer(model: keras.Model) -> object:
    if args.optimizer == "torch":
        return torch.optim.Adam(model.parameters(), lr=LR)
    optimizer = keras.optimizers.Adam(learning_rate=LR)
    optimizer.build(model.trainable_variables)
    return optimizer


def apply(optimizer: object, model: keras.Model) -> None:
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer.step()
        optimizer.zero_grad()
    else:  # Keras' guide for custom loops on torch: the gradients from autograd, then optimizer.apply
        variables = model.trainable_variables
        optimizer.apply([v.value.grad for v in variables], variables)
        model.zero_grad()


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def reference() -> dict[str, object]:
    model = build()
    initial = {v.path: whole(v.value).detach().clone() for v in model.weights}
    optimizer = make_optimizer(model)
    losses = []
    for x, y in batches():
        loss = loss_object(y, model(x)).mean()
        loss.backward()
        apply(optimizer, model)
        losses.append(float(loss.detach()))
    return {"initial": initial, "final": {v.path: v.value.detach().clone() for v in model.weights}, "losses": losses}


ref = reference() if chief else {}
if args.mode == "model_parallel":
    tp = 2 if world > 1 else 1  # one worker: a 1 x 1 mesh, laid out all the same
    mesh = keras.distribution.DeviceMesh((world // tp, tp), ["batch", "model"], devices=kdist.list_devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    # --keys unanchored: keys without the model's prefix, which Keras' whole-path match never takes
    prefix = ".*" if args.keys == "matching" else ""
    layout_map[prefix + "dense_up.*kernel"] = (None, "model")  # Keras' (in, out): the outputs split
    layout_map[prefix + "dense_up.*bias"] = ("model",)
    layout_map[prefix + "dense_down.*kernel"] = ("model", None)  # the inputs split
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
else:
    mesh = keras.distribution.DeviceMesh((world,), ["batch"], devices=kdist.list_devices())
    distribution = keras.distribution.DataParallel(device_mesh=mesh)

strategy = ds.experimental.keras_distribution(distribution, devices=["cpu"])
with strategy.scope():
    model = build()
    optimizer = make_optimizer(model)


if args.outside:  # Keras' own fit would do this: a backward on each worker's whole batch, outside strategy.run
    x, y = batches()[0]
    try:
        loss_object(y, model(x)).mean().backward()
        outcome = "no error"
    except RuntimeError as e:
        outcome = str(e)
    if chief:
        with open(args.out, "w") as f:
            json.dump({"outside": outcome}, f)
    raise SystemExit(0)


def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    per_example = loss_object(y, model(x))
    loss = ds.compute_average_loss(per_example, global_batch_size=GLOBAL)
    loss.backward()
    apply(optimizer, model)
    return loss


losses = []
for x, y in strategy.experimental_distribute_dataset(batches()):
    losses.append(float(strategy.reduce("sum", strategy.run(step, args=(x, y)), axis=None)))

up = next(v for v in model.weights if v.path.endswith("dense_up/kernel"))
local = up.value.to_local() if hasattr(up.value, "to_local") else up.value
coords = strategy.device_mesh.coordinate(strategy.worker_index)
final = {v.path: whole(v.value).detach() for v in model.weights}  # full_tensor: a collective on every worker
shapes = strategy.communicator.all_gather_object([list(local.shape), coords.get("model", 0)])


def zeroed(m: keras.Model) -> keras.Model:
    with torch.no_grad():
        for v in m.weights:
            v.value.zero_()
    return m


restored: dict[str, float] = {}
if args.checkpoint:  # ds.Checkpoint of the laid-out model, restored into another one in the scope and a plain one
    path = ds.Checkpoint(model=model).save(os.path.join(args.checkpoint, "ckpt"))
    with strategy.scope():
        again = build()
    ds.Checkpoint(model=zeroed(again)).restore(path)
    back = {v.path: whole(v.value).detach() for v in again.weights}
    restored["laid_out"] = max(float((back[p] - final[p]).abs().max()) for p in back)
    if chief:
        plain = zeroed(build())
        ds.Checkpoint(model=plain).read(path)
        restored["plain"] = max(float((v.value.detach() - final[v.path]).abs().max()) for v in plain.weights)
if chief:
    initial_up = ref["initial"][up.path]
    width = shapes[0][0][1]
    # the local part each worker held after training is not the initial one; check the orientation on the shapes and
    # on the values: the workers' parts side by side along the columns are the whole trained kernel
    diffs = {path: float((final[path] - ref["final"][path]).abs().max()) for path in final}
    result = {
        "max_diff": max(diffs.values()),
        "diffs": diffs,
        "losses": losses,
        "ref_losses": ref["losses"],
        "local_shapes": [s for s, _ in shapes],
        "kernel_shape": list(initial_up.shape),
        "chief_part_is_columns": bool(torch.equal(local.detach(), final[up.path][:, :width])),
        "param_types": sorted({type(v.value).__name__ for v in model.weights}),
        "restored": restored,
    }
    with open(args.out, "w") as f:
        json.dump(result, f)
