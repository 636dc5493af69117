"""The propagation engine: a sharding for every variable of a jaxpr.

It knows no primitive. Each equation's sharding rule gives factor constraints
over its operands, results and inner-jaxpr variables (``spmd/graph.py`` binds
them to tensors); the engine sweeps them forward then backward until nothing
changes. One step on one constraint (``spmd/factors.py`` does 1-3):

1. project each tensor's sharding onto the constraint's factors;
2. for each factor choose mesh axes among the tensors' candidates: a user's
   annotation first, then the lower resharding cost in bytes, then the more
   specific, then the earlier tensor;
3. give each mesh axis to one factor only (the best supported);
4. project back: a tensor accepts the result only where it refines its
   current sharding (a sharding only becomes more specific) and never in a
   dim the user fixed.

Each accepted update splits one more dim by one more mesh axis, so the sweeps
end. Then ``spmd/partials.py`` marks the pending partial sums, and conflicts
(tensors of one equation that wanted different splits) are reported.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

from gshard.spmd import factors, relayout
from gshard.spmd.graph import Bound, Graph, Tensor, source_of
from gshard.spmd.partials import settle
from gshard.spmd.readers import lay_out_for_readers
from gshard.spmd.sum_scatter import sum_before_scatter
from gshard.spmd.stacked import stack_as_read
from gshard.spmd.sharding import Axes, TensorSharding, fit_axes, short_dtype
from gshard.spmd.updates import lay_out_updates

MAX_SWEEPS = 200


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


# -- one constraint ----------------------------------------------------------

def refine(t: Tensor, new_dims: Sequence[Axes], mesh) -> bool:
  """Extend ``t``'s dims toward ``new_dims`` where that refines them (never a
  pinned dim, never an axis twice, never more shards than elements).
  Returns whether ``t`` changed."""
  cur = t.sharding.dims
  if tuple(new_dims) == cur:
    return False
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
    extra = list(fit_axes(c + tuple(extra), t.shape[i], mesh, exact=False)[len(c):])
    if extra:
      out[i] = c + tuple(extra)
      used.update(extra)
  if tuple(out) == cur:
    return False
  t.sharding = TensorSharding(tuple(out), t.sharding.partial)
  return True


def step(bound: Bound, mesh, defer_ties: bool = False) -> tuple[bool, bool]:
  """One constraint step: solve its factors, refine its tensors. Whether any
  changed, and whether the solve left a tie to other constraints."""
  rule = bound.rule
  choice, tied = factors.solve_tied(rule, bound.operands, bound.results, mesh, defer_ties)
  if not choice:
    return False, tied           # every factor unsplit: nothing to refine
  changed = False
  for t, dims in zip(bound.operands + bound.results, rule.operands + rule.results):
    if t is None or len(t.fixed) == len(t.shape):
      continue
    changed |= refine(t, factors.unproject(dims, choice, rule.size_of, mesh), mesh)
  return changed, tied


# -- conflicts, after the fixed point -------------------------------------------

def conflicts(graph: Graph) -> list[Conflict]:
  """Where a propagated graph's tensors disagreed, what was chosen and why."""
  out = []
  for b in graph.bounds:
    mesh = graph.mesh_sizes
    moved = relayout.carried(b, mesh)     # rows move: these factors differ by design
    holders, _ = factors.holders(b.rule, b.operands, b.results, mesh)
    solved = by_factor = None
    for f in b.rule.factors:
      if f in moved:
        continue
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
      keys = sorted((factors.candidate_key(c, hs, size, mesh, f in b.rule.reduction), c)
                    for c in cands)
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
      if solved is None:
        solved = factors.solve(b.rule, b.operands, b.results, mesh)
        by_factor = factors.solve_by_factor(b.rule, b.operands, b.results, mesh)
      if solved.get(f) in cands and solved[f] != by_factor.get(f):
        # a pin the op could not carry, outweighed by the op's bytes
        best, reason = solved[f], "fewer bytes for the whole op"
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
        return f"{inner}{kind} {i} {short_dtype(t.dtype)}[{','.join(map(str, t.shape))}]"
  return f"{short_dtype(t.dtype)}[{','.join(map(str, t.shape))}]"


# -- the driver --------------------------------------------------------------

def apply_hints(graph: Graph, touching) -> set[int]:
  """Give each state output its input's layout where it has left every dim of
  it open (a tie the first phase left to other constraints): the program
  returns it in that layout anyway. The constraints touching a changed
  output.

  Only where the hint is the whole story: the output is no program input
  (an input returned is no new value), nothing but the program output reads
  it (another reader would pay for the layout), its maker blocks none of the
  input's splits (a part of a layout moves the reshard inside, before a
  free slice), and its maker reads no other state output (that one is
  returned in its own layout, which the hint would flow back into).
  """
  inputs = {id(graph.tensors.get(((), v))) for v in graph.top.invars}
  state = {id(o) for o, _ in graph.hints}
  out: set[int] = set()
  for o, i in graph.hints:
    want = i.sharding.without_partial().dims
    if id(o) in inputs or o.sharding.dims == want:
      continue
    makers = [graph.bounds[k] for k in touching.get(id(o), ())
              if any(t is o for t in graph.bounds[k].results)]
    readers = [k for k in touching.get(id(o), ())
               if any(t is o for t in graph.bounds[k].operands)]
    if readers or not makers or any(
        id(t) in state for b in makers for t in b.operands if t is not None) or any(
        set(f) & b.rule.blocked and axes for b in makers
        for t, fs in zip(b.results, b.rule.results) if t is o
        for axes, f in zip(want, fs)):
      continue
    before = o.sharding
    if refine(o, want, graph.mesh_sizes) and o.sharding.dims != want:
      o.sharding = before               # all or nothing
    if o.sharding is not before:
      out.update(touching.get(id(o), ()))
  return out


def propagate(graph: Graph) -> int:
  """Sweep forward and backward to a fixed point; returns the sweeps made
  (:func:`conflicts` reads the disagreements from the graph after).

  Two phases, each to its fixed point: first, a mesh axis two unpinned
  factors of one constraint want, at the same bytes either way and with
  equal support (in a contraction: any), goes to neither (other constraints,
  later in the program, decide it: a weight gradient takes the layout its
  optimizer update needs); then every tie is settled (the earlier factor).
  A phase's first sweep runs forward over every constraint; later sweeps
  (alternating direction) only over those touching a tensor that changed.
  The second phase's first sweep visits, in program order, the constraints
  whose last solve left a tie or moved their own tensors, and every later one
  a change in this sweep touched: exactly those a full forward sweep would
  find something to do at (any other solves as it last did, to the same
  tensors: without a tie, settling ties changes nothing), in the same order.
  """
  mesh = graph.mesh_sizes
  touching: dict[int, list[int]] = {}
  for i, b in enumerate(graph.bounds):
    for t in b.operands + b.results:
      if t is not None:
        touching.setdefault(id(t), []).append(i)
  sweeps = 0
  start = set(range(len(graph.bounds)))
  for defer in (True, False):
    first = sweeps
    unsettled: set[int] = set()      # last solve tied, or moved its own tensors
    dirty = set(start)
    while dirty or (sweeps == first and graph.bounds):   # a phase's full sweep counts
      if sweeps >= MAX_SWEEPS:
        raise RuntimeError(f"propagation did not converge in {MAX_SWEEPS} sweeps")
      full = sweeps == first           # the phase's first sweep: forward, growing
      queue = sorted(dirty, reverse=(sweeps - first) % 2 == 1)
      queued, dirty = set(queue), set()

      def visits():
        if full:                         # a heap: later constraints a change touches join
          while queue:
            yield heapq.heappop(queue)
        else:
          yield from queue

      for i in visits():
        b = graph.bounds[i]
        before = [(t, t.sharding) for t in b.operands + b.results if t is not None]
        changed, tied = step(b, mesh, defer)
        if changed or tied:
          unsettled.add(i)
        else:
          unsettled.discard(i)
        if changed:
          for t, old in before:
            if t.sharding != old:
              for j in touching[id(t)]:
                if j == i:
                  continue
                dirty.add(j)
                if full and j > i and j not in queued:
                  heapq.heappush(queue, j)     # a full forward sweep reaches it now
                  queued.add(j)
      sweeps += 1
    start = unsettled
    if defer:
      start |= (apply_hints(graph, touching) | relayout.propose(graph, touching)
                | relayout.propose_scans(graph, touching))
  pending, graph.released = settle(graph)
  for t, axes in pending.items():
    t.sharding = t.sharding.with_partial(axes)
  for t, sharding in sum_before_scatter(graph).items():
    t.sharding = sharding
  stack_as_read(graph)
  lay_out_updates(graph, touching)
  lay_out_for_readers(graph, touching)
  return sweeps
