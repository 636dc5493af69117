"""User annotations: gshard's own, and ``jax.lax.with_sharding_constraint``.

Both are identities whose result is pinned to the sharding the user wrote
(``linear=none``: a pending sum is resolved before the annotation). A
``with_sharding_constraint`` names a ``NamedSharding`` (or a bare
``PartitionSpec`` under ``jax.set_mesh``): its mesh must be the one gshard
partitions over; ``P.UNCONSTRAINED`` dims stay free for propagation.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from gshard.spmd.partition.generic import identity_rule as identity_partition
from gshard.spmd.registry import register
from gshard.spmd.rules._core import IN, OUT, Constraint, OpRule, Pin
from gshard.spmd.rules.control import identity_rule
from gshard.spmd.sharding import TensorSharding


def annotation_rule(in_avals, out_avals, *, annotation) -> OpRule:
  """An identity (``linear=none``: a pending sum is resolved first) whose result
  is pinned to the annotation's sharding."""
  del out_avals
  shape = tuple(in_avals[0].shape)
  return OpRule((Constraint(identity_rule(shape, linear="none"), (IN(0),), (OUT(0),)),),
                pins=(Pin(OUT(0), annotation.sharding, annotation.open_dims),))


def sharding_constraint_rule(in_avals, out_avals, *, sharding, unconstrained_dims=(),
                             **params) -> OpRule:
  """``with_sharding_constraint(x, NamedSharding(mesh, P("data", None)))``: the
  annotation ``[data,_]``, checked against the partition mesh."""
  del out_avals, params
  spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
  if spec is None or mesh is None:   # not a NamedSharding: no constraint
    raise NotImplementedError(f"with_sharding_constraint with {type(sharding).__name__}")
  shape = tuple(in_avals[0].shape)
  entries = list(spec) + [None] * (len(shape) - len(spec))
  open_dims = frozenset(unconstrained_dims) | frozenset(
      i for i, e in enumerate(entries) if e is P.UNCONSTRAINED)
  pinned = TensorSharding.from_spec(
      P(*[None if i in open_dims else e for i, e in enumerate(entries)]), len(shape))
  return OpRule((Constraint(identity_rule(shape, linear="none"), (IN(0),), (OUT(0),)),),
                pins=(Pin(OUT(0), pinned, open_dims, what="with_sharding_constraint",
                          mesh=tuple(dict(mesh.shape).items())),))


register("sharding_annotation", annotation_rule)
register("sharding_constraint", sharding_constraint_rule, partition=identity_partition)
