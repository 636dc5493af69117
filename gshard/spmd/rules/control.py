"""Calls and control flow: links between outer values and inner jaxpr values.

A nested ``jit``, ``custom_jvp_call``, ``custom_vjp_call`` or ``checkpoint``
links operand i to inner invar i and inner outvar j to result j (identity
factor rules). ``scan`` also links each carry's output back to its input and
strips the scanned dim of ``xs``/``ys``; ``while`` and ``cond`` likewise. The
engine then treats inner variables like any other.
"""

from __future__ import annotations

import functools

from jax.extend.core import Literal

from gshard.spmd.partition import control as partition
from gshard.spmd.registry import register
from gshard.spmd.rules._core import (IN, OUT, SUB_IN, SUB_OUT, Constraint, FactorRule,
                                     OpRule, Pin, factor_rule, letters)
from gshard.spmd.sharding import TensorSharding


def identity_rule(shape, linear="unary") -> FactorRule:
  """``ab->ab``: a value linked to another of the same shape."""
  f = letters(len(shape))
  return factor_rule(f"{f}->{f}", [shape], [shape], linear=linear)


def _link(src, dst, shape, linear="unary") -> Constraint:
  return Constraint(identity_rule(tuple(shape), linear), (src,), (dst,))


def _strip_leading(outer, inner, outer_shape, to_inner: bool) -> Constraint:
  """``f32[T,a,b]`` outer to ``f32[a,b]`` inner: ``zab->ab`` with ``z`` blocked.
  A ys value (``to_inner`` False) may leave the loop pending: stacking is
  linear, and its psum after the loop sends what one per step would, at once."""
  rank = len(outer_shape) - 1
  f = letters(rank)
  if to_inner:
    rule = factor_rule(f"z{f}->{f}", [outer_shape], [outer_shape[1:]], blocked="z")
    return Constraint(rule, (outer,), (inner,))
  rule = factor_rule(f"{f}->z{f}", [outer_shape[1:]], [outer_shape], blocked="z",
                     linear="unary")
  return Constraint(rule, (inner,), (outer,))


def call_rule(in_avals, out_avals, *, jaxpr_param: str, **params) -> OpRule:
  """``jit(f)(x, y)``: links x and y to f's invars and f's outvars to the results."""
  del params
  path = (jaxpr_param,)
  cons = [_link(IN(i), SUB_IN(path, i), a.shape) for i, a in enumerate(in_avals)]
  cons += [_link(SUB_OUT(path, j), OUT(j), a.shape) for j, a in enumerate(out_avals)]
  return OpRule(tuple(cons))


def accumulators(jaxpr, first: int, n: int) -> frozenset[int]:
  """The carries (of ``n``, whose invars start at ``first``) that only
  accumulate: the body's result for the carry is ``carry + u`` (``add`` or
  ``add_any``), ``carry - u`` or ``u - carry`` (a sum's pending parts stay
  the parts of the result either way), the carry is read by that op alone,
  and the result by nothing else in the body (a micro-batch loop's gradient
  sum)."""
  uses: dict = {}
  for e in jaxpr.eqns:
    for v in e.invars:
      if not isinstance(v, Literal):
        uses[v] = uses.get(v, 0) + 1
  outs = [v for v in jaxpr.outvars if not isinstance(v, Literal)]
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}
  found = set()
  for c in range(n):
    vin, vout = jaxpr.invars[first + c], jaxpr.outvars[c]
    e = producer.get(vout)
    if (e is not None and e.primitive.name in _ADDS and list(e.invars).count(vin) == 1
        and uses.get(vin) == 1 and vin not in outs and vout not in uses
        and outs.count(vout) == 1 and vin.aval.dtype != bool):
      found.add(c)
  return frozenset(found)


_ADDS = frozenset({"add", "add_any", "sub"})


def scan_rule(in_avals, out_avals, *, num_consts, num_carry, jaxpr, **params) -> OpRule:
  """``scan``: consts linked to the body's invars; each carry linked in, round the
  loop and out, never pending, but for an accumulator (:func:`accumulators`):
  its sum may stay pending round the loop and out of it, one psum after the
  loop instead of one per step, its init seeded (``seed``); ``xs``/``ys``
  strip their scanned dim."""
  path = ("jaxpr",)
  acc = accumulators(jaxpr.jaxpr, num_consts, num_carry)
  cons = []
  for i in range(num_consts):
    cons.append(_link(IN(i), SUB_IN(path, i), in_avals[i].shape))
  for c in range(num_carry):
    i = num_consts + c
    shape = in_avals[i].shape
    carried = "unary" if c in acc else "none"
    cons.append(_link(IN(i), SUB_IN(path, i), shape, linear="seed" if c in acc else "none"))
    cons.append(_link(SUB_OUT(path, c), SUB_IN(path, i), shape, linear=carried))
    cons.append(_link(SUB_OUT(path, c), OUT(c), shape, linear=carried))
  for i in range(num_consts + num_carry, len(in_avals)):
    cons.append(_strip_leading(IN(i), SUB_IN(path, i), in_avals[i].shape, True))
  for j in range(num_carry, len(out_avals)):
    cons.append(_strip_leading(OUT(j), SUB_OUT(path, j), out_avals[j].shape, False))
  return OpRule(tuple(cons))


def shard_map_rule(in_avals, out_avals, *, mesh, in_specs, out_specs, **params) -> OpRule:
  """``jax.shard_map`` inside the partitioned function: its ``in_specs`` are
  preferred for its operands (unless pinned already), its ``out_specs`` pin
  its results, and its body (per-device code) is left as written."""
  del params
  mesh_items = tuple(dict(mesh.shape).items())
  pins = [Pin(IN(i), TensorSharding.from_spec(s, len(a.shape)), what="shard_map in_specs",
              mesh=mesh_items, soft=True) for i, (s, a) in enumerate(zip(in_specs, in_avals))]
  pins += [Pin(OUT(j), TensorSharding.from_spec(s, len(a.shape)), what="shard_map out_specs",
               mesh=mesh_items) for j, (s, a) in enumerate(zip(out_specs, out_avals))]
  return OpRule((), tuple(pins), walk_inner=False)


def while_rule(in_avals, out_avals, *, cond_nconsts, body_nconsts, cond_jaxpr, body_jaxpr,
               **params) -> OpRule:
  """``while``: consts and carries linked to the cond's and body's invars, round
  the loop and out, never pending, but for an accumulator the cond does not
  read (``fori_loop`` with a traced bound: its counter is the cond's): as in
  a ``scan``, its sum stays pending round the loop and out of it (one psum
  after the loop, however many times it runs), its init seeded."""
  del params
  cond, body = ("cond_jaxpr",), ("body_jaxpr",)
  read = _reads(cond_jaxpr.jaxpr)
  acc = {c for c in accumulators(body_jaxpr.jaxpr, body_nconsts, len(out_avals))
         if cond_jaxpr.jaxpr.invars[cond_nconsts + c] not in read}
  cons = []
  for i in range(cond_nconsts):
    cons.append(_link(IN(i), SUB_IN(cond, i), in_avals[i].shape))
  for i in range(body_nconsts):
    k = cond_nconsts + i
    cons.append(_link(IN(k), SUB_IN(body, i), in_avals[k].shape))
  for c, a in enumerate(out_avals):
    k = cond_nconsts + body_nconsts + c
    into, carried = ("seed", "unary") if c in acc else ("none", "none")
    for sub, n in ((body, body_nconsts), (cond, cond_nconsts)):
      cons.append(_link(IN(k), SUB_IN(sub, n + c), a.shape, linear=into))
    for sub, n in ((body, body_nconsts), (cond, cond_nconsts)):
      cons.append(_link(SUB_OUT(body, c), SUB_IN(sub, n + c), a.shape, linear=carried))
    cons.append(_link(SUB_OUT(body, c), OUT(c), a.shape, linear=carried))
  return OpRule(tuple(cons))


def _reads(jaxpr) -> set:
  """The variables a jaxpr's equations or outputs read."""
  vs = {v for e in jaxpr.eqns for v in e.invars if not isinstance(v, Literal)}
  return vs | {v for v in jaxpr.outvars if not isinstance(v, Literal)}


def cond_rule(in_avals, out_avals, *, branches, **params) -> OpRule:
  """``cond``: every branch's invars linked to the operands, its outvars to the
  results. A result may stay pending over the axes every branch leaves its
  result pending (a branch returning zeros, ``lax.cond(p, f, zeros)``, any):
  a weight gradient computed under a cond in a loop is summed once, after
  the loop."""
  cons = []
  for k in range(len(branches)):
    path = ("branches", k)
    for i, a in enumerate(in_avals[1:]):
      cons.append(_link(IN(i + 1), SUB_IN(path, i), a.shape, linear="none"))
  for j, a in enumerate(out_avals):     # every branch's result j, to result j
    f = letters(len(a.shape))
    rule = factor_rule(",".join([f] * len(branches)) + f"->{f}",
                       [a.shape] * len(branches), [a.shape], linear="branch")
    cons.append(Constraint(rule, tuple(SUB_OUT(("branches", k), j)
                                       for k in range(len(branches))), (OUT(j),)))
  return OpRule(tuple(cons))


for _names, _param in (("jit pjit", "jaxpr"),
                       ("closed_call core_call custom_jvp_call custom_vjp_call", "call_jaxpr")):
  register(_names, functools.partial(call_rule, jaxpr_param=_param),
           partition=functools.partial(partition.call_rule, param=_param))
register("remat2 checkpoint", functools.partial(call_rule, jaxpr_param="jaxpr"),
         partition=partition.checkpoint_rule)
register("scan", scan_rule, partition=partition.scan_rule)
register("while", while_rule, partition=partition.while_rule)
register("cond", cond_rule, partition=partition.cond_rule)
register("shard_map", shard_map_rule, partition=partition.shard_map_rule)


def linear_solve_rule(in_avals, out_avals, *, const_lengths, jaxprs) -> OpRule:
  """``custom_linear_solve`` (``jnp.linalg.solve``, ``inv``, ``lax.custom_linear_solve``)
  computes its ``solve`` jaxpr on that jaxpr's consts and ``b`` (the other
  jaxprs serve differentiation, which jax has done before gshard sees it):
  those operands are linked to the jaxpr's invars, its outvars to the results."""
  del jaxprs
  path = ("jaxprs", 2)
  cons = [_link(IN(k), SUB_IN(path, i), in_avals[k].shape, linear="none")
          for i, k in enumerate(partition.solve_operands(const_lengths, len(in_avals)))]
  cons += [_link(SUB_OUT(path, j), OUT(j), a.shape, linear="none")
           for j, a in enumerate(out_avals)]
  return OpRule(tuple(cons))


def platform_index_rule(in_avals, out_avals, **params) -> FactorRule:
  """``platform_index`` (``lax.platform_dependent``'s branch index): no operand,
  a replicated scalar that picks a ``cond`` branch."""
  del in_avals, params
  return factor_rule("->" + ",".join("" for _ in out_avals), [], [()] * len(out_avals))


register("platform_index", platform_index_rule)
register("custom_linear_solve", linear_solve_rule, partition=partition.linear_solve_rule)


def custom_lin_rule(in_avals, outs, /, **params) -> OpRule:
  """``custom_lin`` (``jax.jvp`` of a ``custom_vjp``): no constraint; its
  partition rule raises gshard's error (nothing can lower it). Its params
  hold an ``out_avals`` of their own: the avals are positional only."""
  del in_avals, outs, params
  return OpRule(())


register("custom_lin", custom_lin_rule, partition=partition.custom_lin_rule)
