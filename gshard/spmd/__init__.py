"""SPMD: the sharding algebra, sharding rules, propagation and partitioning.

Import submodules directly (``gshard.spmd.sharding``, ``gshard.spmd.infer``);
the public names are re-exported by ``gshard``.
"""
