"""The local plan of one equation: per factor, the mesh axes to compute with.

:func:`plan_local` reads the primitive's factor rule (the one propagation
used) and weighs candidate choices by the bytes their reshards send:
propagation's choice for the whole equation; the operands' own layout
(compute where the data is, then reshard the result: GShard's einsum option
(a)); for a contraction (and a reshape), the result's layout with the
operands moved first (option (c)); for a table lookup or its scatter-add
gradient, and for ``concatenate`` / ``split`` along a split dim, the
operands' layout with a split the op would gather or leave pending moved to
another dim of the same operand first (an all-to-all; the result then moves
back the same way, as GSPMD does). It gives the operand and result
shardings of the cheapest, and a contraction's alternatives with their
bytes for ``explain()`` (:class:`Option`). ``generic.bind_local`` runs a plan.
"""

from __future__ import annotations

import dataclasses
import functools
import math


from gshard.spmd import factors, linearity, registry, reshard
from gshard.spmd.partials import LOOKUPS
from gshard.spmd.partition import windowed_einsum
from gshard.spmd.partition.context import Context, Value
from gshard.spmd.rules import IN, OUT, FactorRule, OpRule
from gshard.spmd.sharding import TensorSharding, fit_axes, itemsize

# ops that cut or join pieces along a dim (blocked from a split): their
# operands' split moves to another dim first where that sends less than a gather
PIECES = frozenset({"concatenate", "split"})
# ops planned in their result's layout too, the operand moved first (as a
# contraction's option (c)): a reshape whose dims' factors propagation
# settled apart (``[2, 16@x*y] -> [32@x*y]``: the 2 took ``x`` from the
# result, the 16 ``x*y`` from the operand) gathered its operand (112 B on a
# 2x4 mesh) where moving it to ``[2@x, 16@y]`` first sends 24
RESULT_FIRST = frozenset({"reshape"})


@dataclasses.dataclass(frozen=True)
class Option:
  """One way to run a contraction or a table lookup per device, and what it sends.

  Attributes:
    label: GShard's name for it: ``(a) compute where the operands are``,
      ``(b) contract the split dim, partial sum`` or ``(c) reshard operands
      first``.
    bytes: bytes per device of its reshards (operands in, results out).
    moves: ``(role, collective kinds and axes)`` of each tensor it reshards.
    chosen: whether the partitioner ran this one.
    memory: bytes per device its operand reshards add (a gathered operand).
  """

  label: str
  bytes: int
  moves: tuple[tuple[str, str], ...]
  chosen: bool = False
  memory: int = 0

  def __str__(self) -> str:
    what = "; ".join(f"{r} {m}" for r, m in self.moves) or "no communication"
    return f"{self.label}: {what}"


@dataclasses.dataclass(frozen=True)
class LocalPlan:
  """How one equation runs per device (``options``: a contraction's or
  lookup's alternatives with their bytes, for ``explain()``)."""

  rule: FactorRule
  choice: dict[str, tuple[str, ...]]
  operands: list[TensorSharding | None]   # None for literals
  results: list[TensorSharding]
  options: tuple[Option, ...] = ()


def factor_rule_of(eqn) -> FactorRule:
  """The factor rule of ``eqn`` (a single-constraint OpRule is unwrapped)."""
  r = registry.rule_of(eqn)
  if isinstance(r, OpRule) and len(r.constraints) == 1:
    c = r.constraints[0]
    if c.operands == tuple(IN(i) for i in range(len(eqn.invars))) and \
        c.results == tuple(OUT(i) for i in range(len(eqn.outvars))):
      r = c.rule
  if not isinstance(r, FactorRule):
    raise TypeError(f"{eqn.primitive.name}: generic partitioning needs a FactorRule")
  return r


@dataclasses.dataclass(frozen=True)
class _In:
  """An operand as the local plan reads it (hashable: the memo's key)."""

  sharding: TensorSharding | None     # None for a literal
  shape: tuple[int, ...]
  dtype: object
  mark: object = None                 # a literal's linearity.ZERO, if the rule reads it
  # layouts its local array was already resharded to in this trace (a
  # forward pass's gathered activation): a plan reading one sends nothing
  have: frozenset = frozenset()


@dataclasses.dataclass(frozen=True)
class _Out:
  """A result as the local plan reads it: its propagated target (None if
  dropped); for a lookup's result left a pending sum, what that sum costs
  where propagation resolves it (``release``, bytes per device)."""

  target: TensorSharding | None
  shape: tuple[int, ...]
  dtype: object
  release: float = 0.0


def plan_local(ctx: Context, eqn, ins: list[Value], scope, *, blocked=frozenset(),
               allow_other_reduction=False) -> LocalPlan:
  """Per-factor axes for the local op, and the operand/result shardings they imply.

  Candidates: the factor axes propagation settled on for the whole
  equation; those its operands hold (compute where the data is, then reshard
  the result: GShard's einsum option (a), which turns a split moving from G
  to E in MoE dispatch into one all-to-all instead of gathering the
  operands); for a contraction and a reshape (RESULT_FIRST), the result's
  (option (c)); for a lookup
  (LOOKUPS) and for an op that cuts or joins pieces along a dim (PIECES), the
  operands' with a split they would lose moved to another of the operand's
  dims (``_relocations``). The one that sends fewer bytes wins; ties go to
  the first.
  Pure in what it reads, so it is memoised (a model's repeated layers are
  planned once).
  """
  rule = factor_rule_of(eqn)
  g = ctx.graph
  operands = tuple(factors.view(g.tensor(scope, v)) for v in eqn.invars)
  results = tuple(factors.view(g.tensor(scope, v)) for v in eqn.outvars)
  marks = rule.linear in linearity.READS_LITERALS
  in_ = tuple(_In(None if v.literal else v.sharding, tuple(v.shape), v.dtype,
                  (linearity.literal_mark(v.x) if v.literal else g.mark_of(scope, var))
                  if marks else None, ctx.held_layouts(v))
              for v, var in zip(ins, eqn.invars))
  lookup = eqn.primitive.name in LOOKUPS
  relocate = lookup or eqn.primitive.name in PIECES
  out = tuple(_Out(None if type(var).__name__ == "DropVar" else ctx.target(scope, var),
                   tuple(var.aval.shape), var.aval.dtype,
                   g.released.get(g.tensor(scope, var), 0.0) if lookup else 0.0)
              for var in eqn.outvars)
  return _planned(rule, in_, operands, results, out, frozenset(blocked),
                  bool(allow_other_reduction), eqn.primitive.name in CONTRACTIONS, relocate,
                  tuple(ctx.mesh_sizes.items()), eqn.primitive.name in RESULT_FIRST)


def _planned(*key) -> LocalPlan:
  """:func:`_plan` of ``key``, memoised where the key hashes (a dtype jax
  cannot hash: planned anew)."""
  try:
    hash(key)
  except TypeError:
    return _plan(*key)
  return _plan_memo(*key)


def plan_of(rule: FactorRule, eqn, operands, results, marks, released,
            mesh, have=None) -> tuple[LocalPlan, tuple, tuple]:
  """:func:`plan_local` before the partition runs: the plan of ``eqn`` (its
  factor ``rule``) from its tensors as propagation holds them or as asked
  (``operands``/``results``: anything with ``sharding``, ``fixed``, ``shape``
  and ``dtype``; None for a literal or a dropped result), ``marks``: each
  operand's linearity mark, ``released``: each result's pending-sum cost (a
  lookup's), ``have``: per operand, the layouts earlier ops moved it to
  (the copies the partitioner reuses; None: none). Memoised with the
  partitioner's plans (one key where the layouts and copies are the
  partitioner's). Returns the plan and what :func:`plan_cost` reads of the
  operands and results."""
  name = eqn.primitive.name
  lookup = name in LOOKUPS
  have = have or (frozenset(),) * len(operands)
  ins = tuple(_In(None if t is None else t.sharding, tuple(v.aval.shape), v.aval.dtype, m, h)
              for t, v, m, h in zip(operands, eqn.invars, marks, have))
  outs = tuple(_Out(None if t is None else t.sharding, tuple(v.aval.shape), v.aval.dtype,
                    r if lookup else 0.0)
               for t, v, r in zip(results, eqn.outvars, released))
  return _planned(rule, ins, tuple(map(factors.view, operands)),
                  tuple(map(factors.view, results)), outs, frozenset(), False,
                  name in CONTRACTIONS, lookup or name in PIECES, tuple(mesh.items()),
                  name in RESULT_FIRST), ins, outs


@functools.lru_cache(maxsize=1 << 15)
def _plan_memo(*key) -> LocalPlan:
  return _plan(*key)


def _plan(rule: FactorRule, ins, operands, results, outs, blocked, allow_other_reduction,
          contraction, relocate, mesh_items, result_first) -> LocalPlan:
  mesh = dict(mesh_items)
  candidates = [factors.solve(rule, operands, results, mesh, settled=True)]
  if any(r is not None for r in results):
    candidates.append(factors.solve(rule, operands, [None] * len(results), mesh))
    if contraction or result_first:   # also in the result's layout, operands moved first
      candidates.append(factors.solve(rule, [None] * len(operands), results, mesh))
  if contraction:
    candidates += _from_copies(rule, ins, operands, len(results), mesh)
  keys = [tuple(sorted(c.items())) for c in candidates]
  made: dict[tuple, LocalPlan] = {}     # a repeated candidate is planned and costed once
  seedable = (frozenset.intersection(*[o.target.partial for o in outs])
              if rule.linear == "sum" and all(o.target is not None for o in outs)
              else frozenset())
  for k, c in zip(keys, candidates):
    if k not in made:
      made[k] = _plan_for(mesh, ins, rule, c, blocked, allow_other_reduction, seedable)
  plans = [made[k] for k in keys]
  base = min(1, len(plans) - 1)          # the operands' own layout
  if len(made) == 1 and not (contraction or relocate):   # one candidate: nothing to weigh
    return plans[0]
  cost = {k: plan_cost(mesh, ins, outs, p) for k, p in made.items()}
  costs = [cost[k] for k in keys]
  # Option (c) runs only where its operand reshards hold no more than those
  # of the plan it competes with (the cheaper of the tensors' own layouts and
  # the operands as they arrive: an all-to-all, where those gather nothing):
  # a gathered weight or activation is memory an expert's layout does not
  # spend (GShard's caveat on (c)).
  grows = [_operand_growth(mesh, ins, p) for p in plans]
  own = min(range(min(2, len(plans))), key=lambda k: (costs[k], k))
  eligible = [k for k in range(len(plans)) if k < 2 or grows[k] <= grows[own]]
  if relocate and min(costs[k] for k in eligible) > 0:
    # Moving an operand's split to another of its dims first (an all-to-all)
    # where the plans above would gather it or leave its sum pending: the
    # FSDP embedding lookup all-to-alls its table from the vocabulary to the
    # feature dim instead of gathering it. Run only where it holds no more
    # per device than the plans it competes with.
    held = min(_footprint(mesh, ins, outs, plans[k]) for k in range(base + 1))
    for c in _relocations(rule, ins, plans[base], candidates[base], blocked, mesh):
      k = tuple(sorted(c.items()))
      if k in made:
        continue
      made[k] = p = _plan_for(mesh, ins, rule, c, blocked, allow_other_reduction)
      if _footprint(mesh, ins, outs, p) <= held:
        plans.append(p)
        costs.append(plan_cost(mesh, ins, outs, p))
        grows.append(_operand_growth(mesh, ins, p))
        eligible.append(len(plans) - 1)
  best = min(eligible, key=lambda k: (costs[k], k))
  if not contraction and len(plans) == len(keys):
    return plans[best]
  options, seen = [], set()
  for k, p in enumerate(plans):
    key = (tuple(p.operands), tuple(p.results))
    if key not in seen and costs[k] < _INFEASIBLE:
      seen.add(key)
      options.append(_option(mesh, ins, outs, p, costs[k], k == best, grows[k]))
  return dataclasses.replace(plans[best], options=tuple(options))


def _from_copies(rule: FactorRule, ins, operands, n_results: int, mesh) -> list[dict]:
  """Choices solved with one operand read in the layout of a copy an earlier
  op left of it (the forward's gathered activation, read again by the weight
  gradient's dot), the results free: that operand then sends nothing, where
  solving from its propagated layout can split a factor the copy does not,
  gather the other operand and move the result (GSPMD reads the copy: XLA
  merges the two gathers)."""
  out = []
  for n, (v, o) in enumerate(zip(ins, operands)):
    for h in sorted(v.have, key=str):
      if o is not None and not h.partial:
        seen = list(operands)
        seen[n] = factors.view_as(o, h, o.fixed)
        out.append(factors.solve(rule, seen, [None] * n_results, mesh))
  return out


def _relocations(rule: FactorRule, ins, plan: LocalPlan, choice, blocked, mesh):
  """Choices that move the axes an operand loses under ``plan`` (gathered,
  or split on a summed factor: a pending sum) to another of its dims: a free
  factor, not summed, that those axes divide."""
  sizes = rule.size_of
  taken = {f for f, axes in choice.items() if axes}
  skip = rule.blocked | rule.reduction | rule.other_reduction | frozenset(blocked)
  for v, dims, s in zip(ins, rule.operands, plan.operands):
    if s is None or v.sharding is None:
      continue
    for d, (held, fs) in enumerate(zip(v.sharding.dims, dims)):
      lost = tuple(a for a in held if a not in s.dims[d] or fs[0] in rule.reduction)
      if not lost or len(fs) != 1:
        continue
      n = math.prod(mesh[a] for a in lost)
      for other in dims:
        g = other[0]
        if len(other) != 1 or g in skip or g in taken or g == fs[0] or sizes[g] % n:
          continue
        yield {**{f: tuple(a for a in axes if a not in lost) for f, axes in choice.items()},
               g: lost}


def _held(t, s: TensorSharding, mesh) -> int:
  """Bytes per device of ``t`` (shape, dtype) laid out as ``s``."""
  return math.prod(s.local_shape(t.shape, mesh)) * itemsize(t.dtype)


def _footprint(mesh, ins, outs, plan: LocalPlan) -> int:
  """Bytes per device the local op holds: its operands and results."""
  pairs = list(zip(ins, plan.operands)) + list(zip(outs, plan.results))
  return sum(_held(t, s, mesh) for t, s in pairs if s is not None)


def _operand_growth(mesh, ins, plan: LocalPlan) -> int:
  """Bytes per device the plan's operand reshards add to what arrives (none
  for a layout the operand already has a copy in)."""
  return sum(max(0, _held(v, s, mesh) - _held(v, v.sharding, mesh))
             for v, s in zip(ins, plan.operands)
             if s is not None and v.sharding != s and not copied(v, s, mesh))


def note_options(ctx: Context, eqn, plan: LocalPlan, ins: list[Value],
                 window: windowed_einsum.Window | None = None) -> None:
  """Record a contraction's or lookup's alternatives, when it had any, for
  ``explain()``. With a ``window``, the ring is the option chosen; the plan's collective is
  listed beside it with what it would hold."""
  options = plan.options
  if window is not None:
    # the collective the ring replaces holds, at a time, the gathered operand
    # or the whole partial result: what windowed_einsum.choose weighed the
    # ring's own holding against
    chosen = next((o for o in options if o.chosen), None)
    options = tuple(dataclasses.replace(o, chosen=False, memory=window.gathered)
                    if o.chosen else o for o in options) + (_ring_option(window, chosen),)
  if len(options) > 1:
    ctx.note_choice(eqn, options, ins, plan.results if window is None else window.results)


def _ring_option(window: windowed_einsum.Window, chosen: Option | None) -> Option:
  """The windowed einsum ``window`` as an option: the plan's option
  ``chosen`` with its gather (or reduce-scatter) run as ``n-1``
  collective-permutes, the same bytes, holding ``window.held``."""
  if window.kind == "gather":
    label, role = "(c) windowed einsum: ring of blocks", f"operand {window.operand}"
  else:
    label, role = "(b) windowed einsum: ring of partial sums", "result 0"
  ring = f"collective_permute[{','.join(window.axes)}] x{window.n - 1}"
  moves = tuple((r, ring if r == role else m) for r, m in (chosen.moves if chosen else ()))
  if role not in (r for r, _ in moves):
    moves += ((role, ring),)
  return Option(label, chosen.bytes if chosen else 0, moves, True, window.held)


def _option(mesh, ins, outs, plan: LocalPlan, cost: int, chosen: bool, grow: int) -> Option:
  """``plan`` described as one of GShard's einsum options."""
  moves = []
  pairs = [(f"operand {j}", v.sharding, s, v) for j, (v, s) in enumerate(zip(ins, plan.operands))
           if s is not None and v.sharding != s]
  kept = []
  for j, (o, s) in enumerate(zip(outs, plan.results)):
    if o.target is not None:
      dst, later = _result_target(o, s)
      if dst != s:
        pairs.append((f"result {j}", s, dst, o))
      if later:
        axes = ",".join(sorted(s.partial & o.target.partial))
        kept.append((f"result {j}", f"psum[{axes}] downstream"))
  for role, src, dst, t in pairs:
    try:
      steps = reshard.plan_reshard(src, dst, t.shape, t.dtype, mesh).collectives
    except ValueError:
      continue
    if steps and dst in getattr(t, "have", ()):
      moves.append((role, "its copy resharded earlier (sends nothing)"))
    elif steps:
      moves.append((role, " + ".join(f"{x.kind}[{','.join(x.axes)}]" for x in steps)))
  moves += kept
  if any(plan.choice.get(f) for f in plan.rule.reduction):
    label = "(b) contract the split dim, partial sum"
  elif any(role.startswith("operand") for role, _ in moves):
    label = "(c) reshard operands first"
  else:
    label = "(a) compute where the operands are"
  return Option(label, cost, tuple(moves), chosen, grow)


_INFEASIBLE = 1 << 62
# Sums over a factor two operands share, where GShard's three einsum options
# apply (a gather's sum factor is a masked lookup; its own moves are LOOKUPS').
CONTRACTIONS = frozenset({"dot_general", "conv_general_dilated"})


def _result_target(o: _Out, s: TensorSharding) -> tuple[TensorSharding, float]:
  """Where result ``s`` goes (its target), and the bytes its pending sum costs
  downstream when the plan leaves it pending. A lookup whose sum propagation
  left pending (``o.release``) may instead give a complete value: the target
  less the axes it does not sum over (a reshard never creates a pending sum;
  the consumers get the value complete and send nothing for it)."""
  if not o.release:
    return o.target, 0.0
  # the sum propagation weighed (over all the target's pending axes); a plan
  # leaving fewer of them pending is charged nothing for them (less than
  # they cost, never more: the move is not favoured by a guess)
  later = o.release if o.target.partial <= s.partial else 0.0
  return o.target.with_partial(o.target.partial & s.partial), later


def copied(v, s: TensorSharding, mesh) -> bool:
  """Whether operand ``v`` (an ``_In``) has a copy ``s`` cuts without
  communicating: an earlier reshard to ``s``, or to a layout ``s`` only
  slices (``Context.reshard`` reuses either)."""
  return s in v.have or (not s.partial and any(
      reshard.cut_from(h, s, v.shape, v.dtype, mesh) for h in v.have))


def plan_cost(mesh, ins, outs, plan: LocalPlan) -> int:
  """Bytes per device to reshard operands into ``plan`` and results out of it
  (and a lookup's pending sum where it is resolved downstream)."""
  total = 0
  for v, s in zip(ins, plan.operands):
    if s is not None and v.sharding != s:   # seeding (partial v lacks) sends nothing
      s = s.with_partial(s.partial & v.sharding.partial)
      if not copied(v, s, mesh):            # (an earlier copy is reused)
        total += reshard.plan_reshard(v.sharding, s, v.shape, v.dtype, mesh).bytes_per_device
  for o, s in zip(outs, plan.results):
    if o.target is None:
      continue
    dst, later = _result_target(o, s)
    total += later
    if dst != s:
      try:
        total += reshard.plan_reshard(s, dst, o.shape, o.dtype, mesh).bytes_per_device
      except ValueError:   # would need to create a partial sum: not a candidate
        return _INFEASIBLE
  return int(total)


def _plan_for(mesh, ins, rule: FactorRule, choice, blocked, allow_other_reduction,
              seedable=frozenset()) -> LocalPlan:
  choice = dict(choice)
  sizes = rule.size_of
  compound = {f for dims in rule.operands + rule.results for d in dims if len(d) > 1
              for f in d}
  for f in rule.factors:
    axes = list(choice.get(f, ()))
    if f in rule.blocked or f in blocked or (
        f in rule.other_reduction and not allow_other_reduction):
      axes = []
    # An uneven split is padded; a factor inside a compound dim must be even.
    if f in compound:
      axes = fit_axes(axes, sizes[f], mesh)
    choice[f] = tuple(axes)
  _drop_inexpressible(choice, [d for v, d in zip(ins, rule.operands) if v.sharding is not None]
                      + list(rule.results), sizes, mesh)
  # A pending partial sum passes through a linear op; otherwise it is resolved.
  partials = [v.mark if v.sharding is None or v.mark is not None else v.sharding.partial
              for v in ins]
  passes = any(partials) and all(linearity.lets_through(rule.linear, partials, i)
                                 for i, p in enumerate(partials) if p)
  pend = [None if v.sharding is None else v.sharding.partial for v in ins]
  seeds = _seeds(rule, ins, seedable) if not passes else frozenset()
  if seeds:   # the complete operands of a sum seeded as pending: no communication
    passes, pend = True, [seeds] * len(ins)
  op_dims = [None if v.sharding is None else tuple(factors.unproject(dims, choice, sizes, mesh))
             for v, dims in zip(ins, rule.operands)]
  res_dims = [tuple(factors.unproject(dims, choice, sizes, mesh)) for dims in rule.results]
  split_axes = {a for d in op_dims + res_dims if d is not None for x in d for a in x}
  if passes:
    # A pending sum passes only where no operand or result is split over its
    # axes: x * sum(x) with x split over them would multiply each block of x
    # by a device's partial sum. Otherwise it is resolved first.
    carried = frozenset().union(*[p - {a for x in d for a in x}
                                  for p, d in zip(pend, op_dims) if d is not None])
    passes = not carried & split_axes
  operands: list[TensorSharding | None] = []
  for p, d in zip(pend, op_dims):
    if d is None:
      operands.append(None)
      continue
    used = {a for x in d for a in x}
    partial = (p - used) if passes else frozenset()
    operands.append(TensorSharding(d, partial))
  carried = frozenset().union(*[o.partial for o in operands if o is not None])
  reduced = frozenset(a for f in rule.reduction for a in choice.get(f, ()))
  results = [TensorSharding(d, (carried | reduced) - {a for x in d for a in x})
             for d in res_dims]
  return LocalPlan(rule, choice, operands, results)


def _seeds(rule: FactorRule, ins, seedable) -> frozenset:
  """The pending axes a sum's complete operands may be seeded over (kept on
  the first device of each group, zeros elsewhere: ``seed``) so that its
  result stays pending where propagation wants it pending: one pending
  operand set ``P`` within ``seedable`` (the results' targets), the others
  complete arrays. This is where a partitioner's plan gave a complete value
  where propagation left a sum pending (a lookup whose table moved): its
  consumer keeps the sum pending instead of resolving its other operands."""
  if rule.linear != "sum" or not seedable or any(
      v.sharding is None or v.mark is not None for v in ins):
    return frozenset()
  pending = {v.sharding.partial for v in ins} - {frozenset()}
  if len(pending) != 1:
    return frozenset()
  (p,) = pending
  return p if p <= seedable else frozenset()


def _drop_inexpressible(choice, tensors, sizes, mesh_sizes) -> None:
  """Unsplit each factor that some operand or result cannot hold as chosen.

  A compound dim holds its minor factor's split only when its major factors
  are split fully: reshape ``f32[2,8] -> f32[16]`` (``ab->(ab)``) with ``b``
  over 8 devices would leave the operand ``[_,x]`` but the result unsplit,
  and the local reshape ``(2,1) -> (16,)`` would be wrong. Edits ``choice``.
  """
  changed = True
  while changed:
    changed = False
    for dims in tensors:
      got = factors.project(dims, factors.unproject(dims, choice, sizes, mesh_sizes), sizes, mesh_sizes)
      for f in sorted({f for d in dims for f in d}):
        if choice.get(f) and got.get(f, ()) != choice[f]:
          choice[f] = ()
          changed = True
