"""Pending partial sums: which values stay a partial sum, and over which mesh axes.

Run after the fixed point, in program order; it returns the pending axes of
every value and changes nothing itself (``propagate`` applies the result).

**Where they come from.** A split ``sum`` factor (a dot contracting a split
dim, ``reduce_sum`` over one, a gather from a split table): the axes chosen
among the operands' projections (:func:`factors.reduced_axes`). **How they
pass.** Through an op whose linearity lets them (:func:`factors.carried`).

**Resolve once, at the producer.** A value stays pending only while every
consumer lets it through; otherwise it is resolved where it is produced, once,
however many consumers it has. Program outputs are resolved. Rounds repeat
until the resolved set stops growing (it only grows). Then, where a pending
value fans out into several psums downstream that together cost more than one
psum of the value itself (a layer norm's backward), resolving it at the
producer is tried, and kept if the total bytes drop.
"""

from __future__ import annotations

import dataclasses

from gshard.spmd import factors
from gshard.spmd.graph import Bound, Graph, Tensor
from gshard.spmd.reshard import allreduce_bytes

MAX_TRIALS = 48


@dataclasses.dataclass
class _Round:
  """One forward marking: pending axes per value, the bytes of the psums it
  implies, and for each pending value the psums it feeds and its ancestors."""

  pending: dict[Tensor, frozenset[str]]
  total: float
  downstream: dict[Tensor, float]
  feeds: dict[Tensor, frozenset[Tensor]]


def _psum_cost(t: Tensor, axes, mesh) -> float:
  """Bytes per device of an all-reduce of ``t``'s local block over ``axes``."""
  n = 1
  for a in axes:
    n *= mesh[a]
  return allreduce_bytes(factors.local_nbytes(t, mesh), n)


def _operand_partials(b: Bound, pending=None) -> list[frozenset[str] | None]:
  """Each operand's pending axes (from ``pending``, else its current sharding);
  None for a literal."""
  if pending is None:
    return [None if o is None else o.sharding.partial for o in b.operands]
  return [None if o is None else pending.get(o, frozenset()) for o in b.operands]


def produced(b: Bound, mesh, pending=None, reduced=None) -> frozenset[str]:
  """The pending axes ``b``'s op gives its result, before any is resolved: its
  split ``sum`` factors' axes and what its linearity carries from the operands."""
  if reduced is None:
    reduced = factors.reduced_axes(b.rule, b.operands, mesh)
  return reduced | factors.carried(b.rule.linear, _operand_partials(b, pending))


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
  return all(factors.lets_through(b.rule.linear, partials, i)
             for i, o in enumerate(b.operands) if o is t)


def _forward(graph: Graph, resolved: set[Tensor], reduced: list) -> _Round:
  mesh = graph.mesh_sizes
  pending: dict[Tensor, frozenset[str]] = {}
  feeds: dict[Tensor, frozenset[Tensor]] = {}
  downstream: dict[Tensor, float] = {}
  total = 0.0
  for b, r in zip(graph.bounds, reduced):
    p = produced(b, mesh, pending, r)
    anc = frozenset().union(*[feeds.get(o, frozenset()) | {o}
                              for o in b.operands if o is not None and pending.get(o)])
    for t in b.results:
      if t is None or t.fixed:
        continue
      raw = p - t.sharding.axes
      q = frozenset() if t in resolved else raw
      if t in pending:
        q &= pending[t]
      pending[t] = q
      if q:
        feeds[t] = anc
      elif raw:
        cost = _psum_cost(t, raw, mesh)
        total += cost
        for a in anc:
          downstream[a] = downstream.get(a, 0.0) + cost
  return _Round(pending, total, downstream, feeds)


def _settle(graph: Graph, resolved: set[Tensor], reduced: list, consumers) -> _Round:
  """Resolve every value some consumer cannot take pending (``resolved`` grows)."""
  for _ in range(len(graph.tensors) + 1):
    rnd = _forward(graph, resolved, reduced)
    bad = {t for t, p in rnd.pending.items() if p and t not in resolved
           and not all(accepts(b, t, rnd.pending) for b in consumers.get(t, ()))}
    if not bad:
      return rnd
    resolved |= bad
  raise RuntimeError("partial-sum marking did not converge")


def mark_partials(graph: Graph, max_trials: int = MAX_TRIALS) -> dict[Tensor, frozenset[str]]:
  """The pending partial-sum axes of every value an equation produces."""
  mesh = graph.mesh_sizes
  consumers: dict[Tensor, list[Bound]] = {}
  for b in graph.bounds:
    for t in b.operands:
      if t is not None:
        consumers.setdefault(t, []).append(b)
  resolved = {graph.tensor((), v) for v in graph.top.outvars} - {None}
  reduced = [factors.reduced_axes(b.rule, b.operands, mesh) for b in graph.bounds]
  best = _settle(graph, resolved, reduced, consumers)
  last = best.pending      # the values pending after the latest trial, kept or not
  order = {t: k for k, t in enumerate(graph.tensors.values())}   # deterministic
  tried: set[Tensor] = set()
  for _ in range(max_trials):
    gains = sorted((-(best.downstream[t] - _psum_cost(t, last[t], mesh)), order[t], t)
                   for t in best.downstream if t not in tried and last.get(t))
    gains = [t for g, _, t in gains if g < 0]
    # Only the most upstream candidates: resolving one settles its descendants.
    candidates = set(gains)
    roots = [t for t in gains if not best.feeds.get(t, frozenset()) & candidates]
    if not roots:
      break
    t = roots[0]
    tried.add(t)
    trial = set(resolved) | {t}
    rnd = _settle(graph, trial, reduced, consumers)
    last = rnd.pending
    if rnd.total < best.total:
      resolved, best = trial, rnd
  return _settle(graph, resolved, reduced, consumers).pending
