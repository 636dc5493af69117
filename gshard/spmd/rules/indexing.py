"""Gather and scatter.

An operand dim indexed by ``gather`` with a slice of 1 (the vocabulary of an
embedding lookup) is a ``sum`` factor: each device looks up the rows it holds,
zeros elsewhere, and the result is a pending sum over that split. The index
vector dim is blocked. A ``scatter-add``'s scattered update dims are summed
into the operand: ``sum`` factors too.
"""

from __future__ import annotations

from gshard.spmd.rules._core import FactorRule, register, shapes
from gshard.spmd.rules.shape import _build, _Names


def gather_rule(in_avals, out_avals, *, dimension_numbers, slice_sizes,
                **params) -> FactorRule:
  """Embedding lookup ``f32[V,D][i32[B,T,1]] -> f32[B,T,D]``: ``vd,btI->btd sum={v}``."""
  del params
  dn = dimension_numbers
  op_shape, idx_shape = shapes(in_avals)
  (out_shape,) = shapes(out_avals)
  new = _Names()
  sizes, blocked, reduction = {}, [], []
  op = [None] * len(op_shape)
  idx = [None] * len(idx_shape)
  out = [None] * len(out_shape)

  def fresh(n, block=False):
    f = new()
    sizes[f] = n
    if block:
      blocked.append(f)
    return f

  batch_out = [d for d in range(len(out_shape)) if d not in dn.offset_dims]
  idx_batch = list(range(len(idx_shape) - 1))
  for i, o in zip(idx_batch, batch_out):
    f = fresh(idx_shape[i])
    idx[i] = out[o] = (f,)
  idx[-1] = (fresh(idx_shape[-1], block=True),)
  for ob, ib in zip(dn.operand_batching_dims, dn.start_indices_batching_dims):
    op[ob] = idx[ib]
  offset_op = [d for d in range(len(op_shape))
               if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
  for d, o in zip(offset_op, dn.offset_dims):
    if slice_sizes[d] == op_shape[d]:
      op[d] = out[o] = (fresh(op_shape[d]),)
    else:
      op[d] = (fresh(op_shape[d], block=True),)
      out[o] = (fresh(out_shape[o], block=True),)
  for d in dn.collapsed_slice_dims:
    f = fresh(op_shape[d], block=d not in dn.start_index_map)
    if d in dn.start_index_map:
      reduction.append(f)
    op[d] = (f,)
  return _build([op, idx], [out], sizes, blocked=blocked, reduction=reduction)


def scatter_rule(in_avals, out_avals, *, dimension_numbers, kind: str,
                 **params) -> FactorRule:
  """Embedding gradient ``scatter-add(f32[V,D], i32[B,T,1], f32[B,T,D])``:
  ``vd,btI,btd->vd sum={bt}``."""
  del params
  dn = dimension_numbers
  op_shape, idx_shape, upd_shape = shapes(in_avals)[:3]
  new = _Names()
  sizes, blocked, reduction = {}, [], []

  def fresh(n, block=False):
    f = new()
    sizes[f] = n
    if block:
      blocked.append(f)
    return f

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
      f = fresh(idx_shape[i], block=kind != "add")
      if kind == "add":
        reduction.append(f)
      idx[i] = upd[u] = (f,)
  idx[-1] = (fresh(idx_shape[-1], block=True),)
  window_op = [d for d in range(len(op_shape))
               if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
  for d, u in zip(window_op, dn.update_window_dims):
    if upd_shape[u] == op_shape[d]:
      upd[u] = op[d]
    else:
      upd[u] = (fresh(upd_shape[u], block=True),)
  return _build([op, idx, upd], [op], sizes, blocked=blocked, reduction=reduction)


register("gather", gather_rule)
for _name, _kind in (("scatter-add", "add"), ("scatter_add", "add"), ("scatter", "set"),
                     ("scatter-mul", "mul"), ("scatter-min", "min"),
                     ("scatter-max", "max")):
  register(_name, lambda *a, _k=_kind, **p: scatter_rule(*a, kind=_k, **p))
