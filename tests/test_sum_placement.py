"""Where a pending sum is resolved when passing it on saves nothing.

A dot contracting a split dim leaves a partial sum. Through a reduction over
unsplit dims it stays a sum; a division (``mean``), a scale or a cast after
it would take it too, but each device would then divide its own partial term
and the psum would add the quotients: ``sum_i (p_i / n)`` rounds differently
from the one-device ``(sum_i p_i) / n``. Where the psum costs the same bytes
before that op as after it, gshard resolves it before, so everything after
the sum runs as on one device. On exact data (integers on a grid: the sum is
exact in any order) the result must then be bit for bit ``jax.jit``'s.
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
from helpers_partition import mesh

pytestmark = pytest.mark.filterwarnings("error::gshard.PartitionWarning")

MESHES = [((8,), ("x",)), ((2, 4), ("x", "y")), ((4, 2), ("x", "y"))]
TAILS = {
    "mean over rows": lambda y: jnp.mean(y, axis=0),
    "mean of all": jnp.mean,
    "sum then divide by 3": lambda y: jnp.sum(y, axis=0) / 3.0,
    "sum then scale by 0.1": lambda y: 0.1 * jnp.sum(y, axis=0),
    "sum then bf16": lambda y: jnp.sum(y, axis=0).astype(jnp.bfloat16),
}


@st.composite
def _cases(draw):
  shape, names = draw(st.sampled_from(MESHES))
  m = draw(st.sampled_from([3, 5, 6, 7]))
  k = draw(st.sampled_from([8, 12, 16, 24]))
  n = draw(st.sampled_from([3, 5, 9, 12]))
  cut = draw(st.sampled_from([names[:1], names[-1:], names]))
  tail = draw(st.sampled_from(sorted(TAILS)))
  return shape, names, m, k, n, cut, tail, draw(st.integers(0, 2 ** 31 - 1))


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_cases())
def test_after_an_exact_sum_the_program_runs_as_on_one_device(case):
  shape, names, m, k, n, cut, tail, seed = case
  rng = np.random.default_rng(seed)
  # multiples of 1/4 below 8: every partial and total sum is exact in f32
  x = jnp.asarray(rng.integers(-32, 32, (m, k)) / 4, jnp.float32)
  w = jnp.asarray(rng.integers(-32, 32, (k, n)) / 4, jnp.float32)
  f = lambda x, w: TAILS[tail](x @ w)
  axes = cut if len(cut) > 1 else cut[0]
  step = gshard.partition(f, mesh(shape, names), in_specs=(P(None, axes), P(axes, None)))
  got, want = np.atleast_1d(step(x, w)), np.atleast_1d(jax.jit(f)(x, w))
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_the_psum_is_of_the_reduced_value_before_the_division():
  f = lambda x, w: jnp.mean(x @ w, axis=0)
  step = gshard.partition(f, mesh((2, 4), ("x", "y")), in_specs=(P(None, "y"), P("y", None)))
  x, w = jnp.ones((6, 16)), jnp.ones((16, 12))
  assert [(c.kind, c.primitive, c.shape) for c in step.lower(x, w).collectives()] == [
      ("psum", "reduce_sum", (12,))]
