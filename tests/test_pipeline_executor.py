"""``pipeline.run(..., loss_fn=...)``: every schedule equals the plain loop.

On a mesh with the stage axis, ``run`` with ``loss_fn`` executes the
schedule's published table (or a user's, or a lockstep form) inside one
``custom_vjp`` forward, each device its own action in a tick that mixes them;
``jax.value_and_grad`` of it must give the loss and the gradients of the plain
loop (a Python loop over the unstacked layers written here, then the head and
the loss over the whole batch): for the stack, the loss parameters, the
input and the (float) targets. Tolerances are derived, never tuned
(``helpers_numerics.assert_close_to_f64``): the pipeline and the one-device
f32 loop are both compared with the f64 loop, each element within
``sqrt(n) E`` with ``n`` the longest sum (every weight gradient sums over the
batch rows, the layers' matmuls over D and H) and ``E`` the one-device f32
loop's own error.

Also: the executed tick loop has the table's length and one permute each way
per phase, and without remat 1F1B's temporary memory shrinks with M at a fixed
batch while GPipe's does not (the point of 1F1B).
"""

from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import gshard
from gshard import pipeline
from gshard.spmd.partition.pipeline import SwitchWarning
from helpers_numerics import assert_close_to_f64, f64_run, to_host
from helpers_partition import mesh
from test_pipeline_run import D, H, megatron_layer, megatron_layers, param_specs, tanh_layer, \
    tanh_layers


def head(lp, y, t):
  """The layers after the stack and the loss of one micro-batch."""
  return jnp.mean((jnp.tanh(y @ lp["w"]) + lp["b"] - t) ** 2)


def plain(layer_fn):
  def loss(layers, lp, x, t):
    h = x
    for p in layers:
      h = layer_fn(p, h)
    return head(lp, h, t)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))


def piped(layer_fn, m, **kw):
  def loss(stacked, lp, x, t):
    return pipeline.run(layer_fn, stacked, x, num_microbatches=m, loss_fn=head,
                        loss_params=lp, targets=t, **kw)
  return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))


def _inputs(key, layers_fn, num_layers, batch):
  layers = layers_fn(key, num_layers)
  lp = {"w": jax.random.normal(jax.random.fold_in(key, 3), (D, D)) / D ** 0.5,
        "b": jax.random.normal(jax.random.fold_in(key, 4), (D,)) * 0.1}
  x = jax.random.normal(jax.random.fold_in(key, 7), (batch, D))
  t = jax.random.normal(jax.random.fold_in(key, 8), (batch, D))
  return layers, lp, x, t


def check(layer_fn, layers, lp, x, t, got, layout, what):
  want = to_host(plain(layer_fn)(layers, lp, x, t))
  exact = f64_run(plain(layer_fn), layers, lp, x, t)
  restack = lambda r: (r[0], (pipeline.stack(r[1][0], **layout),) + tuple(r[1][1:]))
  assert_close_to_f64(to_host(got), restack(want), restack(exact), n=max(x.shape[0], D, H),
                      what=what)


CASES = [
    # name, mesh, layer, L, M, run kwargs
    ("1f1b K4 M8", ((4,), ("stage",)), "tanh", 8, 8, {"schedule": "1f1b"}),
    ("1f1b K2 M4 data4", ((4, 2), ("data", "stage")), "megatron", 4, 4, {"schedule": "1f1b"}),
    ("1f1b megatron K2 M4", ((2, 2, 2), ("data", "stage", "model")), "megatron", 4, 4,
     {"schedule": "1f1b", "remat": False}),
    ("1f1b no remat data2", ((2, 4), ("data", "stage")), "tanh", 8, 8,
     {"schedule": "1f1b", "remat": False}),
    ("1f1b policy", ((2, 4), ("data", "stage")), "megatron", 8, 4,
     {"schedule": "1f1b", "remat": jax.checkpoint_policies.dots_saveable}),
    ("1f1b balance 1331", ((4,), ("stage",)), "tanh", 8, 4,
     {"schedule": "1f1b", "balance": [1, 3, 3, 1]}),
    ("zero_bubble K4 M8 data2", ((2, 4), ("data", "stage")), "tanh", 8, 8,
     {"schedule": "zero_bubble", "remat": False}),
    ("zero_bubble megatron K2 M4", ((2, 2, 2), ("data", "stage", "model")), "megatron", 4, 4,
     {"schedule": "zero_bubble"}),
    ("interleaved K4 M8 data2", ((2, 4), ("data", "stage")), "tanh", 16, 8,
     {"schedule": "interleaved", "repeats": 2, "remat": False}),
    ("interleaved megatron K2 M4", ((2, 2, 2), ("data", "stage", "model")), "megatron", 8, 4,
     {"schedule": "interleaved", "repeats": 2}),
    ("gpipe table K4 M4", ((4,), ("stage",)), "tanh", 8, 4, {"schedule": "gpipe"}),
]


MODELS = {"tanh": (tanh_layer, tanh_layers), "megatron": (megatron_layer, megatron_layers)}


@pytest.mark.parametrize("name, mesh_args, layer, num_layers, m, kw", CASES,
                         ids=[c[0] for c in CASES])
def test_schedule_equals_plain_loop(name, mesh_args, layer, num_layers, m, kw):
  layer_fn = MODELS[layer][0]
  layers, lp, x, t = _inputs(jax.random.PRNGKey(len(name)), MODELS[layer][1], num_layers,
                             32 if m == 8 else 16)
  layout = {k: kw[k] for k in ("repeats", "balance") if k in kw}
  stacked = pipeline.stack(layers, **layout)
  specs = param_specs(layers, stage_dim=1 if kw.get("repeats", 1) > 1 else 0,
                      model="model" in mesh_args[1])
  data = P("data") if "data" in mesh_args[1] else P()
  step = gshard.partition(piped(layer_fn, m, **kw), mesh(*mesh_args),
                          in_specs=(specs, P(), data, data))
  got = step(stacked, lp, x, t)
  check(layer_fn, layers, lp, x, t, got, layout, name)
  low = step.lower(stacked, lp, x, t)
  kinds = {(c.kind, c.axes) for c in low.collectives()}
  assert ("ppermute", ("stage",)) in kinds
  assert not any(c.kind == "all_gather" for c in low.collectives()), low.explain()
  assert low.fallbacks == []


def test_a_users_own_table_and_the_asynchronous_1f1b():
  # run executes any validated table: here 1F1B as the literature writes it
  # (F and B of different stages in one tick) and a hand-made table of
  # GPipe's forwards followed by 1F1B-like backwards, on K=2, M=2
  layers, lp, x, t = _inputs(jax.random.PRNGKey(5), tanh_layers, 4, 16)
  stacked = pipeline.stack(layers)
  own = pipeline.schedule(table=[[("F", 0), None], [("F", 1), ("F", 0)], [None, ("B", 0)],
                                 [("B", 0), ("F", 1)], [None, ("B", 1)], [("B", 1), None]],
                          num_stages=2, num_microbatches=2)
  for sched in (pipeline.schedule("1f1b", num_stages=2, num_microbatches=4), own):
    m = sched.num_microbatches
    step = gshard.partition(piped(tanh_layer, m, schedule=sched),
                            mesh((4, 2), ("data", "stage")),
                            in_specs=({"w": P("stage"), "b": P("stage")}, P(), P("data"),
                                      P("data")))
    check(tanh_layer, layers, lp, x, t, step(stacked, lp, x, t), {}, sched.name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
def test_data_parallel_gradients_are_summed_once_after_the_tick_loop(schedule):
  # with a data axis, each tick's weight and loss-parameter gradients are
  # partial sums over data: they stay pending through the action's
  # conditional and the running sums, and one all-reduce after the loop
  # resolves them (with the loss parameters' sum over the stages), the bytes
  # of one gradient; no data-axis collective runs per tick
  k, m, dp = 4, 8, 2
  layers, lp, x, t = _inputs(jax.random.PRNGKey(2), tanh_layers, 2 * k, 32)
  stacked = pipeline.stack(layers)
  step = gshard.partition(piped(tanh_layer, m, schedule=schedule),
                          mesh((dp, k), ("data", "stage")),
                          in_specs=(param_specs(layers), P(), P("data"), P("data")))
  low = step.lower(stacked, lp, x, t)
  on_data = [c for c in low.collectives() if "data" in c.axes]
  assert on_data and all(c.repeat == 1 for c in on_data), low.explain()
  # the stack's gradient (2 layers per stage, w and b) and the loss
  # parameters' (over data and stages), each all-reduced once
  f32 = 4
  stack_bytes = 2 * (D * D + D) * f32
  assert sum(c.bytes for c in on_data if c.axes == ("data",)) == stack_bytes, low.explain()
  got = step(stacked, lp, x, t)
  check(tanh_layer, layers, lp, x, t, got, {}, f"{schedule} data {dp}")


def random_table(rng, k, m, v, split, idle):
  """A random valid table: each tick, each stage runs one of its ready actions
  (chosen at random) or, with probability ``idle``, waits."""
  nv = k * v
  todo = {(kind, mb, u) for mb in range(m) for u in range(nv)
          for kind in (("F", "B", "W") if split else ("F", "B"))}
  done, table = {}, []
  while todo:
    t, row = len(table), [None] * k
    for s in range(k):
      ready = sorted(a for a in todo if a[2] % k == s and
                     all(done.get(d, t) < t for d in pipeline.actions.dependencies(*a, nv)))
      if ready and rng.random() >= idle:
        kind, mb, u = ready[rng.integers(len(ready))]
        row[s] = (kind, mb, u // k)
    for s, a in enumerate(row):
      if a is not None:
        key = (a[0], a[1], a[2] * k + s)
        done[key] = t
        todo.discard(key)
    table.append(row)
  return pipeline.schedule(table=table, num_stages=k, num_microbatches=m, repeats=v)


@settings(max_examples=int(os.environ.get("GSHARD_TABLE_EXAMPLES", "2")))
@given(seed=st.integers(0, 2 ** 16), k=st.sampled_from([2, 4]), m=st.integers(1, 4),
       v=st.integers(1, 2), split=st.booleans(), remat=st.booleans())
def test_a_random_valid_table_equals_the_plain_loop(seed, k, m, v, split, remat):
  # any valid table (ticks mixing every kind of action, idle ticks, W long
  # after its B) runs per device and equals the plain loop
  if v > 1:          # run's forward-only path (GPipe's circular loop) needs K | M
    m = k * -(-m // k)
  rng = np.random.default_rng(seed)
  sched = random_table(rng, k, m, v, split, idle=0.2)
  layers, lp, x, t = _inputs(jax.random.PRNGKey(seed), tanh_layers, k * v, 16 * m)
  stacked = pipeline.stack(layers, repeats=v)
  step = gshard.partition(piped(tanh_layer, m, schedule=sched, repeats=v, remat=remat),
                          mesh((8 // k, k), ("data", "stage")),
                          in_specs=(param_specs(layers, stage_dim=int(v > 1)), P(), P(), P()))
  check(tanh_layer, layers, lp, x, t, step(stacked, lp, x, t), {"repeats": v} if v > 1 else {},
        f"random table seed={seed}")


@pytest.mark.parametrize("name, v, lockstep", [("1f1b", 1, False), ("zero_bubble", 1, False),
                                               ("interleaved", 2, False), ("1f1b", 1, True)])
def test_the_tick_loop_runs_the_table(name, v, lockstep):
  # one scan over the table's ticks (the published table for a name, here
  # also a lockstep one passed as a Schedule); the shifts move one micro-batch
  # (B/M rows of D floats) each way: gshard's record counts each permute once
  # per trip (they are conditionals, skipped in ticks where nobody sends), so
  # each direction is num_ticks micro-batches
  k, m, batch = 4, 4, 16
  layers, lp, x, t = _inputs(jax.random.PRNGKey(1), tanh_layers, 4 * v, batch)
  stacked = pipeline.stack(layers, repeats=v)
  sched = pipeline.schedule(name, num_stages=k, num_microbatches=m, repeats=v,
                            lockstep=lockstep)
  step = gshard.partition(piped(tanh_layer, m, schedule=sched if lockstep else name, repeats=v),
                          mesh((4,), ("stage",)),
                          in_specs=(param_specs(layers, stage_dim=int(v > 1)), P(), P(), P()))
  low = step.lower(stacked, lp, x, t)
  permutes = [c for c in low.collectives() if c.kind == "ppermute"]
  assert len(permutes) == 2 and all(c.axes == ("stage",) for c in permutes)
  assert [c.bytes for c in permutes] == [sched.num_ticks * (batch // m) * D * 4] * 2
  # nothing else in the tick loop (after it: the stage sums of loss and grads)
  assert {c.kind for c in low.collectives()} == {"ppermute", "psum"}, low.explain()
  loops = [e for e in low.per_device_jaxpr().eqns if e.primitive.name == "scan"
           and e.params["length"] == sched.num_ticks]
  assert len(loops) == 1
  conds = [e for e in loops[0].params["jaxpr"].jaxpr.eqns if e.primitive.name == "cond"]
  if lockstep:      # one conditional phase per kind of action: F, H (loss), B (and W)
    assert len(conds) == 3 + sched.split
  else:             # one switch over the stage's own action (idle, F, F and loss, B, W)
    # and the two shifts
    kinds = {a.kind for row in sched.table for a in row if a is not None}
    assert sorted(len(e.params["branches"]) for e in conds) == [2, 2, 2 + len(kinds)]


def test_each_stage_runs_only_its_own_action():
  # the published 1F1B mixes forwards and backwards in a tick: the per-device
  # program switches on the device's own entry of the table (a scalar index,
  # one branch runs), where computing every action and masking would have no
  # switch at all; the idle branch computes nothing
  sched = pipeline.schedule("1f1b", num_stages=2, num_microbatches=4)
  layers, lp, x, t = _inputs(jax.random.PRNGKey(2), tanh_layers, 2, 16)
  step = gshard.partition(piped(tanh_layer, 4, schedule="1f1b"), mesh((2,), ("stage",)),
                          in_specs=(param_specs(layers), P(), P(), P()))
  with warnings.catch_warnings():
    warnings.simplefilter("error", SwitchWarning)      # not the compute-everything fallback
    low = step.lower(pipeline.stack(layers), lp, x, t)
  loop = next(e for e in low.per_device_jaxpr().eqns if e.primitive.name == "scan"
              and e.params["length"] == sched.num_ticks)
  switch = max((e for e in loop.params["jaxpr"].jaxpr.eqns if e.primitive.name == "cond"),
               key=lambda e: len(e.params["branches"]))
  assert len(switch.params["branches"]) == 4           # idle, F, F and the loss, B
  assert switch.invars[0].aval.shape == ()
  idle = {q.primitive.name for q in switch.params["branches"][0].jaxpr.eqns}
  assert not idle & {"dot_general", "tanh", "scan"}, idle


def _temp(sched_name, m, batch=256, k=4):
  layers = megatron_layers(jax.random.PRNGKey(0), 2 * k)
  stacked = pipeline.stack(layers)
  x = jnp.ones((batch, D))

  def loss(stacked, x):
    return pipeline.run(megatron_layer, stacked, x, num_microbatches=m, schedule=sched_name,
                        loss_fn=lambda lp, y, t: jnp.mean((y - t) ** 2), loss_params=(),
                        targets=x, remat=False)
  step = gshard.partition(jax.grad(loss), mesh((k,), ("stage",)),
                          in_specs=(param_specs(layers), P()))
  return step.lower(stacked, x).compile().memory_analysis().temp_size_in_bytes


def test_1f1b_temp_memory_shrinks_with_m_where_gpipes_does_not():
  # At a fixed batch B a micro-batch is B/M rows. GPipe's table keeps every
  # micro-batch's stash, the whole batch whatever M; 1F1B at most K = 4
  # micro-batches: 4/4 -> 4/32 of the batch from M=4 to 32 (x0.125). The
  # gradients, weights and I/O are the same in both and do not depend on M.
  gpipe = [_temp("gpipe", m) for m in (4, 32)]
  one = [_temp("1f1b", m) for m in (4, 32)]
  assert gpipe[1] >= 0.625 * gpipe[0], gpipe
  assert one[1] <= 0.35 * one[0], one
  assert one[1] <= 0.35 * gpipe[1], (one, gpipe)


OFFLOAD = jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")


@pytest.mark.parametrize("kw", [{"schedule": "1f1b"}, {"schedule": "zero_bubble"},
                                {"schedule": "interleaved", "repeats": 2},
                                {"schedule": "gpipe"}], ids=lambda kw: kw["schedule"])
def test_an_offloading_remat_policy_saves_on_the_device_with_a_warning(kw):
  """The executor selects residuals by stage and tick from device buffers,
  and jax cannot select between host and device values: an offloading
  policy's residuals are saved on the device instead, with a warning; the
  values are the plain loop's (found by review: jax's select_n/cond error)."""
  layers, lp, x, t = _inputs(jax.random.PRNGKey(11), megatron_layers, 8, 16)
  layout = {"repeats": kw["repeats"]} if "repeats" in kw else {}
  stacked = pipeline.stack(layers, **layout)
  specs = param_specs(layers, stage_dim=1 if layout else 0, model=False)
  step = gshard.partition(piped(megatron_layer, 4, remat=OFFLOAD, **kw),
                          mesh((2, 4), ("data", "stage")), in_specs=(specs, P(), P("data"),
                                                                     P("data")))
  with pytest.warns(UserWarning, match="saved on the device instead"):
    got = step(stacked, lp, x, t)
  check(megatron_layer, layers, lp, x, t, got, layout, f"offload {kw}")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
def test_an_int_leaf_in_loss_params(schedule):
  """loss_params with an int leaf (a class-count scale): the head's vjp was
  taken over every leaf, and the int leaf's float0 cotangent met the
  accumulator (jax's 'float0 is not a valid dtype for type promotion')."""
  from gshard import pipeline
  stacked = pipeline.stack([{"w": jnp.eye(4) * (i + 1) / 4} for i in range(4)])
  x = jnp.linspace(-1, 1, 32).reshape(8, 4)
  lp = {"w": jnp.ones((4, 3)) / 3, "n": jnp.int32(2)}
  t = jnp.linspace(0, 1, 24).reshape(8, 3)

  def head(lp, y, t):
    return jnp.mean((y @ lp["w"] * lp["n"] - t) ** 2)

  def loss(s, x, lp, t):
    return pipeline.run(lambda p, h: jnp.tanh(h @ p["w"]), s, x, num_microbatches=4,
                        schedule=schedule, loss_fn=head, loss_params=lp, targets=t)

  m = gshard.make_mesh((2, 4), ("data", "stage"))
  g = lambda s, x, lp, t: jax.value_and_grad(loss)(s, x, lp, t)
  dw = lambda s, x, lp, t: jax.grad(lambda w: loss(s, x, {"w": w, "n": lp["n"]}, t))(lp["w"])
  want = (jax.jit(g)(stacked, x, lp, t), jax.jit(dw)(stacked, x, lp, t))
  got = (gshard.partition(g, m)(stacked, x, lp, t), gshard.partition(dw, m)(stacked, x, lp, t))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_derivatives_beyond_reverse_mode_are_gshards_error_or_equal():
  """With loss_fn the schedule computes the gradients itself, as a
  custom_vjp: jax.jvp / jacfwd of it failed with jax's internals ('can't
  apply forward-mode autodiff', raised while compiling), and a second
  derivative through a per-stage switch with "Differentiation rule for
  'stage_switch' not implemented". Each is now gshard's error naming what
  works; GPipe's second derivatives (its loop is differentiated by jax)
  equal the plain loop's."""
  stacked = pipeline.stack([{"w": jnp.eye(4) * (i + 1) / 4} for i in range(4)])
  x = jnp.linspace(-1, 1, 32).reshape(8, 4)
  t = jnp.linspace(0, 1, 32).reshape(8, 4)
  m = mesh((2, 4), ("data", "stage"))

  def loss(schedule):
    def f(s, x, scale):
      return pipeline.run(lambda p, h: jnp.tanh(h @ p["w"]), s, x, num_microbatches=4,
                          schedule=schedule, targets=t, loss_params=scale,
                          loss_fn=lambda lp, y, t: jnp.mean((y * lp - t) ** 2))
    return f

  ones = jnp.ones_like(x)
  for schedule in ("gpipe", "1f1b", "zero_bubble"):
    f = loss(schedule)
    jvp = lambda s, x, c, f=f: jax.jvp(lambda x: f(s, x, c), (x,), (ones,))
    fwd = lambda s, x, c, f=f: jax.jacfwd(f, argnums=2)(s, x, c)
    for g in (jvp, fwd):
      with pytest.raises(TypeError, match=rf"schedule='{schedule}'\) on a mesh .* reverse "
                         r"mode .* only.*without loss_fn"):
        gshard.partition(g, m)(stacked, x, jnp.float32(1.5))
  second = lambda s, x, c, f: jax.grad(lambda c: jax.grad(f, argnums=2)(s, x, c))(c)
  with pytest.raises(NotImplementedError, match="first derivatives only.*schedule='gpipe'"):
    gshard.partition(lambda s, x, c: second(s, x, c, loss("1f1b")), m)(
        stacked, x, jnp.float32(1.5))
  f = lambda s, x, c: second(s, x, c, loss("gpipe"))
  np.testing.assert_allclose(gshard.partition(f, m)(stacked, x, jnp.float32(1.5)),
                             jax.jit(f)(stacked, x, jnp.float32(1.5)), rtol=1e-5)


def test_jvp_of_a_users_custom_vjp_is_gshards_error():
  """jax.jvp of a user's custom_vjp function stages an equation nothing
  lowers; jax raised while compiling, from its own frames."""
  @jax.custom_vjp
  def f(x):
    return jnp.sin(x)
  f.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x),))
  g = lambda x: jax.jvp(f, (x,), (jnp.ones_like(x),))
  with pytest.raises(TypeError, match=r"forward-mode .* jax.custom_vjp function at .*"
                     r"test_pipeline_executor.py.*jax.custom_jvp"):
    gshard.partition(g, mesh((8,), ("x",)), in_specs=P("x"))(jnp.ones(8))
  # a tangent nothing reads (jax.jit drops it): runs, at the top and in a jit
  def dead(x):
    (a, b), (da, _) = jax.jvp(lambda x: (jnp.sin(x), f(x)), (x,), (jnp.ones_like(x),))
    return a + b, da
  x = jnp.arange(8.0) - 4
  for h in (dead, jax.jit(dead)):
    got = gshard.partition(h, mesh((8,), ("x",)), in_specs=P("x"))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(dead)(x)), rtol=1e-6)
