"""Gathers, scatters and dynamic slices along split dims, without gathering the operand.

A **gather** from a table split on its indexed dim (an embedding lookup with
the vocabulary split): each device looks up the rows it holds, zeros
elsewhere; the result is a pending sum over the table's split axes (where
moving the table to a feature split first sends fewer bytes, the local plan
does that instead: ``plan.py``). A **scatter-add** into a split operand: each
device keeps the updates that land in its rows. A KV cache split over its sequence dim is read
(``dynamic_slice``) by each device taking the rows it holds, zeros elsewhere:
the slice is a pending sum over that split, resolved with one psum of the
(small) slice. It is written (``dynamic_update_slice``) by each device keeping
the update rows that land in its block: no communication at all. Start
indices follow jax's semantics (clamped so the window fits).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.lax import GatherScatterMode

from gshard.spmd import linearity
from gshard.spmd.collectives import zeros
from gshard.spmd.partition.context import Context, Value
from gshard.spmd.partition.generic import bind_local, unkeyed
from gshard.spmd.partition.plan import factor_rule_of, note_options, plan_local
from gshard.spmd.sharding import TensorSharding


def _wide():
  """The platform's int: int32, int64 under x64."""
  return jax.dtypes.canonicalize_dtype(jnp.int64)


def _index(x, n: int):
  """An index of any integer dtype as the platform's int (int32; int64 under
  x64), with the arithmetic below done there: a narrow dtype would wrap a
  device's row offset (uint8 token ids into 300 rows), and a value past the
  wide int (a uint32 start of 2**32 - 1) is clamped to ``n`` first (past the
  end either way)."""
  wide = _wide()
  x = jnp.asarray(x)
  if jnp.iinfo(x.dtype).max > jnp.iinfo(wide).max:
    x = jnp.minimum(x, jnp.asarray(n, x.dtype))
  return x.astype(wide)


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


def _clamped_local(ctx: Context, eqn, ins, scope, *, window, blocked=frozenset()):
  """The op on local values, its start indices clamped first as jax clamps them
  (``0 <= start <= dim - window``, on the local shapes).

  jax's own clamp is inside the op; XLA's simplifier merges a dynamic slice of
  a dynamic slice (the local slice a reshard takes of the result) into one
  slice and clamps the merged start to the outer bounds only, so a start past
  the end would read past the window. An explicit clamp keeps it exact.
  """
  plan = plan_local(ctx, eqn, ins, scope, blocked=blocked)
  k = len(window)
  operand = ins[0]
  local = plan.operands[0].local_shape(operand.shape, ctx.mesh_sizes)
  wlocal = (plan.operands[1].local_shape(window, ctx.mesh_sizes)
            if eqn.primitive.name == "dynamic_update_slice" else
            plan.results[0].local_shape(window, ctx.mesh_sizes))
  first = len(ins) - k
  starts = [ctx.reshard(v, TensorSharding.replicated(0), eqn, f"operand {first + d}")
            for d, v in enumerate(ins[first:])]
  # in the platform's int: a bound past a narrow dtype's range would wrap
  wide = _wide()
  clamped = [Value(jnp.clip(_index(v.x, n), 0, max(0, n - w)) if not v.literal
                   else np.asarray(min(max(int(v.x), 0), max(0, n - w)), wide),
                   TensorSharding.replicated(0), (), wide, literal=v.literal)
             for v, n, w in zip(starts, local, wlocal)]
  return bind_local(ctx, eqn, plan, list(ins[:first]) + clamped)


def dynamic_slice_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``dynamic_slice`` along split dims: each device reads the rows it holds
  (zeros elsewhere); the slice is a pending sum over those dims' axes."""
  operand = ins[0]
  sizes = eqn.params["slice_sizes"]
  full = operand.shape
  split = [d for d in range(len(full)) if operand.sharding.dims[d] and sizes[d] != full[d]]
  if not split or operand.sharding.partial:
    return _clamped_local(ctx, eqn, ins, scope, window=sizes)
  starts = _starts(ctx, eqn, ins[1:])
  x = operand.x
  local = operand.sharding.local_shape(full, ctx.mesh_sizes)
  for d, n in enumerate(full):
    if sizes[d] == n:
      continue
    start = jnp.clip(_index(starts[d], n), 0, n - sizes[d])
    axes = operand.sharding.dims[d]
    if not axes:
      x = lax.dynamic_slice_in_dim(x, start, sizes[d], axis=d)
      continue
    rows, ok = _rows(ctx, axes, local[d], n, start, sizes[d])
    x = jnp.take(x, rows, axis=d)
    x = jnp.where(_mask_along(ok, d, x.shape), x, zeros((), x.dtype))
  dims = tuple(() if sizes[d] != full[d] else operand.sharding.dims[d]
               for d in range(len(full)))
  partial = frozenset(a for d in split for a in operand.sharding.dims[d])
  out = eqn.outvars[0]
  return [Value(x, TensorSharding(dims, partial), tuple(out.aval.shape), out.aval.dtype)]


def dynamic_update_slice_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``dynamic_update_slice`` along split dims: each device writes the update rows
  that land in its block; no communication."""
  operand, update = ins[0], ins[1]
  full, usize = operand.shape, update.shape
  if 0 in usize:          # an empty update writes nothing
    return [ctx.reshard(operand, operand.sharding.without_partial(), eqn, "operand 0")]
  split = [d for d in range(len(full)) if operand.sharding.dims[d] and usize[d] != full[d]]
  if not split:
    # The plain local op: the update's dims must not be split where it is
    # smaller than the operand (its offset dims).
    rule = factor_rule_of(eqn)
    op_f = {f for d in rule.operands[0] for f in d}
    upd_f = {f for d in rule.operands[1] for f in d}
    offset = frozenset(op_f ^ upd_f)      # the offset dims' factors, in both
    return _clamped_local(ctx, eqn, ins, scope, window=update.shape, blocked=offset)
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
    start = jnp.clip(_index(starts[d], n), 0, n - usize[d])
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


def _index_offsets(ctx, eqn, plan, op_dims_factors, indexed_dims, op_value):
  """For each indexed operand dim split by the plan: (dim, axes, local size, offset)."""
  out = []
  for d in indexed_dims:
    (f,) = op_dims_factors[d]
    axes = plan.choice.get(f, ())
    if axes:
      local = op_value.sharding.local_shape(op_value.shape, ctx.mesh_sizes)[d]
      out.append((d, axes, local, ctx.linear_index(axes) * local))
  return out


def _lookup_plan(ctx: Context, eqn, ins, scope):
  """The local plan of a gather or scatter, its alternatives recorded for
  ``explain()`` with the operands as they arrive (the rule moves them before
  ``bind_local``, which would record them again, moved)."""
  plan = plan_local(ctx, eqn, ins, scope)
  note_options(ctx, eqn, plan, ins)
  return dataclasses.replace(plan, options=())


def gather_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """A lookup into a split table: each device looks up the rows it holds.

  Indices outside the local rows read row 0 and are masked to zero; the result
  is a pending sum over the table's split axes (an embedding lookup with the
  vocabulary split never gathers the table).
  """
  del idx
  dn = eqn.params["dimension_numbers"]
  mode = eqn.params["mode"]
  plan = _lookup_plan(ctx, eqn, ins, scope)
  operand = ctx.reshard(ins[0], plan.operands[0], eqn, "operand 0")
  indices = ctx.reshard(ins[1], plan.operands[1], eqn, "operand 1")
  split = _index_offsets(ctx, eqn, plan, plan.rule.operands[0],
                         [d for d in dn.collapsed_slice_dims if d in dn.start_index_map],
                         operand)
  if not split:
    return bind_local(ctx, eqn, plan, [operand, indices])
  full = eqn.invars[0].aval.shape
  idx_x = indices.x
  in_range = None
  oob = None
  comps = []
  for k, d in enumerate(dn.start_index_map):
    comps.append(_index(idx_x[..., k], full[d]))
  for d, axes, local, offset in split:
    k = list(dn.start_index_map).index(d)
    g = comps[k]
    is_fill = "FILL" in str(mode)
    if is_fill:
      bad = (g < 0) | (g >= full[d])
      oob = bad if oob is None else (oob | bad)
    else:
      g = jnp.clip(g, 0, full[d] - 1)
    loc = g - offset.astype(g.dtype)
    ok = (loc >= 0) & (loc < local)
    in_range = ok if in_range is None else (in_range & ok)
    comps[k] = jnp.where(ok, loc, 0)
  new_idx = jnp.stack(comps, axis=-1)
  (out,) = bind_local(ctx, _rewritten(eqn), plan,
                      [operand, dataclasses.replace(indices, x=new_idx)])
  out_rank = len(out.shape)
  batch_dims = [i for i in range(out_rank) if i not in dn.offset_dims]
  local_out = out.sharding.local_shape(out.shape, ctx.mesh_sizes)
  mask = lax.broadcast_in_dim(in_range, local_out, batch_dims)
  y = jnp.where(mask, out.x, zeros((), out.x.dtype))
  if oob is not None:
    fill = eqn.params.get("fill_value")
    if fill is None:
      fill = (jnp.nan if jnp.issubdtype(out.x.dtype, jnp.inexact)
              else (jnp.iinfo(out.x.dtype).min if jnp.issubdtype(out.x.dtype, jnp.signedinteger)
                    else jnp.iinfo(out.x.dtype).max))
    first = None
    for _, axes, _, _ in split:
      f0 = ctx.linear_index(axes) == 0
      first = f0 if first is None else (first & f0)
    put = lax.broadcast_in_dim(oob, local_out, batch_dims) & first
    y = jnp.where(put, jnp.asarray(fill, out.x.dtype), y)
  return [dataclasses.replace(out, x=y)]


def scatter_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """A scatter (add, sub, set, mul, min, max) into a split operand: each device
  applies the updates that land in the rows it holds and drops the others.

  With the indices and updates split (their scattered dims are ``sum``
  factors), each device adds its share of the updates and the result is a
  pending sum over those axes; the operand then enters the sum once (on the
  first device of those axes), not once per device.
  """
  del idx
  dn = eqn.params["dimension_numbers"]
  plan = _lookup_plan(ctx, eqn, ins, scope)
  vals = [ctx.reshard(v, s, eqn, f"operand {j}") if s is not None else v
          for j, (v, s) in enumerate(zip(ins, plan.operands))]
  summed = tuple(a for f in sorted(plan.rule.reduction) for a in plan.choice.get(f, ())
                 if a not in vals[0].sharding.partial)
  if summed and ctx.graph.mark_of(scope, eqn.invars[0]) is not linearity.ZERO:
    # (zeros, a transpose's fresh buffer, are the same on every device)
    first = ctx.linear_index(summed) == 0
    vals[0] = dataclasses.replace(vals[0], x=jnp.where(first, vals[0].x,
                                                       zeros((), vals[0].x.dtype)))
  split = _index_offsets(ctx, eqn, plan, plan.rule.operands[0],
                         [d for d in dn.inserted_window_dims
                          if d in dn.scatter_dims_to_operand_dims], vals[0])
  real = _real_index_rows(ctx, vals[1])
  if not split and real is None:
    return bind_local(ctx, eqn, plan, vals)
  full = eqn.invars[0].aval.shape
  idx_x = vals[1].x
  sdims = list(dn.scatter_dims_to_operand_dims)
  comps = [_index(idx_x[..., k], full[d]) for k, d in enumerate(sdims)]
  if "CLIP" in str(eqn.params["mode"]):      # jax's clip: every window fits
    window = _scatter_window(eqn)
    comps = [jnp.clip(c, 0, full[d] - window[d]) for c, d in zip(comps, sdims)]
  drop = GatherScatterMode.FILL_OR_DROP
  if not split:
    # indices split unevenly: their padding rows are no updates; sent out of
    # bounds, they are dropped
    comps[0] = jnp.where(real, comps[0], full[sdims[0]])
    fixed = dataclasses.replace(vals[1], x=jnp.stack(comps, axis=-1))
    return bind_local(ctx, _rewritten(eqn, mode=drop), plan, [vals[0], fixed, vals[2]])
  # Each update that lands outside this device's rows is sent out of bounds,
  # where the scatter drops it. The operand is a barrier's: XLA (jaxlib
  # 0.10.2) has been seen to misplace out-of-bounds updates once the scatter
  # is fused with a pad that makes its operand (a user's pad, or an uneven
  # split's; found with even splits too).
  x = lax.optimization_barrier(vals[0].x)
  for d, axes, local, offset in split:
    k = sdims.index(d)
    g = comps[k]
    loc = g - offset.astype(g.dtype)
    ok = (loc >= 0) & (loc < local) & (g >= 0) & (g < full[d])
    if real is not None:         # a padding row of unevenly split indices
      ok = ok & real
    comps[k] = jnp.where(ok, loc, local)
  new_idx = jnp.stack(comps, axis=-1)
  eqn2 = _rewritten(eqn, mode=drop)
  y = eqn2.primitive.bind(x, new_idx, vals[2].x, **eqn2.params)
  out = eqn.outvars[0]
  return [Value(y, plan.results[0], tuple(out.aval.shape), out.aval.dtype)]


def _rewritten(eqn, **params):
  """``eqn`` for rewritten indices (local rows, masked or out-of-bounds
  ones): no longer sorted or unique, so it claims neither (a backend may
  rely on those hints)."""
  return eqn.replace(params=unkeyed({**eqn.params, "indices_are_sorted": False,
                                     "unique_indices": False, **params}))


def _real_index_rows(ctx: Context, indices: Value):
  """Which index rows (all dims but the index vector's) are real, not the
  padding of an uneven split; None when no dim of them is split unevenly."""
  if indices.literal:
    return None
  shape = indices.shape
  local = indices.sharding.local_shape(shape, ctx.mesh_sizes)
  real = None
  for d, axes in enumerate(indices.sharding.dims[:-1]):
    if axes and shape[d] % ctx.num_shards(axes):
      pos = ctx.linear_index(axes) * local[d] + lax.iota(jnp.int32, local[d])
      m = lax.broadcast_in_dim(pos < shape[d], tuple(local[:-1]), (d,))
      real = m if real is None else (real & m)
  return real


def _scatter_window(eqn) -> list[int]:
  """Per operand dim, the size of the update window along it (1 where inserted)."""
  dn = eqn.params["dimension_numbers"]
  upd_shape = eqn.invars[2].aval.shape
  op_rank = len(eqn.invars[0].aval.shape)
  window_dims = [d for d in range(op_rank)
                 if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
  size = [1] * op_rank
  for d, u in zip(window_dims, dn.update_window_dims):
    size[d] = upd_shape[u]
  return size
