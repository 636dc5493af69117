"""Annotations a plan places inside the program, and the function that applies them.

An :class:`Annotation` names one top-level value of the traced program by the
equation that makes it (its index in the program and which result), with the
user's source line and the sharding the plan gives it. :func:`annotate`
wraps a function so that, traced, it runs the same equations with
``gshard.shard`` on those values: what the user would write at those lines.
Each re-run equation keeps its own source line, so ``explain()`` still points
at the user's code.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
from jax.extend.core import Literal
from jax.sharding import PartitionSpec as P

from gshard.annotate import shard
from gshard.spmd.source import rebinding


@dataclasses.dataclass(frozen=True)
class Annotation:
  """``gshard.shard(value, spec)`` on result ``out`` of equation ``eqn``.

  Attributes:
    eqn: index of the equation in the traced top-level program.
    out: which of its results.
    primitive: the equation's primitive (checked when applied).
    source: the user's file:line of the equation.
    spec: the PartitionSpec the value is pinned to.
    shape: the value's shape.
    dtype: the value's dtype (short form, ``f32``).
  """

  eqn: int
  out: int
  primitive: str
  source: str
  spec: P
  shape: tuple[int, ...]
  dtype: str

  def __str__(self) -> str:
    return (f"{self.source}: gshard.shard(<{self.primitive} result {self.dtype}"
            f"{list(self.shape)}>, {self.spec})")


def annotate(fn: Callable, annotations: Sequence[Annotation]) -> Callable:
  """``fn`` with ``annotations`` applied (``fn`` itself when there are none).

  The wrapped function traces ``fn`` on its arguments and evaluates the traced
  program equation by equation, pinning the annotated values. It is meant to be
  traced (by ``gshard.partition``); called eagerly it runs op by op.
  A function whose program no longer has the annotated equations (other
  shapes, changed code) is a ValueError naming the first that is missing.
  """
  if not annotations:
    return fn
  by_eqn: dict[int, dict[int, Annotation]] = {}
  for a in annotations:
    by_eqn.setdefault(a.eqn, {})[a.out] = a

  @functools.wraps(fn)
  def annotated(*args):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    jaxpr = closed.jaxpr
    for a in annotations:
      eqns = jaxpr.eqns
      if a.eqn >= len(eqns) or eqns[a.eqn].primitive.name != a.primitive:
        raise ValueError(
            f"the plan's annotation at {a.source} names equation {a.eqn} "
            f"({a.primitive}), which this call's program does not have: "
            f"{getattr(fn, '__name__', 'the function')} traces differently for "
            "these arguments. Run gshard.auto_shard again on arguments of these "
            "shapes.")
    flat = jax.tree_util.tree_leaves(args)
    outs = _run(jaxpr, closed.consts, flat, by_eqn)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

  return annotated


def _run(jaxpr, consts, args, by_eqn):
  env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))

  def read(v):
    return v.val if isinstance(v, Literal) else env[v]

  for i, eqn in enumerate(jaxpr.eqns):
    params = eqn.primitive.get_bind_params(eqn.params)
    with rebinding(eqn.source_info), \
        eqn.ctx.manager:
      ans = eqn.primitive.bind(*map(read, eqn.invars), **params)
      outs = list(ans) if eqn.primitive.multiple_results else [ans]
      for j, a in by_eqn.get(i, {}).items():
        outs[j] = shard(outs[j], a.spec)
    for v, x in zip(eqn.outvars, outs):
      env[v] = x
  return [read(v) for v in jaxpr.outvars]
