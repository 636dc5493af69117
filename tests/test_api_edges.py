"""The public API's less travelled corners: each case here was an internal
traceback, a misleading message or a silently odd result (found by review),
and must now work or fail with an error that names the argument and a fix."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

import gshard
import gshard.checkpoint
import gshard.moe
from gshard import pipeline
from gshard import TensorSharding
from helpers_partition import mesh

MESH = ((2, 4), ("data", "model"))


def _mlp_step(p, x):
  def loss(p):
    return jnp.mean((jax.nn.gelu(x @ p["w1"]) @ p["w2"]) ** 2)
  g = jax.grad(loss)(p)
  return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)


_MLP_ARGS = ({"w1": jax.ShapeDtypeStruct((64, 128), jnp.float32),
              "w2": jax.ShapeDtypeStruct((128, 64), jnp.float32)},
             jax.ShapeDtypeStruct((32, 64), jnp.float32))


# -- auto_shard options --------------------------------------------------------------------

def test_auto_shard_with_an_infinite_memory_limit_is_no_limit():
  m = mesh(*MESH)
  free = gshard.auto_shard(_mlp_step, m)(*_MLP_ARGS)
  inf = gshard.auto_shard(_mlp_step, m, memory_limit=float("inf"))(*_MLP_ARGS)
  assert inf.in_specs == free.in_specs


@pytest.mark.parametrize("kw, match", [
    ({"memory_limit": float("nan")}, "memory_limit=nan"),
    ({"latency": float("nan")}, "latency=nan"),
    ({"latency": float("inf")}, "latency=inf"),
    ({"bandwidth": {"model": float("nan")}}, r"bandwidth\['model'\]=nan"),
    ({"bandwidth": [1.0, 2.0]}, "give a dict from mesh axis name"),
    ({"min_bytes": float("nan")}, "min_bytes=nan"),
    ({"time_limit": float("nan")}, "time_limit=nan"),
])
def test_auto_shard_options_that_are_not_numbers_name_the_option(kw, match):
  with pytest.raises(ValueError, match=match):
    gshard.auto_shard(_mlp_step, mesh(*MESH), **kw)


def test_auto_shard_and_infer_shardings_take_the_padded_state_a_step_returned():
  m = mesh(*MESH)
  x = jnp.ones((10, 64))
  state = gshard.partition(lambda t: t + 0, m, in_specs=(P("model"),))(x)
  assert type(state).__name__ == "PaddedArray"

  def fn(a):
    return (a @ a.T).sum()
  assert (gshard.auto_shard(fn, m)(state).in_specs
          == gshard.auto_shard(fn, m)(x).in_specs)
  assert (gshard.infer_shardings(lambda a: a * 2, m)(state).in_shardings
          == gshard.infer_shardings(lambda a: a * 2, m)(x).in_shardings)


# -- meshes and specs ----------------------------------------------------------------------

@pytest.mark.parametrize("bad", [("data",), None, 8])
def test_a_mesh_that_is_not_a_mesh_is_a_type_error(bad):
  with pytest.raises(TypeError, match="mesh must be a jax Mesh or AbstractMesh"):
    gshard.partition(lambda x: x, bad)(jnp.ones(4))


@pytest.mark.parametrize("shape", [(0,), (-1, 8), (2.0, 4)])
def test_make_mesh_sizes_must_be_positive_ints(shape):
  with pytest.raises(ValueError, match="every size must be a positive int"):
    gshard.make_mesh(shape, ("a", "b")[:len(shape)])


def test_make_mesh_with_too_few_devices_given_says_so():
  with pytest.raises(ValueError, match="devices= has 2"):
    gshard.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:2])


def test_in_specs_may_be_named_shardings_and_a_string_is_a_type_error():
  m = mesh(*MESH)
  x = jnp.arange(128.0).reshape(8, 16)
  step = gshard.partition(lambda v: v * 2, m, in_specs=(NamedSharding(m, P("data")),))
  assert [str(s) for s in step.lower(x).in_shardings] == ["[data,_]"]
  np.testing.assert_array_equal(np.asarray(step(x)), np.asarray(x * 2))
  with pytest.raises(TypeError, match=r"in_specs\[0\]: got 'data' \(str\).*PartitionSpec"):
    gshard.partition(lambda v: v, m, in_specs=("data",))(x)


def test_an_out_spec_that_does_not_fit_speaks_of_the_output():
  m = mesh(*MESH)
  with pytest.raises(ValueError, match="out_specs.*the output has shape"):
    gshard.partition(lambda v: v.sum(0), m, out_specs=P("data", "model"))(jnp.ones((8, 16)))


def test_a_sharding_axis_given_as_a_name_is_that_axis():
  assert TensorSharding(["data", ()]) == TensorSharding((("data",), ()))
  assert TensorSharding(((),), "model").partial == frozenset({"model"})


# -- inspection ----------------------------------------------------------------------------

def test_explain_top_none_lists_everything():
  m = mesh(*MESH)
  low = gshard.partition(lambda a, b: (a @ b).sum(), m,
                         in_specs=(P("data", "model"), P("model"))).lower(
                             jnp.ones((8, 16)), jnp.ones((16, 4)))
  assert low.explain(top=None) == low.explain(top=1000)
  with pytest.raises(ValueError, match="explain"):
    low.explain(top=-1)


def test_compiling_for_an_abstract_mesh_says_there_are_no_devices():
  step = gshard.partition(lambda x: x * 2, AbstractMesh((2, 4), ("data", "model")))
  low = step.lower(jax.ShapeDtypeStruct((8, 16), jnp.float32), platform="tpu")
  with pytest.raises(RuntimeError, match="AbstractMesh .* no devices to compile"):
    low.compile()



def test_a_parameter_named_platform_keeps_its_keyword():
  """``lower(platform=)`` names the platform to lower for, unless the function
  has a parameter of that name left open: then the keyword is the function's
  (as in ``jax.jit(f).lower``), and ``lowering_platform=`` names the platform."""
  def f(x, platform):
    return x * platform
  step = gshard.partition(f, mesh(*MESH), in_specs=(P("data"), P()))
  x = np.arange(8, dtype=np.float32)
  np.testing.assert_array_equal(step.lower(x, platform=3.0).compile()(x, platform=3.0), 3 * x)
  np.testing.assert_array_equal(
      step.lower(x, platform=3.0, lowering_platform="cpu").compile()(x, 3.0), 3 * x)
  assert "stablehlo" in step.lower(x, 2.0, platform="cpu").as_text()  # bound by position
  am = AbstractMesh((2, 4), ("data", "model"))
  struct = jax.ShapeDtypeStruct((8,), jnp.float32)
  for low in (gshard.partition(f, am, in_specs=(P("data"), P())).lower(
                  struct, platform=2.0, lowering_platform="tpu"),
              gshard.partition(lambda x: x * 2, am).lower(struct, lowering_platform="tpu"),
              gshard.partition(lambda x: x * 2, am).lower(struct, platform="tpu")):
    assert "stablehlo" in low.as_text()

# -- checkpoints ---------------------------------------------------------------------------

def test_abstract_args_needs_a_partitioned_step():
  with pytest.raises(TypeError, match="step must be a partitioned function"):
    gshard.checkpoint.abstract_args(lambda x: x, jnp.ones(4))


def test_unpad_of_abstract_args_gives_logical_structs():
  m = mesh(*MESH)
  step = gshard.partition(lambda t: t * 2, m, in_specs=(P("model"),))
  (target,) = gshard.checkpoint.abstract_args(step, jnp.ones((10, 6)))
  out = gshard.unpad(target)
  assert isinstance(out, jax.ShapeDtypeStruct) and out.shape == (10, 6)


def test_restoring_a_padded_leaf_onto_a_target_without_sharding(tmp_path):
  m = mesh(*MESH)
  step = gshard.partition(lambda e: e * 1.0, m, in_specs=(P("model"),))
  e = jnp.arange(50 * 6, dtype=jnp.float32).reshape(50, 6)
  path = os.path.join(tmp_path, "ck")
  gshard.checkpoint.save(path, {"e": step(e)})
  with pytest.raises(ValueError, match="leaf .*e.*gives no sharding.*abstract_args"):
    gshard.checkpoint.restore(path, {"e": jax.ShapeDtypeStruct((50, 6), jnp.float32)})
  # the fix the message gives
  target = {"e": jax.ShapeDtypeStruct((50, 6), jnp.float32, sharding=NamedSharding(m, P()))}
  got = gshard.checkpoint.restore(path, target)
  np.testing.assert_array_equal(np.asarray(got["e"]), np.asarray(e))


# -- mixture of experts --------------------------------------------------------------------

def test_moe_apply_with_tokens_of_another_width_names_both():
  params = gshard.moe.moe_init(jax.random.key(0), d_model=16, d_hidden=32, num_experts=4)
  with pytest.raises(ValueError, match=r"d_model 12.*d_model 16.*moe_init"):
    gshard.moe.moe_apply(params, jnp.ones((4, 8, 12)), key=jax.random.key(1))


# -- pipelines -----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [None, 0, ("stage",)])
def test_pipeline_stage_axis_must_be_a_name(bad):
  with pytest.raises(TypeError, match="stage_axis must be the name of one mesh axis"):
    pipeline.run(lambda w, h: h @ w, jnp.ones((4, 8, 8)), jnp.ones((8, 8)),
                 num_microbatches=2, stage_axis=bad)


def test_pipeline_targets_without_a_loss_fn_are_an_error():
  with pytest.raises(ValueError, match="no loss_fn was given"):
    pipeline.run(lambda w, h: h @ w, jnp.ones((4, 8, 8)), jnp.ones((8, 8)),
                 num_microbatches=2, targets=jnp.ones((8, 8)))


def test_pipeline_balance_of_no_costs_and_a_stack_that_does_not_fit():
  with pytest.raises(ValueError, match="costs is empty"):
    pipeline.balance([], num_stages=2)
  with pytest.raises(ValueError) as e:
    pipeline.run(lambda w, h: h @ w, jnp.ones((8, 8, 8)), jnp.ones((16, 8)),
                 num_microbatches=4, balance=[4, 4])
  assert str(e.value).count("(8, 8, 8)") == 1, str(e.value)


@pytest.mark.parametrize("suffix, magic", [("svg", b"<?xml"), ("pdf", b"%PDF"),
                                           ("png", b"\x89PNG")])
def test_schedule_plot_writes_the_format_its_path_names(tmp_path, suffix, magic):
  path = tmp_path / f"s.{suffix}"
  pipeline.schedule("1f1b", num_stages=2, num_microbatches=4).plot(path)
  assert path.read_bytes().startswith(magic)


# -- keyword arguments ----------------------------------------------------------

def test_keyword_arguments_take_their_positions():
  """``step(x, scale=s)`` is ``step(x, s)``: traced, as jax.jit traces kwargs;
  in_specs and donate_argnums count positions after binding."""
  def f(x, scale, shift=0.0):
    return gshard.split(x, 0, "x") * scale + shift
  m = mesh((8,), ("x",))
  step = gshard.partition(f, m, in_specs=(P("x"), P(), P()))
  x = jnp.arange(16.0)
  want = f(x, 2.0, 1.0)
  np.testing.assert_array_equal(step(x, 2.0, shift=1.0), want)
  np.testing.assert_array_equal(step(x, scale=2.0, shift=1.0), want)
  np.testing.assert_array_equal(step(shift=1.0, scale=2.0, x=x), want)
  assert step.lower(x, scale=2.0, shift=1.0).as_text()


def _f4(a, b, c=0.5, *, d=0.25):
  return gshard.split(a, 0, "x") * b + 3 * c - d


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 2), st.lists(st.sampled_from("bcd"), unique=True), st.randoms())
def test_any_mix_of_positions_and_keywords_is_jax_jits(n_pos, named, rnd):
  """Arguments up to ``n_pos`` by position, then any of the others by keyword
  in any order (keyword-only ``d``, a skipped default ``c`` before a given
  one): the values jax.jit gives, traced once per set of keywords."""
  values = {"a": jnp.arange(16.0), "b": jnp.float32(2.0), "c": jnp.float32(1.5),
            "d": jnp.float32(4.0)}
  order = "abcd"
  pos = [values[k] for k in order[:n_pos]]
  kw = {k: values[k] for k in named if order.index(k) >= n_pos or k == "d"}
  if n_pos < 2:
    kw["b"] = values["b"]
  items = list(kw.items())
  rnd.shuffle(items)
  kw = dict(items)
  traces = []

  def f(*args, **kwargs):
    traces.append(1)
    return _f4(*args, **kwargs)
  step = gshard.partition(functools.wraps(_f4)(f), mesh((8,), ("x",)))
  want = jax.jit(_f4)(*pos, **kw)
  np.testing.assert_array_equal(step(*pos, **kw), want)
  np.testing.assert_array_equal(step(*pos, **dict(reversed(list(kw.items())))), want)
  assert len(traces) == 1


def test_keywords_of_wrappers_and_partials():
  """A wrapper's own signature places the keywords (not what it wraps); a
  partial's bound keywords leave the later ones keywords: as jax.jit."""
  def f(x, scale, shift=0.0, bias=0.0):
    return x * scale + shift + 10 * bias

  @functools.wraps(f)
  def wrapper(extra, *a, **k):
    return f(*a, **k) + extra
  m, x = mesh((8,), ("x",)), jnp.arange(8.0)
  np.testing.assert_array_equal(gshard.partition(wrapper, m)(5.0, x, 2.0, bias=1.0),
                                jax.jit(wrapper)(5.0, x, 2.0, bias=1.0))
  p = functools.partial(f, scale=2.0)
  for kw in ({"shift": 1.0}, {"scale": 3.0}, {"bias": 1.0, "shift": 2.0}):
    np.testing.assert_array_equal(gshard.partition(p, m)(x, **kw), jax.jit(p)(x, **kw))
  with pytest.raises(TypeError, match="unexpected keyword argument 'typo'"):
    gshard.partition(f, m)(x, 2.0, typo=1.0)


def test_compiled_takes_keywords_and_flat_plain_leaves():
  """``lower(...).compile()`` is called as the step is: keywords, and the
  flat leaves with an uneven input given as its plain (logical) array."""
  m = mesh((4,), ("x",))

  def step(s, i, scale=1.0):
    return {"t": s["t"].at[i].add(-scale)}, s["t"][i].sum()
  s, i = {"t": jnp.ones((1003, 6))}, jnp.array([1, 1002])
  part = gshard.partition(step, m, in_specs=(P("x"), P()))
  c = part.lower(s, i, scale=2.0).compile()
  want = jax.jit(step)(s, i, scale=2.0)
  got = c(s, i, scale=2.0)
  np.testing.assert_array_equal(gshard.unpad(got[0])["t"], want[0]["t"])
  c2 = part.lower(s, i).compile()
  flat = c2(*jax.tree_util.tree_leaves((s, i)))
  np.testing.assert_array_equal(flat[-1], jax.jit(step)(s, i)[1])
  np.testing.assert_array_equal(np.asarray(flat[0])[:1003], jax.jit(step)(s, i)[0]["t"])


def test_a_partitioned_function_retraces_when_jax_settings_change():
  """jax.jit keys its traces on jax's trace-time settings; gshard's program
  cache keyed on the arguments only, so after jax_enable_x64 or
  jax_threefry_partitionable changed a partitioned function kept running the
  program traced before: old dtypes (or a lowering error), old random bits,
  the old matmul precision (found by a review of client code)."""
  m = gshard.make_mesh((2, 4), ("data", "model"))

  def f(key, x):
    return jnp.argmax(x, -1), x + jax.random.normal(key, x.shape)

  step, ref = gshard.partition(f, m, in_specs=(None, P("data", "model"))), jax.jit(f)
  key, x = jax.random.key(0), jnp.linspace(0, 1, 64).reshape(8, 8)
  flip = not jax.config.jax_threefry_partitionable
  with jax.enable_x64(True):
    assert step(key, x)[0].dtype == ref(key, x)[0].dtype == jnp.int64
  try:
    for _ in range(2):
      got, want = step(key, x), ref(key, x)
      assert got[0].dtype == want[0].dtype == jnp.int32
      np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
      jax.config.update("jax_threefry_partitionable", flip)
  finally:
    jax.config.update("jax_threefry_partitionable", not flip)
  mm = gshard.partition(lambda a, b: a @ b, m)
  assert "HIGHEST" not in mm.lower(x, x).as_text()
  with jax.default_matmul_precision("highest"):
    assert "HIGHEST" in mm.lower(x, x).as_text()


@settings(max_examples=12, deadline=None)
@given(val=st.one_of(st.floats(width=32), st.integers(-2**31, 2**31 - 1), st.booleans(),
                     st.complex_numbers(width=64)))
def test_a_python_number_returned_is_typed_as_jit_returns_it(val):
  # A metric returned as a Python number (``{"lr": 1e-2}``) is weakly typed
  # under jax.jit, so bf16 * it stays bf16; it came back strong (f32).
  def step(w, x):
    return w * 2, {"lr": val}
  w, x = jnp.ones((8, 8), jnp.bfloat16), jnp.ones((16, 8))
  (_, got), (_, want) = (gshard.partition(step, mesh((2, 4), ("data", "model")), in_specs=(P(None, "model"),
                                                                          P("data")))(w, x),
                         jax.jit(step)(w, x))
  g, r = got["lr"], want["lr"]
  assert (g.dtype, g.weak_type, g.shape) == (r.dtype, r.weak_type, r.shape)
  np.testing.assert_array_equal(np.asarray(g), np.asarray(r))      # NaN where NaN
  assert (w * g).dtype == (w * r).dtype
