"""A ``jax.shard_map`` in user code, whose body holds custom derivatives.

gshard runs a shard_map over its mesh as written (its program is itself per
device), binding each equation of the body again. A ``custom_jvp`` (``jax.nn.relu``)
or ``custom_vjp`` equation keeps its rules as functions only when bound as
jax's own interpreter binds it (``get_bind_params``): they crashed before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import gshard
from helpers_partition import assert_trees_close

pytestmark = pytest.mark.filterwarnings("error::gshard.PartitionWarning")


@jax.custom_vjp
def clip_grad(x):
  return jnp.tanh(x)


clip_grad.defvjp(lambda x: (jnp.tanh(x), x),
                 lambda x, g: (jnp.clip(g * (1 - jnp.tanh(x) ** 2), -0.1, 0.1),))


@jax.custom_jvp
def softplus(x):
  return jnp.logaddexp(x, 0.0)


softplus.defjvp(lambda p, t: (softplus(p[0]), t[0] * jax.nn.sigmoid(p[0])))

BODIES = {
    "relu": jax.nn.relu,
    "custom_vjp": clip_grad,
    "custom_jvp": softplus,
    "relu then psum": lambda a: jax.lax.psum(jax.nn.relu(a), "b"),
}


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.sampled_from(sorted(BODIES)), grad=st.booleans(),
       spec=st.sampled_from([P("a", "b"), P("b", None), P(None, "a"), P(("a", "b"))]))
def test_custom_derivatives_in_a_shard_map_body_equal_one_device(body, grad, spec):
  m = gshard.make_mesh((2, 4), ("a", "b"))
  f = BODIES[body]
  out_spec = spec if body != "relu then psum" else P(*[None if d == "b" else d for d in spec])

  def fn(x):
    y = jax.shard_map(f, mesh=m, in_specs=spec, out_specs=out_spec, check_vma=False)(x)
    return jnp.sum(y * jnp.arange(y.size, dtype=y.dtype).reshape(y.shape))

  fn = jax.grad(fn) if grad else fn
  x = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
  want = jax.jit(fn)(x)
  got = gshard.partition(fn, m, in_specs=(P("a"),))(x)
  assert_trees_close(got, want, rtol=1e-5, atol=1e-5, what=body)


def test_a_shard_map_bodys_collectives_are_reported():
  """The psum a user's shard_map body runs itself is in ``collectives()`` and
  ``explain()``, with the all-reduce's bytes (the report listed none), and a
  scan's inside the body once per trip, as gshard counts its own."""
  from jax import lax

  from helpers_partition import hlo_collectives
  m = gshard.make_mesh((2, 4), ("data", "model"))

  def rowpar(x, w):
    y = lax.psum(x @ w, "model")
    return lax.scan(lambda c, _: (c + lax.pmax(c, "data"), None), y, None, length=3)[0]

  def f(x, w):
    y = jax.shard_map(rowpar, mesh=m, in_specs=(P("data", "model"), P("model", None)),
                      out_specs=P("data", None))(x, w)
    return jnp.tanh(y)

  x, w = jnp.ones((16, 64)), jnp.ones((64, 128))
  low = gshard.partition(f, m, in_specs=(P("data", "model"), P("model", None))).lower(x, w)
  cols = {c.kind: c for c in low.collectives()}
  assert set(cols) == {"psum", "pmax"}, low.collectives()
  block = 8 * 128 * 4                      # f32[8,128] per device
  assert cols["psum"].bytes == 2 * 3 * block // 4 and cols["psum"].axes == ("model",)
  assert cols["pmax"].bytes == 3 * block and cols["pmax"].axes == ("data",)
  assert "test_shard_map_bodies.py" in cols["psum"].source
  hlo = [c for c in hlo_collectives(low.compile().as_text(), m) if c.axes == ("model",)]
  assert [c.nbytes for c in hlo] == [block]
  assert "2 collectives" in low.explain().splitlines()[0]


def test_loops_and_branches_in_a_shard_map_body_equal_one_device():
  """A scan, a fori_loop and a cond inside a shard_map body, with collectives
  in each: their jaxprs are typed with the varying axes, which gshard's
  program (check_vma off) does not carry; binding them as they were, jax
  refused the scan's carry (a jax error from gshard's frames)."""
  from jax import lax
  m = gshard.make_mesh((2, 4), ("data", "model"))

  def body(x, w):
    y = lax.psum(x @ w, "model")
    y = lax.scan(lambda c, _: (c + lax.pmax(c, "data"), None), y, None, length=3)[0]
    y = lax.fori_loop(0, 2, lambda i, c: c * 0.5 + lax.psum(c, "model") / 4, y)
    return lax.cond(y.sum() > 0, lambda c: c + 1, lambda c: c - lax.pmin(c, "data"), y)

  def f(x, w):
    y = jax.shard_map(body, mesh=m, in_specs=(P("data", "model"), P("model", None)),
                      out_specs=P("data", None))(x, w)
    return jnp.tanh(y)

  x, w = jnp.linspace(-1, 1, 16 * 64).reshape(16, 64), jnp.ones((64, 128)) / 64
  for sign in (1, -1):
    got = gshard.partition(f, m, in_specs=(P("data", "model"), P("model", None)))(sign * x, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(f)(sign * x, w)),
                               rtol=1e-6, atol=1e-6)


def test_custom_derivatives_with_loops_in_a_shard_map_body():
  """A custom_jvp and a custom_vjp function whose bodies loop, inside a
  shard_map body: their values and the partitioned gradient equal jax's (jax
  refused the loops' carries from gshard's frames). Their own derivative
  rules are not carried into gshard's program; differentiated from outside,
  the partitioned function is the partition of jax.jvp(f) (of jax.vjp(f)
  where a custom_vjp is inside), which carries their own rules."""
  from jax import lax
  m = gshard.make_mesh((2, 4), ("data", "model"))

  @jax.custom_jvp
  def cj(y):
    return lax.scan(lambda c, _: (jnp.sin(c), None), y, None, length=2)[0]
  cj.defjvp(lambda p, t: (cj(p[0]), t[0]))

  @jax.custom_vjp
  def cv(y):
    return lax.fori_loop(0, 2, lambda i, c: jnp.cos(c), y)
  cv.defvjp(lambda y: (cv(y), None), lambda r, g: (g,))

  def body(x, w):
    return cv(cj(lax.psum(x @ w, "model")))

  def f(x, w):
    return jnp.tanh(jax.shard_map(body, mesh=m, in_specs=(P("data", "model"), P("model", None)),
                                  out_specs=P("data", None))(x, w)).sum()

  x, w = jnp.linspace(-1, 1, 16 * 64).reshape(16, 64), jnp.ones((64, 32)) / 64
  specs = (P("data", "model"), P("model", None))
  np.testing.assert_allclose(float(gshard.partition(f, m, in_specs=specs)(x, w)),
                             float(jax.jit(f)(x, w)), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(gshard.partition(jax.grad(f), m, in_specs=specs)(x, w)),
                             np.asarray(jax.jit(jax.grad(f))(x, w)), rtol=1e-6, atol=1e-7)
  got = jax.grad(lambda x: gshard.partition(f, m, in_specs=specs)(x, w))(x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(jax.grad(f))(x, w)),
                             rtol=1e-6, atol=1e-7)

  def g(x, w):       # the custom_jvp alone: its own rule (tangent t), not its body's
    return jnp.tanh(jax.shard_map(lambda x, w: cj(lax.psum(x @ w, "model")), mesh=m,
                                  in_specs=specs, out_specs=P("data", None))(x, w)).sum()
  got = jax.grad(lambda x: gshard.partition(g, m, in_specs=specs)(x, w))(x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(jax.grad(g))(x, w)),
                             rtol=1e-6, atol=1e-7)
