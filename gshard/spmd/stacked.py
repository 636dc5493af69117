"""A scan's stacked output laid out as the scan that reads it uses it.

Differentiating a ``lax.scan`` splits it in two loops: the forward one stacks
its residuals (``ys``), the backward one reads them back one step at a time
(``xs``). Propagation links each residual to the value the forward body made,
so it is stacked in that value's layout. When the backward body needs it in
another layout (a MoE layer's expert output: made split on experts, read by
the combine's gradient split on groups), every backward step reshards it,
though the forward body already holds that layout for its own consumer (the
combine), and an unrolled program would reuse that copy::

    forward body:   v f32[E@x,G,C,M] --a2a--> v' [E,G@x,C,M] -> combine
                    `-> ys: v   (stacked as v)
    backward body:  xs v --a2a--> [E,G@x,C,M] -> combine's gradient   (again)
    becomes
    forward body:   v --a2a--> v' -> combine
                               `-> ys: v'  (the same copy: no collective)
    backward body:  xs v' -> combine's gradient

:func:`stack_as_read` finds those residuals and lays the stacked value (and
the backward body's slice of it) out as the backward body reads it. Only
where the forward body already makes that layout, so the move never adds a
collective: it drops one per step.
"""

from __future__ import annotations

from gshard.spmd import factors, reshard
from gshard.spmd.graph import Bound, Graph, Tensor
from gshard.spmd.sharding import TensorSharding


def _link(b: Bound) -> tuple[Tensor, Tensor, bool] | None:
  """A scan's xs or ys link (outer stacked value, inner value, whether it is
  a ys), or None."""
  if (b.eqn.primitive.name != "scan" or not b.rule.blocked
      or len(b.operands) != 1 or len(b.results) != 1
      or b.operands[0] is None or b.results[0] is None):
    return None
  src, dst = b.operands[0], b.results[0]
  if dst.scope == b.scope:
    return dst, src, True
  return src, dst, False


def _needs(t: Tensor, readers: list[Bound], mesh) -> set[TensorSharding]:
  """The layouts ``t``'s readers compute with (each its constraint solved
  as the partitioner's local plan solves it)."""
  out = set()
  for b in readers:
    choice = factors.solve(b.rule, b.operands, b.results, mesh)
    for o, dims in zip(b.operands, b.rule.operands):
      if o is t:
        out.add(TensorSharding(tuple(factors.unproject(dims, choice, b.rule.size_of,
                                                       mesh))))
  return out


def stack_as_read(graph: Graph) -> int:
  """Lay out each scan residual as the loops that read it use it, where the
  loop that makes it holds that layout already. Changes the tensors'
  shardings in ``graph``; returns how many residuals moved."""
  ys = [(b, link) for b in graph.bounds if (link := _link(b)) is not None and link[2]]
  if not ys:                 # no scan stacks a value: nothing to read
    return 0
  mesh = graph.mesh_sizes
  readers: dict[Tensor, list[Bound]] = {}
  for b in graph.bounds:
    for t in b.operands:
      if t is not None:
        readers.setdefault(t, []).append(b)
  leaving = {graph.tensor((), v) for v in graph.top.outvars}
  moved = 0
  for b, (outer, made, _) in ys:
    if (outer.fixed or outer.sharding.partial or made.sharding.partial
        or outer in leaving or outer.sharding.dims[0]
        or outer.sharding.dims[1:] != made.sharding.dims):
      continue
    slices = [_link(r) for r in readers.get(outer, ())]
    if not slices or any(s is None or s[2] for s in slices):
      continue               # read by something other than a scan's xs
    inner = [s[1] for s in slices]
    if any(x.fixed or x.sharding != made.sharding for x in inner):
      continue
    needs = set().union(*(_needs(x, readers.get(x, []), mesh) for x in inner))
    if len(needs) != 1:
      continue
    want = next(iter(needs))
    if want == made.sharding or not reshard.plan_reshard(
        made.sharding, want, made.shape, made.dtype, mesh).bytes_per_device:
      continue               # read as it is, or a local slice of it
    if want not in _needs(made, [r for r in readers.get(made, []) if r is not b], mesh):
      continue               # the forward body does not make that copy
    outer.sharding = TensorSharding(((),) + want.dims)
    graph.restacked.add(outer)
    for x in inner:
      x.sharding = want
    moved += 1
  return moved
