"""``ds.experimental``: TF's ``tf.distribute.experimental`` names that distrib has, and mesh parallelism.

``PreemptionCheckpointHandler`` and ``TerminationConfig`` (see :mod:`distrib.preemption`);
``MeshStrategy``, ``DeviceMesh`` and ``LayoutMap`` (data and tensor parallelism over a named mesh, with
Keras 3's names: see :mod:`distrib.strategies.mesh_strategy`), and ``clip_grad_norm_``: torch's, right
for gradients on several meshes (:mod:`distrib.strategies.grad_norm`); ``keras_distribution``: Keras 3's
``DataParallel`` / ``ModelParallel`` on torch as a ``MeshStrategy`` (:mod:`distrib.integrations.keras_distribution`).
"""

from distrib.integrations.keras_distribution import keras_distribution
from distrib.preemption import PreemptionCheckpointHandler, TerminationConfig
from distrib.strategies.grad_norm import clip_grad_norm_
from distrib.strategies.mesh import DeviceMesh, LayoutMap
from distrib.strategies.mesh_strategy import MeshStrategy

__all__ = [
    "PreemptionCheckpointHandler",
    "TerminationConfig",
    "MeshStrategy",
    "DeviceMesh",
    "LayoutMap",
    "clip_grad_norm_",
    "keras_distribution",
]
