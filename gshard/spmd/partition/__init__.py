"""The SPMD partitioner: per-device programs with explicit collectives."""

from gshard.spmd.partition import control as _control  # noqa: F401  (registers rules)
from gshard.spmd.partition import indexing as _indexing  # noqa: F401
from gshard.spmd.partition import random as _random  # noqa: F401  (registers rules)
from gshard.spmd.partition import windowed as _windowed  # noqa: F401  (registers rules)
from gshard.spmd.partition.api import Partitioned, partition
from gshard.spmd.partition.context import Collective, PartitionWarning

__all__ = ["Collective", "PartitionWarning", "Partitioned", "partition"]
