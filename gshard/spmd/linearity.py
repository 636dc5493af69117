"""The one linearity table: when a pending partial sum of an operand may pass
to the result of an op unresolved (:func:`lets_through`), and which axes it
carries there (:func:`carried`); :data:`ZERO` and :data:`ANY` mark the
operands that add nothing to a sum.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# How a pending partial sum of an operand may pass to the result unresolved.
# ``partials`` lists each operand's pending axes; a literal operand is None, or
# ZERO for a scalar zero. A literal is complete: ``x + 1.0`` with ``x`` pending
# is not a partial sum (every device would add the 1.0), but a ZERO adds
# nothing: ``0 + x`` (Python's ``sum``, ``jax.tree.reduce(add, ...,
# initializer=0)``, optax's global norm) keeps ``x`` pending.
#   "none":    never: it is resolved before the op.
#   "unary":   linear in its one operand (neg, transpose, reshape, reduce_sum ...).
#   "sum":     add-like: every operand has the same pending axes (a ZERO any).
#   "product": bilinear (mul, conv): exactly one operand is pending. A float
#              factor holding inf makes a device whose term is 0 add NaN where
#              one device has +-inf (the README's one stated difference).
#   "first":   linear in operand 0 only (float div): the others are complete.
#   "select":  select_n: the cases as in "sum" (a ZERO any: jax transposes a
#              select into one of the cotangent and zeros), the predicate
#              (operand 0) complete: every device picks the same case, so the
#              select of the terms sums to the select of the sums, exactly.
#   "seed":    a loop accumulator's first value (its init linked to the body's
#              carry): nothing passes (a pending init is resolved first), and
#              the carry may be pending over any axes, ANY, until the loop's
#              body says which: the partitioner keeps the init on the first
#              device of those axes and zeros elsewhere, a sum that is the init.
#   "branch":  every branch's result j linked to the cond's result j: each
#              passes, the result is pending over the axes every branch leaves
#              pending (a branch's ZERO, the zeros ``lax.cond(p, f, zeros)``
#              returns, any), and a branch sums the axes the result does not
#              keep. Only one branch runs, so its terms are the sum.
#   "layout":  a link of dims only (a ``stage_switch``'s index to its results):
#              nothing passes, and the result's sum is left to its other
#              producers (ANY).


class _Mark:
  """A literal operand the table reads by value (see the linearity table)."""

  def __init__(self, name: str):
    self.name = name

  def __repr__(self) -> str:
    return self.name

  def __bool__(self) -> bool:      # pends nothing itself
    return False


ZERO = _Mark("ZERO")
# a seeded carry's pending axes before its loop's body has been marked: in a
# sum it adds nothing (like ZERO), so the sum takes its other operands' axes
ANY = _Mark("ANY")
# linearities that read a literal's mark (others see every literal as None)
READS_LITERALS = frozenset({"sum", "select", "branch"})


def literal_mark(val) -> _Mark | None:
  """ZERO for a scalar zero (``0``, ``0.0``, ``-0.0``), None for anything else."""
  try:
    x = np.asarray(val)      # bfloat16 and the other ml_dtypes too (kind 'V')
    if x.ndim or x.dtype == object:
      return None
    return ZERO if bool(x == 0) else None
  except (TypeError, ValueError):
    return None


def _table(linear: str, partials) -> list:
  """The partials as the table reads them: in a sum a ZERO drops out;
  elsewhere it is a complete literal (None)."""
  if linear == "sum":
    return [p for p in partials if p is not ZERO and p is not ANY]
  return [None if p is ZERO or p is ANY else p for p in partials]


def lets_through(linear: str, partials: Sequence[frozenset[str] | None], i: int) -> bool:
  """Whether operand ``i``'s pending sum passes to the result of the op."""
  if linear == "select":
    return i > 0 and not partials[0] and lets_through("sum", partials[1:], i - 1)
  if linear == "branch":     # what the result does not keep, the branch sums
    return True
  partials = _table(linear, partials)     # in a sum, ``i`` (pending) only reads live[0]
  live = [p for p in partials if p is not None]
  if linear == "unary":
    return len(live) == 1
  if linear == "sum":
    return all((p or frozenset()) == live[0] for p in partials)
  if linear == "product":
    return sum(1 for p in live if p) == 1
  if linear == "first":
    return i == 0 and not any(live[1:])
  return False


def carried(linear: str, partials: Sequence[frozenset[str] | None]) -> frozenset[str]:
  """The pending axes the result inherits from its operands."""
  if linear == "select":
    return carried("sum", partials[1:]) if partials and not partials[0] else frozenset()
  partials = _table(linear, partials)
  live = [p for p in partials if p is not None]
  if linear == "unary" and len(live) == 1:
    return live[0]
  if linear == "sum" and live and all((p or frozenset()) == live[0] for p in partials):
    return live[0]
  if linear == "product" and sum(1 for p in live if p) == 1:
    return next(p for p in live if p)
  if linear == "first" and partials and partials[0] is not None and not any(live[1:]):
    return partials[0]
  return frozenset()
