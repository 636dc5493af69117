"""Arguments committed to a mesh with Explicit axes (``jax.make_mesh``'s default).

Such an array's type carries its layout, and jax's sharding-in-types rules then
refuse much one-device code (a gather from a table split over one axis by
indices split over another, a dot contracting split dims, a reshape merging a
split dim): ``jax.jit`` raises a ``ShardingTypeError`` on it. gshard traces the
one-device program and chooses every layout itself, as it uses the mesh's axes
as Auto: the same code, the same arrays, run and equal one device's result.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gshard
from helpers_partition import assert_trees_close

pytestmark = pytest.mark.filterwarnings("ignore::gshard.PartitionWarning")

MESHES = [((8,), ("x",)), ((2, 4), ("x", "y")), ((4, 2), ("x", "y"))]


def _explicit(shape, names):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))


# (table (16, 8), tokens (8, 8) int, weight (8, 8); jax places only even splits): one-device code jax refuses
# under Explicit types for some layouts of its arguments
PROGRAMS = {
    "lookup then dot": lambda t, i, w: (t[i] @ w).sum(-1),
    "dot contracting the table's columns": lambda t, i, w: t @ w,
    "merge a dim into another": lambda t, i, w: (t.reshape(128) * 2.0).reshape(8, 16),
    "scale by a weight's sum": lambda t, i, w: t * jnp.sum(w),
    "lookup gradient": lambda t, i, w: jax.grad(lambda t: jnp.sum(jnp.tanh(t[i] @ w)))(t),
}


@st.composite
def _cases(draw):
  shape, names = draw(st.sampled_from(MESHES))
  axes = [None, *names]

  def spec(rank):
    dims, used = [], set()
    for _ in range(rank):
      a = draw(st.sampled_from([a for a in axes if a not in used]))
      used.add(a)
      dims.append(a)
    return P(*dims)

  specs = (spec(2), spec(2), spec(2))
  return shape, names, draw(st.sampled_from(sorted(PROGRAMS))), specs, draw(st.booleans())


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(_cases())
def test_committed_explicit_arguments_run_as_one_device(case):
  """Arguments committed with their specs to an Explicit mesh (the layouts
  jax's types then carry): gshard's result equals one device's, where jax
  refused some of these with a ShardingTypeError while tracing; also under
  ``jax.set_mesh`` of that mesh (where jax refused even a ``mul`` of such an
  argument under gshard's Auto mesh)."""
  shape, names, name, specs, context = case
  rng = np.random.default_rng(0)
  args = (rng.standard_normal((16, 8)).astype(np.float32),
          rng.integers(0, 16, (8, 8)).astype(np.int32),
          rng.standard_normal((8, 8)).astype(np.float32))
  m = _explicit(shape, names)
  placed = [jax.device_put(a, NamedSharding(m, s)) for a, s in zip(args, specs)]
  fn = PROGRAMS[name]
  with jax.set_mesh(m) if context else contextlib.nullcontext():
    out = gshard.partition(fn, m, in_specs=specs)(*placed)
  assert_trees_close(out, jax.jit(fn)(*args), rtol=1e-5, atol=1e-5, what=name)


def test_jax_refuses_the_lookup_under_explicit_types():
  """The case above that jax's own tracing refuses, so the property tests what
  gshard adds (a jax release that accepts it changes nothing for gshard)."""
  m = _explicit((2, 4), ("x", "y"))
  t = jax.device_put(np.ones((16, 8), np.float32), NamedSharding(m, P("y", None)))
  i = jax.device_put(np.zeros((8, 4), np.int32), NamedSharding(m, P("x", None)))
  fn = lambda t, i: t[i].sum()
  with pytest.raises(Exception, match="out_sharding|sharding"):
    jax.jit(fn)(t, i)
  assert float(gshard.partition(fn, m, in_specs=(P("y", None), P("x", None)))(t, i)) == 256.0


def test_explicit_arguments_in_every_entry_point():
  """``infer_shardings``, ``lower`` (arrays and structs carrying an Explicit
  sharding), ``coverage`` with and without a mesh, ``auto_shard`` and
  ``gspmd_jit`` on that mesh (NumPy arguments: jax keeps an argument's
  committed mesh) trace the one-device program."""
  m = _explicit((2, 4), ("x", "y"))
  specs = (P("y", None), P("x", None))
  t = jax.device_put(np.ones((16, 8), np.float32), NamedSharding(m, specs[0]))
  i = jax.device_put(np.zeros((8, 4), np.int32), NamedSharding(m, specs[1]))
  fn = lambda t, i: (t[i] * 2.0).sum(-1)
  structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in (t, i)]
  res = gshard.infer_shardings(fn, m, in_specs=specs)(t, i)
  assert res.mesh_sizes == {"x": 2, "y": 4}
  step = gshard.partition(fn, m, in_specs=specs)
  for args in ((t, i), structs):
    np.testing.assert_array_equal(np.asarray(step.lower(*args).compile()(t, i)),
                                  np.full((8, 4), 16.0, np.float32))
  assert gshard.coverage(fn, t, i)["gather"].count == 1
  assert gshard.coverage(fn, t, i, mesh=m, in_specs=specs).fallbacks == ()
  plan = gshard.auto_shard(fn, m, check_memory=False)(t, i)
  step = gshard.partition(plan.annotate(fn), m, in_specs=plan.in_specs)
  np.testing.assert_array_equal(np.asarray(step(t, i)),
                                np.full((8, 4), 16.0, np.float32))
  out = gshard.gspmd_jit(lambda t, i: gshard.split(fn(t, i), 0, "x"), m,
                         in_specs=specs)(np.asarray(t), np.asarray(i))
  np.testing.assert_array_equal(np.asarray(out), np.full((8, 4), 16.0, np.float32))


@pytest.mark.parametrize("entry", ["partition", "infer_shardings", "auto_shard"])
def test_a_non_array_argument_is_named(entry):
  """A string where an array goes: jax's message, naming the argument's path
  in the function's signature (``s``), not a bare type error about the value."""
  m = gshard.make_mesh((2, 4), ("x", "y"))
  fn = lambda x, s: x * 2
  make = {"partition": lambda: gshard.partition(fn, m),
          "infer_shardings": lambda: gshard.infer_shardings(fn, m),
          "auto_shard": lambda: gshard.auto_shard(fn, m, check_memory=False)}[entry]
  with pytest.raises(TypeError, match=r"str.*path (args\[1\]|s\b)"):
    make()(np.ones(8, np.float32), "abc")


def _wsc(w, x):
  return jnp.sum(jax.lax.with_sharding_constraint(jnp.sin(x @ w), P("x", "y")))


def _context_shard_map(w, x):
  return jnp.sum(jax.shard_map(lambda a: jax.lax.psum(a, "y"), in_specs=P("x", "y"),
                               out_specs=P("x", None))(x @ w))


def _plain(w, x):
  return jnp.sum(jnp.sin(x @ w))


@pytest.mark.parametrize("fn", [_wsc, _context_shard_map, _plain])
def test_every_entry_point_under_set_mesh_of_an_explicit_mesh(fn):
  """Under ``jax.set_mesh(jax.make_mesh(...))`` (a bare-``P`` constraint and a
  shard_map take that mesh): infer_shardings, coverage, auto_shard and
  gspmd_jit trace as partition does (they failed: jax's 'context mesh should
  match', or a constraint made an assertion under Explicit axes)."""
  m = _explicit((2, 4), ("x", "y"))
  rng = np.random.default_rng(1)
  w = rng.standard_normal((16, 32)).astype(np.float32)
  x = rng.standard_normal((8, 16)).astype(np.float32)
  specs = (P(None, "y"), P("x"))
  with jax.set_mesh(gshard.make_mesh((2, 4), ("x", "y"))):   # Auto: jax.jit's reference
    want = float(jax.jit(fn)(w, x))
  with jax.set_mesh(m):
    got = float(gshard.partition(fn, m, in_specs=specs)(w, x))
    res = gshard.infer_shardings(fn, m, in_specs=specs)(w, x)
    cov = gshard.coverage(fn, w, x, mesh=m, in_specs=specs)
    plan = gshard.auto_shard(fn, m, check_memory=False)(w, x)
    base = float(gshard.gspmd_jit(fn, m, in_specs=specs)(w, x))
  np.testing.assert_allclose([got, base], [want, want], rtol=1e-5)
  assert res.mesh_sizes == {"x": 2, "y": 4} and cov.fallbacks == ()
  assert len(plan.in_specs) == 2


@pytest.mark.parametrize("context", [False, True])
def test_a_shard_map_over_the_explicit_mesh_sees_the_arguments_layouts(context):
  """User code that runs ``jax.shard_map(..., mesh=)`` over the Explicit mesh
  its arguments are committed to: jax checks the arguments' layouts against
  ``in_specs``, so gshard traces them as ``jax.jit`` does (typed), and only
  code jax refuses under the types is traced as the one-device program.
  Under ``jax.set_mesh`` of that mesh jax checks the context mesh too (it
  refused gshard's Auto one: 'context mesh should match')."""
  m = _explicit((2, 4), ("x", "y"))
  x = jax.device_put(np.arange(128, dtype=np.float32).reshape(8, 16),
                     NamedSharding(m, P("x", "y")))
  fn = lambda x: jax.shard_map(lambda a: jax.lax.psum(a, "y"), mesh=m, in_specs=P("x", "y"),
                               out_specs=P("x"))(x) * 2.0
  with jax.set_mesh(m) if context else contextlib.nullcontext():
    got = gshard.partition(fn, m, in_specs=(P("x", "y"),))(x)
    want = jax.jit(fn)(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("call", [
    lambda x: jax.sharding.reshard(x, P("x")) * 2.0,
    lambda x: jnp.einsum("ij,jk->ik", x, x.T, out_sharding=P("x", None)),
])
def test_explicit_sharding_calls_are_an_error_that_names_the_fix(call):
  """jax's explicit-sharding calls under gshard (whose axes are Auto): jax's
  message spoke of Auto axes the user never chose; gshard's names the
  annotation to use instead."""
  m = _explicit((2, 4), ("x", "y"))
  x = np.ones((8, 8), np.float32)
  with jax.set_mesh(m), pytest.raises(ValueError, match=r"not gshard's.*gshard\.shard"):
    gshard.partition(call, m, in_specs=(P("x"),))(x)


@pytest.mark.parametrize("other", [((4, 2), ("x", "y")), ((8,), ("x",))])
def test_a_named_sharding_on_another_mesh_in_in_specs_is_an_error(other):
  """It was read as its spec on the partition mesh, silently."""
  m = gshard.make_mesh((2, 4), ("x", "y"))
  ns = NamedSharding(gshard.make_mesh(*other), P("x"))
  with pytest.raises(ValueError, match=r"in_specs\[0\]: a NamedSharding on mesh .*x=2, y=4"):
    gshard.partition(lambda w: w * 2, m, in_specs=(ns,))(np.ones((8, 4), np.float32))
  same = NamedSharding(m, P("x"))
  out = gshard.partition(lambda w: w * 2, m, in_specs=(same,))(np.ones((8, 4), np.float32))
  assert float(out.sum()) == 64.0
