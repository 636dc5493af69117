"""Partition rules of windowed ops: halo exchange along split dims.

A windowed op reads, for each result row, a window of operand rows. When a
dim is split, the rows a device needs reach a little past its own block: the
**halo**. Each device receives the halo rows from its neighbours with
``ppermute`` (GSPMD's halo exchange, GShard §3.3), fills rows beyond the
global edges with the op's padding value (0 for convolution and sums, ``-inf``
for max, the pad value for ``pad`` ...) and runs the op locally with no
padding on that dim.

One dim, seen globally. The operand (dilated first, if the op dilates it) has
``length`` rows split in ``n`` blocks of ``local``; device ``d`` produces its
block of results, which reads operand rows ``[d*advance - lo, d*advance - lo +
width)``. ``advance`` is the rows between the first rows read by two
neighbouring devices (``result block * stride`` for a convolution); when it
differs from ``local`` the offset into the device's extended block moves with
``d`` (a ``dynamic_slice``). :func:`halo_plan` turns this into rows to receive
from each side; a halo larger than one neighbour's block is not exchanged:
that dim is gathered instead (correct, and the reshard's role says why).

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
import math

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lax import lax as _lax_internal

from gshard.spmd import reshard as _reshard
from gshard.spmd.partition.context import Context, Value
from gshard.spmd.partition.rules import (LocalPlan, _factor_rule, generic_rule,
                                         partition_rules, plan_local)
from gshard.spmd.sharding import TensorSharding


# -- the geometry of one split dim ---------------------------------------------

@dataclasses.dataclass(frozen=True)
class Halo:
  """How each device reads its window of one split dim.

  Device ``d``'s extended block is ``[pad_left fill rows, left rows from
  device d-1, its own local rows, right rows from device d+1, pad_right fill
  rows]``; its window is ``width`` rows from ``offset + d * slope``.

  Example: a SAME 3-wide convolution, stride 1, 16 rows on 4 devices
  (``halo_plan(4, 16, 1, 4, 6)``): ``left=right=1``, ``offset=0``,
  ``slope=0``, ``width=6``: one row from each neighbour, no dynamic offset.
  """

  left: int
  right: int
  pad_left: int
  pad_right: int
  offset: int
  slope: int
  width: int

  @property
  def exchanges(self) -> bool:
    return bool(self.left or self.right)


def halo_plan(n: int, length: int, lo: int, advance: int, width: int) -> Halo | None:
  """The halo of one dim, or ``None`` when a device would need more than one
  neighbour's block.

  Args:
    n: shards of the dim (``n >= 2``); ``length % n == 0``.
    length: operand rows (after any dilation).
    lo: low padding (negative: rows cut off).
    advance: rows between the first rows read by devices ``d`` and ``d+1``.
    width: rows device ``d`` reads, from ``d * advance - lo``.

  Example: a 5-wide max pool, stride 3, padding (2, 2) over 16 rows on 2
  devices makes 6 windows, 3 per device: device 0 reads rows -2..8, device 1
  rows 7..17 (``advance=9``, ``width=11``). ``halo_plan(2, 16, 2, 9, 11)`` is
  ``Halo(left=1, right=1, pad_left=1, pad_right=1, offset=0, slope=1,
  width=11)``: one row from each neighbour, one fill row beyond each, and
  device ``d``'s window starts ``d`` rows further into its extended block.
  """
  local = length // n
  need_left = lambda d: lo + d * (local - advance)
  need_right = lambda d: d * advance - lo + width - (d + 1) * local
  if width <= 0:
    return None
  ext_left = max(0, need_left(0), need_left(n - 1))
  ext_right = max(0, need_right(0), need_right(n - 1))
  left = max(0, need_left(1), need_left(n - 1))          # devices with a left neighbour
  right = max(0, need_right(0), need_right(n - 2))       # devices with a right neighbour
  if left > local or right > local:
    return None
  return Halo(left, right, ext_left - left, ext_right - right, ext_left - lo,
              advance - local, width)


def permute(ctx: Context, x, axes, dest):
  """``lax.ppermute`` over ``axes``: the device at linear index ``i`` (major
  first over ``axes``) sends ``x`` to ``dest(i)`` (``None``: to nobody).

  jax numbers a multi-axis ppermute's devices in mesh order, whatever the
  order of the names given: the pairs are renumbered to it.
  """
  n = ctx.num_shards(axes)
  order = _reshard._mesh_axis_order(ctx.mesh_sizes)
  mesh_axes = tuple(sorted(axes, key=order.index))
  renumber = _reshard._renumbering(tuple(axes), mesh_axes, ctx.mesh_sizes)
  pairs = [(renumber[i], renumber[dest(i)]) for i in range(n) if dest(i) is not None]
  return lax.ppermute(x, _reshard._axis_name(mesh_axes), pairs)


def _row_bytes(x, dim: int) -> int:
  rows = np.shape(x)
  return math.prod(s for i, s in enumerate(rows) if i != dim) * np.dtype(x.dtype).itemsize


def _fill_rows(x, dim: int, rows: int, fill):
  shape = list(np.shape(x))
  shape[dim] = rows
  return jnp.broadcast_to(jnp.asarray(fill, x.dtype), shape)


def _is_zero(fill) -> bool:
  return isinstance(fill, (int, float)) and fill == 0


def exchange(ctx: Context, v: Value, x, dim: int, axes, halo: Halo, fill, eqn,
             role: str):
  """``x`` (this device's block of ``v`` along ``dim``, possibly dilated) with
  its halo: rows from the neighbours over ``axes``, fill beyond the edges.

  Each ppermute is recorded: ``rows * row bytes`` sent per device.
  """
  n = ctx.num_shards(axes)
  local = np.shape(x)[dim]
  index = ctx.linear_index(axes)

  def receive(rows: int, side: str):
    if side == "left":      # my last rows become my right neighbour's left halo
      send, shift, edge = lax.slice_in_dim(x, local - rows, local, axis=dim), 1, 0
    else:
      send, shift, edge = lax.slice_in_dim(x, 0, rows, axis=dim), -1, n - 1
    got = permute(ctx, send, axes, lambda i: i + shift if 0 <= i + shift < n else None)
    if not _is_zero(fill):   # the edge device received nothing: zeros, not fill
      got = jnp.where(index == edge, jnp.asarray(fill, x.dtype), got)
    ctx.record("ppermute", axes, rows * _row_bytes(x, dim), eqn,
               f"{role} {side} halo (dim {dim}, {rows} rows)", v.sharding, v.sharding,
               v.shape, v.dtype)
    return got

  parts = []
  if halo.pad_left:
    parts.append(_fill_rows(x, dim, halo.pad_left, fill))
  if halo.left:
    parts.append(receive(halo.left, "left"))
  parts.append(x)
  if halo.right:
    parts.append(receive(halo.right, "right"))
  if halo.pad_right:
    parts.append(_fill_rows(x, dim, halo.pad_right, fill))
  return lax.concatenate(parts, dim) if len(parts) > 1 else x


def window(ctx: Context, x, dim: int, axes, halo: Halo):
  """The ``halo.width`` rows this device reads, from its extended block."""
  if halo.slope == 0:
    return lax.slice_in_dim(x, halo.offset, halo.offset + halo.width, axis=dim)
  start = halo.offset + ctx.linear_index(axes) * halo.slope
  return lax.dynamic_slice_in_dim(x, start, halo.width, axis=dim)


def dilate(x, dim: int, factor: int, fill):
  """Insert ``factor - 1`` fill rows after every row (the last one too):
  ``[a, b] -> [a, f, b, f]`` for ``factor=2``. The global dilated value is then
  evenly split; its trailing fill rows are taken off the high padding."""
  if factor == 1:
    return x
  config = [(0, 0, 0)] * x.ndim
  config[dim] = (0, factor - 1, factor - 1)
  return lax.pad(x, jnp.asarray(fill, x.dtype), config)


def haloed(ctx: Context, v: Value, x, dim: int, axes, halo: Halo, fill, eqn, role: str):
  """Exchange then window: the rows of ``dim`` this device's op reads."""
  return window(ctx, exchange(ctx, v, x, dim, axes, halo, fill, eqn, role), dim, axes,
                halo)


# -- planning: keep a dim split where a halo works, gather it elsewhere ------------

def _plan_with_halos(ctx: Context, eqn, ins, scope, factors: dict[int, str], geometry):
  """``plan_local`` with each windowed factor kept split only where ``geometry``
  finds a halo for it.

  Args:
    factors: operand-0 dim -> the factor of that windowed dim.
    geometry: ``(dim, n) -> geometry object, or a reason string`` when the dim
      cannot stay split ``n`` ways.
  Returns:
    (plan, {dim: (axes, geometry)}, notes): the notes say which dims were
    gathered and why; they go into the role of the gathering reshard, so
    ``explain()`` shows them.
  """
  blocked: set[str] = set()
  for _ in range(len(factors) + 1):
    plan = plan_local(ctx, eqn, ins, scope, blocked=frozenset(blocked))
    kept, refused = {}, False
    for d, f in factors.items():
      axes = plan.choice.get(f, ())
      if not axes:
        continue
      geo = geometry(d, ctx.num_shards(axes))
      if isinstance(geo, str):
        blocked.add(f)
        refused = True
      else:
        kept[d] = (axes, geo)
    if not refused:
      return plan, kept, _gather_notes(ctx, ins[0], factors, kept, geometry)
  raise AssertionError("unreachable: each round blocks one more factor")


def _gather_notes(ctx: Context, v: Value, factors, kept, geometry) -> list[str]:
  """Why each windowed dim split in ``v`` is not split in the plan."""
  notes = []
  for d in factors:
    have = () if v.literal else v.sharding.dims[d]
    if have and d not in kept:
      why = geometry(d, ctx.num_shards(have))
      notes.append(f"dim {d} gathered: {why if isinstance(why, str) else 'unsplit here'}")
  return notes


def _role(base: str, notes: list[str]) -> str:
  return f"{base} ({'; '.join(notes)})" if notes else base


def _check_shape(name, got, want, sharding):
  if tuple(np.shape(got)) != tuple(want):
    raise AssertionError(
        f"gshard internal error: {name} gave local shape {tuple(np.shape(got))}, "
        f"expected {tuple(want)} for {sharding}.")


def _blocked_reason(n, sizes: dict[str, int]) -> str | None:
  for what, size in sizes.items():
    if size % n:
      return f"{what} {size} is not a multiple of {n} shards"
  return None


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
    why = _blocked_reason(n, {"input": L, "output": Q})
    block = Q // n
    advance, width = block * s, (block - 1) * s + (K - 1) * rd + 1
  else:                # weight gradient: each device contracts K/n rows of rhs
    why = _blocked_reason(n, {"input": L, "window": K})
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
  rule = _factor_rule(eqn)
  factors = {d: rule.operands[0][d][0] for d in lhs_spec[2:]}
  plan, kept, notes = _plan_with_halos(ctx, eqn, ins, scope, factors,
                                       lambda d, n: _conv_geometry(eqn, rule, d, n))
  lhs = ctx.reshard(ins[0], plan.operands[0], eqn, _role("operand 0", notes))
  rhs = ctx.reshard(ins[1], plan.operands[1], eqn, _role("operand 1", notes))
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
  _check_shape("conv_general_dilated", y,
               plan.results[0].local_shape(out_shape, ctx.mesh_sizes), plan.results[0])
  return [Value(y, plan.results[0], out_shape, eqn.outvars[0].aval.dtype)]


# -- pooling: reduce_window and select_and_gather_add ---------------------------

_POOL_FILL = {
    "reduce_window_sum": lambda dtype: 0,
    "reduce_window_max": _lax_internal._get_max_identity,
    "reduce_window_min": _lax_internal._get_min_identity,
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
    ident = (_lax_internal._get_max_identity if eqn.params["select_prim"] is lax.ge_p
             else _lax_internal._get_min_identity)
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
  why = _blocked_reason(n, {"input": L, "output": Q})
  if why:
    return why
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
  rule = _factor_rule(eqn)
  k = _pool_operands(eqn)
  rank = len(eqn.invars[0].aval.shape)
  factors = {j: rule.operands[0][j][0] for j in range(rank)}
  plan, kept, notes = _plan_with_halos(ctx, eqn, ins, scope, factors,
                                       lambda j, n: _pool_geometry(eqn, j, n))
  vals = [ctx.reshard(v, s, eqn, _role(f"operand {i}", notes if i < k else []))
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
  params = dict(p, padding=tuple(padding), base_dilation=tuple(base_dilation))
  outs = eqn.primitive.bind(*xs, **params)
  outs = list(outs) if eqn.primitive.multiple_results else [outs]
  res = []
  for y, var, s in zip(outs, eqn.outvars, plan.results):
    shape = tuple(var.aval.shape)
    _check_shape(eqn.primitive.name, y, s.local_shape(shape, ctx.mesh_sizes), s)
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
  why = _blocked_reason(n, {"operand": L, "source": Q})
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
  rule = _factor_rule(eqn)
  rank = len(eqn.invars[0].aval.shape)
  factors = {j: rule.operands[0][j][0] for j in range(rank)}
  plan, kept, notes = _plan_with_halos(ctx, eqn, ins, scope, factors,
                                       lambda j, n: _scatter_geometry(eqn, j, n))
  src = ctx.reshard(ins[0], plan.operands[0], eqn, _role("operand 0", notes))
  op = ctx.reshard(ins[1], plan.operands[1], eqn, _role("operand 1", notes))
  ident = (_lax_internal._get_max_identity if p["select_prim"] is lax.ge_p
           else _lax_internal._get_min_identity)(np.dtype(op.dtype))
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
  y = eqn.primitive.bind(xs, xo, **dict(p, padding=tuple(padding)))
  for j, keep, local in crops:
    config = [(0, 0, 0)] * y.ndim
    config[j] = (max(0, -keep), max(0, keep + local - np.shape(y)[j]), 0)
    y = lax.pad(y, jnp.zeros((), y.dtype), config)
    y = lax.slice_in_dim(y, max(0, keep), max(0, keep) + local, axis=j)
  out_shape = tuple(eqn.outvars[0].aval.shape)
  _check_shape("select_and_scatter_add", y,
               plan.results[0].local_shape(out_shape, ctx.mesh_sizes), plan.results[0])
  return [Value(y, plan.results[0], out_shape, eqn.outvars[0].aval.dtype)]


# -- slice, pad, rev along a split dim ---------------------------------------------

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
  why = _blocked_reason(n, {"input": L, "output": M})
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
  _check_shape("slice", y, out_s.local_shape(out_shape, ctx.mesh_sizes), out_s)
  return [Value(y, out_s, out_shape, eqn.outvars[0].aval.dtype)]


def _pad_geometry(eqn, d: int, n: int):
  lo, hi, interior = eqn.params["padding_config"][d]
  L = eqn.invars[0].aval.shape[d]
  M = eqn.outvars[0].aval.shape[d]
  why = _blocked_reason(n, {"input": L, "output": M})
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
  _check_shape("pad", y, out_s.local_shape(out_shape, ctx.mesh_sizes), out_s)
  return [Value(y, out_s, out_shape, eqn.outvars[0].aval.dtype)]


def rev_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``rev`` along a split dim that stays split: device i takes block n-1-i
  (one ppermute of the whole block), then reverses it locally."""
  plan = plan_local(ctx, eqn, ins, scope)
  keep = _keep_split(ctx, eqn, ins, scope, plan, eqn.params["dimensions"],
                     lambda d, n: None)
  if keep is None:
    return generic_rule(ctx, eqn, ins, scope, idx)
  op_s, out_s, kept = keep
  v = ctx.reshard(ins[0], op_s, eqn, "operand 0")
  x = v.x
  for d, (axes, _) in kept.items():
    n = ctx.num_shards(axes)
    x = permute(ctx, x, axes, lambda i: n - 1 - i)
    ctx.record("ppermute", axes, int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize,
               eqn, f"operand 0 blocks reversed (dim {d})", v.sharding, out_s, v.shape,
               v.dtype)
  y = lax.rev(x, eqn.params["dimensions"])
  return [Value(y, out_s, tuple(eqn.outvars[0].aval.shape), eqn.outvars[0].aval.dtype)]


partition_rules.update({
    "conv_general_dilated": conv_rule,
    "reduce_window_sum": pool_rule,
    "reduce_window_max": pool_rule,
    "reduce_window_min": pool_rule,
    "reduce_window": pool_rule,
    "select_and_gather_add": pool_rule,
    "select_and_scatter_add": select_and_scatter_add_rule,
    "slice": slice_rule,
    "pad": pad_rule,
    "rev": rev_rule,
})
