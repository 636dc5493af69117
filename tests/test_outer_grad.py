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


def test_a_custom_vjp_reached_from_outside_is_an_error_naming_the_fix():
  # a straight-through estimator: its gradient was 0 (the body's round), silently
  @jax.custom_vjp
  def ste(x):
    return jnp.round(x)
  ste.defvjp(lambda x: (jnp.round(x), None), lambda _, g: (g,))

  def loss(x):
    return jnp.sum(ste(x))
  x = jnp.linspace(-2, 2, 8)
  m = mesh((8,), ("a",))
  with pytest.raises(TypeError, match=r"custom_vjp .*gshard.partition\(jax.grad\(loss\)"):
    jax.grad(gshard.partition(loss, m, in_specs=(P("a"),)))(x)
  inside = gshard.partition(jax.grad(loss), m, in_specs=(P("a"),))(x)
  np.testing.assert_array_equal(np.asarray(inside), np.ones(8, np.float32))


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
