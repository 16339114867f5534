"""The Keras-style layer: ``fit`` / ``evaluate`` / ``predict`` (one loop), callbacks, progress display.

* :mod:`~distrib.keras.loop`: the loop, the same under every strategy; only how a
  step executes differs (:class:`~distrib.strategies.execution.StepExecutor`);
* :mod:`~distrib.keras.callbacks`: Keras' callbacks (``ds.callbacks``);
* :mod:`~distrib.keras.progress`: the progress bar.
"""

from distrib.keras import callbacks
from distrib.keras.loop import Loop, evaluate, fit, predict

__all__ = ["Loop", "callbacks", "evaluate", "fit", "predict"]
