"""The factor solver: pure functions from shardings and a factor rule to a choice.

Propagation (each constraint step) and the partitioner (the local plan of an
equation) both ask one question of a :class:`FactorRule` and the tensors it
names: which mesh axes should each factor get? This module answers it, and
knows nothing of jaxprs, graphs or devices:

- ``project`` reads a tensor's sharding as axes per factor, and ``unproject``
  turns per-factor axes back into a tensor's sharding (both from
  :mod:`gshard.spmd.projection`, and importable from here);
- :func:`solve` chooses axes per factor among the tensors' candidates (a
  pinned tensor first, then the lower resharding cost in bytes, then the more
  specific, then the earlier tensor), gives each mesh axis to one factor, and
  then checks the whole op's bytes against other tensors' proposals for a
  factor that lost axes;
- :func:`reduced_axes` gives the axes of the split ``sum`` factors (a pending
  partial sum of the result); whether such a sum may pass through the op that
  reads it is the linearity table's answer (:mod:`gshard.spmd.linearity`).

A tensor here is anything with ``sharding``, ``fixed`` (dims a user pinned),
``shape`` and ``dtype`` (:class:`Held`); ``None`` stands for a literal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

from gshard.spmd import reshard
from gshard.spmd.projection import Held, local_nbytes, nbytes, project, unproject
from gshard.spmd.rules import FactorRule
from gshard.spmd.sharding import Axes, TensorSharding, is_refinement


# -- choosing axes per factor ------------------------------------------------------

@dataclasses.dataclass
class Holder:
  """One tensor's view of one factor: the axes it holds for it."""

  tensor: Held
  proj: Axes
  fixed: bool
  order: int


def holders(rule: FactorRule, operands: Sequence[Held | None],
            results: Sequence[Held | None], mesh) -> tuple[dict[str, list[Holder]], list]:
  """Per factor, every tensor holding it; and the (tensor, dims) pairs named."""
  out: dict[str, list[Holder]] = {f: [] for f in rule.factors}
  pairs = [(t, d) for t, d in zip(list(operands) + list(results),
                                   rule.operands + rule.results) if t is not None]
  for order, (t, dims) in enumerate(pairs):
    proj = project(dims, t.sharding.dims, rule.size_of, mesh)   # (made once per rule)
    for i, factors in enumerate(dims):
      for f in factors:
        out[f].append(Holder(t, proj.get(f, ()), i in t.fixed, order))
  return out, pairs


def _reshard_bytes(h: Holder, axes: Axes, mesh) -> int:
  """Roughly what one device sends to give ``h``'s factor the split ``axes``.

  Splitting further is a local slice (0), of a pinned tensor too (the op
  reads a slice of it). Axes taken away are gathered: the local bytes times
  their size. (An axis moving to another factor of the same tensor, an
  all-to-all, is settled with exact plans in :func:`solve`.)
  """
  if axes[:len(h.proj)] == h.proj:
    return 0
  removed = math.prod(mesh[a] for a in h.proj if a not in axes)
  return local_nbytes(h.tensor, mesh) * max(1, removed)


def _pins(h: Holder, hs: list[Holder], summed: bool) -> bool:
  """Whether ``h`` pins its factor (of holders ``hs``): a pinned tensor, but not
  one pinned unsplit on a ``summed`` (contracted) factor that holds none of
  the axes the others propose: the op reads a slice of that operand, which
  sends nothing (``h[:, F@b] @ w2``, ``w2`` replicated on F: F may stay split)."""
  return h.fixed and (bool(h.proj) or not summed or any(
      {a for d in h.tensor.sharding.dims for a in d}.intersection(o.proj) for o in hs))


def candidate_key(axes: Axes, hs: list[Holder], size: int, mesh, summed=False) -> tuple:
  """The order candidates are ranked in (smallest first): valid, pinned support
  (:func:`_pins`), resharding bytes, more specific, earlier tensor."""
  fixed_exact = sum(1 for h in hs if _pins(h, hs, summed) and h.proj == axes)
  valid = fixed_exact > 0 or math.prod(mesh[a] for a in axes) <= size
  cost = sum(_reshard_bytes(h, axes, mesh) for h in hs)
  first = min((h.order for h in hs if h.proj == axes), default=len(hs))
  return (not valid, -fixed_exact, cost, -len(axes), first)


def choose(f: str, hs: list[Holder], rule: FactorRule, mesh) -> Axes | None:
  """The best candidate axes for factor ``f`` (``()`` when it must stay unsplit,
  None when no tensor proposes any)."""
  if f in rule.blocked or rule.size_of[f] == 1:
    return ()
  cands = {h.proj for h in hs if h.proj or h.fixed}
  if not cands:
    return None
  return min(sorted(cands), key=lambda a: candidate_key(a, hs, rule.size_of[f], mesh,
                                                          f in rule.reduction))


@dataclasses.dataclass(frozen=True)
class _View:
  """A tensor as the solver reads it: a hashable value (the memo's key), its
  hash computed once."""

  sharding: TensorSharding
  fixed: frozenset[int]
  shape: tuple[int, ...]
  dtype: Any

  def __post_init__(self):
    try:
      h = hash((self.sharding, self.fixed, self.shape, self.dtype))
    except TypeError:        # a dtype jax cannot hash: the memo is skipped
      h = None
    object.__setattr__(self, "_hash", h)

  def __hash__(self) -> int:
    if self._hash is None:
      raise TypeError(f"unhashable dtype {self.dtype!r}")
    return self._hash


def view(t: Held | None):
  """A tensor's hashable view (None stays None): what :func:`solve` reads of it,
  kept on the tensor until its sharding or pins change."""
  if t is None or isinstance(t, _View):
    return t
  v = getattr(t, "_solver_view", None)
  if v is not None and v.sharding is t.sharding and v.fixed is t.fixed:
    return v
  v = _View(t.sharding, t.fixed, tuple(t.shape), t.dtype)
  with contextlib.suppress(AttributeError):   # a tensor type that takes no new attributes
    t._solver_view = v
  return v


def view_as(t: Held, sharding: TensorSharding, fixed=frozenset()):
  """:func:`view` of ``t`` as if laid out as ``sharding`` and pinned in ``fixed``."""
  return _View(sharding, frozenset(fixed), tuple(t.shape), t.dtype)


def solve(rule: FactorRule, operands: Sequence[Held | None],
          results: Sequence[Held | None], mesh, defer_ties: bool = False,
          settled: bool = False) -> dict[str, Axes]:
  """Per-factor axes for one rule over these tensors, each mesh axis given to one
  factor (the better supported one; a contested axis goes where it sends fewer
  bytes, by exact reshard plans).

  With ``defer_ties``, two unpinned factors that want one mesh axis, send the
  same bytes either way and have equal support (or, in a contraction, any
  support) get neither: the choice is left to other constraints
  (propagation's first phase: a weight gradient then takes the layout its
  optimizer update needs, not the first operand's; a MoE combine's gradient,
  the groups' layout its gating backward reads, not the larger operand's).

  With ``settled`` (layouts after propagation: the partitioner's question),
  a split ``sum`` factor an operand lacks may be contracted unsplit
  (:func:`_summed_axes`); while propagating, that operand may still take
  the split, so it is not asked.

  Pure in the tensors' shardings, pins, shapes and dtypes: memoised on them,
  so the repeated layers of a model are solved once.
  """
  return solve_tied(rule, operands, results, mesh, defer_ties, settled)[0]


def solve_tied(rule: FactorRule, operands: Sequence[Held | None],
               results: Sequence[Held | None], mesh,
               defer_ties: bool = False, settled: bool = False) -> tuple[dict[str, Axes], bool]:
  """:func:`solve`, and whether a tie was left to other constraints (without
  one, ``defer_ties`` changed nothing: the answer is the same either way)."""
  try:
    key = (rule, tuple(map(view, operands)), tuple(map(view, results)),
           tuple(mesh.items()), defer_ties, settled)
    hash(key)
  except TypeError:        # a dtype jax cannot hash: solve it anew
    return _solve(rule, operands, results, mesh, defer_ties, settled=settled)
  items, tied = _solve_memo(*key)
  return dict(items), tied


@functools.lru_cache(maxsize=1 << 16)
def _solve_memo(rule, operands, results, mesh_items, defer_ties, settled) -> tuple:
  done, tied = _solve(rule, operands, results, dict(mesh_items), defer_ties, settled=settled)
  return tuple(done.items()), tied


def solve_by_factor(rule: FactorRule, operands: Sequence[Held | None],
                    results: Sequence[Held | None], mesh) -> dict[str, Axes]:
  """:func:`solve` without weighing a pin the op cannot carry against the
  whole op's bytes (:func:`_unpinned_if_cheaper`): what the reports compare."""
  return _solve(rule, operands, results, mesh, whole=False)[0]


def _solve(rule: FactorRule, operands: Sequence[Held | None],
           results: Sequence[Held | None], mesh,
           defer_ties: bool = False, whole: bool = True,
           settled: bool = False) -> tuple[dict[str, Axes], bool]:
  tied = False
  hold, pairs = holders(rule, operands, results, mesh)
  choice: dict[str, Axes] = {}
  strength = {}
  for f in rule.factors:
    c = choose(f, hold[f], rule, mesh)
    if c is None:
      continue
    choice[f] = c
    hs = hold[f]
    strength[f] = (-sum(1 for h in hs if _pins(h, hs, f in rule.reduction) and h.proj == c),
                   -sum(local_nbytes(h.tensor, mesh) for h in hs if h.proj == c and c),
                   rule.factors.index(f))
  owner: dict[str, str] = {}          # mesh axis -> the factor holding it
  done: dict[str, Axes] = {}
  for f in sorted(choice, key=lambda f: strength[f]):
    keep: list[str] = []
    for a in choice[f]:
      if a in owner and owner[a] is None:    # left to other constraints
        break
      g = owner.get(a)
      if g is not None:
        # Two factors want one axis: keep the assignment that sends less.
        stay = {**done, f: tuple(keep)}
        take = {**done, g: done[g][:done[g].index(a)], f: tuple(keep) + (a,)}
        take_bytes = _assignment_bytes(take, pairs, rule, mesh, results)
        stay_bytes = _assignment_bytes(stay, pairs, rule, mesh, results)
        rest = _take_rest(f, keep, choice[f], owner, done, rule, mesh)
        if rest is not None:
          # f may take all the axes it still wants at once: a tuple of axes
          # moves as one all-to-all, where taken one by one the first step
          # gathers
          rest_bytes = _assignment_bytes(rest, pairs, rule, mesh, results)
          if rest_bytes < take_bytes:
            take, take_bytes = rest, rest_bytes
        if take_bytes < stay_bytes:
          _give(take, f, done, owner, tie=False)
          if take is rest:
            keep = list(rest[f])
            owner.update({b: f for b in keep})
            break
        elif (defer_ties and take_bytes == stay_bytes and strength[f][0] == 0
              and (strength[f][:2] == strength[g][:2]
                   or rule.reduction and strength[g][0] == 0)):
          _give(take, f, done, owner, tie=True)   # neither factor takes them
          tied = True
          break
        else:
          break
      keep.append(a)
      owner[a] = f
    done[f] = tuple(keep)
  for f in rule.reduction if settled else ():
    if done.get(f):
      done[f] = _summed_axes(f, done, hold[f], pairs, rule, mesh, results)
  if whole and not tied:
    done = _unpinned_if_cheaper(done, choice, hold, pairs, rule, mesh, results)
    done = _other_proposal_if_cheaper(done, choice, hold, pairs, rule, mesh, results)
  return done, tied


def _summed_axes(f: str, choice: dict, hs: list[Holder], pairs, rule: FactorRule, mesh,
                 results) -> Axes:
  """The axes split ``sum`` factor ``f`` keeps (the result's pending sum), of
  those ``choice`` gives it: the ones every operand holds, the rest gathered,
  where that sends no more bytes (exact reshards) than the least that
  resolving the sum over all of them sends (a reduce-scatter, which a later
  gather of the result can double); else all of them.

  An activation split on its contracted feature dim with a replicated weight
  (``x[:, D@a] @ w``) is gathered, as GSPMD does, rather than all-reducing
  the larger ``x @ w``. Where every operand is split on the factor (data
  parallelism's weight gradient, Megatron's row-parallel layer) the sum
  stays pending: no operand grows, no compute repeats.
  """
  axes = choice[f]
  kept = tuple(a for a in axes if all(a in h.proj for h in hs))
  if kept == axes or (_settled_bytes({**choice, f: axes}, pairs, rule, mesh, results)
                      < _settled_bytes({**choice, f: kept}, pairs, rule, mesh, results)):
    return axes
  return kept


def _settled_bytes(choice, pairs, rule: FactorRule, mesh, results) -> float:
  """:func:`_assignment_bytes` where the results' layouts are settled: a result
  not keeping the op's sum pending is made in ``choice``'s layout and moved to
  its own, the sum resolved on the way, by the exact plan (an all-reduce into
  a result not split over the summed axes), not at the sum's least."""
  red = frozenset(a for f in rule.reduction for a in choice.get(f, ()))
  now = {id(t): d for t, d in zip(results, rule.results) if t is not None
         and t.sharding.partial <= red and not (red and red <= t.sharding.partial)}
  total = _assignment_bytes(choice, [(t, d) for t, d in pairs if id(t) not in now], rule,
                            mesh, [None if id(t) in now else t for t in results])
  for t in (t for t in results if t is not None and id(t) in now):
    made = TensorSharding(tuple(unproject(now[id(t)], choice, rule.size_of, mesh)), red)
    try:
      total += reshard.plan_reshard(made, t.sharding, t.shape, t.dtype, mesh).bytes_per_device
    except (ValueError, TypeError):
      total += nbytes(t)
  return total


def _unpinned_if_cheaper(done: dict, choice: dict, hold, pairs, rule: FactorRule, mesh,
                         results) -> dict:
  """``done``; or, where a result cannot hold every axis ``done`` gives (the
  op would gather one), a factor that took a pinned tensor's axes takes
  another tensor's proposal instead if that sends strictly fewer bytes.

  Pinned support ranks first factor by factor, to carry the pinned layout
  through the op; a pin the op cannot carry costs its own gather:
  ``[4@a, 8@b]`` pinned, reshaped to ``[32@(a,b)]``, keeps ``a`` on the
  first factor and gathers ``b`` (a merged dim split ``a`` then ``b`` is not
  one block per device), where moving ``b`` to the first dim, one
  all-to-all, sends half. A contracted factor, or one the proposal splits
  unevenly, is left as chosen (the byte count prices neither exactly, as in
  :func:`_take_rest`).
  """
  if not _drops_axes(done, rule, mesh):
    return done
  def alternatives():
    for f, axes in done.items():
      if f in rule.reduction or not any(h.fixed and h.proj == choice.get(f) for h in hold[f]):
        continue
      for c in sorted({h.proj for h in hold[f] if not h.fixed and h.proj}):
        if (c == axes or rule.size_of[f] % math.prod(mesh[b] for b in c) != 0
            or any(b not in mesh for b in c)):
          continue
        yield {g: c if g == f else ax[:next((i for i, b in enumerate(ax) if b in c), len(ax))]
               for g, ax in done.items()}
  return _cheapest(done, alternatives(), pairs, rule, mesh, results)


def _other_proposal_if_cheaper(done: dict, choice: dict, hold, pairs, rule: FactorRule,
                               mesh, results) -> dict:
  """``done``; or, where a factor kept fewer axes than it chose (another factor
  took one it wanted first), that factor takes another tensor's proposal on
  axes no other factor holds, if that sends strictly fewer bytes, a sum it
  leaves priced at an all-reduce (its most).

  ``x[:, D@b*a] @ w1[D@a, F@b]``: ``F`` holds ``b``, so ``D`` keeps neither
  axis of ``b*a`` and both operands are gathered (11 KiB); ``D@a`` moves ``x``
  by a permute and a gather over ``b`` (4 KiB) and all-reduces the result over
  ``a`` (4 KiB), as GSPMD does.
  """
  taken = {a for axes in done.values() for a in axes}

  def alternatives():
    for f in rule.factors:
      if f not in choice or done.get(f) == choice[f]:
        continue
      mine = done.get(f, ())
      for c in sorted({h.proj for h in hold[f] if h.proj} - {choice[f], mine}):
        if (any(b not in mesh or (b in taken and b not in mine) for b in c)
            or rule.size_of[f] % math.prod(mesh[b] for b in c) != 0):
          continue
        yield {**done, f: c}
  return _cheapest(done, alternatives(), pairs, rule, mesh, results, resolve=2.0)


def _cheapest(done: dict, alternatives, pairs, rule: FactorRule, mesh, results,
              resolve: float = 1.0) -> dict:
  """``done``, or the first of ``alternatives`` that sends strictly fewer bytes
  than it and than every earlier one (an alternative's sums priced ``resolve``
  times their least, :func:`_assignment_bytes`)."""
  best, least = done, None
  for alt in alternatives:
    if least is None:
      least = _assignment_bytes(done, pairs, rule, mesh, results)
    cost = _assignment_bytes(alt, pairs, rule, mesh, results, resolve)
    if cost < least:
      best, least = alt, cost
  return best


def _drops_axes(done: dict, rule: FactorRule, mesh) -> bool:
  """Whether a result cannot hold an axis ``done`` gives one of its factors (a
  merged dim split by its minor factor while its major one is split only in
  part): the op would gather it."""
  for dims in rule.results:
    held = {a for axes in unproject(dims, done, rule.size_of, mesh) for a in axes}
    if any(a not in held for fs in dims for f in fs for a in done.get(f, ())):
      return True
  return False


def _give(take: dict, f: str, done: dict, owner: dict, tie: bool) -> None:
  """Cut each factor other than ``f`` to its axes in ``take``; the axes it
  gives up are free, or on a ``tie`` left to other constraints."""
  for h, axes in take.items():
    if h != f and axes != done[h]:
      for b in done[h][len(axes):]:
        if tie:
          owner[b] = None
        else:
          owner.pop(b, None)
      done[h] = axes


def _take_rest(f: str, keep: list[str], wanted: Axes, owner, done, rule: FactorRule,
               mesh) -> dict | None:
  """``done`` with factor ``f`` given every axis it still wants (from
  ``len(keep)`` on) and each factor holding one of them cut before it; None
  when that is at most one axis (the one-axis step covers it), an axis is
  left to other constraints, ``f`` is contracted (its result would be a
  partial sum, which the byte count prices only at its least), or the axes
  would not split ``f`` evenly (the result's layout would not be the one
  priced: a dim gets no more shards than elements, an uneven output leaves
  the program even)."""
  rest = wanted[len(keep):]
  if (len(rest) < 2 or f in rule.reduction
      or any(b in owner and owner[b] is None for b in rest)
      or rule.size_of[f] % math.prod(mesh[b] for b in wanted) != 0):
    return None
  out = dict(done)
  for b in rest:
    h = owner.get(b)
    if h is not None and b in out[h]:
      out[h] = out[h][:out[h].index(b)]
  out[f] = tuple(keep) + tuple(rest)
  return out


def _assignment_bytes(choice, pairs, rule: FactorRule, mesh, results=(), resolve=1.0) -> float:
  """Bytes per device to bring every tensor to ``choice`` (refinements free),
  and to resolve the partial sum a split ``sum`` factor leaves in each of the
  ``results`` (at least a reduce-scatter over those axes, ``resolve`` times
  that): an axis given to a contracted dim is not free where it takes the
  place of a batch split."""
  total = 0.0
  reduced = [a for f in rule.reduction for a in choice.get(f, ())]
  if reduced:
    n = math.prod(mesh[a] for a in reduced)
    for t, dims in zip(results, rule.results):
      if t is None:
        continue
      split = math.prod(mesh[a] for axes in unproject(dims, choice, rule.size_of, mesh)
                        for a in axes)
      total += resolve * (n - 1) / n * nbytes(t) / split
  for t, dims in pairs:
    new = TensorSharding(tuple(unproject(dims, choice, rule.size_of, mesh)))
    cur = t.sharding.without_partial()
    if new == cur or (not t.fixed and is_refinement(cur, new)):
      continue
    try:
      total += reshard.plan_reshard(cur, new, t.shape, t.dtype, mesh).bytes_per_device
    except (ValueError, TypeError):
      total += nbytes(t)
  return total


def making_bytes(rule: FactorRule, operands: Sequence[Held | None],
                 results: Sequence[Held | None], t: Held, layout: TensorSharding,
                 mesh) -> float:
  """Bytes per device the op of ``rule`` sends (operands moved, its sum
  resolved, by the settled solve) to make its result ``t`` in ``layout``."""
  results = [view_as(t, layout, range(len(t.shape))) if r is t else view(r) for r in results]
  operands = [view(o) for o in operands]
  choice = solve(rule, operands, results, mesh, settled=True)
  _, pairs = holders(rule, operands, results, mesh)
  return _assignment_bytes(choice, pairs, rule, mesh, results)


def reduced_axes(rule: FactorRule, operands: Sequence[Held | None], mesh,
                 results: Sequence[Held | None] = ()) -> frozenset[str]:
  """Axes of the split ``sum`` factors, as the operands hold them (layouts
  after propagation): the result of the local op is a partial sum over
  these. Where an operand lacks one, the partitioner's solve says whether it
  is gathered instead (:func:`_summed_axes`, given ``results``)."""
  if not rule.reduction:
    return frozenset()
  hold, _ = holders(rule, operands, [], mesh)
  partial: set[str] = set()
  for f in rule.reduction:
    hs = hold[f]
    c = choose(f, hs, rule, mesh) if hs else None
    if c and results and any(not set(c) <= set(h.proj) for h in hs):
      # the axes the settled solve gathers rather than sums
      gathered = (set(solve(rule, operands, results, mesh).get(f, ()))
                  - set(solve(rule, operands, results, mesh, settled=True).get(f, ())))
      c = tuple(a for a in c if a not in gathered)
    partial.update(c or ())
  return frozenset(partial)
