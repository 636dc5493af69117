"""max / min / argmax / argmin / cummax / cummin / top_k over a split dim, in every float
type jax has: equal to one device, NaN positions included.

Across devices gshard combines these as order-preserving integer keys (a
backend's all-reduce max may drop NaN), and pads an uneven split with the
reduction's identity. Both depend on the type's layout: float8 ``e4m3fn`` and
the ``fnuz`` types hold no infinity (an inf padding becomes NaN), the ``fnuz``
types' one NaN sits at -0.0's code, ``e8m0fnu`` has no sign bit; complex values
order by real part, then imaginary. Values come from a small grid, so ties
and NaN are common.
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

pytestmark = pytest.mark.filterwarnings("error::gshard.PartitionWarning")

FLOATS = ["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
          "float8_e5m2fnuz", "float8_e4m3b11fnuz", "float8_e8m0fnu", "float8_e3m4",
          "float8_e4m3"]
OPS = {
    "max": lambda x: jnp.max(x, axis=1),
    "min": lambda x: jnp.min(x, axis=1),
    "argmax": lambda x: jnp.argmax(x, axis=1),
    "argmin": lambda x: jnp.argmin(x, axis=1),
    "cummax": lambda x: lax.cummax(x, axis=1),
    "cummin": lambda x: lax.cummin(x, axis=1),
    "reverse cummax": lambda x: lax.cummax(x, axis=1, reverse=True),
    "top_k": lambda x: lax.top_k(x, 3),
}
COMPLEX_OPS = ("max", "min")
MESHES = [((8,), ("a",), "a"), ((2, 4), ("a", "b"), "b"), ((2, 4), ("a", "b"), ("a", "b")),
          ((4, 2), ("a", "b"), "a")]


def _dtype(name):
  return np.dtype(getattr(jnp, name))


@st.composite
def _cases(draw):
  shape, names, axes = draw(st.sampled_from(MESHES))
  name = draw(st.sampled_from(FLOATS + ["complex64"]))
  # e8m0fnu: jax's one-device argmax/argmin/cummax start from +-inf, NaN in
  # that type, so every result is NaN or index 0; only max/min are compared
  op = draw(st.sampled_from(COMPLEX_OPS if name in ("complex64", "float8_e8m0fnu")
                            else sorted(OPS)))
  length = draw(st.sampled_from([8, 16, 6, 10, 13]))
  grid = draw(st.lists(st.integers(-6, 6), min_size=2 * length, max_size=2 * length))
  vals = np.asarray(grid, np.float64).reshape(2, length)
  if name == "float8_e8m0fnu":          # no sign, no zero: powers of two
    vals = np.exp2(vals)
  elif name == "complex64":
    imag = draw(st.lists(st.integers(-2, 2), min_size=2 * length, max_size=2 * length))
    vals = vals + 1j * np.asarray(imag, np.float64).reshape(2, length)
  else:
    vals = vals / 2
  # XLA's complex max/min with a NaN depends on its reduction order (one
  # device: max(0, 0, 0, 1j, nan, 0, 0, 0) is 0j, max(1j, nan) is nan): no
  # value to equal, so complex draws no NaN
  nans = draw(st.lists(st.tuples(st.integers(0, 1), st.integers(0, length - 1),
                                 st.booleans()),
                       max_size=0 if name == "complex64" else 2))
  for r, c, negative in nans:       # -NaN (0/0 on x86) and +NaN: argmax takes the first
    # (XLA:CPU's pad and select of float8_e5m2 make its -NaN +NaN, one device's
    # too, and top_k orders the two apart: e5m2 draws +NaN)
    vals[r, c] = -np.nan if negative and name != "float8_e5m2" else np.nan
  return shape, names, axes, name, op, vals


def _compare(got, want):
  if isinstance(want, (tuple, list)):
    assert len(got) == len(want)
    for g, w in zip(got, want):
      _compare(g, w)
    return
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape and got.dtype == want.dtype, (got.dtype, want.dtype)
  if got.dtype.kind in "iub":
    np.testing.assert_array_equal(got, want)
    return
  wide = np.complex128 if got.dtype.kind == "c" else np.float64
  g, w = got.astype(wide), want.astype(wide)
  np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
  keep = ~np.isnan(g)
  np.testing.assert_array_equal(g[keep], w[keep])


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(_cases())
def test_order_reductions_over_a_split_dim_equal_one_device(case):
  shape, names, axes, name, op, vals = case
  x = np.asarray(jnp.asarray(vals, _dtype(name)))
  fn = OPS[op]
  want = jax.jit(fn)(x)
  m = gshard.make_mesh(shape, names)
  got = gshard.unpad(gshard.partition(fn, m, in_specs=(P(None, axes),))(x))
  _compare(got, want)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz"])
def test_an_fp8_amax_over_an_uneven_split(name):
  """A float8 scaling factor's amax, the weight split 10 over 4: inf padding
  cast to these types was NaN, and the max came out NaN."""
  w = np.asarray(jnp.asarray(np.linspace(-6, 6, 60).reshape(6, 10), getattr(jnp, name)))
  fn = lambda w: jnp.max(jnp.abs(w))
  m = gshard.make_mesh((2, 4), ("data", "model"))
  got = gshard.partition(fn, m, in_specs=(P(None, "model"),))(w)
  _compare(got, jax.jit(fn)(w))
  assert float(got) == 6.0


@pytest.mark.parametrize("name", ["float8_e5m2", "float8_e8m0fnu", "float8_e4m3fn", "bfloat16"])
@pytest.mark.parametrize("size,k", [(61, 1), (125, 2)])
def test_top_k_over_an_uneven_split_never_picks_the_padding(name, size, k):
  """Rows long enough that each device sends its own top k (not the whole
  dim): the padding of the last device was -NaN's bits, which is +NaN in
  e5m2 (XLA) and e8m0fnu (its one NaN), so it won the top place with an index
  past the end."""
  vals = np.exp2(np.arange(size) % 7 - 3.0)     # positive: every type holds them
  x = np.asarray(jnp.asarray(vals.reshape(1, size), getattr(jnp, name)))
  fn = lambda x: lax.top_k(x, k)
  got = gshard.partition(fn, gshard.make_mesh((8,), ("a",)), in_specs=(P(None, "a"),))(x)
  _compare(got, jax.jit(fn)(x))
  assert int(np.max(np.asarray(got[1]))) < size


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(MESHES), st.sampled_from(["float32", "bfloat16", "float16", "float64"]),
       st.sampled_from([8, 10, 16]),
       st.lists(st.tuples(st.integers(0, 3), st.integers(0, 15)), max_size=4))
def test_min_keeps_the_sign_of_a_nan(mesh, name, length, nans):
  """One device's min returns its operand's NaN (``0/0`` is -NaN on x86,
  ``jnp.nan`` +NaN): bit for bit equal, rows 0 and 2 drawing -NaN, rows 1 and
  3 +NaN. (XLA:CPU's max of a -NaN is +NaN or -NaN by the NaN's position, so
  max is compared by NaN position, above.)"""
  shape, names, axes = mesh
  vals = np.arange(4 * length, dtype=np.float64).reshape(4, length) - length
  for r, c in nans:
    vals[r, c % length] = -np.nan if r % 2 == 0 else np.nan
  x = np.asarray(vals, _dtype(name))
  fn = OPS["min"]
  with jax.enable_x64(name == "float64"):
    want = np.asarray(jax.jit(fn)(x))
    got = np.asarray(gshard.partition(fn, gshard.make_mesh(shape, names),
                                      in_specs=(P(None, axes),))(x))
  assert got.dtype == want.dtype == x.dtype
  bits = np.dtype(f"u{want.dtype.itemsize}")
  np.testing.assert_array_equal(got.view(bits), want.view(bits))


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(MESHES), st.sampled_from(["bfloat16", "float16", "float8_e4m3fn",
                                                 "float8_e5m2", "float32"]),
       st.integers(8, 1200))
def test_iota_of_a_low_precision_float_along_a_split_dim(mesh, name, length):
  """jnp.arange in bf16 (positions of a sequence split over devices): the
  local iota and the device's offset were each rounded to the dtype, then
  their sum again; jax rounds the exact position once."""
  shape, names, axes = mesh
  dtype = _dtype(name)
  f = lambda x: x * jnp.arange(length, dtype=dtype)
  x = jnp.ones(length, dtype)
  m = gshard.make_mesh(shape, names)
  got = gshard.partition(f, m, in_specs=(P(axes),))(x)
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(jax.jit(f)(x), np.float32))
