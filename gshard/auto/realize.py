"""From the solver's layouts to what gshard partitions: in_specs, then annotations.

The solver lays out every value; ``gshard.partition`` takes only the
arguments' layouts (``in_specs``) and the annotations in the code, and its
propagation fills in the rest. :func:`realize` makes the two agree: it pins the
arguments, propagates, and compares every top-level value of at least
``min_bytes`` with the solver's layout. Where they differ, it pins the first
differing value in program order (an earlier choice steers the later ones) and
propagates again, a few per round. The pins left are the plan's annotations:
few, because propagation already follows the arguments almost everywhere.
"""

from __future__ import annotations

import dataclasses

from gshard.auto.annotations import Annotation
from gshard.auto.problem import Problem, factors
from gshard.spmd.graph import Graph
from gshard.spmd.propagate import propagate
from gshard.spmd.sharding import TensorSharding, short_dtype
from gshard.spmd.source import source_of

MAX_ROUNDS = 24
PER_ROUND = 2
TOLERANCE = 1e-3     # of the solver's cost: a realized layout this close is kept


@dataclasses.dataclass
class Realized:
  """The propagated graph gshard will partition, and the annotations it needs."""

  graph: Graph
  annotations: list[Annotation]
  rounds: int
  differing: int        # values still laid out otherwise than the solver chose


def _pinned_graph(jaxpr, mesh_sizes, inputs, pins) -> Graph:
  g = Graph(jaxpr, mesh_sizes)
  for var, s in inputs:
    t = g.tensor((), var)
    if t is not None:
      g.pin(t, s, frozenset(), "in_specs")
  for var, s in pins.items():
    g.pin(g.tensor((), var), s, frozenset(), "auto_shard annotation")
  propagate(g)
  return g


def realize(jaxpr, mesh_sizes, prob: Problem, choice: dict[int, int],
            inputs: list[tuple], min_bytes: int, exact: bool = False) -> Realized:
  """Annotations that make propagation from ``inputs`` ((invar, layout) pairs)
  cost, in the solver's terms, what ``choice`` costs. ``exact`` (under a
  memory limit): until every value is laid out as chosen, not only until
  the bytes match (other layouts at the same bytes may hold far more)."""
  made = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for j, v in enumerate(eqn.outvars):
      made[v] = (i, j)
  tops: dict[int, list] = {}      # value variable -> its top-level members, in order
  for vi, var in enumerate(prob.vars):
    if var.kind != "value":
      continue
    v = var.item
    if var.n <= 1 and not v.fixed or \
        max(factors.nbytes(m.tensor) for m in v.members) < min_bytes:
      continue
    ms = sorted((m for m in v.members if m.tensor.scope == () and m.tensor.var in made),
                key=lambda m: made[m.tensor.var])
    if ms:
      tops[vi] = ms
  values = {vi: c for vi, c in choice.items() if prob.vars[vi].kind == "value"}
  target = prob.best_ops(values)[0]
  pins: dict = {}
  rounds = 0
  while True:
    g = _pinned_graph(jaxpr, mesh_sizes, inputs, pins)
    rounds += 1
    real, differ = dict(values), []
    for vi, ms in tops.items():
      got = [g.tensors[((), m.tensor.var)].sharding.without_partial() for m in ms]
      want = [prob.vars[vi].item.layout_of(m, prob.vars[vi].item.candidates[values[vi]])
              for m in ms]
      if got == want:
        continue
      k = prob.candidate_index(vi, ms[0], got[0])
      if k is None or any(prob.vars[vi].item.layout_of(m, prob.vars[vi].item.candidates[k])
                          != x for m, x in zip(ms, got)):
        k = -1                    # not one layout the solver knows: always pinned
      differ.append(vi)
      real[vi] = k
    known = {vi: k for vi, k in real.items() if k >= 0}
    have = prob.best_ops({**values, **known})[0] if len(known) == len(real) else None
    if not differ or (not exact and have is not None and have <= target * (1 + TOLERANCE) + 1.0) \
        or rounds > MAX_ROUNDS:
      break
    picks = _which(prob, values, real, differ, tops, made)
    if rounds < MAX_ROUNDS and all(
        pins.get(tops[vi][0].tensor.var) == prob.vars[vi].item.layout_of(
            tops[vi][0], prob.vars[vi].item.candidates[values[vi]])
        for vi in picks[:PER_ROUND]):
      # this round's pins are in already: the rounds up to the last would
      # propagate the same graph again, so go to the last (it pins every pick)
      rounds = MAX_ROUNDS
    for vi in picks[:PER_ROUND] if rounds < MAX_ROUNDS else picks:
      m = tops[vi][0]
      pins[m.tensor.var] = prob.vars[vi].item.layout_of(
          m, prob.vars[vi].item.candidates[values[vi]])
  annotations = []
  for var, s in sorted(pins.items(), key=lambda kv: made[kv[0]]):
    i, j = made[var]
    eqn = jaxpr.eqns[i]
    annotations.append(Annotation(i, j, eqn.primitive.name, source_of(eqn) or "<unknown>",
                                  s.to_spec(), tuple(var.aval.shape),
                                  short_dtype(var.aval.dtype)))
  return Realized(g, annotations, rounds, len(differ))


def _which(prob, values, real, differ, tops, made) -> list[int]:
  """The differing values worth pinning, first in program order: those laid out
  as no candidate, and those whose own layout, put back, lowers the cost."""
  order = sorted(differ, key=lambda vi: made[tops[vi][0].tensor.var])
  if any(real[vi] < 0 for vi in order):
    return [vi for vi in order if real[vi] < 0]
  base = prob.best_ops(real)[0]
  out = []
  for vi in order:
    if prob.best_ops({**real, vi: values[vi]})[0] < base - 1e-6 * max(1.0, base):
      out.append(vi)
  return out or order


def layout_in(graph: Graph):
  """``layout(tensor)``: a tensor's propagated layout (pending sums left out)."""
  def layout(t) -> TensorSharding:
    x = graph.tensors.get((t.scope, t.var))
    return x.sharding.without_partial() if x is not None else \
        TensorSharding.replicated(len(t.shape))
  return layout
