"""Windowed ops: convolution, pooling (``reduce_window*``) and their gradients.

A spatial dim of a windowed op is a factor that the operand shares with the
result (or, for a weight-gradient convolution, with the other operand): the
split is *not* blocked. Rows near a shard's edge need a few rows of the
neighbouring shards (the halo); the partition rule
(``spmd/partition/windowed.py``) exchanges them with ``ppermute``. A shared
spatial factor gets the smaller of the two dim sizes, so propagation never
splits it into more shards than either dim has rows.

Convolution ``conv_general_dilated(lhs, rhs)`` (dims named by
``dimension_numbers``; ``lhs [N, C, S..]``, ``rhs [O, I, K..]``,
``out [N, O, Q..]``):

- batch ``n`` (lhs N, out N) and output features ``o`` (rhs O, out O) are free;
  input features ``c`` (lhs C, rhs I) are a **sum** factor: split them and each
  device holds a partial sum.
- with ``feature_group_count = G > 1``: lhs C is ``(g i)`` and rhs O, out O are
  ``(g p)`` (group major, as XLA orders groups); ``g`` is free (a
  depthwise convolution with its channels split runs locally with ``G/n``
  groups), ``i`` is blocked. ``batch_group_count = B > 1`` likewise: lhs N is
  ``(g m)``, out N ``m`` (blocked), rhs O and out O ``(g p)``.
- spatial dim ``j``: when ``Q_j >= K_j`` (an ordinary convolution, or the
  input gradient) lhs ``S_j`` and out ``Q_j`` share a factor and the kernel's
  ``K_j`` is blocked. When ``K_j > Q_j`` (the weight gradient: the "kernel"
  is the output cotangent, as large as the image) lhs ``S_j`` and rhs ``K_j``
  share a **sum** factor and out ``Q_j`` is blocked: split the image and each
  device holds a partial weight gradient.

Printed rules (the golden rows in ``tests/test_windowed.py``):

=============================================  ========================================
``f32[8,16,16,3] * f32[3,3,3,4]`` NHWC/HWIO    ``adfb,egbc->adfc sum={b} blocked={eg}
SAME                                           linear=product``: rows ``d``, columns
                                               ``f`` free, kernel window ``e, g``
                                               blocked
its weight gradient (lhs ``x``, rhs the        ``bdfa,bdfc->egac sum={bdf} blocked={eg}
output cotangent, out ``f32[3,3,3,4]``)        linear=product``: batch ``b`` and the
                                               image ``d, f`` summed
depthwise ``f32[2,16,8] * f32[3,1,16]``,       ``ae(bc),fc(bd)->ae(bd) sum={c}
8 groups                                       blocked={cf} linear=product``
=============================================  ========================================

Pooling ``reduce_window_{sum,max,min}`` / ``reduce_window`` /
``select_and_gather_add``: every dim of the operand(s) shares a factor with the
result; a windowed dim (window, stride, padding or dilation not trivial) is
free as well (the halo rule handles it). ``select_and_scatter_add(source,
operand)`` (the gradient of max pooling) shares each dim of ``source`` (pooled)
with ``operand`` and the result (full size).
"""

from __future__ import annotations

import functools

from gshard.spmd.partition import conv as partition
from gshard.spmd.registry import register
from gshard.spmd.rules._core import FactorRule, Factors, shapes


def conv_rule(in_avals, out_avals, *, dimension_numbers, feature_group_count,
              batch_group_count, **params) -> FactorRule:
  """Factors of ``conv_general_dilated`` (see the module docstring)."""
  del params
  (lhs_shape, rhs_shape), (out_shape,) = shapes(in_avals), shapes(out_avals)
  lhs_spec, rhs_spec, out_spec = dimension_numbers
  new = Factors()
  lhs: list = [None] * len(lhs_shape)
  rhs: list = [None] * len(rhs_shape)
  out: list = [None] * len(out_shape)
  G, B = feature_group_count, batch_group_count
  n_out = out_shape[out_spec[0]]
  o_out = out_shape[out_spec[1]]
  c_in = rhs_shape[rhs_spec[1]]
  # batch
  if B == 1:
    n = new(n_out)
    lhs[lhs_spec[0]] = out[out_spec[0]] = (n,)
  else:
    g, m = new(B), new(n_out, blocked=True)
    lhs[lhs_spec[0]] = (g, m)
    out[out_spec[0]] = (m,)
  # features: input (contracting) and output
  groups = B if B > 1 else G
  if groups == 1:
    c, o = new(c_in, reduction=True), new(o_out)
    lhs[lhs_spec[1]] = rhs[rhs_spec[1]] = (c,)
    rhs[rhs_spec[0]] = out[out_spec[1]] = (o,)
  else:
    if B > 1:
      c = new(c_in, reduction=True)
      lhs[lhs_spec[1]] = rhs[rhs_spec[1]] = (c,)
    else:
      g = new(G)
      i = new(c_in, blocked=True, reduction=True)
      lhs[lhs_spec[1]] = (g, i)
      rhs[rhs_spec[1]] = (i,)
    p = new(o_out // groups)
    rhs[rhs_spec[0]] = out[out_spec[1]] = (g, p)
  # spatial
  for ls, rs, os_ in zip(lhs_spec[2:], rhs_spec[2:], out_spec[2:]):
    L, K, Q = lhs_shape[ls], rhs_shape[rs], out_shape[os_]
    if Q >= K:
      s = new(min(L, Q))
      lhs[ls] = out[os_] = (s,)
      rhs[rs] = (new(K, blocked=True),)
    else:
      s = new(min(L, K), reduction=True)
      lhs[ls] = rhs[rs] = (s,)
      out[os_] = (new(Q, blocked=True),)
  return new.rule([lhs, rhs], [out], linear="product")


def pool_rule(in_avals, out_avals, *, n_operands: int, linear: str = "none",
              **params) -> FactorRule:
  """``reduce_window_max f32[8,16,16,4]`` 2x2/2: ``abcd->abcd`` (every dim shared,
  the windowed ones too). ``n_operands`` array operands come first; any
  further operands (a generic ``reduce_window``'s init values) are scalars."""
  del params
  in_shapes, out_shapes = shapes(in_avals), shapes(out_avals)
  new = Factors()
  dims = [(new(min(n, q)),) for n, q in zip(in_shapes[0], out_shapes[0])]
  operands = [dims] * n_operands + [[] for _ in in_shapes[n_operands:]]
  return new.rule(operands, [dims] * len(out_shapes), linear=linear)


def reduce_window_rule(in_avals, out_avals, **params) -> FactorRule:
  """Generic ``reduce_window``: operands then as many scalar init values."""
  return pool_rule(in_avals, out_avals, n_operands=len(in_avals) // 2, **params)


def select_and_scatter_add_rule(in_avals, out_avals, **params) -> FactorRule:
  """``select_and_scatter_add(source f32[8,4,4,4], operand f32[8,8,8,4])``:
  ``abcd,abcd->abcd linear=first`` (each pooled dim shares the factor of the
  full-size dim it pools; the factor's size is the smaller)."""
  del params
  (src_shape, op_shape), _ = shapes(in_avals), shapes(out_avals)
  new = Factors()
  dims = [(new(min(q, n)),) for q, n in zip(src_shape, op_shape)]
  return new.rule([dims, dims], [dims], linear="first")


register("conv_general_dilated", conv_rule, partition=partition.conv_rule)
register("reduce_window_sum", functools.partial(pool_rule, n_operands=1, linear="unary"),
         partition=partition.pool_rule)
register("reduce_window_max reduce_window_min", functools.partial(pool_rule, n_operands=1),
         partition=partition.pool_rule)
register("reduce_window", reduce_window_rule, partition=partition.pool_rule)
# Linear in the tangents (operand 0), not in the operand that picks the winner.
register("select_and_gather_add", functools.partial(pool_rule, n_operands=2, linear="first"),
         partition=partition.pool_rule)
register("select_and_scatter_add", select_and_scatter_add_rule,
         partition=partition.select_and_scatter_add_rule)
