"""The propagation engine: a sharding for every variable of a jaxpr.

It knows no primitive. Each equation's sharding rule (``spmd/rules``) gives
factor constraints over its operands, results and inner-jaxpr variables; the
engine sweeps them forward then backward until nothing changes:

1. project each tensor's sharding onto the constraint's factors;
2. for each factor choose mesh axes among the tensors' candidates: a user's
   annotation first, then the lower resharding cost in bytes, then the more
   specific, then the earlier tensor;
3. give each mesh axis to one factor only (the best supported);
4. project back: a tensor accepts the result only where it refines its
   current sharding (a sharding only becomes more specific) and never in a
   dim the user fixed.

Each accepted update splits one more dim by one more mesh axis, so the sweeps
end. A last pass in program order marks pending partial sums: a split
``sum`` factor, or a partial operand through a linear op.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jax.extend.core import Literal

from gshard.spmd.rules import as_op_rule, sharding_rules
from gshard.spmd.rules._core import Constraint, FactorRule, Ref
from gshard.spmd.sharding import (Axes, TensorSharding, _short_dtype, is_refinement,
                                  mesh_str)

Scope = tuple          # path of (eqn index, param path) from the top jaxpr
MAX_SWEEPS = 200


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
    try:
      itemsize = np.dtype(self.dtype).itemsize
    except TypeError:
      itemsize = 4
    return math.prod(self.shape) * itemsize

  def describe(self) -> str:
    return f"{self.var}:{self.sharding.format(self.shape, self.dtype)}"


@dataclasses.dataclass(eq=False)
class Bound:
  """A constraint bound to the tensors of one equation."""

  rule: FactorRule
  operands: list[Tensor | None]
  results: list[Tensor | None]
  eqn: Any
  scope: Scope


@dataclasses.dataclass(frozen=True)
class Conflict:
  """Tensors of one equation disagreed on how to split a factor."""

  primitive: str
  source: str
  factor: str
  candidates: tuple[tuple[str, Axes], ...]   # (tensor, its axes for the factor)
  chosen: Axes
  reason: str

  def __str__(self) -> str:
    cands = ", ".join(f"{t} wants {_axes_str(a)}" for t, a in self.candidates)
    return (f"{self.primitive} at {self.source}: factor {self.factor}: {cands}; "
            f"chose {_axes_str(self.chosen)} ({self.reason})")


def _axes_str(axes: Axes) -> str:
  return "*".join(axes) if axes else "unsplit"


def source_of(eqn) -> str:
  from jax._src import source_info_util
  return source_info_util.summarize(eqn.source_info)


# -- building the graph ------------------------------------------------------

def sub_jaxprs(params: Mapping[str, Any]) -> list[tuple[tuple, Any]]:
  """(param path, open Jaxpr) for every jaxpr in an equation's params."""
  out = []
  for k, v in params.items():
    for path, j in _jaxprs_in(v, (k,)):
      out.append((path, j))
  return out


def _jaxprs_in(v, path):
  from jax.extend.core import ClosedJaxpr, Jaxpr
  if isinstance(v, ClosedJaxpr):
    yield path, v.jaxpr
  elif isinstance(v, Jaxpr):
    yield path, v
  elif isinstance(v, (tuple, list)):
    for i, x in enumerate(v):
      if isinstance(x, (ClosedJaxpr, Jaxpr)):
        yield from _jaxprs_in(x, path + (i,))


class Graph:
  """Every tensor of a jaxpr (nested ones included) and every bound constraint."""

  def __init__(self, jaxpr, mesh_sizes: Mapping[str, int]):
    self.mesh_sizes = dict(mesh_sizes)
    self.tensors: dict[tuple[Scope, Any], Tensor] = {}
    self.bounds: list[Bound] = []
    self.unsupported: list[tuple[str, str]] = []
    self.top = jaxpr
    self._walk(jaxpr, ())

  def tensor(self, scope: Scope, var) -> Tensor | None:
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

  def _walk(self, jaxpr, scope: Scope, outer_source: str = "") -> None:
    # Equations jax's own code emits (inside jnp's nested jits) have no user
    # frame: they are reported at the user's call of the enclosing equation.
    for v in list(jaxpr.constvars) + list(jaxpr.invars):
      self.tensor(scope, v)
    for idx, eqn in enumerate(jaxpr.eqns):
      subs = {path: j for path, j in sub_jaxprs(eqn.params)}
      rule_fn = sharding_rules.get(eqn.primitive.name)
      src = source_of(eqn) or outer_source
      for v in eqn.outvars:
        self.tensor(scope, v)
      if rule_fn is None:
        self.unsupported.append((eqn.primitive.name, src))
        for path, j in subs.items():
          self._walk(j, scope + ((idx, path),), src)
        continue
      in_avals = [v.aval for v in eqn.invars]
      out_avals = [v.aval for v in eqn.outvars]
      try:
        op_rule = as_op_rule(rule_fn(in_avals, out_avals, **eqn.params),
                             len(in_avals), len(out_avals))
      except NotImplementedError:   # a case the rule does not cover: no constraint
        self.unsupported.append((eqn.primitive.name, src))
        for path, j in subs.items():
          self._walk(j, scope + ((idx, path),), src)
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

      def bind(c: Constraint) -> Bound:
        return Bound(c.rule, [resolve(r) for r in c.operands],
                     [resolve(r) for r in c.results], eqn, scope)

      def reads_inner_out(c: Constraint) -> bool:
        return any(r[0] == "sub_out" for r in c.operands + c.results)

      self.bounds += [bind(c) for c in op_rule.constraints if not reads_inner_out(c)]
      for path, j in subs.items():
        self._walk(j, scope + ((idx, path),), src)
      self.bounds += [bind(c) for c in op_rule.constraints if reads_inner_out(c)]
      for pin in op_rule.pins:
        t = resolve(pin.ref)
        if t is not None:   # a dropped result (DropVar) needs no sharding
          self.pin(t, pin.sharding, pin.open_dims, f"annotation at {src}")

  def pin(self, t: Tensor, sharding: TensorSharding, open_dims: frozenset[int],
          what: str) -> None:
    for a in sorted(sharding.axes):
      if a not in self.mesh_sizes:
        raise ValueError(
            f"{what}: the value is {sharding.format(t.shape, t.dtype)}; mesh "
            f"axis {a!r} is not in the mesh {mesh_str(self.mesh_sizes)}. Use one of "
            f"{list(self.mesh_sizes)}.")
    t.sharding = sharding.without_partial()
    t.fixed = frozenset(range(len(t.shape))) - frozenset(open_dims)
    t.pinned_by = what


# -- one constraint ----------------------------------------------------------

def _project(dims_factors, sharding_dims, size_of, mesh) -> dict[str, Axes]:
  """The axes each factor of a tensor holds under its sharding.

  A dim of factors ``(a, b)`` split over mesh axes ``(x, y)`` gives ``a`` the
  leading axes whose product divides its size; ``b`` gets the rest only when
  ``a`` is split fully.
  """
  out: dict[str, Axes] = {}
  for factors, axes in zip(dims_factors, sharding_dims):
    rest = list(axes)
    if len(factors) == 1:
      if rest:
        out[factors[0]] = tuple(rest)
      continue
    for f in factors:
      take, prod = [], 1
      while rest and size_of[f] % (prod * mesh[rest[0]]) == 0:
        prod *= mesh[rest[0]]
        take.append(rest.pop(0))
      if take:
        out[f] = tuple(take)
      if prod != size_of[f]:
        break
  return out


def _unproject(dims_factors, choice, size_of, mesh) -> list[Axes]:
  """The inverse of :func:`_project`: a tensor's dims from per-factor axes."""
  dims = []
  for factors in dims_factors:
    axes: list[str] = []
    for f in factors:
      a = list(choice.get(f, ()))
      if len(factors) > 1:
        while a and size_of[f] % math.prod(mesh[x] for x in a):
          a.pop()
      axes += a
      if math.prod(mesh[x] for x in a) != size_of[f]:
        break
    dims.append(tuple(axes))
  return dims


@dataclasses.dataclass
class _Holder:
  tensor: Tensor
  proj: Axes
  fixed: bool
  order: int


def _holders(bound: Bound, mesh) -> tuple[dict[str, list[_Holder]], list]:
  rule = bound.rule
  size_of = rule.size_of
  holders: dict[str, list[_Holder]] = {f: [] for f in rule.factors}
  pairs = [(t, d) for t, d in zip(bound.operands + bound.results,
                                   rule.operands + rule.results) if t is not None]
  for order, (t, dims) in enumerate(pairs):
    proj = _project(dims, t.sharding.dims, size_of, mesh)
    for i, factors in enumerate(dims):
      for f in factors:
        holders[f].append(_Holder(t, proj.get(f, ()), i in t.fixed, order))
  return holders, pairs


def _local_nbytes(t: Tensor, mesh) -> int:
  """Bytes one device holds of ``t``: what resharding it roughly sends."""
  return t.nbytes // max(1, math.prod(mesh[a] for d in t.sharding.dims for a in d))


def _reshard_bytes(h: _Holder, axes: Axes, mesh) -> int:
  """Roughly what one device sends to give ``h``'s factor the split ``axes``.

  Splitting further is a local slice (0), of a pinned tensor too (the op
  reads a slice of it). Axes taken away are gathered: the local bytes times
  their size. (An axis moving to another factor of the same tensor, an
  all-to-all, is settled with exact plans in :func:`_solve`.)
  """
  if axes[:len(h.proj)] == h.proj:
    return 0
  removed = math.prod(mesh[a] for a in h.proj if a not in axes)
  return _local_nbytes(h.tensor, mesh) * max(1, removed)


def _candidate_key(axes: Axes, hs: list[_Holder], size: int, mesh) -> tuple:
  fixed_exact = sum(1 for h in hs if h.fixed and h.proj == axes)
  valid = fixed_exact > 0 or math.prod(mesh[a] for a in axes) <= size
  cost = sum(_reshard_bytes(h, axes, mesh) for h in hs)
  first = min((h.order for h in hs if h.proj == axes), default=len(hs))
  return (not valid, -fixed_exact, cost, -len(axes), first)


def _choose(f: str, hs: list[_Holder], rule: FactorRule, mesh) -> Axes | None:
  if f in rule.blocked or rule.size_of[f] == 1:
    return ()
  cands = {h.proj for h in hs if h.proj or h.fixed}
  if not cands:
    return None
  return min(sorted(cands), key=lambda a: _candidate_key(a, hs, rule.size_of[f], mesh))


def _solve(bound: Bound, mesh) -> tuple[dict[str, Axes], dict, list]:
  """Per-factor axes for one constraint, each mesh axis given to one factor."""
  rule = bound.rule
  holders, pairs = _holders(bound, mesh)
  choice: dict[str, Axes] = {}
  strength = {}
  for f in rule.factors:
    c = _choose(f, holders[f], rule, mesh)
    if c is None:
      continue
    choice[f] = c
    hs = holders[f]
    strength[f] = (-sum(1 for h in hs if h.fixed and h.proj == c),
                   -sum(_local_nbytes(h.tensor, mesh) for h in hs if h.proj == c and c),
                   rule.factors.index(f))
  owner: dict[str, str] = {}          # mesh axis -> the factor holding it
  done: dict[str, Axes] = {}
  for f in sorted(choice, key=lambda f: strength[f]):
    keep: list[str] = []
    for a in choice[f]:
      g = owner.get(a)
      if g is not None:
        # Two factors want one axis: keep the assignment that sends less.
        stay = {**done, f: tuple(keep)}
        cut = done[g][:done[g].index(a)]
        take = {**done, g: cut, f: tuple(keep) + (a,)}
        if _assignment_bytes(take, pairs, rule, mesh) < _assignment_bytes(stay, pairs, rule,
                                                                          mesh):
          for b in done[g][len(cut):]:
            owner.pop(b, None)
          done[g] = cut
        else:
          break
      keep.append(a)
      owner[a] = f
    done[f] = tuple(keep)
  return done, holders, pairs


def _assignment_bytes(choice, pairs, rule: FactorRule, mesh) -> float:
  """Bytes per device to bring every tensor to ``choice`` (refinements free)."""
  from gshard.spmd import reshard
  total = 0.0
  for t, dims in pairs:
    new = TensorSharding(tuple(_unproject(dims, choice, rule.size_of, mesh)))
    cur = t.sharding.without_partial()
    if new == cur or (not t.fixed and is_refinement(cur, new)):
      continue
    try:
      total += reshard.plan_reshard(cur, new, t.shape, t.dtype, mesh).bytes_per_device
    except (ValueError, TypeError):
      total += t.nbytes
  return total


def _refine(t: Tensor, new_dims: Sequence[Axes], mesh) -> bool:
  cur = t.sharding.dims
  used = set(t.sharding.axes)
  out = list(cur)
  for i, (c, n) in enumerate(zip(cur, new_dims)):
    if i in t.fixed or len(n) <= len(c) or n[:len(c)] != c:
      continue
    extra = []
    for a in n[len(c):]:
      if a in used:
        break
      extra.append(a)
    while extra and math.prod(mesh[a] for a in c + tuple(extra)) > t.shape[i]:
      extra.pop()
    if extra:
      out[i] = c + tuple(extra)
      used.update(extra)
  if tuple(out) == cur:
    return False
  t.sharding = TensorSharding(tuple(out), t.sharding.partial)
  return True


def _step(bound: Bound, mesh) -> bool:
  choice, _, pairs = _solve(bound, mesh)
  changed = False
  for t, dims in pairs:
    if len(t.fixed) == len(t.shape):
      continue
    changed |= _refine(t, _unproject(dims, choice, bound.rule.size_of, mesh), mesh)
  return changed


# -- partial sums and conflicts, after the fixed point -----------------------

def _reduced_axes(bound: Bound, mesh) -> frozenset[str]:
  """Axes of the split ``sum`` factors (as the operands hold them)."""
  rule = bound.rule
  if not rule.reduction:
    return frozenset()
  holders, _ = _holders(bound, mesh)
  n_ops = sum(1 for t in bound.operands if t is not None)
  partial: set[str] = set()
  for f in rule.reduction:
    hs = [h for h in holders[f] if h.order < n_ops]
    c = _choose(f, hs, rule, mesh) if hs else None
    partial.update(c or ())
  return frozenset(partial)


def _result_partial(bound: Bound, mesh, reduced: frozenset[str] | None = None
                    ) -> frozenset[str]:
  rule = bound.rule
  partial = set(_reduced_axes(bound, mesh) if reduced is None else reduced)
  ops = [t for t in bound.operands if t is not None]
  parts = [t.sharding.partial for t in ops]
  if rule.linear == "unary" and len(ops) == 1:
    partial |= parts[0]
  elif rule.linear == "sum" and parts and all(p == parts[0] for p in _sum_parts(bound)):
    partial |= parts[0]
  elif rule.linear == "product" and sum(1 for p in parts if p) == 1:
    partial |= next(p for p in parts if p)
  elif rule.linear == "first" and bound.operands and bound.operands[0] is not None \
      and not any(parts[1:]):
    partial |= bound.operands[0].sharding.partial
  return frozenset(partial)


def _sum_parts(bound: Bound) -> list[frozenset[str]]:
  """Partial axes of every operand of an add-like op; a literal is unpartial.

  ``x + 1.0`` with ``x`` pending over ``model`` is not a partial sum of the
  result (each device would add the 1.0), so the literal must count.
  """
  return [t.sharding.partial if t is not None else frozenset() for t in bound.operands]


def _accepts(bound: Bound, t: Tensor) -> bool:
  """Whether ``bound`` lets operand ``t``'s pending partial sum through."""
  ops = [o for o in bound.operands if o is not None]
  parts = [o.sharding.partial for o in ops]
  lin = bound.rule.linear
  if lin == "unary":
    return len(ops) == 1
  if lin == "sum":
    return all(p == parts[0] for p in _sum_parts(bound))
  if lin == "product":
    return sum(1 for p in parts if p) == 1
  if lin == "first":
    return bound.operands[0] is t and not any(parts[1:])
  return False


def _psum_cost(t: Tensor, axes, mesh) -> float:
  """Bytes per device of an all-reduce of ``t``'s local block over ``axes``."""
  n = math.prod(mesh[a] for a in axes)
  local = _local_nbytes(t, mesh)
  return 2 * (n - 1) / n * local


def _forward_partials(graph: Graph, resolved: set[int], reduced: list):
  """One pass in program order. Returns the total bytes of the psums it implies;
  per pending value, the bytes of the psums downstream that it feeds; and per
  pending value, its pending ancestors."""
  found: dict[int, frozenset[str]] = {}
  feeds: dict[int, frozenset[int]] = {}      # pending value -> pending ancestors
  downstream: dict[int, float] = {}
  total = 0.0
  mesh = graph.mesh_sizes
  for b, r in zip(graph.bounds, reduced):
    p = _result_partial(b, mesh, r)
    anc = frozenset().union(*[feeds.get(id(o), frozenset()) | {id(o)}
                              for o in b.operands if o is not None and o.sharding.partial])
    for t in b.results:
      if t is None or t.fixed:
        continue
      raw = p - t.sharding.axes
      q = frozenset() if id(t) in resolved else raw
      prev = found.get(id(t))
      q = q if prev is None else (q & prev)
      found[id(t)] = q
      t.sharding = t.sharding.with_partial(q)
      if q:
        feeds[id(t)] = anc
      elif raw:
        cost = _psum_cost(t, raw, mesh)
        total += cost
        for a in anc:
          downstream[a] = downstream.get(a, 0.0) + cost
  return total, downstream, feeds


def _settle(graph: Graph, resolved: set[int], reduced: list, consumers) -> float:
  """Resolve every value some consumer cannot take pending; returns the cost."""
  for _ in range(len(graph.tensors) + 1):
    total, downstream, feeds = _forward_partials(graph, resolved, reduced)
    bad = {id(t) for t in graph.tensors.values() if t.sharding.partial and
           id(t) not in resolved and
           not all(_accepts(b, t) for b in consumers.get(id(t), ()))}
    if not bad:
      return total, downstream, feeds
    resolved |= bad
  raise RuntimeError("partial-sum marking did not converge")


def _mark_partials(graph: Graph, max_trials: int = 48) -> None:
  """Mark pending partial sums, in program order.

  A value stays pending only while every consumer lets it through (linear
  ops); otherwise it is resolved where it is produced, once, however many
  consumers it has. Program outputs are resolved. Then, where a pending value
  fans out into several psums downstream that together cost more than one
  psum of the value itself (a layer norm's backward), it is resolved where it
  is produced instead, if that lowers the total.
  """
  consumers: dict[int, list[Bound]] = {}
  for b in graph.bounds:
    for t in b.operands:
      if t is not None:
        consumers.setdefault(id(t), []).append(b)
  resolved = {id(graph.tensor((), v)) for v in graph.top.outvars
              if graph.tensor((), v) is not None}
  reduced = [_reduced_axes(b, graph.mesh_sizes) for b in graph.bounds]
  total, downstream, feeds = _settle(graph, resolved, reduced, consumers)
  by_id = {id(t): t for t in graph.tensors.values()}
  order = {id(t): k for k, t in enumerate(graph.tensors.values())}   # deterministic
  tried: set[int] = set()
  for _ in range(max_trials):
    gains = sorted((-(downstream[i] - _psum_cost(by_id[i], by_id[i].sharding.partial,
                                                 graph.mesh_sizes)), order[i], i)
                   for i in downstream if i not in tried and by_id[i].sharding.partial)
    gains = [i for g, _, i in gains if g < 0]
    # Only the most upstream candidates: resolving one settles its descendants.
    candidates = set(gains)
    roots = [i for i in gains if not feeds.get(i, frozenset()) & candidates]
    if not roots:
      break
    i = roots[0]
    tried.add(i)
    trial = set(resolved) | {i}
    t_total, t_down, t_feeds = _settle(graph, trial, reduced, consumers)
    if t_total < total:
      resolved, total, downstream, feeds = trial, t_total, t_down, t_feeds
  _settle(graph, resolved, reduced, consumers)


def _conflicts(graph: Graph) -> list[Conflict]:
  out = []
  for b in graph.bounds:
    mesh = graph.mesh_sizes
    holders, _ = _holders(b, mesh)
    for f in b.rule.factors:
      hs = holders[f]
      cands = sorted({h.proj for h in hs if h.proj or h.fixed})
      clash = [(x, y) for x in cands for y in cands
               if x < y and x[:len(y)] != y and y[:len(x)] != x]
      fixed_clash = any(h.fixed and h.proj != c for h in hs for c in cands)
      if not clash and not fixed_clash:
        continue
      if f in b.rule.blocked:
        continue
      size = b.rule.size_of[f]
      keys = sorted((_candidate_key(c, hs, size, mesh), c) for c in cands)
      (k0, best) = keys[0]
      if len(keys) > 1:
        k1 = keys[1][0]
        if k0[1] < k1[1]:
          reason = "user annotation"
        elif k0[2] < k1[2]:
          reason = f"lower resharding cost: {k0[2]} vs {k1[2]} bytes"
        else:
          reason = "tie: the more specific, then the earlier tensor"
      else:
        reason = "user annotation"
      out.append(Conflict(
          b.eqn.primitive.name, source_of(b.eqn), f,
          tuple((_role(b, h.tensor), h.proj) for h in hs), best, reason))
  return out


def _role(bound: Bound, t: Tensor) -> str:
  """``operand 0 f32[8,16]``: a tensor named by its place in the constraint.

  (``str`` of a jax ``Var`` is an opaque id, useless to a reader.)
  """
  inner = "inner " if t.scope != bound.scope else ""
  for kind, ts in (("operand", bound.operands), ("result", bound.results)):
    for i, o in enumerate(ts):
      if o is t:
        return f"{inner}{kind} {i} {_short_dtype(t.dtype)}[{','.join(map(str, t.shape))}]"
  return f"{_short_dtype(t.dtype)}[{','.join(map(str, t.shape))}]"


# -- the driver --------------------------------------------------------------

def propagate(graph: Graph) -> tuple[int, list[Conflict]]:
  """Sweep forward and backward to a fixed point; returns (sweeps, conflicts).

  The first sweep visits every constraint; later sweeps (alternating
  direction) only those touching a tensor that changed since their last visit.
  """
  mesh = graph.mesh_sizes
  touching: dict[int, list[int]] = {}
  for i, b in enumerate(graph.bounds):
    for t in b.operands + b.results:
      if t is not None:
        touching.setdefault(id(t), []).append(i)
  dirty = set(range(len(graph.bounds)))
  sweeps = 0
  while dirty:
    if sweeps >= MAX_SWEEPS:
      raise RuntimeError(f"propagation did not converge in {MAX_SWEEPS} sweeps")
    order = sorted(dirty, reverse=sweeps % 2 == 1)
    dirty = set()
    for i in order:
      b = graph.bounds[i]
      before = [(t, t.sharding) for t in b.operands + b.results if t is not None]
      if _step(b, mesh):
        for t, old in before:
          if t.sharding != old:
            dirty.update(j for j in touching[id(t)] if j != i)
    sweeps += 1
  _mark_partials(graph)
  return sweeps, _conflicts(graph)
