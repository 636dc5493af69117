"""Pending partial sums: which values stay a partial sum, and over which mesh axes.

Run after the fixed point, in program order; it returns the pending axes of
every value and changes nothing itself (``propagate`` applies the result).

**Where they come from.** A split ``sum`` factor (a dot contracting a split
dim, ``reduce_sum`` over one, a gather from a split table): the axes chosen
among the operands' projections (:func:`factors.reduced_axes`). **How they
pass.** Through an op whose linearity lets them (:func:`linearity.carried`).

**Resolve once, at the producer.** A value stays pending only while every
consumer lets it through; otherwise it is resolved where it is produced, once,
however many consumers it has. Program outputs are resolved. Rounds repeat
until the resolved set stops growing (it only grows). Then, where a pending
value fans out into several psums downstream that together cost more than one
psum of the value itself (a layer norm's backward), resolving it at the
producer is tried, and kept if the total bytes drop. Last, a sum whose
passing on saves nothing (a gradient scaled by the learning rate, then
resolved at the same bytes) is resolved where it is made, or at the first
value on its way whose psum costs no more (``mean(x @ w, axis=0)``: after
the reduction, before the division): summed before what follows, as the
one-device program sums (a lookup's sum is the partitioner's to place).

**Sum before a reduce-scatter**: ``spmd/sum_scatter.py``, after the marking.
"""

from __future__ import annotations

import dataclasses
import heapq

from gshard.spmd import factors, linearity, overlay
from gshard.spmd.graph import Bound, Graph, Tensor, sub_jaxprs
from gshard.spmd.reshard import allreduce_bytes

MAX_TRIALS = 48


@dataclasses.dataclass
class _Round:
  """One forward marking: pending axes per value, the bytes of the psums it
  implies, and for each pending value the psums it feeds and its ancestors.
  ``contrib[k]`` is what bound ``k`` did: per result, (tensor, pending, its
  psum's bytes, the pending ancestors it fed), so a later round can replay it."""

  pending: dict[Tensor, frozenset[str]]
  total: float
  downstream: dict[Tensor, float]
  feeds: dict[Tensor, frozenset[Tensor]]
  contrib: list


def _landed(rnd: _Round) -> _Round:
  """A kept trial's round, its writes applied to the state it read through."""
  return _Round(overlay.land(rnd.pending), rnd.total, overlay.land(rnd.downstream),
                overlay.land(rnd.feeds), overlay.land(rnd.contrib))


def _psum_cost(t: Tensor, axes, mesh) -> float:
  """Bytes per device of an all-reduce of ``t``'s local block over ``axes``."""
  n = 1
  for a in axes:
    n *= mesh[a]
  return allreduce_bytes(factors.local_nbytes(t, mesh), n)


def _operand_partials(b: Bound, pending=None) -> list:
  """Each operand's pending axes (from ``pending``, else its current sharding);
  None for a literal, ``linearity.ZERO`` for a zero the rule reads."""
  if pending is None:
    out = [None if o is None else o.sharding.partial for o in b.operands]
  else:
    out = [None if o is None else pending.get(o, frozenset()) for o in b.operands]
  for k, mark in b.marks:
    out[k] = mark
  return out


def produced(b: Bound, mesh, pending=None, reduced=None) -> frozenset[str]:
  """The pending axes ``b``'s op gives its result, before any is resolved: its
  split ``sum`` factors' axes and what its linearity carries from the operands."""
  if reduced is None:
    reduced = factors.reduced_axes(b.rule, b.operands, mesh, b.results)
  return reduced | linearity.carried(b.rule.linear, _operand_partials(b, pending))


def accepts(b: Bound, t: Tensor, pending=None) -> bool:
  """Whether consumer ``b`` lets ``t``'s pending sum through at every place it reads t.

  Its linearity must let it through, and no other operand may be split over
  the pending axes (``x * sum(x)`` with ``x`` split: each device would scale
  its block of ``x`` by its own partial sum).
  """
  partials = _operand_partials(b, pending)
  axes = t.sharding.partial if pending is None else pending.get(t, frozenset())
  if any(o is not None and o is not t and o.sharding.axes & axes for o in b.operands):
    return False
  return all(linearity.lets_through(b.rule.linear, partials, i)
             for i, o in enumerate(b.operands) if o is t)


class Index:
  """Where each tensor is produced and read: lets a round recompute a suffix,
  or only the bounds a change reaches."""

  def __init__(self, graph: Graph):
    self.producers: dict[Tensor, list[int]] = {}
    self.last_read: dict[Tensor, int] = {}
    self.consumers: dict[Tensor, list[Bound]] = {}
    self.reads: dict[Tensor, list[int]] = {}      # indices of the bounds reading it
    for k, b in enumerate(graph.bounds):
      for t in b.results:
        if t is not None:
          self.producers.setdefault(t, []).append(k)
      for t in b.operands:
        if t is not None:
          self.last_read[t] = k
          self.consumers.setdefault(t, []).append(b)
          if not self.reads.get(t) or self.reads[t][-1] != k:
            self.reads.setdefault(t, []).append(k)
    # A tensor produced once and read only after it: its marking is final when
    # its producer runs, so a change can be followed bound by bound. (Others,
    # a loop's carry, make a round recompute the whole suffix.)
    self.regular = {t for t, ks in self.producers.items()
                    if len(ks) == 1 and self.reads.get(t, [ks[0] + 1])[0] > ks[0]}
    # how many times each bound's psum would run: once per step in a scan's
    # body; a link's where its outer end is (a carry's round-the-loop link: in
    # the body)
    runs: dict = {}
    self.runs = []
    for b in graph.bounds:
      scope = min((t.scope for t in b.operands + b.results if t is not None), key=len,
                  default=b.scope)
      if scope not in runs:
        runs[scope] = _runs(graph.top, scope)
      self.runs.append(runs[scope])


def _runs(jaxpr, scope) -> int:
  """How many times a scope's equations run per call: the product of the scans'
  lengths around it, twice for a while loop's body (its count unknown: it loops)."""
  n = 1
  for idx, path in scope:
    eqn = jaxpr.eqns[idx]
    if eqn.primitive.name == "scan":
      n *= eqn.params["length"]
    elif eqn.primitive.name == "while" and path == ("body_jaxpr",):
      n *= 2
    jaxpr = dict(sub_jaxprs(eqn.params))[path]
  return n


def _forward(graph: Graph, resolved: set[Tensor], reduced: list, index: Index,
             base: _Round | None = None, start: int = 0) -> _Round:
  """Mark pending sums in program order, from bound ``start`` on.

  Bounds before ``start`` see exactly the inputs they saw in ``base`` (they
  read only earlier results, and no tensor they produce changed ``resolved``
  status), so their recorded results (``base.contrib``) stand; the round
  starts from ``base`` with the contributions of the later bounds taken out.
  """
  mesh = graph.mesh_sizes
  if base is None or start == 0:
    pending, feeds, downstream, total = {}, {}, {}, 0.0
    contrib: list = []
  else:
    pending, feeds = overlay.copy(base.pending), overlay.copy(base.feeds)
    downstream, total = overlay.copy(base.downstream), base.total
    old = overlay.copy(base.contrib)
    contrib = old[:start]
    redo: set[Tensor] = set()
    for recs in old[start:]:
      redo.update(t for t, *_ in recs)
      total = _book(recs, downstream, total, -1.0)
    for t in redo:           # back to what the bounds before ``start`` left
      pending.pop(t, None)
      feeds.pop(t, None)
      for k in index.producers[t]:
        if k >= start:
          break
        for u, q, cost, anc in old[k]:
          if u is t:
            pending[t] = q if t not in pending else _meet(pending[t], q)
            if pending[t]:
              feeds[t] = anc
  for k in range(start, len(graph.bounds)):
    recs = _mark(graph.bounds[k], reduced[k], mesh, resolved, pending, feeds, again=True,
                 runs=index.runs[k])
    total = _book(recs, downstream, total, 1.0)
    contrib.append(recs)
  return _Round(pending, total, downstream, feeds, contrib)


def _book(recs, downstream: dict, total: float, sign: float) -> float:
  """Add (``sign`` 1) or take out (-1) the psum bytes of a bound's marking
  ``recs``: to each pending ancestor's downstream total and to the round's
  ``total``, which it returns."""
  for _, _, cost, anc in recs:
    if cost:
      total += sign * cost
      for a in anc:
        downstream[a] = downstream.get(a, 0.0) + sign * cost
  return total


def _meet(a, b):
  """The axes two markings of one value both leave pending (ANY: either's)."""
  return b if a is linearity.ANY else a if b is linearity.ANY else a & b


def _mark(b: Bound, r, mesh, resolved, pending, feeds, again: bool = False,
          runs: int = 1):
  """Bound ``b``'s marking: per result (tensor, pending, its psum's bytes, the
  pending ancestors it fed), from the operands' state in ``pending``/``feeds``
  (its results' entries in them are updated). ``again``: a result another
  bound produced earlier in this round (a loop's carry) stays pending only
  over the axes both leave pending. A psum's bytes count ``runs`` times (the
  bound is in a scan's body)."""
  if b.rule.linear == "seed":       # a loop accumulator's init: its body decides
    for t in b.results:
      if t is not None and not t.fixed:
        pending[t] = frozenset() if t in resolved else linearity.ANY
        feeds.pop(t, None)
    return tuple((t, pending[t], 0.0, frozenset()) for t in b.results
                 if t is not None and not t.fixed)
  if b.rule.linear == "branch":     # every branch's result j: the cond's takes what all leave
    return _mark_branch(b, mesh, resolved, pending, feeds, runs)
  if b.rule.linear == "layout":     # dims only: the other producers say
    recs = []
    for t in b.results:
      if t is not None and not t.fixed:
        q = frozenset() if t in resolved else linearity.ANY
        pending[t] = _meet(pending[t], q) if t in pending else q
        recs.append((t, pending[t], 0.0, frozenset()))
    return tuple(recs)
  p = produced(b, mesh, pending, r)
  anc = frozenset().union(*[feeds.get(o, frozenset()) | {o}
                            for o in b.operands if o is not None and pending.get(o)])
  recs = []
  for t in b.results:
    if t is None:
      continue
    raw = p - t.sharding.axes
    if t.fixed:
      # pinned (an annotation, out_specs, a state output): never pending; a
      # sum its operands bring is resolved here, and booked, so that resolving
      # it where it is made is seen to cost no more
      if raw:
        recs.append((t, frozenset(), _psum_cost(t, raw, mesh) * runs, anc))
      continue
    q = frozenset() if t in resolved else raw
    if again and t in pending:
      q = _meet(pending[t], q)
    pending[t] = q
    cost = 0.0
    if q:
      feeds[t] = anc
    else:
      feeds.pop(t, None)
      if raw:
        cost = _psum_cost(t, raw, mesh) * runs
    recs.append((t, q, cost, anc if (q or raw) else frozenset()))
  return tuple(recs)


def _mark_branch(b: Bound, mesh, resolved, pending, feeds, runs: int):
  """Every branch's result linked to the cond's result ``t``: ``t`` is pending
  over the axes every branch's result is (a branch returning zeros: any; all
  of them: ANY), and each branch sums, in the branch, the axes of its own
  that ``t`` does not keep."""
  (t,) = b.results
  if t is None:
    return ()
  raws, q = [], linearity.ANY
  for o, src in zip(b.operands, _operand_partials(b, pending)):
    if src is linearity.ZERO or src is linearity.ANY:
      continue
    raw = (src or frozenset()) - t.sharding.axes
    raws.append((o, raw))
    q = _meet(q, raw)
  if t in resolved or t.fixed:     # (a pinned result: each branch sums its own)
    q = frozenset()
  if t in pending:             # another constraint's (a stage_switch's layout link)
    q = _meet(pending[t], q)
  pending[t] = q
  kept = q if q is not linearity.ANY else frozenset()
  anc = frozenset().union(*[feeds.get(o, frozenset()) | {o} for o, raw in raws if raw])
  cost = sum(_psum_cost(t, raw - kept, mesh) for _, raw in raws if raw - kept) * runs
  if q:
    feeds[t] = anc
  else:
    feeds.pop(t, None)
  return ((t, q, cost, anc if (q or cost) else frozenset()),)


def _follow(graph: Graph, resolved: set[Tensor], reduced: list, index: Index,
            base: _Round, fresh: set[Tensor]) -> tuple[_Round, set[Tensor]] | None:
  """``base`` with ``fresh`` newly resolved: only the bounds the change reaches
  are marked again (the producers of ``fresh``, then the readers of every
  value whose marking changed, in program order). Returns the round and the
  values whose consumers' view changed; None when a value it reaches is not
  regular (then the caller recomputes the suffix)."""
  if not fresh <= index.regular:
    return None
  mesh = graph.mesh_sizes
  # the trial's writes only, over base's state (copying it made each trial
  # cost the program's size)
  pending, feeds = overlay.Overlay(base.pending), overlay.Overlay(base.feeds)
  downstream, total = overlay.Overlay(base.downstream), base.total
  contrib = overlay.Overlay(base.contrib)
  todo = sorted({index.producers[t][0] for t in fresh if t in index.producers})
  queued = set(todo)
  touched: set[Tensor] = set()
  while todo:
    k = heapq.heappop(todo)
    b = graph.bounds[k]
    old = contrib[k]
    total = _book(old, downstream, total, -1.0)
    before = {t: (pending.get(t), feeds.get(t)) for t, *_ in old}
    recs = _mark(b, reduced[k], mesh, resolved, pending, feeds, runs=index.runs[k])
    contrib[k] = recs
    total = _book(recs, downstream, total, 1.0)
    for t, *_ in recs:
      touched.add(t)
      if before.get(t) != (pending.get(t), feeds.get(t)):
        if t not in index.regular:
          return None
        for j in index.reads.get(t, ()):
          if j not in queued:
            queued.add(j)
            heapq.heappush(todo, j)
        touched.update(o for c in index.consumers.get(t, ()) for o in c.operands
                       if o is not None)
  return _Round(pending, total, downstream, feeds, contrib), touched


def _settle(graph: Graph, resolved: set[Tensor], reduced: list, index: Index,
            base: _Round | None = None, fresh: set[Tensor] = frozenset()) -> _Round:
  """Resolve every value some consumer cannot take pending (``resolved`` grows).

  With ``base`` (a round of the same graph) and ``fresh`` (what ``resolved``
  gained since it), each round recomputes only from the first bound that
  produces a newly resolved value, and only values produced or read from
  there on are checked.
  """
  for _ in range(len(graph.tensors) + 1):
    followed = None if base is None else _follow(graph, resolved, reduced, index, base,
                                                 set(fresh))
    if followed is not None:
      rnd, touched = followed
      check = [(t, rnd.pending.get(t)) for t in touched]
    else:
      start = 0 if base is None else min(
          (index.producers[t][0] for t in fresh if t in index.producers),
          default=len(graph.bounds))
      rnd = _forward(graph, resolved, reduced, index, base, start)
      check = [(t, p) for t, p in rnd.pending.items()
               if start == 0 or index.producers[t][-1] >= start
               or index.last_read.get(t, -1) >= start]
    bad = {t for t, p in check if p and t not in resolved
           and not all(accepts(b, t, rnd.pending) for b in index.consumers.get(t, ()))}
    if not bad:
      return rnd
    resolved |= bad
    base, fresh = rnd, bad
  raise RuntimeError("partial-sum marking did not converge")


def mark_partials(graph: Graph, max_trials: int = MAX_TRIALS) -> dict[Tensor, frozenset[str]]:
  """The pending partial-sum axes of every value an equation produces."""
  return settle(graph, max_trials)[0]


# Lookups into a table and their scatter-add gradients: where the table's split
# conflicts with the indices', the partitioner may move it to another of the
# table's dims first (partition/plan.py), weighing the bytes of their sums.
LOOKUPS = frozenset({"gather", "scatter-add", "scatter-sub"})

# Lookups whose pending sum the partitioner may avoid by moving the table's
# split first: what their sum costs downstream is weighed there.
# A gather only: a scatter-add's pending sum is a table gradient's, the one
# all-reduce data parallelism runs for every gradient. Moving it instead (the
# indices gathered, the cotangent all-to-all'd, the gradient all-gathered)
# sends fewer bytes but runs three collectives for one: on the data-parallel
# LM of docs/benchmarks-client.md it stepped 7-9% slower than the all-reduce.
_WEIGHED = frozenset({"gather"})


def settle(graph: Graph, max_trials: int = MAX_TRIALS) -> tuple[dict, dict]:
  """:func:`mark_partials`, and per pending lookup result (a gather from a
  table split on the looked-up dim) the bytes its
  pending sum costs where it is finally resolved: the drop in the program's
  psum bytes were the lookup's result complete (its downstream psums, less
  any it shares with other pending sums, which stay). None where making it
  complete would change how another value is resolved."""
  mesh = graph.mesh_sizes
  index = Index(graph)
  resolved = {graph.tensor((), v) for v in graph.top.outvars} - {None}
  reduced = [factors.reduced_axes(b.rule, b.operands, mesh, b.results) for b in graph.bounds]
  best = _landed(_settle(graph, resolved, reduced, index))
  last = best.pending      # the values pending after the latest trial, kept or not
  order = {t: k for k, t in enumerate(graph.tensors.values())}   # deterministic
  tried: set[Tensor] = set()
  psum: dict = {}       # (tensor, axes) -> its all-reduce bytes (layouts are fixed here)

  def cost(t, axes):
    k = (t, axes)
    if k not in psum:
      psum[k] = _psum_cost(t, axes, mesh)
    return psum[k]
  for _ in range(max_trials):
    # (bytes saved, negative; upstream first; the value) for each cheaper psum
    gains = sorted((g, order[t], t) for t, down in best.downstream.items()
                   if (p := last.get(t)) and t not in tried and (g := cost(t, p) - down) < 0)
    # Only the most upstream candidates: resolving one settles its descendants.
    candidates = {t for *_, t in gains}
    t = next((t for *_, t in gains if not best.feeds.get(t, frozenset()) & candidates), None)
    if t is None:
      break
    tried.add(t)
    trial = set(resolved) | {t}
    rnd = _settle(graph, trial, reduced, index, best, {t})
    last = rnd.pending
    if rnd.total < best.total:
      resolved, best = trial, _landed(rnd)
  # A sum passed on only to be resolved at the same bytes further down is
  # resolved where it is made, or at the first value on its way where that
  # costs no more (a dot's sum reduced over rows: before the division). That is
  # what one device computes (no 0 * inf = NaN where a term is 0), XLA fuses
  # what follows the psum with the update, and XLA:CPU does not fold a transpose
  # into the dot. Not a lookup's (the partitioner's choice among its plans). In
  # a scan's body a trial costs the trip count times the bytes
  # (``Index.runs``): a sum an accumulator carries out is tried where it leaves.
  for k, b in enumerate(graph.bounds):
    leaves = b.eqn.primitive.name in ("scan", "while") and any(
        o is not None and len(o.scope) > len(b.scope) for o in b.operands)
    # a call's results are its body's, tried inside it (a lookup's stays the
    # partitioner's to place, called or not)
    passes = not sub_jaxprs(b.eqn.params)
    if not (reduced[k] or leaves or passes) or b.eqn.primitive.name in LOOKUPS:
      continue
    for t in b.results:
      if t is None or t in resolved or not best.pending.get(t):
        continue
      trial = set(resolved) | {t}
      rnd = _settle(graph, trial, reduced, index, best, {t})
      if rnd.total <= best.total:
        resolved, best = trial, _landed(rnd)
  released = {}
  for k, b in enumerate(graph.bounds):
    t = b.results[0] if b.results else None
    if b.eqn.primitive.name not in _WEIGHED or t is None or not best.pending.get(t):
      continue
    # resolved where it is produced, less that psum itself: complete for free.
    # Counted only when nothing else changes: a pending value that met t's
    # (an add of two pending sums) would now be resolved where it is
    # produced, a saving the partitioner does not make (it follows the
    # propagated targets), so none is credited to t.
    alone = set(resolved) | {t}
    trial = set(alone)
    rnd = _settle(graph, trial, reduced, index, best, {t})
    if trial != alone:
      continue
    own = sum(c for u, _, c, _ in rnd.contrib[k] if u is t)
    # per run of the lookup, as the partitioner weighs its plans
    released[t] = max(0.0, best.total - (rnd.total - own)) / index.runs[k]
  return {t: frozenset() if p is linearity.ANY else p for t, p in best.pending.items()}, released
