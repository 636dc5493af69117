"""Values laid out for the op that reads them, after propagation.

Propagation settles a value from the constraints that reach it first. An
elementwise op whose operands disagree takes the layout that moves the fewest
bytes at that op alone, and its reader may then move the result. On a 2x4
mesh, an MLP's ``relu`` gradient with ``w1 [64, 128@(b,a)]`` and
``w2 [128@(a,b), 64]``::

    dh    = dy @ w2.T            [32, 128@a*b]
    mask  = h > 0                [32, 128@b*a]   (the forward's layout)
    g     = select(mask, dh, 0)  [32, 128@a*b]   mask moved       512 B
    dW1   = x.T @ g              [64, 128@b*a]   g moved         2048 B

Here each operand a reader moves is tried in the layout that reader wants,
with the values it is made of through ops that pass a layout through
(elementwise ops, converts, transposes) and that nothing else reads: above,
``g``, ``mask`` and ``dh`` in ``b*a``, so ``dh`` moves once (2048 B) and
nothing else does. Kept only where the factor solver prices every op that
makes or reads those values, by exact reshard plans, strictly cheaper; only
moves that keep each value's shard count (never a gather: a value made
replicated costs every device its compute); never a pinned value, a
program input or output, or a pending sum.
"""

from __future__ import annotations

import math

from gshard.spmd import factors, linearity
from gshard.spmd.partials import LOOKUPS
from gshard.spmd.partition import plan
from gshard.spmd.graph import Graph, Tensor
from gshard.spmd.sharding import TensorSharding, is_refinement
from gshard.spmd.updates import _passes


def lay_out_for_readers(graph: Graph, touching: dict[int, list[int]]) -> None:
  """Give each operand its reader moves (and the values it is made of) the
  reader's layout where that sends fewer bytes (``touching``: id of a tensor
  -> indices of the bounds naming it). Readers are visited last first, so a
  chain laid out for a later reader is read as such by an earlier one."""
  mesh = graph.mesh_sizes
  ends = {id(t) for v in list(graph.top.invars) + list(graph.top.outvars)
          if (t := graph.tensor((), v)) is not None}
  for k in range(len(graph.bounds) - 1, -1, -1):
    c = graph.bounds[k]
    if c.scope != () or not any(_free(u, ends) for u in c.operands) or _agrees(c):
      continue
    for u, want in _moved(graph, c):
      if not _free(u, ends) or _shards(want, mesh) < _shards(u.sharding, mesh):
        continue
      chain = _chain(graph, touching, u, want, ends)
      if _cheaper(graph, touching, chain):
        for t, layout in chain.values():
          t.sharding = layout


def _shards(s: TensorSharding, mesh) -> int:
  return math.prod(mesh[a] for d in s.dims for a in d)


def _free(t: Tensor | None, ends) -> bool:
  """Whether ``t`` may be laid out anew: made in the top program, unpinned, no
  program input or output, no sum pending."""
  return (t is not None and t.scope == () and not t.fixed and id(t) not in ends
          and not t.sharding.partial)


def _agrees(c) -> bool:
  """Whether ``c`` is an elementwise op on operands laid out as its result
  (it moves nothing: no plan needed)."""
  r = c.results[0] if len(c.results) == 1 else None
  return r is not None and all(
      u is None or (dims == c.rule.results[0] and u.sharding.dims == r.sharding.dims)
      for u, dims in zip(c.operands, c.rule.operands))


def _moved(graph: Graph, c) -> list[tuple[Tensor, TensorSharding]]:
  """The operands the partitioner's plan for ``c`` moves (not a free slice),
  each with the layout the plan reads it in."""
  planned = _plan(graph, c, {})
  if planned is None:
    return []
  out = []
  for u, s in zip(c.operands, planned[0].operands):
    if u is None or s is None:
      continue
    want, cur = s.without_partial(), u.sharding.without_partial()
    if want != cur and not is_refinement(cur, want) and all(o is not u for o, _ in out):
      out.append((u, want))
  return out


def _chain(graph: Graph, touching, u: Tensor, want: TensorSharding, ends) -> dict:
  """id -> (tensor, layout): ``u`` in ``want`` and the values it is made of
  through ops passing a layout through, read by nothing but those ops."""
  mesh = graph.mesh_sizes
  chain, stack = {id(u): (u, want)}, [u]
  while stack:
    t = stack.pop()
    layout = chain[id(t)][1]
    for k in touching.get(id(t), ()):
      b = graph.bounds[k]
      if b.scope != () or not any(r is t for r in b.results):
        continue
      choice = factors.project(b.rule.results[0], layout.dims, b.rule.size_of, mesh)
      for n, v in enumerate(b.operands):
        if (_free(v, ends) and id(v) not in chain and _passes(b.rule, n)
            and all(j == k for j in touching.get(id(v), ()) if any(
                o is v for o in graph.bounds[j].operands))):
          dims = factors.unproject(b.rule.operands[n], choice, b.rule.size_of, mesh)
          chain[id(v)] = (v, TensorSharding(tuple(dims)))
          stack.append(v)
  return chain


def _cheaper(graph: Graph, touching, chain: dict) -> bool:
  """Whether every op making or reading ``chain``'s values sends strictly fewer
  bytes, as the partitioner plans them, with those values laid out as
  ``chain`` says than as propagated (False where an op is not planned from
  its one factor rule)."""
  ops = [graph.bounds[k] for k in sorted({k for t, _ in chain.values()
                                          for k in touching.get(id(t), ())})]
  new = {id(t): layout for t, layout in chain.values()}
  old = [_plan(graph, b, {}) for b in ops]
  if any(p is None for p in old):
    return False
  after = [_plan(graph, b, new) for b in ops]
  return sum(plan._plan_cost(graph.mesh_sizes, p[1], p[2], p[0]) for p in after) < sum(
      plan._plan_cost(graph.mesh_sizes, p[1], p[2], p[0]) for p in old)


def _plan(graph: Graph, b, layouts: dict):
  """The partitioner's local plan for ``b``'s op, with the tensors of
  ``layouts`` in theirs (as ``plan.plan_local`` builds it: memoised, so the
  partitioner reuses it), and what it reads (operands as they arrive, results'
  targets); None for an op not planned from its one factor rule (a call, an
  op of several constraints)."""
  eqn = b.eqn
  try:
    rule = plan.factor_rule_of(eqn)
  except TypeError:
    return None
  if rule != b.rule:
    return None

  def layout(t):
    return layouts.get(id(t), t.sharding)

  def seen(t):
    if t is None or id(t) not in layouts:
      return factors.view(t)
    return factors._View(layouts[id(t)], t.fixed, tuple(t.shape), t.dtype)
  marks = rule.linear in linearity.READS_LITERALS
  ins = tuple(plan._In(None if t is None else layout(t), tuple(v.aval.shape), v.aval.dtype,
                       graph.mark_of((), v) if marks else None)
              for t, v in zip(b.operands, eqn.invars))
  lookup = eqn.primitive.name in LOOKUPS
  outs = tuple(plan._Out(None if t is None else layout(t), tuple(v.aval.shape), v.aval.dtype,
                         graph.released.get(t, 0.0) if lookup and t is not None else 0.0)
               for t, v in zip(b.results, eqn.outvars))
  key = (rule, ins, tuple(map(seen, b.operands)), tuple(map(seen, b.results)), outs,
         frozenset(), False, eqn.primitive.name in plan.CONTRACTIONS,
         lookup or eqn.primitive.name in plan.PIECES, tuple(graph.mesh_sizes.items()))
  try:
    return plan._plan_memo(*key), ins, outs
  except TypeError:            # a dtype jax cannot hash
    return plan._plan(*key), ins, outs
