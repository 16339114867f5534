"""``ds.function``: the whole training step as one graph, tf.function's counterpart.

* :mod:`~distrib.graphs.step_function`: the decorator and :class:`Function` (signatures, warm-up, capture, replay,
  and the path each signature takes);
* :mod:`~distrib.graphs.signature`: what makes two calls the same (shapes, dtypes, devices, Python values);
* :mod:`~distrib.graphs.cuda_graph`: one captured CUDA graph: static inputs, the capture with its safety
  checks, the replay, and the Python state (``.grad``) it restores;
* :mod:`~distrib.graphs.capturable`: optimizers made capturable (device ``step``, a tensor learning rate that
  schedules keep updating, state kept in place across ``load_state_dict``);
* :mod:`~distrib.graphs.guards`: what a graph assumes beyond its signature, checked: no host decisions in the
  step, and the objects and storages it reads still the step's before each replay;
* :mod:`~distrib.graphs.paths`: where a graph cannot be captured, and the message that says why.
"""

from distrib.graphs.step_function import Function, function

__all__ = ["Function", "function"]
