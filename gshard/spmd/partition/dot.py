"""Partition rule of ``ragged_dot_general`` (its sharding rule: ``rules/dot.py``).

The lhs rows along the ragged dim come in consecutive groups of
``group_sizes`` rows. Split that dim and a device holds rows ``[s, s + b)``
of it: it runs on the group sizes cut to its block, ``clip(end - s, 0, b) -
clip(start - s, 0, b)`` per group, so each local row meets its own group's
rhs. Rows past the last group stay zero, as in the whole program. A split
ragged *contracting* dim (the weight gradient) leaves each device a partial
sum over its rows, which the plan resolves like any contraction's.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from gshard.spmd.partition.context import Context, Value
from gshard.spmd.partition.generic import bind_local, generic_rule
from gshard.spmd.partition.plan import plan_local


def ragged_dot_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """The grouped matmul on local blocks; group sizes cut to this device's rows
  where the ragged dim is split."""
  if ctx.all_replicated(eqn, ins, scope):
    return generic_rule(ctx, eqn, ins, scope, idx)
  plan = plan_local(ctx, eqn, ins, scope)
  (ragged,) = eqn.params["ragged_dot_dimension_numbers"].lhs_ragged_dimensions
  axes = plan.operands[0].dims[ragged]
  if not axes:
    return bind_local(ctx, eqn, plan, ins)

  def bind(lhs, rhs, sizes, **params):
    block = np.shape(lhs)[ragged]
    start = ctx.linear_index(axes) * block
    # ends summed in the sizes' own type, as jax's ragged_dot does (int8 sizes
    # wrap); a group whose end wrapped below its start is empty there too
    end = jnp.cumsum(sizes, axis=-1, dtype=sizes.dtype)
    begin = jnp.concatenate([jnp.zeros_like(end[..., :1]), end[..., :-1]], axis=-1)
    end, begin = end.astype(jnp.int32), begin.astype(jnp.int32)
    local = jnp.maximum(jnp.clip(end - start, 0, block) - jnp.clip(begin - start, 0, block), 0)
    return eqn.primitive.bind(lhs, rhs, local.astype(sizes.dtype), **params)
  return bind_local(ctx, eqn, plan, ins, bind=bind)
