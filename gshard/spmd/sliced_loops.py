"""A loop that reads a batch's micro-batches by dynamic slices reads them as ``xs``.

Gradient accumulation is often written with a counter::

    def body(i, g):
      xb = lax.dynamic_slice_in_dim(x, i * M, M)      # micro-batch i of x [K*M, ...]
      return g + jax.grad(loss)(w, xb)
    g = lax.fori_loop(0, K, body, g0)

With static bounds jax traces it as a ``scan`` of ``K`` steps carrying the
counter, ``x`` a loop constant read by a ``dynamic_slice`` at ``i * M``. With
``x`` split over ``data`` on its rows, each step's slice is a masked read and
a psum of the micro-batch (twice the bytes of gathering ``x`` once), and every
device computes every row of it.

The same loop with ``xs = x.reshape(K, M, ...)`` scanned over is the scan form
of gradient accumulation, whose micro-batches keep the batch's split
(``relayout.py``): each device computes its rows of every micro-batch, and the
gradient sum stays pending round the loop. :func:`slices_as_xs` rewrites the
traced program so, before propagation; the values are the same (step ``t``
reads rows ``[t*M, (t+1)*M)`` either way, and no start is clamped).

It applies only to that form: a scan that is not reversed, whose carries are
one counter (from a literal 0, plus 1 a step, read by nothing after the loop)
and sums (``rules.control.accumulators``), reading a loop constant's leading
dim of ``K*M`` rows by ``dynamic_slice`` at ``counter * M`` (jax's wrap of a
negative start around it), ``M`` rows, its other dims whole. A constant that
something else in the body reads stays a constant too. Programs inside
``jax.jit`` and loops are rewritten as well.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, DropVar, Literal, Var

from gshard.spmd.rules.control import accumulators


def slices_as_xs(closed: ClosedJaxpr) -> ClosedJaxpr:
  """``closed`` with each micro-batch loop's slices read as ``xs`` (see the module)."""
  jaxpr = _rewrite(closed.jaxpr)
  return closed if jaxpr is closed.jaxpr else ClosedJaxpr(jaxpr, closed.consts)


def _rewrite(jaxpr):
  read = {v for e in jaxpr.eqns for v in e.invars if not isinstance(v, Literal)}
  read.update(v for v in jaxpr.outvars if not isinstance(v, Literal))
  eqns, changed = [], False
  for eqn in jaxpr.eqns:
    new = _inner(eqn)
    if new.primitive.name == "scan":
      new = _as_xs(new, eqns, read)
    changed |= new is not eqn
    eqns.append(new)
  return jaxpr.replace(eqns=eqns) if changed else jaxpr


def _inner(eqn):
  """``eqn`` with its inner programs (``jax.jit``'s, a loop's body) rewritten."""
  params = {}
  for k, v in eqn.params.items():
    if isinstance(v, ClosedJaxpr):
      new = slices_as_xs(v)
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
        and any(isinstance(v, Literal) and int(v.val) == 1 for v in step.invars)):
      return c
  return None


def _producer(jaxpr) -> dict:
  return {v: e for e in jaxpr.eqns for v in e.outvars}


def _follow(v, producer):
  """``v`` through dtype conversions."""
  while True:
    e = producer.get(v)
    if e is None or e.primitive.name != "convert_element_type":
      return v
    v = e.invars[0]


def _start_of(v, producer, counter, rows: int) -> bool:
  """Whether start index ``v`` is ``counter * rows`` (under jax's wrap of a
  negative start: ``select_n(s < 0, s, s + n)``, whose second branch a
  count from 0 never takes)."""
  v = _follow(v, producer)
  e = producer.get(v)
  if e is not None and e.primitive.name == "select_n" and len(e.invars) == 3:
    test = producer.get(e.invars[0])
    s = _follow(e.invars[1], producer)
    if (test is None or test.primitive.name != "lt" or _follow(test.invars[0], producer) is not s
        or not (isinstance(test.invars[1], Literal) and int(test.invars[1].val) == 0)):
      return False
    v, e = s, producer.get(s)
  if e is None or e.primitive.name != "mul":
    return False
  a, b = e.invars
  if isinstance(a, Literal):
    a, b = b, a
  return (isinstance(b, Literal) and int(b.val) == rows
          and _follow(a, producer) is counter)


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
    if e.primitive.name != "dynamic_slice" or e.invars[0] not in consts:
      continue
    shape, sizes = e.invars[0].aval.shape, e.params["slice_sizes"]
    rows = sizes[0] if shape else 0
    if (not shape or rows * K != shape[0] or tuple(sizes[1:]) != tuple(shape[1:])
        or not all(isinstance(s, Literal) and int(s.val) == 0 for s in e.invars[2:])
        or not _start_of(e.invars[1], producer, cvar, rows)):
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
  subst, new_in, new_outer = {}, [], []
  for i, (rows, reads) in sorted(found.items()):
    x = eqn.invars[i]
    shape = tuple(x.aval.shape)
    xs_var = Var(x.aval.update(shape=(K, rows) + shape[1:]))
    new_outer.append(_reshape(x, xs_var, reads[0]))
    step = Var(reads[0].outvars[0].aval)
    new_in.append((xs_var, step))
    for e in reads:
      subst[e.outvars[0]] = step
  eqns = [e.replace(invars=[subst.get(v, v) if not isinstance(v, Literal) else v
                            for v in e.invars])
          for e in body.eqns if e.outvars[0] not in subst]
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
                 and not any(cout in e.invars for e in kept))
  if only_counts:
    kept = [e for e in kept if e is not readers[0]]
  return kept, dead, only_counts


def _reshape(x, out, like):
  """``out = x.reshape(out.shape)``, as jax traces it, at ``like``'s source line."""
  probe = jax.make_jaxpr(lambda a: a.reshape(out.aval.shape))(
      jax.ShapeDtypeStruct(x.aval.shape, x.aval.dtype)).jaxpr.eqns[0]
  return probe.replace(invars=[x], outvars=[out], source_info=like.source_info, ctx=like.ctx)
