"""The search problem: gshard's propagation graph reduced to choices and costs.

Built from :class:`gshard.spmd.graph.Graph` (every value of the traced program,
nested jaxprs included, and every constraint of every equation's factor rule):

**Values.** Values tied by an elementwise constraint (every non-broadcast
operand and the result name the same factors, one per dim: ``add``, ``mul``,
``exp``, ``transpose``, a call's link to its inner jaxpr, a ``scan`` carry)
must share a layout for the op to need no communication, so they are merged
into one :class:`Value` (a union-find with a dim map per member: a transpose
is the same layout, permuted). A train step's parameter, its gradient, its
optimizer state and its update are one value; so is a chain of elementwise
ops. Each value has candidate layouts (:func:`layouts.layouts`), restricted by
the user's pins (annotations, ``in_specs``) and replicated only when tiny.

**Ops.** Every other constraint (``dot_general``, reductions, broadcasts,
reshapes, gathers, an annotation, a broadcast operand of an elementwise op) is
an :class:`Op` with one choice per strategy of its factor rule
(:func:`layouts.strategies`). Its cost, for a strategy and the layouts of its
values, is what the partitioner sends: each operand resharded to the layout the
strategy needs, each result (a pending sum over the axes of split ``sum``
factors) resharded to its value's layout, a cross-device max/min for a split
``max``/``min`` factor; times the trip count of enclosing ``scan`` loops.

The result is a graph of choice variables (values and ops) with a cost per
choice and a cost matrix per (op, value) pair: :class:`Problem`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from gshard.auto import layouts as L
from gshard.spmd import factors
from gshard.spmd.graph import Bound, Graph, Tensor, sub_jaxprs
from gshard.spmd.rules.control import identity_rule
from gshard.spmd.sharding import TensorSharding, is_refinement

# Ops whose work must be divided over every device (each mesh axis splits a factor).
HEAVY = frozenset({"dot_general", "conv_general_dilated", "ragged_dot"})
# Primitives whose identity constraint is a resharding point, never merged.
RESHARD_POINTS = frozenset({"sharding_annotation", "sharding_constraint"})


@dataclasses.dataclass
class Member:
  """One tensor of a value: ``dmap[i]`` is the value's dim that its dim ``i``
  is (None for a size-1 dim)."""

  tensor: Tensor
  dmap: tuple


@dataclasses.dataclass
class Value:
  """Tensors that share one layout, and the layouts it may take."""

  root: Tensor
  members: list[Member]
  fixed: dict[int, tuple] = dataclasses.field(default_factory=dict)
  pinned_by: str | None = None
  candidates: list[TensorSharding] = dataclasses.field(default_factory=list)

  @property
  def shape(self) -> tuple[int, ...]:
    return self.root.shape

  def layout_of(self, m: Member, layout: TensorSharding) -> TensorSharding:
    """The layout of member ``m`` when the value is laid out as ``layout``."""
    return TensorSharding(tuple(layout.dims[d] if d is not None else () for d in m.dmap))


@dataclasses.dataclass
class Op:
  """A constraint whose layouts are chosen by a strategy (mesh axes per factor)."""

  bound: object
  strategies: list[dict]
  repeat: int


@dataclasses.dataclass
class Var:
  """A choice variable: a value's layout or an op's strategy."""

  kind: str                       # "value" or "op"
  item: Value | Op
  cost: np.ndarray                # [n] weighted bytes of each choice on its own

  @property
  def n(self) -> int:
    return len(self.cost)


@dataclasses.dataclass
class Problem:
  """Choice variables, pairwise cost matrices, and where values came from."""

  vars: list[Var]
  edges: dict[tuple[int, int], np.ndarray]     # (op var, value var) -> [n_op, n_value]
  roles: dict[tuple[int, int], tuple]          # (op var, value var) -> the op's tensors there
  value_var: dict[int, int]                    # id(root tensor) -> var index
  graph: Graph
  mesh_sizes: dict[str, int]
  pricer: L.Pricer

  def var_of(self, t: Tensor) -> int | None:
    """The value variable a tensor belongs to (None for a scalar)."""
    return self.value_var.get(id(t))

  def member(self, t: Tensor) -> tuple[Value, Member] | None:
    """The value a tensor is part of, and its membership (None for a scalar)."""
    vi = self.value_var.get(id(t))
    if vi is None:
      return None
    v = self.vars[vi].item
    return v, self._members[id(t)]

  def layout(self, t: Tensor, choice: dict[int, int]) -> TensorSharding:
    """Tensor ``t``'s layout under an assignment of every variable."""
    vi = self.value_var.get(id(t))
    if vi is None:
      return TensorSharding.replicated(len(t.shape))
    v = self.vars[vi].item
    return v.layout_of(self._members[id(t)], v.candidates[choice[vi]])

  def __post_init__(self):
    self._members = {id(m.tensor): m for var in self.vars if var.kind == "value"
                     for m in var.item.members}
    self.incident: dict[int, list[tuple[int, np.ndarray]]] = {}
    for (o, v), mat in self.edges.items():
      self.incident.setdefault(o, []).append((v, mat))

  def best_ops(self, values: dict[int, int]) -> tuple[float, dict[int, int]]:
    """Given every value's layout, each op's cheapest strategy: (total weighted
    cost, op var -> strategy). What the partitioner does, op by op."""
    total, out = 0.0, {}
    for o, var in enumerate(self.vars):
      if var.kind != "op":
        continue
      col = var.cost
      for v, mat in self.incident.get(o, ()):
        col = col + mat[:, values[v]]
      out[o] = int(np.argmin(col))
      total += float(col[out[o]])
    return total, out

  def candidate_index(self, vi: int, m: Member, s: TensorSharding) -> int | None:
    """The index of the value layout that gives member ``m`` the layout ``s``."""
    v = self.vars[vi].item
    dims = [()] * len(v.shape)
    for i, d in enumerate(m.dmap):
      if d is not None:
        dims[d] = tuple(s.dims[i])
      elif s.dims[i]:
        return None
    try:
      return v.candidates.index(TensorSharding(tuple(dims)))
    except (ValueError, TypeError):
      return None


# -- merging values --------------------------------------------------------------

class _Merger:
  """Union-find over tensors with dim maps to their root."""

  def __init__(self):
    self.root: dict[int, Tensor] = {}
    self.dmap: dict[int, tuple] = {}
    self.members: dict[int, list[Tensor]] = {}

  def add(self, t: Tensor) -> None:
    if id(t) not in self.root:
      self.root[id(t)] = t
      self.dmap[id(t)] = tuple(i if n > 1 else None for i, n in enumerate(t.shape))
      self.members[id(t)] = [t]

  def merge(self, pairs) -> bool:
    """Merge by ``pairs`` of (tensor a, tensor b, {dim of b: dim of a}), in order;
    False at the first pair whose dims or pins disagree (the rest stay apart)."""
    for a, b, bdims in pairs:
      ra, rb = self.root[id(a)], self.root[id(b)]
      da, db = self.dmap[id(a)], self.dmap[id(b)]
      rmap = {db[j]: da[i] for j, i in bdims.items()
              if db[j] is not None and da[i] is not None}
      if ra is rb:
        if any(k != v for k, v in rmap.items()):
          return False
        continue
      if [ra.shape[v] for v in rmap.values()] != [rb.shape[k] for k in rmap] \
          or _pins_clash(ra, rb, rmap, self):
        return False
      for m in self.members.pop(id(rb)):
        self.root[id(m)] = ra
        self.dmap[id(m)] = tuple(None if d is None else rmap.get(d) for d in self.dmap[id(m)])
        self.members[id(ra)].append(m)
    return True


def _fixed_of(root: Tensor, merger: _Merger) -> dict[int, tuple]:
  out = {}
  for m in merger.members[id(root)]:
    for i in m.fixed:
      d = merger.dmap[id(m)][i]
      if d is not None:
        out[d] = tuple(m.sharding.dims[i])
  return out


def _pins_clash(ra, rb, rmap, merger) -> bool:
  fa, fb = _fixed_of(ra, merger), _fixed_of(rb, merger)
  return any(d in fa and fa[d] != axes for db, axes in fb.items()
             for d in [rmap.get(db)] if d is not None)


def _elementwise(bound) -> list[tuple[Tensor, dict]] | None:
  """For an elementwise constraint: the full tensors and each one's factor -> dim
  (the first is the reference); None if the constraint is not elementwise."""
  rule = bound.rule
  if rule.reduction or rule.other_reduction or bound.eqn.primitive.name in RESHARD_POINTS:
    return None
  size = rule.size_of
  big = {f for f in rule.factors if size[f] > 1}
  if not big or big & rule.blocked:
    return None
  full = []
  for t, dims in zip(bound.operands + bound.results, rule.operands + rule.results):
    if t is None or not t.shape:
      continue
    if any(len(d) != 1 for d in dims):
      return None
    fs = [d[0] for d in dims]
    nt = [f for f in fs if size[f] > 1]
    if set(nt) == big and len(nt) == len(big):
      full.append((t, {f: i for i, f in enumerate(fs) if size[f] > 1}))
  return full or None


def merge_values(graph: Graph) -> tuple[_Merger, set[int]]:
  """Merge the tensors of elementwise constraints; the ids of the merged bounds."""
  merger = _Merger()
  for t in graph.tensors.values():
    if t.shape:
      merger.add(t)
  merged = set()
  for b in graph.bounds:
    full = _elementwise(b)
    if full is None:
      continue
    (ref, rpos), rest = full[0], full[1:]
    pairs = [(ref, t, {pos[f]: rpos[f] for f in rpos}) for t, pos in rest]
    # merged away only when every tensor is one of the merged ones; a broadcast
    # operand (fewer factors) keeps the constraint as an op over both values
    if merger.merge(pairs) and len(full) == len(
        [t for t in b.operands + b.results if t is not None and t.shape]):
      merged.add(id(b))
  return merger, merged


# -- state -------------------------------------------------------------------------

class _StateLink:
  """What a state link's ``eqn`` says (no equation of the program makes it)."""

  class primitive:      # noqa: N801  (read as ``eqn.primitive.name``)
    name = "state"

  params: dict = {}


def link_state(graph: Graph, jaxpr, pairs: Mapping[int, int]) -> None:
  """Link each output that is the next value of an input (``pairs``: flat
  output -> flat input, ``partition.api.pair_state``) to that input, as the
  partitioned program lays it out (``Partitioned._boundary``: in the input's
  layout, unless an annotation pins the output): the model then prices the
  resharding a state update's layout needs (a scatter into a cache)."""
  for j, i in pairs.items():
    t = graph.tensors.get(((), jaxpr.outvars[j]))
    u = graph.tensors.get(((), jaxpr.invars[i]))
    if t is None or u is None or t is u or t.fixed or not t.shape:
      continue
    graph.bounds.append(Bound(identity_rule(t.shape), [t], [u], _StateLink, ()))


# -- building the problem ------------------------------------------------------------

def scope_repeats(graph: Graph) -> dict[tuple, int]:
  """Scope -> how many times its equations run per call (``scan`` trip counts)."""
  out = {(): 1}

  def walk(jaxpr, scope, n):
    for idx, eqn in enumerate(jaxpr.eqns):
      k = n * int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else n
      for path, j in sub_jaxprs(eqn.params):
        s = scope + ((idx, path),)
        out[s] = k
        walk(j, s, k)

  walk(graph.top, (), 1)
  return out


def build(graph: Graph, mesh_sizes: Mapping[str, int], pricer: L.Pricer,
          min_bytes: int) -> Problem:
  """The reduced problem of a propagation graph (pins already applied)."""
  merger, merged = merge_values(graph)
  values: dict[int, Value] = {}
  for rid, ms in merger.members.items():
    root = merger.root[rid]
    members = [Member(m, merger.dmap[id(m)]) for m in ms]
    pinned = next((m.pinned_by for m in ms if m.fixed and m.pinned_by), None)
    v = Value(root, members, _fixed_of(root, merger), pinned)
    nbytes = max(factors.nbytes(m.tensor) for m in members)
    v.candidates = L.layouts(root.shape, mesh_sizes, v.fixed,
                             splittable=nbytes >= min_bytes)
    values[rid] = v
  vars_: list[Var] = []
  value_var: dict[int, int] = {}
  for rid, v in values.items():
    idx = len(vars_)
    vars_.append(Var("value", v, np.zeros(len(v.candidates))))
    for m in v.members:
      value_var[id(m.tensor)] = idx
  repeats = scope_repeats(graph)
  edges: dict[tuple[int, int], np.ndarray] = {}
  roles: dict[tuple[int, int], tuple] = {}
  for b in graph.bounds:
    if id(b) in merged:
      continue
    _add_op(b, graph, merger, values, vars_, value_var, edges, roles, mesh_sizes, pricer,
            repeats.get(b.scope, 1), min_bytes)
  return Problem(vars_, edges, roles, value_var, graph, dict(mesh_sizes), pricer)


def op_tensors(bound):
  """(tensor, dims, is_result) for every tensor of a constraint (literals and
  dropped results left out)."""
  out = []
  for t, dims in zip(bound.operands, bound.rule.operands):
    if t is not None:
      out.append((t, dims, False))
  for t, dims in zip(bound.results, bound.rule.results):
    if t is not None:
      out.append((t, dims, True))
  return out


def targets(bound, choice: dict, mesh_sizes) -> list[TensorSharding]:
  """The layout each tensor of ``bound`` has under a strategy (results pending
  over the axes of split ``sum`` factors)."""
  rule = bound.rule
  size = rule.size_of
  partial = frozenset(a for f in rule.reduction for a in choice.get(f, ()))
  out = []
  for t, dims, is_result in op_tensors(bound):
    s = TensorSharding(tuple(factors.unproject(dims, choice, size, mesh_sizes)))
    out.append(s.with_partial(partial) if is_result else s)
  return out


def tensor_cost(pricer: L.Pricer, t: Tensor, is_result: bool, target: TensorSharding,
                have: TensorSharding, raw: bool = False) -> float:
  """What the partitioner sends for one tensor of an op: an operand resharded from
  its value's layout ``have`` to ``target``, a result from ``target`` to ``have``
  (weighted, or bytes sent with ``raw``)."""
  price = pricer.bytes if raw else pricer.cost
  if is_result:
    if not target.partial and is_refinement(target, have):
      return 0.0
    return price(target, have, t.shape, t.dtype)
  if is_refinement(have, target):
    return 0.0
  return price(have, target, t.shape, t.dtype)


def own_cost(pricer: L.Pricer, bound, choice: dict, tgts, raw: bool = False) -> float:
  """A split max/min/argmax factor: a cross-device reduction of each result."""
  rule = bound.rule
  axes = tuple(a for f in rule.other_reduction for a in choice.get(f, ()))
  if not axes:
    return 0.0
  total = 0.0
  for (t, _, is_result), s in zip(op_tensors(bound), tgts):
    if is_result:
      total += pricer.allreduce(t.shape, t.dtype, s.without_partial(), axes, raw=raw)
  return total


def evaluate(prob: Problem, choice: dict[int, int]) -> list[tuple[float, Op, dict]]:
  """Bytes per device each op sends under a full assignment: (bytes, op, strategy)."""
  out = []
  for vi, var in enumerate(prob.vars):
    if var.kind != "op":
      continue
    op = var.item
    strat = op.strategies[choice[vi]]
    tgts = targets(op.bound, strat, prob.mesh_sizes)
    total = own_cost(prob.pricer, op.bound, strat, tgts, raw=True)
    for (t, _, is_result), tg in zip(op_tensors(op.bound), tgts):
      have = prob.layout(t, choice)
      total += tensor_cost(prob.pricer, t, is_result, tg, have, raw=True)
    out.append((total * op.repeat, op, strat))
  return out


def _add_op(b, graph, merger, values, vars_, value_var, edges, roles, mesh_sizes, pricer,
            repeat, min_bytes):
  tensors = op_tensors(b)
  if not tensors:
    return
  heavy = b.eqn.primitive.name in HEAVY and any(
      factors.nbytes(t) >= min_bytes for t, _, _ in tensors if t.shape)
  strategies = L.strategies(b.rule, mesh_sizes, divide_work=heavy)
  all_targets = [targets(b, c, mesh_sizes) for c in strategies]
  own = np.array([own_cost(pricer, b, c, tg) for c, tg in zip(strategies, all_targets)])
  by_var: dict[int, list[tuple[int, Member]]] = {}
  for k, (t, dims, is_result) in enumerate(tensors):
    if not t.shape:
      scalar = TensorSharding(())
      own += np.array([tensor_cost(pricer, t, is_result, tg[k], scalar)
                       for tg in all_targets])
      continue
    vi = value_var[id(t)]
    v = values[id(merger.root[id(t)])]
    member = next(m for m in v.members if m.tensor is t)
    by_var.setdefault(vi, []).append((k, member))
  idx = len(vars_)
  vars_.append(Var("op", Op(b, strategies, repeat), own * repeat))
  for vi, ks in by_var.items():
    v = vars_[vi].item
    mat = np.zeros((len(strategies), len(v.candidates)))
    for k, member in ks:
      t, _, is_result = tensors[k]
      uniq: dict[TensorSharding, int] = {}
      inv = np.array([uniq.setdefault(tg[k], len(uniq)) for tg in all_targets])
      for j, cand in enumerate(v.candidates):
        have = v.layout_of(member, cand)
        col = np.array([tensor_cost(pricer, t, is_result, u, have) for u in uniq])
        mat[:, j] += col[inv]
    edges[(idx, vi)] = edges.get((idx, vi), 0) + mat * repeat
    roles[(idx, vi)] = tuple(k for k, _ in ks)


def nbytes_local(t: Tensor, s: TensorSharding, mesh_sizes) -> int:
  """Bytes one device holds of tensor ``t`` laid out as ``s``."""
  return L.local_bytes(t.shape, t.dtype, s, mesh_sizes) if t.shape else \
      L.itemsize(t.dtype)


