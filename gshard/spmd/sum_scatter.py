"""Sums before a reduce-scatter: several reduce-scatters become one.

A contraction whose result's layout splits a dim over the axes it reduces
over is resolved by a reduce-scatter; where several of them are only added
together (q, k and v's input gradients with a residual stream split on
d_model), they stay pending with that dim unsplit and the sum is
reduce-scattered once. Run after the pending sums are marked
(``spmd/partials.py``).
"""

from __future__ import annotations

from gshard.spmd import factors
from gshard.spmd.graph import Graph, Tensor
from gshard.spmd.partials import Index

# Elementwise ops a sum passes through unchanged: the nodes of a sum tree.
_SUM_NODES = frozenset({"add", "add_any", "sub"})
_CHAIN_NODES = frozenset({"neg", "convert_element_type", "copy"})
# Producers of a partial sum over their split contracted factors: the leaves.
_LEAVES = frozenset({"dot_general", "conv_general_dilated"})


def sum_before_scatter(graph: Graph) -> dict[Tensor, object]:
  """Values to keep as partial sums so that several reduce-scatters become one.

  A contraction whose result's layout splits a dim over the axes it reduces
  over (sequence parallelism's residual stream ``[B,T,D@model]`` after
  ``x @ w`` contracting ``H@model``) is resolved by a reduce-scatter at the
  contraction. When k such results are only added together (the input
  gradient of q, k and v, ``add_any`` chains), adding the partial sums first
  and reduce-scattering the total once sends 1/k of the bytes: the results,
  and the adds between them, stay pending over those axes with the dim
  unsplit (the same bytes per device a contraction holds before its
  reduce-scatter); the last add's result keeps its layout, reached by one
  reduce-scatter. A node qualifies when it is produced once by one of these
  ops, read only by its parent, not pinned and not a program output.

  Returns the new sharding of each value to change (nothing pending before).
  """
  mesh = graph.mesh_sizes
  index = Index(graph)
  outputs = {graph.tensor((), v) for v in graph.top.outvars} - {None}
  producer = {}
  for t, ks in index.producers.items():
    if t in index.regular and len(ks) == 1:
      producer[t] = graph.bounds[ks[0]]

  def prim(b) -> str:
    return b.eqn.primitive.name if b is not None and b.eqn is not None else ""

  def own(b, t) -> bool:
    """``t`` is a direct result of ``b``'s equation (not a call's link)."""
    return b.eqn is not None and any(
        t is graph.tensors.get((b.scope, v)) for v in b.eqn.outvars)

  def tree(t, parent, layout, axes) -> list[Tensor] | None:
    """The nodes under ``t`` that can stay pending over ``axes``, or None."""
    b = producer.get(t)
    if (b is None or t.fixed or t in outputs or t.sharding != layout
        or [c for c in index.consumers.get(t, ()) if c is not parent] or not own(b, t)):
      return None
    name = prim(b)
    if name in _LEAVES:
      return [t] if axes & factors.reduced_axes(b.rule, b.operands, mesh, b.results) else None
    if name in _SUM_NODES | _CHAIN_NODES:
      if name in _CHAIN_NODES and (len(b.operands) != 1 or b.rule.linear != "unary"):
        return None   # (a narrowing float conversion is not linear: rules.elementwise)
      nodes = [t]
      for o in b.operands:
        sub = None if o is None else tree(o, b, layout, axes)
        if sub is None:
          return None
        nodes += sub
      return nodes
    return None

  changes: dict[Tensor, object] = {}
  for b in reversed(graph.bounds):
    if prim(b) not in _SUM_NODES or len(b.results) != 1 or b.results[0] is None:
      continue
    r = b.results[0]
    if r in changes or r.sharding.partial or not own(b, r):
      continue
    layout = r.sharding
    # the axes every leaf reduces over and r's layout splits
    axes = frozenset(layout.axes)
    nodes = []
    for o in b.operands:
      sub = None if o is None or o in changes else tree(o, b, layout, axes)
      if sub is None:
        nodes = None
        break
      nodes += sub
    if not nodes:
      continue
    leaves = [t for t in nodes if prim(producer[t]) in _LEAVES]
    axes = frozenset.intersection(*[
        factors.reduced_axes(producer[t].rule, producer[t].operands, mesh,
                             producer[t].results) for t in leaves]) \
        & frozenset(layout.axes)
    if len(leaves) < 2 or not axes:
      continue
    pending = type(layout)(tuple(tuple(a for a in d if a not in axes) for d in layout.dims),
                           axes)
    for t in nodes:
      changes[t] = pending
  return changes
