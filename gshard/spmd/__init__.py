"""SPMD: the sharding algebra, sharding rules, propagation and partitioning.

Importing this package registers every primitive family in
:mod:`gshard.spmd.registry` (each ``spmd/rules/X.py`` states a primitive's
sharding rule and its partition rule, from ``spmd/partition/X.py``). Import
submodules directly (``gshard.spmd.sharding``, ``gshard.spmd.infer``); the
public names are re-exported by ``gshard``.
"""

from gshard.spmd.rules import (annotation, callback, control, conv, dot,  # noqa: F401
                               elementwise, indexing, linalg, pipeline, random,
                               reduce, shape)  # (registers them)
