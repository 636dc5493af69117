"""User annotations: gshard's own, ``jax.lax.with_sharding_constraint``, and
``jax.device_put`` to a sharding inside the function.

All are identities whose result is pinned to the sharding the user wrote
(``linear=none``: a pending sum is resolved before the annotation). A
``with_sharding_constraint`` names a ``NamedSharding`` (or a bare
``PartitionSpec`` under ``jax.set_mesh``): its mesh must be the one gshard
partitions over; ``P.UNCONSTRAINED`` dims stay free for propagation. A
``device_put`` to a ``NamedSharding`` of device memory is the same constraint
on each value it moves (with no destination, a copy); one to a device, a
memory kind or another kind of sharding is not a layout gshard keeps, and
takes the safe path.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from gshard.spmd.partition.generic import identity_rule as identity_partition
from gshard.spmd.partition.generic import safe_rule
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


def _named_pin(k: int, shape, sharding, unconstrained_dims, what: str) -> tuple:
  """Result ``k`` linked to operand ``k`` and pinned to ``sharding`` (a
  ``NamedSharding``; NotImplementedError for anything else)."""
  spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
  if spec is None or mesh is None:   # not a NamedSharding: no constraint
    raise NotImplementedError(f"{what} with {type(sharding).__name__}")
  entries = list(spec) + [None] * (len(shape) - len(spec))
  open_dims = frozenset(unconstrained_dims) | frozenset(
      i for i, e in enumerate(entries) if e is P.UNCONSTRAINED)
  pinned = TensorSharding.from_spec(
      P(*[None if i in open_dims else e for i, e in enumerate(entries)]), len(shape))
  return (Constraint(identity_rule(shape, linear="none"), (IN(k),), (OUT(k),)),
          Pin(OUT(k), pinned, open_dims, what=what, mesh=tuple(dict(mesh.shape).items())))


def sharding_constraint_rule(in_avals, out_avals, *, sharding, unconstrained_dims=(),
                             **params) -> OpRule:
  """``with_sharding_constraint(x, NamedSharding(mesh, P("data", None)))``: the
  annotation ``[data,_]``, checked against the partition mesh."""
  del out_avals, params
  con, pin = _named_pin(0, tuple(in_avals[0].shape), sharding, unconstrained_dims,
                        "with_sharding_constraint")
  return OpRule((con,), pins=(pin,))


def _kept(dst) -> bool:
  """Whether a ``device_put`` destination is one gshard keeps: none (a copy) or
  a ``NamedSharding`` of device memory."""
  return dst is None or (getattr(dst, "spec", None) is not None
                         and getattr(dst, "memory_kind", None) in (None, "device"))


def device_put_rule(in_avals, out_avals, *, devices, **params) -> OpRule:
  """``jax.device_put(x, NamedSharding(mesh, P("data")))`` in the function:
  each value it moves pinned like a ``with_sharding_constraint``; with no
  destination, a copy."""
  del out_avals, params
  if not all(map(_kept, devices)):
    raise NotImplementedError("device_put to a device or a memory kind")
  cons, pins = [], []
  for k, (a, dst) in enumerate(zip(in_avals, devices)):
    if dst is None:
      cons.append(Constraint(identity_rule(tuple(a.shape)), (IN(k),), (OUT(k),)))
      continue
    con, pin = _named_pin(k, tuple(a.shape), dst, (), "device_put")
    cons.append(con)
    pins.append(pin)
  return OpRule(tuple(cons), pins=tuple(pins))


def device_put_partition(ctx, eqn, ins, scope, idx) -> list:
  """The values as they are (the interpreter then brings each to its
  propagated sharding); the safe path for a destination gshard does not keep."""
  if not all(map(_kept, eqn.params["devices"])):
    return safe_rule(ctx, eqn, ins, scope, idx)
  return list(ins)


register("sharding_annotation", annotation_rule)
register("sharding_constraint", sharding_constraint_rule, partition=identity_partition)
register("device_put", device_put_rule, partition=device_put_partition)
