"""The schedule executor: any valid table, run inside the one partitioned program.

``pipeline.run(..., loss_fn=...)`` lands here on a mesh with the stage axis.
The whole step's pipeline (every forward, the loss of every micro-batch, every
backward) runs in the *forward* pass of a ``jax.custom_vjp``, in the order of
the schedule's table, and returns the mean loss; the custom vjp's backward
only scales the gradients that pass computed by the loss's cotangent. So a
backward starts as soon as the table says (1F1B: right after the micro-batch's
forward reaches the last stage), users still write ``jax.value_and_grad``, and
a call without differentiation runs only the forward (GPipe's forward loop
and the loss).

One ``lax.scan`` over the table's ticks. Each tick runs the phases F, H, B, W
in that order (``gshard.pipeline.plan``), each inside a ``lax.cond`` that skips
it in the ticks where no stage has it; the slot writes (one in-place
``dynamic_update_slice`` per phase) and the running sums are outside the
conditionals, masked per stage. Every phase runs on every stage at once, as
``jax.vmap(..., spmd_axis_name=stage_axis)`` over a ``[K, ...]`` dim split
over the stage axis (so annotations in ``layer_fn`` keep working), with each
stage's own inputs picked by the plan's per-stage slots; a stage with another
action or none in that phase computes on real data and its results are
dropped by ``where`` (nothing is differentiated through the masks, so no
garbage reaches a gradient either way):

- **F**: read the stage's input (``x``'s micro-batch for virtual stage 0, else
  the activation that arrived), run the stage's layers (a ``lax.scan`` over its
  layer slots) keeping each layer's residuals without weights (or, with
  ``remat=True``, keeping only the input), stash them, and shift the output
  to the next stage (one collective permute).
- **H**: on the last virtual stage, ``loss_fn`` of the micro-batch and its
  vjp: the loss adds to a running sum, the cotangent of the stage output goes
  to the stage's grad slot, the loss parameters' gradient adds to its sum.
- **B**: read the cotangent and the stash, run the stage's backward (a
  reverse scan over its layers; ``remat=True``: recompute the forward first),
  add the weight gradient into the chunk's running sum (split schedules: keep
  what W needs instead), write ``dx`` on the first virtual stage, and shift
  the input gradient to the previous stage (one collective permute).
- **W** (split schedules): the weight gradient from what B kept, added into
  the running sum. Sums, never per micro-batch copies: memory does not grow
  with M.

After the loop the per-stage sums (loss, loss parameters' gradient, dx) are
reduced over the stage axis once, and the weight gradients are already in
the stack's layout, split over the stage axis.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gshard.pipeline.layout import Layout
from gshard.pipeline.loss import mean_loss
from gshard.pipeline.pieces import Pieces, pieces
from gshard.pipeline.plan import Plan, plan
from gshard.pipeline.schedules import Schedule
from gshard.pipeline.shift import shift
from gshard.pipeline.stages import (from_stage_major, mask, merged, microbatches, on_stages,
                                    stage_major)


@dataclasses.dataclass(frozen=True)
class Config:
  """What a call to the executor is about (static)."""

  layout: Layout
  schedule: Schedule
  axis: str
  remat: object          # True, False or a jax.checkpoint policy


def _initial_buffer(shape, dtype):
  """What the slots hold before anything is written (never read unmasked)."""
  return jnp.zeros(shape, dtype)


def _inexact(a) -> bool:
  return jnp.issubdtype(jnp.result_type(a), jnp.inexact)


def _aval(a):
  return jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a))


def run_schedule(layer_fn: Callable, loss_fn: Callable, stacked, x, loss_params, targets,
                 cfg: Config, forward: Callable):
  """The mean over micro-batches of ``loss_fn(loss_params, y_m, targets_m)``,
  ``y`` the stack applied to ``x``, with gradients by ``cfg.schedule``.

  ``forward(layer_fn, stacked, x) -> y`` is the forward-only pipeline, used
  when nothing is differentiated. Values ``layer_fn`` or ``loss_fn`` close
  over that are traced floats are made explicit inputs (``jax.closure_convert``)
  and get gradients too.
  """
  m = cfg.schedule.num_microbatches
  one_layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a)[len(cfg.layout.lead):],
                                                          jnp.result_type(a)), stacked)
  h_aval = jax.tree.map(lambda a: jax.ShapeDtypeStruct((np.shape(a)[0] // m,) + np.shape(a)[1:],
                                                       jnp.result_type(a)), x)
  t_aval = jax.tree.map(lambda a: jax.ShapeDtypeStruct((np.shape(a)[0] // m,) + np.shape(a)[1:],
                                                       jnp.result_type(a)), targets)
  layer_conv, shared = jax.closure_convert(layer_fn, one_layer, h_aval)
  loss_conv, loss_consts = jax.closure_convert(loss_fn, jax.tree.map(_aval, loss_params),
                                               h_aval, t_aval)
  shared, loss_consts = tuple(shared), tuple(loss_consts)

  def layer(w, h):                      # w = (one layer's params, shared closure values)
    return layer_conv(w[0], h, *w[1])

  def head(lp, y, t):                   # lp = (loss_params, loss closure values)
    return loss_conv(lp[0], y, t, *lp[1])

  loss_dtype = jax.eval_shape(head, jax.tree.map(_aval, (loss_params, loss_consts)), h_aval,
                              t_aval).dtype

  @jax.custom_vjp
  def pipelined(stacked, x, lp, targets, shared):
    y = forward(lambda w, h: layer((w, shared), h), stacked, x)
    return mean_loss(head, lp, y, targets, m)

  def fwd(stacked, x, lp, targets, shared):
    loss, grads = _execute(layer, head, cfg, stacked, x, lp, targets, shared, one_layer, h_aval)
    return loss.astype(loss_dtype), grads

  def bwd(grads, g):
    def scale(d):
      if d.dtype == jax.dtypes.float0:
        return d
      return (g * d).astype(d.dtype)
    return jax.tree.map(scale, grads)

  pipelined.defvjp(fwd, bwd)
  return pipelined(stacked, x, (loss_params, loss_consts), targets, shared)


# -- the stage's layers ------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class _Stage:
  """One layer's pieces run over a stage's layer slots (a scan), every stage at
  once (vmap over the ``[K, ...]`` dim)."""

  pieces: Pieces
  shared: tuple
  active: np.ndarray | None      # [S, K] balance: which slots hold a layer
  axis: str

  def _vmap(self, fn, in_axes):
    return jax.vmap(fn, in_axes=in_axes, spmd_axis_name=self.axis)

  def _pin(self, tree, dim=0):
    return on_stages(tree, self.axis, dim)

  def _xs(self, w):
    return (w, self.active)

  def primal(self, w, h):
    def body(h, xs):
      wl, on = xs
      y = self._vmap(lambda wl, h: self.pieces.primal((wl, self.shared), h), (0, 0))(wl, h)
      if on is not None:
        y = jax.tree.map(lambda new, old: jnp.where(mask(on, old), new, old), y, h)
      return self._pin(y), None
    return lax.scan(body, self._pin(h), self._xs(w))[0]

  def forward(self, w, h):
    def body(h, xs):
      wl, on = xs
      y, saved = self._vmap(lambda wl, h: self.pieces.forward((wl, self.shared), h),
                            (0, 0))(wl, h)
      if on is not None:
        y = jax.tree.map(lambda new, old: jnp.where(mask(on, old), new, old), y, h)
      return self._pin(y), self._pin(saved)
    return lax.scan(body, self._pin(h), self._xs(w))

  def _masked(self, on, dw, ds, dh, ct):
    if on is None:
      return dw, ds, dh
    keep = lambda g: jnp.where(mask(on, g), g, jnp.zeros((), g.dtype))
    dh = jax.tree.map(lambda new, old: jnp.where(mask(on, old), new, old), dh, ct)
    return jax.tree.map(keep, dw), jax.tree.map(keep, ds), dh

  def _zero_shared(self, k):
    return jax.tree.map(lambda a: jnp.zeros((k,) + np.shape(a), _acc(a)), self.shared)

  def backward(self, w, saved, ct, k):
    """``(dh, dw [S, K, ...], dshared [K, ...])``."""
    def body(carry, xs):
      ct, acc = carry
      wl, on, res = xs
      (dw, ds), dh = self._vmap(
          lambda wl, res, ct: self.pieces.backward((wl, self.shared), res, ct), (0, 0, 0))(
              wl, res, ct)
      dw, ds, dh = self._masked(on, dw, ds, dh, ct)
      return (self._pin(dh), _add(acc, ds)), self._pin(dw)
    (dh, ds), dw = lax.scan(body, (self._pin(ct), self._zero_shared(k)),
                            (w, self.active, saved), reverse=True)
    return dh, dw, ds

  def input_grad(self, w, saved, ct):
    """``(dh, kept [S, K, ...])``."""
    def body(ct, xs):
      wl, on, res = xs
      dh, kept = self._vmap(
          lambda wl, res, ct: self.pieces.input_grad((wl, self.shared), res, ct), (0, 0, 0))(
              wl, res, ct)
      if on is not None:
        dh = jax.tree.map(lambda new, old: jnp.where(mask(on, old), new, old), dh, ct)
      return self._pin(dh), self._pin(kept)
    return lax.scan(body, self._pin(ct), (w, self.active, saved), reverse=True)

  def weight_grad(self, w, kept, k):
    """``(dw [S, K, ...], dshared [K, ...])``."""
    def body(acc, xs):
      wl, on, kl = xs
      dw, ds = self._vmap(lambda wl, kl: self.pieces.weight_grad((wl, self.shared), kl),
                          (0, 0))(wl, kl)
      if on is not None:
        keep = lambda g: jnp.where(mask(on, g), g, jnp.zeros((), g.dtype))
        dw, ds = jax.tree.map(keep, dw), jax.tree.map(keep, ds)
      return _add(acc, ds), self._pin(dw)
    ds, dw = lax.scan(body, self._zero_shared(k), (w, self.active, kept))
    return dw, ds


def _acc(a):
  """The dtype a running sum of ``a`` is kept in (at least float32)."""
  return jnp.promote_types(jnp.result_type(a), jnp.float32)


def _add(acc, g):
  return jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, g)


# -- slots ---------------------------------------------------------------------------

def _read(buf, slot, kdim: int):
  """Each stage's slot ``slot[s]`` of ``buf`` (``[n, ..., K at kdim, ...]``): a
  per-stage ``dynamic_slice`` (local: the slot dim is not split). Where
  ``slot`` is -1 it reads slot 0, which the caller never uses."""
  index = jnp.maximum(slot, 0)

  def one(b):
    return jax.vmap(lambda bb, i: lax.dynamic_index_in_dim(bb, i, 0, keepdims=False),
                    in_axes=(kdim, 0), out_axes=kdim - 1)(b, index)
  return jax.tree.map(one, buf)


def _write(buf, slot, value, on, kdim: int):
  """``value`` (``buf`` without its slot dim) into slot ``slot`` (one number for
  every stage: one in-place ``dynamic_update_slice``) on the stages where ``on``
  (``[K]``; the others keep what the slot held); nothing where ``slot`` is -1."""
  def one(b, v):
    index = jnp.maximum(slot, 0)
    old = lax.dynamic_index_in_dim(b, index, 0, keepdims=False)
    new = jnp.where(mask(on & (slot >= 0), old, kdim - 1), v.astype(b.dtype), old)
    return lax.dynamic_update_index_in_dim(b, new, index, 0)
  return jax.tree.map(one, buf, value)


def _buffer(n: int, avals, lead: tuple, axis: str, kdim: int):
  """``n`` slots of ``lead + aval.shape`` per leaf, K (in ``lead``) over ``axis``."""
  return on_stages(jax.tree.map(lambda a: _initial_buffer((n,) + lead + tuple(a.shape),
                                                          a.dtype), avals), axis, kdim)


# -- the executor ----------------------------------------------------------------------

def _execute(layer, head, cfg: Config, stacked, x, lp, targets, shared, one_layer, h_aval):
  sched, layout, axis = cfg.schedule, cfg.layout, cfg.axis
  k, m, v = sched.num_stages, sched.num_microbatches, sched.repeats
  p: Plan = plan(sched)
  remat_all = cfg.remat is True
  fn = layer
  if callable(cfg.remat) and not isinstance(cfg.remat, bool):
    fn = jax.checkpoint(layer, prevent_cse=False, policy=cfg.remat)
  lp_aval = jax.tree.map(_aval, lp)
  pcs = pieces(fn, (one_layer, jax.tree.map(_aval, shared)), h_aval)
  active = None
  if layout.balance is not None:
    counts = np.asarray(layout.balance)
    active = np.arange(max(counts))[:, None] < counts[None, :]
  stage = _Stage(pcs, shared, active, axis)
  per_leaf_layers = active.shape[0] if active is not None else layout.num_layers // (v * k)
  leaves, tree = jax.tree.flatten(stacked)
  per_leaf = [stage_major(a, layout, k, axis) for a in leaves]
  weights = [on_stages(tree.unflatten([chunks[c] for chunks in per_leaf]), axis, 1)
             for c in range(v)]
  micro_x = jax.tree.map(lambda a: microbatches(a, m), x)
  micro_t = jax.tree.map(lambda a: microbatches(a, m), targets)
  lead_k, lead_sk = (k,), (per_leaf_layers, k)
  h_struct = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), h_aval)
  stash_avals = h_struct if remat_all else pcs.saved
  stash_kdim = 1 if remat_all else 2
  state = {
      "act": _buffer(max(p.slots["act"], 1), h_struct, lead_k, axis, 1),
      "grad": _buffer(max(p.slots["grad"], 1), h_struct, lead_k, axis, 1),
      "stash": _buffer(max(p.slots["stash"], 1), stash_avals,
                       lead_k if remat_all else lead_sk, axis, stash_kdim),
      "keep": _buffer(p.slots["keep"], pcs.kept, lead_sk, axis, 2) if p.split else (),
      "wgrad": [jax.tree.map(lambda a: jnp.zeros(a.shape, _acc(a)), w) for w in weights],
      "sgrad": stage._zero_shared(k),
      "loss": jnp.zeros((k,), jnp.float32),
      "lgrad": jax.tree.map(lambda a: jnp.zeros((k,) + a.shape, _acc(a)), lp_aval),
      "dx": on_stages(jax.tree.map(lambda a: jnp.zeros((k,) + a.shape, _acc(a)), micro_x),
                      axis),
      "dt": on_stages(jax.tree.map(lambda a: jnp.zeros((k,) + a.shape, _acc(a)),
                                   _float_leaves(micro_t)), axis),
  }
  last = np.arange(k) == k - 1

  def pick(chunk):
    if v == 1:
      return weights[0]
    def one(*cases):
      which = jnp.broadcast_to(mask(chunk, cases[0], 1), cases[0].shape)
      return lax.select_n(which, *cases)
    return jax.tree.map(one, *weights)

  def accumulate(st, dw, ds, on, chunk):
    for c in range(v):
      hit = on & (chunk == c) if v > 1 else on
      st["wgrad"][c] = jax.tree.map(
          lambda acc, g, hit=hit: acc + jnp.where(mask(hit, g, 1), g, 0).astype(acc.dtype),
          st["wgrad"][c], dw)
    st["sgrad"] = jax.tree.map(
        lambda acc, g: acc + jnp.where(mask(on, g), g, 0).astype(acc.dtype), st["sgrad"], ds)

  # Each phase computes from read-only inputs inside a lax.cond (skipped in the
  # ticks that do not need it); the slot writes and running sums happen outside,
  # masked by the plan, so no large buffer passes through a conditional.
  def compute_f(act, xt):
    x_t = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, xt["m_x"], 0, keepdims=False),
                       micro_x)
    recv = _read(act, xt["f_read"], 1)
    take = xt["f_on"] & ~xt["f_first"]
    h = on_stages(jax.tree.map(lambda r, a: jnp.where(mask(take, r), r, a[None]), recv, x_t),
                  axis)
    w = pick(xt["f_chunk"])
    if remat_all:
      y, kept = stage.primal(w, h), h
    else:
      y, kept = stage.forward(w, h)
    sent = on_stages(jax.tree.map(lambda a: shift(a, 0, 1, circular=v > 1), y), axis)
    return y, kept, sent

  def compute_h(y, xt):
    t_t = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, xt["m_head"], 0, keepdims=False),
                       micro_t)
    diff_t, rebuild_t = _split_float(t_t)

    def one(lp, yk, tk_diff):
      def f(lp, yk, tk_diff):
        return head(lp, yk, rebuild_t(tk_diff))
      loss, vjp = jax.vjp(f, lp, yk, tk_diff)
      return (loss,) + vjp(jnp.asarray(1.0 / m, loss.dtype))
    loss, dlp, dy, dt = jax.vmap(one, in_axes=(None, 0, None), spmd_axis_name=axis)(
        lp, y, diff_t)
    return loss.astype(jnp.float32), dlp, on_stages(dy, axis), dt

  def compute_b(grad, stash, xt):
    ct = _read(grad, xt["b_read"], 1)
    w = pick(xt["b_chunk"])
    saved = _read(stash, xt["b_stash"], stash_kdim)
    if remat_all:
      _, saved = stage.forward(w, saved)
    if p.split:
      dh, out = stage.input_grad(w, saved, ct)
    else:
      dh, dw, ds = stage.backward(w, saved, ct, k)
      out = (dw, ds)
    sent = on_stages(jax.tree.map(lambda a: shift(a, 0, -1, circular=v > 1), dh), axis)
    return dh, out, sent

  def compute_w(keep, xt):
    return stage.weight_grad(pick(xt["w_chunk"]), _read(keep, xt["w_read"], 2), k)

  def when(run, fn, *args):
    """``fn(*args)`` in the ticks where ``run``, zeros of its results elsewhere."""
    out = jax.eval_shape(fn, *args)
    zeros = lambda *_: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), out)
    return lax.cond(run, fn, zeros, *args)

  has = {ph: any(ph in pat for pat in p.patterns) for ph in ("F", "H", "B", "W")}
  runs = {ph: np.array([ph in p.patterns[i] for i in p.pattern]) for ph in has}

  def tick(st, xt):
    st = dict(st)
    st["wgrad"] = list(st["wgrad"])
    y = None
    if has["F"]:
      y, kept, sent = when(xt["run_F"], compute_f, st["act"], xt)
      st["stash"] = _write(st["stash"], xt["f_stash"], kept, xt["f_on"], stash_kdim)
      st["act"] = _write(st["act"], xt["f_arrive"], sent, xt["f_into"], 1)
    if has["H"]:
      loss, dlp, dy, dt = when(xt["run_H"], compute_h, y, xt)
      st["loss"] = st["loss"] + jnp.where(last, loss, 0)
      st["lgrad"] = jax.tree.map(
          lambda acc, g: acc + jnp.where(mask(last, g), g, 0).astype(acc.dtype),
          st["lgrad"], dlp)
      st["grad"] = _write(st["grad"], xt["h_slot"], dy, jnp.asarray(last), 1)
      st["dt"] = jax.tree.map(lambda acc, g: _put(acc, g, last, xt["m_head"], add=True),
                              st["dt"], dt)
    if has["B"]:
      dh, out, sent = when(xt["run_B"], compute_b, st["grad"], st["stash"], xt)
      if p.split:
        st["keep"] = _write(st["keep"], xt["b_keep"], out, xt["b_on"], 2)
      else:
        accumulate(st, *out, xt["b_on"], xt["b_chunk"])
      st["dx"] = jax.tree.map(lambda acc, g: _put(acc, g, xt["b_first"], xt["m_dx"]),
                              st["dx"], dh)
      st["grad"] = _write(st["grad"], xt["b_arrive"], sent, xt["b_into"], 1)
    if has["W"]:
      dw, ds = when(xt["run_W"], compute_w, st["keep"], xt)
      accumulate(st, dw, ds, xt["w_on"], xt["w_chunk"])
    return st, None

  names = ("f_on", "f_chunk", "f_first", "f_read", "f_stash", "f_arrive", "f_into", "m_x",
           "h_slot", "m_head", "b_on", "b_chunk", "b_first", "b_read", "b_stash", "b_keep",
           "b_arrive", "b_into", "m_dx", "w_on", "w_chunk", "w_read")
  xs = {n: getattr(p, n) for n in names}
  xs.update({f"run_{ph}": r for ph, r in runs.items()})
  st, _ = lax.scan(tick, state, xs)
  loss = jnp.sum(st["loss"]) / m
  d_stacked = tree.unflatten([
      from_stage_major([jax.tree.leaves(st["wgrad"][c])[i] for c in range(v)], layout, axis)
      .astype(leaves[i].dtype) for i in range(len(leaves))])
  dx = jax.tree.map(lambda acc, a: merged(jnp.sum(acc, 0)).astype(a.dtype), st["dx"], x)
  d_lp = jax.tree.map(lambda acc, a: jnp.sum(acc, 0).astype(a.dtype), st["lgrad"], lp_aval)
  d_shared = jax.tree.map(lambda acc, a: jnp.sum(acc, 0).astype(jnp.result_type(a)),
                          st["sgrad"], shared)
  d_t = _targets_grad(targets, jax.tree.map(lambda acc: merged(jnp.sum(acc, 0)), st["dt"]))
  return loss.astype(jnp.float32), (d_stacked, dx, d_lp, d_t, d_shared)


def _put(acc, g, where_k, index, add: bool = False):
  """Row ``index`` of ``acc`` (``[K, M, ...]``) takes ``g`` (``[K, ...]``) on the
  stages in ``where_k`` (added to it with ``add``)."""
  old = lax.dynamic_index_in_dim(acc, index, 1, keepdims=False)
  new = old + g.astype(acc.dtype) if add else g.astype(acc.dtype)
  new = jnp.where(mask(where_k, old), new, old)
  return lax.dynamic_update_index_in_dim(acc, new, index, 1)


def _float_leaves(tree) -> list:
  return [a for a in jax.tree.leaves(tree) if _inexact(a)]


def _split_float(tree):
  """(the float leaves, a function putting new float leaves back into ``tree``)."""
  leaves, struct = jax.tree.flatten(tree)
  where = [i for i, a in enumerate(leaves) if _inexact(a)]

  def rebuild(new):
    out = list(leaves)
    for i, a in zip(where, new):
      out[i] = a
    return struct.unflatten(out)
  return [leaves[i] for i in where], rebuild


def _targets_grad(targets, float_grads):
  """The targets' cotangent: the computed one for float leaves, float0 zeros else."""
  leaves, struct = jax.tree.flatten(targets)
  grads = iter(float_grads)
  out = [next(grads).astype(jnp.result_type(a)) if _inexact(a) else
         np.zeros(np.shape(a), jax.dtypes.float0) for a in leaves]
  return struct.unflatten(out)
