"""Mistakes in calling ``gshard.partition`` are errors that name the argument,
what it was given, the mesh and a fix (or, where nothing is lost, it works).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

import gshard
from helpers_partition import mesh

M24 = ((2, 4), ("data", "model"))
X = np.arange(32, dtype=np.float32).reshape(8, 4)


def _pair(a):
  return a * 2, a + 1


def _abstract():
  return AbstractMesh((64, 32), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


# -- AbstractMesh ---------------------------------------------------------------------

def test_calling_over_an_abstract_mesh_points_to_lower_with_a_platform():
  step = gshard.partition(_pair, _abstract(), in_specs=(P("data"),))
  with pytest.raises(RuntimeError, match=r"_pair is partitioned over an AbstractMesh "
                     r"\(data=64, model=32\), which has no devices.*"
                     r"_pair\.lower\(\*args, platform='tpu'\)"):
    step(X)


def test_lower_over_an_abstract_mesh_needs_a_platform():
  step = gshard.partition(_pair, _abstract(), in_specs=(P("data"),))
  x = jax.ShapeDtypeStruct((128, 4), jnp.float32)
  with pytest.raises(ValueError, match=r"_pair\.lower\(\): the mesh is an AbstractMesh "
                     r"\(data=64, model=32\).*platform='tpu'"):
    step.lower(x)
  text = step.lower(x, platform="tpu").as_text()      # the fix works
  assert "mhlo.num_partitions = 2048" in text


# -- out_specs -------------------------------------------------------------------------

@pytest.mark.parametrize("out_specs", [(P(), P(), P()), (P(),), {"a": P()}],
                         ids=["too many", "too few", "another structure"])
def test_out_specs_that_do_not_fit_the_outputs(out_specs):
  step = gshard.partition(_pair, mesh(*M24), out_specs=out_specs)
  with pytest.raises(ValueError, match=r"out_specs=.* does not fit what _pair returns: "
                     r"\(f32\[8,4\], f32\[8,4\]\)\. Give one entry per output.*"
                     r"on mesh \(data=2, model=4\)"):
    step(X)


def test_out_specs_that_fit_work():
  step = gshard.partition(_pair, mesh(*M24), out_specs=(P("data"), P(None, "model")))
  a, b = step(X)
  assert a.sharding.spec == P("data") and b.sharding.spec == P(None, "model")
  np.testing.assert_array_equal(np.asarray(a), X * 2)


# -- donate_argnums ----------------------------------------------------------------------

def test_donate_argnums_out_of_range_names_the_call():
  step = gshard.partition(_pair, mesh(*M24), donate_argnums=(0, 2))
  with pytest.raises(ValueError, match=r"donate_argnums=\(0, 2\) names argument 2, but "
                     r"_pair was called with 1 positional argument\(s\)"):
    step(X)
  with pytest.raises(ValueError, match=r"names argument 2"):
    step.lower(X)


def test_donate_argnums_negative():
  with pytest.raises(ValueError, match=r"donate_argnums=-1: -1 is negative\. Count "
                     r"positions from 0"):
    gshard.partition(_pair, mesh(*M24), donate_argnums=-1)


@pytest.mark.parametrize("bad", ["0", 1.0, True, (0, "x")])
def test_donate_argnums_not_ints(bad):
  with pytest.raises(TypeError, match=r"donate_argnums=.*is not an int"):
    gshard.partition(_pair, mesh(*M24), donate_argnums=bad)


def test_donate_argnums_in_range_donate():
  step = gshard.partition(lambda a, b: (a * 2, b), mesh(*M24), donate_argnums=0)
  a, _ = step(X, X)
  b, _ = step(a, X)
  assert a.is_deleted() and not b.is_deleted()


@pytest.mark.parametrize("donate", [(0, 1), (0,), (1,)])
def test_a_donated_array_passed_twice_is_an_error_not_a_crash(donate):
  # `ema = params` then step(params, ema): XLA:CPU crashed the process (SIGSEGV)
  def step(params, ema):
    return params * 0.9, ema * 0.5 + params
  part = gshard.partition(step, mesh(*M24), in_specs=(P("model"), P("model")),
                          donate_argnums=donate)
  params = part(jnp.ones((8, 4)), jnp.ones((8, 4)))[0]
  with pytest.raises(ValueError, match=r"step: arguments 0 and 1 hold the same array "
                     r"\(f32\[8,4\]\), and donate_argnums=.* donates it: .* Pass a copy"):
    part(params, params)
  assert not params.is_deleted()
  new, ema = part(params, jnp.copy(params))          # the fix the message names
  np.testing.assert_allclose(np.asarray(ema), np.full((8, 4), 0.9 * 0.5 + 0.9), rtol=1e-6)


def test_one_array_twice_in_a_donated_argument_is_an_error():
  part = gshard.partition(lambda t: (t[0] + 1, t[1] * 2), mesh(*M24), donate_argnums=0)
  a = jnp.ones((8, 4))
  with pytest.raises(ValueError, match=r"argument 0 holds one array \(f32\[8,4\]\) twice"):
    part((a, a))
  # not donated, passing one array twice is fine
  out = gshard.partition(lambda x, y: x + y, mesh(*M24))(a, a)
  np.testing.assert_array_equal(np.asarray(out), 2 * np.ones((8, 4)))


# -- strict ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["no", 0, None])
def test_strict_must_be_a_bool(bad):
  with pytest.raises(TypeError, match=rf"strict must be True or False, got {bad!r}"):
    gshard.partition(_pair, mesh(*M24), strict=bad)


# a composite (an op backends may match by name; gshard has no rule for it)
_ROW_MAX = lax.composite(lambda x, y: jnp.maximum(x, y).max(axis=1), name="gshard_test.row_max")


def _row_max(x):
  return _ROW_MAX(x, -x)


def test_strict_safe_path_on_replicated_operands_works_and_gathers_nothing():
  """composite has no rule. Its operand is replicated already: the safe path moves
  nothing, so strict=True lets it run; the warning does not claim a gather."""
  step = gshard.partition(_row_max, mesh(*M24), in_specs=(P(),), strict=True)
  with pytest.warns(gshard.PartitionWarning) as record:
    out = step(X)
  np.testing.assert_array_equal(np.asarray(out), X.max(axis=1))
  (msg,) = [str(w.message) for w in record]
  assert "no partition rule for composite" in msg
  assert "its operands are already replicated, so nothing is gathered" in msg
  assert "operands are gathered" not in msg
  low = step.lower(X)
  assert [p for p, _ in low.fallbacks] == ["composite"]
  assert low.collectives() == []


def test_strict_safe_path_that_would_gather_raises_with_a_fix():
  step = gshard.partition(_row_max, mesh(*M24), in_specs=(P("data"),), strict=True)
  with warnings.catch_warnings():
    warnings.simplefilter("error", gshard.PartitionWarning)
    with pytest.raises(NotImplementedError, match=r"no partition rule for composite \(no rule\) "
                       r"at .*test_api_errors\.py:\d+:\d+ \(_row_max\): the safe path would "
                       r"gather its operands.*strict=True forbids that\. Replicate"):
      step(X)


@pytest.mark.parametrize("make", [
    lambda m: gshard.partition(lambda a: a, m, in_specs=(P(1, None),)),
    lambda m: gshard.partition(lambda a: a, m, out_specs=P(1)),
    lambda m: gshard.infer_shardings(lambda a: a, m, in_specs=(P(1),)),
    lambda m: gshard.partition(lambda a: a, m, in_specs=(P("data", unreduced={"model"}),)),
    lambda m: gshard.partition(lambda a: a, m, out_specs=P("data", reduced={"model"})),
    lambda m: gshard.partition(lambda a: gshard.shard(a, P("data", unreduced={"model"})), m),
])
def test_spec_entries_that_are_not_a_layout_are_gshards_error(make):
  """A spec entry that is not an axis name (1), or jax's unreduced= /
  reduced= sets (explicit-sharding partial sums): gshard's error naming the
  spec's place and the shape, not 'int is not iterable' or jax's '*pspec is
  dangerous'."""
  with pytest.raises((TypeError, ValueError)) as e:
    make(mesh(*M24))(jnp.ones((8, 12)))
  assert "8, 12" in str(e.value) or "8,12" in str(e.value), str(e.value)
  assert "not a mesh axis name" in str(e.value) or "unreduced/reduced" in str(e.value)


@pytest.mark.parametrize("make", [
    lambda m: gshard.partition(lambda a: a, m),
    lambda m: gshard.gspmd_jit(lambda a: a, m),
    lambda m: gshard.coverage(lambda a: a, jnp.ones(8), mesh=m),
])
def test_a_mapping_is_not_a_mesh_to_run_on(make):
  with pytest.raises(TypeError, match=r"mesh must be a jax Mesh or AbstractMesh.*dict"):
    make({"data": 2, "model": 4})


@pytest.mark.parametrize("call", [
    lambda s, x: s(x, "x"),
    lambda s, x: s.lower(x, "x"),
    lambda s, x: s(x, mode="x"),
])
def test_a_non_array_argument_names_its_path_and_functools_partial(call):
  """jax's message names static_argnums, which gshard.partition does not take."""
  step = gshard.partition(lambda a, mode: a * 2, mesh(*M24))
  with pytest.raises(TypeError, match=r"a str \('x'\) was passed at path args\[1\].*"
                                      r"functools\.partial\(<lambda>, mode=\.\.\.\)"):
    call(step, jnp.ones((8, 4)))


def test_a_users_own_type_error_keeps_its_cause():
  def f(x):
    try:
      {}["k"]
    except KeyError as e:
      raise TypeError("mine") from e
  with pytest.raises(TypeError, match="mine") as e:
    gshard.partition(f, mesh(*M24))(jnp.ones(8))
  assert isinstance(e.value.__cause__, KeyError)


def test_a_non_array_output_names_the_users_function():
  """jax's error for a string among the outputs names the traced function:
  the user's, as ``jax.jit``'s does (it named gshard's inner ``fresh``)."""
  def step_with_a_name(x):
    return x * 2, "a name"
  with pytest.raises(TypeError, match=r"function step_with_a_name at .*test_api_errors\.py:"
                                      r".*not a valid JAX type"):
    gshard.partition(step_with_a_name, mesh(*M24), in_specs=P("data"))(jnp.ones((8, 4)))


def test_jax_debug_nans_names_the_primitive_and_the_users_line():
  """With jax_debug_nans, jax.jit re-runs op by op and raises at the
  primitive; a partitioned step raised jax's InternalFloatingPointError
  ('jit(body)', 'nan') from gshard's frames (found by a review of client
  code). The user's function is re-run op by op on the logical values."""
  import traceback
  m = gshard.make_mesh((2, 4), ("data", "model"))
  x = jnp.ones((8, 4)).at[1, 1].set(-5.0)

  def loss(x, w):
    return jnp.sqrt(x @ w).sum()          # one negative entry: NaN

  step = gshard.partition(loss, m, in_specs=(P("data"), P(None, "model")))
  jax.config.update("jax_debug_nans", True)
  try:
    with pytest.raises(FloatingPointError, match="invalid value \\(nan\\) encountered in sqrt") \
        as info:
      step(x, jnp.ones((4, 4)))
  finally:
    jax.config.update("jax_debug_nans", False)
  frames = traceback.extract_tb(info.value.__traceback__)
  assert any(f.name == "loss" and f.filename == __file__ for f in frames)
  assert np.isnan(float(step(x, jnp.ones((4, 4)))))       # off again: runs
  # where the op-by-op run makes no NaN, the partitioned program alone did
  from gshard.spmd.partition import nans
  err = nans.localize(lambda x: x * 2, (jnp.ones(2),), "step", RuntimeError("nan"))
  assert isinstance(err, FloatingPointError) and "a gshard bug" in str(err)


@pytest.mark.parametrize("specs, args, said", [
    (({"w": P(None, "model")}, P("data")), ("a8x8", "a16x8"),
     "in_specs[0] is a dict with keys ['w'], but argument 0 is an array f32[8,8]"),
    (({"w": P(), "b": P()}, None), ({"w": "a8x8"}, "a16x8"),
     "in_specs[0] is a dict with keys ['b', 'w'], but argument 0 is a dict with keys ['w']"),
    ((({"w": P()}, P()), None), (({"w": "a8x8"}, "a8x8", "a8x8"), "a16x8"),
     "in_specs[0] is a tuple of 2, but argument 0 is a tuple of 3"),
    ((({"w": (P(), P())},), None), (({"w": "a8x8"},), "a16x8"),
     "in_specs[0][0]['w'] is a tuple of 2, but argument 0[0]['w'] is an array f32[8,8]"),
    ((P("data"),), ("a16x8", "a8x8"),
     "in_specs is a tuple of 1, but 2 positional arguments were passed"),
    ((P("data"), None, None), ("a16x8",),
     "in_specs is a tuple of 3, but 1 positional argument was passed"),
])
def test_in_specs_that_do_not_fit_the_arguments_say_where_and_what(specs, args, said):
  # A spec pytree shaped unlike an argument named jax's tracer type
  # (DynamicJaxprTracer) and neither the shape nor the mesh.
  def arr(s):
    return jnp.ones(tuple(int(n) for n in s[1:].split("x")))
  args = jax.tree.map(arr, args)
  step = gshard.partition(lambda *a: jax.tree.leaves(a)[0], mesh((2, 4), ("data", "model")),
                          in_specs=specs)
  with pytest.raises(ValueError) as e:
    step(*args)
  msg = str(e.value)
  assert said in msg and "(data=2, model=4)" in msg and "Tracer" not in msg, msg
