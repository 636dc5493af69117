"""``gshard.pipeline.shift`` and its rules; vmap with ``spmd_axis_name``; ``checkpoint_name``.

The shift is checked against ``jnp.roll`` and a pad-and-slice written here
(not gshard's own reference), eagerly, under jit, vmap, jvp and grad, and
partitioned: along a dim split over one or two mesh axes it must be exactly
the ppermutes the partition rule documents (counted in gshard's record and in
XLA's optimized HLO: collective permutes only, never an all-gather), with the
reverse shift as its transpose.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import gshard
from gshard.pipeline.shift import shift, shift_p
from gshard.spmd import registry
from helpers_partition import hlo_collectives, mesh


def expected(x, axis, offset, circular):
  """The shift written with numpy: roll, or a slice padded with zeros."""
  x = np.asarray(x)
  if circular:
    return np.roll(x, offset, axis=axis)
  out = np.zeros_like(x)
  n = x.shape[axis]
  src = [slice(None)] * x.ndim
  dst = [slice(None)] * x.ndim
  if offset >= 0:
    src[axis], dst[axis] = slice(0, max(n - offset, 0)), slice(min(offset, n), n)
  else:
    src[axis], dst[axis] = slice(min(-offset, n), n), slice(0, max(n + offset, 0))
  out[tuple(dst)] = x[tuple(src)]
  return out


# -- the primitive -----------------------------------------------------------------

@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
       data=st.data(), circular=st.booleans())
def test_eager_and_jit_equal_numpy(shape, data, circular):
  axis = data.draw(st.integers(-len(shape), len(shape) - 1))
  offset = data.draw(st.integers(-7, 7))
  x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape) + 1
  want = expected(x, axis, offset, circular)
  np.testing.assert_array_equal(shift(x, axis, offset, circular), want)
  np.testing.assert_array_equal(
      jax.jit(lambda v: shift(v, axis, offset, circular))(x), want)


def test_examples_of_the_docstring():
  np.testing.assert_array_equal(shift(jnp.arange(4), offset=1), [0, 0, 1, 2])
  np.testing.assert_array_equal(shift(jnp.arange(4), offset=1, circular=True), [3, 0, 1, 2])
  np.testing.assert_array_equal(shift(jnp.arange(4), offset=-1), [1, 2, 3, 0])


@pytest.mark.parametrize("circular", [False, True])
@pytest.mark.parametrize("offset", [1, -2, 5])
def test_grad_is_the_reverse_shift(offset, circular):
  x = jax.random.normal(jax.random.PRNGKey(0), (5, 3))
  w = jax.random.normal(jax.random.PRNGKey(1), (5, 3))
  f = lambda v: jnp.sum(shift(v, 0, offset, circular) * w)
  g = lambda v: jnp.sum(jnp.asarray(expected(np.eye(5), 0, offset, circular)) @ v * w)
  np.testing.assert_allclose(jax.grad(f)(x), jax.grad(g)(x), rtol=1e-6)
  np.testing.assert_allclose(jax.grad(f)(x), expected(w, 0, -offset, circular), rtol=1e-6)
  transposed = jax.make_jaxpr(jax.grad(f))(x)
  params = [e.params for e in transposed.jaxpr.eqns if e.primitive is shift_p]
  assert {p["offset"] for p in params} == {offset, -offset}, params


def test_jvp_is_the_shift_of_the_tangent():
  x, t = jnp.arange(6.0).reshape(3, 2), jnp.ones((3, 2))
  y, dy = jax.jvp(lambda v: shift(v, 1, 1), (x,), (t,))
  np.testing.assert_array_equal(y, expected(x, 1, 1, False))
  np.testing.assert_array_equal(dy, expected(t, 1, 1, False))


@pytest.mark.parametrize("in_axes", [0, 1, 2])
def test_vmap_moves_the_shifted_dim(in_axes):
  x = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
  got = jax.vmap(lambda v: shift(v, 1, 1, True), in_axes=in_axes, out_axes=in_axes)(x)
  want = np.stack([expected(np.take(x, i, in_axes), 1, 1, True)
                   for i in range(x.shape[in_axes])], in_axes)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("call, message", [
    (lambda: shift(jnp.float32(1)), "x is a scalar"),
    (lambda: shift(jnp.ones((2, 3)), axis=2), r"axis must be an int in \[-2, 1\]"),
    (lambda: shift(jnp.ones((2, 3)), offset=1.5), "offset must be an int"),
])
def test_errors(call, message):
  with pytest.raises(ValueError, match=message):
    call()


# -- the sharding rule ---------------------------------------------------------------

def test_sharding_rule_keeps_every_factor_and_is_linear():
  rule = registry.sharding_rule("pipeline_shift")
  aval = jax.core.ShapedArray((8, 16), jnp.float32)
  assert str(rule([aval], [aval], axis=0, offset=1, circular=False)) == "ab->ab linear=unary"
  assert registry.entry("pipeline_shift").rule_name == "shift_rule"


def test_a_pending_sum_passes_through_the_shift():
  """``shift(x @ w)`` with the contracted dim split: the shift moves the partial
  sums (+model), and one psum resolves them after it (after the sum over the
  last dim, where the psum is smallest)."""
  m = mesh((4, 2), ("stage", "model"))
  g = lambda x, w: jnp.sum(shift(x @ w, 0, 1) * 2.0, 1)
  specs = (P("stage", "model"), P("model", None))
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 4))
  w = jax.random.normal(jax.random.PRNGKey(1), (4, 3))
  res = gshard.infer_shardings(g, m, in_specs=specs)(x, w)
  (sh,) = [e for e in res.jaxpr.jaxpr.eqns if e.primitive is shift_p]
  assert str(res.sharding(sh.invars[0])) == "[stage,_]+model"
  assert str(res.sharding(sh.outvars[0])) == "[stage,_]+model"
  step = gshard.partition(g, m, in_specs=specs)
  np.testing.assert_allclose(step(x, w), jnp.sum(expected(x @ w, 0, 1, False) * 2.0, 1),
                             rtol=1e-5)
  kinds = sorted((c.kind, c.axes) for c in step.lower(x, w).collectives())
  assert kinds == [("ppermute", ("stage",)), ("psum", ("model",))], kinds


# -- partitioned ---------------------------------------------------------------------

CASES = [
    # mesh, spec of x [8, 6], offset, circular, ppermutes: list of rows sent per device
    (((4, 2), ("stage", "data")), P("stage", "data"), 1, False, [1]),
    (((4, 2), ("stage", "data")), P("stage", "data"), 1, True, [1]),
    (((4, 2), ("stage", "data")), P("stage", "data"), -1, True, [1]),
    (((4, 2), ("stage", "data")), P("stage", "data"), 3, True, [1, 1]),
    (((4, 2), ("stage", "data")), P("stage", "data"), 2, False, [2]),
    (((4, 2), ("stage", "data")), P("stage", "data"), -5, False, [1, 1]),
    (((8,), ("stage",)), P("stage"), 1, True, [1]),
    (((8,), ("stage",)), P("stage"), 1, False, [1]),
    (((8,), ("stage",)), P("stage"), -3, True, [1]),
    (((2, 4), ("a", "b")), P(("a", "b")), 1, True, [1]),
    (((2, 4), ("a", "b")), P(("b", "a")), -1, False, [1]),
    (((2, 4), ("a", "b")), P("a"), 1, True, [1]),
    (((2, 4), ("a", "b")), P("a"), 5, False, [3]),
    (((4, 2), ("stage", "data")), P("stage", "data"), 8, True, []),
    (((4, 2), ("stage", "data")), P("stage", "data"), 9, False, []),
]


@pytest.mark.parametrize("mesh_args, spec, offset, circular, rows", CASES)
def test_partitioned_shift_is_ppermutes_only(mesh_args, spec, offset, circular, rows):
  m = mesh(*mesh_args)
  sizes = dict(zip(m.axis_names, m.devices.shape))
  x = jnp.arange(48, dtype=jnp.float32).reshape(8, 6) + 1
  w = jax.random.normal(jax.random.PRNGKey(2), (8, 6))
  row_axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
  col_shards = math.prod(sizes[a] for a in (spec[1:2] if len(spec) > 1 else ()))

  def f(x):
    y = shift(gshard.shard(x, spec), 0, offset, circular)
    return jnp.sum(y * w), y

  step = gshard.partition(f, m, in_specs=spec)
  value, y = step(x)
  np.testing.assert_array_equal(y, expected(x, 0, offset, circular))
  np.testing.assert_allclose(value, np.sum(expected(x, 0, offset, circular) * w), rtol=1e-5)
  low = step.lower(x)
  permutes = [c for c in low.collectives() if c.kind == "ppermute"]
  assert sorted(c.bytes for c in permutes) == sorted(r * (6 // col_shards) * 4 for r in rows)
  assert all(set(c.axes) == set(row_axes) for c in permutes)
  assert {c.kind for c in low.collectives()} <= {"ppermute", "psum"}
  hlo = hlo_collectives(low.compile().as_text(), m)
  assert len([c for c in hlo if c.kind == "collective-permute"]) == len(rows)
  assert "all-gather" not in {c.kind for c in hlo}
  grad = gshard.partition(jax.grad(lambda x: f(x)[0]), m, in_specs=spec)
  np.testing.assert_allclose(grad(x), expected(w, 0, -offset, circular), rtol=1e-6)
  assert {c.kind for c in grad.lower(x).collectives()} <= {"ppermute"}


@given(n=st.sampled_from([8, 16, 24]), offset=st.integers(-30, 30), circular=st.booleans(),
       two_axes=st.booleans())
def test_partitioned_shift_on_random_offsets_equals_numpy(n, offset, circular, two_axes):
  m = mesh((2, 4), ("a", "b")) if two_axes else mesh((4,), ("b",))
  spec = P(("a", "b")) if two_axes else P("b")
  x = np.arange(n * 3, dtype=np.float32).reshape(n, 3) + 1
  step = gshard.partition(lambda v: shift(gshard.shard(v, spec), 0, offset, circular), m,
                          in_specs=spec)
  np.testing.assert_array_equal(step(x), expected(x, 0, offset, circular))


def test_shift_along_an_unsplit_dim_is_local():
  m = mesh((4,), ("stage",))
  x = np.arange(24, dtype=np.float32).reshape(4, 6)
  step = gshard.partition(lambda v: shift(gshard.shard(v, P("stage")), 1, 2, True), m,
                          in_specs=P("stage"))
  np.testing.assert_array_equal(step(x), expected(x, 1, 2, True))
  assert step.lower(x).collectives() == []


def test_shift_along_an_unevenly_split_dim_is_gathered_and_correct():
  m = mesh((4,), ("stage",))
  x = np.arange(10 * 3, dtype=np.float32).reshape(10, 3)
  step = gshard.partition(lambda v: shift(v, 0, 1) + 0, m, in_specs=P("stage"))
  np.testing.assert_array_equal(step(x), expected(x, 0, 1, False))


def test_roll_gathers_where_shift_permutes():
  """Why the primitive exists: jnp.roll along the split dim partitions to an all-gather."""
  m = mesh((4,), ("stage",))
  x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
  f = lambda roll: lambda v: gshard.shard(roll(gshard.shard(v, P("stage"))), P("stage"))
  rolled = gshard.partition(f(lambda v: jnp.roll(v, 1, 0)), m, in_specs=P("stage"))
  shifted = gshard.partition(f(lambda v: shift(v, 0, 1, True)), m, in_specs=P("stage"))
  np.testing.assert_array_equal(rolled(x), shifted(x))
  assert "all_gather" in {c.kind for c in rolled.lower(x).collectives()}
  assert [c.kind for c in shifted.lower(x).collectives()] == ["ppermute"]


# -- vmap with spmd_axis_name ----------------------------------------------------------

def _annotations(jaxpr):
  return [str(e.params["annotation"]) for e in jaxpr.eqns
          if e.primitive.name == "sharding_annotation"]


def test_vmap_spmd_axis_name_splits_the_vmapped_dim():
  x = jnp.ones((4, 8, 16))
  f = lambda v: gshard.shard(v, P("data", P.UNCONSTRAINED))
  named = jax.make_jaxpr(jax.vmap(f, spmd_axis_name="stage"))(x).jaxpr
  assert _annotations(named) == ["[stage,data,?]"]
  plain = jax.make_jaxpr(jax.vmap(f))(x).jaxpr
  assert _annotations(plain) == ["[_,data,?]"]
  moved = jax.make_jaxpr(jax.vmap(f, in_axes=1, spmd_axis_name=("a", "b")))(x).jaxpr
  assert _annotations(moved) == ["[data,a*b,?]"]


def test_vmap_spmd_axis_name_under_grad_annotates_the_cotangent():
  x = jnp.ones((4, 8))
  f = lambda v: jnp.sum(jax.vmap(lambda r: gshard.split(r, 0, "data") ** 2,
                                 spmd_axis_name="stage")(v))
  assert _annotations(jax.make_jaxpr(jax.grad(f))(x).jaxpr) == ["[stage,data]"] * 2


def test_vmap_spmd_axis_name_already_in_the_annotation_is_an_error():
  with pytest.raises(ValueError, match="spmd_axis_name=\\('data',\\).*already uses mesh axis "
                                       "'data'"):
    jax.make_jaxpr(jax.vmap(lambda v: gshard.split(v, 0, "data"), spmd_axis_name="data"))(
        jnp.ones((4, 8)))


def test_vmap_spmd_axis_name_partitions_without_gathering():
  m = mesh((4, 2), ("stage", "data"))
  w = jax.random.normal(jax.random.PRNGKey(0), (4, 16, 16))
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 8, 16))

  def layer(w, h):
    return gshard.split(jnp.tanh(h @ w), 0, "data")

  step = gshard.partition(lambda w, x: jax.vmap(layer, spmd_axis_name="stage")(w, x), m,
                          in_specs=(P("stage"), P("stage", "data")))
  np.testing.assert_allclose(step(w, x), jax.vmap(layer)(w, x), rtol=1e-5)
  assert step.lower(w, x).collectives() == []


# -- checkpoint_name ---------------------------------------------------------------------

def test_checkpoint_name_is_partitioned_as_an_identity():
  from jax.ad_checkpoint import checkpoint_name
  m = mesh((2, 4), ("data", "model"))
  policy = jax.checkpoint_policies.save_only_these_names("h")

  def f(w, x):
    h = checkpoint_name(gshard.split(x, 0, "data") @ w, "h")
    return jnp.sum(jnp.tanh(h))

  g = jax.grad(jax.checkpoint(f, policy=policy))
  step = gshard.partition(g, m, in_specs=(P(None, "model"), P("data")), strict=True)
  w = jax.random.normal(jax.random.PRNGKey(0), (16, 8))
  x = jax.random.normal(jax.random.PRNGKey(1), (8, 16))
  np.testing.assert_allclose(step(w, x), g(w, x), rtol=1e-5, atol=1e-5)
  low = step.lower(w, x)
  assert low.fallbacks == []
  cov = gshard.coverage(g, w, x)
  assert (cov["name"].sharding_rule, cov["name"].partition) == (True, "generic")
