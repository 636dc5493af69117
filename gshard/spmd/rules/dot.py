"""``dot_general``: batch factors shared, contracting factors summed over.

``f32[b,i,k] . f32[b,k,j] -> f32[b,i,j]`` is ``bik,bkj->bij`` with ``k`` a sum
reduction: split ``k`` and each device holds a partial sum of the result.
"""

from __future__ import annotations

from gshard.spmd.registry import register
from gshard.spmd.rules._core import FactorRule, factor_rule, letters, shapes


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


register("dot_general", dot_general_rule)
