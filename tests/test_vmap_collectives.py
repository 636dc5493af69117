"""``vmap(axis_name=...)`` with ``psum``/``pmean``/``pmax``/``pmin`` over the mapped axis.

vmap leaves ``psum[axes=(0,)]``: a collective over a positional axis, which
is the reduction of that dim (``reduce_sum``/``reduce_max``/``reduce_min``).
gshard partitions it as one: a split mapped dim is reduced on each device,
then combined across devices (a pending sum for ``psum``, pmax/pmin for the
others); no safe path. Hypothesis draws meshes, which dims are split (even
and uneven), the mapped dim, nesting, the collective and dtypes, and compares
with ``jax.jit`` bit for bit. Floats hold small integers (and NaN/+-inf/-0.0
for max/min), so a sum's order changes nothing and exact equality is the
right check; a float sum of arbitrary values is reassociated as any sum over
a split dim (``test_cumulative.py`` derives that bound).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import PartitionSpec as P

import gshard
from helpers_partition import mesh

pytestmark = pytest.mark.filterwarnings("error::gshard.PartitionWarning")

MESHES = [((8,), ("x",)), ((2, 4), ("x", "y")), ((4, 2), ("x", "y"))]
COLLECTIVES = {
    "psum": lambda r: lax.psum(r, "v"),
    "pmean": lambda r: r - lax.pmean(r, "v"),
    "pmax": lambda r: lax.pmax(r, "v"),
    "pmin": lambda r: lax.pmin(r, "v"),
    "psum of a pair": lambda r: sum(lax.psum((r, 2 * jnp.sum(r)), "v")),
}


@st.composite
def _cases(draw):
  shape, names = draw(st.sampled_from(MESHES))
  rank = draw(st.integers(1, 3))
  dims = tuple(draw(st.sampled_from([1, 2, 3, 5, 8, 12])) for _ in range(rank))
  spec = [None] * rank
  for a in names:
    d = draw(st.integers(-1, rank - 1))
    if d >= 0 and spec[d] is None:
      spec[d] = a
  mapped = draw(st.integers(0, rank - 1))
  name = draw(st.sampled_from(sorted(COLLECTIVES)))
  if name == "pmean":
    dtype = draw(st.sampled_from([np.float32, jnp.bfloat16]))
  else:
    dtype = draw(st.sampled_from([np.int32, np.int8, np.float32, jnp.bfloat16]))
  nested = rank > 1 and draw(st.booleans())
  # all of one sign now and then: a padding row holding 0 would then win a max/min
  offset = draw(st.sampled_from([-20, 0, 20]))
  return (shape, names, dims, P(*spec), mapped, name, dtype, nested, offset,
          draw(st.integers(0, 99)))


def _values(dims, dtype, offset, seed, special):
  rng = np.random.default_rng(seed)
  x = rng.integers(-8, 9, dims) + offset
  if np.issubdtype(np.dtype(dtype), np.integer):
    return jnp.asarray(x, dtype)
  x = x.astype(np.float32)
  if special:
    pick = rng.random(dims) < 0.2
    x[pick] = rng.choice([np.nan, np.inf, -np.inf, -0.0], size=int(pick.sum()))
  return jnp.asarray(x, dtype)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_cases())
def test_vmapped_collectives_equal_one_device(case):
  shape, names, dims, spec, mapped, name, dtype, nested, offset, seed = case
  body = COLLECTIVES[name]
  if nested:   # two mapped dims, one name each: the collective over both
    inner = jax.vmap(lambda r: body(r) if name != "psum" else lax.psum(r, ("v", "w")),
                     axis_name="w")
    f = jax.vmap(inner, in_axes=mapped, axis_name="v")
  else:
    f = jax.vmap(body, in_axes=mapped, axis_name="v")
  x = _values(dims, dtype, offset, seed, special=name in ("pmax", "pmin"))
  want = jax.jit(f)(x)
  got = gshard.unpad(gshard.partition(f, mesh(shape, names), in_specs=(spec,))(x))
  assert got.dtype == want.dtype and got.shape == want.shape
  g, w = np.asarray(got).astype(np.float32), np.asarray(want).astype(np.float32)
  np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
  np.testing.assert_array_equal(np.signbit(g[~np.isnan(g)]), np.signbit(w[~np.isnan(w)]))
  np.testing.assert_array_equal(g[~np.isnan(g)], w[~np.isnan(w)])


def test_a_split_mapped_dim_is_reduced_where_it_lies():
  """``x - pmean(x)`` over a vmapped dim split 8 ways: one all-reduce of the
  12 sums, not a gather of the 64 x 12 operand."""
  f = jax.vmap(lambda r: r - lax.pmean(r, "v"), axis_name="v")
  x = jnp.arange(64 * 12, dtype=jnp.float32).reshape(64, 12)
  step = gshard.partition(f, mesh((8,), ("x",)), in_specs=(P("x"),))
  np.testing.assert_array_equal(np.asarray(step(x)), np.asarray(jax.jit(f)(x)))
  kinds = [(c.kind, c.shape) for c in step.lower(x).collectives()]
  assert kinds == [("psum", (12,))], kinds
