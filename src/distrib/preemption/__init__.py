"""Preemption: a termination notice becomes one agreed checkpoint, an exit the launcher restarts, an exact resume.

``handler.py`` (:class:`PreemptionCheckpointHandler`), ``config.py`` (:class:`TerminationConfig`,
the exit code 42 and the grace period), ``agreement.py`` (how the workers agree on the step,
through a store the chief hosts, with nothing added to a step until a notice comes). Public
as ``ds.experimental.PreemptionCheckpointHandler`` and ``ds.experimental.TerminationConfig``.
"""

from distrib.preemption.config import GRACE_ENV, PREEMPTION_EXIT_CODE, TerminationConfig
from distrib.preemption.handler import PreemptionCheckpointHandler

__all__ = ["GRACE_ENV", "PREEMPTION_EXIT_CODE", "PreemptionCheckpointHandler", "TerminationConfig"]
