"""Gather, scatter and dynamic slices.

An operand dim indexed by ``gather`` with a slice of 1 (the vocabulary of an
embedding lookup) is a ``sum`` factor: each device looks up the rows it holds,
zeros elsewhere, and the result is a pending sum over that split. The index
vector dim is blocked. A ``scatter-add``'s scattered update dims are summed
into the operand: ``sum`` factors too.
"""

from __future__ import annotations

import functools

from gshard.spmd.partition import indexing as partition
from gshard.spmd.registry import register
from gshard.spmd.rules._core import FactorRule, Factors, shapes
from gshard.spmd.rules.shape import windowed_rule


def gather_rule(in_avals, out_avals, *, dimension_numbers, slice_sizes,
                **params) -> FactorRule:
  """Embedding lookup ``f32[V,D][i32[B,T,1]] -> f32[B,T,D]``: ``vd,btI->btd sum={v}``."""
  del params
  dn = dimension_numbers
  op_shape, idx_shape = shapes(in_avals)
  (out_shape,) = shapes(out_avals)
  fresh = Factors()
  op = [None] * len(op_shape)
  idx = [None] * len(idx_shape)
  out = [None] * len(out_shape)

  batch_out = [d for d in range(len(out_shape)) if d not in dn.offset_dims]
  idx_batch = list(range(len(idx_shape) - 1))
  for i, o in zip(idx_batch, batch_out):
    f = fresh(idx_shape[i])
    idx[i] = out[o] = (f,)
  idx[-1] = (fresh(idx_shape[-1], blocked=True),)
  for ob, ib in zip(dn.operand_batching_dims, dn.start_indices_batching_dims):
    op[ob] = idx[ib]
  offset_op = [d for d in range(len(op_shape))
               if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
  for d, o in zip(offset_op, dn.offset_dims):
    if slice_sizes[d] == op_shape[d]:
      op[d] = out[o] = (fresh(op_shape[d]),)
    else:
      op[d] = (fresh(op_shape[d], blocked=True),)
      out[o] = (fresh(out_shape[o], blocked=True),)
  for d in dn.collapsed_slice_dims:
    indexed = d in dn.start_index_map
    op[d] = (fresh(op_shape[d], blocked=not indexed, reduction=indexed),)
  return fresh.rule([op, idx], [out])


def scatter_rule(in_avals, out_avals, *, dimension_numbers, kind: str,
                 **params) -> FactorRule:
  """Embedding gradient ``scatter-add(f32[V,D], i32[B,T,1], f32[B,T,D])``:
  ``vd,btI,btd->vd sum={bt}``."""
  del params
  dn = dimension_numbers
  op_shape, idx_shape, upd_shape = shapes(in_avals)[:3]
  fresh = Factors()
  op = [(fresh(n),) for n in op_shape]
  idx = [None] * len(idx_shape)
  upd = [None] * len(upd_shape)
  scatter_upd = [d for d in range(len(upd_shape)) if d not in dn.update_window_dims]
  for i, u in zip(range(len(idx_shape) - 1), scatter_upd):
    batch_pair = i in dn.scatter_indices_batching_dims
    if batch_pair:
      ob = dn.operand_batching_dims[list(dn.scatter_indices_batching_dims).index(i)]
      idx[i] = upd[u] = op[ob]
    else:
      f = fresh(idx_shape[i], blocked=kind != "add", reduction=kind == "add")
      idx[i] = upd[u] = (f,)
  idx[-1] = (fresh(idx_shape[-1], blocked=True),)
  window_op = [d for d in range(len(op_shape))
               if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
  for d, u in zip(window_op, dn.update_window_dims):
    if upd_shape[u] == op_shape[d]:
      upd[u] = op[d]
    else:   # a window narrower than the dim: where it lands depends on the index
      upd[u] = (fresh(upd_shape[u], blocked=True),)
      op[d] = (fresh(op_shape[d], blocked=True),)
  return fresh.rule([op, idx, upd], [op])


def dynamic_slice_rule(in_avals, out_avals, *, slice_sizes, **params) -> FactorRule:
  """A dim read whole shares its factor; a sliced dim is blocked (the partition
  rule still reads along a split one: a masked local read and a pending sum)."""
  del params
  op_shape = in_avals[0].shape
  keep = [s == n for s, n in zip(slice_sizes, op_shape)]
  return windowed_rule(in_avals, out_avals, keep, linear="unary")


def dynamic_update_slice_rule(in_avals, out_avals, **params) -> FactorRule:
  """Operand and result share every factor; the update shares the dims it covers."""
  del params
  op_shape, upd_shape, *idx = shapes(in_avals)
  new = Factors()
  op, upd = [], []
  for n, m in zip(op_shape, upd_shape):
    f = new(n)
    op.append((f,))
    upd.append((f,) if n == m else (new(m),))
  return new.rule([op, upd] + [[] for _ in idx], [op])



register("gather", gather_rule, partition=partition.gather_rule)
register("scatter-add", functools.partial(scatter_rule, kind="add"),
         partition=partition.scatter_rule)
# operand - sum of updates: linear like scatter-add
register("scatter-sub", functools.partial(scatter_rule, kind="add"),
         partition=partition.scatter_rule)
# Scatters that overwrite or combine by mul/min/max: their scattered update dims
# are blocked (no partial result to combine); a split operand dim is written
# locally, each device keeping the updates that land in its rows.
for _name, _kind in (("scatter", "set"), ("scatter-mul", "mul"), ("scatter-min", "min"),
                     ("scatter-max", "max")):
  register(_name, functools.partial(scatter_rule, kind=_kind), partition=partition.scatter_rule)
register("dynamic_slice", dynamic_slice_rule, partition=partition.dynamic_slice_rule)
register("dynamic_update_slice", dynamic_update_slice_rule,
         partition=partition.dynamic_update_slice_rule)
