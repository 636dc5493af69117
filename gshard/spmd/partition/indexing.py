"""dynamic_slice / dynamic_update_slice along split dims, without gathering.

A KV cache split over its sequence dim is read (``dynamic_slice``) by each
device taking the rows it holds, zeros elsewhere: the slice is a pending sum
over that split, resolved with one psum of the (small) slice. It is written
(``dynamic_update_slice``) by each device keeping the update rows that land in
its block: no communication at all. Start indices follow jax's semantics
(clamped so the window fits).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from gshard.spmd.partition.context import Context, Value
from gshard.spmd.partition.rules import generic_rule, partition_rules
from gshard.spmd.sharding import TensorSharding


def _starts(ctx: Context, eqn, ins: list[Value]):
  """Start indices as replicated scalars."""
  return [v.x if v.literal else
          ctx.reshard(v, TensorSharding.replicated(0), eqn, f"operand {k + 1}").x
          for k, v in enumerate(ins)]


def _rows(ctx, axes, local: int, n: int, start, size: int):
  """For a dim of global size ``n`` split over ``axes`` into blocks of ``local``:
  (local row of each of the ``size`` wanted rows, clipped; mask of rows held here)."""
  offset = ctx.linear_index(axes) * local if axes else 0
  want = start + jnp.arange(size, dtype=jnp.int32)
  loc = want - offset
  ok = (loc >= 0) & (loc < local) & (want < n)
  return jnp.clip(loc, 0, local - 1), ok


def _mask_along(mask, dim: int, shape):
  return lax.broadcast_in_dim(mask, shape, (dim,))


def dynamic_slice_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  operand = ins[0]
  sizes = eqn.params["slice_sizes"]
  full = operand.shape
  split = [d for d in range(len(full)) if operand.sharding.dims[d] and sizes[d] != full[d]]
  if not split or operand.sharding.partial:
    return generic_rule(ctx, eqn, ins, scope, idx)
  starts = _starts(ctx, eqn, ins[1:])
  x = operand.x
  local = operand.sharding.local_shape(full, ctx.mesh_sizes)
  mask = None
  for d, n in enumerate(full):
    if sizes[d] == n:
      continue
    start = jnp.clip(starts[d].astype(jnp.int32), 0, n - sizes[d])
    axes = operand.sharding.dims[d]
    if not axes:
      x = lax.dynamic_slice_in_dim(x, start, sizes[d], axis=d)
      continue
    rows, ok = _rows(ctx, axes, local[d], n, start, sizes[d])
    x = jnp.take(x, rows, axis=d)
    m = _mask_along(ok, d, x.shape)
    mask = m if mask is None else (mask & m)
  if mask is not None:
    x = jnp.where(mask, x, jnp.zeros((), x.dtype))
  dims = tuple(() if sizes[d] != full[d] else operand.sharding.dims[d]
               for d in range(len(full)))
  partial = frozenset(a for d in split for a in operand.sharding.dims[d])
  out = eqn.outvars[0]
  return [Value(x, TensorSharding(dims, partial), tuple(out.aval.shape), out.aval.dtype)]


def dynamic_update_slice_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  operand, update = ins[0], ins[1]
  full, usize = operand.shape, update.shape
  split = [d for d in range(len(full)) if operand.sharding.dims[d] and usize[d] != full[d]]
  if not split:
    return generic_rule(ctx, eqn, ins, scope, idx)
  operand = ctx.reshard(operand, operand.sharding.without_partial(), eqn, "operand 0")
  upd_s = TensorSharding(tuple(operand.sharding.dims[d] if usize[d] == full[d] else ()
                               for d in range(len(full))))
  update = ctx.reshard(update, upd_s, eqn, "operand 1")
  starts = _starts(ctx, eqn, ins[2:])
  local = operand.sharding.local_shape(full, ctx.mesh_sizes)
  u = update.x
  mask = None
  for d, n in enumerate(full):
    if usize[d] == n:
      continue
    start = jnp.clip(starts[d].astype(jnp.int32), 0, n - usize[d])
    axes = operand.sharding.dims[d]
    offset = ctx.linear_index(axes) * local[d] if axes else 0
    held = offset + jnp.arange(local[d], dtype=jnp.int32)     # global rows held here
    rel = held - start
    ok = (rel >= 0) & (rel < usize[d]) & (held < n)
    u = jnp.take(u, jnp.clip(rel, 0, usize[d] - 1), axis=d)
    m = _mask_along(ok, d, tuple(local))
    mask = m if mask is None else (mask & m)
  x = jnp.where(mask, u.astype(operand.x.dtype), operand.x)
  out = eqn.outvars[0]
  return [Value(x, operand.sharding, tuple(out.aval.shape), out.aval.dtype)]


partition_rules.update({"dynamic_slice": dynamic_slice_rule,
                        "dynamic_update_slice": dynamic_update_slice_rule})
