"""Strategies: how one replica function is run over devices and workers."""

from distrib.strategies.base import Strategy
from distrib.strategies.default import DefaultStrategy, OneDeviceStrategy
from distrib.strategies.mirrored import MirroredStrategy
from distrib.strategies.multi_worker import MultiWorkerMirroredStrategy

__all__ = ["Strategy", "DefaultStrategy", "OneDeviceStrategy", "MirroredStrategy", "MultiWorkerMirroredStrategy"]
