"""Reductions, scans along a dim, and sorts.

``reduce_sum`` over a split dim leaves a pending partial sum (a ``sum``
factor); ``reduce_max``/``argmax`` ... over a split dim need a cross-device
reduction of their own kind (``reduce`` factors). ``cumsum``/``cumprod``/
``cummax``/``cummin`` may keep their dim split (each device scans its block,
then combines in the blocks before it); ``cumlogsumexp``, sorts,
``approx_top_k`` and a ``lax.reduce`` of the user's own computation block
their dim.
"""

from __future__ import annotations

import functools

from gshard.spmd.partition import reduce as partition
from gshard.spmd.registry import register
from gshard.spmd.rules._core import FactorRule, factor_rule, letters, shapes


def reduce_rule(in_avals, out_avals, *, axes, kind: str, **params) -> FactorRule:
  """``reduce_sum(f32[8,16], axes=(1,))`` is ``ab->a sum={b}``."""
  del params
  rank = len(in_avals[0].shape)
  f = letters(rank)
  out = "".join(c for i, c in enumerate(f) if i not in axes)
  reduced = "".join(f[i] for i in axes)
  n = len(in_avals)   # variadic reductions (reduce_max of several) share factors
  spec = ",".join([f] * n) + "->" + ",".join([out] * len(out_avals))
  if kind == "sum":
    return factor_rule(spec, shapes(in_avals), shapes(out_avals), reduction=reduced,
                       linear="unary")
  return factor_rule(spec, shapes(in_avals), shapes(out_avals), other_reduction=reduced)


def positional_collective_rule(in_avals, out_avals, *, axes, kind: str,
                               axis_index_groups=None, **params) -> FactorRule:
  """``psum``/``pmax``/``pmin`` over positional axes, what ``vmap(axis_name=)``
  leaves of a collective over the mapped axis: ``psum(f32[6,12], axes=(0,))``
  is ``reduce_sum``'s ``ab->b sum={a}``. Each operand has factors of its own.
  Named axes (a collective inside a ``shard_map``) are not this rule's."""
  del params
  if axis_index_groups is not None or not all(isinstance(a, int) for a in axes):
    raise NotImplementedError(f"{kind} over named axes {axes}")
  ins, outs, start = [], [], 0
  for aval in in_avals:
    f = letters(len(aval.shape), start)
    start += len(f)
    ins.append(f)
    outs.append("".join(c for i, c in enumerate(f) if i not in axes))
  reduced = "".join(c for f in ins for i, c in enumerate(f) if i in axes)
  spec = ",".join(ins) + "->" + ",".join(outs)
  if kind == "sum":
    return factor_rule(spec, shapes(in_avals), shapes(out_avals), reduction=reduced,
                       linear="unary" if len(ins) == 1 else "none")
  return factor_rule(spec, shapes(in_avals), shapes(out_avals), other_reduction=reduced)


def along_dim_rule(in_avals, out_avals, *, dim_param: str, linear: str = "none",
                   **params) -> FactorRule:
  """Every operand/result shares factors; the dim named by ``dim_param`` is blocked.

  ``cumsum(f32[4,8], axis=1)`` is ``ab->ab blocked={b}``.
  """
  dim = params[dim_param]
  rank = len(in_avals[0].shape)
  f = letters(rank)
  spec = ",".join([f] * len(in_avals)) + "->" + ",".join([f] * len(out_avals))
  return factor_rule(spec, shapes(in_avals), shapes(out_avals), blocked=f[dim % rank],
                     linear=linear)


def _k_of(in_avals, out_avals, dim: int, *, split: bool) -> FactorRule:
  """A top-k along ``dim``: the results' factors are the operand's with a k
  factor (blocked) in place of ``dim``'s, which is a ``reduce`` factor where
  it may be ``split``, else blocked."""
  rank = len(in_avals[0].shape)
  dim %= rank
  f = letters(rank + 1)
  ins, out = f[:rank], f[:dim] + f[rank] + f[dim + 1:rank]
  return factor_rule(f"{ins}->{out},{out}", shapes(in_avals), shapes(out_avals),
                     other_reduction=f[dim] if split else "",
                     blocked=f[rank] if split else f[dim] + f[rank])


def top_k_rule(in_avals, out_avals, *, axis=-1, **params) -> FactorRule:
  """``top_k(f32[4,50], k=2)``: ``ab->ac,ac reduce={b} blocked={c}``: a split
  ``b`` is each device's top k, then the top k of those
  (``partition/reduce.py``); ``axis`` names the dim (the last by default)."""
  del params
  return _k_of(in_avals, out_avals, axis, split=True)


def approx_top_k_rule(in_avals, out_avals, *, reduction_dimension, **params) -> FactorRule:
  """``approx_max_k(f32[4,50], k=2)``: ``ab->ac,ac blocked={bc}``. The reduced
  dim is whole on each device, so each row's result (exact or approximate)
  is the one the whole operand gives."""
  del params
  return _k_of(in_avals, out_avals, reduction_dimension, split=False)


def variadic_reduce_rule(in_avals, out_avals, *, dimensions, **params) -> FactorRule:
  """``lax.reduce`` with a computation of its own (several operands, one init
  value each): ``ab,ab,,->a,a`` with the reduced ``b`` blocked. A split reduced
  dim is gathered: the computation is the user's, so partial results are not
  combined across devices (the order of combining could change the values)."""
  del params
  n = len(out_avals)
  rank = len(in_avals[0].shape)
  f = letters(rank)
  out = "".join(c for i, c in enumerate(f) if i not in dimensions)
  spec = ",".join([f] * n + [""] * n) + "->" + ",".join([out] * n)
  return factor_rule(spec, shapes(in_avals), shapes(out_avals),
                     blocked="".join(f[i] for i in dimensions))


register("reduce_sum", functools.partial(reduce_rule, kind="sum"))
for _name in ("reduce_max", "reduce_min", "reduce_and", "reduce_or"):
  register(_name, functools.partial(reduce_rule, kind=_name), partition=partition.combine_rule)
register("psum", functools.partial(positional_collective_rule, kind="sum"))
for _name in ("pmax", "pmin"):
  register(_name, functools.partial(positional_collective_rule, kind=_name),
           partition=partition.combine_rule)
for _name in ("reduce_prod", "reduce_xor"):     # a split reduced dim is gathered
  register(_name, functools.partial(reduce_rule, kind=_name))
for _name in ("argmax", "argmin"):
  register(_name, functools.partial(reduce_rule, kind=_name),
           partition=partition.arg_reduce_rule)
def cumulative_rule(in_avals, out_avals, *, linear="none", **params) -> FactorRule:
  """``cumsum(f32[4,8], axis=1)`` is ``ab->ab``: a split ``b`` is each
  device's scan of its own block, then the total of the blocks before it
  (after it, ``reverse``) combined in (``partition/reduce.py``)."""
  del params
  f = letters(len(in_avals[0].shape))
  return factor_rule(f"{f}->{f}", shapes(in_avals), shapes(out_avals), linear=linear)


register("cumsum", functools.partial(cumulative_rule, linear="unary"),
         partition=partition.cumulative_rule)
register("cumprod cummax cummin", cumulative_rule, partition=partition.cumulative_rule)
register("cumlogsumexp", functools.partial(along_dim_rule, dim_param="axis"))
register("sort", functools.partial(along_dim_rule, dim_param="dimension"))
register("top_k", top_k_rule, partition=partition.top_k_rule)
register("approx_top_k", approx_top_k_rule)
register("reduce", variadic_reduce_rule)
