"""Every ds.metrics metric on several workers, built inside the scope and OUTSIDE it (issue 10, A.5).

    distrib launch --workers 2 tests/scripts/metric_outside_scope.py [--local-replicas 2]

Every worker reads the same global batches through ``experimental_distribute_dataset`` (sizes 8,
8 and 3: the last one leaves a replica an empty batch when there are 4), so each replica sees only
its share. For every metric class, one metric built under the scope and one built before it are
updated inside ``strategy.run``; a third, plain one is fed the whole global batches. Prints on every
worker one line per metric, ``METRIC <name> inside=... outside=... expected=...``, then the same
mistake through fit (``FIT mae=... expected=...``: a metric object built outside the scope given to
``ds.fit(metrics=[...])``), then ``ALL OK`` when every value matches, or ``MISMATCH`` lines.
"""

import argparse

import torch

import distrib as ds

p = argparse.ArgumentParser()
p.add_argument("--local-replicas", type=int, default=1)
args = p.parse_args()

strategy = ds.MultiWorkerMirroredStrategy(
    devices=[f"cpu:{i}" for i in range(args.local_replicas)],
    communication_options=ds.CommunicationOptions(timeout_seconds=60),
)
M = ds.metrics
FACTORIES = {
    "accuracy": M.Accuracy,
    "binary_accuracy": lambda: M.BinaryAccuracy(threshold=0.4),
    "categorical_accuracy": M.CategoricalAccuracy,
    "sparse_categorical_accuracy": M.SparseCategoricalAccuracy,
    "top_k_categorical_accuracy": lambda: M.TopKCategoricalAccuracy(k=2),
    "sparse_top_k_categorical_accuracy": lambda: M.SparseTopKCategoricalAccuracy(k=2),
    "mean": M.Mean,
    "sum": M.Sum,
}
outside = {name: make() for name, make in FACTORIES.items()}  # built before the scope: the mistake of A.5
expected = {name: make() for name, make in FACTORIES.items()}  # plain: fed the whole global batches
with strategy.scope():
    inside = {name: make() for name, make in FACTORIES.items()}


def batch(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, 4, generator=g)
    labels = torch.randint(0, 4, (n,), generator=g)
    return {
        "scores": scores,
        "labels": labels,
        "one_hot": torch.nn.functional.one_hot(labels, 4),
        "exact": torch.randint(0, 3, (n, 1), generator=g),
        "guess": torch.randint(0, 3, (n, 1), generator=g),
        "binary": (torch.rand(n, 1, generator=g) > 0.5).float(),
        "prob": torch.rand(n, 1, generator=g),
        "values": torch.randn(n, generator=g),
        "weights": torch.rand(n, generator=g),
    }


def inputs(b: dict[str, torch.Tensor], name: str) -> tuple:
    return {
        "accuracy": (b["exact"], b["guess"]),
        "binary_accuracy": (b["binary"], b["prob"]),
        "categorical_accuracy": (b["one_hot"], b["scores"]),
        "sparse_categorical_accuracy": (b["labels"], b["scores"]),
        "top_k_categorical_accuracy": (b["one_hot"], b["scores"]),
        "sparse_top_k_categorical_accuracy": (b["labels"], b["scores"]),
        "mean": (b["values"],),
        "sum": (b["values"],),
    }[name]


batches = [batch(8, 0), batch(8, 1), batch(3, 2)]
for b in batches:
    for name, metric in expected.items():
        metric.update_state(*inputs(b, name), sample_weight=b["weights"])


def step(b: dict[str, torch.Tensor]) -> None:
    for name in FACTORIES:
        inside[name].update_state(*inputs(b, name), sample_weight=b["weights"])
        outside[name].update_state(*inputs(b, name), sample_weight=b["weights"])


for x in strategy.experimental_distribute_dataset(batches):
    strategy.run(step, args=(x,))

bad = []
for name in FACTORIES:
    values = [float(m[name].result()) for m in (inside, outside, expected)]
    print(f"METRIC {name} inside={values[0]:.6f} outside={values[1]:.6f} expected={values[2]:.6f}", flush=True)
    if any(abs(v - values[2]) > 1e-5 for v in values[:2]):
        bad.append(name)

# the same mistake through fit: a metric object built outside the scope, passed to metrics=[...]
with strategy.scope():
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
mae_outside = M.MeanMetricWrapper(lambda t, p: (t - p).abs().reshape(len(t), -1).mean(1), name="mae")
numbers = torch.arange(16, dtype=torch.float32)[:, None]
history = ds.fit(
    model,
    [(numbers[:8], numbers[:8]), (numbers[8:], numbers[8:])],
    optimizer=optimizer,
    loss="mae",
    metrics=[mae_outside],
    verbose=0,
)
print(f"FIT mae={history.history['mae'][0]:g} expected=7.5", flush=True)
if abs(history.history["mae"][0] - 7.5) > 1e-6:
    bad.append("fit")
print("ALL OK" if not bad else f"MISMATCH {bad}", flush=True)
