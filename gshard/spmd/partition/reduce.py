"""Partition rules of reductions whose split needs a cross-device combine.

``reduce_sum`` over a split dim leaves a pending sum: the generic rule. A split
``reduce_max``/``reduce_min``/``reduce_or``/``reduce_and`` is reduced locally
and then combined across the devices (``pmax``/``pmin``); ``argmax``/``argmin``
take the local winner, then the globally first winner; ``top_k`` takes each
device's top k, then the top k of the gathered candidates; ``cumsum``/
``cumprod``/``cummax``/``cummin`` scan each block, then combine in the totals
of the blocks before it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

from gshard.spmd.partition.context import Context, Value
from gshard.spmd.partition.generic import (bind_local, mask_padding, reduction_identity,
                                          safe_rule)
from gshard.spmd.partition.plan import factor_rule_of, plan_local
from gshard.spmd.reshard import allreduce_bytes
from gshard.spmd.sharding import TensorSharding

# Cross-device combine for split non-sum reductions.
_COMBINE = {"reduce_max": "pmax", "reduce_min": "pmin", "reduce_or": "pmax",
            "reduce_and": "pmin", "pmax": "pmax", "pmin": "pmin"}


def allreduce_bytes_of(x, n: int) -> int:
  """Bytes one device sends to all-reduce the local array ``x`` over ``n`` devices."""
  return int(allreduce_bytes(x.size * x.dtype.itemsize, n))


_INT_OF = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


# Floats whose own bits order as their values once the negatives are flipped
# (a sign bit, -0.0, NaN at the top codes): the others (float8 fnuz types with
# NaN at -0.0's code, e8m0 without a sign bit, fp6/fp4) are keyed as float32,
# which holds each of their values exactly.
_OWN_KEY = frozenset(np.dtype(t) for t in (jnp.float16, jnp.bfloat16, jnp.float32,
                                           jnp.float64))


def _key_float(dtype):
  return np.dtype(dtype) if np.dtype(dtype) in _OWN_KEY else np.dtype(jnp.float32)


def ordered_key(x, nan_high: bool, signed_nan: bool = False):
  """An integer whose order is ``x``'s float order, with NaN above every number
  (``nan_high``) or below it; bools and integers as they are.

  A float's bits ``b`` (read as a signed integer) keep their order for
  ``b >= 0`` and reverse it below: ``b ^ 0x7F..F`` puts the negatives back in
  order. NaN takes the highest or lowest key; ``signed_nan``: a -NaN the
  next one in, so :func:`from_ordered_key` gives back a NaN of its sign, as
  one device's max/min returns its operand's NaN (argmax/argmin need every
  NaN equal: the first wins).
  """
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    return x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x
  f = x.astype(_key_float(x.dtype))
  itype = _INT_OF[f.dtype.itemsize]
  info = jnp.iinfo(itype)
  b = lax.bitcast_convert_type(f, itype)
  key = jnp.where(b >= 0, b, b ^ jnp.asarray(info.max, itype))
  nan, neg_nan = _nan_keys(itype, nan_high)
  nan_key = (jnp.where(b < 0, neg_nan, nan) if signed_nan else jnp.asarray(nan)).astype(itype)
  return jnp.where(jnp.isnan(f), nan_key, key)


def _nan_keys(itype, nan_high: bool):
  """The keys of +NaN and -NaN: the extreme key and the one next to it."""
  info = jnp.iinfo(itype)
  return (info.max, info.max - 1) if nan_high else (info.min, info.min + 1)


def from_ordered_key(k, dtype, nan_high: bool):
  """The inverse of :func:`ordered_key` (NaN the quiet NaN of its sign)."""
  if not jnp.issubdtype(dtype, jnp.inexact):
    return k.astype(dtype)
  b = jnp.where(k >= 0, k, k ^ jnp.asarray(jnp.iinfo(k.dtype).max, k.dtype))
  kf = _key_float(dtype)
  f = lax.bitcast_convert_type(b, kf)
  nan, neg_nan = _nan_keys(k.dtype, nan_high)
  f = jnp.where(k == nan, np.array(np.nan, kf),
                jnp.where(k == neg_nan, np.array(-np.nan, kf), f))
  return f.astype(dtype)


def _combine(x, op, axes, record):
  """``op`` (``lax.pmax``/``lax.pmin``) across ``axes`` as the unpartitioned
  max/min computes it: NaN anywhere gives NaN (a backend's all-reduce max may
  drop NaN: the values travel as order-preserving integer keys, one
  collective of the same bytes). Complex values (ordered by real part, then
  imaginary) are all-gathered and reduced as jax reduces them. ``record(y,
  kind)`` is called with what is sent."""
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    every = lax.all_gather(x, axes)
    record(every, "all_gather")
    return (jnp.max if op is lax.pmax else jnp.min)(every, axis=0)
  key = ordered_key(x, nan_high=op is lax.pmax, signed_nan=True)
  y = op(key, axes)
  record(y, None)
  return from_ordered_key(y, x.dtype, nan_high=op is lax.pmax)


def combine_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """A max/min/or/and over a split dim: the local reduction, then pmax/pmin
  (NaN-propagating for floats, as the unpartitioned max/min)."""
  try:
    factor_rule_of(eqn)
  except NotImplementedError:   # a case the sharding rule does not cover
    return safe_rule(ctx, eqn, ins, scope, idx)
  combine = _COMBINE[eqn.primitive.name]
  # or/and of integers are bitwise: no pmax/pmin combines them (the dim gathered)
  bitwise = (eqn.primitive.name in ("reduce_or", "reduce_and")
             and ins[0].dtype != jnp.bool_)
  plan = plan_local(ctx, eqn, ins, scope, allow_other_reduction=not bitwise)
  outs = bind_local(ctx, eqn, plan, ins)
  axes = tuple(a for f in plan.rule.other_reduction for a in plan.choice.get(f, ()))
  if not axes:
    return outs
  n = ctx.num_shards(axes)
  res = []
  for v in outs:
    def record(arr, kind, v=v):
      sent = arr.size // n * (n - 1) * arr.dtype.itemsize if kind else allreduce_bytes_of(arr, n)
      ctx.record(kind or combine, axes, sent, eqn, "result 0", v.sharding,
                 v.sharding, v.shape, v.dtype)
    y = _combine(v.x, getattr(lax, combine), axes, record)
    res.append(dataclasses.replace(v, x=y))
  return res


def arg_reduce_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """argmax/argmin over a split dim: each device's local winner, then the
  globally first winner; as in jax, the first NaN wins over any number."""
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
  best = (jnp.max if is_max else jnp.min)(masked, axis=axis)   # NaN if a local NaN
  if jnp.issubdtype(best.dtype, jnp.floating):   # -0.0 equals 0.0: the first index wins
    best = jnp.where(best == 0, jnp.zeros_like(best), best)
  glob = out.x + (ctx.linear_index(axes) * local_n).astype(out.x.dtype)
  n = ctx.num_shards(axes)

  def record(arr, kind):
    ctx.record(kind, axes, allreduce_bytes_of(arr, n), eqn, "result 0", out.sharding,
               out.sharding, out.shape, out.dtype)

  # the best local value as an ordered key (NaN the best of all, as the local
  # argmax/argmin of jax makes the first NaN win), then the first device index
  # holding the global best
  key = ordered_key(best, nan_high=is_max)
  top = (lax.pmax if is_max else lax.pmin)(key, axes)
  record(top, "pmax" if is_max else "pmin")
  big = jnp.iinfo(out.x.dtype).max
  winner = lax.pmin(jnp.where(key == top, glob, big), axes)
  record(winner, "pmin")
  return [dataclasses.replace(out, x=winner)]


def top_k_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``top_k`` along a split dim: each device takes the top ``min(k, rows)`` of
  its rows (with their global indices), the candidates are all-gathered
  along that dim (n of them per device instead of the whole dim), and the
  top k of the candidates is the result. Every element of the global top k
  is among its device's candidates, and among equal values the candidates
  keep the order of their global indices (device-major, each device's in
  index order), so ties resolve as on one device (jax: the lower index
  first); ``top_k`` orders floats totally (NaN highest, -0.0 below 0.0), so
  an uneven split's padding is filled with the lowest value of that order.
  Where the candidates would send more than the dim itself, the dim is
  gathered instead (the generic rule)."""
  plan = plan_local(ctx, eqn, ins, scope, allow_other_reduction=True)
  dim = eqn.params["axis"] % len(ins[0].shape)
  (f,) = plan.rule.operands[0][dim]
  axes = plan.choice.get(f, ())
  if not axes:
    return bind_local(ctx, eqn, plan, ins)
  dtype, k, n = ins[0].dtype, eqn.params["k"], ctx.num_shards(axes)
  rows = plan.operands[0].local_shape(ins[0].shape, ctx.mesh_sizes)[dim]
  kl, size = min(k, rows), jnp.dtype(dtype).itemsize
  if kl * (size + 4) >= rows * size or not jnp.issubdtype(dtype, jnp.number):
    # the candidates would send more than the rows: the dim gathered, the op whole
    return bind_local(ctx, eqn, plan_local(ctx, eqn, ins, scope, blocked=frozenset({f})), ins)
  x_val = ctx.reshard(ins[0], plan.operands[0], eqn, "operand 0")
  x = x_val.x
  if x_val.shape[dim] % n:
    # padding: the lowest value of top_k's order (-NaN's bits) where the type
    # keeps it; the others (float8: XLA makes e5m2's -NaN +NaN, e8m0's one NaN
    # is its top code) the lowest number, which the padding's higher indices
    # lose ties to
    lowest = (lax.bitcast_convert_type(jnp.asarray(-1, _INT_OF[jnp.dtype(dtype).itemsize]),
                                       dtype) if np.dtype(dtype) in _OWN_KEY
              else reduction_identity("reduce_max", dtype))
    pos = ctx.linear_index(axes) * rows + lax.broadcasted_iota(jnp.int32, x.shape, dim)
    x = jnp.where(pos < x_val.shape[dim], x, jnp.asarray(lowest, dtype))
  vals, idx_l = lax.top_k(x, kl, axis=dim)
  idx_g = idx_l + (ctx.linear_index(axes) * rows).astype(idx_l.dtype)
  cand_shape = tuple(n * kl if d == dim else m for d, m in enumerate(x_val.shape))
  split = x_val.sharding.without_partial()
  whole = TensorSharding(tuple(() if d == dim else a for d, a in enumerate(split.dims)))
  vals, idx_g = (ctx.reshard(Value(v, split, cand_shape, v.dtype), whole, eqn,
                             f"candidates ({what})").x
                 for v, what in ((vals, "values"), (idx_g, "indices")))
  top, j = lax.top_k(vals, k, axis=dim)
  out = [top, jnp.take_along_axis(idx_g, j, axis=dim)]
  return [Value(o, whole, tuple(v.aval.shape), v.aval.dtype) for o, v in zip(out, eqn.outvars)]


# a cumulative op: its combine, and the reduction whose identity fills padding
_SCAN = {"cumsum": (lax.add, "reduce_sum"), "cumprod": (lax.mul, "reduce_prod"),
         "cummax": (lax.max, "reduce_max"), "cummin": (lax.min, "reduce_min")}


def cumulative_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``cumsum``/``cumprod``/``cummax``/``cummin`` along a split dim: each
  device scans its own block; the blocks' totals (each block's last row, its
  first with ``reverse``) are all-gathered, one row per device instead of the
  whole dim; each device combines the total of the blocks before it (after
  it, ``reverse``) into its scan. A block with no real block before it keeps
  its scan as it is (no combine with an identity). An uneven split's padding
  holds the op's identity, so a reverse scan carries nothing from it. A float
  sum's -0.0 becomes 0.0 as in XLA's scan of more than one row, which adds
  its +0.0 init (a block of one row is not scanned by XLA). Integers come out bit for bit (wrapping sums and
  products are associative), max/min too; a float sum or product is
  reassociated at the block boundaries, as a sum over a split dim is."""
  del idx
  plan = plan_local(ctx, eqn, ins, scope)
  dim, reverse = eqn.params["axis"], eqn.params["reverse"]
  (f,) = plan.rule.operands[0][dim]
  axes = plan.choice.get(f, ())
  if not axes or ins[0].shape[dim] == 0:    # an empty dim: nothing to carry between blocks
    return bind_local(ctx, eqn, plan, ins)
  op, reduction = _SCAN[eqn.primitive.name]
  size, n = ins[0].shape[dim], ctx.num_shards(axes)
  out = plan.results[0]
  whole = TensorSharding(tuple(() if d == dim else a for d, a in enumerate(out.dims)),
                         out.partial)

  zero_sign = (eqn.primitive.name == "cumsum" and size > 1
               and jnp.issubdtype(ins[0].dtype, jnp.floating))

  def scan(x, **params):
    rows = x.shape[dim]
    me = ctx.linear_index(axes)
    identity = jnp.asarray(reduction_identity(reduction, x.dtype), x.dtype)
    if rows * n != size:   # padding at the dim's end
      pos = me * rows + lax.broadcasted_iota(jnp.int32, x.shape, dim)
      x = jnp.where(pos < size, x, identity)
    local = eqn.primitive.bind(x, **params)
    total = lax.index_in_dim(local, 0 if reverse else rows - 1, dim)
    shape = tuple(n if d == dim else m for d, m in enumerate(ins[0].shape))
    totals = ctx.reshard(Value(total, out, shape, total.dtype), whole, eqn,
                         "block totals").x
    j = lax.broadcasted_iota(jnp.int32, totals.shape, dim)
    before = (j > me) & (j * rows < size) if reverse else j < me
    # the reduction's own primitive (jax transposes reduce_sum; a generic
    # lax.reduce, which the identity traced inside the body made, it does not)
    offset = lax.expand_dims(getattr(lax, reduction)(jnp.where(before, totals, identity),
                                                     (dim,)), (dim,))
    if zero_sign:
      # XLA's scan of more than one row adds its +0.0 init: so does the first
      # block's (the offset is +0.0 there). A select on the values would
      # do the same, but not transpose (jax.grad of a partitioned cumsum)
      return op(offset, local)
    real_before = (me + 1) * rows < size if reverse else me > 0
    return jnp.where(real_before, op(offset, local), local)

  return bind_local(ctx, eqn, plan, ins, bind=scan)
