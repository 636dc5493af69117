"""Partition rules of shape ops that need more than the op on local shapes.

``iota`` along a split dim adds this device's offset. ``slice``, ``pad`` and
``rev`` along a split dim whose result stays split the same way exchange a
halo (``partition/halo.py``; often none) or permute whole blocks (``rev``:
device i gets block n-1-i) and run locally. When no dim can stay split, the
generic rule gathers it (its sharding rule blocks it). ``concatenate`` and
``split`` along a split dim have no rule here: the generic plan moves the
split to another dim first (``PIECES`` in ``partition/plan.py``) or gathers.
``reshape`` of a split dim into micro-batches (``[B@data] -> [K, M@data]``,
``spmd/relayout.py``) moves rows by ppermute rounds (an exchange), then reshapes
locally.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

from gshard.spmd import collectives, relayout
from gshard.spmd.partition.context import Context, Value
from gshard.spmd.partition.generic import bind_local, generic_rule
from gshard.spmd.partition.halo import (blocked_reason, check_shape, dilate, halo_plan,
                                        haloed, permute)
from gshard.spmd.partition.plan import LocalPlan, factor_rule_of, plan_local
from gshard.spmd.sharding import TensorSharding, itemsize


def iota_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """Local iota plus this device's offset along a split ``dimension``."""
  del idx
  plan = plan_local(ctx, eqn, ins, scope)
  (out,) = bind_local(ctx, eqn, plan, ins)
  dim = eqn.params["dimension"]
  axes = out.sharding.dims[dim]
  if axes:
    local = out.sharding.local_shape(out.shape, ctx.mesh_sizes)[dim]
    if jnp.issubdtype(out.x.dtype, jnp.inexact):
      # the global position as an integer, rounded once (as jax's iota is):
      # the local iota and the offset rounded apart, then their sum, differ
      # in a low-precision float (bf16 from 256 on)
      pos = lax.broadcasted_iota(jnp.int32, out.x.shape, dim) + ctx.linear_index(axes) * local
      return [dataclasses.replace(out, x=pos.astype(out.x.dtype))]
    offset = (ctx.linear_index(axes) * local).astype(out.x.dtype)
    out = dataclasses.replace(out, x=out.x + offset)
  return [out]


def _keep_split(ctx: Context, eqn, ins, scope, plan: LocalPlan, dims, geometry):
  """Dims of operand 0 that stay split through the op: split ``A`` in the
  operand and in the result's target, with ``geometry(d, n)`` not a reason.

  Returns (operand sharding, result sharding, {dim: (axes, geometry)}), or
  None when no dim stays split.
  """
  have = ins[0].sharding
  want = ctx.target(scope, eqn.outvars[0])
  op_dims, out_dims = list(plan.operands[0].dims), list(plan.results[0].dims)
  kept = {}
  for d in dims:
    axes = have.dims[d]
    if not axes or want.dims[d] != axes:
      continue
    geo = geometry(d, ctx.num_shards(axes))
    if isinstance(geo, str):
      continue
    trial_op = op_dims[:d] + [axes] + op_dims[d + 1:]
    trial_out = out_dims[:d] + [axes] + out_dims[d + 1:]
    try:
      TensorSharding(tuple(trial_op), plan.operands[0].partial)
      TensorSharding(tuple(trial_out), plan.results[0].partial)
    except ValueError:     # the plan already uses those axes elsewhere
      continue
    op_dims, out_dims = trial_op, trial_out
    kept[d] = (axes, geo)
  if not kept:
    return None
  return (TensorSharding(tuple(op_dims), plan.operands[0].partial),
          TensorSharding(tuple(out_dims), plan.results[0].partial), kept)


def _slice_geometry(eqn, d: int, n: int):
  p = eqn.params
  L = eqn.invars[0].aval.shape[d]
  M = eqn.outvars[0].aval.shape[d]
  stride = (p["strides"] or (1,) * len(p["start_indices"]))[d]
  why = blocked_reason(n, {"input": L, "output": M})
  if why:
    return why
  block = M // n
  return halo_plan(n, L, -p["start_indices"][d], block * stride,
                   (block - 1) * stride + 1) or "halo wider than one shard"


def slice_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``slice`` along a split dim whose result stays split: a halo (none when the
  slice stays within each block) and a local (dynamic) slice."""
  p = eqn.params
  plan = plan_local(ctx, eqn, ins, scope)
  shape = eqn.invars[0].aval.shape
  sliced = [d for d in range(len(shape))
            if (p["start_indices"][d], p["limit_indices"][d]) != (0, shape[d])
            or (p["strides"] and p["strides"][d] != 1)]
  keep = _keep_split(ctx, eqn, ins, scope, plan, sliced,
                     lambda d, n: _slice_geometry(eqn, d, n))
  if keep is None:
    return generic_rule(ctx, eqn, ins, scope, idx)
  op_s, out_s, kept = keep
  v = ctx.reshard(ins[0], op_s, eqn, "operand 0")
  x = v.x
  strides = list(p["strides"] or (1,) * len(shape))
  starts, limits = list(p["start_indices"]), list(p["limit_indices"])
  for d in range(len(shape)):
    if d in kept:
      axes, halo = kept[d]
      x = haloed(ctx, v, x, d, axes, halo, 0, eqn, "operand 0")
      starts[d], limits[d] = 0, halo.width
    elif op_s.dims[d]:      # a dim kept whole by the slice, split: local rows
      starts[d], limits[d] = 0, np.shape(x)[d]
  y = lax.slice(x, starts, limits, strides)
  out_shape = tuple(eqn.outvars[0].aval.shape)
  check_shape("slice", y, out_s.local_shape(out_shape, ctx.mesh_sizes), out_s)
  return [Value(y, out_s, out_shape, eqn.outvars[0].aval.dtype)]


def _pad_geometry(eqn, d: int, n: int):
  lo, hi, interior = eqn.params["padding_config"][d]
  L = eqn.invars[0].aval.shape[d]
  M = eqn.outvars[0].aval.shape[d]
  why = blocked_reason(n, {"input": L, "output": M})
  if why:
    return why
  halo = halo_plan(n, L * (interior + 1), lo, M // n, M // n)
  return halo or "halo wider than one shard"


def pad_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``pad`` along a split dim whose result stays split: dilate locally (interior
  padding), exchange the halo, take this device's rows; the pad value fills."""
  p = eqn.params
  plan = plan_local(ctx, eqn, ins, scope)
  padded = [d for d, c in enumerate(p["padding_config"]) if tuple(c) != (0, 0, 0)]
  keep = _keep_split(ctx, eqn, ins, scope, plan, padded,
                     lambda d, n: _pad_geometry(eqn, d, n))
  if keep is None:
    return generic_rule(ctx, eqn, ins, scope, idx)
  op_s, out_s, kept = keep
  v = ctx.reshard(ins[0], op_s, eqn, "operand 0")
  fill = ctx.reshard(ins[1], TensorSharding.replicated(0), eqn, "operand 1").x
  x = v.x
  config = list(p["padding_config"])
  for d, (axes, halo) in kept.items():
    x = dilate(x, d, config[d][2] + 1, fill)
    x = haloed(ctx, v, x, d, axes, halo, fill, eqn, "operand 0")
    config[d] = (0, 0, 0)
  y = lax.pad(x, jnp.asarray(fill, x.dtype), config)
  out_shape = tuple(eqn.outvars[0].aval.shape)
  check_shape("pad", y, out_s.local_shape(out_shape, ctx.mesh_sizes), out_s)
  return [Value(y, out_s, out_shape, eqn.outvars[0].aval.dtype)]


def rev_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``rev`` along a split dim that stays split: device i takes block n-1-i
  (one ppermute of the whole block), then reverses it locally. Only an even
  split: with padding, block n-1-i reversed would put the padding first."""
  plan = plan_local(ctx, eqn, ins, scope)
  shape = eqn.invars[0].aval.shape
  keep = _keep_split(ctx, eqn, ins, scope, plan, eqn.params["dimensions"],
                     lambda d, n: blocked_reason(n, {"dim": shape[d]}))
  if keep is None:
    return generic_rule(ctx, eqn, ins, scope, idx)
  op_s, out_s, kept = keep
  v = ctx.reshard(ins[0], op_s, eqn, "operand 0")
  x = v.x
  for d, (axes, _) in kept.items():
    n = ctx.num_shards(axes)
    if n == 1:           # axes of size 1: the block is the whole dim
      continue
    x = permute(ctx, x, axes, lambda i: n - 1 - i)
    ctx.record("ppermute", axes, int(np.prod(np.shape(x))) * itemsize(x.dtype),
               eqn, f"operand 0 blocks reversed (dim {d})", v.sharding, out_s, v.shape,
               v.dtype)
  y = lax.rev(x, eqn.params["dimensions"])
  return [Value(y, out_s, tuple(eqn.outvars[0].aval.shape), eqn.outvars[0].aval.dtype)]


def reshape_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``reshape`` that carries a split across by moving rows
  (:mod:`gshard.spmd.relayout`): ``[B@A] -> [K, M@A]`` runs ``K`` ppermute
  rounds on the operand's block, then the local reshape; ``[K, M@A] -> [B@A]``
  the local reshape, then the rounds the other way. Any other reshape (and
  one whose layouts do not fit: uneven, other factors split, a key array) is
  the generic rule's."""
  v = ins[0]
  move = None if v.literal or collectives.is_key(v.dtype) else relayout.find(
      factor_rule_of(eqn), eqn, v.sharding.dims, ctx.mesh_sizes)
  out_shape = tuple(eqn.outvars[0].aval.shape)
  if move is None or ctx.target(scope, eqn.outvars[0]).dims[
      relayout.target_dim(move)] != move.axes:
    return generic_rule(ctx, eqn, ins, scope, idx)
  plan = plan_local(ctx, eqn, ins, scope)
  op_dims, out_dims = list(plan.operands[0].dims), list(plan.results[0].dims)
  # the move's dims as the move lays them out (the plan's factors gather the
  # compound dim, or hold a first axis on the micro-batches), the others as
  # the plan has them
  compound, rows = (out_dims, op_dims) if move.merge else (op_dims, out_dims)
  for d in move.before:
    rows[d] = ()
  compound[move.compound] = rows[move.rows] = move.axes
  try:
    op_s = TensorSharding(tuple(op_dims), plan.operands[0].partial)
    out_s = TensorSharding(tuple(out_dims), plan.results[0].partial)
  except ValueError:        # the plan uses those axes elsewhere
    return generic_rule(ctx, eqn, ins, scope, idx)
  if not (op_s.is_even(v.shape, ctx.mesh_sizes) and out_s.is_even(out_shape, ctx.mesh_sizes)):
    return generic_rule(ctx, eqn, ins, scope, idx)
  v = ctx.reshard(v, op_s, eqn, "operand 0")
  local = out_s.local_shape(out_shape, ctx.mesh_sizes)
  if move.merge:     # recorded as the result's rows, of the operand's dtype
    y = _move_rows(ctx, lax.reshape(v.x, local), move.compound, move, eqn, out_s,
                   out_shape, v.dtype)
  else:
    y = lax.reshape(_move_rows(ctx, v.x, move.compound, move, eqn, op_s, v.shape,
                               v.dtype), local)
  return [Value(y, out_s, out_shape, eqn.outvars[0].aval.dtype)]


def _move_rows(ctx: Context, x, dim: int, move: relayout.Move, eqn,
               layout: TensorSharding, shape, dtype):
  """This device's block of ``dim`` (``K`` pieces of ``M/n`` rows) after the
  ppermute rounds of ``move`` (a merge: the rounds reversed), run as an
  exchange; the rounds are recorded as moving rows of a value of ``shape``
  laid out as ``layout`` (the blocks keep their size, in another order)."""
  ex = relayout.exchange_of(move, tuple(np.shape(x)), dim, itemsize(x.dtype),
                            ctx.num_shards(move.axes))
  for r in range(len(ex.rounds)):
    ctx.record("ppermute", move.axes, ex.bytes_per_device // len(ex.rounds), eqn,
               f"operand 0 rows moved to dim {relayout.target_dim(move)} (round "
               f"{r + 1} of {len(ex.rounds)})", layout, layout, shape, dtype)
  return collectives.run_exchange(x, ex, ctx.mesh_sizes)
