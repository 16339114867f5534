"""Builds a Keras 3 model under ShardedStrategy on every launched worker and prints the error it gets.

distrib launch --workers 2 tests/scripts/keras_unsupported.py
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402

import distrib as ds  # noqa: E402

strategy = ds.ShardedStrategy()
try:
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
except NotImplementedError as error:
    print(f"refused: {error}", flush=True)
else:
    print("accepted", flush=True)
