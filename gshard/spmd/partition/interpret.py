"""The interpreter: runs a jaxpr per device inside ``jax.shard_map``.

For each equation it looks up the partition rule, which reshards operands to
what the local op needs, binds the op on local values and says how its
results are sharded; each result is then brought to its propagated sharding
(pending partial sums stay pending where propagation kept them pending). The
driver knows no primitive.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence

import numpy as np
from jax.experimental.xla_metadata import set_xla_metadata
from jax.extend.core import Literal

from gshard.spmd import registry
from gshard.spmd.partition.context import Context, PartitionWarning, Value
from gshard.spmd.partition.generic import generic_rule, safe_rule
from gshard.spmd.sharding import TensorSharding
from gshard.spmd.tracing import MESH_KEY
from gshard.spmd.source import names_code, rebinding


def partition_rule_for(eqn):
  """The registered partition rule of ``eqn``'s primitive (the safe path if none)."""
  entry = registry.entry(eqn.primitive.name)
  if entry is None or entry.partition == registry.SAFE:
    return safe_rule
  if entry.partition == registry.GENERIC:
    return generic_rule
  return entry.partition


def literal_value(v: Literal) -> Value:
  """A literal as a replicated per-device value."""
  shape = tuple(np.shape(v.val))
  return Value(v.val, TensorSharding.replicated(len(shape)), shape,
               getattr(v.aval, "dtype", None), literal=True)


def run_jaxpr(ctx: Context, jaxpr, scope: tuple, consts: Sequence,
              args: Sequence[Value]) -> list[Value]:
  """Interpret ``jaxpr`` on per-device values; returns its outputs' values."""
  env: dict = {}

  def read(v) -> Value:
    return literal_value(v) if isinstance(v, Literal) else env[v]

  for v, c in zip(jaxpr.constvars, consts):
    shape = tuple(np.shape(c))
    env[v] = Value(c, TensorSharding.replicated(len(shape)), shape, v.aval.dtype)
  caller = ctx.enclosing[-1] if ctx.enclosing else None   # None: the program itself
  for v, a in zip(jaxpr.invars, args):
    env[v] = ctx.reshard(a, ctx.target(scope, v), caller, "argument") \
        if a.sharding != ctx.target(scope, v) else a
  for idx, eqn in enumerate(jaxpr.eqns):
    ins = [read(v) for v in eqn.invars]
    rule = partition_rule_for(eqn)
    # what the equation becomes (its local op, its collectives) is bound under
    # its source and the user's set_xla_metadata; an equation of a library's
    # jitted function traced with no user frame keeps its caller's line (what
    # ctx.source reports)
    own_line = not ctx.enclosing or names_code(eqn.source_info.traceback)
    with rebinding(eqn.source_info, own_line), _user_attributes(ctx, eqn):
      ctx.enclosing.append(eqn)   # inner jaxprs name this equation's source line
      try:
        outs = rule(ctx, eqn, ins, scope, idx)
      finally:
        ctx.enclosing.pop()
      for j, (v, out) in enumerate(zip(eqn.outvars, outs)):
        if type(v).__name__ == "DropVar":
          continue
        env[v] = ctx.reshard(out, ctx.target(scope, v), eqn, f"result {j}")
  return [read(v) for v in jaxpr.outvars]


def _user_attributes(ctx: Context, eqn):
  """The user's ``set_xla_metadata`` of ``eqn``, to bind its per-device ops
  under (nothing to enter for most equations). A ``compute_on`` placement is
  not carried: the collectives gshard adds for the equation would be placed
  with it. It warns."""
  if eqn.ctx.compute_type is not None:
    warnings.warn(
        f"gshard: compute_on({eqn.ctx.compute_type!r}) at {ctx.source(eqn)} is not "
        "carried into the partitioned program: this equation runs on the device.",
        PartitionWarning, stacklevel=3)
  meta = {k: v for k, v in (eqn.ctx.xla_metadata or {}).items() if k != MESH_KEY}
  return set_xla_metadata(**meta) if meta else contextlib.nullcontext()
