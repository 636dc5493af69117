"""Resharding: the only module of gshard that chooses collectives.

``plan_reshard(src, dst, global_shape, dtype, mesh_sizes)`` returns a
:class:`ReshardPlan`: the local slices, pads and collectives (``all_gather``,
``all_to_all``, ``psum``, ``psum_scatter``, ``ppermute``) that turn a value laid
out as ``src`` into the same value laid out as ``dst``, each with the bytes one
device sends. ``spmd/collectives.py`` runs a plan inside ``jax.shard_map``.

How a plan is chosen. A layout in the middle of a plan is a state: the axes of
each dim, the pending partial-sum axes, and the padded global length of each
dim. Every move below is exact on the padded layout; the plan is the cheapest
path of moves from ``src`` to ``dst`` (Dijkstra on bytes sent per device, then
on the number of collectives). Moves only bring an axis where ``dst`` wants it:

============  =============================================  ==================
move          effect on the state                            bytes per device
============  =============================================  ==================
slice         append a free axis to a dim (local, by         0
              ``axis_index``)
pad           re-pad an unsplit dim to ``dst``'s padded      0
              length (local; new padding is zero)
psum_scatter  pending axis -> appended to a dim              (n-1)/n * S_in
psum          resolve pending axes                           2(n-1)/n * S
all_to_all    minor-most axes of dim i -> appended to dim j  (n-1)/n * S
all_gather    drop the minor-most axis of a dim              (n-1)/n * S_out
ppermute      same tiling, other device order (e.g.          S
              ``(a,b) -> (b,a)`` or ``a -> b`` of one size)
exchange      src -> dst at once, each device receiving the  rounds * piece
              pieces it lacks (only as run: ``exchange.py``)
============  =============================================  ==================

So the cheap cases come out as GSPMD orders them: identical -> no step;
replicated -> split: ``slice``; split -> replicated: ``all_gather``; a split
moving to another dim: ``all_to_all``; partial -> replicated: ``psum``;
partial -> split: ``psum_scatter``; reordered axes: ``ppermute``. Anything else
is the cheapest combination, e.g. ``[a,_] -> [_,b]`` slices ``b`` first and
then gathers ``a`` on a quarter of the data. A plan that materialises the whole
value unsplit on every device in between (GSPMD's "involuntary full
rematerialisation") has ``fallback=True``.

Local data follows jax's ``NamedSharding``/``shard_map`` convention: a dim split
over ``(a1, a2)`` is cut into ``|a1|*|a2|`` blocks of ``ceil(n / k)`` elements
and the device at ``(i1, i2)`` holds block ``i1*|a2| + i2``.

Padding guarantee. The logical part of the result is always exact, whatever the
source's padding holds (padding is never moved into a logical position).
Padding that a plan creates (a ``pad`` step: e.g. replicated -> split of an
uneven dim) is zero; padding carried over from the source keeps its content, so
a source with zero padding gives a result with zero padding.

Size-1 mesh axes split nothing: they are dropped before planning (so a
partial sum over a size-1 axis is trivially resolved, or created).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from gshard.spmd.sharding import (Axes, MeshSizes, TensorSharding, is_refinement, itemsize,
                                  validate)

COLLECTIVE_KINDS = ("all_gather", "all_to_all", "psum", "psum_scatter", "ppermute", "exchange")
LOCAL_KINDS = ("slice", "pad")


@dataclasses.dataclass(frozen=True)
class Step:
  """One local op or collective of a plan.

  Attributes:
    kind: one of ``COLLECTIVE_KINDS`` or ``LOCAL_KINDS``.
    axes: the mesh axes it runs over, major to minor (the order of the linear
      device index for slice/all_gather/all_to_all/psum_scatter).
    dim: the tensor dim it slices, gathers, scatters or pads (None for psum,
      ppermute and all_to_all).
    bytes_per_device: bytes one device sends (0 for local steps).
    src_dim: all_to_all only: the dim that loses ``axes`` (``concat_axis``).
    dst_dim: all_to_all only: the dim that gains ``axes`` (``split_axis``).
    length: pad only: the new local (= padded global) length of ``dim``.
    perm: ppermute only: ``(source, destination)`` pairs of linear indices over
      ``axes`` (major to minor, in the order of ``axes``).
    exchange: exchange only: its pieces and rounds (``exchange.Exchange``).

  Example: ``Step("all_gather", ("model",), 0, 384)`` gathers dim 0 over
  ``model``; printed ``all_gather(model) dim 0: 384 B``.
  """

  kind: str
  axes: Axes = ()
  dim: int | None = None
  bytes_per_device: int = 0
  src_dim: int | None = None
  dst_dim: int | None = None
  length: int | None = None
  perm: tuple[tuple[int, int], ...] = ()
  exchange: Any = None

  @property
  def is_collective(self) -> bool:
    """Whether the step sends anything (not a local slice or pad)."""
    return self.kind in COLLECTIVE_KINDS

  def __str__(self) -> str:
    where = ""
    if self.kind == "all_to_all":
      where = f" dim {self.src_dim}->{self.dst_dim}"
    elif self.dim is not None:
      where = f" dim {self.dim}"
    if self.kind == "pad":
      where += f" to {self.length}"
    return f"{self.kind}({','.join(self.axes)}){where}: {self.bytes_per_device} B"


@dataclasses.dataclass(frozen=True)
class ReshardPlan:
  """The steps from ``src`` to ``dst`` and what they cost.

  Attributes:
    src, dst: the shardings as given (size-1 axes included).
    steps: in order of execution.
    bytes_per_device: the sum of the steps' bytes.
    fallback: True when the value is materialised unsplit on every device in
      between (gather everything, then slice): correct but costly; report it.
  """

  src: TensorSharding
  dst: TensorSharding
  steps: tuple[Step, ...]
  bytes_per_device: int
  fallback: bool

  @property
  def collectives(self) -> tuple[Step, ...]:
    """The steps that communicate."""
    return tuple(s for s in self.steps if s.is_collective)

  @property
  def kinds(self) -> tuple[str, ...]:
    """``("slice", "all_gather")`` for a plan that slices then gathers."""
    return tuple(s.kind for s in self.steps)

  def __str__(self) -> str:
    body = "; ".join(str(s) for s in self.steps) or "nothing"
    tail = " [fallback]" if self.fallback else ""
    return f"{self.src} -> {self.dst}: {body}{tail}"


# -- planning -----------------------------------------------------------------

def plan_reshard(src: TensorSharding, dst: TensorSharding,
                 global_shape: Sequence[int], dtype,
                 mesh_sizes: MeshSizes) -> ReshardPlan:
  """The cheapest plan from ``src`` to ``dst`` for a value of ``global_shape``.

  Args:
    src, dst: shardings of rank ``len(global_shape)``. ``dst.partial`` must be
      a subset of ``src.partial`` (ignoring size-1 axes).
    global_shape: the logical (unpadded) global shape.
    dtype: anything ``np.dtype`` accepts; sets the byte counts.
    mesh_sizes: mesh axis name -> size, in mesh order.

  Example, on a ``(data=2, model=4)`` mesh, for ``f32[8,16]``::

    >>> plan_reshard(TensorSharding((("model",), ())), TensorSharding(((), ())),
    ...              (8, 16), "float32", {"data": 2, "model": 4}).kinds
    ('all_gather',)

  The local ``f32[2,16]`` (128 B) is gathered 4 ways: 3 * 128 = 384 B sent.
  """
  validate(src, global_shape, mesh_sizes, "reshard source")
  validate(dst, global_shape, mesh_sizes, "reshard destination")
  return _plan_cached(src, dst, tuple(int(n) for n in global_shape),
                      itemsize(dtype), tuple(dict(mesh_sizes).items()), _is_bool(dtype))


def cut_from(held: TensorSharding, dst: TensorSharding, global_shape: Sequence[int],
             dtype, mesh_sizes: MeshSizes) -> bool:
  """Whether a copy laid out as ``held`` gives ``dst`` by local slices
  alone (``dst`` splits it further, sending nothing): the partitioner cuts
  such a layout from a copy it already holds."""
  return is_refinement(held, dst) and not plan_reshard(
      held, dst, global_shape, dtype, mesh_sizes).collectives


@functools.lru_cache(maxsize=4096)
def _plan_cached(src: TensorSharding, dst: TensorSharding, global_shape: tuple,
                 itemsize: int, mesh_items: tuple, logical_or: bool) -> ReshardPlan:
  sizes = dict(mesh_items)
  s, d = drop_trivial_axes(src, sizes), drop_trivial_axes(dst, sizes)
  _check_partial(src, dst, s, d)
  order = {a: i for i, a in enumerate(sizes)}
  start = _State(s.dims, _sorted(s.partial, order),
                 s.padded_shape(global_shape, sizes))
  goal = _State(d.dims, _sorted(d.partial, order),
                d.padded_shape(global_shape, sizes))
  prob = _Problem(goal, sizes, itemsize, order,
                  frozenset(s.partial - d.partial), logical_or)
  path = _search(start, prob)
  steps = _merge_steps(tuple(_finish_step(step, before, after, prob)
                             for step, before, after in path))
  states = [start] + [after for _, _, after in path]
  return ReshardPlan(src, dst, steps, sum(x.bytes_per_device for x in steps),
                     _is_full_remat(states))


def _is_bool(dtype) -> bool:
  try:
    return np.dtype(dtype) == np.bool_
  except TypeError:
    return False


def drop_trivial_axes(s: TensorSharding, sizes: MeshSizes) -> TensorSharding:
  """``[data*one,_]+one`` with ``one`` of size 1 is ``[data,_]``."""
  keep = lambda axes: tuple(a for a in axes if sizes[a] > 1)
  return TensorSharding(tuple(keep(d) for d in s.dims), keep(sorted(s.partial)))


def _check_partial(src, dst, s, d) -> None:
  extra = d.partial - s.partial
  if extra:
    raise ValueError(
        f"reshard {src} -> {dst}: the destination is a pending partial sum over "
        f"{sorted(extra)} but the source is not; a reshard can resolve partial "
        "sums (psum, psum_scatter) but not create them. Drop those axes from "
        "the destination's partial set.")


def _sorted(axes, order: Mapping[str, int]) -> Axes:
  return tuple(sorted(axes, key=order.__getitem__))


@dataclasses.dataclass(frozen=True)
class _State:
  """A layout during a plan: axes per dim, pending axes, padded global shape."""
  dims: tuple[Axes, ...]
  pending: Axes
  padded: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _Problem:
  goal: _State
  sizes: Mapping[str, int]
  itemsize: int
  order: Mapping[str, int]
  resolvable: frozenset[str]     # pending in src, not in dst: psum them
  logical_or: bool = False       # a bool value: its partial "sum" is an OR (pmax, no scatter)


# -- ring formulas: bytes one device sends ---------------------------------------

def allreduce_bytes(nbytes: float, n: int) -> float:
  """A ring all-reduce of ``nbytes`` over ``n`` devices sends 2(n-1)/n of them."""
  return 2 * (n - 1) * nbytes / n


def shard_count(axes: Axes, sizes: MeshSizes) -> int:
  """How many blocks ``axes`` cut a dim into: the product of their sizes."""
  return math.prod(sizes[a] for a in axes)


def _local_len(st: _State, dim: int, prob: _Problem) -> int:
  return st.padded[dim] // shard_count(st.dims[dim], prob.sizes)


def _local_bytes(st: _State, prob: _Problem) -> int:
  return prob.itemsize * math.prod(
      _local_len(st, i, prob) for i in range(len(st.dims)))


def _with_dim(st: _State, dim: int, axes: Axes, **changes) -> _State:
  dims = st.dims[:dim] + (tuple(axes),) + st.dims[dim + 1:]
  return dataclasses.replace(st, dims=dims, **changes)


def _search(start: _State, prob: _Problem) -> list[tuple[Step, _State, _State]]:
  """Dijkstra from ``start`` to ``prob.goal``; cost (bytes, collectives, steps).

  The goal is always reachable (gather all, psum, pad, slice), so this returns.
  """
  cost = {start: (0, 0, 0)}
  parent: dict[_State, tuple[_State, Step] | None] = {start: None}
  heap = [((0, 0, 0), 0, start)]
  tie = itertools.count(1)
  while heap:
    c, _, st = heapq.heappop(heap)
    if st == prob.goal:
      break
    if c > cost[st]:
      continue
    for step, nxt in _moves(st, prob):
      nc = (c[0] + step.bytes_per_device, c[1] + step.is_collective, c[2] + 1)
      if nxt not in cost or nc < cost[nxt]:
        cost[nxt], parent[nxt] = nc, (st, step)
        heapq.heappush(heap, (nc, next(tie), nxt))
  path, st = [], prob.goal
  while parent[st] is not None:
    before, step = parent[st]
    path.append((step, before, st))
    st = before
  return path[::-1]


def _moves(st: _State, prob: _Problem) -> Iterator[tuple[Step, _State]]:
  for gen in (_slice_moves, _pad_moves, _reduce_moves, _all_to_all_moves,
              _gather_moves, _ppermute_moves):
    yield from gen(st, prob)


def _busy_axes(st: _State) -> frozenset[str]:
  return frozenset(a for d in st.dims for a in d) | frozenset(st.pending)


def _slice_moves(st, prob):
  """A free axis that ``dst`` puts on dim d is appended to d by a local slice.

  ``[_,_] -> [data,_]``: device ``data=i`` keeps rows ``[i*n/2, (i+1)*n/2)``.
  """
  busy = _busy_axes(st)
  for dim, want in enumerate(prob.goal.dims):
    for a in want:
      if a not in busy and _local_len(st, dim, prob) % prob.sizes[a] == 0:
        yield Step("slice", (a,), dim), _with_dim(st, dim, st.dims[dim] + (a,))


def _pad_moves(st, prob):
  """An unsplit dim is re-padded (trimmed) to the goal's padded length.

  ``f32[5]`` unsplit, going to ``[model]`` with ``model=4``: pad 5 -> 8.
  """
  for dim, (axes, n) in enumerate(zip(st.dims, st.padded)):
    want = prob.goal.padded[dim]
    if not axes and n != want:
      padded = st.padded[:dim] + (want,) + st.padded[dim + 1:]
      yield (Step("pad", (), dim, length=want),
             dataclasses.replace(st, padded=padded))


def _reduce_moves(st, prob):
  """Pending axes: psum_scatter onto a dim dst splits by it, or psum.

  ``[_,_]+model -> [model,_]`` is one psum_scatter ((n-1)/n of the input),
  ``[_,_]+model -> [_,_]`` one psum (2(n-1)/n).
  """
  todo = [a for a in st.pending if a in prob.resolvable]
  size = _local_bytes(st, prob)
  for a in todo if not prob.logical_or else ():   # no OR-scatter collective: psum, slice
    n, rest = prob.sizes[a], tuple(p for p in st.pending if p != a)
    for dim, want in enumerate(prob.goal.dims):
      if a in want and _local_len(st, dim, prob) % n == 0:
        nxt = _with_dim(st, dim, st.dims[dim] + (a,), pending=rest)
        yield Step("psum_scatter", (a,), dim, (n - 1) * size // n), nxt
  for k in range(1, len(todo) + 1):
    for group in itertools.combinations(todo, k):
      n = shard_count(group, prob.sizes)
      rest = tuple(p for p in st.pending if p not in group)
      yield (Step("psum", group, None, int(allreduce_bytes(size, n))),
             dataclasses.replace(st, pending=rest))


def _all_to_all_moves(st, prob):
  """The minor-most axes of dim i move to the end of dim j, where dst wants them.

  ``[data,_] -> [_,data]``: one all_to_all, (n-1)/n of the local bytes.
  """
  size = _local_bytes(st, prob)
  for i, axes in enumerate(st.dims):
    for k in range(1, len(axes) + 1):
      group = axes[-k:]
      n = shard_count(group, prob.sizes)
      for j, want in enumerate(prob.goal.dims):
        if (j != i and set(group) <= set(want)
            and _local_len(st, j, prob) % n == 0):
          nxt = _with_dim(_with_dim(st, i, axes[:-k]), j, st.dims[j] + group)
          step = Step("all_to_all", group, None, (n - 1) * size // n,
                      src_dim=i, dst_dim=j)
          yield step, nxt


def _gather_moves(st, prob):
  """The minor-most axis of a dim is gathered: (n-1) times the local bytes."""
  size = _local_bytes(st, prob)
  for dim, axes in enumerate(st.dims):
    if axes:
      n = prob.sizes[axes[-1]]
      yield (Step("all_gather", axes[-1:], dim, (n - 1) * size),
             _with_dim(st, dim, axes[:-1]))


def _ppermute_moves(st, prob):
  """Same number of shards per dim, other axes or order: one ppermute (S bytes).

  Candidates: each dim's axes reordered as dst orders them (``(a,b)->(b,a)``);
  each dim whose shard count equals dst's replaced by dst's axes; both.
  """
  size = _local_bytes(st, prob)
  seen = {st.dims}
  for dims in _ppermute_targets(st, prob):
    if dims not in seen and _valid_dims(dims, st.pending):
      seen.add(dims)
      yield Step("ppermute", (), None, size), dataclasses.replace(st, dims=dims)


def _ppermute_targets(st, prob) -> Iterator[tuple[Axes, ...]]:
  goal = prob.goal.dims
  reorder = tuple(_reorder_like(have, want) for have, want in zip(st.dims, goal))
  same = [shard_count(h, prob.sizes) == shard_count(w, prob.sizes)
          for h, w in zip(st.dims, goal)]
  yield reorder
  yield tuple(w if s else h for h, w, s in zip(st.dims, goal, same))
  yield tuple(w if s else r for r, w, s in zip(reorder, goal, same))


def _reorder_like(have: Axes, want: Axes) -> Axes:
  """``_reorder_like(("a","b","c"), ("c","a")) == ("c","a","b")``."""
  first = tuple(a for a in want if a in have)
  return first + tuple(a for a in have if a not in first)


def _valid_dims(dims: tuple[Axes, ...], pending: Axes) -> bool:
  used = [a for d in dims for a in d] + list(pending)
  return len(used) == len(set(used))


# -- turning the path into steps ----------------------------------------------

def _finish_step(step: Step, before: _State, after: _State,
                 prob: _Problem) -> Step:
  """Fill a ppermute's axes and permutation (the search leaves them out)."""
  if step.kind != "ppermute":
    return step
  axes = _sorted({a for d in before.dims + after.dims for a in d}, prob.order)
  perm = ppermute_pairs(before.dims, after.dims, axes, prob.sizes)
  return dataclasses.replace(step, axes=axes, perm=perm)


def ppermute_pairs(old: Sequence[Axes], new: Sequence[Axes], axes: Axes,
                   sizes: MeshSizes) -> tuple[tuple[int, int], ...]:
  """(source, destination) pairs, linear over ``axes``, from layout old to new.

  Each device needs the block (per dim) that ``new`` gives it; some device
  holds it under ``old``. A device that already holds its block keeps it.

  Example: ``old=[(a,b)]``, ``new=[(b,a)]``, ``a=2, b=2`` over axes ``(a, b)``:
  device (0,1) (index 1) holds block 1 and needs block 2 = (a=1,b=0)'s block,
  so the pairs include ``(2, 1)`` and ``(1, 2)``; devices 0 and 3 keep theirs.
  """
  coords = list(itertools.product(*(range(sizes[a]) for a in axes)))
  pos = {a: i for i, a in enumerate(axes)}
  block = lambda dims, c: tuple(
      linear_index([c[pos[a]] for a in d], [sizes[a] for a in d]) for d in dims)
  holders: dict[tuple, list[int]] = {}
  for i, c in enumerate(coords):
    holders.setdefault(block(old, c), []).append(i)
  needs = [block(new, c) for c in coords]
  pairs: list[tuple[int, int] | None] = [None] * len(coords)
  for i, b in enumerate(needs):          # keep what is already in place
    if i in holders[b]:
      holders[b].remove(i)
      pairs[i] = (i, i)
  for i, b in enumerate(needs):
    if pairs[i] is None:
      pairs[i] = (holders[b].pop(0), i)
  return tuple(pairs)


def linear_index(index: Sequence[int], sizes: Sequence[int]) -> int:
  """Row-major linear index of ``index`` in a grid of ``sizes``: ``linear_index((1, 2), (2, 4)) == 6``."""
  out = 0
  for i, n in zip(index, sizes):
    out = out * n + i
  return out


_MERGEABLE = {"slice": "append", "psum_scatter": "append", "all_gather": "prepend"}


def _merge_steps(steps: tuple[Step, ...]) -> tuple[Step, ...]:
  """Fuse runs on one dim: ``slice(a)`` then ``slice(b)`` is ``slice(a,b)``;
  ``all_gather(b)`` then ``all_gather(a)`` is ``all_gather(a,b)``. Bytes add
  (the fused ring costs exactly the sum)."""
  out: list[Step] = []
  for s in steps:
    prev = out[-1] if out else None
    how = _MERGEABLE.get(s.kind)
    if how and prev and prev.kind == s.kind and prev.dim == s.dim:
      axes = prev.axes + s.axes if how == "append" else s.axes + prev.axes
      out[-1] = dataclasses.replace(
          prev, axes=axes,
          bytes_per_device=prev.bytes_per_device + s.bytes_per_device)
    else:
      out.append(s)
  return tuple(out)


def _is_full_remat(states: list[_State]) -> bool:
  """True when a state strictly between a split src and a split dst is unsplit."""
  split = lambda st: any(st.dims)
  if len(states) < 3 or not split(states[0]) or not split(states[-1]):
    return False
  return any(not split(st) for st in states[1:-1])
