"""Partition rules: per primitive, what the local op needs and what it gives.

Most primitives need no rule of their own: :func:`generic_rule` reads the
primitive's factor rule (the same one propagation used), picks per factor the
mesh axes that propagation settled on, reshards each operand to match, binds
the primitive on local values with local shape params, and marks a result
pending (partial sum) over the axes of its split ``sum`` factors. Primitives
that need more (an offset, a mask, a cross-device max, an inner jaxpr) have
rules below, registered last. A primitive with neither takes the safe path.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gshard.spmd import reshard as _reshard_mod
from gshard.spmd.partition.context import Context, Value
from gshard.spmd.propagate import Bound, _accepts, _project, _solve, _unproject
from gshard.spmd.rules import IN, OUT, FactorRule, OpRule, sharding_rules
from gshard.spmd.sharding import TensorSharding

PartitionRule = Callable[..., list[Value]]
partition_rules: dict[str, PartitionRule] = {}

# Primitives whose local op is the primitive itself on local shapes.
_GENERIC_FAMILIES = ("gshard.spmd.rules.elementwise", "gshard.spmd.rules.dot",
                     "gshard.spmd.rules.shape", "gshard.spmd.rules.reduce",
                     "gshard.spmd.rules.annotation")
# Cross-device combine for split non-sum reductions.
_COMBINE = {"reduce_max": "pmax", "reduce_min": "pmin", "reduce_or": "pmax",
            "reduce_and": "pmin"}


def partition_rule_for(eqn) -> PartitionRule:
  name = eqn.primitive.name
  if name in partition_rules:
    return partition_rules[name]
  rule = sharding_rules.get(name)
  family = getattr(getattr(rule, "func", rule), "__module__", "")
  if rule is not None and family in _GENERIC_FAMILIES:
    return generic_rule
  return safe_rule


# -- the generic rule ---------------------------------------------------------

@dataclasses.dataclass
class LocalPlan:
  """How one equation runs per device."""

  rule: FactorRule
  choice: dict[str, tuple[str, ...]]
  operands: list[TensorSharding | None]   # None for literals
  results: list[TensorSharding]


def _factor_rule(eqn) -> FactorRule:
  r = sharding_rules[eqn.primitive.name](
      [v.aval for v in eqn.invars], [v.aval for v in eqn.outvars], **eqn.params)
  if isinstance(r, OpRule) and len(r.constraints) == 1:
    c = r.constraints[0]
    if c.operands == tuple(IN(i) for i in range(len(eqn.invars))) and \
        c.results == tuple(OUT(i) for i in range(len(eqn.outvars))):
      r = c.rule
  if not isinstance(r, FactorRule):
    raise TypeError(f"{eqn.primitive.name}: generic partitioning needs a FactorRule")
  return r


def plan_local(ctx: Context, eqn, ins: list[Value], scope, *, blocked=frozenset(),
               allow_other_reduction=False) -> LocalPlan:
  """Per-factor axes for the local op, and the operand/result shardings they imply.

  Two candidates: the factor axes propagation settled on for the whole
  equation, and those its operands hold (compute where the data is, then
  reshard the result: GShard's einsum option (a), which turns a split moving
  from G to E in MoE dispatch into one all-to-all instead of gathering the
  operands). The one that sends fewer bytes wins; ties go to the first.
  """
  rule = _factor_rule(eqn)
  g = ctx.graph
  operands = [g.tensor(scope, v) for v in eqn.invars]
  results = [g.tensor(scope, v) for v in eqn.outvars]
  candidates = [_solve(Bound(rule, operands, results, eqn, scope), ctx.mesh_sizes)[0]]
  if any(r is not None for r in results):
    candidates.append(_solve(Bound(rule, operands, [None] * len(results), eqn, scope),
                             ctx.mesh_sizes)[0])
  plans = [_plan_for(ctx, eqn, ins, scope, rule, c, blocked, allow_other_reduction)
           for c in candidates]
  if len(plans) == 1:
    return plans[0]
  costs = [_plan_cost(ctx, eqn, ins, scope, p) for p in plans]
  return plans[costs.index(min(costs))]


def _plan_cost(ctx: Context, eqn, ins, scope, plan: LocalPlan) -> int:
  """Bytes per device to reshard operands into ``plan`` and results out of it."""
  total = 0
  for v, s in zip(ins, plan.operands):
    if s is not None and v.sharding != s:
      total += _reshard_mod.plan_reshard(v.sharding, s, v.shape, v.dtype,
                                         ctx.mesh_sizes).bytes_per_device
  for var, s in zip(eqn.outvars, plan.results):
    if type(var).__name__ == "DropVar":
      continue
    t = ctx.target(scope, var)
    if t != s:
      try:
        total += _reshard_mod.plan_reshard(s, t, tuple(var.aval.shape), var.aval.dtype,
                                           ctx.mesh_sizes).bytes_per_device
      except ValueError:   # would need to create a partial sum: not a candidate
        return 1 << 62
  return total


def _plan_for(ctx: Context, eqn, ins, scope, rule: FactorRule, choice, blocked,
              allow_other_reduction) -> LocalPlan:
  choice = dict(choice)
  sizes = rule.size_of
  compound = {f for dims in rule.operands + rule.results for d in dims if len(d) > 1
              for f in d}
  for f in rule.factors:
    axes = list(choice.get(f, ()))
    if f in rule.blocked or f in blocked or (
        f in rule.other_reduction and not allow_other_reduction):
      axes = []
    # An uneven split is padded; a factor inside a compound dim must be even.
    while axes and f in compound and sizes[f] % math.prod(ctx.mesh_sizes[a] for a in axes):
      axes.pop()
    choice[f] = tuple(axes)
  _drop_inexpressible(choice, [d for v, d in zip(ins, rule.operands) if not v.literal]
                      + list(rule.results), sizes, ctx.mesh_sizes)
  # A pending partial sum passes through a linear op; otherwise it is resolved.
  live = [v for v in ins if not v.literal]
  fake = Bound(rule, [_Shim(v.sharding) if not v.literal else None for v in ins], [],
               eqn, scope)
  passes = any(v.sharding.partial for v in live) and all(
      _accepts(fake, o) for o in fake.operands if o is not None and o.sharding.partial)
  operands: list[TensorSharding | None] = []
  for v, dims in zip(ins, rule.operands):
    if v.literal:
      operands.append(None)
      continue
    d = tuple(_unproject(dims, choice, sizes, ctx.mesh_sizes))
    used = {a for x in d for a in x}
    partial = (v.sharding.partial - used) if passes else frozenset()
    operands.append(TensorSharding(d, partial))
  carried = frozenset().union(*[o.partial for o in operands if o is not None])
  reduced = frozenset(a for f in rule.reduction for a in choice.get(f, ()))
  results = []
  for dims in rule.results:
    d = tuple(_unproject(dims, choice, sizes, ctx.mesh_sizes))
    used = {a for x in d for a in x}
    results.append(TensorSharding(d, (carried | reduced) - used))
  return LocalPlan(rule, choice, operands, results)


def _drop_inexpressible(choice, tensors, sizes, mesh_sizes) -> None:
  """Unsplit each factor that some operand or result cannot hold as chosen.

  A compound dim holds its minor factor's split only when its major factors
  are split fully: reshape ``f32[2,8] -> f32[16]`` (``ab->(ab)``) with ``b``
  over 8 devices would leave the operand ``[_,x]`` but the result unsplit,
  and the local reshape ``(2,1) -> (16,)`` would be wrong. Edits ``choice``.
  """
  changed = True
  while changed:
    changed = False
    for dims in tensors:
      got = _project(dims, _unproject(dims, choice, sizes, mesh_sizes), sizes, mesh_sizes)
      for f in sorted({f for d in dims for f in d}):
        if choice.get(f) and got.get(f, ()) != choice[f]:
          choice[f] = ()
          changed = True


@dataclasses.dataclass
class _Shim:
  """Stands in for a propagation Tensor in :func:`_accepts`."""

  sharding: TensorSharding


def local_params(eqn, out_local_shapes, in_local_shapes) -> dict:
  """The equation's params with shape-carrying ones made per-device."""
  params = dict(eqn.params)
  for k in ("sharding", "out_sharding"):
    if k in params:
      params[k] = None
  fix = _LOCAL_PARAMS.get(eqn.primitive.name)
  if fix is not None:
    params = fix(params, out_local_shapes, in_local_shapes, eqn)
  return params


def _shape_param(name):
  def fix(params, outs, ins, eqn):
    params[name] = tuple(outs[0])
    return params
  return fix


def _slice_params(params, outs, ins, eqn):
  full = eqn.invars[0].aval.shape
  params["limit_indices"] = tuple(
      ins[0][i] if (s == 0 and l == n and (not params["strides"] or params["strides"][i] == 1))
      else l for i, (s, l, n) in enumerate(zip(params["start_indices"],
                                              params["limit_indices"], full)))
  return params


def _dynamic_slice_params(params, outs, ins, eqn):
  params["slice_sizes"] = tuple(outs[0])
  return params


def _gather_params(params, outs, ins, eqn):
  full = eqn.invars[0].aval.shape
  params["slice_sizes"] = tuple(
      ins[0][i] if s == n else s for i, (s, n) in enumerate(zip(params["slice_sizes"], full)))
  return params


_LOCAL_PARAMS = {
    "broadcast_in_dim": _shape_param("shape"),
    "reshape": _shape_param("new_sizes"),
    "iota": _shape_param("shape"),
    "slice": _slice_params,
    "dynamic_slice": _dynamic_slice_params,
    "gather": _gather_params,
}


_MAX_LIKE = {"reduce_max", "argmax"}
_MIN_LIKE = {"reduce_min", "argmin"}


def reduction_identity(name: str, dtype):
  """The value padding must hold so that reducing it changes nothing."""
  dtype = np.dtype(dtype)
  if name in _MAX_LIKE or name in _MIN_LIKE:
    low = name in _MAX_LIKE
    if dtype == np.bool_:
      return not low
    if jnp.issubdtype(dtype, jnp.inexact):
      return -np.inf if low else np.inf
    info = jnp.iinfo(dtype)
    return info.min if low else info.max
  if name == "reduce_and":
    return True
  if name == "reduce_prod":
    return 1
  return 0


def mask_padding(ctx: Context, eqn, plan: LocalPlan, xs: list) -> list:
  """Fill the padding of unevenly split reduced dims with the reduction's identity.

  A dim of 30 split 4 ways holds 8 rows per device, the last 2 of the last
  device being padding; before a sum (or a contraction) over that dim they
  must be 0, before a max -inf.
  """
  rule, sizes = plan.rule, plan.rule.size_of
  uneven = {}
  for f in rule.reduction | rule.other_reduction:
    axes = plan.choice.get(f, ())
    if axes and sizes[f] % math.prod(ctx.mesh_sizes[a] for a in axes):
      uneven[f] = axes
  if not uneven:
    return xs
  out = []
  for x, dims, s in zip(xs, rule.operands, plan.operands):
    mask = None
    if s is not None:
      for d, factors in enumerate(dims):
        if len(factors) == 1 and factors[0] in uneven:
          n = sizes[factors[0]]
          local = np.shape(x)[d]
          idx = ctx.linear_index(uneven[factors[0]]) * local + lax.iota(jnp.int32, local)
          m = lax.broadcast_in_dim(idx < n, np.shape(x), (d,))
          mask = m if mask is None else (mask & m)
    if mask is not None:
      fill = reduction_identity(eqn.primitive.name, x.dtype)
      x = jnp.where(mask, x, jnp.asarray(fill, x.dtype))
    out.append(x)
  return out


def _bind_local(ctx: Context, eqn, plan: LocalPlan, ins: list[Value]) -> list[Value]:
  xs = []
  for j, (v, s) in enumerate(zip(ins, plan.operands)):
    if s is None:
      xs.append(v.x)
    else:
      xs.append(ctx.reshard(v, s, eqn, f"operand {j}").x)
  xs = mask_padding(ctx, eqn, plan, xs)
  out_shapes = [tuple(v.aval.shape) for v in eqn.outvars]
  out_local = [s.local_shape(sh, ctx.mesh_sizes) for s, sh in zip(plan.results, out_shapes)]
  in_local = [tuple(np.shape(x)) for x in xs]
  params = local_params(eqn, out_local, in_local)
  if eqn.primitive.name == "reshape" and math.prod(in_local[0]) != math.prod(out_local[0]):
    raise AssertionError(
        f"gshard internal error: local reshape {in_local[0]} -> {out_local[0]} changes "
        f"the element count (global {eqn.invars[0].aval.shape} -> {out_shapes[0]}, "
        f"operand {plan.operands[0]}, result {plan.results[0]}).")
  outs = eqn.primitive.bind(*xs, **params)
  outs = list(outs) if eqn.primitive.multiple_results else [outs]
  for o, want, s in zip(outs, out_local, plan.results):
    if tuple(np.shape(o)) != tuple(want):
      raise AssertionError(
          f"gshard internal error: {eqn.primitive.name} gave local shape "
          f"{tuple(np.shape(o))}, expected {want} for sharding {s}.")
  return [Value(o, s, sh, v.aval.dtype)
          for o, s, sh, v in zip(outs, plan.results, out_shapes, eqn.outvars)]


def generic_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  combine = _COMBINE.get(eqn.primitive.name)
  try:
    _factor_rule(eqn)
  except NotImplementedError:   # a case the sharding rule does not cover
    return safe_rule(ctx, eqn, ins, scope, idx)
  plan = plan_local(ctx, eqn, ins, scope, blocked=_extra_blocked(eqn),
                    allow_other_reduction=combine is not None)
  outs = _bind_local(ctx, eqn, plan, ins)
  axes = tuple(a for f in plan.rule.other_reduction for a in plan.choice.get(f, ()))
  if combine and axes:
    res = []
    for v in outs:
      x = v.x
      is_bool = x.dtype == jnp.bool_
      y = getattr(lax, combine)(x.astype(jnp.int32) if is_bool else x, axes)
      y = y.astype(jnp.bool_) if is_bool else y
      ctx.record(combine, axes, _allreduce_bytes(y, ctx.num_shards(axes)), eqn,
                 "result 0", v.sharding, v.sharding, v.shape, v.dtype)
      res.append(dataclasses.replace(v, x=y))
    outs = res
  return outs


def _extra_blocked(eqn) -> frozenset[str]:
  """Factors propagation may split but the plain local op cannot."""
  name = eqn.primitive.name
  if name == "dynamic_update_slice":
    rule = _factor_rule(eqn)
    upd = {f for d in rule.operands[1] for f in d}
    return frozenset(f for d in rule.operands[0] for f in d if f not in upd)
  return frozenset()


def _allreduce_bytes(x, n: int) -> int:
  return int(2 * (n - 1) / n * x.size * x.dtype.itemsize)


# -- rules of their own --------------------------------------------------------

def iota_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """Local iota plus this device's offset along a split ``dimension``."""
  del idx
  plan = plan_local(ctx, eqn, ins, scope)
  (out,) = _bind_local(ctx, eqn, plan, ins)
  dim = eqn.params["dimension"]
  axes = out.sharding.dims[dim]
  if axes:
    local = out.sharding.local_shape(out.shape, ctx.mesh_sizes)[dim]
    offset = (ctx.linear_index(axes) * local).astype(out.x.dtype)
    out = dataclasses.replace(out, x=out.x + offset)
  return [out]


def arg_reduce_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """argmax/argmin over a split dim: local winner, then the global first winner."""
  del idx
  plan = plan_local(ctx, eqn, ins, scope, allow_other_reduction=True)
  (axis,) = eqn.params["axes"]
  (f,) = plan.rule.operands[0][axis]
  axes = plan.choice.get(f, ())
  (x_val,) = [ctx.reshard(ins[0], plan.operands[0], eqn, "operand 0")]
  (out,) = _bind_local(ctx, eqn, plan, [x_val])
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
  ctx.record("pmax" if is_max else "pmin", axes, _allreduce_bytes(best, n), eqn,
             "result 0", out.sharding, out.sharding, out.shape, out.dtype)
  ctx.record("pmin", axes, _allreduce_bytes(winner, n), eqn, "result 0", out.sharding,
             out.sharding, out.shape, out.dtype)
  return [dataclasses.replace(out, x=winner)]


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


def gather_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """A lookup into a split table: each device looks up the rows it holds.

  Indices outside the local rows read row 0 and are masked to zero; the result
  is a pending sum over the table's split axes (an embedding lookup with the
  vocabulary split never gathers the table).
  """
  del idx
  dn = eqn.params["dimension_numbers"]
  mode = eqn.params["mode"]
  plan = plan_local(ctx, eqn, ins, scope)
  operand = ctx.reshard(ins[0], plan.operands[0], eqn, "operand 0")
  indices = ctx.reshard(ins[1], plan.operands[1], eqn, "operand 1")
  split = _index_offsets(ctx, eqn, plan, plan.rule.operands[0],
                         [d for d in dn.collapsed_slice_dims if d in dn.start_index_map],
                         operand)
  if not split:
    return _bind_local(ctx, eqn, plan, [operand, indices])
  full = eqn.invars[0].aval.shape
  idx_x = indices.x
  in_range = None
  oob = None
  comps = []
  for k, d in enumerate(dn.start_index_map):
    comps.append(idx_x[..., k])
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
  new_idx = jnp.stack(comps, axis=-1).astype(idx_x.dtype)
  (out,) = _bind_local(ctx, eqn, plan, [operand, dataclasses.replace(indices, x=new_idx)])
  out_rank = len(out.shape)
  batch_dims = [i for i in range(out_rank) if i not in dn.offset_dims]
  local_out = out.sharding.local_shape(out.shape, ctx.mesh_sizes)
  mask = lax.broadcast_in_dim(in_range, local_out, batch_dims)
  y = jnp.where(mask, out.x, jnp.zeros((), out.x.dtype))
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


def scatter_add_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """Scatter-add into a split operand: each device keeps the rows it holds."""
  del idx
  dn = eqn.params["dimension_numbers"]
  plan = plan_local(ctx, eqn, ins, scope)
  vals = [ctx.reshard(v, s, eqn, f"operand {j}") if s is not None else v
          for j, (v, s) in enumerate(zip(ins, plan.operands))]
  split = _index_offsets(ctx, eqn, plan, plan.rule.operands[0],
                         [d for d in dn.inserted_window_dims
                          if d in dn.scatter_dims_to_operand_dims], vals[0])
  if not split:
    return _bind_local(ctx, eqn, plan, vals)
  full = eqn.invars[0].aval.shape
  idx_x = vals[1].x
  comps = [idx_x[..., k] for k in range(len(dn.scatter_dims_to_operand_dims))]
  clip = "CLIP" in str(eqn.params["mode"])
  for d, axes, local, offset in split:
    k = list(dn.scatter_dims_to_operand_dims).index(d)
    g = jnp.clip(comps[k], 0, full[d] - 1) if clip else comps[k]
    loc = g - offset.astype(g.dtype)
    ok = (loc >= 0) & (loc < local) & (g >= 0) & (g < full[d])
    comps[k] = jnp.where(ok, loc, local)          # out of range: dropped
  new_idx = jnp.stack(comps, axis=-1).astype(idx_x.dtype)
  from jax.lax import GatherScatterMode
  fixed = dataclasses.replace(vals[1], x=new_idx)
  eqn2 = eqn.replace(params={**eqn.params, "mode": GatherScatterMode.FILL_OR_DROP})
  return _bind_local(ctx, eqn2, plan, [vals[0], fixed, vals[2]])


def call_rule(ctx: Context, eqn, ins, scope, idx, *, param: str) -> list[Value]:
  """A nested jit / custom_jvp / custom_vjp call: interpret its jaxpr inline."""
  from gshard.spmd.partition.interpret import run_jaxpr
  inner = eqn.params[param]
  jaxpr = getattr(inner, "jaxpr", inner)
  consts = getattr(inner, "consts", ())
  return run_jaxpr(ctx, jaxpr, scope + ((idx, (param,)),), consts, ins)


def checkpoint_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``jax.checkpoint``: the per-device program keeps the rematerialisation."""
  from gshard.spmd.partition.interpret import run_jaxpr
  inner = eqn.params["jaxpr"]
  sub = scope + ((idx, ("jaxpr",)),)
  meta: list[Value] = []
  live = [i for i, v in enumerate(ins) if not v.literal]

  def body(*xs):
    args = list(ins)
    for i, x in zip(live, xs):
      args[i] = dataclasses.replace(ins[i], x=x)
    outs = run_jaxpr(ctx, inner, sub, (), args)
    meta[:] = outs
    return [o.x for o in outs]

  xs = jax.checkpoint(body, prevent_cse=eqn.params.get("prevent_cse", True),
                      policy=eqn.params.get("policy"))(*[ins[i].x for i in live])
  return [dataclasses.replace(m, x=x) for m, x in zip(meta, xs)]


def safe_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """The safe path: gather every operand, compute replicated, results replicated."""
  del scope, idx
  ctx.fallback(eqn, "no rule" if eqn.primitive.name not in sharding_rules
               else "no local form")
  first = len(ctx.recorder.collectives)
  xs = [v.x if v.literal else
        ctx.reshard(v, TensorSharding.replicated(len(v.shape)), eqn, f"operand {j}").x
        for j, v in enumerate(ins)]
  cols = ctx.recorder.collectives     # the safe path's gathers are reported as such
  cols[first:] = [dataclasses.replace(c, fallback=True) for c in cols[first:]]
  outs = eqn.primitive.bind(*xs, **eqn.params)
  outs = list(outs) if eqn.primitive.multiple_results else [outs]
  return [Value(o, TensorSharding.replicated(len(v.aval.shape)), tuple(v.aval.shape),
                v.aval.dtype) for o, v in zip(outs, eqn.outvars)]


def _call(param):
  return lambda ctx, eqn, ins, scope, idx: call_rule(ctx, eqn, ins, scope, idx,
                                                     param=param)


partition_rules.update({
    "iota": iota_rule,
    "argmax": arg_reduce_rule,
    "argmin": arg_reduce_rule,
    "gather": gather_rule,
    "scatter-add": scatter_add_rule,
    "jit": _call("jaxpr"),
    "pjit": _call("jaxpr"),
    "closed_call": _call("call_jaxpr"),
    "core_call": _call("call_jaxpr"),
    "custom_jvp_call": _call("call_jaxpr"),
    "custom_vjp_call": _call("call_jaxpr"),
    "remat2": checkpoint_rule,
    "checkpoint": checkpoint_rule,
})
