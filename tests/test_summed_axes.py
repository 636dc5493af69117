"""A contraction whose summed dim only one operand splits, and a value read
again split less than it was gathered.

``x[:, D@axes] @ w`` with ``w`` replicated: computing where ``x`` is leaves a
partial sum of ``x @ w`` (at least a reduce-scatter of the result to
resolve); gathering ``x`` sends ``x``'s size instead. gshard gathers where
that sends less, as GSPMD does, and keeps the sum where every operand splits
the summed dim (data parallelism's weight gradient). A value already
gathered in the program is sliced, not gathered again, where a later reader
wants it split less than it arrived.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import gshard
from helpers_partition import mesh

MESHES = [((8,), ("a",)), ((2, 4), ("a", "b")), ((4, 2), ("a", "b")), ((2, 2, 2), ("a", "b", "c"))]


@settings(max_examples=25, deadline=None)
@given(m=st.sampled_from(MESHES), take=st.integers(1, 3), reverse=st.booleans(),
       b=st.sampled_from([2, 8, 32]), d=st.sampled_from([8, 16]), f=st.sampled_from([4, 16, 64]),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_an_operand_split_on_the_summed_dim_alone_is_gathered_when_that_sends_less(
    m, take, reverse, b, d, f, dtype):
  shape, names = m
  axes = names[:take][::-1] if reverse else names[:take]
  n = int(np.prod([dict(zip(names, shape))[a] for a in axes]))
  x = jax.random.normal(jax.random.PRNGKey(b + f), (b, d), dtype)
  w = jax.random.normal(jax.random.PRNGKey(d), (d, f), dtype)

  def fn(x, w):
    return jax.nn.relu(x @ w)        # relu: the sum cannot stay pending

  part = gshard.partition(fn, mesh(shape, names), in_specs=(P(None, axes), P()),
                          out_specs=P())
  lowered = part.lower(x, w)
  size = jnp.dtype(dtype).itemsize
  gather_x = (n - 1) * b * d * size // n               # all-gather of x
  psum_h = 2 * (n - 1) * b * f * size // n              # all-reduce of x @ w
  if b * d < b * f:                  # the gather sends less than even a reduce-scatter
    assert lowered.total_bytes() == gather_x, lowered.explain()
  else:
    assert lowered.total_bytes() <= psum_h, lowered.explain()
  # gathered: the same products in the same order as one device; summed
  # across devices: the D products of each entry summed in another order,
  # off by at most D ulps of the sum of magnitudes (each rounding in dtype)
  got = np.asarray(part(x, w), np.float32)
  want = np.asarray(jax.jit(fn)(x, w), np.float32)
  mag = np.asarray(jnp.abs(x).astype(jnp.float32) @ jnp.abs(w).astype(jnp.float32))
  assert (np.abs(got - want) <= 2 * d * float(jnp.finfo(dtype).eps) * mag).all()


def test_data_parallel_weight_gradients_stay_a_sum():
  # gathering the 16 rows of x and of the cotangent would send less than
  # all-reducing the 64x256 gradient, but every operand splits the batch:
  # the expert's layout sums the gradient and repeats no compute
  x = jax.random.normal(jax.random.PRNGKey(0), (16, 64))
  w = jax.random.normal(jax.random.PRNGKey(1), (64, 256))

  def step(w, x):
    return w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)

  lowered = gshard.partition(step, mesh((8,), ("a",)), in_specs=(P(), P("a"))).lower(w, x)
  kinds = {c.kind for c in lowered.collectives()}
  assert kinds <= {"psum", "psum_scatter"} and kinds, lowered.explain()


def test_a_gathered_value_is_sliced_where_read_again_split_less():
  # sort gathers x whole; the product wants x split over a only: a slice of
  # the gathered copy, not a second all-gather over b (896 + 384 B before)
  x = jnp.arange(256.0).reshape(16, 16)[::-1]
  z = jnp.ones((16, 16))

  def f(x, z):
    return jnp.sort(x, axis=0), x * z

  part = gshard.partition(f, mesh((2, 4), ("a", "b")), in_specs=(P(("a", "b")), P("a")),
                          out_specs=(P(), P("a")))
  lowered = part.lower(x, z)
  assert [(c.kind, c.axes) for c in lowered.collectives()] == [("all_gather", ("a", "b"))], \
      lowered.explain()
  got = part(x, z)
  np.testing.assert_array_equal(np.asarray(got[0]), np.sort(np.asarray(x), axis=0))
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(x * z))
