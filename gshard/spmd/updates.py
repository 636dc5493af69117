"""State updates made in their state's layout, after propagation.

A train step returns each parameter in the layout it takes it in (state
pairing, ``infer.pair_state``). Propagation settles each value from the
constraints that reach it first: a weight gradient takes the layout its dot's
operands lead to, which may not be its weight's (a tuple of axes in the other
order, another dim), and the update ``w - lr * g`` then moves it. On a 2x4
mesh with ``w1 [64, 128@(b,a)]`` and ``x [32@b, 64]`` (an MLP's SGD step)::

    dW1 = dot(x, dh)      [128@a, 64]+b     psum[b]                  24 KiB
    w1 - lr * dW1         [128@b*a, 64]     moved at the update      16 KiB

Here the chain of values an update is made of, back through ops that pass a
layout through unchanged (elementwise ops, transposes, converts), is laid out
as the state instead, so its first op makes it there: above, ``dh`` moves to
the split the gradient needs first (an all-to-all and a permute, 3.5 KiB)
and no sum is left (the step: 62 KiB -> 30 KiB). Only where the factor
solver prices that cheaper, by exact reshard plans at the ops that make the
chain's values, than making them as propagated and moving them after; only
values nothing outside the chain reads; and no chain holding a value another
update's chain holds, or another output (a momentum and its weight share the
gradient: ``gather_early`` gathers it once for both). A pending sum stays
pending, but over an axis the state's layout splits.
"""

from __future__ import annotations

from gshard.spmd import factors, reshard
from gshard.spmd.graph import Graph, Tensor
from gshard.spmd.sharding import TensorSharding


def lay_out_updates(graph: Graph, touching: dict[int, list[int]]) -> None:
  """Lay out the values each state update of ``graph`` is made of as its state
  (``touching``: id of a tensor -> indices of the bounds naming it)."""
  outputs = {id(t) for t in map(lambda v: graph.tensor((), v), graph.top.outvars) if t}
  chains = []
  for out, inp in graph.hints:
    src = out if len(out.fixed) == len(out.shape) else inp
    if len(src.fixed) == len(src.shape):    # else a state propagation lays out
      chains.append((out, _chain(graph, touching, out, src.sharding.without_partial())))
  seen: dict[int, int] = {}
  for _, chain in chains:
    for k in chain:
      seen[k] = seen.get(k, 0) + 1
  for out, chain in chains:
    # whole chains only: values two updates share (a momentum's and its
    # weight's gradient: gather_early gathers it once), another output, a
    # value something else reads (a global norm of the gradients), one no
    # op of the program makes (an input), or one the state's layout splits
    # into more shards than it has elements (a pinned state may be) leave
    # it as propagated
    if (any(seen[k] > 1 or (k in outputs and k != id(out)) for k in chain)
        or not all(want.fits(t.shape, graph.mesh_sizes) for t, want in chain.values())
        or not all(_own(graph, touching, t, chain) for t, _ in chain.values())
        or not _cheaper(graph, touching, chain)):
      continue
    for t, want in chain.values():
      t.sharding = want.with_partial(t.sharding.partial - set(want.axes))


def _own(graph: Graph, touching, t: Tensor, chain: dict) -> bool:
  """Whether ``t`` is made by an op of the program and read only by ops that
  make values of ``chain``."""
  made = read = False
  for k in touching.get(id(t), ()):
    b = graph.bounds[k]
    made |= any(r is t for r in b.results)
    if any(x is t for x in b.operands):
      read = True
      if not any(id(r) in chain for r in b.results):
        return False
  return made or not read


def passes(rule, k: int) -> bool:
  """Whether operand ``k`` of ``rule`` holds exactly its result's factors, one
  per dim: its layout follows the result's."""
  if len(rule.results) != 1 or rule.reduction or rule.blocked:
    return False
  op, res = rule.operands[k], rule.results[0]
  return (all(len(d) == 1 for d in op + res)
          and sorted(f for d in op for f in d) == sorted(f for d in res for f in d))


def _passes_through(b) -> bool:
  """Whether ``b``'s op only passes its operands' layout on (a scalar or a
  literal beside them): it makes no value of a chain, the chain runs through it."""
  return b.scope == () and all(o is None or not b.rule.operands[n] or passes(b.rule, n)
                               for n, o in enumerate(b.operands))


def _chain(graph: Graph, touching, out: Tensor, want: TensorSharding) -> dict:
  """id -> (tensor, layout) of ``out`` and the values it is made of through ops
  that pass a layout through, each in the layout that gives ``out`` ``want``."""
  mesh = graph.mesh_sizes
  chain, stack = {id(out): (out, want)}, [out]
  while stack:
    t = stack.pop()
    layout = chain[id(t)][1]
    for k in touching.get(id(t), ()):
      b = graph.bounds[k]
      if b.scope != () or not any(r is t for r in b.results):
        continue
      choice = factors.project(b.rule.results[0], layout.dims, b.rule.size_of, mesh)
      for n, u in enumerate(b.operands):
        if (u is not None and not u.fixed and id(u) not in chain and u.scope == ()
            and passes(b.rule, n)):
          dims = factors.unproject(b.rule.operands[n], choice, b.rule.size_of, mesh)
          chain[id(u)] = (u, TensorSharding(tuple(dims)))
          stack.append(u)
  return chain


def _cheaper(graph: Graph, touching, chain: dict) -> bool:
  """Whether the ops making ``chain``'s values (other than those passing a
  layout through) send fewer bytes making them as wanted than making them as
  propagated and moving them after."""
  mesh = graph.mesh_sizes
  old = new = 0.0
  for t, want in chain.values():
    for k in touching.get(id(t), ()):
      b = graph.bounds[k]
      if not any(r is t for r in b.results) or _passes_through(b):
        continue
      cur = t.sharding.without_partial()
      move = 0.0 if cur == want else reshard.plan_reshard(
          cur, want, tuple(t.shape), t.dtype, mesh).bytes_per_device
      old += factors.making_bytes(b.rule, b.operands, b.results, t, cur, mesh) + move
      new += factors.making_bytes(b.rule, b.operands, b.results, t, want, mesh)
  return new < old
