"""Training precision (Lightning's names) for the loops: the policy, and whether it is fast on this machine."""

from distrib.precision.policy import Precision, backward_and_step

__all__ = ["Precision", "backward_and_step"]
