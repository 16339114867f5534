"""Parameter-server workers compute on their GPU (issue 28, item 4), as TF's workers place their ops on theirs.

One worker (so that the order of the updates is fixed) trains a model with a BatchNorm (buffers travel by
value), a sparse embedding (the ps answers with changed rows) and Adagrad for 12 scheduled steps, once on
the checked device and once on the CPU: the batches, the variables' copies and the step run on the device,
and the losses and the parameters match the CPU run's. Under ``DISTRIB_CHECK_DEVICE=cpu`` both runs are on
the CPU (the dry run proves the path, not the GPU).
"""

from __future__ import annotations

import sys

import cloudpickle
import torch
import torch.nn.functional as F
from torch import nn

import distrib as ds

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # scheduled functions travel by value

STEPS = 12


def _dataset_fn(input_context):
    g = torch.Generator().manual_seed(1 + input_context.input_pipeline_id)
    while True:
        x = torch.randn(16, 8, generator=g)
        yield torch.randint(0, 10, (16,), generator=g), x, x[:, :4].argmax(1)  # learnable: the largest of 4


def _train(worker_device: str) -> tuple[list[float], list[str], list[torch.Tensor]]:
    resolver = ds.testing.create_in_process_cluster(num_workers=1, num_ps=1, worker_device=worker_device)
    try:
        strategy = ds.ParameterServerStrategy(resolver)
        torch.manual_seed(0)
        with strategy.scope():
            embedding = nn.Embedding(10, 8, sparse=True)
            # no bias before the BatchNorm: its gradient is 0 up to rounding, whose sign Adagrad's normalised
            # step turns into +-lr, differently on each device (measured: 0.19 apart after one step)
            model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
            optimizer = torch.optim.Adagrad([*embedding.parameters(), *model.parameters()], lr=0.1)
        coordinator = ds.coordinator.ClusterCoordinator(strategy)
        iterator = iter(coordinator.create_per_worker_dataset(_dataset_fn))

        def replica_fn(ids, x, y):
            h = x + embedding(ids)
            loss = ds.compute_average_loss(F.cross_entropy(model(h), y, reduction="none"))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss, f"{h.device} {next(model.parameters()).device}"

        def step(it):
            ids, x, y = next(it)
            return strategy.run(replica_fn, args=(ids, x, y))

        results = [coordinator.schedule(step, args=(iterator,)) for _ in range(STEPS)]
        coordinator.join()
        fetched = [r.fetch() for r in results]
        params = coordinator.schedule(lambda: [p.detach() for p in [*embedding.parameters(), *model.parameters()]])
        return [float(loss) for loss, _ in fetched], [where for _, where in fetched], params.fetch()
    finally:
        ds.testing.stop_in_process_cluster(resolver)


def test_a_worker_computes_on_its_device_and_trains_as_on_the_cpu(device):
    losses, where, params = _train(str(device))
    expected = "cuda:0 cuda:0" if device.type == "cuda" else "cpu cpu"
    assert set(where) == {expected}, where  # the batch and the variables' copies were on the device
    cpu_losses, cpu_where, cpu_params = _train("cpu")
    assert set(cpu_where) == {"cpu cpu"}
    assert max(abs(a - b) for a, b in zip(losses, cpu_losses)) < 1e-5, (losses, cpu_losses)
    assert sum(losses[-3:]) < sum(losses[:3])  # it learns
    assert all(p.device.type == "cpu" for p in params)  # results come back to the coordinator's host
    assert max(float((a - b).abs().max()) for a, b in zip(params, cpu_params)) < 1e-5
