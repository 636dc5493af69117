"""Rules for grouped matmuls, approximate top-k, reductions of the user's own
computation, and the rarer linear-algebra and special-function primitives.

Hypothesis draws a mesh, a spec for every operand (even and uneven splits,
any dim, axes reused across operands) and the sizes; the partitioned program
must give exactly what ``jax.jit`` gives on one device, values and gradients,
with no safe path (a ``PartitionWarning`` is an error here).

Exactness is by construction, not tolerance: grouped-matmul operands are small
integers held in f32, so every partial sum, in any order, is an integer
below 2**24 and exact; top-k, ``lax.reduce`` and the factorisations compute
each row or matrix whole on one device, as the unpartitioned program does
(at the 4x4 matrices used here; XLA:CPU's batched matmul, which
``symmetric_product`` is, may round a larger matrix by an ulp differently
for another batch size, as any ``dot_general`` split over its batch).
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
from gshard.spmd import registry
from helpers_numerics import f64_run
from helpers_partition import mesh

pytestmark = pytest.mark.filterwarnings("error::gshard.PartitionWarning")

MESHES = [((8,), ("x",)), ((2, 4), ("x", "y")), ((4, 2), ("x", "y")), ((2, 2), ("x", "y"))]
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _exact(got, want, what=""):
  got, want = jax.tree.leaves(gshard.unpad(got)), jax.tree.leaves(want)
  assert len(got) == len(want), what
  for k, (g, w) in enumerate(zip(got, want)):
    assert np.shape(g) == np.shape(w) and g.dtype == w.dtype, (what, k, g.shape, w.shape)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{what} leaf {k}")


@st.composite
def _specs(draw, shapes, names):
  """One spec per shape: each dim None or a mesh axis not yet used in that spec."""
  out = []
  for shape in shapes:
    free = list(names)
    dims = []
    for _ in shape:
      choice = draw(st.sampled_from([None] + free))
      if choice is not None:
        free.remove(choice)
      dims.append(choice)
    out.append(P(*dims))
  return tuple(out)


def _ints(rng, shape):
  return rng.integers(-3, 4, shape).astype(np.float32)


# -- ragged_dot_general --------------------------------------------------------

@st.composite
def _ragged_cases(draw):
  shape, names = draw(st.sampled_from(MESHES))
  m = draw(st.sampled_from([5, 8, 12, 16]))
  k = draw(st.sampled_from([4, 6]))
  n = draw(st.sampled_from([2, 4]))
  g = draw(st.integers(1, 4))
  # groups covering fewer rows than m (the rest stay zero), all of them, or
  # more (the extra rows do not exist)
  total = draw(st.integers(0, m + 2))
  cuts = sorted(draw(st.lists(st.integers(0, total), min_size=g - 1, max_size=g - 1)))
  sizes = np.diff([0] + cuts + [total]).astype(np.int32)
  specs = draw(_specs([(m, k), (g, k, n), (g,)], names))
  seed = draw(st.integers(0, 2**16))
  return mesh(shape, names), (m, k, n, g), sizes, specs, seed


@SETTINGS
@given(_ragged_cases())
def test_ragged_dot_and_its_gradients_equal_one_device(case):
  """``lax.ragged_dot`` and both its gradients (a grouped matmul with the
  transposed rhs, and the ragged-contracting one per group) split every way."""
  m, (mm, k, n, g), sizes, specs, seed = case
  rng = np.random.default_rng(seed)
  lhs, rhs, w = _ints(rng, (mm, k)), _ints(rng, (g, k, n)), _ints(rng, (mm, n))

  def loss(lhs, rhs, sizes):
    out = lax.ragged_dot(lhs, rhs, sizes)
    return jnp.sum(out * w), out

  fn = jax.grad(loss, argnums=(0, 1), has_aux=True)
  want = jax.jit(fn)(lhs, rhs, sizes)
  got = gshard.partition(fn, m, in_specs=specs)(lhs, rhs, sizes)
  _exact(got, want, f"specs {specs} sizes {sizes}")


def test_ragged_dot_split_rows_stay_split():
  """Rows split over the mesh are computed where they are: no collective for
  the forward grouped matmul, and the weight gradient's sum over rows is one
  all-reduce of the per-group result (not a gather of the rows)."""
  m = mesh((8,), ("x",))
  rng = np.random.default_rng(0)
  lhs, rhs = _ints(rng, (64, 8)), _ints(rng, (4, 8, 8))
  sizes = np.array([10, 30, 0, 24], np.int32)
  fwd = gshard.partition(lambda a, b, s: lax.ragged_dot(a, b, s), m,
                         in_specs=(P("x"), P(), P()))
  assert fwd.lower(lhs, rhs, sizes).collectives() == []
  _exact(fwd(lhs, rhs, sizes), lax.ragged_dot(lhs, rhs, sizes))
  grad = jax.grad(lambda b, a, s: jnp.sum(lax.ragged_dot(a, b, s) ** 2))
  step = gshard.partition(grad, m, in_specs=(P(), P("x"), P()))
  kinds = [c.kind for c in step.lower(rhs, lhs, sizes).collectives()]
  assert kinds == ["psum"], kinds
  _exact(step(rhs, lhs, sizes), jax.jit(grad)(rhs, lhs, sizes))


@SETTINGS
@given(st.sampled_from(MESHES), st.integers(0, 2**16), st.data())
def test_ragged_dot_with_batch_dims_equals_one_device(mesh_case, seed, data):
  """``ragged_dot_general`` with a batch dim and per-batch group sizes
  ``[b, g]``: the batch may be split like the rows."""
  shape, names = mesh_case
  m = mesh(shape, names)
  b, rows, k, n, g = 4, 12, 4, 2, 3
  rng = np.random.default_rng(seed)
  lhs, rhs = _ints(rng, (b, rows, k)), _ints(rng, (b, g, k, n))
  sizes = rng.multinomial(rows, np.ones(g) / g, size=b).astype(np.int32)
  nums = lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((2,), (2,)), ((0,), (0,))),
      lhs_ragged_dimensions=(1,), rhs_group_dimensions=(1,))

  def f(lhs, rhs, sizes):
    return lax.ragged_dot_general(lhs, rhs, sizes, nums)

  specs = data.draw(_specs([lhs.shape, rhs.shape, sizes.shape], names))
  _exact(gshard.partition(f, m, in_specs=specs)(lhs, rhs, sizes),
         jax.jit(f)(lhs, rhs, sizes), f"specs {specs}")


def test_ragged_dot_with_int8_group_sizes_wraps_as_jax_does():
  """Group sizes of int8 summing past 127: jax's ragged_dot sums them in int8
  (the running end wraps, and the group after it is empty); split rows see
  the same groups (found by review: int32 sums had given row 127 a group)."""
  m = mesh((8,), ("x",))
  rng = np.random.default_rng(4)
  lhs, rhs = _ints(rng, (128, 4)), _ints(rng, (2, 4, 2))
  sizes = np.array([127, 1], np.int8)
  f = lambda a, b, s: lax.ragged_dot(a, b, s)
  _exact(gshard.partition(f, m, in_specs=(P("x"), P(), P()))(lhs, rhs, sizes),
         jax.jit(f)(lhs, rhs, sizes))


def test_ragged_dot_with_group_offset_takes_the_safe_path_with_a_warning():
  """A case the rule does not cover is computed replicated, and says so."""
  rule = registry.entry("ragged_dot_general").sharding
  nums = lax.RaggedDotDimensionNumbers((((1,), (1,)), ((), ())), (0,), (0,))
  avals = [jax.core.ShapedArray(s, jnp.float32) for s in ((8, 4), (2, 4, 3))]
  with pytest.raises(NotImplementedError, match="group_offset"):
    rule(avals + [jax.core.ShapedArray((2,), jnp.int32)],
         [jax.core.ShapedArray((8, 3), jnp.float32)],
         ragged_dot_dimension_numbers=nums, group_offset=np.zeros(1, np.int32),
         precision=None, preferred_element_type=None, out_sharding=None)


# -- approx_top_k, lax.reduce ----------------------------------------------------

@SETTINGS
@given(st.sampled_from(MESHES), st.sampled_from([(8, 12), (6, 16, 4), (16,)]),
       st.booleans(), st.integers(1, 4), st.integers(0, 2**16), st.data())
def test_approx_top_k_equals_one_device(mesh_case, shape, is_max, k, seed, data):
  """``approx_max_k``/``approx_min_k`` along a random dim of a random split:
  values and indices exactly, and the gradient."""
  names = mesh_case[1]
  m = mesh(*mesh_case)
  dim = data.draw(st.integers(-len(shape), len(shape) - 1))
  x = np.random.default_rng(seed).permutation(np.prod(shape)).reshape(shape)
  x = x.astype(np.float32)
  op = lax.approx_max_k if is_max else lax.approx_min_k

  def f(x):
    vals, idx = op(x, k, reduction_dimension=dim)
    return vals, idx, jax.grad(lambda y: jnp.sum(op(y, k, reduction_dimension=dim)[0] ** 2))(x)

  (spec,) = data.draw(_specs([shape], names))
  _exact(gshard.partition(f, m, in_specs=(spec,))(x), jax.jit(f)(x), f"spec {spec} dim {dim}")


@SETTINGS
@given(st.sampled_from(MESHES), st.sampled_from([(8, 12), (6, 16, 4), (5, 8)]),
       st.integers(0, 2**16), st.data())
def test_variadic_reduce_equals_one_device(mesh_case, shape, seed, data):
  """``lax.reduce`` of (value, index) pairs with the user's own comparison (the
  first of equal maxima wins, NaN wins), over random dims of a random split."""
  names = mesh_case[1]
  m = mesh(*mesh_case)
  rank = len(shape)
  dims = tuple(sorted(data.draw(st.sets(st.integers(0, rank - 1), min_size=1))))
  x = _ints(np.random.default_rng(seed), shape)
  x[tuple(np.random.default_rng(seed).integers(0, n) for n in shape)] = np.nan

  def pick(a, b):
    take_b = (b[0] > a[0]) | (jnp.isnan(b[0]) & ~jnp.isnan(a[0])) | \
             ((b[0] == a[0]) & (b[1] < a[1]))
    return jnp.where(take_b, b[0], a[0]), jnp.where(take_b, b[1], a[1])

  def f(x):
    idx = lax.broadcasted_iota(jnp.int32, x.shape, dims[0])
    return lax.reduce((x, idx), (np.float32(-np.inf), np.int32(0)), pick, dims)

  (spec,) = data.draw(_specs([shape], names))
  _exact(gshard.partition(f, m, in_specs=(spec,))(x), jax.jit(f)(x), f"spec {spec} dims {dims}")


def test_variadic_reduce_keeps_the_other_dims_split():
  """Only the reduced dim is gathered: the rows stay where they are."""
  m = mesh((2, 4), ("x", "y"))
  x = _ints(np.random.default_rng(1), (8, 16))

  def f(x):
    return lax.reduce((x, x), (np.float32(0), np.float32(-np.inf)),
                      lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])), (1,))

  step = gshard.partition(f, m, in_specs=(P("x", "y"),))
  low = step.lower(x)
  assert [c.kind for c in low.collectives()] == ["all_gather"]
  assert [s.to_spec() for s in low.out_shardings] == [P("x"), P("x")]
  _exact(step(x), jax.jit(f)(x))


# -- factorisations and elementwise ops ------------------------------------------

def _matrices(rng, batch, n):
  return (rng.standard_normal((*batch, n, n)) + 3 * np.eye(n)).astype(np.float32)


LINALG = {
    "hessenberg": lambda a: lax.linalg.hessenberg(a),
    "tridiagonal": lambda a: lax.linalg.tridiagonal(a + jnp.swapaxes(a, -1, -2)),
    "symmetric_product": lambda a: lax.linalg.symmetric_product(a, a, alpha=2.0, beta=0.5),
    "schur": lambda a: jax.vmap(jax.scipy.linalg.schur)(a.reshape(-1, *a.shape[-2:])),
    "qr raw (geqrf)": lambda a: jnp.linalg.qr(a, mode="raw"),
    "slogdet by qr (geqrf)": lambda a: jnp.linalg.slogdet(a, method="qr"),
    "qr_multiply (geqrf, ormqr)": lambda a: jax.vmap(jax.scipy.linalg.qr_multiply)(a, a[..., 0]),
    "qr_multiply pivoting (geqp3, ormqr)": lambda a: jax.vmap(
        lambda m: jax.scipy.linalg.qr_multiply(m, m[0], pivoting=True))(a),
    "hessenberg with q (householder_product)": lambda a: jax.vmap(
        lambda m: jax.scipy.linalg.hessenberg(m, calc_q=True))(a),
}


@SETTINGS
@given(st.sampled_from(MESHES), st.sampled_from(sorted(LINALG)), st.integers(0, 2**16),
       st.data())
def test_batched_factorisations_equal_one_device(mesh_case, name, seed, data):
  """Each matrix factorised whole where its batch block lies."""
  names = mesh_case[1]
  m = mesh(*mesh_case)
  a = _matrices(np.random.default_rng(seed), (8,), 4)
  (spec,) = data.draw(_specs([a.shape], names))
  f = LINALG[name]
  _exact(gshard.partition(f, m, in_specs=(spec,))(a), jax.jit(f)(a), f"{name} {spec}")


def test_cholesky_update_equals_one_device():
  m = mesh((8,), ("x",))
  rng = np.random.default_rng(2)
  a = _matrices(rng, (), 8)
  r = np.linalg.cholesky(a @ a.T).T.astype(np.float32)
  w = rng.standard_normal(8).astype(np.float32)
  f = lax.linalg.cholesky_update
  _exact(gshard.partition(f, m, in_specs=(P("x"), P("x")))(r, w), jax.jit(f)(r, w))


def _igamma_grad(a, x):
  return jax.grad(lambda a: jnp.sum(jax.scipy.special.gammainc(a, x)))(a)


_IGAMMA_GRAD, _IGAMMA_GRAD_F64 = jax.jit(_igamma_grad), jax.jit(_igamma_grad)


@settings(SETTINGS, max_examples=10)
@given(st.sampled_from(MESHES), st.integers(0, 2**16), st.data())
def test_igamma_gradient_equals_one_device(mesh_case, seed, data):
  """``igamma_grad_a`` (the gradient of ``gammainc`` in its shape),
  elementwise on any split.

  Not bit for bit: XLA:CPU evaluates the function's series in vector lanes and
  a scalar tail, and a device's smaller block moves elements between the two
  (an ulp or two apart; hypothesis found one). The bound is fuzzcheck's: the
  partitioned value is another evaluation of the same series, so against the
  float64 oracle ``o`` it errs about as much as the one-device value ``s``:
  ``|p - o| <= 2 |s - o| + 8 u |o|``."""
  names = mesh_case[1]
  m = mesh(*mesh_case)
  rng = np.random.default_rng(seed)
  a = rng.uniform(0.5, 4.0, (8, 6)).astype(np.float32)
  x = rng.uniform(0.1, 5.0, (8, 6)).astype(np.float32)
  specs = data.draw(_specs([a.shape, x.shape], names))
  got = np.asarray(gshard.partition(_igamma_grad, m, in_specs=specs)(a, x))
  one = np.asarray(_IGAMMA_GRAD(a, x))
  oracle = f64_run(_IGAMMA_GRAD_F64, a, x)
  bound = 2 * np.abs(one - oracle) + 8 * 2.0**-24 * np.abs(oracle)
  assert got.dtype == one.dtype and (np.abs(got - oracle) <= bound).all(), specs


# -- top_k along a split dim ------------------------------------------------------

_SPECIAL = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, 1.0, -2.0], np.float32)


@SETTINGS
@given(st.sampled_from(MESHES), st.sampled_from([(4, 24), (3, 10, 16), (64,), (5, 13), (2, 50),
                                                 (3, 37)]),
       st.sampled_from([np.float32, np.int32, jnp.bfloat16]), st.integers(1, 5),
       st.integers(0, 2**16), st.data())
def test_top_k_along_a_split_dim_equals_one_device(mesh_case, shape, dtype, k, seed, data):
  """``lax.top_k`` along a random ``axis`` of a random split (even and uneven):
  values and indices bit for bit, ties (many equal values), NaNs of both
  signs, infinities and signed zeros included; and the gradient."""
  names = mesh_case[1]
  m = mesh(*mesh_case)
  axis = data.draw(st.integers(-len(shape), len(shape) - 1))
  k = min(k, shape[axis])
  rng = np.random.default_rng(seed)
  # all negative sometimes: an uneven split's padding must not outrank them
  x = rng.integers(-3, 4 if data.draw(st.booleans()) else 0, shape).astype(np.float32)
  if dtype != np.int32:
    mask = rng.random(shape) < 0.2
    x[mask] = rng.choice(_SPECIAL, mask.sum())
  x = np.asarray(jnp.asarray(x).astype(dtype))

  def f(x):
    vals, idx = lax.top_k(x, k, axis=axis)
    if dtype == np.int32:
      return vals, idx
    grad = jax.grad(lambda y: jnp.sum(jnp.nan_to_num(lax.top_k(y, k, axis=axis)[0]) * 3))(x)
    return vals, idx, grad

  (spec,) = data.draw(_specs([shape], names))
  got, want = gshard.unpad(gshard.partition(f, m, in_specs=(spec,))(x)), jax.jit(f)(x)
  for k, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
    assert g.dtype == w.dtype and g.shape == w.shape, (k, spec)
    bits = np.dtype(f"uint{8 * g.dtype.itemsize}")        # NaN signs, -0.0 included
    np.testing.assert_array_equal(np.asarray(g).view(bits), np.asarray(w).view(bits),
                                  err_msg=f"spec {spec} axis {axis} leaf {k}")


def test_top_k_over_a_split_vocabulary_gathers_candidates_only():
  """Top-k sampling over vocab-parallel logits ``[B, V@model]``: each device
  sends its k candidates (values and indices), not its share of the
  vocabulary: 2 x 384 B per device here, where gathering the logits sends
  24 KiB."""
  m = mesh((2, 4), ("x", "y"))
  x = np.random.default_rng(0).standard_normal((16, 1024)).astype(np.float32)
  f = lambda x: lax.top_k(x, 4)
  step = gshard.partition(f, m, in_specs=(P("x", "y"),))
  low = step.lower(x)
  rows, cands = 16 // 2, 4 * 4
  assert [(c.kind, c.bytes) for c in low.collectives()] == \
      [("all_gather", rows * cands * 4 * 3 // 4)] * 2, low.explain()
  _exact(step(x), jax.jit(f)(x))
