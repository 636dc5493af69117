"""``cumsum``/``cumprod``/``cummax``/``cummin`` along a split dim.

Each device scans its own block and combines in the total of the blocks
before it (after it, ``reverse``); the dim is not gathered. Hypothesis draws
the mesh, which dim is split over which axes (even and uneven, padding
included), the direction, dtypes and values, and compares with ``jax.jit``
on one device:

* integers, and max/min of any dtype (NaN, +-inf, -0.0 and 0.0 included)
  must come out bit for bit: wrapping integer sums and products and max/min
  are associative, so the block boundaries change nothing (a NaN is a NaN
  where jax.jit's is, of either sign: which NaN operand a max passes on is
  XLA's choice);
* a float sum of small integers is exact in any order, so it too must be
  bit for bit (signed zeros included);
* a float sum or product of arbitrary values is reassociated at the block
  boundaries, as any sum over a split dim is: the local scan of the block,
  the sum of the earlier blocks' totals and the final combine are one valid
  evaluation order of each prefix, so against the float64 result ``o`` its
  error is at most ``(k - 1) u sum_{j<=i} |x_j|`` for a prefix of ``k``
  terms (a product: ``(k - 1) u |o|`` to first order), ``u = 2**-24``. The
  one-device result obeys the same bound; both are checked.
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
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
OPS = {"cumsum": lax.cumsum, "cumprod": lax.cumprod, "cummax": lax.cummax,
       "cummin": lax.cummin}
SPECIAL = [np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, 1.0, -1.0, 2.0]


@st.composite
def _cases(draw):
  shape, names = draw(st.sampled_from(MESHES))
  rank = draw(st.integers(1, 3))
  dims = [draw(st.sampled_from([1, 2, 3, 5, 8, 12])) for _ in range(rank)]
  axis = draw(st.integers(0, rank - 1))
  dims[axis] = draw(st.sampled_from([2, 3, 5, 7, 8, 9, 16, 21]))
  # the scanned dim split over one axis or two (uneven ones pad); another dim
  # maybe split too
  cut = draw(st.sampled_from([names[:1], names[-1:], names]))
  spec = [None] * rank
  spec[axis] = cut if len(cut) > 1 else cut[0]
  rest = [a for a in names if a not in cut]
  if rest and rank > 1 and draw(st.booleans()):
    spec[draw(st.sampled_from([d for d in range(rank) if d != axis]))] = rest[0]
  return shape, names, tuple(dims), axis, P(*spec), draw(st.booleans())


def _run(shape, names, spec, f, x):
  m = mesh(shape, names)
  got = gshard.partition(f, m, in_specs=(spec,))(x)
  return np.asarray(gshard.unpad(got)), np.asarray(jax.jit(f)(x))


def _same_bits(got, want, what):
  """Equal bits; NaN where the reference has NaN, of either sign (which NaN
  operand a max passes on is XLA's choice, not a value)."""
  assert got.shape == want.shape and got.dtype == want.dtype, what
  got, want = np.atleast_1d(got), np.atleast_1d(want)
  if np.issubdtype(got.dtype, np.floating) or got.dtype == jnp.bfloat16:
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan, err_msg=what)
    got, want = np.where(nan, 0, got), np.where(nan, 0, want)
    got, want = got.view(np.uint8), want.view(np.uint8)
  np.testing.assert_array_equal(got, want, err_msg=what)


@SETTINGS
@given(case=_cases(), op=st.sampled_from(sorted(OPS)),
       dtype=st.sampled_from([np.int32, np.int8, np.uint8, np.float32, jnp.bfloat16]),
       seed=st.integers(0, 2**16))
def test_integer_and_small_integer_scans_are_bit_for_bit(case, op, dtype, seed):
  """Wrapping int8/uint8 sums and products included; floats hold small
  integers (sums stay exact), +-0.0 among them."""
  shape, names, dims, axis, spec, reverse = case
  rng = np.random.default_rng(seed)
  x = rng.integers(-3, 4, dims)
  if dtype == np.uint8:
    x = np.abs(x)
  x = np.asarray(x).astype(dtype)
  if np.issubdtype(np.dtype(dtype), np.floating) or dtype == jnp.bfloat16:
    if op == "cumprod":   # products of small integers: exact while below 2**8 (bf16)
      x = np.where(np.abs(x.astype(np.float32)) > 1, np.sign(x.astype(np.float32)), x)
      x = x.astype(dtype)
    x = np.where(x == 0, np.where(rng.random(dims) < 0.5, -0.0, 0.0), x).astype(dtype)

  def f(v):
    return OPS[op](v, axis=axis, reverse=reverse)

  got, want = _run(shape, names, spec, f, jnp.asarray(x))
  _same_bits(got, want, f"{op} axis={axis} reverse={reverse} {spec} {dims} {dtype}")


@SETTINGS
@given(case=_cases(), op=st.sampled_from(["cummax", "cummin"]),
       dtype=st.sampled_from([np.float32, jnp.bfloat16, np.float16]),
       seed=st.integers(0, 2**16))
def test_max_and_min_with_nans_infs_and_signed_zeros_are_bit_for_bit(case, op, dtype, seed):
  shape, names, dims, axis, spec, reverse = case
  rng = np.random.default_rng(seed)
  x = jnp.asarray(np.asarray(rng.choice(SPECIAL, dims), np.float32), dtype)

  def f(v):
    return OPS[op](v, axis=axis, reverse=reverse)

  got, want = _run(shape, names, spec, f, x)
  _same_bits(got, want, f"{op} axis={axis} reverse={reverse} {spec} {dims} {dtype}")


@SETTINGS
@given(case=_cases(), op=st.sampled_from(["cumsum", "cumprod"]), seed=st.integers(0, 2**16))
def test_float_sums_and_products_are_within_the_reassociation_bound(case, op, seed):
  shape, names, dims, axis, spec, reverse = case
  rng = np.random.default_rng(seed)
  if op == "cumsum":
    x = rng.normal(size=dims) * 10.0 ** rng.integers(-3, 4, dims)
  else:   # products stay far from overflow and underflow
    x = rng.uniform(0.5, 2.0, dims) * rng.choice([-1.0, 1.0], dims)
  x = x.astype(np.float32)

  def f(v):
    return OPS[op](v, axis=axis, reverse=reverse)

  got, want = _run(shape, names, spec, f, jnp.asarray(x))
  o = _f64(op, x, axis, reverse)
  k = _prefix_lengths(dims, axis, reverse)
  u = 2.0 ** -24
  if op == "cumsum":
    scale = _f64("cumsum", np.abs(x).astype(np.float64), axis, reverse)
  else:
    scale = np.abs(o)
  bound = (k - 1) * u * scale * 1.0001   # first-order; the factor covers the 2nd order
  for name, r in (("gshard", got), ("jax.jit", want)):
    err = np.abs(r.astype(np.float64) - o)
    assert np.all(err <= bound), (name, op, spec, dims, float(np.max(err - bound)))


def _f64(op, x, axis, reverse):
  """The scan in float64 with numpy (exactly rounded per step, in order)."""
  x = np.asarray(x, np.float64)
  if reverse:
    x = np.flip(x, axis)
  fn = {"cumsum": np.cumsum, "cumprod": np.cumprod}[op]
  out = fn(x, axis=axis)
  return np.flip(out, axis) if reverse else out


def _prefix_lengths(dims, axis, reverse):
  k = np.arange(1, dims[axis] + 1, dtype=np.float64)
  if reverse:
    k = k[::-1]
  shape = [1] * len(dims)
  shape[axis] = dims[axis]
  return np.broadcast_to(k.reshape(shape), dims)


def test_a_split_scan_sends_block_totals_not_the_dim():
  """cumsum over [64, 1024@model]: one all-gather of the 4 blocks' last
  rows (64 f32 per device from each of 3 peers), nothing else; the result
  stays split."""
  m = mesh((2, 4), ("data", "model"))
  x = jnp.ones((64, 1024), jnp.float32)
  low = gshard.partition(lambda v: jnp.cumsum(v, axis=1), m,
                         in_specs=(P(None, "model"),)).lower(x)
  (c,) = low.collectives()
  assert c.kind == "all_gather" and c.axes == ("model",), c
  assert c.bytes == 3 * 64 * 4, c
  assert "block totals" in c.role
  assert low.out_shardings[0].to_spec() == P(None, "model")


def test_grad_of_a_split_cumsum_is_the_reverse_scan():
  """The transpose of cumsum is a reverse cumsum; both stay split."""
  m = mesh((2, 4), ("data", "model"))
  x = jnp.asarray(np.random.default_rng(0).integers(-3, 4, (4, 24)), jnp.float32)

  def loss(v):
    return jnp.sum(jnp.cumsum(v, axis=1) * jnp.arange(24.0))

  got = gshard.partition(jax.grad(loss), m, in_specs=(P(None, "model"),))(x)
  _same_bits(np.asarray(got), np.asarray(jax.jit(jax.grad(loss))(x)), "grad")
  text = gshard.partition(jax.grad(loss), m, in_specs=(P(None, "model"),)).lower(
      x).as_text("jaxpr")
  assert "cumsum[axis=1 reverse=True]" in text


def test_position_ids_from_a_sequence_split_mask():
  """Sequence parallelism: position ids ``cumsum(mask) - 1`` of a padded
  batch whose sequence dim is split over 8 devices, exact."""
  m = mesh((8,), ("seq",))
  lengths = np.array([0, 5, 17, 40])
  mask = jnp.asarray(np.arange(40)[None, :] < lengths[:, None])

  def positions(msk):
    msk = gshard.split(msk, 1, "seq")
    return jnp.where(msk, jnp.cumsum(msk, axis=1) - 1, -1)

  got = gshard.partition(positions, m, in_specs=(P(None, "seq"),))(mask)
  _same_bits(np.asarray(gshard.unpad(got)), np.asarray(jax.jit(positions)(mask)), "ids")


@pytest.mark.parametrize("op", ["cumsum", "cumprod"])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("n", [3, 7, 10])
def test_negative_zeros_keep_their_sign_next_to_padding(op, reverse, n):
  """A block with no real block after it (reverse) or before it combines
  nothing in: adding the padding's +0.0 would turn a sum of -0.0 into 0.0."""
  x = jnp.full((2, n), -0.0 if op == "cumsum" else -1.0, jnp.float32)
  x = x.at[:, 0].set(-0.0)

  def f(v):
    return OPS[op](v, axis=1, reverse=reverse)

  got, want = _run((2, 4), ("x", "y"), P(None, "y"), f, x)
  _same_bits(got, want, f"{op} reverse={reverse} n={n}")


# -- found by review beside the scans: reductions whose combine must not change a bit ------

@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=_cases(), to=st.sampled_from([jnp.bfloat16, np.float16]),
       seed=st.integers(0, 2**16))
def test_a_sum_rounded_to_a_narrower_float_is_rounded_once(case, to, seed):
  """``jnp.sum(x, d).astype(bf16)`` with ``d`` split: the f32 sum is resolved
  before the narrowing conversion (each device rounding its partial sum and
  summing in bf16 rounds twice: partials 1001 and -1000 give 0, not 1)."""
  shape, names, dims, axis, spec, _ = case
  rng = np.random.default_rng(seed)
  x = (rng.integers(-3, 4, dims) * 1000 + rng.integers(-1, 2, dims)).astype(np.float32)

  def f(v):
    return jnp.sum(v, axis=axis).astype(to)

  got, want = _run(shape, names, spec, f, jnp.asarray(x))
  _same_bits(got, want, f"sum axis={axis} {spec} {dims} -> {to}")


@pytest.mark.parametrize("n", [4, 6, 7])
@pytest.mark.parametrize("op", ["or", "and"])
def test_bitwise_or_and_of_integers_over_a_split_dim(op, n):
  """An integer or/and is bitwise: no max/min combines it (the dim is gathered)."""
  x = jnp.asarray(np.random.default_rng(n).integers(0, 256, (3, n)), jnp.int32)

  def f(v):
    return (jnp.bitwise_or if op == "or" else jnp.bitwise_and).reduce(v, axis=1)

  got, want = _run((2, 4), ("x", "y"), P(None, "y"), f, x)
  _same_bits(got, want, f"{op} n={n}")


@pytest.mark.parametrize("fn", [jnp.argmax, jnp.argmin])
def test_arg_max_of_signed_zeros_over_a_split_dim_is_the_first(fn):
  x = jnp.asarray([[-1.0, -0.0, -2.0, 0.0], [1.0, 0.0, 2.0, -0.0]], jnp.float32)
  got, want = _run((2, 4), ("x", "y"), P(None, "x"), lambda v: fn(v, axis=1), x)
  _same_bits(got, want, fn.__name__)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("op", [lax.cumsum, lax.cumprod, lax.cummax, lax.cummin])
@pytest.mark.parametrize("shape,axis,spec,mesh_shape", [
    ((0, 4), 0, P("x"), (8,)), ((6, 0), 1, P(None, "x"), (8,)),
    ((0, 6), 0, P(("x", "y")), (2, 4))])
def test_a_scan_along_an_empty_split_dim(op, reverse, shape, axis, spec, mesh_shape):
  """Each block's total was read as its last row, of none: an IndexError."""
  names = ("x", "y")[:len(mesh_shape)]
  fn = lambda a: op(a, axis=axis, reverse=reverse)
  x = np.zeros(shape, np.float32)
  got = gshard.partition(fn, gshard.make_mesh(mesh_shape, names), in_specs=(spec,))(x)
  assert got.shape == shape and got.dtype == np.float32
