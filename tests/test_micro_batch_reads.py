"""Loops over micro-batches read by slices keep data parallelism.

A ``lax.fori_loop(0, K, body, g)`` whose body reads micro-batch ``i`` of a
batch split over ``data`` as ``dynamic_slice(x, i * M, M)``, and a Python loop
over ``x[k*M:(k+1)*M]`` (or ``x.reshape(K, M, ...)[k]``), are read as the
reshaped batch before propagation (``spmd/micro_batches.py``), whose
micro-batches keep the batch's split (``spmd/relayout.py``). Before, each
fori step's slice was a masked read and a psum of the micro-batch (twice the
bytes GSPMD sends by gathering ``x``), the Python loop gathered ``x``, and
every device computed every row. Values are small integers (every order of
the sums exact), so the partitioned program is compared with ``jax.jit`` bit
for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax
from jax.extend.core import check_jaxpr, jaxpr_as_fun
from jax.sharding import PartitionSpec as P

import gshard
from gshard.spmd.micro_batches import reshaped_reads
from helpers_partition import draw_batch, mesh


def _ints(rng, shape):
  return rng.integers(-3, 4, shape).astype(np.float32)


def _accumulate(count: int, form: str = "in_dim"):
  """SGD on the sum of ``count`` micro-batches' gradients, the micro-batch
  read by a dynamic slice at ``i * M``: ``dynamic_slice_in_dim``,
  ``lax.dynamic_slice`` with every start given, or with a loss sum carried
  beside the gradient."""
  def step(w, x, y):
    rows = x.shape[0] // count

    def read(a, i):
      if form == "tuple":
        return lax.dynamic_slice(a, (i * rows, 0), (rows, a.shape[1]))
      return lax.dynamic_slice_in_dim(a, i * rows, rows)

    def loss(w, xx, yy):
      return jnp.sum((xx @ w) * yy)

    def body(i, carry):
      xx, yy = read(x, i), read(y, i)
      if form == "with_loss":
        g, total = carry
        value, grad = jax.value_and_grad(loss)(w, xx, yy)
        return g + grad, total + value
      return carry + jax.grad(loss)(w, xx, yy)

    init = (jnp.zeros_like(w), jnp.zeros(())) if form == "with_loss" else jnp.zeros_like(w)
    out = lax.fori_loop(0, count, body, init)
    g = out[0] if form == "with_loss" else out
    return (w - 0.5 * g, out[1]) if form == "with_loss" else w - 0.5 * g
  return step


def _loop_dots(low):
  scan = [e for e in low.per_device_jaxpr().eqns if e.primitive.name == "scan"]
  assert len(scan) == 1, low.per_device_jaxpr()
  return [e for e in scan[0].params["jaxpr"].jaxpr.eqns if e.primitive.name == "dot_general"]


def _check_equal(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _run_drawn(data, step, shape, names, axes, batch: int, nan_in: int):
  """``step(w, x, y)`` on drawn small integers (a NaN in ``x`` or ``y``,
  ``nan_in``, if drawn), the batch split over ``axes``: bit for bit
  ``jax.jit``'s values, and no collective but ppermute, all-to-all and psum.
  The lowered program."""
  rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
  w = _ints(rng, (8, 8))
  xy = [_ints(rng, (batch, 8)), _ints(rng, (batch, 8))]
  if data.draw(st.booleans(), label="NaN"):
    xy[nan_in][rng.integers(0, batch), rng.integers(0, 8)] = np.nan
  spec = P(axes[0] if len(axes) == 1 else axes)
  part = gshard.partition(step, mesh(shape, names), in_specs=(P(), spec, spec))
  low = part.lower(w, *xy)
  _check_equal(part(w, *xy), jax.jit(step)(w, *xy))
  assert {c.kind for c in low.collectives()} <= {"ppermute", "all_to_all", "psum"}, \
      low.explain()
  return low


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fori_accumulation_is_data_parallel_and_equals_one_device(data):
  """Random meshes, batch axes (one or two), micro-batch counts below, at and
  above the device count, rows per device, the three ways of reading the
  micro-batch, NaNs in the batch or not: the step equals ``jax.jit`` bit
  for bit (NaN positions included); nothing is gathered, and the loop's dot
  reads this device's rows of the micro-batch (``B / K / n``)."""
  shape, names, sizes, axes, n, count, rows = draw_batch(data)
  form = data.draw(st.sampled_from(["in_dim", "tuple", "with_loss"]), label="form")
  low = _run_drawn(data, _accumulate(count, form), shape, names, axes, count * rows, nan_in=0)
  dots = _loop_dots(low)
  assert dots and all(e.invars[0].aval.shape[0] == rows // n for e in dots), low.explain()


def test_fori_accumulation_sends_the_scan_forms_bytes():
  """K = 2, 4, 8 and 16 over 8 devices: the fori_loop form sends what the scan
  form sends (``x`` and ``y`` moved once, one psum of the gradient after the
  loop), under half of what it sent before (a psum of each micro-batch of
  ``x`` and ``y``: ``2 * 2 * 7/8`` of their bytes) and no more than GSPMD."""
  rng = np.random.default_rng(0)
  w, x, y = _ints(rng, (16, 16)), _ints(rng, (128, 16)), _ints(rng, (128, 16))
  m = mesh((8,), ("data",))
  local, grad_sum = 128 * 16 * 4 // 8, 2 * 7 * (16 * 16 * 4) // 8
  before = 2 * 2 * 7 * 128 * 16 * 4 // 8
  for count in (2, 4, 8, 16):
    step = _accumulate(count)
    part = gshard.partition(step, m, in_specs=(P(), P("data"), P("data")))
    low = part.lower(w, x, y)
    _check_equal(part(w, x, y), jax.jit(step)(w, x, y))
    moved = 2 * local if count < 8 else 2 * 7 * local // 8
    assert low.total_bytes() == moved + grad_sum, low.explain()
    assert low.total_bytes() * 2 < before, low.explain()
    assert all(c.repeat == 1 for c in low.collectives()), low.explain()   # none in the loop


def test_the_rewrite_is_the_scan_form():
  """The traced fori_loop becomes a scan over ``x.reshape(K, M, ...)`` with
  the counter gone; the program type-checks and computes the same values."""
  rng = np.random.default_rng(1)
  w, x, y = _ints(rng, (8, 8)), _ints(rng, (32, 8)), _ints(rng, (32, 8))
  closed = jax.make_jaxpr(_accumulate(4))(w, x, y)
  new = reshaped_reads(closed)
  check_jaxpr(new.jaxpr)
  scan = [e for e in new.jaxpr.eqns if e.primitive.name == "scan"][0]
  assert scan.params["num_carry"] == 1, scan        # the counter gone
  assert [tuple(v.aval.shape) for v in scan.invars[-2:]] == [(4, 8, 8)] * 2, scan
  body = scan.params["jaxpr"].jaxpr
  assert not any(e.primitive.name == "dynamic_slice" for e in body.eqns), body
  _check_equal(jaxpr_as_fun(new)(w, x, y), jaxpr_as_fun(closed)(w, x, y))


def _loops():
  """Loops the rewrite leaves as they are: name -> (function, args)."""
  rng = np.random.default_rng(2)
  w, x = _ints(rng, (8, 8)), _ints(rng, (32, 8))

  def shifted(w, x):        # start i * 8 + 1: not the micro-batch grid
    return lax.fori_loop(0, 3, lambda i, g: g + lax.dynamic_slice_in_dim(x, i * 8 + 1, 8)
                         @ w, jnp.zeros((8, 8)))

  def short(w, x):          # 3 of the 4 micro-batches: not a reshape of x
    return lax.fori_loop(0, 3, lambda i, g: g + lax.dynamic_slice_in_dim(x, i * 8, 8) @ w,
                         jnp.zeros((8, 8)))

  def layers(w, x):         # the carry is the activation, not a sum
    return lax.fori_loop(0, 4, lambda i, h: h @ w + lax.dynamic_slice_in_dim(x, i * 8, 8),
                         jnp.zeros((8, 8)))

  def from_one(w, x):       # the counter starts at 1
    return lax.fori_loop(1, 4, lambda i, g: g + lax.dynamic_slice_in_dim(x, i * 8, 8) @ w,
                         jnp.zeros((8, 8)))

  def columns(w, x):        # slices of the trailing dim
    return lax.fori_loop(0, 4, lambda i, g: g + w @ lax.dynamic_slice_in_dim(x.T, i * 8, 8,
                                                                              axis=1),
                         jnp.zeros((8, 8)))
  return {f.__name__: (f, (w, x)) for f in (shifted, short, layers, from_one, columns)}


def test_other_loops_are_left_as_they_are():
  """A start off the micro-batch grid, fewer steps than micro-batches, a
  carried activation, a counter from 1, slices of another dim: the program
  is unchanged, and partitioned it still equals ``jax.jit``."""
  m = mesh((8,), ("data",))
  for name, (f, args) in _loops().items():
    closed = jax.make_jaxpr(f)(*args)
    assert reshaped_reads(closed) is closed, name
    part = gshard.partition(f, m, in_specs=(P(), P("data")))
    _check_equal(part(*args), jax.jit(f)(*args))


def test_a_counter_read_in_the_body_stays():
  """The body reads the counter (a per-step weight): the slices become
  ``xs``, the counter stays a carry, the values are ``jax.jit``'s, and the
  loop is still one over micro-batches: each device computes its rows, and
  ``x`` moves once (nothing gathered)."""
  rng = np.random.default_rng(3)
  w, x = _ints(rng, (8, 8)), _ints(rng, (32, 8))

  def f(w, x):
    def body(i, g):
      return g + (i + 1) * (lax.dynamic_slice_in_dim(x, i * 8, 8) @ w)
    return lax.fori_loop(0, 4, body, jnp.zeros((8, 8)))
  closed = jax.make_jaxpr(f)(w, x)
  new = reshaped_reads(closed)
  check_jaxpr(new.jaxpr)
  scan = [e for e in new.jaxpr.eqns if e.primitive.name == "scan"][0]
  assert scan.params["num_carry"] == 2 and scan.invars[-1].aval.shape == (4, 8, 8), scan
  part = gshard.partition(f, mesh((8,), ("data",)), in_specs=(P(), P("data")))
  _check_equal(part(w, x), jax.jit(f)(w, x))
  low = part.lower(w, x)
  assert not [c for c in low.collectives() if c.shape == x.shape and c.kind != "ppermute"], \
      low.explain()           # (the sum of activations is gathered as the output)
  dots = _loop_dots(low)
  assert dots and all(e.invars[0].aval.shape[0] == 1 for e in dots), low.explain()


def test_inside_jit_and_differentiated():
  """The loop inside a ``jax.jit`` is rewritten too (data parallel), and the
  input gradient through the loop equals ``jax.jit``'s."""
  rng = np.random.default_rng(4)
  w, x, y = _ints(rng, (8, 8)), _ints(rng, (64, 8)), _ints(rng, (64, 8))
  m = mesh((8,), ("data",))
  step = jax.jit(_accumulate(2))
  part = gshard.partition(step, m, in_specs=(P(), P("data"), P("data")))
  low = part.lower(w, x, y)
  _check_equal(part(w, x, y), jax.jit(step)(w, x, y))
  assert {c.kind for c in low.collectives()} <= {"ppermute", "psum"}, low.explain()

  def dx(w, x):
    def loss(x):
      return lax.fori_loop(0, 2, lambda i, s: s + jnp.sum(
          lax.dynamic_slice_in_dim(x, i * 32, 32) @ w), 0.0)
    return jax.grad(loss)(x)
  part = gshard.partition(dx, m, in_specs=(P(), P("data")))
  _check_equal(part(w, x), jax.jit(dx)(w, x))


# what a step may do to its batch before the loop (exact on small integers):
# the loop then reads a value made of the input, not the input
_PREP = {
    None: lambda w, x: x,
    "bf16": lambda w, x: x.astype(jnp.bfloat16).astype(x.dtype),
    "scale": lambda w, x: x * 2.0,
    "shift": lambda w, x: x - w[:, 0],
}


def _unrolled(count: int, form: str, wrt_x: bool = False, prep=None):
  """The same step as a Python loop: ``x[k*M:(k+1)*M]`` (``slices``),
  ``x.reshape(K, M, ...)[k]`` (``index``) or ``jnp.split(x, K)[k]``
  (``split``); ``wrt_x``: the gradient with respect to ``x`` too (jax
  transposes each read into a pad and sums them, or a split into a
  concatenate); ``prep``: the batch cast, scaled or shifted first
  (``_PREP``)."""
  def total(w, x, y):
    rows = x.shape[0] // count
    x = _PREP[prep](w, x)
    if form == "index":
      xs, ys = x.reshape(count, rows, -1), y.reshape(count, rows, -1)
    elif form == "split":
      xs, ys = jnp.split(x, count), jnp.split(y, count)
    out = jnp.zeros(())
    for k in range(count):
      if form in ("index", "split"):
        xx, yy = xs[k], ys[k]
      else:
        xx, yy = x[k * rows:(k + 1) * rows], y[k * rows:(k + 1) * rows]
      out = out + jnp.sum((xx @ w) * yy)
    return out

  def step(w, x, y):
    if wrt_x:
      g, dx = jax.grad(total, argnums=(0, 1))(w, x, y)
      return w - 0.5 * g, dx
    return w - 0.5 * jax.grad(total)(w, x, y)
  return step


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_python_loop_accumulation_is_data_parallel_and_equals_one_device(data):
  """A Python loop over the micro-batches, by static slices, by indexing the
  reshaped batch or by ``jnp.split``, of the batch or of a value made of it
  (cast, scaled, shifted), the gradient of ``x`` too or not; random meshes,
  batch axes, K from 2 to past the device count, rows per device, NaNs or
  not: bit for bit ``jax.jit``'s values; nothing gathered, every dot reads
  this device's rows of its micro-batch (``B / K / n``), and the gradient of
  ``x`` comes out split as ``x`` came in."""
  shape, names, sizes, axes, n, count, rows = draw_batch(data, least=2)
  form = data.draw(st.sampled_from(["slices", "index", "split"]), label="form")
  wrt_x = data.draw(st.booleans(), label="gradient of x too")
  prep = data.draw(st.sampled_from(sorted(_PREP, key=str)), label="batch made first")
  low = _run_drawn(data, _unrolled(count, form, wrt_x, prep), shape, names, axes,
                   count * rows, nan_in=1)
  dots = [e for e in low.per_device_jaxpr().eqns if e.primitive.name == "dot_general"]
  assert len(dots) >= count and all(
      e.invars[0].aval.shape[0] == rows // n for e in dots), low.explain()
  if wrt_x:
    assert low.out_shardings[1].dims[0] == tuple(axes), low.out_shardings


def test_slices_that_do_not_tile_the_batch_are_left_as_they_are():
  """Halves of different sizes, a missing micro-batch, a strided slice, a
  slice of a trailing dim, one slice alone, an uneven ``jnp.split``, one of
  columns, a concatenation of unequal pieces: no reshape; the values are
  ``jax.jit``'s."""
  rng = np.random.default_rng(5)
  x = _ints(rng, (32, 8))
  cases = {
      "uneven": lambda x: x[:8].sum(0) + x[8:].sum(0),
      "missing": lambda x: x[:8].sum(0) + x[16:24].sum(0) + x[24:].sum(0),
      "strided": lambda x: x[0:16:2].sum(0) + x[16:32:2].sum(0),
      "trailing": lambda x: x[:, :4].sum(0) + x[:, 4:].sum(0),
      "alone": lambda x: x[:16].sum(0),
      "uneven split": lambda x: sum(p.sum(0) for p in jnp.split(x, [8])),
      "split of columns": lambda x: sum(p.sum(0) for p in jnp.split(x, 2, axis=1)),
      "concatenated unequal": lambda x: jnp.concatenate([x[:8] * 2, x[8:]]),
  }
  m = mesh((8,), ("data",))
  for name, f in cases.items():
    closed = jax.make_jaxpr(f)(x)
    assert reshaped_reads(closed) is closed, name
    part = gshard.partition(f, m, in_specs=(P("data"),))
    _check_equal(part(x), jax.jit(f)(x))


def _rows(n: int):
  """Row ``r`` holds ``r``: a wrong row shows in the sum."""
  return np.tile(np.arange(n, dtype=np.float32)[:, None], (1, 4))


def _narrow(dtype, rows: int, count: int):
  def f(x):     # start dtype(i) * dtype(rows): wraps at i*rows > max
    return lax.fori_loop(0, count, lambda i, g: g + jnp.sum(lax.dynamic_slice_in_dim(
        x, i.astype(dtype) * np.asarray(rows, dtype), rows), 0), jnp.zeros(4))
  return f


def _byte_counter(x):       # a hand-written scan with an int8 counter (wraps at 128)
  def body(c, _):
    i, acc = c
    return (i + np.int8(1), acc + jnp.sum(lax.dynamic_slice_in_dim(x, i * np.int8(1), 1), 0)), None
  return lax.scan(body, (np.int8(0), jnp.zeros(4)), None, length=200)[0][1]


def _float_step(x):         # start floor(i * 2.5): rows 0, 2, 5, 6 (not 0, 2, 4, 6)
  return lax.fori_loop(0, 4, lambda i, g: g + jnp.sum(lax.dynamic_slice_in_dim(
      x, (i * 2.5).astype(jnp.int32), 2), 0), jnp.zeros(4))


def _counter_as_ys(plus: int):
  def f(x):                 # the counter (or the next one) is also each step's ys
    def body(c, _):
      i, acc = c
      return (i + 1, acc + jnp.sum(lax.dynamic_slice_in_dim(x, i * 8, 8), 0)), i + plus
    (_, acc), ys = lax.scan(body, (0, jnp.zeros(4)), None, length=4)
    return acc, ys
  return f


def _with_callback(x):      # an equation without results in the body
  def body(i, g):
    jax.debug.callback(lambda v: None, i)
    return g + jnp.sum(lax.dynamic_slice_in_dim(x, i * 8, 8), 0)
  return lax.fori_loop(0, 4, body, jnp.zeros(4))


def test_starts_that_wrap_or_round_and_other_bodies():
  """A second reader's cases: a start computed in int8 / uint8 (it wraps), an
  int8 counter over 200 steps, a float step (``i * 2.5`` truncated), each
  step's ``ys`` the counter or the next one, a callback in the body. Wrong
  values or a crash before; now each equals ``jax.jit``."""
  m = mesh((8,), ("data",))
  cases = [(_narrow(jnp.int8, 64, 3), 192), (_narrow(jnp.uint8, 128, 3), 384),
           (_byte_counter, 200), (_float_step, 8), (_counter_as_ys(0), 32),
           (_counter_as_ys(1), 32), (_with_callback, 32)]
  for f, n in cases:
    x = _rows(n)
    part = gshard.partition(f, m, in_specs=(P("data"),))
    _check_equal(part(x), jax.jit(f)(x))


def test_the_python_loop_rewrite():
  """Static slices that tile ``x`` become one reshape and a slice of one
  micro-batch each; the gradient of ``x`` (a sum of pads, as jax transposes
  the slices) is summed on ``[K, M, ...]`` and reshaped once. The program
  type-checks and computes the same values."""
  rng = np.random.default_rng(6)
  w, x, y = _ints(rng, (8, 8)), _ints(rng, (32, 8)), _ints(rng, (32, 8))
  closed = jax.make_jaxpr(_unrolled(4, "slices", wrt_x=True))(w, x, y)
  new = reshaped_reads(closed)
  check_jaxpr(new.jaxpr)
  names = [e.primitive.name for e in new.jaxpr.eqns]
  reshapes = [e for e in new.jaxpr.eqns if e.primitive.name == "reshape"]
  assert [tuple(e.outvars[0].aval.shape) for e in reshapes].count((4, 8, 8)) == 2, names
  assert [tuple(e.outvars[0].aval.shape) for e in reshapes].count((32, 8)) == 1, names
  pads = [e for e in new.jaxpr.eqns if e.primitive.name == "pad"]
  assert len(pads) == 4 and all(e.outvars[0].aval.shape == (4, 8, 8) for e in pads), pads
  _check_equal(jaxpr_as_fun(new)(w, x, y), jaxpr_as_fun(closed)(w, x, y))


def test_split_and_its_transpose_become_the_reshaped_batch():
  """``jnp.split(x, K)`` becomes one reshape and a slice of one micro-batch
  each; its transpose (a concatenate of the cotangents) is stacked on
  ``[K, M, ...]`` and reshaped once. Type-checks, same values."""
  rng = np.random.default_rng(7)
  w, x, y = _ints(rng, (8, 8)), _ints(rng, (32, 8)), _ints(rng, (32, 8))
  closed = jax.make_jaxpr(_unrolled(4, "split", wrt_x=True))(w, x, y)
  new = reshaped_reads(closed)
  check_jaxpr(new.jaxpr)
  names = [e.primitive.name for e in new.jaxpr.eqns]
  assert "split" not in names, names
  cat = [e for e in new.jaxpr.eqns if e.primitive.name == "concatenate"]
  assert len(cat) == 1 and cat[0].outvars[0].aval.shape == (4, 8, 8), cat
  _check_equal(jaxpr_as_fun(new)(w, x, y), jaxpr_as_fun(closed)(w, x, y))


def test_other_slices_of_a_tiled_batch_stay():
  """Beside the slices that tile ``x``, a strided slice and a slice of some
  columns of it are read from ``x`` as they are (a second reader found them
  taken as micro-batches of the reshaped ``x``: wrong values)."""
  rng = np.random.default_rng(8)
  x = _ints(rng, (16, 4))
  m = mesh((8,), ("data",))
  for f in (lambda x: (x[0:8] * 2 + x[8:16], x[::2]),
            lambda x: (x[0:8] + x[8:16], x[0:8, :2])):
    new = reshaped_reads(jax.make_jaxpr(f)(x))
    check_jaxpr(new.jaxpr)
    part = gshard.partition(f, m, in_specs=(P("data"),))
    _check_equal(part(x), jax.jit(f)(x))


def test_many_micro_batches():
  """64 micro-batches by ``jnp.split`` and by slices, the gradient of ``x``
  too: jax's concatenate of 64 pieces has more factors than letters (it
  raised "rank too large for factor names" before, at the base too)."""
  rng = np.random.default_rng(9)
  w, x = _ints(rng, (8, 8)), _ints(rng, (256, 8))
  m = mesh((8,), ("data",))

  def by_split(w, x):
    return jax.grad(lambda x: sum(jnp.sum((p @ w) ** 2) for p in jnp.split(x, 64)))(x)

  def by_slices(w, x):
    return jax.grad(lambda x: sum(jnp.sum((x[k * 4:(k + 1) * 4] @ w) ** 2)
                                  for k in range(64)))(x)
  for f in (by_split, by_slices):
    part = gshard.partition(f, m, in_specs=(P(), P("data")))
    _check_equal(part(w, x), jax.jit(f)(w, x))


def test_concatenated_weights_and_halves_of_activations_are_no_micro_batches():
  """A fused projection's weights concatenated on dim 0 (rows split over a
  model axis), and halves of an activation multiplied together (a
  contrastive loss): a second reader found both moved to their rows and
  sending more (1156 -> 2692 B, 1344 -> 1600 B). Only an input read as
  micro-batches, and the transpose of that read, are rewritten now; these
  programs are left as they are and equal ``jax.jit``."""
  rng = np.random.default_rng(10)
  x, wq, w = _ints(rng, (32, 8)), _ints(rng, (16, 8)), _ints(rng, (8, 8))

  def fused(x, a, b, c):
    h = x @ jnp.concatenate([a, b, c]).T
    q, k, v = jnp.split(h, 3, axis=1)
    return jnp.sum(q * k * v)

  def contrastive(x, w):
    def loss(w):
      a, b = jnp.split(x @ w, 2)
      return jnp.sum(a @ b.T)
    return jax.grad(loss)(w)
  cases = [(fused, (x, wq, wq + 1, wq - 1), mesh((2, 4), ("x", "y")),
            (P("x"), P("y"), P("y"), P("y"))),
           (contrastive, (x, w), mesh((8,), ("data",)), (P("data"), P()))]
  for f, args, m, specs in cases:
    closed = jax.make_jaxpr(f)(*args)
    assert reshaped_reads(closed) is closed, f.__name__
    part = gshard.partition(f, m, in_specs=specs)
    _check_equal(part(*args), jax.jit(f)(*args))


def test_a_sum_with_a_literal_term():
  """jax's transpose can add a literal cotangent (``add_any 1.0 i``): the
  search for sums of micro-batch pads skips it (it raised "unhashable type:
  'Literal'", found by the propagation property test)."""
  def f(a):
    c = jnp.sum(a, axis=0)
    return jnp.sum(c, axis=()) + jnp.sum(-c, axis=())
  x = np.ones((8,), np.float32)
  closed = jax.make_jaxpr(jax.grad(f))(x)
  assert reshaped_reads(closed) is closed
  part = gshard.partition(jax.grad(f), mesh((8,), ("data",)), in_specs=(P("data"),))
  _check_equal(part(x), jax.jit(jax.grad(f))(x))
