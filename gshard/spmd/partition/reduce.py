"""Partition rules of reductions whose split needs a cross-device combine.

``reduce_sum`` over a split dim leaves a pending sum: the generic rule. A split
``reduce_max``/``reduce_min``/``reduce_or``/``reduce_and`` is reduced locally
and then combined across the devices (``pmax``/``pmin``); ``argmax``/``argmin``
take the local winner, then the globally first winner.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from gshard.spmd.partition.context import Context, Value
from gshard.spmd.partition.generic import (bind_local, factor_rule_of, mask_padding,
                                           plan_local, safe_rule)
from gshard.spmd.reshard import allreduce_bytes

# Cross-device combine for split non-sum reductions.
_COMBINE = {"reduce_max": "pmax", "reduce_min": "pmin", "reduce_or": "pmax",
            "reduce_and": "pmin"}


def allreduce_bytes_of(x, n: int) -> int:
  """Bytes one device sends to all-reduce the local array ``x`` over ``n`` devices."""
  return int(allreduce_bytes(x.size * x.dtype.itemsize, n))


def combine_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """A max/min/or/and over a split dim: the local reduction, then pmax/pmin."""
  try:
    factor_rule_of(eqn)
  except NotImplementedError:   # a case the sharding rule does not cover
    return safe_rule(ctx, eqn, ins, scope, idx)
  combine = _COMBINE[eqn.primitive.name]
  plan = plan_local(ctx, eqn, ins, scope, allow_other_reduction=True)
  outs = bind_local(ctx, eqn, plan, ins)
  axes = tuple(a for f in plan.rule.other_reduction for a in plan.choice.get(f, ()))
  if not axes:
    return outs
  res = []
  for v in outs:
    x = v.x
    is_bool = x.dtype == jnp.bool_
    y = getattr(lax, combine)(x.astype(jnp.int32) if is_bool else x, axes)
    y = y.astype(jnp.bool_) if is_bool else y
    ctx.record(combine, axes, allreduce_bytes_of(y, ctx.num_shards(axes)), eqn,
               "result 0", v.sharding, v.sharding, v.shape, v.dtype)
    res.append(dataclasses.replace(v, x=y))
  return res


def arg_reduce_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """argmax/argmin over a split dim: local winner, then the global first winner."""
  del idx
  plan = plan_local(ctx, eqn, ins, scope, allow_other_reduction=True)
  (axis,) = eqn.params["axes"]
  (f,) = plan.rule.operands[0][axis]
  axes = plan.choice.get(f, ())
  (x_val,) = [ctx.reshard(ins[0], plan.operands[0], eqn, "operand 0")]
  (out,) = bind_local(ctx, eqn, plan, [x_val])
  if not axes:
    return [out]
  local_n = x_val.sharding.local_shape(x_val.shape, ctx.mesh_sizes)[axis]
  is_max = eqn.primitive.name == "argmax"
  (masked,) = mask_padding(ctx, eqn, plan, [x_val.x])
  best = (jnp.max if is_max else jnp.min)(masked, axis=axis)
  glob = out.x + (ctx.linear_index(axes) * local_n).astype(out.x.dtype)
  top = (lax.pmax if is_max else lax.pmin)(best, axes)
  big = jnp.iinfo(out.x.dtype).max
  mine = jnp.where(best == top, glob, big)
  winner = lax.pmin(mine, axes)
  n = ctx.num_shards(axes)
  ctx.record("pmax" if is_max else "pmin", axes, allreduce_bytes_of(best, n), eqn,
             "result 0", out.sharding, out.sharding, out.shape, out.dtype)
  ctx.record("pmin", axes, allreduce_bytes_of(winner, n), eqn, "result 0", out.sharding,
             out.sharding, out.shape, out.dtype)
  return [dataclasses.replace(out, x=winner)]
