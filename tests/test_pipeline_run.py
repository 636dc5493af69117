"""``gshard.pipeline.run``: GPipe inside the partitioned program equals the plain loop.

Every pipelined loss and gradient is compared with a Python loop over the
unstacked layers written here (not ``run``). Tolerances are derived: both the
float32 pipeline and the float32 plain loop are compared with the float64
plain loop; the pipeline's error (relative to each leaf's largest entry) may
be at most 4x the plain loop's plus 8 float32 epsilons (the pipeline sums the
batch mean and every weight gradient in another order: per micro-batch, per
tick). Both are also held under 1e-5.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import gshard
from gshard import pipeline
from gshard.annotate import current_mesh_sizes
from helpers_numerics import assert_close_to_f64, to_host
from helpers_partition import mesh

D, H = 16, 32


# -- models ------------------------------------------------------------------------

def tanh_layer(p, h):
  return jnp.tanh(h @ p["w"] + p["b"])


def megatron_layer(p, h):
  """A residual Megatron MLP: columns of w1, rows of w2 over ``model`` when the
  mesh has it (the annotation names the mesh's axes)."""
  u = jax.nn.gelu(h @ p["w1"])
  axes = current_mesh_sizes() or {}
  if "model" in axes:
    u = gshard.shard(u, P("data" if "data" in axes else None, "model"))
  return h + u @ p["w2"] * 0.5


def tanh_layers(key, n):
  keys = jax.random.split(key, n)
  return [{"w": jax.random.normal(k, (D, D)) / D ** 0.5,
           "b": jax.random.normal(jax.random.fold_in(k, 1), (D,)) * 0.1} for k in keys]


def megatron_layers(key, n):
  keys = jax.random.split(key, n)
  return [{"w1": jax.random.normal(k, (D, H)) / D ** 0.5,
           "w2": jax.random.normal(jax.random.fold_in(k, 1), (H, D)) / H ** 0.5} for k in keys]


def plain_loss(layer_fn, layers, x, y):
  """The reference: a Python loop over the layers, then a squared error."""
  h = x
  for p in layers:
    h = layer_fn(p, h)
  return jnp.mean((h - y) ** 2)


def pipe_loss(layer_fn, m, **kw):
  def loss(stacked, x, y):
    return jnp.mean((pipeline.run(layer_fn, stacked, x, num_microbatches=m, **kw) - y) ** 2)
  return loss


def _f64(tree):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def check_against_plain(layer_fn, layers, x, y, got, *, layout=None, what=""):
  """``got`` (loss, gradients of the stack) against the float32 and the float64
  plain loop (gradients restacked in ``got``'s layout), within the derived
  bound of ``helpers_numerics`` (the longest sum: the batch rows of a weight
  gradient, or a matmul's D or H)."""
  layout = layout or {}
  loss32, grads32 = jax.value_and_grad(lambda ls: plain_loss(layer_fn, ls, x, y))(layers)
  with jax.enable_x64(True):
    loss64, grads64 = jax.value_and_grad(lambda ls: plain_loss(layer_fn, ls, *_f64((x, y))))(
        _f64(layers))
    exact = jax.tree.map(np.asarray, (loss64, pipeline.stack(grads64, **layout)))
  ref32 = to_host((loss32, pipeline.stack(grads32, **layout)))
  assert_close_to_f64(to_host(got), ref32, exact, n=max(x.shape[0], D, H), what=f"{what}: ")


def param_specs(layers, *, stage_dim=0, model=False):
  """in_specs of a stack: the layer dim(s) over ``stage``; Megatron over ``model``."""
  lead = (None,) * stage_dim + ("stage",)
  if "w" in layers[0]:
    return {"w": P(*lead), "b": P(*lead)}
  col, row = ("model", None) if model else (None, None)
  return {"w1": P(*lead, None, col), "w2": P(*lead, col, None)}


# -- equal to the plain loop ---------------------------------------------------------

CASES = [
    # name, mesh, layer, L, M, run kwargs
    ("K4 M4", ((4,), ("stage",)), "tanh", 8, 4, {}),
    ("K4 M8", ((4,), ("stage",)), "tanh", 8, 8, {}),
    ("K4 M16", ((4,), ("stage",)), "tanh", 4, 16, {}),
    ("K4 M8 data2", ((2, 4), ("data", "stage")), "tanh", 8, 8, {}),
    ("K2 M2 data4", ((4, 2), ("data", "stage")), "tanh", 4, 2, {}),
    ("K2 M4 data4", ((4, 2), ("data", "stage")), "tanh", 4, 4, {}),
    ("K2 M8 data4", ((4, 2), ("data", "stage")), "megatron", 6, 8, {}),
    ("megatron K2 M2", ((2, 2, 2), ("data", "stage", "model")), "megatron", 4, 2, {}),
    ("megatron K2 M4", ((2, 2, 2), ("data", "stage", "model")), "megatron", 4, 4, {}),
    ("circular K4 M8", ((2, 4), ("data", "stage")), "tanh", 16, 8, {"repeats": 2}),
    ("circular K2 M4", ((2, 2, 2), ("data", "stage", "model")), "megatron", 8, 4,
     {"repeats": 2}),
    ("balance 1331", ((4,), ("stage",)), "tanh", 8, 4, {"balance": [1, 3, 3, 1]}),
    ("balance 31 data4", ((4, 2), ("data", "stage")), "megatron", 4, 4, {"balance": [3, 1]}),
    ("no remat", ((2, 4), ("data", "stage")), "megatron", 8, 4, {"remat": False}),
    ("policy", ((2, 4), ("data", "stage")), "megatron", 8, 4,
     {"remat": jax.checkpoint_policies.dots_saveable}),
    ("circular no remat", ((2, 4), ("data", "stage")), "tanh", 8, 4,
     {"repeats": 2, "remat": False}),
]


@pytest.mark.parametrize("name, mesh_args, layer, num_layers, m, kw", CASES,
                         ids=[c[0] for c in CASES])
def test_pipeline_equals_plain_loop(name, mesh_args, layer, num_layers, m, kw):
  layer_fn, make = ((tanh_layer, tanh_layers) if layer == "tanh" else
                    (megatron_layer, megatron_layers))
  key = jax.random.PRNGKey(len(name))
  layers = make(key, num_layers)
  batch = 32 if m == 8 else 16     # a micro-batch of 4 rows: 1 per device over data=4
  x = jax.random.normal(jax.random.fold_in(key, 7), (batch, D))
  y = jax.random.normal(jax.random.fold_in(key, 8), (batch, D))
  layout = {k: kw[k] for k in ("repeats", "balance") if k in kw}
  stacked = pipeline.stack(layers, **layout)
  m_ = mesh(*mesh_args)
  stage_dim = 1 if kw.get("repeats", 1) > 1 else 0
  specs = param_specs(layers, stage_dim=stage_dim, model="model" in mesh_args[1])
  data = P("data") if "data" in mesh_args[1] else P()
  step = gshard.partition(jax.value_and_grad(pipe_loss(layer_fn, m, **kw)), m_,
                          in_specs=(specs, data, data))
  got = step(stacked, x, y)
  check_against_plain(layer_fn, layers, x, y, got, layout=layout, what=name)
  low = step.lower(stacked, x, y)
  kinds = {(c.kind, c.axes) for c in low.collectives()}
  assert ("ppermute", ("stage",)) in kinds
  assert not any(c.kind == "all_gather" for c in low.collectives()), low.explain()
  assert low.fallbacks == []
  if layer == "megatron" and "model" in mesh_args[1]:
    assert ("psum", ("model",)) in kinds


def test_off_mesh_run_is_the_plain_loop():
  """Off a mesh ``run`` is the plain loop in the stack's layer order (a scan of
  the layers, compiled its own way: within the derived bound of the f64 loop,
  as the Python loop of eager layers is)."""
  layers = tanh_layers(jax.random.PRNGKey(0), 8)
  x = jax.random.normal(jax.random.PRNGKey(1), (12, D))
  want = x
  for p in layers:
    want = tanh_layer(p, want)
  with jax.enable_x64(True):
    exact = _f64(x)
    for p in _f64(layers):
      exact = tanh_layer(p, exact)
    exact = np.asarray(exact)
  for layout in ({}, {"repeats": 2}, {"balance": [1, 3, 3, 1]}, {"repeats": 4}):
    stacked = pipeline.stack(layers, **layout)
    for remat in (True, False):
      got = pipeline.run(tanh_layer, stacked, x, num_microbatches=3, remat=remat, **layout)
      assert_close_to_f64(to_host(got), to_host(want), exact, n=D, what=f"{layout}: ")
      got = jax.jit(lambda s, x: pipeline.run(tanh_layer, s, x, num_microbatches=4,
                                               remat=remat, **layout))(stacked, x)
      assert_close_to_f64(to_host(got), to_host(want), exact, n=D, what=f"jit {layout}: ")


def test_on_a_mesh_without_the_stage_axis_run_is_the_plain_loop():
  layers = megatron_layers(jax.random.PRNGKey(0), 4)
  x = jax.random.normal(jax.random.PRNGKey(1), (16, D))
  y = jnp.zeros((16, D))
  m = mesh((2, 4), ("data", "model"))
  specs = {"w1": P(None, None, "model"), "w2": P(None, "model", None)}
  step = gshard.partition(jax.value_and_grad(pipe_loss(megatron_layer, 4)), m,
                          in_specs=(specs, P("data"), P("data")))
  got = step(pipeline.stack(layers), x, y)
  check_against_plain(megatron_layer, layers, x, y, got, what="no stage axis")
  assert "ppermute" not in {c.kind for c in step.lower(pipeline.stack(layers), x, y)
                            .collectives()}


def test_pytree_activations():
  """``x`` may be a pytree: every leaf is micro-batched and passed along."""
  def layer(p, hs):
    a, b = hs["a"], hs["b"]
    return {"a": jnp.tanh(a @ p["w"] + b[:, :1]), "b": b * 0.5 + a[:, :2]}

  layers = tanh_layers(jax.random.PRNGKey(0), 4)
  xs = {"a": jax.random.normal(jax.random.PRNGKey(1), (8, D)),
        "b": jax.random.normal(jax.random.PRNGKey(2), (8, 2))}

  def loss(run_fn):
    def f(stacked, xs):
      out = run_fn(stacked, xs)
      return jnp.sum(out["a"] ** 2) + jnp.sum(out["b"] ** 3)
    return f

  ref = jax.value_and_grad(loss(lambda s, xs: pipeline.run(layer, s, xs,
                                                           num_microbatches=4)))(
      pipeline.stack(layers), xs)
  step = gshard.partition(jax.value_and_grad(loss(
      lambda s, xs: pipeline.run(layer, s, xs, num_microbatches=4))), mesh((4,), ("stage",)),
      in_specs=({"w": P("stage"), "b": P("stage")}, None))
  got = step(pipeline.stack(layers), xs)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    np.testing.assert_allclose(g, r, rtol=2e-5, atol=1e-6)


# -- bubbles never leak ---------------------------------------------------------------

def sqrt_layer(p, h):
  """Finite only for h >= 0, with an infinite derivative at 0: a garbage (NaN,
  negative or zero) input anywhere would reach the loss or the gradients."""
  return jax.nn.softplus(h @ p["w"]) + jnp.sqrt(h) + jnp.log(h)


@pytest.mark.parametrize("kw", [{}, {"repeats": 2}, {"balance": [1, 2]}, {"remat": False}],
                         ids=["gpipe", "circular", "balance", "no remat"])
def test_nan_filled_buffers_never_reach_values_or_gradients(monkeypatch, kw):
  from gshard.pipeline import loop
  monkeypatch.setattr(loop, "_initial_buffer",
                      lambda shape, dtype: jnp.full(shape, jnp.nan, dtype))
  layers = [{"w": jax.random.normal(k, (D, D)) * 0.1, "b": jnp.zeros(D)}
            for k in jax.random.split(jax.random.PRNGKey(3), 4 if kw != {"balance": [1, 2]}
                                      else 3)]
  x = jax.random.uniform(jax.random.PRNGKey(4), (8, D), minval=0.5, maxval=2.0)
  y = jnp.zeros((8, D))
  layout = {k: kw[k] for k in ("repeats", "balance") if k in kw}
  step = gshard.partition(jax.value_and_grad(pipe_loss(sqrt_layer, 4, **kw)),
                          mesh((2,), ("stage",)),
                          in_specs=({"w": P(*(None,) * ("repeats" in kw), "stage"),
                                     "b": P(*(None,) * ("repeats" in kw), "stage")},
                                    None, None))
  got = step(pipeline.stack(layers, **layout), x, y)
  assert all(bool(np.all(np.isfinite(g))) for g in jax.tree.leaves(got)), got
  check_against_plain(sqrt_layer, layers, x, y, got, layout=layout, what=str(kw))


# -- errors name the argument, the shape, the mesh and a fix -----------------------------

def _trace(fn, m, *args):
  return gshard.partition(fn, mesh(*m)).lower(*args)


ERRORS = [
    (lambda s, x: pipeline.run(tanh_layer, s, x, num_microbatches=5), ((4,), ("stage",)), 8,
     {}, r"x has batch 16 \(shape \(16, 16\)\), which num_microbatches=5 does not divide "
         r"\(on mesh \(stage=4\)\)\. Use one of \[1, 2, 4, 8, 16\]"),
    (lambda s, x: pipeline.run(tanh_layer, s, x, num_microbatches=4), ((4,), ("stage",)), 6,
     {}, r"L=6 layers cannot be cut evenly into 4 stages \(stage_axis 'stage' on mesh "
         r"\(stage=4\)\)\. Use a multiple of 4 layers, or unequal stages: "
         r"balance=pipeline.balance\(costs, num_stages=4\)"),
    (lambda s, x: pipeline.run(tanh_layer, s, x, num_microbatches=4, repeats=2),
     ((4,), ("stage",)), 12, {"repeats": 2},
     r"L/repeats=6 layers per chunk \(L=12, repeats=2\) cannot be cut evenly into 4 stages"),
    (lambda s, x: pipeline.run(tanh_layer, s, x, num_microbatches=2, repeats=2),
     ((4,), ("stage",)), 16, {"repeats": 2},
     r"num_microbatches=2 must be a multiple of the 4 stages .* Use num_microbatches=4"),
    (lambda s, x: pipeline.run(tanh_layer, s, x, num_microbatches=4, balance=[2, 2, 4]),
     ((4,), ("stage",)), 8, {"balance": [2, 2, 4]},
     r"balance=\[2, 2, 4\] has 3 stages, but stage_axis 'stage' has 4 devices on mesh "
     r"\(stage=4\)\. Give 4 counts"),
    (lambda s, x: pipeline.run(tanh_layer, s, x, num_microbatches=4, repeats=2),
     ((4,), ("stage",)), 8, {},
     r"leaf \['b'\] has shape \(8, 16\); with repeats=2 every leaf is \[repeats, L/repeats, "
     r"\.\.\.\] = \[2, L/2, \.\.\.\]\. Use pipeline.stack\(layer_params, repeats=2\)"),
    (lambda s, x: pipeline.run(tanh_layer, s, x, num_microbatches=4, balance=[1, 3]),
     ((2,), ("stage",)), 4, {},
     r"leaf \['w'\] has shape \(4, 16, 16\), but stacked leaf \['b'\] has shape \(4, 16\)"
     r"|leaf \['b'\] has shape \(4, 16\).*\[2, 3, \.\.\.\]"),
    (lambda s, x: pipeline.run(tanh_layer, s, x, num_microbatches=4, schedule="1f1b"),
     ((4,), ("stage",)), 8, {}, r"run\(schedule='1f1b'\) needs loss_fn=\.\.\. \(on mesh"),
    (lambda s, x: pipeline.run(tanh_layer, s, x, num_microbatches=4, remat="yes"),
     ((4,), ("stage",)), 8, {}, r"remat must be True, False or a jax.checkpoint policy"),
    (lambda s, x: pipeline.run(lambda p, h: h[:, :2], s, x, num_microbatches=4),
     ((4,), ("stage",)), 8, {}, r"layer_fn\(one_layer_params, x\) must return x's structure"),
    (lambda s, x: pipeline.run(tanh_layer, s, x, num_microbatches=4, balance=[2, 2],
                               repeats=2),
     ((2,), ("stage",)), 4, {"balance": [2, 2]}, r"run supports unequal stages with "
                                                   r"repeats=1 only"),
]


@pytest.mark.parametrize("fn, mesh_args, num_layers, layout, message", ERRORS)
def test_errors_name_the_argument_shape_mesh_and_fix(fn, mesh_args, num_layers, layout,
                                                     message):
  stacked = pipeline.stack(tanh_layers(jax.random.PRNGKey(0), num_layers), **layout)
  with pytest.raises(ValueError, match=message):
    _trace(fn, mesh_args, stacked, jnp.ones((16, D)))


def test_off_mesh_errors_too():
  stacked = pipeline.stack(tanh_layers(jax.random.PRNGKey(0), 4))
  with pytest.raises(ValueError, match=r"num_microbatches=3 does not divide \(off mesh\)"):
    pipeline.run(tanh_layer, stacked, jnp.ones((16, D)), num_microbatches=3)


def test_stack_errors_and_round_trip():
  layers = tanh_layers(jax.random.PRNGKey(0), 6)
  with pytest.raises(ValueError, match=r"balance=\[1, 2\] sums to 3, but there are 6 layers"):
    pipeline.stack(layers, balance=[1, 2])
  with pytest.raises(ValueError, match=r"repeats=4 must divide the number of layers 6"):
    pipeline.stack(layers, repeats=4)
  with pytest.raises(ValueError, match=r"leaf 0 of layer 1 is float32\[3\]"):
    pipeline.stack([{"w": jnp.ones(2)}, {"w": jnp.ones(3)}])
  for layout in ({}, {"repeats": 3}, {"balance": [1, 4, 1]}):
    stacked = pipeline.stack(layers, **layout)
    back = pipeline.unstack(stacked, **layout)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(layers)):
      np.testing.assert_array_equal(a, b)
  padded = pipeline.stack(layers, balance=[1, 4, 1])
  assert padded["w"].shape == (3, 4, D, D)
  np.testing.assert_array_equal(padded["w"][0, 1:], 0)
  np.testing.assert_array_equal(padded["w"][1], jnp.stack([p["w"] for p in layers[1:5]]))
  assert pipeline.stack(layers, repeats=3)["w"].shape == (3, 2, D, D)


# -- the example: layers before and after the stack on the same mesh --------------------

def test_pipelined_gpt_example_matches_the_plain_loop_and_trains():
  """examples/pipeline_gpt.py: embedding, 8 pipelined blocks over (data=2, stage=4),
  head and loss in one partitioned Adam step; its first loss is the plain loop's."""
  from examples import pipeline_gpt
  losses, plain, low = pipeline_gpt.train(steps=3, verbose=False)
  assert abs(losses[0] - plain) <= 1e-5 * abs(plain), (losses[0], plain)
  assert losses[-1] < losses[0]
  permutes = [c for c in low.collectives() if c.kind == "ppermute"]
  assert [c.axes for c in permutes] == [("stage",), ("stage",)]
  assert not any(c.kind == "all_gather" for c in low.collectives())
  assert low.fallbacks == []


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from([(2, None), (4, None), (2, (1, 2)), (2, (3, 1)), (4, (2, 1, 1, 2))]),
       st.integers(1, 6), st.booleans())
def test_bubbles_and_idle_slots_never_reach_the_gradient(stages, m, remat):
  """A layer defined only on its real inputs (``sqrt(a * h)``: the first
  layer flips the negative input's sign, every later one takes the square
  root of a positive). A bubble computes on a raw micro-batch and a short
  stage's idle slot on zero weights (``h / t`` with t = 0): their outputs are
  dropped, and their backward pass multiplied a zero cotangent by inf or NaN,
  so NaN reached the weights' and the input's gradients. Equal to the plain
  loop, finite."""
  k, balance = stages
  n = k if balance is None else sum(balance)
  layers = [{"a": jnp.float32(-1.0 if i == 0 else 1.0), "t": jnp.float32(1.0 + i / n)}
            for i in range(n)]
  x = -jnp.arange(1.0, 2.0 * m + 1).reshape(2 * m, 1)

  def layer(p, h):
    return jnp.sqrt(p["a"] * h) / p["t"]

  def loss(s, x, balance=None):
    return jnp.sum(pipeline.run(layer, s, x, num_microbatches=m, remat=remat,
                                balance=balance) ** 2)

  want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(pipeline.stack(layers), x)
  m8 = mesh((k, 8 // k), ("stage", "data"))
  got = gshard.partition(
      jax.value_and_grad(lambda s, x: loss(s, x, balance), argnums=(0, 1)), m8,
      in_specs=({"a": P("stage"), "t": P("stage")}, None))(
          pipeline.stack(layers, balance=balance) if balance else pipeline.stack(layers), x)
  if balance:      # the padded [K, S] grads back in layer order, the zero slots dropped
    got = (got[0], (pipeline.unstack(got[1][0], balance=balance), got[1][1]))
    got = (got[0], (pipeline.stack(got[1][0]), got[1][1]))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert np.isfinite(np.asarray(g)).all()
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
  # forward mode through the same loop: the gate is a JVP rule (a custom_vjp
  # refused jax.jvp), its tangents cut where its cotangents are; tangent one
  # for every weight (an idle slot's padding too: it is skipped) and input
  def jvp(s, x, balance=None):
    ones = jax.tree.map(jnp.ones_like, (s, x))
    return jax.jvp(lambda s, x: loss(s, x, balance), (s, x), ones)
  want = jax.jit(jvp)(pipeline.stack(layers), x)
  got = gshard.partition(lambda s, x: jvp(s, x, balance), m8,
                         in_specs=({"a": P("stage"), "t": P("stage")}, None))(
      pipeline.stack(layers, balance=balance) if balance else pipeline.stack(layers), x)
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_a_function_traced_before_is_traced_again_for_the_mesh():
  """jax keys its traces by the function, not by gshard's mesh context, which
  pipeline.run reads: after jax.jit(f), partition(f) over a stage mesh ran the
  plain loop; after partition(f) over a stage mesh, partition(f) over a mesh
  without 'stage' raised "mesh axis 'stage' is not in the mesh"."""
  stacked = pipeline.stack([{"w": jnp.eye(4) * (i + 1) / 4} for i in range(4)])
  x = jnp.linspace(0.1, 1, 32).reshape(8, 4)

  def f(s, x):
    return jnp.sum(pipeline.run(lambda p, h: jnp.tanh(h @ p["w"]), s, x, num_microbatches=4))

  want = float(jax.jit(f)(stacked, x))
  low = gshard.partition(f, mesh((2, 4), ("data", "stage"))).lower(stacked, x)
  assert "ppermute" in {c.kind for c in low.collectives()}
  other = gshard.partition(f, mesh((2, 4), ("data", "model")))(stacked, x)
  np.testing.assert_allclose([float(low.compile()(stacked, x)), float(other)], [want, want],
                             rtol=1e-6)


def test_a_random_draw_in_layer_fn_is_warned():
  """A dropout mask drawn in layer_fn from a closed-over key: the pipeline
  draws one per micro-batch, of its rows' shape, not the plain loop's draw
  for the whole batch, so values differ (found by a review of client code):
  a PartitionWarning names the draw's line. Without a draw, none."""
  stacked = pipeline.stack([{"w": jnp.eye(4) * (i + 1) / 4} for i in range(4)])
  x = jnp.linspace(-1, 1, 32).reshape(8, 4)
  key = jax.random.key(0)

  def dropout_layer(p, h):
    return jnp.tanh(h @ p["w"]) * jax.random.bernoulli(key, 0.9, h.shape)

  m = mesh((4, 2), ("stage", "data"))
  f = lambda layer: lambda s, x: pipeline.run(layer, s, x, num_microbatches=4)
  with pytest.warns(gshard.PartitionWarning, match=r"draws random numbers \(random_bits at "
                    r".*test_pipeline_run.py.*pass it in x"):
    gshard.partition(f(dropout_layer), m).lower(stacked, x)
  with warnings.catch_warnings():
    warnings.simplefilter("error", gshard.PartitionWarning)
    gshard.partition(f(lambda p, h: jnp.tanh(h @ p["w"])), m).lower(stacked, x)


def test_side_inputs_in_x_keep_their_dtypes_and_keys_ride_along():
  """A bool padding mask, uint8 / int8 ids and typed PRNG keys (one per row,
  split in each layer for its dropout) carried in x: the pipelined program
  returns them in their own dtypes, with the plain loop's values, and warns
  of no draw (each row draws from its own key either way). The mask came
  back int32 (``~mask`` then flipped every bit: wrong numbers after run),
  and typed keys crashed inside jax (found by a review of pipelines)."""
  d = 8

  def layer(p, x):
    keys = jax.vmap(jax.random.split)(x["key"])
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 0.8, (d,)))(keys[:, 0])
    h = jnp.where(keep, jnp.tanh(x["h"] @ p["w"]) / 0.8, 0.0)
    return {**x, "h": h, "key": keys[:, 1]}

  stacked = pipeline.stack([{"w": jnp.eye(d) * (i + 2) / 4} for i in range(4)])
  x = {"h": jnp.linspace(-1, 1, 8 * d).reshape(8, d), "pad": jnp.arange(8) >= 6,
       "ids": jnp.arange(8, dtype=jnp.uint8) + 250, "small": -jnp.arange(8, dtype=jnp.int8),
       "key": jax.random.split(jax.random.key(0), 8)}

  def f(s, x):
    return pipeline.run(layer, s, x, num_microbatches=4)

  m = mesh((4, 2), ("stage", "data"))
  with warnings.catch_warnings():
    warnings.simplefilter("error", gshard.PartitionWarning)
    got = gshard.partition(f, m, in_specs=(P("stage"), P("data")))(stacked, x)
  want = jax.jit(f)(stacked, x)
  for name in ("pad", "ids", "small"):
    assert got[name].dtype == x[name].dtype, name
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(x[name]))
  assert got["key"].dtype == x["key"].dtype
  np.testing.assert_array_equal(np.asarray(jax.random.key_data(got["key"])),
                                np.asarray(jax.random.key_data(want["key"])))
  np.testing.assert_allclose(np.asarray(got["h"]), np.asarray(want["h"]), rtol=1e-6, atol=1e-7)


def test_a_draw_for_the_whole_micro_batch_from_a_carried_key_is_warned():
  """A key carried in x but one row's used for every row's bits: the bits'
  shape is the micro-batch's, not the batch's: warned as before."""
  stacked = pipeline.stack([{"w": jnp.eye(4)} for _ in range(4)])
  x = {"h": jnp.ones((8, 4)), "key": jax.random.split(jax.random.key(0), 8)}

  def layer(p, x):
    return {**x, "h": x["h"] * jax.random.bernoulli(x["key"][0], 0.9, x["h"].shape)}

  m = mesh((4, 2), ("stage", "data"))
  with pytest.warns(gshard.PartitionWarning, match=r"draws random numbers \(random_bits"):
    gshard.partition(lambda s, x: pipeline.run(layer, s, x, num_microbatches=4), m,
                     in_specs=(P("stage"), P("data"))).lower(stacked, x)


def test_a_jitted_forward_is_traced_again_for_each_mesh():
  """A model's jax.jit forward that calls run, called on one device first
  (an eval), then partitioned over 4 stages, then over 2: jax's trace cache
  reused the one-device trace (the stack all-gathered, no pipeline) and the
  4-stage trace on 2 stages (found by a review of pipelines). Each mesh now
  gets its own trace: ppermutes of its stages' blocks."""
  stacked = pipeline.stack([{"w": jnp.eye(16) * (i + 2) / 8, "b": jnp.zeros(16)}
                           for i in range(8)])
  x = jnp.linspace(-1, 1, 16 * 16).reshape(16, 16)

  @jax.jit
  def forward(s, x):
    return pipeline.run(tanh_layer, s, x, num_microbatches=4)

  step = lambda s, x: jax.grad(lambda s: jnp.mean(forward(s, x) ** 2))(s)  # noqa: E731
  want = jax.jit(step)(stacked, x)           # traces forward off mesh first
  for stages in (4, 2):
    m = mesh((stages, 8 // stages), ("stage", "data"))
    low = gshard.partition(step, m, in_specs=(P("stage"), P("data"))).lower(stacked, x)
    shifts = [c for c in low.collectives() if c.kind == "ppermute"]
    assert shifts and all(c.shape[0] == stages for c in shifts), low.collectives()
    assert not any(c.kind == "all_gather" for c in low.collectives())
    got = low.compile()(stacked, x)
    np.testing.assert_allclose(np.asarray(got["w"]), np.asarray(want["w"]), rtol=1e-5,
                               atol=1e-7)


def test_a_balanced_stack_run_without_balance_names_it():
  """Leaves of pipeline.stack(..., balance=[2,2,2,2]) are [4, 2, ...]; run
  without balance= takes [2, ...] as one layer's parameters, and its error
  blamed layer_fn alone (found by a review of pipelines): it now shows one
  layer's parameter shapes and names balance=."""
  stacked = pipeline.stack([{"w": jnp.eye(8)} for _ in range(8)], balance=[2, 2, 2, 2])
  f = lambda s, x: pipeline.run(lambda p, h: jnp.tanh(h @ p["w"]), s, x,  # noqa: E731
                                num_microbatches=4)
  with pytest.raises(ValueError, match=r"had shapes \[\(2, 8, 8\)\].*pass the same balance="):
    gshard.partition(f, mesh((4, 2), ("stage", "data")),
                     in_specs=(P("stage"), P("data")))(stacked, jnp.ones((16, 8)))


def test_the_bubble_gate_keeps_no_weight_sized_mask_per_tick():
  """The bubble gate's JVP selects tangents with a mask of each value's
  shape; linearised as it was, that mask was a residual of every layer's
  weights (and activations) in every tick, bool[T, S, 1, D, H]: temporary
  memory 2.3 MB where 1.1 MB held before the gate became a JVP rule
  (found re-running the pipeline benchmark). It is rebuilt from the [K]
  flags in the backward pass now."""
  import jax.extend
  d, hidden = 64, 256
  stacked = pipeline.stack([{"w1": jnp.ones((d, hidden)) / d, "w2": jnp.ones((hidden, d)) / hidden}
                            for _ in range(8)])
  x = jnp.ones((256, d))

  def layer(p, h):
    return h + jax.nn.gelu(h @ p["w1"]) @ p["w2"]

  def loss(s, x):
    return jnp.mean(pipeline.run(layer, s, x, num_microbatches=16) ** 2)

  low = gshard.partition(jax.grad(loss), mesh((4,), ("stage",)),
                         in_specs=(P("stage"), None)).lower(stacked, x)

  def stacked_outs(j):
    for e in j.eqns:
      if e.primitive.name == "scan":
        yield from e.outvars
      for sub in jax.extend.core.jaxprs_in_params(e.params):
        yield from stacked_outs(sub)

  weight_shapes = {(d, hidden), (hidden, d)}
  masks = [v.aval for v in stacked_outs(low.per_device_jaxpr())
           if v.aval.dtype == np.bool_ and tuple(v.aval.shape[-2:]) in weight_shapes]
  assert not masks, masks


@pytest.mark.parametrize("axis, warned", [("stages", True), ("Stage", True), ("stage", False),
                                          ("pipe", False)])
def test_a_stage_axis_close_to_a_mesh_axis_warns(axis, warned):
  # A typo ran the plain loop quietly: the stack gathered whole on every
  # device, no pipeline. A name unlike every axis is the documented plain loop.
  stacked = pipeline.stack([{"w": jnp.eye(D) * 0.5, "b": jnp.zeros(D)} for _ in range(4)])
  x = jnp.ones((16, D))

  def f(stacked, x):
    return pipeline.run(tanh_layer, stacked, x, num_microbatches=4, stage_axis=axis)
  step = gshard.partition(f, mesh((2, 4), ("stage", "data")), in_specs=(P("stage"), P("data")))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    step.lower(stacked, x)
  said = [str(w.message) for w in caught if issubclass(w.category, gshard.PartitionWarning)
          and "stage_axis" in str(w.message)]
  if warned:
    assert len(said) == 1 and "Did you mean stage_axis='stage'?" in said[0], said
    assert all(w.filename == __file__ for w in caught if "stage_axis" in str(w.message))
  else:
    assert not said, said
