"""The generic partition rule: the primitive itself, on local shapes.

Most primitives need no partition code of their own. :func:`plan_local`
(``partition/plan.py``) reads the primitive's factor rule (the one propagation
used), picks per factor the mesh axes to compute with (the candidate that sends
fewer bytes), and gives the operand and result shardings that implies;
:func:`bind_local` reshards the operands to them, masks the padding of
unevenly split reduced dims with the reduction's identity, rewrites
shape-carrying params to local shapes and binds the primitive. A result is
pending (a partial sum) over the axes of its split ``sum`` factors and those a
linear op lets through. Rules of their own (``partition/X.py``) build on the
same two functions. :func:`safe_rule` is the safe path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr

from gshard.spmd import registry
from gshard.spmd.collectives import is_key, zeros
from gshard.spmd.partition import windowed_einsum
from gshard.spmd.partition.context import Context, Value
from gshard.spmd.partition.plan import LocalPlan, factor_rule_of, note_options, plan_local
from gshard.spmd.sharding import TensorSharding
from gshard.spmd.tracing import MESH_KEY

__all__ = ["bind_local", "generic_rule", "identity_rule", "local_params", "mask_padding",
           "reduction_identity", "safe_rule"]


def local_params(eqn, out_local_shapes, in_local_shapes) -> dict:
  """The equation's params with shape-carrying ones made per-device, and an
  inner jaxpr bound as it is (a scatter's or a reduce's combiner) without
  the trace's mesh key (``tracing.traced_for``)."""
  params = dict(eqn.params)
  for k in ("sharding", "out_sharding"):
    if k in params:
      params[k] = None
  params = unkeyed(params)
  fix = _LOCAL_PARAMS.get(eqn.primitive.name)
  if fix is not None:
    params = fix(params, out_local_shapes, in_local_shapes, eqn)
  return params


def unkeyed(params: dict) -> dict:
  """``params`` with each inner jaxpr bound as it is (a scatter's or a
  reduce's combiner) made without the trace's mesh key (:func:`_unkeyed`)."""
  out = dict(params)
  for k, v in params.items():
    if isinstance(v, Jaxpr):
      out[k] = _unkeyed(v)
    elif isinstance(v, ClosedJaxpr):
      out[k] = ClosedJaxpr(_unkeyed(v.jaxpr), v.consts)
  return out


def _unkeyed(jaxpr):
  """``jaxpr`` with its equations' context made without the mesh key (it
  lowered as a frontend attribute: the program's text differed from
  GSPMD's by it); the user's ``set_xla_metadata``, which the interpreter
  binds this equation under, is kept."""
  if not any(MESH_KEY in (e.ctx.xla_metadata or {}) for e in jaxpr.eqns):
    return jaxpr
  ctx = jax.make_jaxpr(lambda x: -x)(np.float32(0)).eqns[0].ctx   # the current context
  return jaxpr.replace(eqns=[e.replace(ctx=ctx) if MESH_KEY in (e.ctx.xla_metadata or {})
                             else e for e in jaxpr.eqns])


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


def _tile_params(params, outs, ins, eqn):
  params["reps"] = tuple(o // i if i else r for o, i, r in zip(outs[0], ins[0], params["reps"]))
  return params


_LOCAL_PARAMS = {
    "broadcast_in_dim": _shape_param("shape"),
    "reshape": _shape_param("new_sizes"),
    "iota": _shape_param("shape"),
    "slice": _slice_params,
    "dynamic_slice": _dynamic_slice_params,
    "gather": _gather_params,
    "tile": _tile_params,
}


_MAX_LIKE = {"reduce_max", "argmax", "pmax"}
_MIN_LIKE = {"reduce_min", "argmin", "pmin"}


def reduction_identity(name: str, dtype):
  """The value padding must hold so that reducing it changes nothing."""
  dtype = np.dtype(dtype)
  if name in _MAX_LIKE or name in _MIN_LIKE:
    low = name in _MAX_LIKE
    if dtype == np.bool_:
      return not low
    if jnp.issubdtype(dtype, jnp.complexfloating):   # ordered by real, then imaginary
      return complex(-np.inf, -np.inf) if low else complex(np.inf, np.inf)
    if jnp.issubdtype(dtype, jnp.inexact):
      # float8 types without inf (e4m3fn, the fnuz ones) hold their extremes
      with np.errstate(invalid="ignore", over="ignore"):
        has_inf = np.isinf(np.asarray(np.inf, dtype)).item()
      info = jnp.finfo(dtype)
      return (-np.inf if low else np.inf) if has_inf else (info.min if low else info.max)
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
      for d, fs in enumerate(dims):
        if len(fs) == 1 and fs[0] in uneven:
          n = sizes[fs[0]]
          local = np.shape(x)[d]
          idx = ctx.linear_index(uneven[fs[0]]) * local + lax.iota(jnp.int32, local)
          m = lax.broadcast_in_dim(idx < n, np.shape(x), (d,))
          mask = m if mask is None else (mask & m)
    if mask is not None:
      fill = (zeros((), x.dtype) if is_key(x.dtype)     # keys: a sum of their data
              else jnp.asarray(reduction_identity(eqn.primitive.name, x.dtype), x.dtype))
      x = jnp.where(mask, x, fill)
    out.append(x)
  return out


def seed(v: Value, target: TensorSharding) -> Value:
  """``v`` as a pending sum over ``target.partial`` too: along the axes it is
  not pending over, kept on the first device and zeros elsewhere (their sum
  is the value). No communication."""
  missing = target.partial - v.sharding.partial
  if not missing:
    return v
  first = functools.reduce(jnp.logical_and, [lax.axis_index(a) == 0 for a in sorted(missing)])
  return Value(jnp.where(first, v.x, zeros(np.shape(v.x), v.x.dtype)),
               v.sharding.with_partial(v.sharding.partial | missing), v.shape, v.dtype)


def fit(ctx: Context, v: Value, s: TensorSharding, eqn, role: str) -> Value:
  """``v`` laid out as ``s``, a pending sum over ``s.partial``: resharded
  (which resolves axes ``s`` does not keep), then seeded over the axes ``v``
  was not pending over (a value the partitioner made complete where
  propagation left a sum pending: a lookup's moved table; a cond branch's
  zeros)."""
  return seed(ctx.reshard(v, s, eqn, role), s)


def bind_local(ctx: Context, eqn, plan: LocalPlan, ins: list[Value],
               window: windowed_einsum.Window | None = None,
               bind: Callable | None = None) -> list[Value]:
  """Reshard ``ins`` to ``plan``'s operands, mask padding, bind the primitive on
  local values with local shape params; the results' values (shapes checked).

  With a ``window`` (``windowed_einsum.choose``) the gather of its operand, or
  the reduce-scatter of the result, is a ring of ppermutes around the local op
  instead. ``bind`` replaces ``eqn.primitive.bind`` (same arguments)."""
  note_options(ctx, eqn, plan, ins, window)
  xs = []
  for j, (v, s) in enumerate(zip(ins, plan.operands)):
    if s is None or (window is not None and window.operand == j):
      xs.append(v.x)          # a literal, or the block that circulates
    elif s.partial - v.sharding.partial:   # a sum's complete operand seeded (plan._seeds)
      xs.append(seed(ctx.reshard(v, s, eqn, f"operand {j}"), s).x)
    else:
      xs.append(ctx.reshard(v, s, eqn, f"operand {j}").x)
  xs = mask_padding(ctx, eqn, plan, xs)
  results = plan.results if window is None else list(window.results)
  out_shapes = [tuple(v.aval.shape) for v in eqn.outvars]
  out_local = [s.local_shape(sh, ctx.mesh_sizes) for s, sh in zip(results, out_shapes)]
  in_local = [tuple(np.shape(x)) for x in xs]
  params = local_params(eqn, out_local, in_local)
  if eqn.primitive.name == "reshape" and math.prod(in_local[0]) != math.prod(out_local[0]):
    raise AssertionError(
        f"gshard internal error: local reshape {in_local[0]} -> {out_local[0]} changes "
        f"the element count (global {eqn.invars[0].aval.shape} -> {out_shapes[0]}, "
        f"operand {plan.operands[0]}, result {plan.results[0]}).")
  if window is not None:
    outs = windowed_einsum.run(ctx, eqn, window, plan, ins, xs, params)
  else:
    outs = _bind(eqn, xs, params, bind)
  _check_local(eqn, outs, out_local, results)
  return [Value(o, s, sh, v.aval.dtype)
          for o, s, sh, v in zip(outs, results, out_shapes, eqn.outvars)]


def _bind(eqn, xs: list, params: dict, bind: Callable | None = None) -> list:
  """``bind`` (the primitive's own by default) on ``xs``; its results as a list."""
  outs = (bind or eqn.primitive.bind)(*xs, **params)
  return list(outs) if eqn.primitive.multiple_results else [outs]


def _check_local(eqn, outs, out_local, shardings) -> None:
  """Each local result has the shape its sharding gives (else a gshard bug)."""
  for o, want, s in zip(outs, out_local, shardings):
    if tuple(np.shape(o)) != tuple(want):
      raise AssertionError(
          f"gshard internal error: {eqn.primitive.name} gave local shape "
          f"{tuple(np.shape(o))}, expected {want} for sharding {s}.")


def generic_rule(ctx: Context, eqn, ins, scope, idx, *,
                 bind: Callable | None = None) -> list[Value]:
  """The primitive itself on local shapes, from its factor rule (``plan_local``);
  ``bind`` replaces ``eqn.primitive.bind`` on the local blocks."""
  try:
    factor_rule_of(eqn)
  except NotImplementedError:   # a case the sharding rule does not cover
    return safe_rule(ctx, eqn, ins, scope, idx)
  if ctx.all_replicated(eqn, ins, scope):   # nothing split or pending: the op as written
    return _bind_whole(eqn, [v.x for v in ins])
  same = _one_layout(ctx, eqn, ins, scope)
  if same is not None and bind is None:
    return _bind_in_place(ctx, eqn, ins, same)
  plan = plan_local(ctx, eqn, ins, scope)
  return bind_local(ctx, eqn, plan, ins, windowed_einsum.choose(ctx, eqn, plan, ins, scope),
                    bind=bind)


def _one_layout(ctx: Context, eqn, ins: list[Value], scope) -> TensorSharding | None:
  """The layout every operand arrives in and every result is wanted in, for
  an op whose factors pass dim for dim from operands to results (elementwise:
  ``add``, ``mul``, ``select_n``, ``convert_element_type``), nothing pending
  and no factor blocked: its local plan is the op on the blocks as they are
  (what ``plan_local`` would find, without weighing). None otherwise."""
  rule = factor_rule_of(eqn)
  if rule.reduction or rule.other_reduction or rule.blocked:
    return None
  dims = rule.results[0]
  if any(r != dims for r in rule.results) or any(o and o != dims for o in rule.operands):
    return None
  same = None
  for v, o in zip(ins, rule.operands):
    if v.literal:
      continue
    if v.sharding.partial:
      return None
    if o:                    # a scalar operand is whole on every device
      if same is not None and v.sharding != same:
        return None
      same = v.sharding
  if same is None:
    return None
  shape = eqn.outvars[0].aval.shape
  if any(ctx.num_shards(a) > n for a, n in zip(same.dims, shape) if a):
    return None              # more blocks than rows: the plan search gathers the dim
  for var in eqn.outvars:
    if type(var).__name__ != "DropVar" and ctx.target(scope, var) != same:
      return None
  return same


def _bind_in_place(ctx: Context, eqn, ins: list[Value], same: TensorSharding) -> list[Value]:
  """The op on the local blocks of one layout; its results in that layout."""
  xs = [v.x for v in ins]
  out = same.local_shape(tuple(eqn.outvars[0].aval.shape), ctx.mesh_sizes)
  n = len(eqn.outvars)
  params = local_params(eqn, [out] * n, [tuple(np.shape(x)) for x in xs])
  outs = _bind(eqn, xs, params)
  _check_local(eqn, outs, [out] * n, [same] * n)
  return [Value(o, same, tuple(v.aval.shape), v.aval.dtype) for o, v in zip(outs, eqn.outvars)]


def safe_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """The safe path: gather every operand, compute replicated, results replicated."""
  del scope, idx
  ctx.fallback(eqn, "no rule" if registry.sharding_rule(eqn.primitive.name) is None
               else "no local form",
               gathered=any(not v.literal and v.sharding != TensorSharding.replicated(
                   len(v.shape)) for v in ins))
  first = len(ctx.recorder.collectives)
  xs = [v.x if v.literal else
        ctx.reshard(v, TensorSharding.replicated(len(v.shape)), eqn, f"operand {j}").x
        for j, v in enumerate(ins)]
  cols = ctx.recorder.collectives     # the safe path's gathers are reported as such
  cols[first:] = [dataclasses.replace(c, fallback=True) for c in cols[first:]]
  return _bind_whole(eqn, xs)


def _bind_whole(eqn, xs: list) -> list[Value]:
  """The primitive on whole (replicated) operands; its results replicated."""
  params = local_params(eqn, [v.aval.shape for v in eqn.outvars], [np.shape(x) for x in xs])
  return [Value(o, TensorSharding.replicated(len(v.aval.shape)), tuple(v.aval.shape),
                v.aval.dtype) for o, v in zip(_bind(eqn, xs, params), eqn.outvars)]


def identity_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """The value as it is (``reshard``, ``with_sharding_constraint``); the
  interpreter then brings it to its propagated sharding."""
  del ctx, eqn, scope, idx
  return [ins[0]]
