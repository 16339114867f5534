"""Clusters: their spec, and resolvers that read one environment each (``ds.cluster_resolver``).

``resolve()`` picks the resolver for the current environment: it asks each registered
resolver's ``detect`` in turn, ``TF_CONFIG`` first, then torchrun's variables, then
Slurm's (``register_resolver`` adds one of your own); None when the process is not in a
cluster. ``UnionClusterResolver`` (TF's ``UnionResolver``) merges several resolvers.
``worker_rank(resolver)`` and ``resolver.rendezvous_address()`` are what synchronous
strategies need: this task's rank among the chief and workers, and where they meet.
"""

from __future__ import annotations

from distrib.cluster.resolver import (
    ClusterResolver,
    SimpleClusterResolver,
    UnionClusterResolver,
    UnionResolver,
    register_resolver,
    registered_resolvers,
    resolve,
    worker_rank,
)
from distrib.cluster.slurm import SlurmClusterResolver
from distrib.cluster.spec import ClusterSpec
from distrib.cluster.tf_config import TFConfigClusterResolver, TFConfigError
from distrib.cluster.torchrun import TorchrunClusterResolver

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TFConfigError",
    "TorchrunClusterResolver",
    "UnionClusterResolver",
    "UnionResolver",
    "register_resolver",
    "registered_resolvers",
    "resolve",
    "worker_rank",
]

for _resolver in (TFConfigClusterResolver, TorchrunClusterResolver, SlurmClusterResolver):  # resolve()'s order
    register_resolver(_resolver)
