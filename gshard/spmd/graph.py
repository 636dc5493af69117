"""The graph propagation works on: a tensor per variable, a bound constraint per rule.

``Graph(jaxpr, mesh_sizes)`` walks a jaxpr and every nested jaxpr. It makes a
:class:`Tensor` for each variable, keyed by ``(scope, var)`` (a scope is the
path of ``(eqn index, param path)`` from the top), each starting replicated;
and a :class:`Bound` for each constraint of each equation's sharding rule (from
the registry), in program order. Constraints that read an inner jaxpr's
outvars come after that jaxpr's own equations, so the list order is a valid
program order. Pins (annotations, ``in_specs``) fix tensors' shardings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from gshard.spmd import factors, linearity, registry
from gshard.spmd.rules import Constraint, FactorRule, Ref, as_op_rule
from gshard.spmd.sharding import TensorSharding, mesh_str
from gshard.spmd.source import source_of

Scope = tuple          # path of (eqn index, param path) from the top jaxpr


@dataclasses.dataclass(eq=False)
class Tensor:
  """A variable of the program (in some scope) and its current sharding."""

  scope: Scope
  var: Any
  shape: tuple[int, ...]
  dtype: Any
  sharding: TensorSharding
  fixed: frozenset[int] = frozenset()   # dims pinned by the user
  pinned_by: str | None = None          # what pinned it: an annotation's source

  @property
  def nbytes(self) -> int:
    """Global bytes of the value."""
    return factors.nbytes(self)

  def describe(self) -> str:
    """``var:f32[8@data,16]``: the variable with its sharding."""
    return f"{self.var}:{self.sharding.format(self.shape, self.dtype)}"


@dataclasses.dataclass(eq=False)
class Bound:
  """A constraint bound to the tensors of one equation."""

  rule: FactorRule
  operands: list[Tensor | None]
  results: list[Tensor | None]
  eqn: Any
  scope: Scope
  marks: tuple = ()   # (position, linearity.ZERO) of literal operands the rule reads


# -- building the graph ------------------------------------------------------

# ops that keep a zero a zero, and calls whose jaxpr's invars are their operands
_KEEP_ZERO = frozenset({"broadcast_in_dim", "convert_element_type", "reshape", "squeeze",
                        "expand_dims", "transpose", "copy"})
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint",
                    "custom_jvp_call", "custom_vjp_call"})


def sub_jaxprs(params: Mapping[str, Any]) -> list[tuple[tuple, Any]]:
  """(param path, open Jaxpr) for every jaxpr in an equation's params."""
  out = []
  for k, v in params.items():
    for path, j in _jaxprs_in(v, (k,)):
      out.append((path, j))
  return out


def _jaxprs_in(v, path):
  if isinstance(v, ClosedJaxpr):
    yield path, v.jaxpr
  elif isinstance(v, Jaxpr):
    yield path, v
  elif isinstance(v, (tuple, list)):
    for i, x in enumerate(v):
      if isinstance(x, (ClosedJaxpr, Jaxpr)):
        yield from _jaxprs_in(x, path + (i,))


def _lazy_source(eqn, outer):
  """``source_of(eqn)``, else the enclosing equation's (``outer()``), found on
  first call: a user frame is looked up only for what is reported."""
  found = []

  def src() -> str:
    if not found:
      found.append(source_of(eqn) or outer())
    return found[0]
  return src


class Graph:
  """Every tensor of a jaxpr (nested ones included) and every bound constraint."""

  def __init__(self, jaxpr, mesh_sizes: Mapping[str, int]):
    self.mesh_sizes = dict(mesh_sizes)
    self.tensors: dict[tuple[Scope, Any], Tensor] = {}
    self.bounds: list[Bound] = []
    self.unsupported: list[tuple[str, str]] = []
    # per pending lookup result, the bytes its sum costs downstream (propagation
    # fills it: partials.settle)
    self.released: dict[Tensor, float] = {}
    # values that are all zeros (a broadcast of a literal 0: jnp.zeros, the
    # zeros jax's transposes make): a sum or a select reads them as a ZERO
    self.zeros: set[Tensor] = set()
    # scans' stacked results laid out as the loop reading them needs
    # (spmd/stacked.py): their ys are stacked in that layout
    self.restacked: set[Tensor] = set()
    # (state output, the input it is the next value of): the input's layout is
    # the output's hint, settling a tie propagation left open (infer.hint_state,
    # propagate.apply_hints)
    self.hints: list[tuple[Tensor, Tensor]] = []
    self.top = jaxpr
    self._walk(jaxpr, ())

  def tensor(self, scope: Scope, var) -> Tensor | None:
    """The tensor of ``var`` in ``scope`` (made on first use); None for a literal or a dropped result."""
    if isinstance(var, Literal) or type(var).__name__ == "DropVar":
      return None
    key = (scope, var)
    t = self.tensors.get(key)
    if t is None:
      aval = var.aval
      shape = tuple(getattr(aval, "shape", ()))
      t = Tensor(scope, var, shape, getattr(aval, "dtype", None),
                 TensorSharding.replicated(len(shape)))
      self.tensors[key] = t
    return t

  def _walk(self, jaxpr, scope: Scope, outer_source=lambda: "", zero_in=()) -> None:
    # Equations jax's own code emits (inside jnp's nested jits) have no user
    # frame: they are reported at the user's call of the enclosing equation.
    for v in list(jaxpr.constvars) + list(jaxpr.invars):
      self.tensor(scope, v)
    if zero_in and len(jaxpr.invars) > max(zero_in):
      self.zeros.update(self.tensor(scope, jaxpr.invars[k]) for k in zero_in)
    for idx, eqn in enumerate(jaxpr.eqns):
      subs = {path: j for path, j in sub_jaxprs(eqn.params)}
      rule_fn = registry.sharding_rule(eqn.primitive.name)
      src = _lazy_source(eqn, outer_source)     # read only for reports and pins
      for v in eqn.outvars:
        self.tensor(scope, v)
      if eqn.primitive.name in _KEEP_ZERO and eqn.invars and \
          self.mark_of(scope, eqn.invars[0]) is linearity.ZERO:
        self.zeros.add(self.tensor(scope, eqn.outvars[0]))
      # a call's inner invar bound to a zero is one (jnp.where(m, x, 0.0): the
      # 0.0 enters the jit of _where, which broadcasts it)
      inner_zero = [k for k, v in enumerate(eqn.invars)
                    if self.mark_of(scope, v) is linearity.ZERO] \
          if eqn.primitive.name in _CALLS and len(subs) == 1 else []
      if rule_fn is None:
        self.unsupported.append((eqn.primitive.name, src()))
        for path, j in subs.items():
          self._walk(j, scope + ((idx, path),), src, inner_zero)
        continue
      in_avals = [v.aval for v in eqn.invars]
      out_avals = [v.aval for v in eqn.outvars]
      try:
        op_rule = as_op_rule(registry.rule_of(eqn), len(in_avals), len(out_avals))
      except NotImplementedError:   # a case the rule does not cover: no constraint
        self.unsupported.append((eqn.primitive.name, src()))
        for path, j in subs.items():
          self._walk(j, scope + ((idx, path),), src, inner_zero)
        continue

      def resolve(ref: Ref):
        kind, path, i = ref
        if kind == "in":
          return self.tensor(scope, eqn.invars[i])
        if kind == "out":
          return self.tensor(scope, eqn.outvars[i])
        inner = subs[path]
        var = inner.invars[i] if kind == "sub_in" else inner.outvars[i]
        return self.tensor(scope + ((idx, path),), var)

      def mark(ref: Ref):
        kind, path, i = ref
        if kind == "in":
          return self.mark_of(scope, eqn.invars[i])
        if kind == "sub_out":       # a branch's result (zeros: lax.cond(p, f, zeros))
          return self.mark_of(scope + ((idx, path),), subs[path].outvars[i])
        return None

      def bind(c: Constraint) -> Bound:
        marks = () if c.rule.linear not in linearity.READS_LITERALS else tuple(
            (k, m) for k, ref in enumerate(c.operands) if (m := mark(ref)) is not None)
        return Bound(c.rule, [resolve(r) for r in c.operands],
                     [resolve(r) for r in c.results], eqn, scope, marks)

      def reads_inner_out(c: Constraint) -> bool:
        return any(r[0] == "sub_out" for r in c.operands + c.results)

      self.bounds += [bind(c) for c in op_rule.constraints if not reads_inner_out(c)]
      for path, j in (subs.items() if op_rule.walk_inner else ()):
        self._walk(j, scope + ((idx, path),), src, inner_zero)
      self.bounds += [bind(c) for c in op_rule.constraints if reads_inner_out(c)]
      for pin in op_rule.pins:
        t = resolve(pin.ref)
        what = f"{pin.what} at {src()}"
        if pin.mesh is not None:
          self.check_mesh(dict(pin.mesh), what)
        if t is not None and not (pin.soft and t.fixed):   # a DropVar needs no sharding
          self.pin(t, pin.sharding, pin.open_dims, what)

  def mark_of(self, scope: Scope, var):
    """ZERO for a literal zero or an all-zeros value (:attr:`zeros`); None for
    anything else."""
    if isinstance(var, Literal):
      return linearity.literal_mark(var.val)
    return linearity.ZERO if self.tensor(scope, var) in self.zeros else None

  def check_mesh(self, mesh: Mapping[str, int], what: str) -> None:
    """A construct naming its own mesh (``with_sharding_constraint``, ``shard_map``)
    must name the one being partitioned over."""
    if list(dict(mesh).items()) != list(self.mesh_sizes.items()):   # in order too
      raise ValueError(
          f"{what}: it names the mesh {mesh_str(mesh)} but gshard partitions over the "
          f"mesh {mesh_str(self.mesh_sizes)}. Build it with the mesh given to "
          "gshard.partition (same axis names, order and sizes), or use gshard.shard.")

  def pin(self, t: Tensor, sharding: TensorSharding, open_dims: frozenset[int],
          what: str) -> None:
    """Fix ``t``'s sharding (an annotation, ``in_specs``): dims not in ``open_dims`` never change.

    ``what`` names the pin in errors (``in_specs[0]['w']``, ``annotation at model.py:12``)."""
    for a in sorted(sharding.axes):
      if a not in self.mesh_sizes:
        raise ValueError(
            f"{what}: the value is {sharding.format(t.shape, t.dtype)}; mesh "
            f"axis {a!r} is not in the mesh {mesh_str(self.mesh_sizes)}. Use one of "
            f"{list(self.mesh_sizes)}.")
    t.sharding = sharding.without_partial()
    t.fixed = frozenset(range(len(t.shape))) - frozenset(open_dims)
    t.pinned_by = what
