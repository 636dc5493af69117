"""Gathering once before an elementwise tail instead of at each of its outputs.

Propagation keeps a value split as far as it can, and the program's boundary
then gathers every output whose layout is less split (the next value of a
replicated input: optimizer state). When several such outputs come from one
split value through elementwise ops only (SGD with momentum: the momentum and
the parameter, both from a gradient split like the activations it was
contracted from), each output is gathered; gathering the value once where
the tail begins and running the tail in the outputs' layout sends less::

    g f32[32@model,10] -> m' = 0.9 m + g -> out m'        gather   (960 B)
                                  `-> w' = w - 0.1 m' -> out w'   gather   (960 B)
    becomes
    g -> gather (960 B) -> m' -> out m'
                             `-> w' -> out w'

:func:`gather_early` finds those tails (regions of elementwise equations of
the top-level program whose values only feed each other or leave as such
outputs), weighs the reshards into each region's equations against the
outputs' reshards (``reshard.plan_reshard`` bytes), and lays the region out
as its outputs where that sends less. The tail's values are then held (and
computed) as the outputs are, which the outputs hold anyway.
"""

from __future__ import annotations

from gshard.spmd import reshard
from gshard.spmd.graph import Bound, Graph, Tensor, sub_jaxprs
from gshard.spmd.sharding import TensorSharding


def _elementwise(b: Bound) -> bool:
  """One result, every operand dim the result's (or a scalar): nothing is
  reduced, blocked or moved between dims."""
  r = b.rule
  return (len(r.results) == 1 and b.results[0] is not None and not b.scope
          and not sub_jaxprs(b.eqn.params)
          and not (r.reduction or r.other_reduction or r.blocked)
          and all(o == r.results[0] or o == () for o in r.operands))


def _coarser(src: TensorSharding, dst: TensorSharding) -> bool:
  """Whether ``dst`` splits each dim over a leading part of ``src``'s axes
  (reaching ``src`` from ``dst`` is a local slice)."""
  return (len(src.dims) == len(dst.dims) and src != dst and not (src.partial or dst.partial)
          and all(s[:len(d)] == d for s, d in zip(src.dims, dst.dims)))


def _bytes(src: TensorSharding, dst: TensorSharding, t: Tensor, mesh) -> int:
  if src == dst:
    return 0
  return reshard.plan_reshard(src, dst, t.shape, t.dtype, mesh).bytes_per_device


def gather_early(graph: Graph, outs: list[TensorSharding]) -> int:
  """Lay out elementwise tails as their outputs where gathering on entry
  sends less than gathering where the tail ends (``outs``: each top-level
  output's layout at the boundary). Changes the tensors' shardings in
  ``graph``; returns how many tensors moved."""
  mesh = graph.mesh_sizes
  producer: dict[Tensor, Bound] = {}
  readers: dict[Tensor, list[Bound]] = {}
  per_eqn: dict[int, int] = {}
  for b in graph.bounds:
    per_eqn[id(b.eqn)] = per_eqn.get(id(b.eqn), 0) + 1
    for t in b.results:
      if t is not None:
        producer[t] = b
    for t in b.operands:
      if t is not None:
        readers.setdefault(t, []).append(b)
  # where a split value is gathered now: an output laid out coarser at the
  # boundary, an elementwise equation whose result is coarser than an operand
  ends: dict[tuple, dict[Tensor, int]] = {}
  leaving: dict[Tensor, list[TensorSharding]] = {}
  for var, dst in zip(graph.top.outvars, outs):
    t = graph.tensor((), var)
    if t is not None:
      leaving.setdefault(t, []).append(dst)
    if t is not None and not t.sharding.partial and _coarser(t.sharding, dst):
      ends.setdefault((t.sharding, dst, t.shape), {}).setdefault(t, 0)
  for b in graph.bounds:
    if not _elementwise(b) or per_eqn[id(b.eqn)] != 1:
      continue
    dst = b.results[0].sharding
    for o in b.operands:
      if (o is not None and o.shape == b.results[0].shape and not o.sharding.partial
          and _coarser(o.sharding, dst)):
        n = ends.setdefault((o.sharding, dst, o.shape), {})
        n[o] = n.get(o, 0) + 1
  moved = 0
  for (src, dst, shape), gathered in ends.items():
    moved += _settle_region(gathered, src, dst, shape, producer, readers, per_eqn,
                            leaving, mesh)
  return moved


def _settle_region(gathered, src, dst, shape, producer, readers, per_eqn, leaving,
                   mesh) -> int:
  """Lay out the elementwise region that ends where ``gathered`` (tensor ->
  how many times it is gathered from ``src`` to ``dst`` inside the program)
  as ``dst``, when the region's inputs and outputs (``leaving``: tensor ->
  its layouts at the boundary) cost fewer bytes that way."""
  region = _region(gathered, src, dst, shape, producer, readers, per_eqn)
  now = _bytes_now(region, gathered, src, dst, readers, leaving, mesh)
  after = _bytes_after(region, src, dst, shape, producer, leaving, mesh)
  if after is None or after >= now:
    return 0
  for t in region:
    t.sharding = dst
  return len(region)


def _region(gathered, src, dst, shape, producer, readers, per_eqn) -> set[Tensor]:
  """The region grown backward from ``gathered`` through elementwise
  equations, and its frontier: values computed otherwise (a contraction's
  result, say) that only the region reads; each is resharded once, where it
  is produced. A value read elsewhere stays as it is, and so does what it
  reads."""
  def inside(t: Tensor, region) -> bool:
    # every reader computes a value of the region or one laid out as dst
    return all(_elementwise(r) and per_eqn[id(r.eqn)] == 1
               and (r.results[0] in region or r.results[0].sharding == dst)
               for r in readers.get(t, ()))

  def eligible(t: Tensor) -> bool:
    b = producer.get(t)
    return (b is not None and not b.scope and per_eqn[id(b.eqn)] == 1
            and not sub_jaxprs(b.eqn.params) and t.shape == shape and t.sharding == src
            and not t.fixed)

  region = {t for t in gathered if eligible(t)}
  grew = True
  while grew:
    grew = False
    for t in [t for t in region if _elementwise(producer[t])]:
      for o in producer[t].operands:
        if o is not None and o not in region and eligible(o) and inside(o, region | {o}):
          region.add(o)
          grew = True
  while (out := {t for t in region if not inside(t, region)}):
    region -= out
  return region


def _bytes_now(region, gathered, src, dst, readers, leaving, mesh) -> int:
  """A lower bound on the bytes the region's ends send as it is laid out now.

  The gathers at its ends fall into groups: values of the region and the
  equations outside it that read them (a "sink", its result laid out as
  dst), linked by those reads. A group is served by gathering its values
  (once each: the partitioner reuses a reshard) or its sinks' results, so it
  sends at least its cheapest such gather, and a value that leaves the
  program as dst its own."""
  now = 0
  group = {t: t for t in region}

  def root(t):
    while group[t] is not t:
      t = group[t]
    return t

  sinks: dict[int, tuple[Bound, list[Tensor]]] = {}
  for t in region:
    for lay in set(leaving.get(t, ())) - {src, dst}:
      now += _bytes(src, lay, t, mesh)
    for r in readers.get(t, ()):
      if r.results[0] not in region:
        sinks.setdefault(id(r), (r, []))[1].append(t)
  for r, ts in sinks.values():
    for t in ts[1:]:
      group[root(t)] = root(ts[0])
  floor: dict[Tensor, int] = {}    # per group root: its cheapest gather
  need: dict[Tensor, int] = {}     # per group root: what must be gathered as is
  for t in region:
    if gathered.get(t) or dst in leaving.get(t, ()):
      k = root(t)
      floor[k] = min(floor.get(k, _bytes(src, dst, t, mesh)), _bytes(src, dst, t, mesh))
      if dst in leaving.get(t, ()):
        need[k] = max(need.get(k, 0), _bytes(src, dst, t, mesh))
  for r, ts in sinks.values():
    k = root(ts[0])
    floor[k] = min(floor[k], _bytes(src, dst, r.results[0], mesh))
  return now + sum(max(f, need.get(k, 0)) for k, f in floor.items())


def _bytes_after(region, src, dst, shape, producer, leaving, mesh) -> int | None:
  """An upper bound on the bytes the region sends laid out as ``dst`` (None
  where it must not move): a frontier value resharded once; an equation with
  an operand from outside that ``dst`` does not hold at most gathers its
  result (run as now, then gathered)."""
  after = 0
  for t in region:
    for lay in set(leaving.get(t, ())) - {src, dst}:
      after += _bytes(dst, lay, t, mesh)
    if not _elementwise(producer[t]):
      after += _bytes(src, dst, t, mesh)
      continue
    outside = [o for o in producer[t].operands if o is not None and o not in region
               and o.shape]
    if any(o.sharding.partial or o.shape != shape for o in outside):
      return None
    if any(_bytes(o.sharding, dst, o, mesh) for o in outside):
      after += _bytes(src, dst, t, mesh)
  return after
