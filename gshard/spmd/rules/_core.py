"""Factor rules (the Shardy way) and the table of sharding rules.

A :class:`FactorRule` names each dimension of every operand and result by
factors: ``dot_general`` of ``f32[b,i,k]`` and ``f32[b,k,j]`` is
``bik,bkj->bij`` with ``k`` a sum-reduction factor; a reshape of ``f32[6,4]``
to ``f32[2,3,4]`` is ``(ab)c->abc`` with a compound first dim. Propagation
works on factors only, so it never needs to know a primitive.

A sharding rule is a pure function ``rule(in_avals, out_avals, **params)``
returning a FactorRule (over the equation's operands and results) or an
:class:`OpRule` (several constraints, e.g. linking a call's operands to the
variables of its inner jaxpr, and pins).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

from gshard.spmd.sharding import TensorSharding

Dims = tuple[tuple[str, ...], ...]   # per dim, the factors (major first) it holds

# How a pending partial sum of an operand may pass to the result unresolved
# (the table itself: gshard/spmd/factors.py, ``lets_through``).
#   "none":    it must be resolved first (psum) before the op.
#   "unary":   linear in its one operand (neg, convert, transpose, reshape, ...).
#   "sum":     add-like: passes when every operand has the same partial axes.
#   "product": bilinear (mul, conv): passes when exactly one operand is partial.
#   "first":   linear in operand 0 only, the others unpartial (float div).
#   "seed":    a loop accumulator's first value: the result may be pending
#              over any axes (the partitioner keeps the value on one device).
#   "select":  select_n: its cases as "sum", the predicate (operand 0) unpartial.
#   "branch":  every cond branch's result linked to the cond's: each passes,
#              the result pending over the axes every branch leaves pending (a
#              branch returning zeros any), the others summed in the branch.
#   "layout":  links dims only: the result's sum is another constraint's to say
#              (a ``stage_switch``'s index to its results' stage dim).
LINEARITIES = ("none", "unary", "sum", "product", "first", "seed", "select", "branch",
               "layout")


@dataclasses.dataclass(frozen=True)
class FactorRule:
  """Each operand and result dim named by factors.

  Attributes:
    operands: per operand, per dim, the factors of that dim (major first).
    results: the same for the results.
    sizes: factor name -> size, sorted by name.
    reduction: factors summed over (appear in operands, not results). If one
      is split, each device computes a partial sum: the result is pending.
    other_reduction: factors reduced by max/min/argmax/product ... A split one
      needs a cross-device reduction of that kind (not a pending sum).
    blocked: factors that must not be split (sorted dim, cumsum axis, ...).
    linear: how a pending partial sum of an operand may reach the result.
  """

  operands: tuple[Dims, ...]
  results: tuple[Dims, ...]
  sizes: tuple[tuple[str, int], ...]
  reduction: frozenset[str] = frozenset()
  other_reduction: frozenset[str] = frozenset()
  blocked: frozenset[str] = frozenset()
  linear: str = "none"

  def __post_init__(self):
    if self.linear not in LINEARITIES:
      raise ValueError(f"linear={self.linear!r} is not one of {LINEARITIES}")

  @functools.cached_property
  def size_of(self) -> Mapping[str, int]:
    """Factor name -> size (made once per rule: read it, never write it)."""
    return dict(self.sizes)

  @functools.cached_property
  def factors(self) -> tuple[str, ...]:
    """Every factor, in order of first appearance (operands, then results)."""
    seen: dict[str, None] = {}
    for dims in self.operands + self.results:
      for d in dims:
        for f in d:
          seen.setdefault(f, None)
    return tuple(seen)

  def __str__(self) -> str:
    def tensor(dims: Dims) -> str:
      return "".join(d[0] if len(d) == 1 else "(" + "".join(d) + ")" for d in dims)
    s = ",".join(map(tensor, self.operands)) + "->" + ",".join(map(tensor, self.results))
    for label, fs in (("sum", self.reduction), ("reduce", self.other_reduction),
                      ("blocked", self.blocked)):
      if fs:
        s += f" {label}={{{''.join(sorted(fs))}}}"
    if self.linear != "none":
      s += f" linear={self.linear}"
    return s


def _parse_tensor(text: str) -> list[tuple[str, ...]]:
  dims, i = [], 0
  while i < len(text):
    c = text[i]
    if c == "(":
      j = text.index(")", i)
      dims.append(tuple(text[i + 1:j]))
      i = j + 1
    elif c == " ":
      i += 1
    else:
      dims.append((c,))
      i += 1
  return dims


def factor_rule(spec: str, in_shapes: Sequence[Sequence[int]],
                out_shapes: Sequence[Sequence[int]], *,
                sizes: Mapping[str, int] | None = None, reduction: str = "",
                other_reduction: str = "", blocked: str = "",
                linear: str = "none") -> FactorRule:
  """Build a FactorRule from einsum-like text; sizes come from the shapes.

  ``factor_rule("bik,bkj->bij", [(2,8,4), (2,4,16)], [(2,8,16)], reduction="k")``.
  Compound dims are parenthesised, ``"(ab)c->abc"``; give compound factor
  sizes in ``sizes`` (one per compound dim may be left out and is inferred).
  A rank-0 tensor is the empty string (``"ij,->ij"``).
  """
  lhs, rhs = spec.split("->")
  ins = [_parse_tensor(t) for t in lhs.split(",")] if lhs or in_shapes else []
  outs = [_parse_tensor(t) for t in rhs.split(",")] if rhs or out_shapes else []
  if len(ins) != len(in_shapes) or len(outs) != len(out_shapes):
    raise ValueError(f"factor rule {spec!r}: {len(ins)} operands / {len(outs)} "
                     f"results but shapes {in_shapes} -> {out_shapes}")
  size: dict[str, int] = dict(sizes or {})
  pending: list[tuple[tuple[str, ...], int]] = []
  for dims, shape in zip(ins + outs, list(in_shapes) + list(out_shapes)):
    if len(dims) != len(shape):
      raise ValueError(f"factor rule {spec!r}: tensor {dims} does not match shape {shape}")
    for d, n in zip(dims, shape):
      if len(d) == 1:
        f = d[0]
        if f in size and size[f] != n:
          raise ValueError(f"factor rule {spec!r}: factor {f} has sizes {size[f]} and {n}")
        size[f] = int(n)
      else:
        pending.append((d, int(n)))
  for d, n in pending:
    unknown = [f for f in d if f not in size]
    known = math.prod(size[f] for f in d if f in size)
    if len(unknown) == 1:
      size[unknown[0]] = n // known
    elif unknown:
      raise ValueError(f"factor rule {spec!r}: give sizes for compound dim {d}")
  for d, n in pending:
    if math.prod(size[f] for f in d) != n:
      raise ValueError(f"factor rule {spec!r}: compound dim {d} sizes do not "
                       f"multiply to {n}")
  return FactorRule(
      operands=tuple(tuple(d) for d in ins), results=tuple(tuple(d) for d in outs),
      sizes=tuple(sorted(size.items())), reduction=frozenset(reduction),
      other_reduction=frozenset(other_reduction), blocked=frozenset(blocked),
      linear=linear)


def letters(n: int, start: int = 0) -> str:
  """``letters(3) == 'abc'``: factor names for generated rules."""
  alphabet = string.ascii_lowercase + string.ascii_uppercase
  if start + n > len(alphabet):
    raise ValueError(f"rank too large for factor names: {start + n}")
  return alphabet[start:start + n]


def _name(i: int) -> str:
  """The ``i``-th fresh factor name: a letter, then (past 52: a concatenate
  of 60 pieces has 120 factors) a letter and a number."""
  alphabet = string.ascii_lowercase + string.ascii_uppercase
  return alphabet[i] if i < len(alphabet) else f"{alphabet[i % len(alphabet)]}{i // len(alphabet)}"


class Factors:
  """Fresh factor names with their sizes and roles: the way to build a rule by hand.

  Names are handed out in order (``a``, ``b``, ...). ``rule`` assembles the
  :class:`FactorRule` from per-tensor, per-dim factor tuples.

  Example: ``reduce_sum(f32[8,16], axes=(1,))`` is::

    >>> f = Factors()
    >>> a, b = f(8), f(16, reduction=True)
    >>> str(f.rule([[(a,), (b,)]], [[(a,)]], linear="unary"))
    'ab->a sum={b} linear=unary'
  """

  def __init__(self):
    self.sizes: dict[str, int] = {}
    self.blocked: list[str] = []
    self.reduction: list[str] = []

  def __call__(self, size: int, *, blocked: bool = False, reduction: bool = False) -> str:
    """A new factor of ``size``; ``blocked`` never split, ``reduction`` summed over."""
    f = _name(len(self.sizes))
    self.sizes[f] = int(size)
    if blocked:
      self.blocked.append(f)
    if reduction:
      self.reduction.append(f)
    return f

  def rule(self, operands: Sequence[Sequence[Sequence[str]]],
           results: Sequence[Sequence[Sequence[str]]], *, linear: str = "none",
           other_reduction: Sequence[str] = ()) -> FactorRule:
    """The rule over ``operands`` and ``results`` (per tensor, per dim, factors)."""
    return FactorRule(
        operands=tuple(tuple(tuple(d) for d in t) for t in operands),
        results=tuple(tuple(tuple(d) for d in t) for t in results),
        sizes=tuple(sorted(self.sizes.items())), reduction=frozenset(self.reduction),
        other_reduction=frozenset(other_reduction), blocked=frozenset(self.blocked),
        linear=linear)


# -- rules over several tensors: operands, results and inner jaxprs ----------

# A reference to a tensor of an equation:
#   ("in", None, i)    operand i          ("out", None, i)   result i
#   ("sub_in", path, i) invar i of the inner jaxpr at param ``path``
#   ("sub_out", path, i) outvar i of that jaxpr. ``path`` is a tuple: ("jaxpr",)
#   or ("branches", 1).
Ref = tuple[str, Any, int]


def IN(i: int) -> Ref:
  """Operand ``i`` of the equation."""
  return ("in", None, i)


def OUT(i: int) -> Ref:
  """Result ``i`` of the equation."""
  return ("out", None, i)


def SUB_IN(path: tuple, i: int) -> Ref:
  """Invar ``i`` of the inner jaxpr at param ``path`` (e.g. ``('branches', 1)``)."""
  return ("sub_in", path, i)


def SUB_OUT(path: tuple, i: int) -> Ref:
  """Outvar ``i`` of the inner jaxpr at param ``path``."""
  return ("sub_out", path, i)


@dataclasses.dataclass(frozen=True)
class Constraint:
  """A FactorRule over any tensors of an equation (outer or inner)."""

  rule: FactorRule
  operands: tuple[Ref, ...]
  results: tuple[Ref, ...]


@dataclasses.dataclass(frozen=True)
class Pin:
  """A tensor whose sharding the user fixed (an annotation's result).

  Dims in ``open_dims`` stay free for propagation.
  """

  ref: Ref
  sharding: TensorSharding
  open_dims: frozenset[int] = frozenset()
  what: str = "annotation"           # how errors name it, before its source line
  mesh: tuple[tuple[str, int], ...] | None = None   # the mesh it names, if any
  soft: bool = False                 # a preference: skipped where a pin already fixed it


@dataclasses.dataclass(frozen=True)
class OpRule:
  """Several constraints over an equation's tensors (inner jaxprs' too), and pins.

  ``walk_inner=False`` keeps propagation out of the equation's inner jaxprs
  (a ``shard_map`` body works on per-device blocks, not global values).
  """

  constraints: tuple[Constraint, ...]
  pins: tuple[Pin, ...] = ()
  walk_inner: bool = True


RuleResult = Union[FactorRule, OpRule]
ShardingRule = Callable[..., RuleResult]


def as_op_rule(result: RuleResult, num_in: int, num_out: int) -> OpRule:
  """A rule's result as an OpRule: a FactorRule is one constraint over all operands and results."""
  if isinstance(result, OpRule):
    return result
  return OpRule((Constraint(result, tuple(IN(i) for i in range(num_in)),
                            tuple(OUT(i) for i in range(num_out))),))


def shapes(avals) -> list[tuple[int, ...]]:
  """The shapes of avals (``()`` for those without one)."""
  return [tuple(getattr(a, "shape", ())) for a in avals]
