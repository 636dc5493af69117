"""A reshape that cuts a split dim into micro-batches keeps the split on the rows.

``xs = x.reshape(K, B // K, ...)`` of ``x`` split over ``data`` (``n`` devices),
the micro-batches of gradient accumulation: where ``K`` is no multiple of ``n``
(fewer micro-batches than devices, the usual case on a pod), no factor of the
reshape can hold ``data`` (device ``s``'s block of ``B`` rows is part of one
micro-batch, not a block of ``K``). The factor solver drops the split, and the
result would be gathered: every device would compute every micro-batch.

Instead the result takes ``data`` on its minor-most factor ``M = B // K``
(``xs: [K, M@data]``), and the partitioner moves the rows there
(``partition/shape.py``): device ``s``'s block is ``K`` pieces of ``M/n`` rows,
piece ``c`` going to device ``(s*K + c) % n``, where it is micro-batch
``(s*K + c) // n``; ``K`` ppermute rounds, each a permutation of the devices,
send the block's bytes once in all. They run as an exchange
(:func:`exchange_of`: ``exchange.py``'s tables, run by
``collectives.run_exchange`` as a move between layouts is). The transposed
reshape (``[K, M@data] -> [B]``, a backward pass) runs the rounds the other
way and gives ``[B@data]``.

Where ``K`` is a multiple of ``n`` the reshape is free (``xs: [K@data, M]``),
and a scan over the micro-batches would gather ``xs``: a loop over
micro-batches (a scan whose every carry is a sum, its ``xs`` cut from a batch
by a reshape) gives each step's slice the split on its rows instead, and
moves it there with one all-to-all (:func:`propose_scans`).

A Python loop over the micro-batches (``xs[k]`` for each ``k``: a slice of
one micro-batch each; ``micro_batches.py`` turns ``x[k*M:(k+1)*M]`` into
that) is such a loop too: the reshape moves the rows, or, where ``K`` is a
multiple of ``n``, each slice takes the split on its rows (one all-to-all
of ``xs``, shared by the slices).

Both are hints propagation gives after its first phase; the second phase
carries them on. The reshape's only where such a loop reads its
micro-batches (:func:`propose`): a reshape of features (``[3D] -> [3, H,
Dh]``) moved so would split ``Dh`` and sum the attention scores, and a scan
over stacked layers (the activation carried) reads its weights as they come.
Only a dim whose factors cannot hold all its axes moves, and only where ``M``
splits evenly.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
from jax.extend.core import Literal

from gshard.spmd import factors
from gshard.spmd.collectives import is_key
from gshard.spmd.exchange import Exchange
from gshard.spmd.rules.control import accumulators
from gshard.spmd.sharding import Axes, TensorSharding, itemsize


@dataclasses.dataclass(frozen=True)
class Move:
  """A split carried across a reshape by moving rows.

  Attributes:
    axes: the mesh axes of the split (``n`` shards).
    count: ``K``, the micro-batches: the factors before ``M`` in the
      compound dim.
    merge: ``False``: the operand's dim is compound (``[B] -> [K, M]``);
      ``True``: the result's is (``[K, M] -> [B]``).
    compound: the dim (of the operand for a split, of the result for a
      merge) that is ``K*M``.
    rows: the dim of ``M`` (of the result for a split, of the operand for a
      merge).
    before: the dims (on ``rows``'s side) of the factors before ``M``.
  """

  axes: Axes
  count: int
  merge: bool
  compound: int
  rows: int
  before: tuple[int, ...] = ()


def find(rule, eqn, op_dims, mesh) -> Move | None:
  """The move a reshape's rule allows for its operand's split (``op_dims``):
  a split of the operand's compound dim that its factors cannot hold whole
  (``K`` holding a first axis of two is not enough), to the result's dim of
  the minor-most factor; or (``merge``) a split of the operand's ``M`` dim
  to the result's compound dim. None when there is none."""
  if (eqn.primitive.name != "reshape" or eqn.params.get("dimensions") is not None
      or len(rule.operands) != 1 or len(rule.results) != 1):
    return None
  size = rule.size_of
  for merge in (False, True):
    compound, rows = ((rule.results[0], rule.operands[0]) if merge
                      else (rule.operands[0], rule.results[0]))
    for i, fs in enumerate(compound):
      j = [k for k, d in enumerate(rows) if fs[-1] in d]
      if len(fs) < 2 or len(j) != 1 or rows[j[0]] != (fs[-1],):
        continue
      axes = tuple(op_dims[j[0]] if merge else op_dims[i])
      if not axes:
        continue
      n = math.prod(mesh[a] for a in axes)
      held = factors.project([fs], [axes], size, mesh)
      if sum(len(a) for a in held.values()) == len(axes) or size[fs[-1]] % n:
        continue                # the factors hold it all, or M cannot
      # the factors before M: dims of their own (the micro-batch dims)
      before = tuple(k for k, d in enumerate(rows) if set(d) & set(fs[:-1]))
      if not all(set(rows[k]) <= set(fs[:-1]) for k in before):
        continue
      count = math.prod(size[f] for f in fs[:-1])
      if schedule(count, n) is not None:
        return Move(axes, count, merge, i, j[0], before)
  return None


def target_dim(move: Move) -> int:
  """The result's dim that takes the split."""
  return move.compound if move.merge else move.rows


def moved_bytes(bound, layout_of, mesh) -> float | None:
  """Bytes per device the partitioner sends for ``bound`` where it is a
  reshape moving rows (``partition/shape.py``) with its operand and result
  laid out as ``layout_of(tensor)`` says: the ppermute rounds that move
  pieces of the block. None for any other op or layouts (then the generic
  rule's plan prices it); kept to a move alone: no other dim split, no sum
  pending."""
  pair = _one_to_one(bound)
  if pair is None:
    return None
  (u, r), (op, res) = pair, map(layout_of, pair)
  if op.partial or res.partial or is_key(u.dtype):
    return None
  move = find(bound.rule, bound.eqn, op.dims, mesh)
  if move is None:
    return None
  src, dst = (move.rows, move.compound) if move.merge else (move.compound, move.rows)
  if (res.dims[dst] != move.axes or any(a for k, a in enumerate(res.dims) if k != dst)
      or any(a for k, a in enumerate(op.dims) if k != src)):
    return None
  n = math.prod(mesh[a] for a in move.axes)
  if u.shape[src] % n or r.shape[dst] % n:
    return None
  # the block the rows move in: the compound dim's (a merge's after its local reshape)
  shape = tuple(u.shape) if not move.merge else tuple(r.shape)
  block = tuple(m // n if d == move.compound else m for d, m in enumerate(shape))
  return exchange_of(move, block, move.compound, itemsize(u.dtype), n).bytes_per_device


def _one_to_one(b) -> tuple | None:
  """``(operand, result)`` of a reshape bound with one of each; None otherwise."""
  if (b.eqn is None or b.eqn.primitive.name != "reshape" or len(b.operands) != 1
      or len(b.results) != 1 or b.operands[0] is None or b.results[0] is None):
    return None
  return b.operands[0], b.results[0]


def carried(bound, mesh) -> frozenset[str]:
  """The factors whose split ``bound`` (a reshape) carries to its result by
  moving rows (the compound dim's: their tensors disagree there by design,
  no conflict); empty for any other constraint."""
  if bound.eqn is None or len(bound.operands) != 1 or len(bound.results) != 1 or \
      bound.operands[0] is None or bound.results[0] is None:
    return frozenset()
  move = find(bound.rule, bound.eqn, bound.operands[0].sharding.dims, mesh)
  if move is None or bound.results[0].sharding.dims[target_dim(move)] != move.axes:
    return frozenset()
  side = bound.rule.results[0] if move.merge else bound.rule.operands[0]
  return frozenset(side[move.compound])


def _accumulates(eqn) -> bool:
  """Whether ``eqn`` is a loop over micro-batches: a scan whose every carry
  only accumulates (gradient and loss sums) or counts the steps (a
  ``fori_loop``'s counter its body reads, say for a per-step scale). A scan
  over stacked layers carries the activation (an aux-loss sum beside it
  does not make it one)."""
  p = eqn.params
  if eqn.primitive.name != "scan" or p["num_carry"] == 0:
    return False
  body, first = p["jaxpr"].jaxpr, p["num_consts"]
  sums = accumulators(body, first, p["num_carry"])
  return bool(sums) and all(c in sums or _counts(body, first, c)
                           for c in range(p["num_carry"]))


def _counts(body, first: int, c: int) -> bool:
  """Whether carry ``c`` is an integer scalar the body adds 1 to."""
  vin, vout = body.invars[first + c], body.outvars[c]
  if vin.aval.shape or not np.issubdtype(vin.aval.dtype, np.integer):
    return False
  for e in body.eqns:
    if vout in e.outvars:
      return e.primitive.name == "add" and vin in e.invars and any(
          isinstance(v, Literal) and np.issubdtype(np.asarray(v.val).dtype, np.integer)
          and int(v.val) == 1 for v in e.invars)
  return False


def _strip(b, xs: bool):
  """``(outer, inner)`` where ``b`` is a scan's constraint stripping the
  scanned dim of an ``xs`` entering the body (``xs``) or of a ``ys`` leaving
  it; None for any other constraint."""
  if (b.eqn is None or b.eqn.primitive.name != "scan" or len(b.operands) != 1
      or len(b.results) != 1):
    return None
  outer, inner = (b.operands[0], b.results[0]) if xs else (b.results[0], b.operands[0])
  if outer is None or inner is None or len(outer.shape) != len(inner.shape) + 1:
    return None
  return outer, inner


def _scan_strips(graph, touching, t, xs: bool) -> bool:
  """Whether ``t`` is the ``xs`` (``xs``) or ``ys`` of a scan over
  micro-batches (:func:`_accumulates`)."""
  for k in touching.get(id(t), ()):
    pair = _strip(graph.bounds[k], xs)
    if pair is not None and pair[0] is t:
      return _accumulates(graph.bounds[k].eqn)
  return False


def _one_micro_batch(b, t) -> bool:
  """Whether ``b`` is a ``slice`` of one micro-batch of ``t`` (``t[k:k+1]``,
  its other dims whole): a Python loop's read of micro-batch ``k``."""
  if (b.eqn is None or b.eqn.primitive.name != "slice" or len(b.operands) != 1
      or b.operands[0] is not t or not b.results or b.results[0] is None):
    return False
  r = b.results[0]
  return r.shape[:1] == (1,) and tuple(r.shape[1:]) == tuple(t.shape[1:])


def _read_per_micro_batch(graph, touching, t) -> bool:
  """Whether every reader of ``t`` (its maker aside) takes one micro-batch
  (:func:`_one_micro_batch`), and one does: the micro-batches of an unrolled
  loop (``for k in range(K): ... xs[k]``)."""
  readers = [graph.bounds[k] for k in touching.get(id(t), ())
             if not any(r is t for r in graph.bounds[k].results)]
  return bool(readers) and all(_one_micro_batch(b, t) for b in readers)


def _maker(graph, touching, t):
  """The constraint of the equation that makes ``t``, or None."""
  for k in touching.get(id(t), ()):
    b = graph.bounds[k]
    if b.eqn is not None and any(r is t for r in b.results):
      return b
  return None


def _written_per_micro_batch(graph, touching, t) -> bool:
  """Whether ``t`` is a sum of pads of one micro-batch each (``[1, M, ...]``
  padded on dim 0 only), or a concatenation of them on dim 0: the
  cotangent of a Python loop's reads (:func:`_one_micro_batch`), transposed."""
  stack = [t]
  while stack:
    b = _maker(graph, touching, stack.pop())
    name = b.eqn.primitive.name if b is not None else None
    if name == "pad":
      op = b.operands[0]
      ok = (op is not None and op.shape[:1] == (1,) and tuple(op.shape[1:]) == tuple(t.shape[1:])
            and all(tuple(c) == (0, 0, 0) for c in b.eqn.params["padding_config"][1:]))
    elif name == "concatenate":        # split's transpose, stacked (micro_batches.py)
      ok = b.eqn.params["dimension"] == 0 and all(
          o is not None and o.shape[:1] == (1,) and tuple(o.shape[1:]) == tuple(t.shape[1:])
          for o in b.operands)
    elif name in ("add", "add_any") and b.operands:
      ok = all(o is not None and o.shape == t.shape for o in b.operands)
      stack.extend(b.operands if ok else ())
    else:
      ok = False
    if not ok:
      return False
  return True


def propose(graph, touching) -> set[int]:
  """Give the operand's split to each reshape result that came out unsplit
  where a move would split it (after propagation's first phase), where the
  micro-batches are a loop's: the result is the ``xs`` of a scan over the
  micro-batch dim, or read only by slices of one micro-batch (a split); or
  the operand is a scan's ``ys``, or a sum of pads of one micro-batch each
  (a merge: the transposed reshape of a backward pass). A merge whose
  result nothing lays out (a sum of rows reads it) takes the whole split
  of the batch cut into its micro-batches (the reshape of that shape into
  this one), as the batch's own gradient would. The constraints touching a
  changed result. (Elsewhere the partitioner moves rows only where
  something pins the result so.)"""
  mesh = graph.mesh_sizes
  out: set[int] = set()
  for b in graph.bounds:
    if b.eqn is None or len(b.operands) != 1 or len(b.results) != 1:
      continue
    (op,), (res,) = b.operands, b.results
    if op is None or res is None:
      continue
    move = None if is_key(op.dtype) else find(b.rule, b.eqn, op.sharding.dims, mesh)
    if move is None or move.before != (0,) or move.rows != 1 or not (
        (_scan_strips(graph, touching, op, False)
         or _written_per_micro_batch(graph, touching, op)) if move.merge
        else (_scan_strips(graph, touching, res, True)
              or _read_per_micro_batch(graph, touching, res))):
      continue
    dims = _moved_layout(move, res)
    if dims is not None:
      res.sharding = TensorSharding(dims, res.sharding.partial)
      out.update(touching.get(id(res), ()))
  # a merge whose pieces came out unsplit or split on part of the batch's
  # axes (the micro-batches they are made of split only now, or on their
  # rows only later: a slice of one micro-batch takes the rest) and that
  # nothing else lays out: the split of the batch cut into those
  # micro-batches, as that batch's gradient would have (a parameter
  # shifting the batch: its gradient sums the merge's rows)
  reshapes = [b for b in graph.bounds if _one_to_one(b) is not None]
  batches = {(tuple(b.operands[0].shape), tuple(b.results[0].shape)): b.operands[0].sharding.dims[0]
             for b in reshapes if b.operands[0].shape and b.operands[0].sharding.dims[0]}
  for b in reshapes:
    (op,), (res,) = b.operands, b.results
    axes = batches.get((tuple(res.shape), tuple(op.shape)))
    if (axes is None or len(op.shape) < 2 or any(res.sharding.dims[1:])
        or not set(res.sharding.dims[0]) < set(axes) or res.fixed
        or res.sharding.partial or is_key(op.dtype)
        or op.shape[0] * op.shape[1] != res.shape[0] or op.shape[2:] != res.shape[1:]
        or not _written_per_micro_batch(graph, touching, op)):
      continue
    res.sharding = TensorSharding((axes,) + res.sharding.dims[1:])
    out.update(touching.get(id(res), ()))
  return out


def _moved_layout(move: Move, res) -> tuple | None:
  """``res``'s dims with the move's split on its target dim, or None where
  ``res`` is laid out otherwise. The first phase may have given the
  micro-batch dims (the compound dim of a merge) a first axis of the split,
  as far as the factors hold it: that part is taken back, and the whole
  split goes to the rows."""
  d = target_dim(move)
  cur = list(res.sharding.dims)
  undo = [d] if move.merge else list(move.before)
  taken = tuple(a for k in undo for a in cur[k])
  if (taken != move.axes[:len(taken)] or taken == move.axes
      or (not move.merge and cur[d]) or any(k in res.fixed for k in undo + [d])
      or any(set(c) & set(move.axes) for k, c in enumerate(cur) if k not in undo)):
    return None
  for k in undo:
    cur[k] = ()
  cur[d] = move.axes
  return tuple(cur)


def _cut_from_a_batch(graph, touching, t) -> bool:
  """Whether ``t`` is a reshape's result whose leading dim is the leading
  part of one of the operand's dims: micro-batches cut from a batch
  (``x.reshape(K, B // K, ...)``), not stacked weights."""
  for k in touching.get(id(t), ()):
    b = graph.bounds[k]
    if (b.eqn is not None and b.eqn.primitive.name == "reshape" and b.results
        and b.results[0] is t and len(b.rule.results) == 1 and b.rule.results[0]):
      lead = b.rule.results[0][0]
      return any(len(fs) > len(lead) and fs[:len(lead)] == lead
                 for fs in b.rule.operands[0])
  return False


def propose_scans(graph, touching) -> set[int]:
  """A scan that accumulates (every carry a sum, as gradient accumulation's)
  over micro-batches cut from a batch (a reshape's result) split on the
  scanned dim (``K@data``: at least as many micro-batches as devices): each
  step's slice takes the split on its leading dim (the rows, after any split
  they have; where it divides them evenly), so every device computes its
  rows of every step and the sum stays pending round the loop, one psum
  after it; the scan moves the split (one all-to-all) instead of gathering
  ``xs``. Likewise a slice of one micro-batch (``xs[k]``, ``[1, M, ...]``)
  where every reader of ``xs`` is one: it takes the split on its rows. The
  constraints touching a changed slice."""
  mesh = graph.mesh_sizes
  out: set[int] = set()
  for b in graph.bounds:
    pair = _strip(b, xs=True)
    if pair is not None and pair[1].shape and _accumulates(b.eqn):
      (outer, inner), d = pair, 0          # the slice lost the micro-batch dim
    elif b.operands and _one_micro_batch(b, b.operands[0]) and \
        _read_per_micro_batch(graph, touching, b.operands[0]):
      outer, inner, d = b.operands[0], b.results[0], 1    # [1, M, ...]
    else:
      continue
    axes = outer.sharding.dims[0]
    if (not axes or set(axes) & set(inner.sharding.axes) or len(outer.shape) < 2
        or not _cut_from_a_batch(graph, touching, outer)):
      continue
    rows = inner.sharding.dims[d]
    n = math.prod(mesh[a] for a in rows + tuple(axes))
    if rows != outer.sharding.dims[1] or d in inner.fixed or inner.shape[d] % n:
      continue
    dims = list(inner.sharding.dims)
    dims[d] = rows + tuple(axes)
    inner.sharding = TensorSharding(tuple(dims), inner.sharding.partial)
    out.update(touching.get(id(inner), ()))
  return out


@functools.lru_cache(maxsize=1024)
def exchange_of(move: Move, local_shape: tuple[int, ...], dim: int,
                item_bytes: int, n: int) -> Exchange:
  """The move as an exchange (``exchange.py``'s form, run by
  ``collectives.run_exchange``) on a device's block of ``local_shape``
  whose ``dim`` holds its ``K`` pieces: a round whose every piece stays
  where it is is a held slot; each other round a ppermute of one piece per
  device. A merge runs the rounds the other way."""
  piece, dest, sender, lands = schedule(move.count, n)
  if move.merge:
    piece, dest, lands = lands, sender, piece
  rows = local_shape[dim] // move.count
  at = lambda r: tuple(tuple(int(p) * rows if d == dim else 0 for d in range(len(local_shape)))
                       for p in piece[r])
  stay = [r for r in range(move.count) if (dest[r] == np.arange(n)).all()]
  moved = [r for r in range(move.count) if r not in stay]
  slot = {r: i for i, r in enumerate(stay + moved)}
  take = [[0] * move.count for _ in range(n)]
  for r in range(move.count):
    for t in range(n):
      take[t][int(lands[r, t])] = slot[r]
  shape = tuple(rows if d == dim else m for d, m in enumerate(local_shape))
  return Exchange(
      tuple(move.axes), shape,
      tuple(move.count if d == dim else 1 for d in range(len(local_shape))),
      tuple(at(r) for r in stay),
      tuple((tuple((s, int(dest[r, s])) for s in range(n)), at(r)) for r in moved),
      tuple(map(tuple, take)), len(moved) * math.prod(shape) * item_bytes)


@functools.lru_cache(maxsize=256)
def schedule(count: int, n: int):
  """The ppermute rounds of a split move (memoised), or None if they do not
  come out as permutations: per round ``r`` (``count`` of them), for each source
  device ``s`` (linear index over the axes) the piece it sends, the device it
  goes to, and (indexed by the receiver) the micro-batch it lands at."""
  g = math.gcd(count, n)
  src = np.arange(n)
  piece = np.stack([(r + src // (n // g)) % count for r in range(count)])
  dest = (src * count + piece) % n
  if any(sorted(row) != list(range(n)) for row in dest.tolist()):
    return None
  lands = np.empty_like(dest)
  sender = np.empty_like(dest)
  for r in range(count):
    sender[r, dest[r]] = src
    lands[r, dest[r]] = (src * count + piece[r]) // n
  for table in (piece, dest, sender, lands):    # memoised: shared, never written
    table.setflags(write=False)
  return piece, dest, sender, lands
