"""``pipeline.run``: GPipe as a loop inside the one partitioned program.

Off gshard, or on a mesh without the stage axis, ``run`` is the plain loop
over the L layers (a ``lax.scan``). Under ``gshard.partition`` on a mesh whose
``stage_axis`` has K > 1 devices it is the GPipe pipeline of Huang et al.
(2019), written as one SPMD program over that axis, as GSPMD and praxis do:

- the stacked weights are reshaped stage-major (``[K, S, ...]``, or ``[v, K,
  S, ...]`` with ``repeats=v``) and annotated split over the stage axis on the
  K dim: each device holds only its stage's layers (other dims are left to
  the caller's annotations and in_specs);
- the batch is cut into M micro-batches ``[M, B/M, ...]`` (micro-batch ``m``
  holds rows ``m, m+M, m+2M, ...``, so a batch split over a data axis stays
  split the same way in every micro-batch);
- a ``lax.scan`` over ``T = M*v + K - 1`` ticks carries one activation per
  stage, ``[K, B/M, ...]`` split over the stage axis. Each tick:
  ``pipeline.shift`` moves every stage's output to the next stage (one
  collective permute; circular when ``v > 1``, the last stage feeding the
  first); stage 0 takes its next micro-batch; every stage runs its layers,
  ``jax.vmap(layer_fn, spmd_axis_name=stage_axis)`` over the stage dim, on
  the chunk the schedule gives it (``repeats > 1``: a per-stage select of
  the chunk's weights);
- which stage does what at each tick comes from ``pipeline.schedule("gpipe",
  K, M, repeats)`` (its forward half; stage s runs its j-th forward at tick
  ``s + j``) as small constant tables;
- a stage with nothing to do in a tick (the bubble) runs on a real
  micro-batch instead of whatever its buffer holds, and its result is never
  used: no garbage (NaN, inf) reaches a value or a gradient;
- ``jax.grad`` of the loop is the transposed pipeline: the reverse shift
  carries cotangents from stage to stage; with ``remat`` each stage keeps only
  its boundary activations per tick (``jax.checkpoint`` around a stage's
  layers) and recomputes the rest in the backward pass;
- the last stage's outputs are collected per tick and reduced over the stage
  axis once, after the loop: the result is an ordinary value for the code
  after ``run`` (the head, the loss).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from gshard.annotate import current_mesh_sizes
from gshard.pipeline.executor import Config, run_schedule
from gshard.pipeline.inputs import keys_as_data, warn_draws
from gshard.pipeline.layout import Layout, layer_order, layout_of
from gshard.pipeline.loss import check_loss, mean_loss
from gshard.pipeline.schedules import Schedule
from gshard.pipeline.shift import shift
from gshard.pipeline.stages import mask, merged, microbatches, on_stages, stage_major
from gshard.pipeline.tables import SCHEDULES
from gshard.pipeline.tables import schedule as make_schedule
from gshard.spmd.partition.context import PartitionWarning
from gshard.spmd.sharding import mesh_str

CHUNK_WEIGHTS = "gshard_pipeline_chunk_weights"   # checkpoint_name of a tick's chunk weights


def run(layer_fn: Callable, stacked, x, *, num_microbatches: int, stage_axis: str = "stage",
        schedule="gpipe", repeats: int = 1, remat=True, balance=None, loss_fn=None,
        loss_params=None, targets=None):
  """Apply L stacked layers to ``x``, pipelined over ``stage_axis`` under gshard.

  Two forms. ``run(layer_fn, stacked, x, ...)`` returns the stack's output
  (GPipe: ``jax.grad`` of the loop is the mirrored backward). With
  ``loss_fn``, ``run`` returns the mean loss over micro-batches, and on a mesh
  the pipeline runs ``schedule``'s table, backwards interleaved with forwards
  (``"1f1b"``, ``"interleaved"``, ``"zero_bubble"``, ``"gpipe"`` or your own
  :class:`Schedule`); ``jax.value_and_grad`` of it gives the plain loop's
  gradients.

  Args:
    layer_fn: ``layer_fn(one_layer_params, x) -> x`` with the same structure
      and shapes; rows of the batch (dim 0 of every leaf of ``x``) must not
      interact (every micro-batch is run on its own, as in GPipe).
      Annotations inside it (data, model, expert axes) keep working.
    stacked: the layers' parameters in the layout of
      :func:`gshard.pipeline.stack` (``[L, ...]``; ``[repeats, L/repeats,
      ...]``; ``[K, max(balance), ...]``).
    x: an array or pytree of arrays, all with the batch as dim 0.
    num_microbatches: M, must divide the batch.
    stage_axis: the mesh axis of pipeline stages.
    schedule: ``"gpipe"``; with ``loss_fn`` also ``"1f1b"``,
      ``"interleaved"``, ``"zero_bubble"`` or a :class:`Schedule` (your own
      table, ``pipeline.schedule(table=...)``). A name runs its published
      table, ``pipeline.schedule(name, K, M, repeats)``: in a tick where
      stages run different actions each device runs only its own.
    repeats: v, chunks per device (the circular pipeline: device s runs
      virtual stages s, s+K, ...); needs M to be a multiple of K when v > 1.
    remat: True (recompute each stage's layers in the backward pass, keep
      only boundary activations), False (keep everything), or a
      ``jax.checkpoint`` policy for the stage's layers.
    balance: layers per stage (K entries, e.g. ``pipeline.balance(costs,
      num_stages=K)``); None splits evenly. Short stages pad their idle layer
      slots with the zero parameters of the stack and skip them (identity).
    loss_fn: ``loss_fn(loss_params, y, targets) -> scalar``, the loss of one
      micro-batch (``y`` its rows of the stack's output, ``targets`` the same
      rows of ``targets``): the layers after the stack and the loss. On the
      pipeline it runs on the last stage as each micro-batch finishes, so its
      backward can start there. Values it (or ``layer_fn``) closes over that
      are traced floats get gradients too.
    loss_params: parameters of ``loss_fn`` (any pytree; their gradient is
      the mean over micro-batches).
    targets: a pytree with the batch as dim 0 (or None), cut into
      micro-batches like ``x``.

  Returns:
    Without ``loss_fn``: ``x`` after the L layers. With it: the mean over
    micro-batches of ``loss_fn(loss_params, y_m, targets_m)``. On one device,
    or under gshard without ``stage_axis``, the plain loop; on a mesh with
    ``stage_axis`` the pipeline, equal to the plain loop (to float rounding),
    gradients included.
  """
  if not isinstance(stage_axis, str):
    raise TypeError(f"run: stage_axis must be the name of one mesh axis (a str), got "
                    f"{stage_axis!r}. The stages run over one axis, e.g. stage_axis='stage'.")
  if loss_fn is None and (targets is not None or loss_params is not None):
    raise ValueError("run: targets and loss_params are the arguments of loss_fn, and no "
                     "loss_fn was given. Pass loss_fn(loss_params, y, targets) -> scalar, "
                     "or drop them (run then returns the stack's output).")
  _check_remat(remat)
  layout = layout_of(stacked, repeats=repeats, balance=balance)
  mesh = current_mesh_sizes()
  _check_schedule(schedule, loss_fn, mesh)
  batch = _check_batch(x, num_microbatches, mesh)
  if loss_fn is not None:
    check_loss(loss_fn, loss_params, targets, x, stacked, batch, num_microbatches,
               _where(mesh))
  one_layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a)[len(layout.lead):],
                                                          jnp.result_type(a)), stacked)
  stages = None if mesh is None else mesh.get(stage_axis)
  if stages is None and mesh:
    _warn_near_miss(stage_axis, mesh)
  if stages is None or (stages == 1 and layout.balance is None):
    _check_layer_fn(layer_fn, one_layer, x, batch)
    y = _plain(layer_fn, layer_order(stacked, layout), x, remat)
    if loss_fn is None:
      return y
    return mean_loss(loss_fn, loss_params, y, targets, num_microbatches)
  _check_stages(layout, stages, stage_axis, mesh, num_microbatches)
  mb = batch // num_microbatches
  _check_layer_fn(layer_fn, one_layer,
                  jax.tree.map(lambda a: jax.ShapeDtypeStruct((mb,) + np.shape(a)[1:],
                                                              jnp.result_type(a)), x), mb,
                  micro=True)
  if loss_fn is None:       # (with loss_fn, check_loss admits float leaves of x only)
    x, keyed = keys_as_data(x)
    layer = layer_fn if keyed is None else \
        lambda p, h: keys_as_data(layer_fn(p, keyed(h)))[0]
    y = _pipelined(layer, stacked, x, layout, stages, num_microbatches, stage_axis, remat)
    return y if keyed is None else keyed(y)
  sched = _executed(schedule, stages, num_microbatches, layout, stage_axis, mesh)

  def forward(fn, stacked, x):
    return _pipelined(fn, stacked, x, layout, stages, num_microbatches, stage_axis, False)
  return run_schedule(layer_fn, loss_fn, stacked, x, loss_params, targets,
                      Config(layout, sched, stage_axis, remat), forward)


# -- checks ---------------------------------------------------------------------

def _warn_near_miss(axis: str, mesh: dict[str, int]) -> None:
  """Without ``stage_axis`` in the mesh, run is the plain loop (the model
  code runs unchanged on a mesh without stages); a name close to one of the
  mesh's axes is more likely a typo, which would quietly run every layer on
  every stage device: say so."""
  near = difflib.get_close_matches(axis, list(mesh), n=1, cutoff=0.75)
  if near:
    warnings.warn(PartitionWarning(
        f"pipeline.run: stage_axis {axis!r} is not an axis of the mesh "
        f"{mesh_str(mesh)}, so the layers run as the plain loop, not pipelined over "
        f"{near[0]!r}. Did you mean stage_axis={near[0]!r}?"), stacklevel=3)


def _where(mesh) -> str:
  return "off mesh" if mesh is None else f"on mesh {mesh_str(mesh)}"


def _check_schedule(schedule, loss_fn, mesh) -> None:
  if isinstance(schedule, Schedule):
    if loss_fn is None:
      raise ValueError(
          f"run(schedule={schedule!r}): a schedule's table runs with loss_fn=...: its "
          "backwards start before the last forward, so each micro-batch's loss must be "
          "computed inside the pipeline. Pass loss_fn (and loss_params, targets); run then "
          "returns the mean loss.")
    return
  if schedule not in SCHEDULES:
    raise ValueError(f"run(schedule={schedule!r}): use one of "
                     f"{', '.join(map(repr, SCHEDULES))} or a pipeline.Schedule.")
  if schedule != "gpipe" and loss_fn is None:
    raise ValueError(
        f"run(schedule={schedule!r}) needs loss_fn=... ({_where(mesh)}): {schedule} starts "
        "micro-batch 0's backward before the last micro-batch's forward, so the layers "
        "after the stack and the loss run inside the pipeline, on the last stage: pass "
        "loss_fn(loss_params, y, targets) -> scalar, loss_params and targets, and run "
        "returns the mean loss (jax.value_and_grad of it as usual). Or use "
        "schedule='gpipe', which returns the stack's output.")


def _executed(schedule, k: int, m: int, layout: Layout, axis: str, mesh) -> Schedule:
  """The table run executes on K stages: a name's published table, or the user's."""
  v = layout.repeats
  if isinstance(schedule, Schedule):
    got = (schedule.num_stages, schedule.num_microbatches, schedule.repeats)
    if got != (k, m, v):
      raise ValueError(
          f"run(schedule=...): the table is for num_stages={got[0]}, num_microbatches="
          f"{got[1]}, repeats={got[2]}, but this call has {k} stages (stage_axis {axis!r} on "
          f"mesh {mesh_str(mesh)}), num_microbatches={m}, repeats={v}. Build it with "
          f"pipeline.schedule(..., num_stages={k}, num_microbatches={m}, repeats={v}).")
    return schedule
  if schedule in ("1f1b", "zero_bubble") and v != 1:
    raise ValueError(
        f"run(schedule={schedule!r}, repeats={v}): {schedule} runs one chunk per device; for "
        f"{v} chunks per device use schedule='interleaved' (or 'gpipe').")
  return make_schedule(schedule, num_stages=k, num_microbatches=m, repeats=v)


def _check_remat(remat) -> None:
  if not (isinstance(remat, bool) or callable(remat)):
    raise ValueError(f"run(remat={remat!r}): remat must be True, False or a jax.checkpoint "
                     "policy such as jax.checkpoint_policies.dots_saveable.")


def _check_batch(x, num_microbatches, mesh) -> int:
  if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, (int, np.integer)) \
      or num_microbatches < 1:
    raise ValueError(f"run(num_microbatches={num_microbatches!r}): give an int >= 1.")
  leaves, _ = jax.tree_util.tree_flatten_with_path(x)
  if not leaves:
    raise ValueError("run: x has no array leaves.")
  batch = None
  for path, a in leaves:
    shape = tuple(np.shape(a))
    name = jax.tree_util.keystr(path) or "x"
    if not shape:
      raise ValueError(f"run: x leaf {name} is a scalar; every leaf of x needs the batch as "
                       "dim 0.")
    if batch is None:
      batch = shape[0]
    elif shape[0] != batch:
      raise ValueError(f"run: x leaf {name} has shape {shape}, but the batch (dim 0) of the "
                       f"first leaf is {batch}; every leaf of x needs the same batch.")
  if batch % num_microbatches:
    fits = [d for d in range(1, batch + 1) if batch % d == 0]
    raise ValueError(
        f"run: x has batch {batch} (shape {tuple(np.shape(leaves[0][1]))}), which "
        f"num_microbatches={num_microbatches} does not divide ({_where(mesh)}). Use one of "
        f"{fits}, or pad the batch to a multiple of {num_microbatches}.")
  return batch


def _check_stages(layout: Layout, stages: int, axis: str, mesh, num_microbatches: int):
  where = f"mesh {mesh_str(mesh)}"
  if layout.balance is not None:
    if len(layout.balance) != stages:
      raise ValueError(
          f"run: balance={list(layout.balance)} has {len(layout.balance)} stages, but "
          f"stage_axis {axis!r} has {stages} devices on {where}. Give {stages} counts, e.g. "
          f"pipeline.balance(costs, num_stages={stages}) (and restack with "
          f"pipeline.stack(layers, balance=...)).")
    return
  per_chunk = layout.num_layers // layout.repeats
  if per_chunk % stages:
    v = layout.repeats
    what = (f"L={layout.num_layers} layers" if v == 1 else
            f"L/repeats={per_chunk} layers per chunk (L={layout.num_layers}, repeats={v})")
    raise ValueError(
        f"run: {what} cannot be cut evenly into {stages} stages (stage_axis {axis!r} on "
        f"{where}). Use a multiple of {stages * v} layers, or unequal stages: "
        f"balance=pipeline.balance(costs, num_stages={stages}) with repeats=1 and "
        "pipeline.stack(layers, balance=...).")
  if layout.repeats > 1 and num_microbatches % stages:
    raise ValueError(
        f"run: num_microbatches={num_microbatches} must be a multiple of the {stages} stages "
        f"(stage_axis {axis!r} on {where}) when repeats={layout.repeats} > 1: the circular "
        f"pipeline runs K micro-batches per chunk. Use num_microbatches="
        f"{stages * -(-num_microbatches // stages)}, or repeats=1.")


def _check_layer_fn(layer_fn, one_layer, x, rows, micro: bool = False) -> None:
  want = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), x)
  traced = jax.make_jaxpr(layer_fn, return_shape=True)(one_layer, want)
  got = traced[1]
  if micro:
    jaxpr = traced[0].jaxpr
    warn_draws(jaxpr, set(jaxpr.invars[len(jax.tree.leaves(one_layer)):]), rows)
  if jax.tree.structure(got) != jax.tree.structure(want) or any(
      (a.shape, a.dtype) != (b.shape, b.dtype)
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))):
    shapes = sorted({tuple(a.shape) for a in jax.tree.leaves(one_layer)})[:3]
    raise ValueError(
        f"run: layer_fn(one_layer_params, x) must return x's structure, shapes and dtypes; "
        f"for x of {want} ({rows} rows) it returned {got}. One layer's parameters "
        f"had shapes {shapes}: if the stack was built with pipeline.stack(..., "
        "balance=...) (leaves [stages, layers per stage, ...]), pass the same balance= "
        "to run.")


# -- the plain loop ----------------------------------------------------------------

def _plain(layer_fn, layers, x, remat):
  """The L layers one after the other (``layers`` leaves ``[L, ...]``)."""
  fn = _checkpointed(layer_fn, remat, circular=False)
  y, _ = lax.scan(lambda h, p: (fn(p, h), None), x, layers)
  return y


# -- the tick tables ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Ticks:
  """What every stage does in each forward tick of the GPipe schedule.

  Attributes:
    take: ``[T, K]`` bool: the stage computes on what its left neighbour sent
      (False: it is stage 0 starting a micro-batch, or idle).
    chunk: ``[T, K]`` int32: the chunk it runs (0 when idle).
    m_in: ``[T]`` int32: the micro-batch stage 0 starts (idle stages compute
      on it too; 0 when none starts).
    t_out: ``[M]`` int32: the tick at which the last stage finishes each
      micro-batch's last chunk.
    live: ``[T, K]`` bool: the stage runs a forward (False: a bubble).
  """

  take: np.ndarray
  chunk: np.ndarray
  m_in: np.ndarray
  t_out: np.ndarray
  live: np.ndarray

  @property
  def num_ticks(self) -> int:
    return self.take.shape[0]


@functools.lru_cache(maxsize=64)
def forward_ticks(num_stages: int, num_microbatches: int, repeats: int) -> Ticks:
  """The forward half of ``pipeline.schedule("gpipe", K, M, repeats)`` as tables."""
  k, m, v = num_stages, num_microbatches, repeats
  sched = make_schedule("gpipe", num_stages=k, num_microbatches=m, repeats=v)
  num_ticks = m * v + k - 1
  take = np.zeros((num_ticks, k), bool)
  chunk = np.zeros((num_ticks, k), np.int32)
  m_in = np.zeros((num_ticks,), np.int32)
  t_out = np.full((m,), -1, np.int32)
  live = np.zeros((num_ticks, k), bool)
  forwards = 0
  for t, row in enumerate(sched.table):
    for s, a in enumerate(row):
      if a is None or a.kind != "F":
        continue
      if not 0 <= t - s < m * v:
        raise AssertionError(f"gshard internal error: gpipe's F at tick {t}, stage {s} is "
                             "outside the dense forward ticks.")
      forwards += 1
      live[t, s] = True
      chunk[t, s] = a.chunk
      if s == 0 and a.chunk == 0:
        m_in[t] = a.microbatch
      else:
        take[t, s] = True
      if s == k - 1 and a.chunk == v - 1:
        t_out[a.microbatch] = t
  if forwards != k * m * v or (t_out < 0).any():
    raise AssertionError("gshard internal error: the gpipe table does not have every forward.")
  return Ticks(take, chunk, m_in, t_out, live)


# -- the pipeline ------------------------------------------------------------------

# Recomputed in the backward pass under any remat setting when repeats > 1:
# the per-tick copy of a chunk's weights, and the selects / broadcasts that make it.
_NOT_SAVED = ("select_n", "broadcast_in_dim", "squeeze")


def _checkpointed(fn, remat, circular: bool):
  """``fn`` under the remat setting (circular: never save a chunk's weights)."""
  if remat is True:
    return jax.checkpoint(fn, prevent_cse=False)
  if remat is False and not circular:
    return fn
  user = jax.checkpoint_policies.everything_saveable if remat is False else remat
  if not circular:
    return jax.checkpoint(fn, prevent_cse=False, policy=user)

  def policy(prim, *args, **params):
    if prim.name in _NOT_SAVED or (prim.name == "name" and params.get("name") == CHUNK_WEIGHTS):
      return False
    return user(prim, *args, **params)
  return jax.checkpoint(fn, prevent_cse=False, policy=policy)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _gate(tree, on, dim: int):
  """``tree`` unchanged; its tangents (and so, transposed, a stage's
  cotangents in the backward pass) are kept where ``on`` (``[K]``, placed at
  ``dim``) and zero elsewhere. A bubble or a short stage's idle slot computes
  on a value it was never meant for (a raw micro-batch, zero weights): its
  output is dropped, but its backward pass multiplies that zero cotangent by
  a derivative that may be inf or NaN (``sqrt`` of a negative, ``h / 0``),
  and 0 * NaN reached the gradients. A JVP rule (not a VJP) keeps forward
  mode (``jax.jvp``, ``jacfwd``) working through the loop; its select
  transposes to the select that cuts the cotangents."""
  del on, dim
  return tree


@_gate.defjvp
def _gate_jvp(dim, primals, tangents):
  tree, on = primals

  # rematerialised: the mask, broadcast to the value's shape, is rebuilt from
  # ``on`` in the backward pass (kept, it was a residual the size of every
  # layer's weights and activations in every tick: +1.2 MiB of 1.0 MiB)
  @jax.checkpoint
  def cut(on, t):
    return jnp.where(mask(on, t, dim), t, jnp.zeros((), t.dtype))

  def keep(t):
    return cut(on, t) if jnp.issubdtype(t.dtype, jnp.inexact) else t
  return _gate(tree, on, dim), jax.tree.map(keep, tangents[0])


def _stage_fn(layer_fn, layout: Layout, k: int, axis: str, remat):
  """One tick of every stage: ``(weights, chunk [K], h [K, ...]) -> h``.

  ``weights`` holds one pytree per chunk (leaves ``[S, K, ...]``). Circular:
  each layer slot's weights are narrowed to the chunk of each stage by a
  select, named :data:`CHUNK_WEIGHTS`; no remat policy keeps that per-tick
  copy, it is recomputed from the weights in the backward pass.
  """
  v = layout.repeats
  active = None
  if layout.balance is not None:
    counts = np.asarray(layout.balance)
    active = np.arange(max(counts))[:, None] < counts[None, :]     # [S, K]
  vmapped = jax.vmap(layer_fn, spmd_axis_name=axis)

  def pick(chunk, *cases):   # each case [K, ...] -> [K, ...]: each stage's chunk
    which = jnp.broadcast_to(mask(chunk, cases[0]), cases[0].shape)
    return checkpoint_name(lax.select_n(which, *cases), CHUNK_WEIGHTS)

  def stage(weights, chunk, h):
    def layer(h, xs):
      ws, on = xs
      w = ws[0] if v == 1 else jax.tree.map(functools.partial(pick, chunk), *ws)
      # an idle slot's backward pass never reaches w or h (its identity does)
      y = vmapped(w, h) if on is None else vmapped(_gate(w, on, 0), _gate(h, on, 0))
      if on is not None:   # a short stage's idle slot: identity
        y = jax.tree.map(lambda new, old: jnp.where(mask(on, old), new, old), y, h)
      return on_stages(y, axis), None

    h, _ = lax.scan(layer, on_stages(h, axis), (weights, active))
    return h

  return _checkpointed(stage, remat, v > 1)


def _initial_buffer(shape, dtype):
  """What the stage buffers hold before the first tick (never read: bubbles
  compute on real micro-batches)."""
  return jnp.zeros(shape, dtype)


def _pipelined(layer_fn, stacked, x, layout: Layout, k: int, m: int, axis: str, remat):
  v = layout.repeats
  ticks = forward_ticks(k, m, v)
  leaves, tree = jax.tree.flatten(stacked)
  per_leaf = [stage_major(a, layout, k, axis) for a in leaves]
  weights = [tree.unflatten([chunks[c] for chunks in per_leaf]) for c in range(v)]
  micro = jax.tree.map(lambda a: microbatches(a, m), x)                 # [M, B/M, ...]

  def per_tick_input(a):   # [T, K, B/M, ...]: the micro-batch stage 0 starts, every stage
    # broadcast before the gather: its gradient is summed over the stages once, [M, ...]
    every = on_stages(jnp.broadcast_to(a[None], (k,) + a.shape), axis)   # [K, M, ...]
    return jnp.swapaxes(jnp.take(every, ticks.m_in, axis=1), 0, 1)
  inputs = on_stages(jax.tree.map(per_tick_input, micro), axis, dim=1)
  stage = _stage_fn(layer_fn, layout, k, axis, remat)

  def tick(prev, xs):
    take, chunk, start, live = xs
    sent = jax.tree.map(lambda a: shift(a, 0, 1, circular=v > 1), prev)
    h = jax.tree.map(lambda r, s: jnp.where(mask(take, s), r, s), on_stages(sent, axis),
                     start)
    # a bubble's backward pass never reaches the weights or the input
    out = stage(_gate(weights, live, 1), chunk, _gate(on_stages(h, axis), live, 0))
    out = on_stages(out, axis)
    return out, out

  init = on_stages(jax.tree.map(lambda a: _initial_buffer((k,) + a.shape[1:], a.dtype),
                                 micro), axis)
  _, outs = lax.scan(tick, init, (ticks.take, ticks.chunk, inputs, ticks.live))  # [T, K, ..]

  def finished(y):   # the last stage's output of each micro-batch: [M, B/M, ...]
    y = jnp.take(y, ticks.t_out, axis=0)                                 # [M, K, B/M, ...]
    last = (np.arange(k) == k - 1).reshape((1, k) + (1,) * (y.ndim - 2))
    # one term of the sum is not zero; in y's own dtype (jnp.sum promotes a
    # bool mask to int32 and a uint8 id to uint32: the values after run differed)
    y = jnp.where(last, y, jnp.zeros((), y.dtype))
    return jnp.any(y, axis=1) if y.dtype == np.bool_ else jnp.sum(y, axis=1, dtype=y.dtype)
  return jax.tree.map(lambda y: merged(finished(y)), outs)
