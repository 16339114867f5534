"""``fit`` / ``evaluate`` / ``predict`` on data shorter than asked (issue 10, A.6), one line per trial.

    python tests/scripts/fit_short_data.py [--strategies default,mirrored] [--ps]
    distrib launch --workers 2 tests/scripts/fit_short_data.py --strategies multi_worker

Prints ``TRIAL case=<case> strategy=<strategy> outcome=<outcome> epochs=<recorded epochs> steps=<steps run>
zero_epochs=<epochs recorded with a loss of exactly 0> seconds=<s>``. The outcome is ``ValueError``
(or another exception's name), ``warned`` (a "ran out of data" warning, once) or ``silent``.
"""

import argparse
import time
import warnings

import torch

import distrib as ds

p = argparse.ArgumentParser()
p.add_argument("--strategies", default="default,mirrored")
p.add_argument("--ps", action="store_true", help="also the parameter-server cases (in-process cluster)")
args = p.parse_args()


def batches(n: int = 6) -> list:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n * 4, 2, generator=g)
    return [(x[i : i + 4], x[i : i + 4, :1]) for i in range(0, n * 4, 4)]


class FirstPassOnly:
    """A dataset that yields nothing on a later pass (a stream that was consumed, a cache that expired)."""

    def __init__(self, items: list) -> None:
        self.items, self.passes = items, 0

    def __iter__(self):
        self.passes += 1
        return iter(self.items if self.passes == 1 else [])

    def __len__(self) -> int:
        return len(self.items)


class Steps(ds.callbacks.Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1


def trial(case: str, strategy_name: str, call) -> None:
    start = time.monotonic()
    counter = Steps()
    outcome, epochs, zero = "silent", "-", "-"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = call(counter)
            if isinstance(result, ds.callbacks.History):
                epochs = str(result.epoch).replace(" ", "")
                zero = str(sum(1 for v in result.history.get("loss", []) if v == 0.0))
        except Exception as e:  # the outcome is what the trial reports
            outcome = type(e).__name__
    ran_out = [w for w in caught if "ran out of data" in str(w.message)]
    if outcome == "silent" and ran_out:
        outcome = "warned" if len(ran_out) == 1 else f"warned{len(ran_out)}x"
    print(
        f"TRIAL case={case} strategy={strategy_name} outcome={outcome} epochs={epochs} steps={counter.steps} "
        f"zero_epochs={zero} seconds={time.monotonic() - start:.2f}",
        flush=True,
    )


def synchronous_cases(strategy_name: str, strategy: ds.Strategy) -> None:
    with strategy.scope():
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def fit(data, **kw):
        return lambda steps: ds.fit(model, data, optimizer=optimizer, loss="mse", verbose=0, callbacks=[steps], **kw)

    trial("fit_empty", strategy_name, fit([], epochs=2))
    trial("evaluate_empty", strategy_name, lambda _: ds.evaluate(model, [], loss="mse"))
    trial("predict_empty", strategy_name, lambda _: ds.predict(model, []))
    trial(
        "fit_generator_steps_per_epoch_10_of_6",
        strategy_name,
        fit((b for b in batches()), epochs=3, steps_per_epoch=10),
    )
    trial("fit_generator_3_epochs", strategy_name, fit((b for b in batches()), epochs=3))
    trial(
        "fit_empty_on_later_pass_steps_per_epoch_10_of_6",
        strategy_name,
        fit(FirstPassOnly(batches()), epochs=3, steps_per_epoch=10),
    )
    trial(
        "evaluate_iterator_steps_10_of_6",
        strategy_name,
        lambda _: ds.evaluate(model, iter(batches()), loss="mse", steps=10),
    )


def parameter_server_cases() -> None:
    resolver = ds.testing.create_in_process_cluster(num_workers=2, num_ps=1)
    try:
        strategy = ds.ParameterServerStrategy(resolver)
        with strategy.scope():
            model = torch.nn.Linear(2, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        data = batches(3)

        def three_batches(input_context):
            return iter(data)

        def fit(d, **kw):
            return lambda steps: ds.fit(model, d, optimizer=optimizer, loss="mse", verbose=0, callbacks=[steps], **kw)

        trial("fit_empty", "parameter_server", fit([], steps_per_epoch=4))
        trial("evaluate_empty", "parameter_server", lambda _: ds.evaluate(model, [], loss="mse", steps=3))
        trial(
            "fit_dataset_fn_steps_per_epoch_10_of_2x3",
            "parameter_server",
            fit(three_batches, epochs=3, steps_per_epoch=10),
        )
    finally:
        ds.testing.stop_in_process_cluster(resolver)


for name in args.strategies.split(","):
    made = {
        "default": ds.get_strategy,
        "mirrored": lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"]),
        "multi_worker": lambda: ds.MultiWorkerMirroredStrategy(
            communication_options=ds.CommunicationOptions(timeout_seconds=30)
        ),
    }[name]()
    synchronous_cases(name, made)
if args.ps:
    parameter_server_cases()
print("DONE", flush=True)
