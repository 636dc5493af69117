"""End-to-end tests of ``gshard.partition``: same numbers as one device, on real
meshes of 8 CPU devices, plus the API contract (caching, placement, specs,
donation), the safe path, the primitives that need more than a local op, pod
scale lowering and the ``Lowered`` inspection object.

The reference is always the unannotated program run by ``jax.jit`` on one
device (annotations are identities there).
"""

from __future__ import annotations

import inspect
import math
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gshard
from examples import models as M
from gshard.spmd.registry import sharding_rule
from helpers_numerics import AdamSpec, check_steps
from helpers_partition import (assert_named_sharding, assert_trees_close,
                               check_shards_against_reference, hlo_collectives, mesh)

THIS_FILE = os.path.basename(__file__)


def line_of(fn, text: str) -> int:
  """The source line of ``fn`` containing ``text`` (absolute line number)."""
  lines, start = inspect.getsourcelines(fn)
  hits = [start + i for i, line in enumerate(lines) if text in line]
  assert len(hits) == 1, (text, hits)
  return hits[0]


# -- the Megatron MLP ----------------------------------------------------------

def mlp_batch(batch=16, d_model=32, seed=1):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return (jax.random.normal(k1, (batch, d_model)),
          jax.random.normal(k2, (batch, d_model)))


MLP_STEP = M.sgd_step(M.mlp_loss)
MLP_REF = jax.jit(MLP_STEP)
MLP_EXACT = jax.jit(MLP_STEP)        # traced in f64 by f64_run
MLP_N = 16 * 32                      # the loss's mean over mlp_batch: the longest sum


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (1, 8), (8, 1)])
def test_mlp_sgd_equals_one_device(shape):
  m = mesh(shape, ("data", "model"))
  params = M.mlp_init(jax.random.PRNGKey(0), 32, 128)
  step = gshard.partition(MLP_STEP, m, in_specs=(M.MLP_SPECS, P("data"), None))
  out = check_steps(step, MLP_REF, MLP_EXACT, (params,), mlp_batch(), n=MLP_N)
  low = step.lower(params, *mlp_batch())
  for k, (x, s) in enumerate(zip(jax.tree.leaves(out), low.out_shardings)):
    assert_named_sharding(x, m, s.to_spec(), f"output {k}")
  assert_named_sharding(out[0]["w1"], m, P(None, "model"), "w1")
  assert_named_sharding(out[0]["w2"], m, P("model", None), "w2")


def test_mlp_data_parallel_1d_mesh():
  """(8,) mesh named ``data``: parameters left to propagation end up replicated."""
  m = mesh((8,), ("data",))
  params = M.mlp_init(jax.random.PRNGKey(0), 32, 128)
  step = gshard.partition(MLP_STEP, m, in_specs=(None, P("data"), None))
  check_steps(step, MLP_REF, MLP_EXACT, (params,), mlp_batch(), n=MLP_N)
  low = step.lower(params, *mlp_batch())
  assert [s.to_spec() for s in low.in_shardings[:2]] == [P(None, None)] * 2
  kinds = {(c.kind, c.axes) for c in low.collectives()}
  assert kinds == {("psum", ("data",))}, kinds


def _mlp_loss_unannotated(params, x, y):
  return jnp.mean((jax.nn.gelu(x @ params["w1"]) @ params["w2"] - y) ** 2)


def test_mlp_tensor_parallel_1d_mesh():
  """(8,) mesh named ``model``: the hidden dim over 8 devices, batch replicated."""
  m = mesh((8,), ("model",))
  params = M.mlp_init(jax.random.PRNGKey(0), 32, 128)
  sgd = M.sgd_step(_mlp_loss_unannotated)
  step = gshard.partition(sgd, m, in_specs=(M.MLP_SPECS, None, None))
  check_steps(step, jax.jit(sgd), jax.jit(sgd), (params,), mlp_batch(), n=MLP_N)
  cols = step.lower(params, *mlp_batch()).collectives()
  assert {c.kind for c in cols} == {"psum"} and all(c.axes == ("model",) for c in cols)


def test_mlp_3d_mesh_hidden_split_over_two_axes():
  """(2,2,2) mesh: batch over ``data``, the hidden dim over ``(model, x)``."""
  m = mesh((2, 2, 2), ("data", "model", "x"))
  specs = {"w1": P(None, ("model", "x")), "w2": P(("model", "x"), None)}
  params = M.mlp_init(jax.random.PRNGKey(0), 32, 128)
  step = gshard.partition(MLP_STEP, m, in_specs=(specs, P("data"), None))
  out = check_steps(step, MLP_REF, MLP_EXACT, (params,), mlp_batch(), n=MLP_N)
  assert out[0]["w1"].sharding.spec == P(None, ("model", "x"))
  assert not [c for c in step.lower(params, *mlp_batch()).collectives()
              if c.kind == "all_gather"]


# -- the GPT-style Transformer -------------------------------------------------

GPT_SGD = M.sgd_step(M.gpt_loss)
GPT_SGD_REF = jax.jit(GPT_SGD)
GPT_SGD_EXACT = jax.jit(GPT_SGD)     # traced in f64 by f64_run
GPT_N = 8 * 16                       # gpt_batch's tokens


def gpt_batch(batch=8, seq=16, vocab=128):
  k1, k2 = jax.random.split(jax.random.PRNGKey(7))
  return (jax.random.randint(k1, (batch, seq), 0, vocab),
          jax.random.randint(k2, (batch, seq), 0, vocab))


@pytest.mark.parametrize("shape,names", [
    ((2, 4), ("data", "model")),
    ((4, 2), ("data", "model")),
    # 4 heads over model=8 do not split: propagation keeps a pending sum that
    # the local op never makes (regression: the reshard used to raise).
    ((1, 8), ("data", "model")),
    ((8, 1), ("data", "model")),
    ((2, 2, 2), ("data", "model", "x")),
])
def test_gpt_sgd_equals_one_device(shape, names):
  m = mesh(shape, names)
  params = M.gpt_init(jax.random.PRNGKey(0))
  step = gshard.partition(GPT_SGD, m,
                          in_specs=(M.gpt_specs(params), P("data"), P("data")))
  out = check_steps(step, GPT_SGD_REF, GPT_SGD_EXACT, (params,), gpt_batch(), n=GPT_N)
  low = step.lower(params, *gpt_batch())
  for k, (x, s) in enumerate(zip(jax.tree.leaves(out), low.out_shardings)):
    assert_named_sharding(x, m, s.to_spec(), f"output {k}")



ADAM = optax.adam(3e-3)
# where (params, opt_state, loss) keeps Adam's moments, and its hyperparameters
ADAM_SPEC = AdamSpec(params="[0]", mu="[1][0].mu", nu="[1][0].nu", count="[1][0].count",
                     lr=3e-3)


def _gpt_adam_step(params, opt_state, tokens, targets):
  loss, grads = jax.value_and_grad(M.gpt_loss)(params, tokens, targets)
  updates, opt_state = ADAM.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_gpt_adam_equals_one_device(shape):
  m = mesh(shape, ("data", "model"))
  params = M.gpt_init(jax.random.PRNGKey(0))
  opt_state = ADAM.init(params)
  step = gshard.partition(_gpt_adam_step, m,
                          in_specs=(M.gpt_specs(params), None, P("data"), P("data")))
  out = check_steps(step, jax.jit(_gpt_adam_step), jax.jit(_gpt_adam_step),
                  (params, opt_state), gpt_batch(), n=GPT_N, adam=ADAM_SPEC)
  # the moments follow their parameters' layout
  mu = out[1][0].mu
  assert mu["embed"].sharding.spec == out[0]["embed"].sharding.spec
  assert mu["layers"][0]["w1"].sharding.spec == P(None, "model")


@pytest.mark.parametrize("shape,names", [((2, 4), ("data", "model")),
                                         ((1, 8), ("data", "model")),
                                         ((3, 2), ("data", "model"))])
def test_ops_in_one_layout_emit_what_the_plan_search_emits(shape, names, monkeypatch):
  """An elementwise equation whose operands arrive in the layout its results
  are wanted in binds on the blocks without the plan search
  (``generic._one_layout``): the per-device program is the one the plan
  search emits, equation for equation, with Adam's state, uneven splits
  (3 x 2 devices) and pending sums."""
  from gshard.spmd.partition import generic
  m = mesh(shape, names)
  params = M.gpt_init(jax.random.PRNGKey(0))
  args = (params, ADAM.init(params), *gpt_batch())

  def per_device():
    step = gshard.partition(_gpt_adam_step, m,
                            in_specs=(M.gpt_specs(params), None, P("data"), P("data")))
    low = step.lower(*args)
    return str(low.per_device_jaxpr()), low.collectives()
  taken = []
  one_layout = generic._one_layout
  monkeypatch.setattr(generic, "_one_layout",
                      lambda *a: taken.append(one_layout(*a)) or taken[-1])
  fast = per_device()
  assert sum(s is not None for s in taken) > 100      # the path runs
  monkeypatch.setattr(generic, "_one_layout", lambda *a: None)
  assert per_device() == fast



@pytest.mark.parametrize("shape", [(1, 4), (3, 4), (7, 4)])
def test_ops_in_an_over_split_layout_emit_what_the_plan_search_emits(shape, monkeypatch):
  """A dim split into more blocks than it has rows (pinned by an annotation):
  the plan search gathers it, and so does the one-layout path (found by
  review: it kept a 1-row dim split over 2 devices)."""
  from gshard.spmd.partition import generic
  m = mesh((2, 4), ("x", "y"))
  fn = lambda a: gshard.shard(a, P(("x", "y"))) * 2.0     # noqa: E731
  a = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)

  def per_device():
    step = gshard.partition(fn, m, in_specs=(P(("x", "y")),))
    np.testing.assert_array_equal(np.asarray(gshard.unpad(step(a))), 2.0 * a)
    low = step.lower(a)
    return str(low.per_device_jaxpr()), low.collectives()
  fast = per_device()
  monkeypatch.setattr(generic, "_one_layout", lambda *a: None)
  assert per_device() == fast


def test_an_optimization_barrier_of_values_of_several_shapes():
  """``lax.optimization_barrier((a, a.sum()))``: each result is its own
  operand (found by review: its rule took every value for the first one's
  shape and raised)."""
  m = mesh((2, 4), ("x", "y"))

  def fn(a):
    y, s = lax.optimization_barrier((a, a.sum()))
    return y + s
  a = np.arange(8.0, dtype=np.float32).reshape(4, 2)
  step = gshard.partition(fn, m, in_specs=(P("x"),), strict=True)
  np.testing.assert_array_equal(np.asarray(step(a)), np.asarray(jax.jit(fn)(a)))

# -- the API contract -----------------------------------------------------------

def test_second_call_same_shapes_does_not_retrace():
  calls = []

  def f(x, w):
    calls.append(1)
    return jnp.tanh(gshard.split(x, 0, "data") @ w)

  m = mesh((2, 4), ("data", "model"))
  step = gshard.partition(f, m, in_specs=(None, P(None, "model")))
  x, w = np.ones((8, 16), np.float32), np.ones((16, 8), np.float32)
  step(x, w)
  assert len(calls) == 1
  y = step(2 * x, jnp.asarray(w) + 1)            # new values, numpy or jax: no retrace
  assert len(calls) == 1
  step.lower(x, w)                               # lowering reuses the entry too
  assert len(calls) == 1
  np.testing.assert_allclose(np.asarray(y), np.tanh((2 * x) @ (w + 1)), rtol=1e-6)
  step(np.ones((16, 16), np.float32), w)         # a new shape traces again
  assert len(calls) == 2
  step(x.astype(np.int32), w)                    # so does a new dtype
  assert len(calls) == 3


def test_numpy_inputs_and_outputs_are_named_sharded_arrays():
  m = mesh((2, 4), ("data", "model"))
  params = jax.tree.map(np.asarray, M.mlp_init(jax.random.PRNGKey(0), 32, 128))
  x, y = (np.asarray(a) for a in mlp_batch())
  step = gshard.partition(MLP_STEP, m, in_specs=(M.MLP_SPECS, P("data"), None))
  out = step(params, x, y)
  assert_trees_close(out, MLP_REF(params, x, y))
  low = step.lower(params, x, y)
  leaves = jax.tree.leaves(out)
  assert len(leaves) == len(low.out_shardings) == 3
  for k, (leaf, s) in enumerate(zip(leaves, low.out_shardings)):
    assert_named_sharding(leaf, m, s.to_spec(), f"output {k}")
    assert leaf.sharding.mesh == m


def test_inputs_with_another_layout_are_placed():
  """A jax.Array laid out differently (or on one device) is moved, not rejected."""
  m = mesh((2, 4), ("data", "model"))
  x = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8),
                     NamedSharding(m, P("model", "data")))
  step = gshard.partition(lambda a: a * 2, m, in_specs=(P("data", "model"),))
  out = step(x)
  np.testing.assert_array_equal(np.asarray(out), 2 * np.asarray(x))
  assert_named_sharding(out, m, P("data", "model"))


def test_out_specs_are_honoured():
  m = mesh((2, 4), ("data", "model"))
  params = M.mlp_init(jax.random.PRNGKey(0), 32, 128)
  out_specs = ({"w1": P(), "w2": P(None, "model")}, P())
  step = gshard.partition(MLP_STEP, m, in_specs=(M.MLP_SPECS, P("data"), None),
                          out_specs=out_specs)
  out = step(params, *mlp_batch())
  assert_trees_close(out, MLP_REF(params, *mlp_batch()))
  assert_named_sharding(out[0]["w1"], m, P())
  assert_named_sharding(out[0]["w2"], m, P(None, "model"))
  check_shards_against_reference(out[0]["w2"], MLP_REF(params, *mlp_batch())[0]["w2"],
                                 P(None, "model"), m)
  # a single PartitionSpec is a prefix for every output
  step = gshard.partition(lambda a, b: (a + b, a - b), m, out_specs=P("model"))
  a = np.arange(32, dtype=np.float32).reshape(8, 4)
  for o in step(a, a):
    assert_named_sharding(o, m, P("model"))


def test_in_specs_none_leaves_are_left_to_propagation():
  """w1 unannotated: propagation splits it like w2 (Megatron's column/row pair)."""
  m = mesh((2, 4), ("data", "model"))
  params = M.mlp_init(jax.random.PRNGKey(0), 32, 128)
  specs = ({"w1": None, "w2": P("model", None)}, P("data"), None)
  step = gshard.partition(MLP_STEP, m, in_specs=specs)
  out = step(params, *mlp_batch())
  assert_trees_close(out, MLP_REF(params, *mlp_batch()))
  low = step.lower(params, *mlp_batch())
  assert low.in_shardings[0].to_spec() == P(None, "model")
  assert out[0]["w1"].sharding.spec == P(None, "model")


def test_donate_argnums_runs_and_donates():
  m = mesh((2, 4), ("data", "model"))
  params = M.mlp_init(jax.random.PRNGKey(0), 32, 128)
  batch = mlp_batch()
  step = gshard.partition(MLP_STEP, m, in_specs=(M.MLP_SPECS, P("data"), None),
                          donate_argnums=0)
  p1, _ = step(params, *batch)
  assert not any(x.is_deleted() for x in jax.tree.leaves(params))   # it was copied
  p2, loss = step(p1, *batch)                   # p1 is already laid out: donated
  assert all(x.is_deleted() for x in jax.tree.leaves(p1))
  ref = MLP_REF(MLP_REF(params, *batch)[0], *batch)
  assert_trees_close((p2, loss), ref)


# -- the safe path ------------------------------------------------------------

def _pair_max(a, b):
  return jnp.maximum(a, b).max(axis=1)


# lax.composite: an op XLA backends may match by name, lowered as its
# decomposition; gshard keeps it whole (no rule)
_PAIR_MAX = lax.composite(_pair_max, name="gshard_test.pair_max")


def _composite_program(x):
  y = gshard.split(x, 1, "model")
  z = _PAIR_MAX(y, -y)   # no rule for composite
  return z[:, None] + y


def test_missing_rule_warns_with_primitive_and_source_line():
  assert sharding_rule("composite") is None, \
      "composite got a rule: pick another primitive without one for this test"
  m = mesh((2, 4), ("data", "model"))
  x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
  line = line_of(_composite_program, "_PAIR_MAX(")
  step = gshard.partition(_composite_program, m, in_specs=(P("data", "model"),))
  with pytest.warns(gshard.PartitionWarning,
                    match=rf"no partition rule for composite .*{THIS_FILE}:{line}:"):
    out = step(x)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(_composite_program)(x)))
  low = step.lower(x)
  assert [p for p, _ in low.fallbacks] == ["composite"]
  assert f"{THIS_FILE}:{line}:" in low.fallbacks[0][1]
  report = low.explain()
  assert "safe path" in report and f"composite at {low.fallbacks[0][1]}" in report
  # the safe path gathers both operands over the axis they are split on, model
  moved = [(c.kind, c.role, c.fallback) for c in low.collectives()
           if c.primitive == "composite"]
  assert sorted(moved) == [("all_gather", "operand 0", True), ("all_gather", "operand 1", True)]
  assert all("model" in c.axes for c in low.collectives() if c.primitive == "composite")


def test_missing_rule_strict_raises_with_the_same_message():
  m = mesh((2, 4), ("data", "model"))
  x = np.ones((8, 16), np.float32)
  line = line_of(_composite_program, "_PAIR_MAX(")
  step = gshard.partition(_composite_program, m, in_specs=(P("data", "model"),), strict=True)
  with warnings.catch_warnings():
    warnings.simplefilter("error", gshard.PartitionWarning)   # raise, not warn
    with pytest.raises(NotImplementedError, match=rf"no partition rule for composite "
                       rf".*{THIS_FILE}:{line}:.*strict=True"):
      step(x)


# a jitted function of jax's own (its equations carry no user frame) binding a
# composite (no rule)
_LIBRARY_SIN = jax.jit(lax.composite(jnp.sin, name="gshard_test.sin"))


def _library_call(a):
  return _LIBRARY_SIN(gshard.split(a, 0, "model"))


def test_missing_rule_inside_a_library_call_names_the_users_line():
  """A composite bound inside a jit of jax's own code: its equations carry no
  user frame, and the warning names the user's call instead of an empty
  location."""
  assert sharding_rule("composite") is None, \
      "composite got a rule: pick another primitive without one for this test"
  m = mesh((2, 4), ("data", "model"))
  a = np.random.default_rng(1).standard_normal((8, 8)).astype(np.float32)
  line = line_of(_library_call, "_LIBRARY_SIN(")
  step = gshard.partition(_library_call, m, in_specs=(P("data", "model"),))
  with pytest.warns(gshard.PartitionWarning, match=rf"composite .*at .*{THIS_FILE}:{line}:"):
    out = step(a)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(_library_call)(a)))


# -- primitives that need more than the local op ------------------------------

M24 = ("data", "model")


def _run(fn, args, in_specs, out_specs=None, shape=(2, 4)):
  """Partition on a (data, model) mesh with PartitionWarning as an error."""
  m = mesh(shape, M24)
  step = gshard.partition(fn, m, in_specs=in_specs, out_specs=out_specs)
  with warnings.catch_warnings():
    warnings.simplefilter("error", gshard.PartitionWarning)
    out = step(*args)
    low = step.lower(*args)
  return out, low, m


@pytest.mark.parametrize("name,fn", [
    ("argmax", lambda x: jnp.argmax(x, axis=1)),
    ("argmin", lambda x: jnp.argmin(x, axis=1)),
    ("argmax dim 0", lambda x: jnp.argmax(x, axis=0)),
    ("reduce_max", lambda x: jnp.max(x, axis=1)),
    ("reduce_min", lambda x: jnp.min(x, axis=1)),
    ("reduce_max all", lambda x: jnp.max(x)),
])
def test_reductions_over_a_split_dim(name, fn):
  x = np.random.default_rng(0).standard_normal((8, 32)).astype(np.float32)
  x[:, 5] = x[:, 21] = 10.0        # ties in two shards: the first index wins
  x[:, 6] = x[:, 22] = -10.0
  x[3, :] = 10.0                   # a whole row tied
  out, low, _ = _run(fn, (x,), (P("data", "model"),))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(fn(x)))
  cols = low.collectives()
  assert not [c for c in cols if c.kind == "all_gather"], [str(c) for c in cols]
  assert {c.kind for c in cols} <= {"pmax", "pmin"}


def test_cumsum_over_a_split_dim():
  x = np.random.default_rng(0).standard_normal((8, 32)).astype(np.float32)
  fn = lambda x: jnp.cumsum(x, axis=1)   # noqa: E731
  out, _, m = _run(fn, (x,), (P("data", "model"),), out_specs=P("data", "model"))
  np.testing.assert_allclose(np.asarray(out), np.cumsum(x, axis=1), rtol=1e-5, atol=1e-5)
  check_shards_against_reference(out, np.cumsum(x, axis=1), P("data", "model"), m,
                                 atol=1e-5)


def test_iota_over_a_split_dim_uses_the_device_offset():
  """Each device makes its own block of the iota: no collective at all."""
  def fn(x):
    i = lax.broadcasted_iota(jnp.int32, (8, 32), 1)
    return gshard.shard(i, P(None, "model")) * 3 + x

  x = np.zeros((8, 32), np.int32)
  out, low, m = _run(fn, (x,), (P(None, "model"),), out_specs=P(None, "model"))
  want = np.broadcast_to(3 * np.arange(32, dtype=np.int32), (8, 32))
  np.testing.assert_array_equal(np.asarray(out), want)
  check_shards_against_reference(out, want, P(None, "model"), m)
  assert low.collectives() == []
  assert "iota" in low.as_text("jaxpr") and "i32[8,8]" in low.as_text("jaxpr")


def _embed_tokens():
  """A vocab-split table whose feature dim (18) the model axis does not divide:
  the table cannot move to a feature split, so its lookup is the masked one."""
  rng = np.random.default_rng(3)
  table = rng.standard_normal((64, 18)).astype(np.float32)
  tokens = rng.integers(0, 64, (8, 12)).astype(np.int32)
  tokens[0, :4] = [0, 15, 16, 63]        # the first and last row of each shard
  return table, tokens


def test_embedding_lookup_with_vocab_split_never_gathers_the_table():
  table, tokens = _embed_tokens()
  fn = lambda t, k: t[k]   # noqa: E731
  out, low, m = _run(fn, (table, tokens), (P("model"), P("data")))
  np.testing.assert_array_equal(np.asarray(out), table[tokens])
  cols = low.collectives()
  assert not [c for c in cols if c.kind == "all_gather"], [str(c) for c in cols]
  assert [(c.kind, c.axes, c.primitive) for c in cols] == [("psum", ("model",), "gather")]
  hlo = hlo_collectives(low.compile().as_text(), m)
  assert not [c for c in hlo if c.kind == "all-gather"]
  assert all(c.nbytes < table.nbytes for c in hlo)


def test_take_along_axis_over_split_vocab():
  rng = np.random.default_rng(4)
  logits = rng.standard_normal((8, 4, 32)).astype(np.float32)
  targets = rng.integers(0, 32, (8, 4)).astype(np.int32)
  targets[0] = [0, 7, 8, 31]

  def fn(lg, t):
    logp = jax.nn.log_softmax(lg, axis=-1)
    return jnp.take_along_axis(logp, t[..., None], axis=-1)[..., 0]

  out, low, _ = _run(fn, (logits, targets), (P("data", None, "model"), P("data")))
  np.testing.assert_allclose(np.asarray(out), np.asarray(fn(logits, targets)), rtol=1e-6,
                             atol=1e-6)
  assert not [c for c in low.collectives() if c.kind == "all_gather"]
  # only [B,T]-sized reductions: never the logits
  assert all(math.prod(c.shape) <= 8 * 4 for c in low.collectives()), \
      [str(c) for c in low.collectives()]


def test_embedding_gradient_is_a_split_scatter_add():
  table, tokens = _embed_tokens()
  w = np.random.default_rng(5).standard_normal((8, 12, 18)).astype(np.float32)
  grad = jax.grad(lambda t, k: jnp.sum(jnp.sin(t[k]) * w))
  out, low, m = _run(grad, (table, tokens), (P("model"), P("data")),
                     out_specs=P("model"))   # the gradient stays vocab-split
  np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(grad)(table, tokens)),
                             rtol=1e-5, atol=1e-5)
  assert "scatter-add" in low.as_text("jaxpr")
  assert_named_sharding(out, m, P("model", None))
  cols = low.collectives()
  assert not [c for c in cols if c.kind == "all_gather"], [str(c) for c in cols]
  # the data-parallel sum of the gradient runs on each device's vocab block
  scatter = [c for c in cols if c.primitive == "scatter-add"]
  assert [(c.kind, c.axes) for c in scatter] == [("psum", ("data",))]
  assert scatter[0].bytes == 2 * (2 - 1) * table.nbytes // 4 // 2


# -- pod scale --------------------------------------------------------------------

def test_pod_scale_lowering_on_an_abstract_mesh():
  m = AbstractMesh((64, 32), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  params = jax.eval_shape(lambda: M.gpt_init(jax.random.PRNGKey(0), vocab=1024,
                                             d_model=256, n_heads=32, d_ff=1024))
  tokens = jax.ShapeDtypeStruct((256, 128), jnp.int32)
  step = gshard.partition(GPT_SGD, m,
                          in_specs=(M.gpt_specs(params), P("data"), P("data")))
  low = step.lower(params, tokens, tokens, platform="tpu")
  text = low.as_text()
  assert "mhlo.num_partitions = 2048" in text
  assert '"data"=64' in text and '"model"=32' in text
  assert "tensor<1024x256xf32>" in text      # the embedding table, global ...
  assert "tensor<32x256xf32>" in text        # ... and its per-device block (1024 / 32)
  assert low.collectives() and not [c for c in low.collectives() if c.fallback]


# -- the Lowered object -------------------------------------------------------

def test_lowered_inspection_api():
  m = mesh((2, 4), ("data", "model"))
  params = M.mlp_init(jax.random.PRNGKey(0), 32, 128)
  batch = mlp_batch()
  step = gshard.partition(MLP_STEP, m, in_specs=(M.MLP_SPECS, P("data"), None))
  low = step.lower(params, *batch)

  jaxpr = low.as_text("jaxpr")
  assert "psum" in jaxpr and "f32[8,32]" in jaxpr    # local batch 16/2, d_model 32
  assert "f32[32,32]" in jaxpr                        # local w1: 128 / 4 columns
  hlo = low.as_text()
  assert hlo.startswith("module @") and "stablehlo." in hlo
  assert "mhlo.num_partitions = 8" in hlo

  compiled = low.compile()
  assert "HloModule" in compiled.as_text() and "all-reduce" in compiled.as_text()
  # memory and cost are the per-device program's: its arguments are the local
  # blocks (w1, w2 [32, 32], x, y [8, 32]) ...
  leaves = jax.tree.leaves((params, *batch))
  local = [math.prod(x.shape) // math.prod(m.shape[a] for a in s.axes)
           for x, s in zip(leaves, low.in_shardings)]
  assert compiled.memory_analysis().argument_size_in_bytes == 4 * sum(local) == 10240
  # ... and its flops at least those of its five [8, 32] x [32, 32] matmuls
  # (forward two, backward three: no input gradient), with less than as much
  # again elementwise work; one tanh (gelu) per element of the local hidden h
  cost = compiled.cost_analysis()
  matmuls = 5 * 2 * 8 * 32 * 32
  assert matmuls <= cost["flops"] < 2 * matmuls, cost
  assert cost["transcendentals"] == 8 * 32, cost
  out = compiled(*[jax.device_put(x, NamedSharding(m, s.to_spec()))
                   for x, s in zip(jax.tree.leaves((params, *batch)), low.in_shardings)])
  assert_trees_close(jax.tree.leaves(MLP_REF(params, *batch)), list(out))

  # every variable of the global program has a sharding of its rank; the inputs'
  # are the in_shardings
  shardings = low.shardings()
  assert all(isinstance(s, gshard.TensorSharding) and s.rank == len(var.aval.shape)
             for (_, var), s in shardings.items())
  assert set(low.in_shardings) <= set(shardings.values())
  # a pending sum shows in the layouts: h @ w2 feeding only a sum (linear)
  # stays pending over model; the step above resolves each sum where it is made
  assert not any(s.partial for s in shardings.values())
  lin = gshard.partition(lambda p, x: jnp.sum(jax.nn.gelu(x @ p["w1"]) @ p["w2"]), m,
                         in_specs=(M.MLP_SPECS, P("data")))
  assert any(s.partial == frozenset({"model"})
             for s in lin.lower(params, batch[0]).shardings().values())

  # the Megatron MLP's: the forward partial sum over model, and over data the
  # loss (at its sum, before the mean's div) and the two weight gradients
  # (4096 B: a [32, 32] block)
  cols = low.collectives()
  assert all(isinstance(c, gshard.Collective) for c in cols)
  assert sorted((c.kind, c.axes, c.primitive, c.bytes) for c in cols) == [
      ("psum", ("data",), "dot_general", 4096), ("psum", ("data",), "dot_general", 4096),
      ("psum", ("data",), "reduce_sum", 4), ("psum", ("model",), "dot_general", 1536)]
  line = line_of(M.mlp_loss, 'out = h @ params["w2"]')
  fwd = [c for c in cols if c.axes == ("model",)]
  assert len(fwd) == 1 and fwd[0].kind == "psum" and fwd[0].primitive == "dot_general"
  assert f"models.py:{line}:" in fwd[0].source
  assert fwd[0].src.partial == {"model"} and not fwd[0].dst.partial

  report = low.explain()
  assert f"models.py:{line}:" in report
  assert "psum[model]" in report and "psum[data]" in report
  assert set(low.timings) >= {"trace", "propagate", "lower"}


def _tp_pair(x, w1, w2):
  h = jnp.tanh(x @ w1)
  return gshard.replicate(h @ w2)


def test_explain_names_the_users_source_line_and_suggests_a_fix():
  m = mesh((2, 4), ("data", "model"))
  x = np.ones((8, 16), np.float32)
  w1, w2 = np.ones((16, 32), np.float32), np.ones((32, 16), np.float32)
  # w2 split on its output dim while h is split on its hidden dim: h is gathered
  step = gshard.partition(_tp_pair, m, in_specs=(P("data"), P(None, "model"),
                                                 P(None, "model")))
  low = step.lower(x, w1, w2)
  np.testing.assert_allclose(np.asarray(step(x, w1, w2)),
                             np.asarray(jax.jit(_tp_pair)(x, w1, w2)), rtol=1e-6)
  line = line_of(_tp_pair, "h @ w2")
  gathers = [c for c in low.collectives()
             if c.kind == "all_gather" and c.primitive == "dot_general"]
  assert gathers and f"{THIS_FILE}:{line}:" in gathers[0].source
  report = low.explain()
  first = report.split("largest communication first:")[1].strip().splitlines()
  assert first[0].split()[2].startswith("all_gather[model]"), report   # largest first
  assert f"dot_general operand 0 at {gathers[0].source}" in report
  assert "hint: dims [1] are gathered" in report
  assert "conflicts settled by propagation" in report
