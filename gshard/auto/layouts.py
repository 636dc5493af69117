"""Candidate layouts and op strategies, and what a change of layout costs.

The solver chooses, for every value of the reduced graph, one of its
*candidate layouts*, and for every op with three or more values one of its
*strategies* (mesh axes per factor of its factor rule). This module lists
them and prices a layout change:

- :func:`layouts` enumerates the shardings of a shape: each mesh axis splits
  at most one dim, dims split only evenly; a dim the user fixed keeps its axes.
- :func:`strategies` enumerates a factor rule's assignments of mesh axes to
  factors (blocked and size-1 factors stay unsplit, splits are even).
- :class:`Pricer` prices ``src -> dst`` with ``reshard.plan_reshard`` (the plan
  the partitioner itself would run), in bytes per device weighted by each mesh
  axis' relative bandwidth, memoised.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

from gshard.spmd import reshard
from gshard.spmd.rules import FactorRule
from gshard.spmd.sharding import Axes, TensorSharding, itemsize

# What an impossible layout change costs: more than any real plan.
INFEASIBLE = 1e18


def active_axes(mesh_sizes: Mapping[str, int]) -> tuple[str, ...]:
  """The mesh axes that split anything (size > 1), in mesh order."""
  return tuple(a for a, n in mesh_sizes.items() if n > 1)


def local_bytes(shape: Sequence[int], dtype, sharding: TensorSharding,
                mesh_sizes: Mapping[str, int]) -> int:
  """Bytes one device holds of a value (uneven dims padded, as gshard lays them out)."""
  return itemsize(dtype) * math.prod(sharding.local_shape(shape, mesh_sizes))


def _placements(dims: int, axes: Sequence[str]):
  """Every way to give each axis one of ``dims`` dims or none (-1)."""
  return itertools.product(range(-1, dims), repeat=len(axes))


def _orders(groups: dict[int, list[str]]):
  """Every major-to-minor order of the axes within each group."""
  keys = sorted(groups)
  for perm in itertools.product(*[itertools.permutations(groups[k]) for k in keys]):
    yield dict(zip(keys, perm))


def layouts(shape: Sequence[int], mesh_sizes: Mapping[str, int],
            fixed: Mapping[int, Axes] | None = None,
            splittable: bool = True) -> list[TensorSharding]:
  """The candidate layouts of a value of ``shape``, replicated first.

  ``fixed`` maps dims the user pinned to their axes (kept exactly; their axes
  split no other dim). With ``splittable=False`` (a tiny value) only the
  replicated layout (or the pinned one) is a candidate.

  ``layouts((8, 4), {"data": 2, "model": 4})`` has 9 entries, among them
  ``[8@data, 4@model]`` and ``[8@data*model, 4]``.
  """
  fixed = dict(fixed or {})
  rank = len(shape)
  taken = {a for axes in fixed.values() for a in axes}
  free = [a for a in active_axes(mesh_sizes) if a not in taken]
  out: list[TensorSharding] = []
  seen = set()
  for place in (_placements(rank, free) if splittable else [(-1,) * len(free)]):
    groups: dict[int, list[str]] = {}
    for a, d in zip(free, place):
      if d >= 0:
        if d in fixed:
          break
        groups.setdefault(d, []).append(a)
    else:
      for order in _orders(groups):
        dims = [tuple(fixed.get(i, ())) + tuple(order.get(i, ())) for i in range(rank)]
        if all(n % math.prod(mesh_sizes[a] for a in axes) == 0
               for n, axes in zip(shape, dims) if axes):
          s = TensorSharding(tuple(dims))
          if s not in seen:
            seen.add(s)
            out.append(s)
  if not out:   # a pinned uneven split: the pin itself
    out.append(TensorSharding(tuple(tuple(fixed.get(i, ())) for i in range(rank))))
  return out


def strategies(rule: FactorRule, mesh_sizes: Mapping[str, int],
               divide_work: bool = False) -> list[dict[str, Axes]]:
  """Every assignment of mesh axes to the factors of ``rule`` (each axis to one
  factor or none; blocked and size-1 factors unsplit; even splits), the
  unsplit one first.

  ``divide_work`` (a matmul, a convolution): only the assignments that use
  every mesh axis, so each device does ``1/n`` of the work, as Alpa requires of
  its heavy operators; all of them if no such assignment exists.
  """
  size = rule.size_of
  facs = [f for f in rule.factors if f not in rule.blocked and size[f] > 1]
  axes = active_axes(mesh_sizes)
  out = []
  for place in _placements(len(facs), axes):
    groups: dict[int, list[str]] = {}
    for a, d in zip(axes, place):
      if d >= 0:
        groups.setdefault(d, []).append(a)
    for order in _orders(groups):
      choice = {facs[k]: tuple(v) for k, v in order.items()}
      if all(size[f] % math.prod(mesh_sizes[a] for a in ax) == 0
             for f, ax in choice.items()):
        out.append(choice)
  if divide_work:
    full = [c for c in out if sum(len(a) for a in c.values()) == len(axes)]
    if full:
      return full
  return out


class Pricer:
  """Weighted bytes per device of layout changes, by the partitioner's own plans.

  ``bandwidth`` gives each mesh axis a relative bandwidth (default 1.0 each):
  a collective over axes ``A`` costs its bytes divided by the smallest
  bandwidth among ``A``. ``latency`` adds a fixed cost per collective (in
  bytes), so that of two plans sending the same bytes the one with fewer
  collectives is cheaper. ``bytes(...)`` is the raw figure (bytes sent).

  Between even layouts, every move of a plan sends a fixed fraction of the
  value's bytes, so the cheapest plan does not depend on the shape: plans are
  made once per (source, destination) on a stand-in shape whose split dims
  divide evenly, and scaled by the value's bytes.
  """

  def __init__(self, mesh_sizes: Mapping[str, int],
               bandwidth: Mapping[str, float] | None = None, latency: float = 0.0):
    self.mesh_sizes = dict(mesh_sizes)
    self.bandwidth = {a: float((bandwidth or {}).get(a, 1.0)) for a in mesh_sizes}
    self.latency = float(latency)
    self._unit = math.prod(n for n in mesh_sizes.values())
    self._memo: dict[tuple, tuple[float, float, int]] = {}   # per stand-in shape
    self._seen: dict[tuple, tuple[float, float, int]] = {}   # per value

  def _priced(self, src: TensorSharding, dst: TensorSharding, shape, dtype):
    """(weighted bytes, bytes, collectives) of ``src -> dst`` for this value."""
    key = (src, dst, tuple(shape), dtype)
    hit = self._seen.get(key)
    if hit is None:
      hit = self._seen[key] = self._plan(src, dst, tuple(shape), dtype)
    return hit

  def _plan(self, src, dst, shape, dtype):
    even = all(n % math.prod(self.mesh_sizes[a] for a in axes) == 0
               for s in (src, dst) for n, axes in zip(shape, s.dims))
    stand_in = tuple(self._unit if n > 1 else 1 for n in shape) if even else tuple(shape)
    key = (src, dst, stand_in)
    hit = self._memo.get(key)
    if hit is None:
      try:
        plan = reshard.plan_reshard(src, dst, stand_in, "float32", self.mesh_sizes)
        cols = [s for s in plan.collectives if s.axes]
        hit = (sum(s.bytes_per_device / min(self.bandwidth[a] for a in s.axes) for s in cols),
               float(plan.bytes_per_device), len(cols))
      except (ValueError, TypeError):
        hit = (INFEASIBLE, INFEASIBLE, 0)
      self._memo[key] = hit
    scale = itemsize(dtype) * math.prod(shape) / (4 * math.prod(stand_in))
    return hit[0] * scale, hit[1] * scale, hit[2]

  def cost(self, src: TensorSharding, dst: TensorSharding, shape, dtype) -> float:
    """Weighted bytes per device (plus latency) to bring a value from ``src`` to ``dst``."""
    if src == dst:
      return 0.0
    w, _, n = self._priced(src, dst, shape, dtype)
    return w + self.latency * n

  def bytes(self, src: TensorSharding, dst: TensorSharding, shape, dtype) -> float:
    """Bytes per device to bring a value from ``src`` to ``dst``."""
    if src == dst:
      return 0.0
    return self._priced(src, dst, shape, dtype)[1]

  def allreduce(self, shape, dtype, sharding: TensorSharding, axes: Axes,
                raw: bool = False) -> float:
    """Weighted bytes (or bytes sent, ``raw``) of a cross-device reduction (pmax,
    pmin ...) over ``axes`` of a value laid out as ``sharding``: a ring
    all-reduce of its local bytes."""
    axes = tuple(a for a in axes if self.mesh_sizes[a] > 1)
    if not axes:
      return 0.0
    n = math.prod(self.mesh_sizes[a] for a in axes)
    sent = reshard.allreduce_bytes(local_bytes(shape, dtype, sharding, self.mesh_sizes), n)
    if raw:
      return sent
    return sent / min(self.bandwidth[a] for a in axes) + self.latency
