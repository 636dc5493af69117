"""Partition rules of windowed ops: convolution, pooling and their gradients.

Each keeps a split spatial dim split by exchanging halos (``partition/halo.py``).

The ops and what runs per device:

=========================  ==========================================================
``conv_general_dilated``   batch / output-feature splits: local; input features:
                           partial sum; spatial: halo of the input (lhs), local
                           VALID convolution. ``lhs_dilation`` is applied locally
                           first. The weight gradient (the image split in both
                           operands) is a halo plus a partial sum.
``reduce_window*``,        halo of every operand, local op without padding
``select_and_gather_add``
``select_and_scatter_add`` halo of operand and source; each device scatters the
                           windows that touch its block and keeps its block
``slice``, ``pad``         along a split dim whose result stays split the same way:
                           a halo (often none), a local (dynamic) slice
``rev``                    along a split dim that stays split: a ppermute of whole
                           blocks (device i gets block n-1-i), then a local rev
=========================  ==========================================================

When a plan cannot keep a dim split (sizes not divisible by the shards, a halo
wider than a block, misaligned pooling for ``select_and_scatter_add``) the dim
is gathered and the op computed with it whole; the gathering reshard's role
says why (``explain()`` shows it). ``concatenate`` along a split dim has no
rule here: the generic rule gathers that dim (its sharding rule blocks it).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

from gshard.spmd.partition.context import Context, Value
from gshard.spmd.partition.generic import reduction_identity, unkeyed
from gshard.spmd.partition.halo import (Halo, blocked_reason, check_shape, dilate, halo_plan,
                                        haloed, plan_with_halos, role_with)
from gshard.spmd.partition.plan import factor_rule_of, note_options


# -- convolution ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _ConvDim:
  halo: Halo
  dilation: int    # lhs_dilation, applied locally before the exchange


def _conv_geometry(eqn, rule, dim: int, n: int):
  p = eqn.params
  lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
  j = list(lhs_spec).index(dim) - 2      # spatial index of lhs dim ``dim``
  L = eqn.invars[0].aval.shape[dim]
  K = eqn.invars[1].aval.shape[rhs_spec[2 + j]]
  Q = eqn.outvars[0].aval.shape[out_spec[2 + j]]
  s, rd, ld = p["window_strides"][j], p["rhs_dilation"][j], p["lhs_dilation"][j]
  lo = p["padding"][j][0]
  if rule.results[0][out_spec[2 + j]] == rule.operands[0][dim]:
    # the output shares the input's factor: each device makes Q/n output rows
    # with the whole kernel
    why = blocked_reason(n, {"input": L, "output": Q})
    block = Q // n
    advance, width = block * s, (block - 1) * s + (K - 1) * rd + 1
  else:                # weight gradient: each device contracts K/n rows of rhs
    why = blocked_reason(n, {"input": L, "window": K})
    block = K // n
    advance, width = block * rd, (block - 1) * rd + (Q - 1) * s + 1
  if why:
    return why
  halo = halo_plan(n, L * ld, lo, advance, width)
  if halo is None:
    return f"its halo is wider than one shard of {L // n} rows"
  return _ConvDim(halo, ld)


def conv_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``conv_general_dilated``: halo exchange on split spatial dims of the input."""
  del idx
  p = eqn.params
  lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
  rule = factor_rule_of(eqn)
  factors = {d: rule.operands[0][d][0] for d in lhs_spec[2:]}
  plan, kept, notes = plan_with_halos(ctx, eqn, ins, scope, factors,
                                       lambda d, n: _conv_geometry(eqn, rule, d, n))
  note_options(ctx, eqn, plan, ins)
  lhs = ctx.reshard(ins[0], plan.operands[0], eqn, role_with("operand 0", notes))
  rhs = ctx.reshard(ins[1], plan.operands[1], eqn, role_with("operand 1", notes))
  x = lhs.x
  padding, lhs_dilation = list(p["padding"]), list(p["lhs_dilation"])
  for dim, (axes, geo) in kept.items():
    j = list(lhs_spec).index(dim) - 2
    x = dilate(x, dim, geo.dilation, 0)
    x = haloed(ctx, lhs, x, dim, axes, geo.halo, 0, eqn, "operand 0")
    padding[j], lhs_dilation[j] = (0, 0), 1
  groups = {}
  for key, spec_dim in (("feature_group_count", lhs_spec[1]),
                        ("batch_group_count", lhs_spec[0])):
    count = p[key]
    if count > 1:
      g = rule.operands[0][spec_dim][0]
      count //= ctx.num_shards(plan.choice.get(g, ()))
    groups[key] = count
  params = dict(p, padding=tuple(padding), lhs_dilation=tuple(lhs_dilation),
                out_sharding=None, **groups)
  y = eqn.primitive.bind(x, rhs.x, **params)
  out_shape = tuple(eqn.outvars[0].aval.shape)
  check_shape("conv_general_dilated", y,
               plan.results[0].local_shape(out_shape, ctx.mesh_sizes), plan.results[0])
  return [Value(y, plan.results[0], out_shape, eqn.outvars[0].aval.dtype)]


# -- pooling: reduce_window and select_and_gather_add ---------------------------

def _max_identity(dtype):
  return reduction_identity("reduce_max", dtype)


def _min_identity(dtype):
  return reduction_identity("reduce_min", dtype)


_POOL_FILL = {
    "reduce_window_sum": lambda dtype: 0,
    "reduce_window_max": _max_identity,
    "reduce_window_min": _min_identity,
}


def _pool_operands(eqn) -> int:
  name = eqn.primitive.name
  if name == "reduce_window":
    return len(eqn.invars) // 2
  return 2 if name == "select_and_gather_add" else 1


def _pool_fills(eqn, vals: list[Value]) -> list:
  """The value of padding (the reduction's identity) for each array operand."""
  name = eqn.primitive.name
  dtype = np.dtype(eqn.invars[0].aval.dtype)
  if name == "reduce_window":
    k = _pool_operands(eqn)
    return [v.x for v in vals[k:]]
  if name == "select_and_gather_add":
    ident = (_max_identity if eqn.params["select_prim"] is lax.ge_p
             else _min_identity)
    return [0, ident(np.dtype(eqn.invars[1].aval.dtype))]
  return [_POOL_FILL[name](dtype)]


@dataclasses.dataclass(frozen=True)
class _PoolDim:
  halo: Halo
  dilation: int    # base_dilation, applied locally before the exchange


def _pool_geometry(eqn, j: int, n: int):
  p = eqn.params
  L = eqn.invars[0].aval.shape[j]
  Q = eqn.outvars[0].aval.shape[j]
  w, s = p["window_dimensions"][j], p["window_strides"][j]
  bd, wd = p["base_dilation"][j], p["window_dilation"][j]
  why = blocked_reason(n, {"input": L, "output": Q})
  if why:
    return why
  if eqn.primitive.name == "reduce_window" and (tuple(p["padding"][j]) != (0, 0) or bd != 1):
    # XLA skips padding and dilation holes; a halo filled with the init value
    # counts it once more per such row, unless it is the computation's
    # identity, which gshard cannot know for an arbitrary computation
    return "a generic reduce_window skips its padding, which a split dim's halo cannot"
  block = Q // n
  halo = halo_plan(n, L * bd, p["padding"][j][0], block * s,
                   (block - 1) * s + (w - 1) * wd + 1)
  if halo is None:
    return f"its halo is wider than one shard of {L // n} rows"
  return _PoolDim(halo, bd)


def pool_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``reduce_window*`` and ``select_and_gather_add``: halo of every operand
  along split windowed dims, filled with the reduction's identity."""
  del idx
  p = eqn.params
  rule = factor_rule_of(eqn)
  k = _pool_operands(eqn)
  rank = len(eqn.invars[0].aval.shape)
  factors = {j: rule.operands[0][j][0] for j in range(rank)}
  plan, kept, notes = plan_with_halos(ctx, eqn, ins, scope, factors,
                                       lambda j, n: _pool_geometry(eqn, j, n))
  vals = [ctx.reshard(v, s, eqn, role_with(f"operand {i}", notes if i < k else []))
          if s is not None else v for i, (v, s) in enumerate(zip(ins, plan.operands))]
  fills = _pool_fills(eqn, vals)
  xs = [v.x for v in vals]
  padding, base_dilation = list(p["padding"]), list(p["base_dilation"])
  for j, (axes, geo) in kept.items():
    trivial = (geo.dilation == 1 and not geo.halo.exchanges and geo.halo.slope == 0
               and geo.halo.offset == 0 and geo.halo.width == np.shape(xs[0])[j]
               and tuple(padding[j]) == (0, 0))
    if trivial:
      continue
    for i in range(k):
      x = dilate(xs[i], j, geo.dilation, fills[i])
      xs[i] = haloed(ctx, vals[i], x, j, axes, geo.halo, fills[i], eqn, f"operand {i}")
    padding[j], base_dilation[j] = (0, 0), 1
  params = unkeyed(dict(p, padding=tuple(padding), base_dilation=tuple(base_dilation)))
  outs = eqn.primitive.bind(*xs, **params)
  outs = list(outs) if eqn.primitive.multiple_results else [outs]
  res = []
  for y, var, s in zip(outs, eqn.outvars, plan.results):
    shape = tuple(var.aval.shape)
    check_shape(eqn.primitive.name, y, s.local_shape(shape, ctx.mesh_sizes), s)
    res.append(Value(y, s, shape, var.aval.dtype))
  return res


# -- select_and_scatter_add: the gradient of max pooling ---------------------------

@dataclasses.dataclass(frozen=True)
class _ScatterDim:
  source: Halo     # the windows (source rows) that touch this device's block
  operand: Halo    # the operand rows those windows read
  keep: int        # where this device's block starts in the op's local result


def _scatter_geometry(eqn, j: int, n: int):
  p = eqn.params
  Q = eqn.invars[0].aval.shape[j]
  L = eqn.invars[1].aval.shape[j]
  w, s = p["window_dimensions"][j], p["window_strides"][j]
  lo = p["padding"][j][0]
  why = blocked_reason(n, {"operand": L, "source": Q})
  if why:
    return why
  local, block = L // n, Q // n
  if block * s != local:
    return (f"windows ({block} per shard, stride {s}) do not align with shards of "
            f"{local} rows")
  before = (w - 1 - lo) // s          # windows starting in the left neighbour's rows
  after = (lo - 1) // s + 1           # windows starting past my last row
  count = block + before + after
  source = halo_plan(n, Q, before, block, count)
  operand = halo_plan(n, L, before * s + lo, local, (count - 1) * s + w)
  if source is None or operand is None:
    return f"its halo is wider than one shard of {local} rows"
  return _ScatterDim(source, operand, before * s + lo)


def select_and_scatter_add_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """Each device scatters every window that touches its block (the windows'
  source rows and operand rows come from the neighbours) and keeps its block."""
  del idx
  p = eqn.params
  rule = factor_rule_of(eqn)
  rank = len(eqn.invars[0].aval.shape)
  factors = {j: rule.operands[0][j][0] for j in range(rank)}
  plan, kept, notes = plan_with_halos(ctx, eqn, ins, scope, factors,
                                       lambda j, n: _scatter_geometry(eqn, j, n))
  src = ctx.reshard(ins[0], plan.operands[0], eqn, role_with("operand 0", notes))
  op = ctx.reshard(ins[1], plan.operands[1], eqn, role_with("operand 1", notes))
  ident = (_max_identity if p["select_prim"] is lax.ge_p
           else _min_identity)(np.dtype(op.dtype))
  xs, xo = src.x, op.x
  padding = list(p["padding"])
  crops = []
  for j, (axes, geo) in kept.items():
    if (p["window_dimensions"][j], p["window_strides"][j]) == (1, 1) and \
        tuple(padding[j]) == (0, 0):
      continue        # not a windowed dim
    xs = haloed(ctx, src, xs, j, axes, geo.source, 0, eqn, "operand 0")
    xo = haloed(ctx, op, xo, j, axes, geo.operand, ident, eqn, "operand 1")
    padding[j] = (0, 0)
    crops.append((j, geo.keep, np.shape(op.x)[j]))
  y = eqn.primitive.bind(xs, xo, **unkeyed(dict(p, padding=tuple(padding))))
  for j, keep, local in crops:
    config = [(0, 0, 0)] * y.ndim
    config[j] = (max(0, -keep), max(0, keep + local - np.shape(y)[j]), 0)
    y = lax.pad(y, jnp.zeros((), y.dtype), config)
    y = lax.slice_in_dim(y, max(0, keep), max(0, keep) + local, axis=j)
  out_shape = tuple(eqn.outvars[0].aval.shape)
  check_shape("select_and_scatter_add", y,
               plan.results[0].local_shape(out_shape, ctx.mesh_sizes), plan.results[0])
  return [Value(y, plan.results[0], out_shape, eqn.outvars[0].aval.dtype)]
