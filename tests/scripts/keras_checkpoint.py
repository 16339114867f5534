"""TF's custom loop with a Keras 3 model and optimizer, checkpointed with ds.Checkpoint, for the resume tests.

    distrib launch --workers 2 tests/scripts/keras_checkpoint.py --strategy multi-worker --until 6 --dir D --out OUT

Builds keras_custom_loop.py's model, loss and optimizer in the strategy's scope, tracks them in
``ds.Checkpoint(model=..., optimizer=..., step=...)`` (the tutorial's ``tf.train.Checkpoint``), restores D's latest
checkpoint if there is one (a run saved under another strategy or number of workers), trains the seeded global batches
from the restored step up to ``--until``, then saves into D. ``--preempt-at K`` instead runs every step through
``ds.experimental.PreemptionCheckpointHandler`` and sends this process SIGTERM before step K: the handler saves
and exits 42, the launcher restarts the group (``DISTRIB_RESTART=1``), whose handler resumes from that checkpoint. The chief writes the model's trainable variables and the
optimizer's variables to OUT; ``train`` is importable for in-process strategies.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import torch  # noqa: E402
from keras_custom_loop import GLOBAL_BATCH, _nothing, create_model, global_batches, make_strategy  # noqa: E402

import distrib as ds  # noqa: E402

STEPS = 12


def train(
    strategy: ds.Strategy | None, optimizer_kind: str, until: int, directory: str | None, preempt_at: int | None = None
) -> dict[str, object]:
    """Restore ``directory``'s latest checkpoint (if any), train up to step ``until``, save there; the final state."""
    keras.utils.clear_session()  # the model's variable paths as in a fresh process (they hold the layers' names)
    with strategy.scope() if strategy is not None else _nothing():
        model = create_model()
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
        if optimizer_kind == "keras":
            optimizer = keras.optimizers.Adam(learning_rate=1e-2)
        else:
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = torch.zeros((), dtype=torch.int64)
    checkpoint = ds.Checkpoint(optimizer=optimizer, model=model, step=step)

    def train_step(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = ds.compute_average_loss(loss_object(labels, model(images)), global_batch_size=GLOBAL_BATCH)
        model.zero_grad()
        loss.backward()
        if optimizer_kind == "keras":
            trainable_weights = model.trainable_weights
            with torch.no_grad():
                optimizer.apply([v.value.grad for v in trainable_weights], trainable_weights)
        else:
            optimizer.step()
        return loss

    workers = strategy.num_workers if strategy is not None else 1
    worker = strategy.worker_index if strategy is not None else 0
    replicas = strategy.num_local_replicas if strategy is not None else 1

    def distributed_step(images: torch.Tensor, labels: torch.Tensor) -> None:
        rows = slice(worker * GLOBAL_BATCH // workers, (worker + 1) * GLOBAL_BATCH // workers)
        images, labels = images[rows], labels[rows]
        if strategy is None:
            train_step(images, labels)
            return
        if replicas > 1:
            images, labels = ds.PerReplica(tuple(images.chunk(replicas))), ds.PerReplica(tuple(labels.chunk(replicas)))
        strategy.run(train_step, args=(images, labels))

    batches = global_batches(STEPS)
    if preempt_at is not None:
        assert directory is not None and strategy is not None
        handler = ds.experimental.PreemptionCheckpointHandler(strategy.cluster_resolver, checkpoint, directory)
        print(f"START worker={strategy.worker_index} run={handler.total_run_calls}", flush=True)
        for k in range(handler.total_run_calls, until):
            if k == preempt_at and strategy.is_chief and os.environ.get("DISTRIB_RESTART", "0") == "0":
                os.kill(os.getpid(), signal.SIGTERM)  # the notice; the handler saves at an agreed step and exits 42
            handler.run(distributed_step, *batches[k])
        handler.close()
    else:
        latest = ds.latest_checkpoint(directory) if directory is not None else None
        if latest is not None:
            checkpoint.restore(latest).assert_consumed()
        for k in range(int(step), until):
            distributed_step(*batches[k])
            step.fill_(k + 1)
        if directory is not None:
            checkpoint.save(os.path.join(directory, "ckpt"))
    optimizer_state = (
        [v.value.detach().clone() for v in optimizer.variables]
        if optimizer_kind == "keras"
        else [t.clone() for s in optimizer.state_dict()["state"].values() for t in s.values()]
    )
    return {"weights": [v.value.detach().clone() for v in model.trainable_weights], "optimizer": optimizer_state}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="multi-worker")
    p.add_argument("--optimizer", choices=["keras", "torch"], default="keras")
    p.add_argument("--until", type=int, default=STEPS)
    p.add_argument("--dir", required=True)
    p.add_argument("--preempt-at", type=int, default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    strategy = make_strategy(args.strategy)
    result = train(strategy, args.optimizer, args.until, args.dir, args.preempt_at)
    if strategy is None or strategy.is_chief:
        torch.save(result, args.out)
