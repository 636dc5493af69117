"""``dot_general``: batch factors shared, contracting factors summed over.

``f32[b,i,k] . f32[b,k,j] -> f32[b,i,j]`` is ``bik,bkj->bij`` with ``k`` a sum
reduction: split ``k`` and each device holds a partial sum of the result.

``ragged_dot_general`` (``lax.ragged_dot``, a mixture of experts' grouped
matmul) is a ``dot_general`` whose lhs rows come in consecutive groups, one
rhs per group. Its group dim is blocked; its ragged dim may be split: each
device's block starts at its own row, so it runs on group sizes cut to the
block (``partition/dot.py``).
"""

from __future__ import annotations

from gshard.spmd.partition import dot as partition
from gshard.spmd.registry import register
from gshard.spmd.rules._core import FactorRule, Factors, factor_rule, letters, shapes


def dot_general_rule(in_avals, out_avals, *, dimension_numbers, **params) -> FactorRule:
  """``f32[b,i,k] . f32[b,k,j]`` is ``bik,bkj->bij sum={k}`` (batch factors first,
  then contracting, then free)."""
  del params
  (lc, rc), (lb, rb) = dimension_numbers
  lshape, rshape = shapes(in_avals)
  names = iter(letters(len(lshape) + len(rshape)))
  lhs = [""] * len(lshape)
  rhs = [""] * len(rshape)
  batch, lfree, rfree, contract = [], [], [], []
  for l, r in zip(lb, rb):
    f = next(names)
    lhs[l] = rhs[r] = f
    batch.append(f)
  for l, r in zip(lc, rc):
    f = next(names)
    lhs[l] = rhs[r] = f
    contract.append(f)
  for i in range(len(lshape)):
    if not lhs[i]:
      lhs[i] = next(names)
      lfree.append(lhs[i])
  for i in range(len(rshape)):
    if not rhs[i]:
      rhs[i] = next(names)
      rfree.append(rhs[i])
  out = "".join(batch + lfree + rfree)
  return factor_rule(f"{''.join(lhs)},{''.join(rhs)}->{out}", shapes(in_avals),
                     shapes(out_avals), reduction="".join(contract))


def ragged_dot_rule(in_avals, out_avals, *, ragged_dot_dimension_numbers, group_offset,
                    **params) -> FactorRule:
  """``ragged_dot(f32[m,k], f32[g,k,n], i32[g])`` is ``mk,gkn,g->mn sum={k}
  blocked={g}``; its weight gradient (the ragged dim contracted, one result
  per group) ``mk,mn,g->gkn sum={m} blocked={g}``. A ragged batch dim is
  blocked. ``group_sizes`` of rank > 1 shares the lhs dims before the ragged
  one (``[b..., g]``)."""
  del params
  if group_offset is not None:
    raise NotImplementedError("ragged_dot_general with a group_offset")
  nums = ragged_dot_dimension_numbers
  (lc, rc), (lb, rb) = nums.dot_dimension_numbers
  (ragged,) = nums.lhs_ragged_dimensions
  lshape, rshape, gshape = shapes(in_avals)
  f = Factors()
  lhs, rhs = [None] * len(lshape), [None] * len(rshape)
  batch, lfree, rfree = [], [], []
  for l, r in zip(lb, rb):
    lhs[l] = rhs[r] = f(lshape[l], blocked=l == ragged)
    batch.append(lhs[l])
  for l, r in zip(lc, rc):
    lhs[l] = rhs[r] = f(lshape[l], reduction=True)
  groups = f(gshape[-1], blocked=True)
  for r in nums.rhs_group_dimensions:
    rhs[r] = groups
  for i, n in enumerate(lshape):
    if lhs[i] is None:
      lhs[i] = f(n)
      lfree.append(lhs[i])
  for i, n in enumerate(rshape):
    if rhs[i] is None:
      rhs[i] = f(n)
      rfree.append(rhs[i])
  out = batch + lfree + rfree
  if ragged in lc:                 # one result per group
    out = [groups] + out
    prefix = list(lb) + list(lc[:list(lc).index(ragged)])
  elif ragged in lb:
    prefix = list(lb[:list(lb).index(ragged)])
  else:
    free = [i for i in range(len(lshape)) if i not in lc and i not in lb]
    prefix = list(lb) + free[:free.index(ragged)]
  sizes = [lhs[i] for i in prefix] + [groups] if len(gshape) > 1 else [groups]
  return f.rule([[(x,) for x in lhs], [(x,) for x in rhs], [(x,) for x in sizes]],
                [[(x,) for x in out]])


register("dot_general", dot_general_rule)
register("ragged_dot_general", ragged_dot_rule, partition=partition.ragged_dot_rule)
