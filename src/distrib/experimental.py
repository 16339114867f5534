"""``ds.experimental``: TF's ``tf.distribute.experimental`` names that distrib has.

``PreemptionCheckpointHandler`` and ``TerminationConfig`` (see :mod:`distrib.preemption`).
"""

from distrib.preemption import PreemptionCheckpointHandler, TerminationConfig

__all__ = ["PreemptionCheckpointHandler", "TerminationConfig"]
