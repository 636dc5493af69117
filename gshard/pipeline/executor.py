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

One ``lax.scan`` over the table's ticks, in one of two forms (``gshard.pipeline.plan``):

- **per device** (a table with ticks where stages run different kinds of
  action: the published 1F1B, interleaved and ZB-H1 tables): each tick is
  one ``stage_switch`` (``gshard.pipeline.switch``) over the actions idle, F,
  F plus the loss head H, B and W; under gshard every device runs only its own
  action's branch (a ``lax.switch`` on its entry of the table). The branches
  read their inputs from the pools (read-only operands); the slot writes,
  the running sums and the two shifts (each under a ``lax.cond`` that skips
  a direction nobody sends in) are outside, masked per stage.
- **phases** (every tick one kind of action: GPipe's table, the lockstep
  forms ``pipeline.schedule(..., lockstep=True)``): each tick runs the phases
  F, H, B, W in that order, each inside a ``lax.cond`` that skips it in the
  ticks where no stage has it, on every stage at once (a stage with another
  action or none computes on real data and its results are dropped by
  ``where``; nothing is differentiated through the masks).

Either way a stage's computation runs as ``jax.vmap(...,
spmd_axis_name=stage_axis)`` over a ``[K, ...]`` dim split over the stage
axis (so annotations in ``layer_fn`` keep working), with each stage's own
inputs picked by the plan's per-stage slots (``gshard.pipeline.slots``). The
actions:

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
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import Offloadable, Saveable

from gshard.pipeline import slots
from gshard.pipeline.layout import Layout
from gshard.pipeline.loss import mean_loss
from gshard.pipeline.pieces import pieces
from gshard.pipeline.plan import (B, F, FH, IDLE, KIND_NAMES, WRITES, W, Plan, action_chunks,
                                  per_device, per_device_codes, per_device_kinds, plan)
from gshard.pipeline.schedules import Schedule
from gshard.pipeline.shift import shift
from gshard.pipeline.stages import (Stage, acc_dtype, from_stage_major, mask, merged,
                                    microbatches, on_stages, stage_major)
from gshard.pipeline.switch import stage_switch


@dataclasses.dataclass(frozen=True)
class Config:
  """What a call to the executor is about (static)."""

  layout: Layout
  schedule: Schedule
  axis: str
  remat: object          # True, False or a jax.checkpoint policy


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
  message = (
      f"pipeline.run(loss_fn=..., schedule={cfg.schedule.name!r}) on a mesh computes its "
      "gradients with the schedule, as a jax.custom_vjp: reverse mode (jax.grad, "
      "value_and_grad, vjp, jacrev) only. Forward mode (jax.jvp, jacfwd, jax.hessian) "
      "cannot go through it. Use reverse mode, or call pipeline.run without loss_fn "
      "(GPipe; jax differentiates its loop in either mode) and apply the loss to its output.")
  # jax.jvp stages the custom_vjp's tangent as an equation nothing lowers;
  # gshard's partitioner raises this message there (partition.control)
  bwd.gshard_jvp_error = message
  try:
    return pipelined(stacked, x, (loss_params, loss_consts), targets, shared)
  except TypeError as e:        # jacfwd: jax refuses while tracing
    if "forward-mode" not in str(e):
      raise
    raise TypeError(message) from e


# -- the executor ----------------------------------------------------------------------

def _on_device(policy):
  """``policy`` with its offloads saved on the device instead: the executor
  stashes residuals in buffers it selects among by stage and tick, and those
  live in device memory (jax cannot select between host and device values).
  Values are the same; the offload's memory saving is not had (warned once)."""
  warned = []

  def kept(prim, *args, **params):
    case = policy(prim, *args, **params)
    if isinstance(case, Offloadable):
      if not warned:
        warned.append(True)
        warnings.warn(
            "pipeline.run: the remat policy offloads residuals to host memory, which a "
            "schedule with a loss_fn (or a table) keeps in device buffers: the offloaded "
            "residuals are saved on the device instead (the same values, not the memory "
            "saving). schedule='gpipe' without a loss_fn applies the offload.",
            stacklevel=2)
      return Saveable
    return case
  return kept


def _execute(layer, head, cfg: Config, stacked, x, lp, targets, shared, one_layer, h_aval):
  sched, layout, axis = cfg.schedule, cfg.layout, cfg.axis
  k, m, v = sched.num_stages, sched.num_microbatches, sched.repeats
  p: Plan = plan(sched)
  remat_all = cfg.remat is True
  fn = layer
  if callable(cfg.remat) and not isinstance(cfg.remat, bool):
    fn = jax.checkpoint(layer, prevent_cse=False, policy=_on_device(cfg.remat))
  lp_aval = jax.tree.map(_aval, lp)
  pcs = pieces(fn, (one_layer, jax.tree.map(_aval, shared)), h_aval)
  active = None
  if layout.balance is not None:
    counts = np.asarray(layout.balance)
    active = np.arange(max(counts))[:, None] < counts[None, :]
  stage = Stage(pcs, shared, active, axis)
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
      "act": slots.buffer(max(p.slots["act"], 1), h_struct, lead_k, axis, 1),
      "grad": slots.buffer(max(p.slots["grad"], 1), h_struct, lead_k, axis, 1),
      "stash": slots.buffer(max(p.slots["stash"], 1), stash_avals,
                       lead_k if remat_all else lead_sk, axis, stash_kdim),
      "keep": slots.buffer(p.slots["keep"], pcs.kept, lead_sk, axis, 2) if p.split else (),
      "wgrad": [jax.tree.map(lambda a: jnp.zeros(a.shape, acc_dtype(a)), w) for w in weights],
      "sgrad": stage._zero_shared(k),
      "loss": jnp.zeros((k,), jnp.float32),
      "lgrad": [jnp.zeros((k,) + a.shape, acc_dtype(a)) for a in _float_leaves(lp_aval)],
      "dx": on_stages(jax.tree.map(lambda a: jnp.zeros((k,) + a.shape, acc_dtype(a)), micro_x),
                      axis),
      "dt": on_stages(jax.tree.map(lambda a: jnp.zeros((k,) + a.shape, acc_dtype(a)),
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
    recv = slots.read(act, xt["f_read"], 1)
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
    return loss_head(y, t_t)

  def loss_head(y, t_t):
    diff_t, rebuild_t = _split_float(t_t)
    diff_lp, rebuild_lp = _split_float(lp)       # an int leaf has no gradient

    def one(lp_diff, yk, tk_diff):
      def f(lp_diff, yk, tk_diff):
        return head(rebuild_lp(lp_diff), yk, rebuild_t(tk_diff))
      loss, vjp = jax.vjp(f, lp_diff, yk, tk_diff)
      return (loss,) + vjp(jnp.asarray(1.0 / m, loss.dtype))
    loss, dlp, dy, dt = jax.vmap(one, in_axes=(None, 0, None), spmd_axis_name=axis)(
        diff_lp, y, diff_t)
    return loss.astype(jnp.float32), dlp, on_stages(dy, axis), dt

  def compute_b(grad, stash, xt):
    ct = slots.read(grad, xt["b_read"], 1)
    w = pick(xt["b_chunk"])
    saved = slots.read(stash, xt["b_stash"], stash_kdim)
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
    return stage.weight_grad(pick(xt["w_chunk"]), slots.read(keep, xt["w_read"], 2), k)

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
      st["stash"] = slots.write(st["stash"], xt["f_stash"], kept, xt["f_on"], stash_kdim,
                           p.shared["stash"])
      st["act"] = slots.write(st["act"], xt["f_arrive"], sent, xt["f_into"], 1, p.shared["act"])
    if has["H"]:
      loss, dlp, dy, dt = when(xt["run_H"], compute_h, y, xt)
      st["loss"] = st["loss"] + jnp.where(last, loss, 0)
      st["lgrad"] = jax.tree.map(
          lambda acc, g: acc + jnp.where(mask(last, g), g, 0).astype(acc.dtype),
          st["lgrad"], dlp)
      st["grad"] = slots.write(st["grad"], xt["h_slot"], dy, jnp.asarray(last), 1, p.shared["grad"])
      st["dt"] = jax.tree.map(lambda acc, g: slots.put(acc, g, last, xt["m_head"], add=True),
                              st["dt"], dt)
    if has["B"]:
      dh, out, sent = when(xt["run_B"], compute_b, st["grad"], st["stash"], xt)
      if p.split:
        st["keep"] = slots.write(st["keep"], xt["b_keep"], out, xt["b_on"], 2, p.shared["keep"])
      else:
        accumulate(st, *out, xt["b_on"], xt["b_chunk"])
      st["dx"] = jax.tree.map(lambda acc, g: slots.put(acc, g, xt["b_first"], xt["m_dx"]),
                              st["dx"], dh)
      st["grad"] = slots.write(st["grad"], xt["b_arrive"], sent, xt["b_into"], 1, p.shared["grad"])
    if has["W"]:
      dw, ds = when(xt["run_W"], compute_w, st["keep"], xt)
      accumulate(st, dw, ds, xt["w_on"], xt["w_chunk"])
    return st, None

  # -- per device: a tick where stages run different kinds of action -----------------
  # One stage_switch: every stage reads its inputs (outside, one slot each),
  # runs its own action's branch, and the writes, running sums and the two
  # shifts happen outside, as above (the shifts under a cond that skips a
  # direction nobody sends in).
  kinds = per_device_kinds(p)
  code = per_device_codes(p)
  branch_of = np.array([kinds.index(c) if c in kinds else 0 for c in range(len(KIND_NAMES))],
                       np.int32)

  def zeros_like_avals(avals):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), avals)

  # The branches read their inputs from the (read-only) pools themselves, so
  # only the slot a stage uses is read, by that stage alone.
  def act_f(ops, head_too):
    w, act, _, _, _, x_t, t_t, sl = ops
    recv = slots.read(act, sl["f_read"], 1)
    take = sl["f_on"] & ~sl["f_first"]
    h = on_stages(jax.tree.map(lambda r, a: jnp.where(mask(take, r), r, a[None]), recv, x_t),
                  axis)
    if remat_all:
      y, stash_v = stage.primal(w, h), h
    else:
      y, stash_v = stage.forward(w, h)
    out = {"y": y, "stash": stash_v}
    if head_too:
      out["loss"], out["dlp"], out["dy"], out["dt"] = loss_head(y, t_t)
    return out

  def act_b(ops):
    w, _, grad, stash, _, _, _, sl = ops
    ct = slots.read(grad, sl["b_read"], 1)
    saved = slots.read(stash, sl["b_stash"], stash_kdim)
    if remat_all:
      _, saved = stage.forward(w, saved)
    if p.split:
      dh, keep_v = stage.input_grad(w, saved, ct)
      return {"dh": dh, "keep": keep_v}
    dh, dw, ds = stage.backward(w, saved, ct, k)
    return {"dh": dh, "dw": dw, "ds": ds}

  def act_w(ops):
    w, _, _, _, keep, _, _, sl = ops
    dw, ds = stage.weight_grad(w, slots.read(keep, sl["w_read"], 2), k)
    return {"dw": dw, "ds": ds}

  actions = {IDLE: lambda ops: {}, F: lambda ops: act_f(ops, False),
             FH: lambda ops: act_f(ops, True), B: act_b, W: act_w}

  def tick_per_device(st, xt):
    st = dict(st)
    st["wgrad"] = list(st["wgrad"])
    x_t = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, xt["m_x"], 0, keepdims=False),
                       micro_x)
    t_t = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, xt["m_head"], 0, keepdims=False),
                       micro_t)
    sl = {n: xt[n] for n in ("f_read", "f_on", "f_first", "b_read", "b_stash", "w_read")}
    ops = (pick(xt["chunk"]), st["act"], st["grad"], st["stash"], st["keep"], x_t, t_t, sl)
    parts = {c: jax.eval_shape(actions[c], ops) for c in kinds}
    avals = {}
    for part in parts.values():
      avals.update(part)
    keys = sorted(avals)
    kdim_of = {"stash": 0 if remat_all else 1, "keep": 1, "dw": 1}
    leaves_of = lambda d: [leaf for key in keys for leaf in jax.tree.leaves(d[key])]
    kdims = [kdim_of.get(key, 0) for key in keys for _ in jax.tree.leaves(avals[key])]
    flat_ops, ops_tree = jax.tree.flatten(ops)

    def branch(c):
      def run(*flat):
        out = actions[c](ops_tree.unflatten(flat))
        return leaves_of({key: out[key] if key in out else zeros_like_avals(avals[key])
                          for key in keys})
      return run

    flat = stage_switch(jnp.asarray(branch_of)[xt["code"]], [branch(c) for c in kinds],
                        flat_ops, kdims)
    it = iter(flat)
    o = {key: jax.tree.map(lambda _: next(it), avals[key]) for key in keys}
    if "stash" in o:
      st["stash"] = slots.write(st["stash"], xt["f_stash"], o["stash"], xt["f_on"], stash_kdim,
                           p.shared["stash"])
      sent = when(xt["f_send"], lambda y: on_stages(
          jax.tree.map(lambda a: shift(a, 0, 1, circular=v > 1), y), axis), o["y"])
      st["act"] = slots.write(st["act"], xt["f_arrive"], sent, xt["f_into"], 1, p.shared["act"])
    if "loss" in o:
      st["loss"] = st["loss"] + jnp.where(last, o["loss"], 0)
      st["lgrad"] = jax.tree.map(
          lambda acc, g: acc + jnp.where(mask(last, g), g, 0).astype(acc.dtype),
          st["lgrad"], o["dlp"])
      st["grad"] = slots.write(st["grad"], xt["h_slot"], o["dy"], jnp.asarray(last), 1, p.shared["grad"])
      st["dt"] = jax.tree.map(lambda acc, g: slots.put(acc, g, last, xt["m_head"], add=True),
                              st["dt"], o["dt"])
    if "keep" in o:
      st["keep"] = slots.write(st["keep"], xt["b_keep"], o["keep"], xt["b_on"], 2, p.shared["keep"])
    if "dw" in o:
      accumulate(st, o["dw"], o["ds"], xt["w_on"] if p.split else xt["b_on"], xt["chunk"])
    if "dh" in o:
      st["dx"] = jax.tree.map(lambda acc, g: slots.put(acc, g, xt["b_first"], xt["m_dx"]),
                              st["dx"], o["dh"])
      sent = when(xt["b_send"], lambda d: on_stages(
          jax.tree.map(lambda a: shift(a, 0, -1, circular=v > 1), d), axis), o["dh"])
      st["grad"] = slots.write(st["grad"], xt["b_arrive"], sent, xt["b_into"], 1, p.shared["grad"])
    return st, None

  names = ("f_on", "f_chunk", "f_first", "f_read", "f_stash", "f_arrive", "f_into", "m_x",
           "h_slot", "m_head", "b_on", "b_chunk", "b_first", "b_read", "b_stash", "b_keep",
           "b_arrive", "b_into", "m_dx", "w_on", "w_chunk", "w_read")
  xs = {n: getattr(p, n) for n in names}
  for n, pool in WRITES.items():       # a shared pool's write: one number per tick
    if p.shared[pool]:
      xs[n] = xs[n].max(1)
  if per_device(p):
    xs.update(code=code, chunk=action_chunks(p), f_send=p.f_into.any(1),
              b_send=p.b_into.any(1))
    st, _ = lax.scan(tick_per_device, state, xs)
  else:
    xs.update({f"run_{ph}": r for ph, r in runs.items()})
    st, _ = lax.scan(tick, state, xs)
  loss = jnp.sum(st["loss"]) / m
  d_stacked = tree.unflatten([
      from_stage_major([jax.tree.leaves(st["wgrad"][c])[i] for c in range(v)], layout, axis)
      .astype(leaves[i].dtype) for i in range(len(leaves))])
  dx = jax.tree.map(lambda acc, a: merged(jnp.sum(acc, 0)).astype(a.dtype), st["dx"], x)
  d_lp = _float_cotangent(lp_aval, [jnp.sum(acc, 0) for acc in st["lgrad"]])
  d_shared = jax.tree.map(lambda acc, a: jnp.sum(acc, 0).astype(jnp.result_type(a)),
                          st["sgrad"], shared)
  d_t = _float_cotangent(targets, jax.tree.map(lambda acc: merged(jnp.sum(acc, 0)), st["dt"]))
  return loss.astype(jnp.float32), (d_stacked, dx, d_lp, d_t, d_shared)


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


def _float_cotangent(targets, float_grads):
  """The cotangent of ``targets`` (or the loss parameters): the computed one
  for float leaves, float0 zeros else."""
  leaves, struct = jax.tree.flatten(targets)
  grads = iter(float_grads)
  out = [next(grads).astype(jnp.result_type(a)) if _inexact(a) else
         np.zeros(np.shape(a), jax.dtypes.float0) for a in leaves]
  return struct.unflatten(out)
