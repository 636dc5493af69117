"""The SPMD partitioner: per-device programs with explicit collectives.

``api`` (``gshard.partition``) traces, propagates and builds the per-device
program; ``interpret`` runs a jaxpr per device; ``generic`` is the factor-based
partition rule most primitives use; ``X.py`` holds the partition rules of the
family whose sharding rules are in ``spmd/rules/X.py``; ``context`` is what
every rule sees (values, resharding, the record of collectives).
"""
