"""Derivatives taken outside a partitioned function: ``jax.grad(partition(f))``.

jax differentiated the per-device program, which is not ``f``'s derivative
where gshard rewrites an op: a max over a split dim combined through integer
keys gave a zero gradient, a ``custom_jvp`` ran as its body (``relu`` at 0 gave
0.5, a user's rule was ignored), a linear solve read its matrix through
``stop_gradient`` (a zero gradient). A traced call is a ``jax.custom_jvp``
whose derivative is gshard's program of ``jax.jvp(f)``.

Hypothesis: random meshes, split dims and axes (tuples, uneven sizes), and
those ops; reverse mode (``jax.grad``, also under an outer ``jax.jit``) and
forward mode (``jax.jvp``) against ``jax.jit`` on one device, within the
derived bound of ``helpers_numerics`` (against a float64 run).
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
from helpers_numerics import assert_close_to_f64, f64_run
from helpers_partition import mesh

MESHES = [((8,), ("a",)), ((2, 4), ("a", "b")), ((4, 2), ("a", "b")),
          ((2, 2, 2), ("a", "b", "c"))]


@jax.custom_jvp
def _scaled_sin(x):
  return jnp.sin(x)


_scaled_sin.defjvp(lambda p, t: (jnp.sin(p[0]), 0.1 * t[0]))


def _weights(shape):
  return jnp.cos(jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape))


# each op: f(x) of a [rows, cols] array, its split dim (0 or 1) chosen per example
OPS = {
    "max over the split dim": lambda x, d: jnp.max(x, axis=d),
    "min of all": lambda x, d: jnp.min(x),
    "max of |x|": lambda x, d: jnp.max(jnp.abs(x), axis=d),
    "clip at the max": lambda x, d: jnp.clip(x, -1.0, jnp.max(x, axis=d, keepdims=True)),
    "relu at 0": lambda x, d: jax.nn.relu(jnp.round(x)),
    "a user's custom_jvp": lambda x, d: _scaled_sin(x),
    "inverse of a batch of matrices": lambda x, d: jnp.linalg.inv(
        0.1 * x[:, :4].reshape(-1, 2, 2) + 3 * jnp.eye(2)),
    "solve": lambda x, d: jnp.linalg.solve(
        0.1 * x[:, :4].reshape(-1, 2, 2) + 3 * jnp.eye(2), x[:, 4:6].reshape(-1, 2, 1)),
    "log_softmax over the split dim": lambda x, d: jax.nn.log_softmax(x, axis=d),
    "cummax over the split dim": lambda x, d: jax.lax.cummax(x, axis=d),
    # its tangent is a cumsum: transposed in reverse mode (a select on the
    # values and a generic reduce in the rule did not transpose)
    "cumsum over the split dim": lambda x, d: jax.lax.cumsum(x, axis=d) ** 2,
    "reverse cumsum": lambda x, d: jax.lax.cumsum(x, axis=d, reverse=True) ** 2,
}


@st.composite
def cases(draw):
  shape, names = draw(st.sampled_from(MESHES))
  sizes = dict(zip(names, shape))
  d = draw(st.sampled_from([0, 1]))
  n = draw(st.integers(1, len(names)))
  axes = tuple(draw(st.permutations(names))[:n])
  split = int(np.prod([sizes[a] for a in axes]))
  rows = draw(st.sampled_from([split, 2 * split, split + 2])) if d == 0 else 8
  cols = draw(st.sampled_from([split, 2 * split, split + 2])) if d == 1 else 6
  op = draw(st.sampled_from(sorted(OPS)))
  if op in ("inverse of a batch of matrices", "solve"):
    cols = max(cols, 6)
  spec = P(axes if len(axes) > 1 else axes[0], None) if d == 0 else \
      P(None, axes if len(axes) > 1 else axes[0])
  seed = draw(st.integers(0, 2 ** 16))
  # values on a grid of 1/4 (ties and exact zeros for relu), distinct enough
  x = np.random.default_rng(seed).integers(-12, 13, (rows, cols)).astype(np.float32) / 4
  return (shape, names), spec, d, op, jnp.asarray(x)


def _loss(op, d):
  def loss(x):
    y = OPS[op](x, d)
    return jnp.sum(_weights(y.shape) * y)
  return loss


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_grad_of_a_partitioned_function_is_the_functions_gradient(case):
  (shape, names), spec, d, op, x = case
  loss = _loss(op, d)
  part = gshard.partition(loss, mesh(shape, names), in_specs=(spec,))
  want = jax.jit(jax.grad(loss))(x)
  exact = f64_run(jax.jit(jax.grad(loss)), x)
  n = x.size
  for got in (jax.grad(part)(x), jax.jit(jax.grad(part))(x)):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(np.asarray(got)), np.isnan(np.asarray(want)))
    assert_close_to_f64(np.asarray(got), np.asarray(want), exact, n=n, what=f"{op}: ")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_jvp_of_a_partitioned_function_is_the_functions_jvp(case):
  (shape, names), spec, d, op, x = case

  def f(x):
    return OPS[op](x, d)
  part = gshard.partition(f, mesh(shape, names), in_specs=(spec,))
  t = _weights(x.shape)
  want = jax.jit(lambda x, t: jax.jvp(f, (x,), (t,)))(x, t)
  exact = f64_run(jax.jit(lambda x, t: jax.jvp(f, (x,), (t,))), x, t)
  got = jax.jvp(part, (x,), (t,))
  assert_close_to_f64(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want), exact,
                      n=x.size, what=f"{op}: ")


@jax.custom_vjp
def _ste(x):
  return jnp.round(x)


_ste.defvjp(lambda x: (jnp.round(x), None), lambda _, g: (g * 0.5,))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), scale=st.sampled_from([1, 2]))
def test_a_custom_vjp_differentiated_from_outside_runs_its_own_rule(case, scale):
  # a straight-through estimator (its rule: half the cotangent): the gradient
  # was 0 (the body's round), silently. Reverse mode is the custom_vjp's own
  # rule; an int argument and a weight dict ride along
  (shape, names), spec, d, op, x = case

  def loss(params, x, k):
    y = OPS[op](_ste(x * 1.5) * k, d)
    return jnp.sum(_weights(y.shape) * y) + params["b"] * params["c"]
  params = {"b": jnp.float32(0.25), "c": jnp.float32(3.0)}
  part = gshard.partition(loss, mesh(shape, names), in_specs=(None, spec, None))
  grad = jax.grad(loss, argnums=(0, 1))
  want = jax.jit(grad)(params, x, scale)
  exact = f64_run(jax.jit(grad), params, x, scale)
  for got in (jax.grad(part, argnums=(0, 1))(params, x, scale),
              jax.jit(jax.grad(part, argnums=(0, 1)))(params, x, scale)):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert_close_to_f64(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want), exact,
                        n=x.size, what=f"{op}: ")
  with pytest.raises(TypeError, match="forward-mode"):   # jax's own refusal
    jax.jvp(lambda x: part(params, x, scale), (x,), (x,))


def test_grad_of_a_partitioned_train_step_with_padded_state():
  # the jvp program keeps the primal program's layouts and pairs: uneven
  # state that enters padded leaves padded, and its tangent too
  m = mesh((2, 4), ("data", "model"))
  w, x = jnp.linspace(-1, 1, 10 * 14).reshape(10, 14), jnp.linspace(0, 1, 60).reshape(6, 10)

  def step(w, x):
    return w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w), jnp.max(x @ w)
  part = gshard.partition(step, m, in_specs=(P(None, "model"), P("data")))
  padded, _ = part(w, x)
  assert isinstance(padded, gshard.PaddedArray)

  def outer(w):
    new, top = part(w, x)
    return jnp.sum(jnp.asarray(new) ** 2) + top
  want = jax.jit(jax.grad(lambda w: jnp.sum(step(w, x)[0] ** 2) + step(w, x)[1]))(w)
  got = jax.grad(outer)(w)
  exact = f64_run(jax.jit(jax.grad(lambda w: jnp.sum(step(w, x)[0] ** 2) + step(w, x)[1])), w)
  assert_close_to_f64(np.asarray(got), np.asarray(want), exact, n=140)
  # the step's own output, padded, differentiated through
  g = jax.grad(lambda p: jnp.sum(jnp.asarray(part(p, x)[0]) ** 2))(padded)
  assert isinstance(g, gshard.PaddedArray) and g.shape == (10, 14)


def test_remat_scan_and_closures_around_a_partitioned_call():
  m = mesh((8,), ("a",))
  x = jnp.cos(jnp.arange(16.0))
  sin = gshard.partition(jnp.sin, m, in_specs=(P("a"),))
  # jax.checkpoint around the call: the jvp program ran wrapped in a
  # custom_jvp of its own, whose primal outputs remat could not separate
  for g in (jax.grad(lambda w: jnp.sum(jax.checkpoint(sin)(w))),
            jax.jit(jax.grad(lambda w: jnp.sum(jax.checkpoint(sin)(w))))):
    np.testing.assert_allclose(np.asarray(g(x)), np.cos(np.asarray(x)), rtol=1e-6)

  def body(c, row):
    return c + jax.checkpoint(sin)(row * c).sum(), None
  got = jax.grad(lambda c: jax.lax.scan(body, c, jnp.ones((3, 8)))[0])(1.0)
  want = jax.grad(lambda c: jax.lax.scan(
      lambda c, row: (c + jnp.sin(row * c).sum(), None), c, jnp.ones((3, 8)))[0])(1.0)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  # a traced value the function closes over (an outer grad's parameter):
  # it read as a constant of the per-device program, whose max gave 0
  for closure in (lambda s: gshard.partition(lambda x: jnp.max(x * s), m,
                                             in_specs=(P("a"),))(x),
                  lambda s: gshard.partition(lambda x: jnp.max(x * s), m,
                                             in_specs=(P("a"),))(x * 1)):
    assert float(jax.grad(closure)(2.0)) == float(jnp.max(x))
    assert float(jax.jit(jax.grad(closure))(2.0)) == float(jnp.max(x))
  # second order: the jvp program's own derivative
  top = gshard.partition(lambda w: jnp.max(jnp.sin(w) * w), m, in_specs=(P("a"),))
  np.testing.assert_allclose(np.asarray(jax.hessian(top)(x)),
                             np.asarray(jax.hessian(lambda w: jnp.max(jnp.sin(w) * w))(x)),
                             rtol=1e-5, atol=1e-6)


def _types(xs):
  return [(a.shape, a.dtype, a.weak_type) for a in map(jax.typeof, jax.tree.leaves(xs))]


@pytest.mark.parametrize("outer_jit", [False, True])
@pytest.mark.parametrize("with_vjp", [False, True])
def test_the_gradient_of_a_weakly_typed_scalar_stays_weak(outer_jit, with_vjp):
  # jax.grad of jax.jit gives a Python float's gradient weakly typed; the
  # transpose of gshard's jvp program gave it strong (a loop feeding it back
  # then had another input signature); forward mode too
  act = _ste if with_vjp else jnp.sin

  def loss(s, x):
    return jnp.sum(act(s * x))

  x = jax.random.normal(jax.random.PRNGKey(0), (8, 4))
  part = gshard.partition(loss, mesh((2, 4), ("a", "b")), in_specs=(P(), P("a")))
  grad, ref = jax.grad(part, argnums=(0, 1)), jax.grad(jax.jit(loss), argnums=(0, 1))
  if outer_jit:
    grad, ref = jax.jit(grad), jax.jit(ref)
  got, want = grad(2.0, x), ref(2.0, x)
  assert _types(got) == _types(want)
  assert jax.typeof(got[0]).weak_type
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-6)
  if not with_vjp:
    got = jax.jvp(part, (2.0, x), (1.0, jnp.ones_like(x)))
    want = jax.jvp(jax.jit(loss), (2.0, x), (1.0, jnp.ones_like(x)))
    assert _types(got) == _types(want)
