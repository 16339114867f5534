"""Clusters: their spec, and resolvers that read one environment each (``ds.cluster_resolver``).

``resolve()`` picks the resolver for the current environment: ``TF_CONFIG`` first,
then torchrun's variables, then Slurm's; None when the process is not in a cluster.
``UnionClusterResolver`` (TF's ``UnionResolver``) merges several resolvers.
``worker_rank(resolver)`` and ``resolver.rendezvous_address()`` are what synchronous
strategies need: this task's rank among the chief and workers, and where they meet.
"""

from __future__ import annotations

from typing import Mapping, Optional

from distrib.cluster.resolver import (ClusterResolver, SimpleClusterResolver, UnionClusterResolver, UnionResolver,
                                     worker_rank)
from distrib.cluster.slurm import SlurmClusterResolver
from distrib.cluster.spec import ClusterSpec
from distrib.cluster.tf_config import TFConfigClusterResolver, TFConfigError
from distrib.cluster.torchrun import TorchrunClusterResolver

__all__ = ["ClusterResolver", "ClusterSpec", "SimpleClusterResolver", "SlurmClusterResolver",
           "TFConfigClusterResolver", "TFConfigError", "TorchrunClusterResolver", "UnionClusterResolver",
           "UnionResolver", "resolve", "worker_rank"]


def resolve(environ: Optional[Mapping[str, str]] = None) -> Optional[ClusterResolver]:
    """The resolver for this process's environment, or None outside any cluster."""
    if TFConfigClusterResolver.detect(environ):
        return TFConfigClusterResolver(environ=environ)
    if TorchrunClusterResolver.detect(environ):
        return TorchrunClusterResolver(environ=environ)
    if SlurmClusterResolver.detect(environ):
        return SlurmClusterResolver(environ=environ)
    return None
