"""distrib: tf.distribute's strategies for PyTorch custom training loops.

Write one training step; run it on one device, on several local devices, or on
many worker processes, by changing the strategy::

    import distrib as ds
    strategy = ds.MirroredStrategy()              # or OneDeviceStrategy("cuda:0"), ...
    with strategy.scope():
        model = make_model()                      # mirrored on every replica
        optimizer = torch.optim.Adam(model.parameters())
    for batch in strategy.experimental_distribute_dataset(loader):
        strategy.run(train_step, args=(batch,))   # optimizer.step() sums over replicas

Glossary
--------
replica
    One copy of the model that computes on its share of every global batch.
    ``num_replicas_in_sync`` counts them over all workers.
worker
    One process taking part in synchronous training; it drives one or more
    local replicas.
chief
    The worker that does the extra bookkeeping: it alone writes checkpoints and
    summaries. The ``chief`` task if the cluster has one, else worker 0.
ps
    A parameter-server task: it holds (shards of) the parameters under
    ``ParameterServerStrategy``.
coordinator
    The process that schedules functions on workers under
    ``ParameterServerStrategy`` (the chief).
cross-replica context
    Code inside ``strategy.scope()`` but outside ``strategy.run``: it sees all
    replicas' values at once (``reduce``, ``gather``).
replica context
    Code inside the function given to ``strategy.run``: it sees its own
    replica's values (``get_replica_context()``).
"""

from distrib import cluster as cluster_resolver
from distrib import callbacks, metrics
from distrib.cluster import ClusterSpec
from distrib.checkpoint import Checkpoint, CheckpointManager, latest_checkpoint
from distrib.fit import evaluate, fit, predict
from distrib.context import get_replica_context, get_strategy, has_strategy, in_cross_replica_context
from distrib.input import InputContext
from distrib.losses import compute_average_loss, scale_regularization_loss
from distrib.replica import ReplicaContext
from distrib.collectives import CommunicationOptions
from distrib.strategies import MirroredStrategy, MultiWorkerMirroredStrategy, OneDeviceStrategy, Strategy
from distrib.values import PerReplica, ReduceOp

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "CommunicationOptions",
    "MultiWorkerMirroredStrategy",
    "ClusterSpec",
    "cluster_resolver",
    "CheckpointManager",
    "InputContext",
    "MirroredStrategy",
    "OneDeviceStrategy",
    "PerReplica",
    "ReduceOp",
    "ReplicaContext",
    "Strategy",
    "callbacks",
    "compute_average_loss",
    "evaluate",
    "fit",
    "predict",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "latest_checkpoint",
    "metrics",
    "scale_regularization_loss",
]

# Parameter-server training (issue 4): strategy, servers, coordinator, partitioners, test clusters.
from distrib import testing
from distrib.parameter_server import ParameterServerStrategy, Server, coordinator, partitioners

__all__ += ["ParameterServerStrategy", "Server", "coordinator", "partitioners", "testing"]
