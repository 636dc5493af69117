"""Loops over micro-batches read them from the batch reshaped to ``[K, M, ...]``.

Gradient accumulation reads micro-batch ``k`` of a batch ``x`` of ``K*M`` rows
in three common ways: ``xs = x.reshape(K, M, ...)`` scanned over (MaxText's
form), a ``fori_loop`` reading ``lax.dynamic_slice_in_dim(x, i * M, M)``, and
a Python loop over ``x[k*M:(k+1)*M]``. The first keeps the batch's split
over ``data`` on the micro-batch rows (``relayout.py``): each device computes
its rows of every micro-batch, and the gradient sum stays pending. The other
two are rewritten into reads of the reshaped batch before propagation, so
they get the same layout:

- **A fori_loop.** With static bounds jax traces it as a ``scan`` of ``K``
  steps carrying the counter, ``x`` a loop constant read by a
  ``dynamic_slice`` at ``i * M``. Split over ``data``, each step's slice was
  a masked read and a psum of the micro-batch (twice the bytes of gathering
  ``x`` once), and every device computed every row. It becomes a scan over
  ``xs = x.reshape(K, M, ...)`` (:func:`_as_xs`). It applies only to that
  form: a scan that is not reversed, whose carries are one counter (from a
  literal 0, plus 1 a step, read by nothing after the loop) and sums
  (``rules.control.accumulators``), reading a loop constant's leading dim of
  ``K*M`` rows at ``counter * M`` (jax's wrap of a negative start around
  it), ``M`` rows, its other dims whole. The counter goes where nothing else
  reads it; a constant something else reads stays a constant too.
- **Static slices.** ``x[k*M:(k+1)*M]`` for every ``k`` of ``K >= 2`` (the
  slices tile the leading dim; their other dims whole) become
  ``x.reshape(K, M, ...)[k]`` (:func:`_tilings`). A split over ``data`` was
  gathered before, and every device computed every row. Their transpose (a
  gradient of ``x``: a sum of pads of each micro-batch's cotangent into
  ``[K*M, ...]``) is summed on ``[K, M, ...]`` and reshaped once
  (:func:`_pad_sums`), where each pad of a split micro-batch gathered it.
  ``jnp.split(x, K)`` of the leading dim into equal pieces is read the same
  way; its transpose, a concatenate of equal pieces on the leading dim,
  becomes the pieces stacked on ``[K, M, ...]`` and reshaped once. Only a
  batch is read so (:func:`_batches`: the program's inputs, an inner
  program's too, and values made of one row by row, such as a cast to
  bf16), and only pads and concatenates into such a batch's shape, in its
  micro-batches, are rewritten: other equal splits and concatenates (halves
  of an activation, a fused projection's weights) are no loop over
  micro-batches.

Step ``t`` (slice ``k``) reads the same rows either way, and no start is
clamped, so the values are the same. Programs inside ``jax.jit`` and loops
are rewritten as well.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, DropVar, Literal, Var

from gshard.spmd.partition import plan
from gshard.spmd.rules.control import accumulators
from gshard.spmd.updates import passes


def reshaped_reads(closed: ClosedJaxpr) -> ClosedJaxpr:
  """``closed`` with each loop over micro-batches reading them from the
  reshaped batch (see the module); ``closed`` itself where there is none."""
  jaxpr = _rewrite(closed.jaxpr)
  return closed if jaxpr is closed.jaxpr else ClosedJaxpr(jaxpr, closed.consts)


def _rewrite(jaxpr):
  read = {v for e in jaxpr.eqns for v in e.invars if not isinstance(v, Literal)}
  read.update(v for v in jaxpr.outvars if not isinstance(v, Literal))
  inputs = _batches(jaxpr)
  tiled, reshaped = _tilings(jaxpr, inputs), {}
  families = _families(jaxpr, tiled, inputs)
  sums, pieces = _pad_sums(jaxpr, families), {}
  eqns, changed = [], False
  for eqn in jaxpr.eqns:
    if id(eqn) in sums:
      eqns.extend(_as_pieces(eqn, *sums[id(eqn)], pieces))
      changed = True
      continue
    if id(eqn) in tiled:
      x = eqn.invars[0]
      rows = tiled[id(eqn)]
      if x not in reshaped:
        reshaped[x] = Var(x.aval.update(shape=(x.aval.shape[0] // rows, rows)
                                        + tuple(x.aval.shape[1:])))
        eqns.append(_reshape(x, reshaped[x], eqn))
      eqns.extend(_index(reshaped[x], eqn.params["start_indices"][0] // rows, eqn,
                         eqn.outvars[0]))
      changed = True
      continue
    rows = _equal_split(eqn, inputs)
    if rows:                   # jnp.split(x, K): the K slices at once
      x = eqn.invars[0]
      xs = Var(x.aval.update(shape=(x.aval.shape[0] // rows, rows) + tuple(x.aval.shape[1:])))
      eqns.append(_reshape(x, xs, eqn))
      for k, out in enumerate(eqn.outvars):
        eqns.extend(_index(xs, k, eqn, out))
      changed = True
      continue
    if _equal_concatenate(eqn, families):   # split's transpose: stacked, reshaped once
      eqns.extend(_stacked(eqn))
      changed = True
      continue
    new = _inner(eqn)
    if new.primitive.name == "scan":
      new = _as_xs(new, eqns, read)
    changed |= new is not eqn
    eqns.append(new)
  return jaxpr.replace(eqns=eqns) if changed else jaxpr


def _reshapeable(x) -> bool:
  """A variable of an array dtype (not a PRNG key's) with a leading dim."""
  return (not isinstance(x, Literal) and bool(getattr(x.aval, "shape", ()))
          and not jax.dtypes.issubdtype(x.aval.dtype, jax.dtypes.extended))


def _batches(jaxpr) -> set:
  """The program's inputs (or an inner program's), and the values made of
  one by ops passing its layout on (a cast to bf16, ``x / 255``, ``x -
  mean``, ``x * mask``): each row of theirs is made of that row of a batch."""
  out = set(jaxpr.invars)
  for e in jaxpr.eqns:
    if len(e.outvars) != 1 or not any(
        not isinstance(v, Literal) and v in out for v in e.invars):
      continue
    try:
      rule = plan.factor_rule_of(e)
    except (TypeError, NotImplementedError):
      continue
    if any(not isinstance(v, Literal) and v in out and passes(rule, n)
           for n, v in enumerate(e.invars)):
      out.add(e.outvars[0])
  return out


def _tilings(jaxpr, inputs: set) -> dict:
  """``id(slice eqn) -> M`` for the ``slice`` readers of ``M >= 2`` rows that
  tile the leading dim of a batch of ``inputs`` (every ``[k*M, (k+1)*M)``
  read, ``K >= 2``, the other dims whole, no strides). Its other slices
  (strided, of some columns) stay as they are. Slices of one row (``xs[k]``)
  already read the micro-batches of a reshaped batch. Only a batch
  (:func:`_batches`): halves of an activation (a contrastive loss's ``a,
  b``) are no micro-batches: a second reader found them moved to their rows
  only to be multiplied together (1344 -> 1600 B)."""
  readers: dict = {}
  for e in jaxpr.eqns:
    x = e.invars[0] if e.primitive.name == "slice" else None
    if x is None or not _reshapeable(x) or x not in inputs:
      continue
    start, limit, strides = (e.params["start_indices"], e.params["limit_indices"],
                             e.params["strides"])
    if (not any(start[1:]) and tuple(limit[1:]) == tuple(x.aval.shape[1:])
        and (strides is None or all(s == 1 for s in strides))):
      readers.setdefault(x, []).append((start[0], limit[0] - start[0], id(e)))
  out = {}
  for x, pieces in readers.items():
    rows, n = pieces[0][1], x.aval.shape[0]
    if (rows >= 2 and n % rows == 0 and n // rows >= 2 and all(m == rows for _, m, _ in pieces)
        and {s for s, _, _ in pieces} == set(range(0, n, rows))):
      out.update({e: rows for _, _, e in pieces})
  return out


def _pad_piece(e):
  """``(K, M, k)`` where ``e`` pads its operand ``[M, ...]`` with zeros into
  rows ``[k*M, (k+1)*M)`` of ``[K*M, ...]`` (dim 0 only, ``K >= 2``, ``M >=
  2``): the transpose of a read of micro-batch ``k``. None otherwise."""
  if e.primitive.name != "pad" or not _reshapeable(e.invars[0]):
    return None
  zero, config = e.invars[1], e.params["padding_config"]
  (lo, hi, interior), n, m = config[0], e.outvars[0].aval.shape[0], e.invars[0].aval.shape[0]
  if (not isinstance(zero, Literal) or np.any(np.asarray(zero.val) != 0) or interior
      or any(tuple(c) != (0, 0, 0) for c in config[1:]) or m < 2 or lo < 0 or hi < 0
      or lo % m or n % m or n // m < 2):
    return None
  return n // m, m, lo // m


def _pad_sums(jaxpr, families) -> dict:
  """``id(eqn) ->`` how it is rewritten, for each ``add_any`` tree summing
  pads of micro-batches (:func:`_pad_piece`; the cotangent of a Python loop's
  reads, as jax transposes them): each pad into ``[K, M, ...]`` instead, the
  sums there, one reshape to ``[K*M, ...]`` at the root. Values inside a
  tree are read by their parent alone."""
  uses: dict = {}
  for e in jaxpr.eqns:
    for v in e.invars:
      if not isinstance(v, Literal):
        uses[v] = uses.get(v, 0) + 1
  for v in jaxpr.outvars:
    if not isinstance(v, Literal):
      uses[v] = uses.get(v, 0) + 1
  family, node = {}, {}         # value -> (K, M); a sum's value -> its eqn
  for e in jaxpr.eqns:
    piece = _pad_piece(e)
    if piece is not None and (tuple(e.outvars[0].aval.shape), piece[1]) in families:
      family[e.outvars[0]] = piece[:2]
    elif (e.primitive.name == "add_any" and len(e.invars) == 2
          and all(not isinstance(v, Literal) and v in family and uses.get(v) == 1
                  for v in e.invars)
          and family[e.invars[0]] == family[e.invars[1]]):
      family[e.outvars[0]] = family[e.invars[0]]
      node[e.outvars[0]] = e
  out, producer = {}, _producer(jaxpr)
  inner = {v for e in node.values() for v in e.invars}
  for root, e in node.items():
    if root in inner:
      continue
    stack = [e]
    while stack:
      cur = stack.pop()
      out[id(cur)] = (family[root], cur is e)
      for v in cur.invars:
        if v in node:
          stack.append(node[v])
        else:                          # a pad
          out[id(producer[v])] = (family[root], False)
  return out


def _as_pieces(e, family, root: bool, pieces: dict) -> list:
  """``e`` (a pad or sum of :func:`_pad_sums`) on ``[K, M, ...]``; at the
  root, reshaped back to its own value. ``pieces``: a tree's values so far
  -> their ``[K, M, ...]`` values."""
  count, rows = family
  old = e.outvars[0]
  shape = (count, rows) + tuple(old.aval.shape[1:])
  new = Var(old.aval.update(shape=shape))
  if e.primitive.name == "pad":
    x = e.invars[0]
    one = Var(x.aval.update(shape=(1,) + tuple(x.aval.shape)))
    k = e.params["padding_config"][0][0] // rows
    out = [_reshape(x, one, e), e.replace(invars=[one, e.invars[1]], outvars=[new], params=dict(
        e.params, padding_config=((k, count - 1 - k, 0), (0, 0, 0))
        + tuple(e.params["padding_config"][1:])))]
  else:
    out = [e.replace(invars=[pieces.pop(v) for v in e.invars], outvars=[new])]
  if root:
    out.append(_reshape(new, old, e))
  else:
    pieces[old] = new
  return out


def _equal_split(e, inputs) -> int:
  """``M`` where ``e`` is ``jnp.split(x, K)`` of a batch (:func:`_tilings`)
  on the leading dim into ``K >= 2`` pieces of ``M >= 2`` rows; 0 otherwise."""
  if (e.primitive.name != "split" or e.params["axis"] != 0 or not _reshapeable(e.invars[0])
      or e.invars[0] not in inputs):
    return 0
  sizes = {int(n) for n in e.params["sizes"]}
  rows = sizes.pop() if len(sizes) == 1 else 0
  return rows if rows >= 2 and len(e.outvars) >= 2 else 0


def _families(jaxpr, tiled, inputs) -> set:
  """``(shape, M)`` of each input read as micro-batches here (by slices or
  ``jnp.split``): the layouts a transpose's concatenate or pads may take."""
  out = set()
  for e in jaxpr.eqns:
    rows = tiled.get(id(e)) or _equal_split(e, inputs)
    if rows:
      out.add((tuple(e.invars[0].aval.shape), rows))
  return out


def _equal_concatenate(e, families) -> bool:
  """Whether ``e`` concatenates ``K >= 2`` pieces of ``M >= 2`` rows each on
  the leading dim, into the shape of an input read as micro-batches of ``M``
  rows (split's transpose). Other concatenates stay: weights concatenated
  into a fused projection were moved to their rows (1156 -> 2692 B)."""
  if (e.primitive.name != "concatenate" or e.params["dimension"] != 0 or len(e.invars) < 2
      or not all(_reshapeable(v) for v in e.invars)):
    return False
  shapes = {tuple(v.aval.shape) for v in e.invars}
  piece = shapes.pop() if len(shapes) == 1 else (0,)
  return (tuple(e.outvars[0].aval.shape), piece[0]) in families


def _stacked(e) -> list:
  """``e``'s result as its pieces stacked (``[K, M, ...]``: each reshaped
  to ``[1, M, ...]``, concatenated) and reshaped once."""
  pieces, ones = [], []
  for v in e.invars:
    one = Var(v.aval.update(shape=(1,) + tuple(v.aval.shape)))
    pieces.append(_reshape(v, one, e))
    ones.append(one)
  old = e.outvars[0]
  stacked = Var(old.aval.update(shape=(len(ones),) + tuple(e.invars[0].aval.shape)))
  return pieces + [e.replace(invars=ones, outvars=[stacked]), _reshape(stacked, old, e)]


def _index(xs, k: int, like, out) -> list:
  """``out = xs[k]``: a slice of one micro-batch, then a squeeze (at
  ``like``'s source line)."""
  shape = tuple(xs.aval.shape)
  one = Var(xs.aval.update(shape=(1,) + shape[1:]))
  probe = _probe_index(shape, xs.aval.dtype)
  where = dict(source_info=like.source_info, ctx=like.ctx)
  cut = dict(probe[0].params, start_indices=(k,) + (0,) * (len(shape) - 1),
             limit_indices=(k + 1,) + shape[1:])
  return [probe[0].replace(invars=[xs], outvars=[one], params=cut, **where),
          probe[1].replace(invars=[one], outvars=[out], **where)]


def _inner(eqn):
  """``eqn`` with its inner programs (``jax.jit``'s, a loop's body) rewritten."""
  params = {}
  for k, v in eqn.params.items():
    if isinstance(v, ClosedJaxpr):
      new = reshaped_reads(v)
      if new is not v:
        params[k] = new
  return eqn.replace(params={**eqn.params, **params}) if params else eqn


def _counter(eqn, read) -> int | None:
  """The carry (index among the carries) that counts the steps from 0, read by
  nothing after the loop (not in ``read``); None if none."""
  p = eqn.params
  body, nc = p["jaxpr"].jaxpr, p["num_consts"]
  for c in range(p["num_carry"]):
    init, vin, vout = eqn.invars[nc + c], body.invars[nc + c], body.outvars[c]
    if not (isinstance(init, Literal) and np.ndim(init.val) == 0
            and np.issubdtype(np.asarray(init.val).dtype, np.integer) and int(init.val) == 0
            and eqn.outvars[c] not in read):
      continue
    step = _producer(body).get(vout)
    if (step is not None and step.primitive.name == "add" and vin in step.invars
        and any(_literal(v, 1) for v in step.invars)):
      return c
  return None


def _literal(v, value: int) -> bool:
  """Whether ``v`` is the integer literal ``value`` (a float one is not)."""
  return (isinstance(v, Literal) and np.ndim(v.val) == 0
          and np.issubdtype(np.asarray(v.val).dtype, np.integer) and int(v.val) == value)


def _exact(v, n: int) -> bool:
  """Whether ``v`` is an integer holding every value up to ``n`` (none wraps)."""
  dtype = getattr(v.aval, "dtype", None)
  return (dtype is not None and np.issubdtype(dtype, np.integer)
          and np.iinfo(dtype).max >= n)


def _producer(jaxpr) -> dict:
  return {v: e for e in jaxpr.eqns for v in e.outvars}


def _follow(v, producer, n: int):
  """``v`` through dtype conversions, every value on the way an integer
  holding ``0 .. n`` (:func:`_exact`); None where one could wrap or round."""
  while True:
    if isinstance(v, Literal) or not _exact(v, n):
      return None
    e = producer.get(v)
    if e is None or e.primitive.name != "convert_element_type":
      return v
    v = e.invars[0]


def _start_of(v, producer, counter, rows: int, n: int) -> bool:
  """Whether start index ``v`` is ``counter * rows``, in integers that hold
  every start up to ``n`` (under jax's wrap of a negative start:
  ``select_n(s < 0, s, s + n)``, whose second branch a count from 0 never
  takes)."""
  v = _follow(v, producer, n)
  e = producer.get(v) if v is not None else None
  if e is not None and e.primitive.name == "select_n" and len(e.invars) == 3:
    test = producer.get(e.invars[0])
    s = _follow(e.invars[1], producer, n)
    if (s is None or test is None or test.primitive.name != "lt"
        or _follow(test.invars[0], producer, n) is not s or not _literal(test.invars[1], 0)):
      return False
    v, e = s, producer.get(s)
  if e is None or e.primitive.name != "mul":
    return False
  a, b = e.invars
  if isinstance(a, Literal):
    a, b = b, a
  return _literal(b, rows) and _follow(a, producer, n) is counter


def _slices(eqn, counter: int) -> dict:
  """Body const index -> ``(rows, [dynamic_slice eqns])``: the constants read
  as micro-batches of ``rows`` rows by the counter."""
  p = eqn.params
  body, nc, K = p["jaxpr"].jaxpr, p["num_consts"], p["length"]
  producer = _producer(body)
  cvar = body.invars[nc + counter]
  consts = {v: i for i, v in enumerate(body.invars[:nc])}
  found: dict = {}
  for e in body.eqns:
    if (e.primitive.name != "dynamic_slice" or not _reshapeable(e.invars[0])
        or e.invars[0] not in consts):
      continue
    shape, sizes = e.invars[0].aval.shape, e.params["slice_sizes"]
    rows = sizes[0] if shape else 0
    if (not shape or rows * K != shape[0] or tuple(sizes[1:]) != tuple(shape[1:])
        or not all(_literal(s, 0) for s in e.invars[2:])
        or not _start_of(e.invars[1], producer, cvar, rows, shape[0])):
      continue
    i = consts[e.invars[0]]
    if found.get(i, (rows,))[0] == rows:
      found.setdefault(i, (rows, []))[1].append(e)
  return found


def _as_xs(eqn, outer: list, read):
  """The scan ``eqn`` with its micro-batch slices read as ``xs`` (a reshape
  of each constant appended to ``outer``), its counter dropped where nothing
  else reads it; ``eqn`` itself where it is no such loop."""
  p = eqn.params
  if p["reverse"] or p["num_carry"] < 2:
    return eqn
  counter = _counter(eqn, read)
  if counter is None:
    return eqn
  nc, ncar, K = p["num_consts"], p["num_carry"], p["length"]
  body = p["jaxpr"].jaxpr
  if accumulators(body, nc, ncar) != frozenset(range(ncar)) - {counter}:
    return eqn
  found = _slices(eqn, counter)
  if not found:
    return eqn
  subst, new_in, new_outer, gone = {}, [], [], set()
  for i, (rows, reads) in sorted(found.items()):
    x = eqn.invars[i]
    shape = tuple(x.aval.shape)
    xs_var = Var(x.aval.update(shape=(K, rows) + shape[1:]))
    new_outer.append(_reshape(x, xs_var, reads[0]))
    step = Var(reads[0].outvars[0].aval)
    new_in.append((xs_var, step))
    for e in reads:
      subst[e.outvars[0]] = step
      gone.add(id(e))
  eqns = [e.replace(invars=[subst.get(v, v) if not isinstance(v, Literal) else v
                            for v in e.invars])
          for e in body.eqns if id(e) not in gone]
  outvars = [subst.get(v, v) if not isinstance(v, Literal) else v for v in body.outvars]
  invars = list(body.invars) + [s for _, s in new_in]
  # the constants and the counter nothing reads any more
  eqns, dead_consts, drop_counter = _prune(eqns, outvars, invars, nc, counter)
  keep_in = [k for k in range(len(invars))
             if k not in dead_consts and not (drop_counter and k == nc + counter)]
  keep_out = [k for k in range(len(outvars)) if not (drop_counter and k == counter)]
  new_body = body.replace(invars=[invars[k] for k in keep_in], eqns=eqns,
                          outvars=[outvars[k] for k in keep_out])
  operands = list(eqn.invars) + [x for x, _ in new_in]
  params = dict(p, jaxpr=ClosedJaxpr(new_body, p["jaxpr"].consts),
                num_consts=nc - len(dead_consts), num_carry=ncar - int(drop_counter))
  if "linear" in p:        # older jax
    linear = tuple(p["linear"]) + (False,) * len(new_in)
    params["linear"] = tuple(linear[k] for k in keep_in)
  outer.extend(new_outer)
  return eqn.replace(invars=[operands[k] for k in keep_in],
                     outvars=[eqn.outvars[k] for k in keep_out], params=params)


def _prune(eqns, outvars, invars, nc: int, counter: int):
  """The body's equations without those nothing reads (none has effects), the
  constants nothing reads, and whether the counter only counts."""
  live = {v for v in outvars if not isinstance(v, Literal)}
  kept = []
  for e in reversed(eqns):
    if e.effects or any(v in live for v in e.outvars if not isinstance(v, DropVar)):
      kept.append(e)
      live.update(v for v in e.invars if not isinstance(v, Literal))
  kept.reverse()
  dead = {k for k in range(nc) if invars[k] not in live}
  cvar, cout = invars[nc + counter], outvars[counter]
  readers = [e for e in kept if cvar in e.invars]
  only_counts = (len(readers) == 1 and cout in readers[0].outvars
                 and not any(cout in e.invars for e in kept)
                 and cvar not in outvars and outvars.count(cout) == 1)
  if only_counts:
    kept = [e for e in kept if e is not readers[0]]
  return kept, dead, only_counts


def _reshape(x, out, like):
  """``out = x.reshape(out.shape)``, as jax traces it, at ``like``'s source line."""
  probe = _probe_reshape(tuple(x.aval.shape), x.aval.dtype, tuple(out.aval.shape))
  return probe.replace(invars=[x], outvars=[out], source_info=like.source_info, ctx=like.ctx)


@functools.lru_cache(maxsize=512)
def _probe_reshape(shape, dtype, new):
  """jax's reshape equation ``shape -> new`` (traced once per shape: a loop of
  K micro-batches asks K times)."""
  return jax.make_jaxpr(lambda a: a.reshape(new))(jax.ShapeDtypeStruct(shape, dtype)).jaxpr.eqns[0]


@functools.lru_cache(maxsize=512)
def _probe_index(shape, dtype):
  """jax's equations for ``a[0]`` of ``a: shape``: a slice, a squeeze."""
  return tuple(jax.make_jaxpr(lambda a: jax.lax.squeeze(jax.lax.slice_in_dim(a, 0, 1), (0,)))(
      jax.ShapeDtypeStruct(shape, dtype)).jaxpr.eqns)
