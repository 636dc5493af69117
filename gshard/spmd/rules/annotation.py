"""The annotation primitive: identity, with its result pinned by the user."""

from __future__ import annotations

from gshard.spmd.registry import register
from gshard.spmd.rules._core import IN, OUT, Constraint, OpRule, Pin
from gshard.spmd.rules.control import identity_rule


def annotation_rule(in_avals, out_avals, *, annotation) -> OpRule:
  """An identity (``linear=none``: a pending sum is resolved first) whose result
  is pinned to the annotation's sharding."""
  del out_avals
  shape = tuple(in_avals[0].shape)
  return OpRule((Constraint(identity_rule(shape, linear="none"), (IN(0),), (OUT(0),)),),
                pins=(Pin(OUT(0), annotation.sharding, annotation.open_dims),))


register("sharding_annotation", annotation_rule)
