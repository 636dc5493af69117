"""Partition rule for debug prints and host callbacks: run once, on whole values.

The unpartitioned program calls ``jax.debug.print("{}", x)`` or an
``io_callback`` once per step, with the whole ``x``. Bound on every device,
the per-device program would call it once per device, each with its own
block: a print repeated, and a stateful callback (a host-side counter, the
next batch of a data loader) advanced once per device, so the devices would
disagree on its result. So the operands are gathered (recorded against the
equation, like any reshard), the callback runs under a ``lax.cond`` on the
mesh's first device only, and its results reach the other devices by one
all-reduce of their bits (the others add zeros: every value exact, NaN
payloads and the sign of zero included). ``pure_callback`` is run the same
way, once, as ``jax.jit`` runs it. An ordered effect is bound as it is: jax
refuses ordered effects on more than one device, with or without gshard.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from gshard.spmd.partition.context import Context, Value
from gshard.spmd.partition.generic import safe_rule
from gshard.spmd.partition.reduce import allreduce_bytes_of
from gshard.spmd.sharding import TensorSharding

_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _carried(dtype) -> bool:
  """Whether a result of ``dtype`` can travel as bits (a bool, an integer or
  a real float of 1 to 8 bytes)."""
  try:
    d = np.dtype(dtype)
  except TypeError:
    return False
  return d == np.bool_ or (jnp.issubdtype(d, jnp.integer) or jnp.issubdtype(d, jnp.floating)) \
      and d.itemsize in _BITS


def _from_first(x, first, axes):
  """``x`` as the first device holds it, on every device: its bits summed
  with the others' zeros."""
  if x.dtype == np.bool_:
    return _from_first(x.astype(jnp.uint8), first, axes).astype(np.bool_)
  bits = lax.bitcast_convert_type(x, _BITS[x.dtype.itemsize])
  total = lax.psum(jnp.where(first, bits, jnp.zeros((), bits.dtype)), axes)
  return lax.bitcast_convert_type(total, x.dtype)


def once_rule(ctx: Context, eqn, ins: list[Value], scope, idx) -> list[Value]:
  """The operands gathered, the callback bound on the mesh's first device, its
  results (if any) sent from there to every device."""
  outs = [v.aval for v in eqn.outvars]
  if not all(_carried(a.dtype) for a in outs):
    return safe_rule(ctx, eqn, ins, scope, idx)
  xs = [v.x if v.literal else
        ctx.reshard(v, TensorSharding.replicated(len(v.shape)), eqn, f"operand {j}").x
        for j, v in enumerate(ins)]
  axes = tuple(ctx.mesh_sizes)

  def bind(operands) -> tuple:
    got = eqn.primitive.bind(*operands, **eqn.params)
    return tuple(got) if eqn.primitive.multiple_results else (got,) if outs else ()
  if eqn.params.get("ordered", False) or ctx.num_shards(axes) == 1:
    results = bind(xs)
  else:
    first = ctx.linear_index(axes) == 0
    got = lax.cond(first, bind, lambda _: tuple(jnp.zeros(a.shape, a.dtype) for a in outs),
                   xs)
    results = []
    for j, (r, a) in enumerate(zip(got, outs)):
      rep = TensorSharding.replicated(len(a.shape))
      ctx.record("psum", axes, allreduce_bytes_of(r, ctx.num_shards(axes)), eqn,
                 f"result {j}", rep, rep, a.shape, a.dtype)
      results.append(_from_first(r, first, axes))
  return [Value(r, TensorSharding.replicated(len(a.shape)), tuple(a.shape), a.dtype)
          for r, a in zip(results, outs)]
