"""The Keras-style layer: ``fit`` / ``evaluate`` / ``predict`` (one loop), callbacks, progress display.

* :mod:`~distrib.keras.loop`: the loop, the same under every strategy; only how a
  step executes differs (:class:`~distrib.strategies.execution.StepExecutor`);
* :mod:`~distrib.keras.training`: what a training loop keeps and its callbacks see (``Loop``), and its
  epoch, resume and callback bookkeeping (``Training``: fit's, and ``distrib train``'s custom loop);
* :mod:`~distrib.keras.callbacks`: Keras' callbacks (``ds.callbacks``);
* :mod:`~distrib.keras.progress`: the progress bar.
"""

from distrib.keras import callbacks
from distrib.keras.loop import evaluate, fit, predict
from distrib.keras.training import Loop

__all__ = ["Loop", "callbacks", "evaluate", "fit", "predict"]
