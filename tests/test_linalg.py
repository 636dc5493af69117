"""Batched linear algebra and FFTs, debug prints and host callbacks, ``device_put``
in the function, and the small primitives jax's library code emits
(``platform_index``, the total-order comparisons of ``searchsorted``).

A batched factorisation, solve or transform works matrix by matrix, so a
device's block of the batch gives bit for bit what the whole batch gives:
every value below is compared exactly with ``jax.jit`` on one device (NaN
positions included), and a batch split in and out sends nothing. A debug
print or host callback runs once with the whole value, as the unpartitioned
program runs it.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gshard
from tests.helpers_partition import mesh

M24 = ((2, 4), ("data", "model"))


def _spd(a: np.ndarray) -> np.ndarray:
  """A batch of symmetric positive definite matrices, made on the host (a
  contraction in the program over a split dim would reorder its sums)."""
  a64 = a.astype(np.float64)
  return (np.einsum("...ij,...kj->...ik", a64, a64)
          + a.shape[-1] * np.eye(a.shape[-1])).astype(np.float32)


def _tridiag(a):
  return lax.linalg.tridiagonal_solve(jnp.tanh(a[..., 0]) * 0.5, a[..., 1] + 4.0,
                                      jnp.tanh(a[..., 2]) * 0.5, a)


# name -> (function of a batch of square matrices [..., n, n], the primitive
# it binds, differentiable, whether it takes symmetric positive definite input)
OPS = {
    "cholesky": (lambda a: lax.linalg.cholesky(a), "cholesky", True, True),
    "eigh": (lambda a: jnp.linalg.eigh(a), "eigh", True, True),
    "eig": (lambda a: lax.linalg.eig(a, compute_left_eigenvectors=False), "eig", False,
            False),
    "qr": (lambda a: jnp.linalg.qr(a), "qr", True, False),
    "svd": (lambda a: jnp.linalg.svd(a, compute_uv=False), "svd", True, False),
    "lu": (lambda a: lax.linalg.lu(a), "lu", False, False),
    "triangular_solve": (lambda a: lax.linalg.triangular_solve(
        jnp.tril(a) + 4 * jnp.eye(a.shape[-1]), a * 2, left_side=True, lower=True),
        "triangular_solve", True, False),
    "pivots": (lambda a: lax.linalg.lu_pivots_to_permutation(lax.linalg.lu(a)[1],
                                                            a.shape[-1]),
               "lu_pivots_to_permutation", False, False),
    "tridiagonal_solve": (_tridiag, "tridiagonal_solve", False, False),
    # custom_linear_solve: its solve jaxpr (lu_solve: triangular solves) inline
    "solve": (lambda a: jnp.linalg.solve(a + 4 * jnp.eye(a.shape[-1]), a[..., :1] * 2),
              "custom_linear_solve", True, False),
    "inv": (lambda a: jnp.linalg.inv(a + 4 * jnp.eye(a.shape[-1])), "custom_linear_solve",
            True, False),
    "fft": (lambda a: jnp.fft.fft(a), "fft", True, False),
    "rfft2": (lambda a: jnp.fft.rfft2(a), "fft", True, False),
    "irfft": (lambda a: jnp.fft.irfft(a), "fft", True, False),
}


_LINALG = {op[1] for op in OPS.values()} | {"lu", "triangular_solve"}


def _prims(fn, *args) -> set[str]:
  names = set()

  def walk(jaxpr):
    for e in jaxpr.eqns:
      names.add(e.primitive.name)
      for sub in jax.core.subjaxprs(e.params) if hasattr(jax.core, "subjaxprs") else ():
        walk(sub)
      for v in e.params.values():
        if hasattr(v, "jaxpr") and hasattr(v, "consts"):
          walk(v.jaxpr)
        elif hasattr(v, "eqns"):
          walk(v)
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return names


def _equal(got, want, what=""):
  """Equal bit for bit (NaN positions too), dtypes included. An output shaped
  like an input comes back as padded state when split unevenly: compared as
  the array it stands for."""
  gl, wl = jax.tree.leaves(gshard.unpad(got)), jax.tree.leaves(want)
  assert len(gl) == len(wl), what
  for g, w in zip(gl, wl):
    assert np.asarray(g).dtype == np.asarray(w).dtype, what
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=what)


@pytest.mark.parametrize("name", sorted(OPS))
def test_each_op_binds_its_primitive(name):
  """The catalogue exercises what it names (a jax change would silently test
  something else)."""
  fn, prim, _, _ = OPS[name]
  assert prim in _prims(fn, jnp.ones((2, 3, 3), jnp.float32))


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_batched_op_equals_one_device_bit_for_bit(data):
  """Random ops, batch shapes (one or two batch dims, even and uneven over the
  mesh), matrix sizes, and layouts of the input (batch dims split over one
  or two axes, or a matrix dim split: gathered first): values equal jax.jit's
  exactly; nothing takes the safe path, and with the batch split evenly no
  collective serves the op itself (split unevenly, the outputs leave
  replicated, and gathering a small input can cost less than gathering
  the outputs). Differentiable ops are checked through
  ``value_and_grad`` too."""
  name = data.draw(st.sampled_from(sorted(OPS)), label="op")
  fn, _, grads, spd = OPS[name]
  shape, names = data.draw(st.sampled_from([((8,), ("x",)), M24, ((4, 2), ("x", "y"))]),
                           label="mesh")
  m = mesh(shape, names)
  batch = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=2), label="batch")
  # (an inverse real FFT of a length-1 dim has length 0: jax's own gradient
  # of it divides by zero)
  n = data.draw(st.integers(2 if name == "irfft" else 1, 4), label="n")
  rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
  a = rng.standard_normal((*batch, n, n)).astype(np.float32)
  if spd:
    a = _spd(a)
  rank = a.ndim
  pool = list(names) + ([tuple(names)] if len(names) > 1 else [])
  entries = [None] * rank
  where = data.draw(st.sampled_from(["batch", "batch", "matrix", "none"]), label="where")
  if where == "batch":
    entries[0] = data.draw(st.sampled_from(pool), label="axes 0")
    if len(batch) == 2 and len(names) > 1 and not isinstance(entries[0], tuple):
      entries[1] = data.draw(st.sampled_from([None] + [x for x in names
                                                       if x != entries[0]]), label="axes 1")
  elif where == "matrix":
    entries[rank - 1] = data.draw(st.sampled_from(pool), label="matrix axes")
  spec = P(*entries)
  with warnings.catch_warnings():
    warnings.simplefilter("error", gshard.PartitionWarning)
    part = gshard.partition(fn, m, in_specs=(spec,))
    _equal(part(a), jax.jit(fn)(a), f"{name} {spec}")
    sizes = dict(zip(names, shape))
    even = all(e is None or batch[d] % np.prod([sizes[x] for x in np.atleast_1d(e)]) == 0
               for d, e in enumerate(entries[:len(batch)]))
    if where == "batch" and even:     # the op itself runs on local blocks
      low = part.lower(a)
      moved = [c for c in low.collectives() if c.primitive in _LINALG]
      assert not moved, low.explain()
    if grads and where != "matrix":
      # (a split matrix dim would split the backward's contractions: their
      # sums reordered, equal only to rounding)
      def loss(x):
        return sum(jnp.sum(jnp.abs(y)) for y in jax.tree.leaves(fn(x)))
      gpart = gshard.partition(jax.value_and_grad(loss), m, in_specs=(spec,))
      got, want = gpart(a), jax.jit(jax.value_and_grad(loss))(a)
      _equal(got[1], want[1], f"grad {name} {spec}")
      got = gshard.unpad(got)
      # the loss sums over the batch: split, its order differs (one f32 sum of
      # |y| over at most 6*6*4*4 terms, each a few units: 1e-5 relative)
      np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5)


def test_a_batch_split_over_devices_factors_in_place():
  """Shampoo-style: per-block preconditioners [blocks, n, n] split over the
  mesh are factored where they lie; the program sends nothing."""
  m = mesh(*M24)
  blocks = np.random.default_rng(0).standard_normal((16, 8, 8)).astype(np.float32)

  blocks = _spd(blocks)

  def inverse_roots(g):
    w, v = jnp.linalg.eigh(g)
    return jnp.einsum("bij,bj,bkj->bik", v, w ** -0.25, v)
  part = gshard.partition(inverse_roots, m, in_specs=(P(("data", "model")),))
  low = part.lower(blocks)
  assert low.collectives() == [] and low.fallbacks == []
  np.testing.assert_allclose(np.asarray(part(blocks)), np.asarray(jax.jit(inverse_roots)(blocks)),
                             rtol=1e-6, atol=1e-6)


# -- debug prints and callbacks ------------------------------------------------------

def test_debug_print_runs_once_with_the_whole_value(capfd):
  m = mesh(*M24)
  x = np.arange(16.0, dtype=np.float32).reshape(8, 2)

  def step(x):
    jax.debug.print("sum={s} first={f}", s=x.sum(), f=x[:, 0])
    return x * 2
  with warnings.catch_warnings():
    warnings.simplefilter("error", gshard.PartitionWarning)
    out = gshard.partition(step, m, in_specs=(P("data"),))(x)
  jax.effects_barrier()
  printed = capfd.readouterr().out.strip().splitlines()
  assert printed == ["sum=120.0 first=[ 0.  2.  4.  6.  8. 10. 12. 14.]"], printed
  np.testing.assert_array_equal(np.asarray(out), x * 2)


def test_debug_callback_sees_the_whole_value_once_per_iteration():
  m = mesh(*M24)
  seen = []
  x = np.arange(24.0, dtype=np.float32).reshape(3, 8)

  def step(xs):
    def body(c, row):
      jax.debug.callback(lambda v: seen.append(np.asarray(v)), row)
      return c + row, None
    return lax.scan(body, jnp.zeros(8), xs)[0]
  out = gshard.partition(step, m, in_specs=(P(None, "model"),))(x)
  jax.effects_barrier()
  assert len(seen) == 3
  for got, want in zip(seen, x):
    np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.asarray(out), x.sum(0))


def test_a_stateful_io_callback_runs_once_per_step_and_every_device_agrees():
  """A host-side counter read by ``io_callback`` (as a data loader would be):
  called once per step, as under jax.jit, so every device gets the same
  value; results of several dtypes come back bit for bit (NaN, -0.0)."""
  from jax.experimental import io_callback
  m = mesh(*M24)
  count = [0]

  def next_values(v):
    count[0] += 1
    return (np.float32(v.sum() + count[0]), np.array([np.nan, -0.0, 3.5], np.float32),
            np.int32(count[0]), np.bool_(count[0] % 2))
  shapes = (jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((3,), jnp.float32),
            jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.bool_))

  def step(x):
    s, v, k, odd = io_callback(next_values, shapes, x)
    return x * s, v, k, odd
  x = np.arange(16.0, dtype=np.float32).reshape(8, 2)
  with warnings.catch_warnings():
    warnings.simplefilter("error", gshard.PartitionWarning)
    part = gshard.partition(step, m, in_specs=(P("data"),))
    got = [part(x) for _ in range(2)]
  jax.effects_barrier()
  assert count[0] == 2
  count[0] = 0
  want = [jax.jit(step)(x) for _ in range(2)]
  for g, w in zip(got, want):
    _equal(g, w)
  kinds = {(c.kind, c.role) for c in part.lower(x).collectives()}
  assert ("all_gather", "operand 0") in kinds and ("psum", "result 0") in kinds


@pytest.mark.parametrize("ordered", [False, True])
def test_io_callback_results_of_every_dtype_come_back_exact(ordered):
  """Ordered or not, named sharding or not: one call; complex results travel
  as their parts, 4-bit ones widened to a byte and narrowed back."""
  import ml_dtypes
  from jax.experimental import io_callback
  m = mesh(*M24)
  count = [0]
  dtypes = [np.complex64, ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.float4_e2m1fn,
            jnp.bfloat16, np.uint16, np.int8]
  vals = [np.array([1 + 2j, np.nan - 0.0j], np.complex64)] + \
      [np.array([-1, 3], d) if jnp.issubdtype(d, jnp.signedinteger) or
       jnp.issubdtype(d, jnp.floating) else np.array([1, 3], d) for d in dtypes[1:]]

  def host(v):
    count[0] += 1
    return tuple(vals)
  shapes = tuple(jax.ShapeDtypeStruct((2,), d) for d in dtypes)

  def step(x):
    return io_callback(host, shapes, x, ordered=ordered,
                       sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  x = np.arange(8.0, dtype=np.float32)
  with warnings.catch_warnings():
    warnings.simplefilter("error", gshard.PartitionWarning)
    got = gshard.partition(step, m, in_specs=(P("data"),))(x)
  jax.effects_barrier()
  assert count[0] == 1
  _equal(got, tuple(vals))


def test_a_callback_result_gshard_cannot_send_is_refused():
  from gshard.spmd.partition import callback
  assert not callback._carried(jax.dtypes.float0)
  assert callback._carried(np.complex64) and callback._carried(jnp.bfloat16)


def test_pure_callback_runs_once_on_the_whole_value():
  m = mesh(*M24)
  calls = []

  def host_fn(v):
    calls.append(v.shape)
    return np.sort(v, axis=0)
  x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)

  def step(x):
    return jax.pure_callback(host_fn, jax.ShapeDtypeStruct(x.shape, x.dtype), x * 2) + 1
  with warnings.catch_warnings():
    warnings.simplefilter("error", gshard.PartitionWarning)
    out = gshard.partition(step, m, in_specs=(P("data", "model"),))(x)
  jax.effects_barrier()
  assert calls == [(8, 4)]
  np.testing.assert_array_equal(np.asarray(out), np.sort(x * 2, axis=0) + 1)


# -- device_put in the function --------------------------------------------------------

def test_device_put_to_a_named_sharding_is_a_sharding_constraint():
  """The value moved is laid out as the destination says (the output, shaped
  unlike the input, is not state: it leaves in its propagated layout)."""
  m = mesh(*M24)
  x = np.arange(32.0, dtype=np.float32).reshape(8, 4)

  def step(x):
    y = jax.device_put(x * 2, NamedSharding(m, P(None, "model")))
    return (jnp.tanh(y) + 1).T
  with warnings.catch_warnings():
    warnings.simplefilter("error", gshard.PartitionWarning)
    part = gshard.partition(step, m, in_specs=(P("data"),))
    _equal(part(x), jax.jit(step)(x))
  low = part.lower(x)
  assert "tanh" in low.as_text("jaxpr") and "f32[8,1] = tanh" in low.as_text("jaxpr")
  assert low.out_shardings[0].to_spec() == P("model", None)


def test_device_put_of_several_values_and_of_none():
  m = mesh(*M24)
  x = np.arange(32.0, dtype=np.float32).reshape(8, 4)

  def step(x):
    a, b = jax.device_put((x + 1, x * 3), NamedSharding(m, P("model")))
    return (a * b).T, jax.device_put(x - 1)        # no destination: a copy
  with warnings.catch_warnings():
    warnings.simplefilter("error", gshard.PartitionWarning)
    part = gshard.partition(step, m, in_specs=(P("data"),))
    _equal(part(x), jax.jit(step)(x))
  assert part.lower(x).out_shardings[0].to_spec() == P(None, "model")


def test_device_put_on_another_mesh_names_it():
  m = mesh(*M24)
  other = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("rows",))
  x = np.zeros((8, 4), np.float32)

  def step(x):
    return jax.device_put(x, NamedSharding(other, P("rows"))) + 1
  with pytest.raises(ValueError, match=r"device_put at .*test_linalg\.py"):
    gshard.partition(step, m, in_specs=(P("data"),))(x)


def test_device_put_to_one_device_takes_the_safe_path():
  m = mesh(*M24)
  x = np.arange(32.0, dtype=np.float32).reshape(8, 4)

  def step(x):
    return jax.device_put(x * 2, jax.devices()[0]) + 1
  with pytest.warns(gshard.PartitionWarning, match="no partition rule for device_put"):
    out = gshard.partition(step, m, in_specs=(P("data"),))(x)
  np.testing.assert_array_equal(np.asarray(out), x * 2 + 1)


# -- what jax's library code emits -----------------------------------------------------

def test_platform_dependent_and_searchsorted_partition_without_warnings():
  m = mesh(*M24)
  x = np.linspace(-1, 11, 64, dtype=np.float32).reshape(8, 8)
  x[0, :3] = [np.nan, -0.0, 0.0]

  def step(x):
    y = lax.platform_dependent(x, cpu=lambda v: v * 2, default=lambda v: v * 3)
    return y, jnp.searchsorted(jnp.arange(10.0), x), jnp.sort(x, axis=1)
  with warnings.catch_warnings():
    warnings.simplefilter("error", gshard.PartitionWarning)
    _equal(gshard.partition(step, m, in_specs=(P("data", "model"),))(x), jax.jit(step)(x))


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_tile_equals_one_device_bit_for_bit(data):
  """``jnp.tile`` (the ``tile`` primitive): random shapes (zero-size and size-1
  dims included), repetitions, input layouts and out_specs; value and gradient
  equal jax.jit's exactly, and nothing takes the safe path."""
  m = mesh(*M24)
  shape = tuple(data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=3), label="shape"))
  reps = tuple(data.draw(st.lists(st.integers(1, 4), min_size=len(shape),
                                  max_size=len(shape)), label="reps"))
  entries = [()] * len(shape)
  for axis in ("data", "model"):      # each mesh axis on one dim, or none
    d = data.draw(st.sampled_from([None, *range(len(shape))]), label=f"{axis} on")
    if d is not None:
      entries[d] = entries[d] + (axis,)
  spec = P(*[None if not e else e[0] if len(e) == 1 else e for e in entries])
  out = data.draw(st.sampled_from([None, P("data"), P(None, "model") if len(shape) > 1
                                   else P("model")]), label="out")
  x = np.arange(max(1, np.prod(shape)), dtype=np.float32)[:np.prod(shape)].reshape(shape)

  def f(v):
    return jnp.tile(v * 2 - 3, reps)
  with warnings.catch_warnings():
    warnings.simplefilter("error", gshard.PartitionWarning)
    _equal(gshard.partition(f, m, in_specs=(spec,), out_specs=out)(x), jax.jit(f)(x))
    grad = jax.grad(lambda v: jnp.sum(f(v) * jnp.cos(f(v))))
    _equal(gshard.partition(grad, m, in_specs=(spec,))(x), jax.jit(grad)(x))
