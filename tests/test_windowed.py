"""Windowed ops over split dims: convolution, pooling and their gradients,
slice / pad / rev / concatenate.

Every value test compares ``gshard.partition`` with ``jax.jit`` on one device,
gradients included. Structural tests check that a spatially split convolution
exchanges only its halo rows (``ppermute`` bytes = halo rows x row bytes, in
gshard's record and in XLA's compiled program) and never gathers the image.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import PartitionSpec as P

import gshard
from gshard.spmd.partition.halo import Halo, halo_plan
from gshard.spmd.registry import sharding_rule
from helpers_partition import hlo_collectives, mesh

NHWC = ("NHWC", "HWIO", "NHWC")
NWC = ("NWC", "WIO", "NWC")


def rand(*shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def assert_close(got, want, what=""):
  """rtol 1e-5; atol 1e-5 of the largest entry (f32 sums are reordered)."""
  for path, g, w in zip(jax.tree_util.tree_flatten_with_path(want)[0],
                        jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    w = np.asarray(w)
    np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5,
                               atol=1e-5 * max(1.0, float(np.max(np.abs(w)))),
                               err_msg=f"{what}{jax.tree_util.keystr(path[0])}")


def check(f, args, m, in_specs, out_specs=None, what=""):
  """Partition ``f`` over ``m``, compare with ``jax.jit(f)``; return the Lowered."""
  step = gshard.partition(f, m, in_specs=in_specs, out_specs=out_specs, strict=True)
  assert_close(step(*args), jax.jit(f)(*args), what)
  return step.lower(*args)


def kinds(lowered) -> set[str]:
  return {c.kind for c in lowered.collectives()}


def conv(stride, padding, rhs_dilation=None, lhs_dilation=None, dn=NHWC, **kw):
  return lambda x, w: lax.conv_general_dilated(
      x, w, stride, padding, lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
      dimension_numbers=dn, **kw)


def value_and_grads(fn):
  """value_and_grad of sum(sin(fn(x, w))) in both arguments."""
  return value_and_grads_n(fn, 2)


def value_and_grads_n(fn, n):
  return jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), argnums=tuple(range(n)))


# -- the halo geometry ----------------------------------------------------------

def test_halo_plan_examples():
  # SAME 3-wide conv, stride 1, 16 rows over 4 devices: one row from each side.
  assert halo_plan(4, 16, 1, 4, 6) == Halo(1, 1, 0, 0, 0, 0, 6)
  # 5-wide pool, stride 3, padding (2, 2), 16 rows over 2 (3 windows each):
  # device 0 reads rows -2..8, device 1 rows 7..17; device 1's window starts
  # one row further into its extended block (slope 1).
  assert halo_plan(2, 16, 2, 9, 11) == Halo(1, 1, 1, 1, 0, 1, 11)
  # SAME 3-wide conv, stride 2 (lo=0, hi=1): only the right neighbour's first row.
  assert halo_plan(4, 16, 0, 4, 5) == Halo(0, 1, 0, 0, 0, 0, 5)
  # 7-wide kernel on 2-row shards: 3 rows from each side is more than one shard.
  assert halo_plan(8, 16, 3, 2, 8) is None


@given(n=st.integers(1, 8), local=st.integers(1, 6), lo=st.integers(-6, 6),
       advance=st.integers(0, 8), width=st.integers(1, 10))
def test_halo_plan_reads_each_devices_window(n, local, lo, advance, width):
  """Simulated with numpy: every device's extended block (fill, rows from its
  neighbours, its own rows, fill) holds at ``offset + d * slope`` exactly the
  rows ``d * advance - lo ...`` of the global dim, fill outside it; n == 1 too
  (an axis of size 1 "splits" a dim into one block)."""
  halo = halo_plan(n, n * local, lo, advance, width)
  if halo is None:
    return
  assert min(halo.left, halo.right, halo.pad_left, halo.pad_right) >= 0, halo
  rows = np.arange(n * local)
  blocks = rows.reshape(n, local)
  fill = -1
  for d in range(n):
    left = blocks[d - 1][local - halo.left:] if d > 0 else np.full(halo.left, fill)
    right = blocks[d + 1][:halo.right] if d < n - 1 else np.full(halo.right, fill)
    ext = np.concatenate([np.full(halo.pad_left, fill), left, blocks[d], right,
                          np.full(halo.pad_right, fill)])
    start = halo.offset + d * halo.slope
    assert 0 <= start and start + width <= len(ext), (d, halo)
    want = [r if 0 <= r < n * local else fill
            for r in range(d * advance - lo, d * advance - lo + width)]
    np.testing.assert_array_equal(ext[start:start + width], want, err_msg=f"device {d}")


def _rule(f, *args):
  eqn = jax.make_jaxpr(f)(*args).eqns[-1]
  return str(sharding_rule(eqn.primitive.name)(
      [v.aval for v in eqn.invars], [v.aval for v in eqn.outvars], **eqn.params))


def test_conv_sharding_rules_printed():
  x, w = rand(8, 16, 16, 3), rand(3, 3, 3, 4)
  # rows d and columns f shared by input and output (free), kernel window blocked
  assert _rule(conv((1, 1), "SAME"), x, w) == \
      "adfb,egbc->adfc sum={b} blocked={eg} linear=product"
  # weight gradient: the image factors are summed (each device a partial grad)
  grad_w = jax.grad(lambda w, x: jnp.sum(conv((1, 1), "SAME")(x, w)))
  assert _rule(grad_w, w, x) == "bdfa,bdfc->egac sum={bdf} blocked={eg} linear=product"
  # depthwise (8 groups of 1 channel, 2 outputs each): the group factor b is
  # free, the in-group channel c blocked
  assert _rule(conv((1,), "SAME", dn=NWC, feature_group_count=8), rand(2, 16, 8),
               rand(3, 1, 16)) == "ae(bc),fc(bd)->ae(bd) sum={c} blocked={cf} linear=product"
  assert _rule(pool("max", (1, 3, 3, 1), (1, 2, 2, 1), "SAME"), x) == "abcd->abcd"


# -- convolution: values and gradients ------------------------------------------------

CONV_CASES = [
    # name, fn, x shape, w shape, mesh, in_specs, collectives expected
    ("batch split", conv((1, 1), "SAME"), (8, 8, 8, 3), (3, 3, 3, 4),
     ((8,), ("x",)), (P("x"), P()), {"psum"}),
    ("H split", conv((1, 1), "SAME"), (2, 16, 16, 3), (3, 3, 3, 4),
     ((2, 4), ("a", "b")), (P("a", "b"), P()), {"ppermute", "psum"}),
    ("H,W split", conv((1, 1), "SAME"), (2, 16, 16, 3), (3, 3, 3, 4),
     ((2, 4), ("a", "b")), (P(None, "a", "b"), P()), {"ppermute", "psum"}),
    ("H over two axes", conv((1, 1), "SAME"), (2, 32, 8, 3), (3, 3, 3, 4),
     ((2, 4), ("a", "b")), (P(None, ("b", "a")), P()), {"ppermute", "psum"}),
    ("stride 2", conv((2, 2), "SAME"), (2, 16, 16, 3), (3, 3, 3, 4),
     ((2, 2, 2), ("p", "q", "r")), (P("p", "q", "r"), P()), {"ppermute", "psum"}),
    ("rhs dilation", conv((1, 1), "SAME", rhs_dilation=(2, 3)), (2, 16, 24, 3), (3, 3, 3, 4),
     ((2, 4), ("a", "b")), (P(None, "a", "b"), P()), {"ppermute", "psum"}),
    ("stride 2 dilation 2, 5-wide", conv((2,), "SAME", rhs_dilation=(2,), dn=NWC),
     (2, 64, 3), (5, 3, 4), ((8,), ("x",)), (P(None, "x"), P()), {"ppermute", "psum"}),
    ("explicit padding", conv((2, 1), ((2, 1), (0, 2))), (2, 16, 16, 3), (4, 3, 3, 4),
     ((2, 4), ("a", "b")), (P(None, "b", "a"), P()), {"ppermute", "psum"}),
    ("lhs dilation (transposed)", conv((1,), ((2, 2),), lhs_dilation=(2,), dn=NWC),
     (2, 16, 3), (4, 3, 4), ((8,), ("x",)), (P(None, "x"), P()), {"ppermute", "psum"}),
    ("NCHW", conv((1, 2), "SAME", rhs_dilation=(2, 1), dn=("NCHW", "OIHW", "NCHW")),
     (2, 3, 16, 16), (4, 3, 3, 3), ((2, 4), ("a", "b")), (P(None, None, "a", "b"), P()),
     {"ppermute", "psum"}),
    ("input features split", conv((1,), "SAME", dn=NWC), (2, 16, 8), (3, 8, 4),
     ((2, 4), ("a", "b")), (P("a", None, "b"), P(None, "b")), {"psum"}),
    ("output features split", conv((1,), "SAME", dn=NWC), (2, 16, 8), (3, 8, 8),
     ((8,), ("x",)), (P(), P(None, None, "x")), {"psum"}),
]


@pytest.mark.parametrize("case", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_conv_value_and_grads(case):
  name, fn, x_shape, w_shape, (shape, names), in_specs, want = case
  lowered = check(value_and_grads(fn), (rand(*x_shape), rand(*w_shape, seed=1)),
                  mesh(shape, names), in_specs, what=name)
  assert kinds(lowered) <= want, lowered.explain()


@pytest.mark.parametrize("count,spec", [
    (8, P(None, None, None, ("b", "b2"))),     # depthwise, channels split 4 ways
    (8, P("a", "b", None, "b2")),              # depthwise, batch, rows and channels
    (2, P(None, "a", "b", "b2")),              # 2 groups, one per device
], ids=["depthwise channels", "depthwise mixed", "2 groups"])
def test_grouped_conv_forward(count, spec):
  """feature_group_count > 1: the group factor splits and runs locally with
  fewer groups. (Their gradients reshape with ``dimensions=``, which
  propagation does not support yet, so forward only.)"""
  m = mesh((2, 2, 2), ("a", "b", "b2"))
  fn = conv((1, 1), "SAME", feature_group_count=count)
  x, w = rand(2, 8, 8, 8), rand(3, 3, 8 // count, 16, seed=1)
  lowered = check(fn, (x, w), m, (spec, P()), what=f"groups={count}")
  assert "all_gather" not in kinds(lowered), lowered.explain()


def test_batch_group_conv_forward():
  m = mesh((2, 2, 2), ("a", "b", "b2"))
  fn = conv((1, 1), "SAME", batch_group_count=2)
  lowered = check(fn, (rand(4, 8, 8, 3), rand(3, 3, 3, 4, seed=1)), m,
                  (P(None, "a", "b"), P()))
  assert "all_gather" not in kinds(lowered), lowered.explain()


def cnn_loss(params, x, pool_window=2, pool_stride=2, pool_padding="VALID"):
  w1, w2 = params
  y = jax.nn.relu(lax.conv_general_dilated(x, w1, (1, 1), "SAME", dimension_numbers=NHWC))
  y = lax.reduce_window(y, -jnp.inf, lax.max, (1, pool_window, pool_window, 1),
                        (1, pool_stride, pool_stride, 1), pool_padding)
  y = lax.conv_general_dilated(y, w2, (1, 1), "SAME", dimension_numbers=NHWC)
  return jnp.mean(y)


CNN_LAYOUTS = [
    ("data parallel", ((8,), ("x",)), P("x"), (8, 16, 16, 3), {"psum"}),
    ("image rows", ((2, 4), ("data", "model")), P("data", "model"), (4, 16, 16, 3),
     {"ppermute", "psum"}),
    ("image rows and cols", ((2, 4), ("data", "model")), P(None, "data", "model"),
     (2, 16, 32, 3), {"ppermute", "psum"}),
    ("rows 8 ways", ((8,), ("x",)), P(None, "x"), (2, 32, 16, 3), {"ppermute", "psum"}),
]


@pytest.mark.parametrize("layout", CNN_LAYOUTS, ids=[c[0] for c in CNN_LAYOUTS])
def test_cnn_loss_value_and_grad(layout):
  """conv -> relu -> max pool -> conv -> mean, value_and_grad in the weights."""
  name, (shape, names), spec, x_shape, want = layout
  params = (rand(3, 3, 3, 4, seed=1), rand(3, 3, 4, 5, seed=2))
  lowered = check(jax.value_and_grad(cnn_loss), (params, rand(*x_shape)),
                  mesh(shape, names), ((P(), P()), spec), what=name)
  assert kinds(lowered) <= want, lowered.explain()


def test_cnn_overlapping_pool_grad():
  """3x3/2 SAME max pool: its gradient (select_and_scatter_add) needs halos too."""
  loss = lambda p, x: cnn_loss(p, x, 3, 2, "SAME")
  params = (rand(3, 3, 3, 4, seed=1), rand(3, 3, 4, 5, seed=2))
  lowered = check(jax.value_and_grad(loss), (params, rand(2, 16, 16, 3)),
                  mesh((2, 4), ("data", "model")), ((P(), P()), P(None, "data", "model")))
  assert kinds(lowered) <= {"ppermute", "psum"}, lowered.explain()
  assert any(c.primitive == "select_and_scatter_add" for c in lowered.collectives())


# -- pooling ---------------------------------------------------------------------

def pool(kind, window, strides, padding, base_dilation=None, window_dilation=None):
  init, op = {"max": (-jnp.inf, lax.max), "min": (jnp.inf, lax.min),
              "sum": (0.0, lax.add), "prod": (1.0, lax.mul)}[kind]
  return lambda x: lax.reduce_window(x, init, op, window, strides, padding, base_dilation,
                                     window_dilation)


L8, L24, LBA = (((8,), ("x",)), P(None, "x")), (((2, 4), ("a", "b")), P("a", "b")), \
    (((2, 4), ("a", "b")), P(None, ("b", "a")))
POOL_CASES = [
    # name, pooling, layout of f32[2,32,3]
    ("max 3/2 SAME", pool("max", (1, 3, 1), (1, 2, 1), "SAME"), LBA),
    ("max 3/1 SAME", pool("max", (1, 3, 1), (1, 1, 1), "SAME"), L8),
    ("max 5/1 SAME", pool("max", (1, 5, 1), (1, 1, 1), "SAME"), L24),
    ("max 3/2 pad (1,0)", pool("max", (1, 3, 1), (1, 2, 1), ((0, 0), (1, 0), (0, 0))), L8),
    ("min 4/4 SAME", pool("min", (1, 4, 1), (1, 4, 1), "SAME"), L24),
    ("min 3/2 SAME", pool("min", (1, 3, 1), (1, 2, 1), "SAME"), L8),
    ("max 2/3 VALID (gaps)", pool("max", (1, 2, 1), (1, 3, 1), "VALID"), L8),
    ("sum 3/2 SAME", pool("sum", (1, 3, 1), (1, 2, 1), "SAME"), LBA),
    ("sum base dilation", pool("sum", (1, 3, 1), (1, 2, 1), ((0, 0), (1, 1), (0, 0)),
                               (1, 2, 1)), L8),
]


@pytest.mark.parametrize("case", POOL_CASES, ids=[c[0] for c in POOL_CASES])
def test_pool_value_and_grad(case):
  name, fn, ((shape, names), spec) = case
  f = jax.value_and_grad(lambda x: jnp.sum(jnp.sin(fn(x))))
  lowered = check(f, (rand(2, 32, 3),), mesh(shape, names), (spec,), what=name)
  # 4/4 and 2/3 windows never cross a shard edge: no halo
  assert ("ppermute" in kinds(lowered)) != name.startswith(("min 4/4", "max 2/3")), \
      lowered.explain()


def test_pool_window_dilation_and_generic_reduce_window():
  m = mesh((8,), ("x",))
  x = rand(2, 32, 3)
  dilated = pool("max", (1, 3, 1), (1, 1, 1), ((0, 0), (2, 2), (0, 0)), None, (1, 2, 1))
  check(dilated, (x,), m, (P(None, "x"),), what="window dilation")
  check(pool("prod", (1, 3, 1), (1, 1, 1), "SAME"), (x,), m, (P(None, "x"),),
        what="generic reduce_window")


def test_select_and_gather_add_from_jvp():
  """Forward-mode derivative of max pooling binds select_and_gather_add."""
  fn = pool("max", (1, 3, 1), (1, 2, 1), "SAME")
  f = lambda x, t: jax.jvp(fn, (x,), (t,))[1]
  assert "select_and_gather_add" in str(jax.make_jaxpr(f)(rand(2, 16, 3), rand(2, 16, 3)))
  lowered = check(f, (rand(2, 16, 3), rand(2, 16, 3, seed=1)), mesh((8,), ("x",)),
                  (P(None, "x"), P(None, "x")))
  assert kinds(lowered) == {"ppermute"}, lowered.explain()


# -- random convolutions ---------------------------------------------------------------

MESHES = [((8,), ("x",)), ((2, 4), ("a", "b")), ((4, 2), ("a", "b")),
          ((2, 2, 2), ("p", "q", "r"))]


@st.composite
def conv_programs(draw):
  shape, names = draw(st.sampled_from(MESHES))
  sizes = dict(zip(names, shape))
  nsp = draw(st.sampled_from([1, 2]))
  order = draw(st.permutations(names))
  if nsp == 1:
    groups = [tuple(order)]
  else:     # both spatial dims split where the mesh has two axes or more
    cut = draw(st.integers(min(1, len(order) - 1), max(1, len(order) - 1)))
    groups = [tuple(order[:cut]), tuple(order[cut:])]
  dims = []
  for axes in groups:
    n = math.prod(sizes[a] for a in axes)
    stride, k = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    rd = draw(st.integers(1, 2))
    length = n * stride * draw(st.integers(2, 4))
    kind = draw(st.sampled_from(["SAME", "aligned", "aligned", "any"]))
    ld = 1 if kind == "SAME" else draw(st.sampled_from([1, 1, 2]))
    if kind == "aligned":     # total padding that makes the output length * ld / stride
      total = (k - 1) * rd + ld - 1 - draw(st.integers(0, stride - 1))
      lo = draw(st.integers(min(0, total), max(0, total)))
      pad = (lo, total - lo)
    elif kind == "any":
      pad = (draw(st.integers(-1, 3)), draw(st.integers(-1, 3)))
    else:
      pad = "SAME"
    dims.append((axes, length, stride, k, rd, ld, pad))
  return shape, names, dims


@settings(max_examples=10)
@given(conv_programs())
def test_random_convolutions(program):
  """Random strides, dilations, paddings, kernel sizes and meshes, 1-D and 2-D
  spatial splits: value and both gradients equal the unsplit program."""
  shape, names, dims = program
  spatial = "HW"[:len(dims)]
  lhs, rhs, out = "NC" + spatial, "OI" + spatial, "NC" + spatial
  pads = [p for *_, p in dims]
  padding = "SAME" if all(p == "SAME" for p in pads) else (
      "VALID" if all(p == "VALID" for p in pads) else None)
  if padding is None:
    padding = []
    for axes, length, stride, k, rd, ld, p in dims:
      if isinstance(p, tuple):
        padding.append(p)
      else:
        padding.append(lax.padtype_to_pads(((length - 1) * ld + 1,), ((k - 1) * rd + 1,),
                                           (stride,), p)[0])
  fn = conv(tuple(d[2] for d in dims), padding, tuple(d[4] for d in dims),
            tuple(d[5] for d in dims), dn=(lhs, rhs, out))
  x = rand(2, 2, *[d[1] for d in dims])
  w = rand(3, 2, *[d[3] for d in dims], seed=1)
  try:
    out_shape = jax.eval_shape(fn, x, w).shape
  except (ValueError, TypeError):
    assume(False)
  assume(all(n > 0 for n in out_shape))
  spec = P(None, None, *[d[0] for d in dims])
  check(value_and_grads(fn), (x, w), mesh(shape, names), (spec, P()), what=str(program))


# -- structure: only halos are exchanged -------------------------------------------------

HALO_CASES = [
    # name, conv, x shape, x spec, halo bytes per device (by hand)
    # 16 rows over model=4: local f32[2,4,16,8], a row is 2*16*8*4 = 1024 B;
    # SAME 3x3 needs 1 row from each neighbour.
    ("3x3 SAME", conv((1, 1), "SAME"), (4, 16, 16, 8), P("data", "model"), 2 * 1024),
    # 5x5 with rhs dilation 2: reach 4 rows each side = a whole neighbour shard.
    ("5x5 dilated", conv((1, 1), "SAME", rhs_dilation=(2, 1)), (4, 16, 16, 8),
     P("data", "model"), 8 * 1024),
    # stride 2 SAME: padding (0, 1), each device needs its right neighbour's first row.
    ("3x3 stride 2", conv((2, 2), "SAME"), (4, 16, 16, 8), P("data", "model"), 1 * 1024),
    # rows over data=2 (local f32[4,8,4,8]: H row 4*4*8*4 = 512 B), then columns over
    # model=4 on the extended block f32[4,10,4,8] (W column 4*10*8*4 = 1280 B): corners
    # come with the second exchange.
    ("3x3 rows and cols", conv((1, 1), "SAME"), (4, 16, 16, 8), P(None, "data", "model"),
     2 * 512 + 2 * 1280),
]


@pytest.mark.parametrize("case", HALO_CASES, ids=[c[0] for c in HALO_CASES])
def test_spatial_conv_exchanges_only_halos(case):
  name, fn, x_shape, spec, halo_bytes = case
  m = mesh((2, 4), ("data", "model"))
  w = rand(5 if "5x5" in name else 3, 3, 8, 8, seed=1)
  lowered = check(fn, (rand(*x_shape), w), m, (spec, P()), out_specs=spec, what=name)
  cols = lowered.collectives()
  assert {c.kind for c in cols} == {"ppermute"}, lowered.explain()
  assert sum(c.bytes for c in cols) == halo_bytes, lowered.explain()
  hlo = hlo_collectives(lowered.compile().as_text(), m)
  assert {c.kind for c in hlo} == {"collective-permute"}, hlo
  assert sum(c.nbytes for c in hlo) == halo_bytes, hlo


def test_pending_sum_into_conv():
  """A partial sum (contracting dim split over b) feeding a convolution: where
  propagation keeps it pending, the halo carries partial sums (the convolution
  is linear in its input) and one psum follows."""
  def f(x, a, w):
    y = jnp.einsum("nlc,cd->nld", x, a)
    return conv((2,), "SAME", dn=NWC)(y, w)

  lowered = check(value_and_grads_n(f, 3), (rand(2, 16, 8), rand(8, 6, seed=1),
                                            rand(3, 6, 1, seed=2)),
                  mesh((2, 4), ("a", "b")), (P(None, "a", "b"), P("b"), P()))
  assert "all_gather" not in kinds(lowered), lowered.explain()
  assert any(c.kind == "ppermute" and c.src.partial for c in lowered.collectives()), \
      lowered.explain()


def test_weight_gradient_is_halo_plus_partial_sum():
  """Image split: the weight gradient exchanges halos and sums partial grads;
  the image is never gathered."""
  m = mesh((2, 4), ("data", "model"))
  f = jax.grad(lambda w, x: jnp.sum(jnp.sin(conv((1, 1), "SAME")(x, w))))
  lowered = check(f, (rand(3, 3, 8, 8, seed=1), rand(4, 16, 16, 8)), m,
                  (P(), P("data", "model")))
  cols = lowered.collectives()
  assert {c.kind for c in cols} == {"ppermute", "psum"}, lowered.explain()
  (psum,) = [c for c in cols if c.kind == "psum"]
  assert psum.shape == (3, 3, 8, 8) and set(psum.axes) == {"data", "model"}


# -- fallbacks: a dim that cannot keep its split is gathered, and says why ----------

@pytest.mark.parametrize("fn,x_shape,spec,why", [
    (conv((1,), "SAME", dn=NWC), (2, 16, 3), P(None, "x"), "halo is wider than one shard"),
    (conv((1,), "VALID", dn=NWC), (2, 32, 3), P(None, "x"), "30 is not a multiple of 8"),
    (conv((1,), ((1, 1),), lhs_dilation=(2,), dn=NWC), (2, 16, 3), P(None, "x"),
     "31 is not a multiple of 8"),
], ids=["7-wide on 2-row shards", "VALID", "lhs dilation"])
def test_conv_gather_fallback(fn, x_shape, spec, why):
  k = 7 if "halo" in why else 3
  lowered = check(value_and_grads(fn), (rand(*x_shape), rand(k, 3, 4, seed=1)),
                  mesh((8,), ("x",)), (spec, P()))
  gathers = [c for c in lowered.collectives() if c.kind == "all_gather"]
  assert gathers and all(why in c.role for c in gathers), lowered.explain()


def test_misaligned_pool_gradient_gathers():
  """5-wide, stride-3 max pool (6 windows) over two 8-row shards: 3 windows
  start every 9 rows, not every 8, so the gradient (select_and_scatter_add)
  gathers that dim; the forward pool still exchanges halos."""
  fn = pool("max", (1, 5, 1), (1, 3, 1), ((0, 0), (2, 2), (0, 0)))
  lowered = check(jax.grad(lambda x: jnp.sum(jnp.sin(fn(x)))), (rand(2, 16, 3),),
                  mesh((2, 4), ("a", "b")), (P(None, "a"),))
  roles = {(c.primitive, c.kind) for c in lowered.collectives()}
  assert ("reduce_window_max", "ppermute") in roles, lowered.explain()
  assert any(c.primitive == "select_and_scatter_add" and "do not align" in c.role
             for c in lowered.collectives()), lowered.explain()


# -- slice, pad, rev, concatenate along a split dim ------------------------------------

SHIFT_CASES = [
    # name, fn (result annotated split like the input), mesh, spec, collectives
    ("rev", lambda x: jnp.flip(x, 1), ((8,), ("x",)), P(None, "x"), {"ppermute"}),
    ("rev both dims", lambda x: jnp.flip(x, (0, 1)), ((2, 4), ("a", "b")), P("a", "b"),
     {"ppermute"}),
    ("rev over two axes", lambda x: jnp.flip(x, 1), ((2, 4), ("a", "b")),
     P(None, ("b", "a")), {"ppermute"}),
    ("slice 2:30", lambda x: x[:, 2:30], ((2, 4), ("a", "b")), P(None, "b"), {"ppermute"}),
    ("slice ::2", lambda x: x[:, ::2], ((8,), ("x",)), P(None, "x"), set()),
    ("slice 3:27:3", lambda x: lax.slice(x, (0, 3), (4, 27), (1, 3)), ((8,), ("x",)),
     P(None, "x"), {"ppermute"}),
    ("slice 1:17 (gathered)", lambda x: x[:, 1:17], ((8,), ("x",)), P(None, "x"),
     {"all_gather"}),
    ("pad (2, 2)", lambda x: jnp.pad(x, ((0, 0), (2, 2))), ((2, 4), ("a", "b")),
     P(None, "b"), {"ppermute"}),
    ("pad shift", lambda x: lax.pad(x, 1.5, ((0, 0, 0), (1, -1, 0))), ((8,), ("x",)),
     P(None, "x"), {"ppermute"}),
    ("pad interior", lambda x: lax.pad(x, -2.0, ((0, 0, 0), (1, 0, 1))), ((8,), ("x",)),
     P(None, "x"), {"ppermute"}),
    ("concatenate", lambda x: jnp.concatenate([x, 2 * x], axis=1), ((8,), ("x",)),
     P(None, "x"), {"all_gather"}),
    ("roll", lambda x: jnp.roll(x, 3, axis=1), ((8,), ("x",)), P(None, "x"),
     {"all_gather"}),
]


@pytest.mark.parametrize("case", SHIFT_CASES, ids=[c[0] for c in SHIFT_CASES])
def test_shift_ops_along_split_dim(case):
  name, fn, (shape, names), spec, want = case
  f = lambda x: gshard.shard(fn(x), spec)
  lowered = check(f, (rand(4, 32),), mesh(shape, names), (spec,), what=name)
  assert kinds(lowered) == want, lowered.explain()


@pytest.mark.parametrize("case", SHIFT_CASES, ids=[c[0] for c in SHIFT_CASES])
def test_shift_ops_along_a_size_one_axis(case):
  """The same ops with the dim "split" over an axis of size 1: whole on every
  device, no halo to exchange (a slice once built a fill of -2 rows)."""
  name, fn, _, _, _ = case
  spec = P(None, "one")
  f = lambda x: gshard.shard(fn(x), spec)
  lowered = check(f, (rand(4, 32),), mesh((1, 8), ("one", "x")), (spec,), what=name)
  assert "ppermute" not in kinds(lowered), lowered.explain()


def test_rev_sends_each_block_once():
  lowered = check(lambda x: jnp.flip(x, 1), (rand(4, 32),), mesh((8,), ("x",)),
                  (P(None, "x"),), out_specs=P(None, "x"))
  (c,) = lowered.collectives()
  assert c.kind == "ppermute" and c.bytes == 4 * 4 * 4     # the whole f32[4,4] block


def test_shift_ops_grads():
  """Gradients of slice / pad / rev along the split dim (pad <-> slice transpose)."""
  m = mesh((2, 4), ("a", "b"))

  def loss(x):
    y = gshard.shard(jnp.pad(x, ((0, 0), (2, 2))), P(None, "b"))
    z = gshard.shard(jnp.flip(y, 1)[:, 4:36] * x, P(None, "b"))
    return jnp.sum(jnp.sin(z))

  check(jax.value_and_grad(loss), (rand(4, 32),), m, (P(None, "b"),))


@pytest.mark.parametrize("init,op,window,strides,padding", [
    (100.0, lax.add, (3,), (1,), "SAME"),
    (2.0, lax.mul, (3,), (2,), ((1, 1),)),
    (-5.0, lax.max, (4,), (1,), ((2, 1),)),
])
def test_generic_reduce_window_whose_init_is_not_the_identity(init, op, window, strides,
                                                              padding):
  """XLA skips a reduce_window's padding and applies the init value once per
  window; a split dim's halo filled with the init value counted it once more
  per padded row (found by a review). The dim is gathered for a generic
  computation with padding (gshard cannot know its identity)."""
  f = lambda a: lax.reduce_window(a, init, op, window, strides, padding)
  check(f, (np.arange(1.0, 17.0, dtype=np.float32),), mesh((4,), ("y",)), (P("y"),),
        what=f"init {init}")
