"""Communication between worker processes: the communicator seam and gradient reduction.

* :mod:`~distrib.comm.communicator`: the :class:`Communicator` protocol every
  strategy holds, and :class:`LocalCommunicator` (one process);
* :mod:`~distrib.comm.process_group`: the implementation over ``torch.distributed``,
  imported on first use;
* :mod:`~distrib.comm.options`: :class:`CommunicationOptions`;
* :mod:`~distrib.comm.hooks` and :mod:`~distrib.comm.gradient_reducer`: how gradients
  are reduced, bucket by bucket, through a pluggable comm hook;
* :mod:`~distrib.comm.compression` (fp16/bf16 casting) and :mod:`~distrib.comm.powersgd`
  (low rank with error feedback): the compressing hooks that
  ``CommunicationOptions(compression=...)`` chooses;
* :mod:`~distrib.comm.failures` (which exception is a collective's failure, which one the
  user's code raised) and :mod:`~distrib.comm.step_errors` (a worker's step error, told to the
  others through the store): a user's error is raised as itself, ``CollectiveError`` is for
  the collectives.
"""

from distrib.comm.communicator import CollectiveError, Communicator, LocalCommunicator
from distrib.comm.compression import CastHook
from distrib.comm.gradient_reducer import BucketedGradientReducer, reduce_gradients
from distrib.comm.hooks import CommHook, DeferredFuture, GradBucket, allreduce_hook
from distrib.comm.options import CommunicationImplementation, CommunicationOptions
from distrib.comm.powersgd import PowerSGD, PowerSGDHook

__all__ = [
    "BucketedGradientReducer",
    "CastHook",
    "CollectiveError",
    "CommHook",
    "CommunicationImplementation",
    "CommunicationOptions",
    "Communicator",
    "DeferredFuture",
    "GradBucket",
    "LocalCommunicator",
    "PowerSGD",
    "PowerSGDHook",
    "allreduce_hook",
    "reduce_gradients",
]
