"""Classes of silently wrong values and crashes found on real code, each fixed at
its root, each with its neighbours.

Every case compares the partitioned program with ``jax.jit`` of the same
function on one device: bitwise for ints and bools (dtype included), NaN
positions included, and to rounding for floats (the only float cases here are
sums of a few exactly representable terms, so they are compared exactly too).

* a pending sum of bools is an OR (a gather from a split bool table, a
  dynamic_slice of a bool array along its split dim, a dot of bools over a
  split contracting dim), of small ints a wrapping sum;
* NaN over a split dim: max/min propagate it, argmax/argmin return the first
  NaN, the gradient of max through NaN is NaN-free exactly where jax's is;
* a pending sum never passes an op that another operand splits over its axes
  (``x * sum(x)`` with ``x`` split);
* scatter-add with split indices or updates adds the operand once;
* dynamic_update_slice with its update split along an offset dim, and the
  gradient of a split dynamic_slice;
* dynamic_slice with two split dims, or a split dim and another sliced dim;
  a start past the end with the result split (jax clamps it; XLA's merge of
  nested dynamic slices would not, so gshard clamps explicitly);
* a scalar two-index gather from a split array;
* scatters other than scatter-add (set, max, min, multiply, subtract) into a
  split operand write locally instead of taking the safe path;
* zero-size dims, split, reshaped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gshard
from helpers_partition import mesh

MASK = np.array([True, False, True, True, False, False, True, False])
IDX = np.array([1, 0, 3, 5], np.int32)
NANS = np.array([1., np.nan, 3., 4., np.nan, 0., 2., 1.], np.float32)
ARANGE8 = np.arange(8.0, dtype=np.float32)
M24 = ((2, 4), ("a", "b"))


def _same(got, want, what):
  got_leaves, want_leaves = jax.tree.leaves(gshard.unpad(got)), jax.tree.leaves(want)
  assert len(got_leaves) == len(want_leaves), what
  for g, w in zip(got_leaves, want_leaves):
    g, w = np.asarray(g), np.asarray(w)
    assert g.dtype == w.dtype, f"{what}: dtype {g.dtype} != {w.dtype}"
    assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
    assert np.array_equal(g, w, equal_nan=True), f"{what}: {g} != {w}"


CASES = {
    # -- bools and small ints through a pending sum
    "bool gather, where(~m)": (lambda m, i: jnp.where(~m[i], 1.0, 2.0),
                               (MASK, IDX), (P("b"), None)),
    "bool gather 2-d": (lambda m, i: jnp.where(~m[i], 1, 2),
                        (MASK.reshape(2, 4), np.array([[1, 0], [0, 3]], np.int32)),
                        (P("a", "b"), None)),
    "bool dynamic_slice": (lambda m, s: ~lax.dynamic_slice(m, (s,), (3,)),
                           (MASK, np.int32(2)), (P("b"), None)),
    "bool dot over split k": (lambda x, y: ~jnp.dot(x, y),
                              (MASK.reshape(2, 4), MASK.reshape(4, 2)), (P(None, "b"), P("b"))),
    "jnp.unique of bools": (lambda m: jnp.unique(m, size=2, fill_value=False),
                            (MASK,), (P("b"),)),
    "int8 sum wraps": (lambda x: jnp.sum(x, dtype=jnp.int8), (np.full(8, 100, np.int8),),
                       (P("b"),)),
    "uint8 dot wraps": (lambda x, y: jnp.dot(x, y),
                        (np.full((2, 8), 200, np.uint8), np.full((8, 2), 3, np.uint8)),
                        (P(None, "b"), P("b"))),
    # -- NaN over a split dim
    "max NaN": (jnp.max, (NANS,), (P("b"),)),
    "min NaN": (jnp.min, (NANS,), (P("b"),)),
    "max bf16 NaN": (lambda x: jnp.max(x.astype(jnp.bfloat16)), (NANS,), (P("b"),)),
    "argmax NaN": (jnp.argmax, (NANS,), (P("b"),)),
    "argmin NaN": (jnp.argmin, (NANS,), (P("b"),)),
    "argmax NaN uneven": (jnp.argmax, (NANS[:7],), (P("b"),)),
    "argmax ties": (jnp.argmax, (np.array([1, 3, 3, 0, 3, 2, 1, 3], np.float32),), (P("b"),)),
    "argmin bools": (jnp.argmin, (MASK,), (P("b"),)),
    "max rows with NaN, 2-d": (lambda x: jnp.max(x, axis=1), (NANS.reshape(2, 4),),
                               (P(None, "b"),)),
    "grad max NaN": (jax.grad(jnp.max), (NANS,), (P("b"),)),
    "grad max no NaN": (jax.grad(jnp.max), (ARANGE8[::-1].copy(),), (P("b"),)),
    # -- a pending sum meeting an operand split over its axes
    "x * sum(x)": (lambda x: x * jnp.sum(x), (ARANGE8,), (P("b"),)),
    "x / sum(x)": (lambda x: x / jnp.sum(x), (ARANGE8 + 1,), (P("b"),)),
    "x * sum(x) 2-d": (lambda x: x * jnp.sum(x, axis=0), (ARANGE8.reshape(4, 2),),
                       (P("b"),)),
    "sum(x) * x.T @ x": (lambda x: jnp.sum(x) * (x.T @ x), (ARANGE8.reshape(4, 2),),
                         (P("b"),)),
    # -- scatter-add
    "x.at[idx].add(u), idx and u split": (
        lambda x, i, u: x.at[i].add(u),
        (np.ones(6, np.float32), IDX, np.arange(4.0, dtype=np.float32)), (None, P("b"), P("b"))),
    "x.at[idx].add(u), u split": (
        lambda x, i, u: x.at[i].add(u),
        (np.ones(6, np.float32), IDX, np.arange(4.0, dtype=np.float32)), (P("a"), None, P("b"))),
    "scatter-add into uneven split operand": (
        lambda x, i, u: x.at[:, i].add(u),
        (np.zeros((2, 7), np.float32), np.array([6, 0, 3], np.int32), np.ones((2, 3), np.float32)),
        (P(None, "b"), None, None)),
    "scatter-add rows into uneven split operand": (
        lambda x, i, u: x.at[i].add(u),
        (np.zeros((7, 3), np.float32), np.array([6, 0, 3], np.int32), np.ones((3, 3), np.float32)),
        (P("b"), None, None)),
    "x.at[idx].set(u) into a split operand": (
        lambda x, i, u: x.at[i].set(u),
        (np.zeros(8, np.float32), np.array([7, 0, 3, 3], np.int32), np.arange(4.0, dtype=np.float32)),
        (P("b"), None, None)),
    "x.at[-1].set(v), operand split unevenly inside (XLA misplaces OOB scatters)": (
        lambda a, i: gshard.shard(a, P("b")).at[i].set(-0.5),
        (np.arange(40.0, dtype=np.float32).reshape(5, 2, 1, 4), np.int32(-1)), (None, None)),
    "x.at[i].add(u, mode=clip), a window dim indexed too": (
        lambda a, i, u: a.at[i, 1:3].add(u, mode="clip"),
        (np.zeros((7, 4), np.float32), np.array([9, -2, 3], np.int32), np.ones((3, 2), np.float32)),
        (P("b"), None, None)),
    "x.at[idx].max(u) into an uneven split operand, out of range dropped": (
        lambda x, i, u: x.at[i].max(u),
        (np.zeros((7, 3), np.float32), np.array([6, 0, 9], np.int32), np.ones((3, 3), np.float32)),
        (P("b"), None, None)),
    "x.at[idx].min(u, mode=clip)": (
        lambda x, i, u: x.at[i].min(u, mode="clip"),
        (np.ones(8, np.float32), np.array([9, -3, 3], np.int32), -np.arange(3.0, dtype=np.float32)),
        (P("b"), None, None)),
    "x.at[idx].multiply(u)": (
        lambda x, i, u: x.at[i].multiply(u),
        (np.full(8, 2.0, np.float32), np.array([1, 5, 5], np.int32), np.full(3, 3.0, np.float32)),
        (P("b"), None, None)),
    "x.at[:, idx].add(u), idx split unevenly, operand split (padding rows dropped)": (
        lambda x, i, u: gshard.shard(x, P(("a", "b"))).at[:, i].add(u),
        (np.zeros((2, 6, 2), np.float32), np.array([5, -5, -4, -5, -5, 5], np.int32),
         np.float32(-0.25)), (None, P(("a", "b")), None)),
    "x.at[idx].set(u), idx split unevenly, operand replicated": (
        lambda x, i, u: x.at[i].set(u),
        (np.ones(6, np.float32), np.array([1, 2, 4], np.int32), np.float32(7.0)),
        (None, P("b"), None)),
    "x.at[idx].add(u), idx and u split unevenly": (
        lambda x, i, u: x.at[i].add(u),
        (np.ones(6, np.float32), np.array([1, 0, 4], np.int32),
         np.array([1.0, 2.0, 3.0], np.float32)), (None, P("b"), P("b"))),
    "x.at[idx].subtract(u), idx and u split": (
        lambda x, i, u: x.at[i].subtract(u),
        (np.ones(6, np.float32), IDX, np.arange(4.0, dtype=np.float32)), (None, P("b"), P("b"))),
    "jnp.unique of split ints": (lambda m: jnp.unique(m, size=3, fill_value=-1),
                                 (np.array([3, 1, 3, 2, 1, 1, 0, 2], np.int32),), (P("b"),)),
    # -- dynamic slices
    "dynamic_update_slice, update split on the offset dim": (
        lambda x, u, s: lax.dynamic_update_slice(x, u, (s,)),
        (np.zeros(8, np.float32), np.arange(4.0, dtype=np.float32), np.int32(3)),
        (None, P("b"), None)),
    "dynamic_update_slice, start clamped": (
        lambda x, u, s: lax.dynamic_update_slice(x, u, (s, 0)),
        (np.zeros((8, 4), np.float32), np.arange(12.0, dtype=np.float32).reshape(3, 4),
         np.int32(9)), (P(None, "b"), P("a"), None)),
    "grad of split dynamic_slice": (
        jax.grad(lambda x, s: jnp.sum(lax.dynamic_slice(x, (s,), (3,)) ** 2)),
        (ARANGE8, np.int32(2)), (P("b"), None)),
    "grad of dynamic_slice, result split": (
        jax.grad(lambda x, s: jnp.sum(gshard.shard(lax.dynamic_slice(x, (s, 0), (3, 8)),
                                                   P(None, "b")) ** 2)),
        (np.arange(64.0, dtype=np.float32).reshape(8, 8), np.int32(6)), (P("a", "b"), None)),
    "dynamic_slice, two split dims": (
        lambda x, s: lax.dynamic_slice(x, (s, s), (2, 3)),
        (np.arange(64.0, dtype=np.float32).reshape(8, 8), np.int32(3)), (P("a", "b"), None)),
    "dynamic_slice, a split and an unsplit sliced dim": (
        lambda x, s: lax.dynamic_slice(x, (s, s), (2, 3)),
        (np.arange(64.0, dtype=np.float32).reshape(8, 8), np.int32(5)), (P("b"), None)),
    "dynamic_slice, start past the end": (
        lambda x, s: lax.dynamic_slice(x, (s,), (4,)), (ARANGE8, np.int32(7)), (P("b"), None)),
    "dynamic_slice past the end, result split (XLA merges nested slices)": (
        lambda a, s: gshard.shard(lax.dynamic_slice_in_dim(a, s, 4), P("b")),
        (ARANGE8, np.int32(6)), (None, None)),
    "dynamic_slice 2-d past the end, result split": (
        lambda a, s: gshard.shard(lax.dynamic_slice(a, (s, 1), (4, 3)), P("b", None)),
        (np.arange(64.0, dtype=np.float32).reshape(8, 8), np.int32(7)), (None, None)),
    "dynamic_update_slice past the end, result split": (
        lambda a, u, s: gshard.shard(lax.dynamic_update_slice_in_dim(a, u, s, 0), P("b")),
        (ARANGE8, np.ones(3, np.float32), np.int32(7)), (None, None, None)),
    # -- gathers
    "a.T[i, j] from a split array": (
        lambda a, i, j: a.T[i, j],
        (np.arange(32.0, dtype=np.float32).reshape(4, 8), np.int32(1), np.int32(2)),
        (P(None, "b"), None, None)),
    # -- shapes
    "top_k along a non-last axis": (lambda x: lax.top_k(jnp.moveaxis(x, 0, -1), 3),
                                    (np.random.default_rng(0).random((8, 5), np.float32),),
                                    (P("b"),)),
    "top_k, k larger than a local shard": (lambda x: lax.top_k(x, 5),
                                           (np.random.default_rng(1).random((3, 8),
                                                                            np.float32),),
                                           (P(None, "b"),)),
    "flip along an uneven split dim": (lambda x: jnp.flip(x, 0) * 1,
                                       (np.arange(27.0, dtype=np.float32).reshape(9, 3),),
                                       (P("b"),)),
    "flip along an even split dim": (lambda x: jnp.flip(x, 0) * 1, (ARANGE8,), (P("b"),)),
    "pad mode=edge": (lambda x: jnp.pad(x, 2, mode="edge"), (ARANGE8,), (None,)),
    "pad mode=edge, split": (lambda x: jnp.pad(x, 2, mode="edge"), (ARANGE8,), (P("b"),)),
    "zero-size dim split": (lambda x, y: (x * 2, jnp.sum(x) + y.sum(), gshard.split(x + 1, 0, "b")),
                            (np.zeros((0, 4), np.float32), np.ones((8,), np.float32)),
                            (P("b"), None)),
    "reshape of an empty value": (lambda x: (x.reshape(0, 6) + 1, x.sum()),
                                   (np.zeros((2, 0, 3), np.float32),), (P("b"),)),
    "zero-size dim split, other dim split": (
        lambda x, y: (x * 2, jnp.sum(x) + y.sum()),
        (np.zeros((0, 4), np.float32), np.ones((8,), np.float32)), (P(None, "a"), P("b"))),
}


@pytest.mark.filterwarnings("error::gshard.PartitionWarning")
@pytest.mark.parametrize("name", sorted(CASES))
def test_equals_one_device(name):
  fn, args, specs = CASES[name]
  want = jax.jit(fn)(*args)
  got = gshard.partition(fn, mesh(*M24), in_specs=specs)(*args)
  _same(got, want, name)


# -- constructs of real model code ---------------------------------------------

X84 = np.arange(32.0, dtype=np.float32).reshape(8, 4)


def _wsc_named(x):
  return jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh(*M24), P("b"))) + 1


def _wsc_bare(x):
  return jax.lax.with_sharding_constraint(x * 2, P(None, "b")) + 1


def _shard_map(x):
  body = lambda y: (lax.psum(y, "b"), jax.jit(lambda z: lax.psum(z, "a"))(y * 2))
  return jax.shard_map(body, mesh=mesh(*M24), in_specs=P("b"), out_specs=(P(), P("b")))(x + 1)


@pytest.mark.parametrize("fn,want", [(_wsc_named, "[b,_]"), (_wsc_bare, "[_,b]")])
def test_with_sharding_constraint_is_an_annotation(fn, want):
  with jax.set_mesh(mesh(*M24)):
    res = gshard.infer_shardings(fn, mesh(*M24))(X84)
    got = gshard.partition(fn, mesh(*M24))(X84)
    ref = jax.jit(fn)(X84)
  # the constraint's layout reaches the output through the elementwise add
  assert [str(s) for s in res.out_shardings] == [want]
  assert not res.unsupported
  _same(got, ref, fn.__name__)


def test_with_sharding_constraint_on_another_mesh_is_an_error():
  other = gshard.make_mesh((4, 2), ("a", "b"))
  fn = lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(other, P("b")))
  with pytest.raises(ValueError, match=r"with_sharding_constraint at .*names the mesh "
                     r"\(a=4, b=2\) but gshard partitions over the mesh \(a=2, b=4\)"):
    gshard.partition(fn, mesh(*M24))(X84)


def test_shard_map_over_the_mesh_with_its_axes_reordered_is_an_error():
  """Same names and sizes, another order (another device assignment): jax's
  'context mesh should match the aval mesh' leaked from the body before."""
  m = mesh(*M24)
  other = jax.sharding.Mesh(m.devices.T, tuple(reversed(m.axis_names)))
  fn = lambda x: jax.shard_map(lambda a: a * 2, mesh=other, in_specs=P("b"), out_specs=P("b"))(x)
  with pytest.raises(ValueError, match=r"shard_map in_specs at .*names the mesh "
                     r"\(b=4, a=2\) but gshard partitions over the mesh \(a=2, b=4\)"):
    gshard.partition(fn, m)(X84)


def test_shard_map_inside_runs_its_body_as_written():
  res = gshard.infer_shardings(_shard_map, mesh(*M24))(X84)
  assert [str(s) for s in res.out_shardings] == ["[_,_]", "[b,_]"]
  _same(gshard.partition(_shard_map, mesh(*M24))(X84), jax.jit(_shard_map)(X84), "shard_map")


def test_shard_map_over_part_of_the_mesh_is_a_clear_error():
  body = lambda y: lax.psum(y, "b")
  fn = lambda x: jax.shard_map(body, mesh=mesh(*M24), in_specs=P("b"), out_specs=P(),
                               axis_names={"b"})(x)
  with pytest.raises(ValueError, match=r"jax.shard_map at .*manual over \['b'\] only"):
    gshard.partition(fn, mesh(*M24))(X84)


def _pmap_style_step(w, x):
  g = jax.grad(lambda w: jnp.mean((gshard.split(x, 0, "a") @ w) ** 2))(w)
  g = lax.pmean(g, "batch")             # written for jax.pmap(..., axis_name="batch")
  return w - 0.1 * g, lax.psum(1, "batch"), lax.axis_index("batch")


def test_pmap_style_collectives_over_an_unbound_axis_are_identities():
  w = np.linspace(-1, 1, 8, dtype=np.float32).reshape(4, 2)
  got = gshard.partition(_pmap_style_step, mesh(*M24))(w, X84)
  g = jax.grad(lambda w: jnp.mean((X84 @ w) ** 2))(w)
  np.testing.assert_allclose(np.asarray(got[0]), w - 0.1 * g, rtol=1e-6)
  assert int(got[1]) == 1 and int(got[2]) == 0


_PMAP_STYLE = {
    "pmean": lambda x: lax.pmean(x, "batch"),
    "pmax": lambda x: lax.pmax(x, "batch"),
    "all_gather": lambda x: lax.all_gather(x, "batch"),
    "all_gather tiled": lambda x: lax.all_gather(x, "batch", axis=1, tiled=True),
    "psum_scatter": lambda x: lax.psum_scatter(x[None], "batch"),
    "all_to_all": lambda x: lax.all_to_all(x[None], "batch", 0, 0)[0],
    "all_to_all 1 0": lambda x: lax.all_to_all(x[:, None], "batch", 1, 0, tiled=True),
    "ppermute": lambda x: lax.ppermute(x, "batch", [(0, 0)]),
    "axis_index": lambda x: x + lax.axis_index("batch"),
    "all_to_all in scan": lambda x: lax.scan(
        lambda c, _: (lax.all_to_all(c[None], "batch", 0, 0)[0] + 1, None), x, None,
        length=2)[0],
    "pure_callback": lambda x: lax.pmean(jax.pure_callback(
        lambda a: np.asarray(a) * 3, jax.ShapeDtypeStruct(x.shape, x.dtype), x), "batch"),
}


@pytest.mark.parametrize("spec", [P("a"), P(None, "b"), None])
@pytest.mark.parametrize("name", sorted(_PMAP_STYLE))
def test_pmap_style_collectives_equal_a_one_device_pmap(name, spec):
  """Each pmap-style collective over an axis only pmap binds gives what
  ``jax.pmap`` over one device gives (all_to_all came out (8, 4, 1, 8, 4)
  for (8, 4): jax's batching rule mis-shapes an unbatched operand; such a
  program's arguments enter batched, and a callback's stay unbatched)."""
  f = lambda x: _PMAP_STYLE[name](x * 2.0)
  want = jax.pmap(f, axis_name="batch", devices=jax.devices()[:1])(X84[None])[0]
  got = gshard.partition(f, mesh(*M24), in_specs=(spec,))(X84)
  assert got.shape == want.shape and got.dtype == want.dtype
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

def test_split_of_a_scalar_says_there_is_no_dim():
  with pytest.raises(ValueError, match=r"split\(x, dim=0, axis='b'\): x is a scalar "
                     r"\(f32\[\]\): it has no dim to split. Use gshard.replicate\(x\)"):
    gshard.split(np.float32(1), 0, "b")


# -- the order-preserving keys max/min/argmax travel as -------------------------


from gshard.spmd.partition.reduce import from_ordered_key, ordered_key  # noqa: E402

SPECIAL = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, -1e-45, 3.4e38, -3.4e38]


@settings(max_examples=60)
@given(st.sampled_from(["float32", "bfloat16", "float16"]),
       st.lists(st.one_of(st.floats(width=32, allow_nan=True), st.sampled_from(SPECIAL)),
                min_size=2, max_size=40),
       st.booleans())
def test_ordered_keys_sort_like_floats_with_nan_at_the_end(dtype, values, nan_high):
  x = jnp.asarray(np.asarray(values, np.float32)).astype(dtype)
  key = np.asarray(ordered_key(x, nan_high=nan_high, signed_nan=True))
  xs = np.asarray(x.astype(jnp.float32))
  nan = np.isnan(xs)
  # round trip: every number back bit for bit, every NaN back as a NaN of its sign
  back = np.asarray(from_ordered_key(jnp.asarray(key), x.dtype, nan_high)
                    .astype(jnp.float32))
  assert np.array_equal(back[~nan], xs[~nan]) and np.isnan(back[nan]).all()
  assert np.array_equal(np.signbit(back[nan]), np.signbit(xs[nan]))
  for i in range(len(xs)):
    for j in range(len(xs)):
      if nan[i] or nan[j]:
        if nan[i] and nan[j]:
          assert (key[i] == key[j]) == (np.signbit(xs[i]) == np.signbit(xs[j]))
        elif nan[i]:
          assert (key[i] > key[j]) == nan_high
      elif xs[i] < xs[j]:
        assert key[i] < key[j]
      elif xs[i] == xs[j] and (np.signbit(xs[i]) == np.signbit(xs[j])):
        assert key[i] == key[j]


def test_scatter_with_unevenly_split_indices_drops_their_padding_rows():
  """Fuzz program 20261201-321: indices of 6 split 8 ways hold 2 padding rows;
  they used to scatter-add the update once more each into row 0."""
  m = mesh((2, 1, 4), ("p", "q", "r"))

  def f(x1, x2, x3, x4):
    v4 = gshard.shard(jnp.log(x1), P(("r", "p"), "q"))
    v5 = v4 - x2
    v6 = jnp.einsum("abc,ebg->aceg", v5, v4)
    return v6, v5.at[:, x3].add(x4)

  x1 = np.abs(np.random.default_rng(0).standard_normal((2, 6, 2))).astype(np.float32) + 0.5
  args = (x1, np.float32(-0.25), np.array([5, -5, -4, -5, -5, 5], np.int32), np.float32(-0.25))
  specs = (P(("q", "p")), None, P(("r", "p")), None)
  _same(gshard.partition(f, m, in_specs=specs)(*args), jax.jit(f)(*args), "scatter")


_SPECIAL = [0.0, -0.0, 1.0, -2.0, 3.0, np.inf, -np.inf, np.nan]


@settings(max_examples=30, deadline=None)
@given(op=st.sampled_from(["x*y", "y*x", "x*c", "c*x", "x/y", "y/x", "x/c", "c/x"]),
       dtype=st.sampled_from([jnp.float32, jnp.int32]), c=st.sampled_from(_SPECIAL),
       ys=st.lists(st.sampled_from(_SPECIAL), min_size=6, max_size=6),
       a=st.lists(st.integers(-2, 2), min_size=24, max_size=24),
       pin=st.sampled_from([None, "out_specs", "annotation"]))
def test_a_pending_sum_scaled_or_divided_equals_one_device(op, dtype, c, ys, a, pin):
  """``s = sum(a, axis=2)`` over a split dim; then ``s * y``, ``s / c`` ...
  with y a tensor and c a literal, zeros, infinities and NaN among them. An
  integer quotient never takes a pending sum (it truncates: (1 + 1) / 2 is not
  1 / 2 + 1 / 2). A float product or quotient could take it, but the psum
  after it would cost the same bytes, so the sum is resolved first, as one
  device sums: equal bit for bit, the kind of every non-finite value (inf,
  not NaN, where one device's term is 0) and the sign of every zero
  included. Small integers: every order of the sums is exact. The same with
  the result pinned (``out_specs``, an annotation on it): the psum a pin makes
  at the result was not priced, so the sum went on into the product."""
  m = mesh((4,), ("x",))
  x = np.asarray(a, np.float64).reshape(2, 3, 4).astype(dtype)
  y = np.asarray(ys, np.float64).reshape(2, 3)
  if dtype == jnp.int32:
    y, c = np.where(np.isfinite(y) & (y != 0), y, 1).astype(np.int32), int(c) if (
        np.isfinite(c) and c != 0) else 3
  y = y.astype(dtype)
  div = lax.div

  def f(x, y):
    s = jnp.sum(x, axis=2)
    out = {"x*y": lambda: s * y, "y*x": lambda: y * s, "x*c": lambda: s * c,
            "c*x": lambda: c * s, "x/y": lambda: div(s, y), "y/x": lambda: div(y, s),
            "x/c": lambda: div(s, jnp.asarray(c, s.dtype)) if dtype == jnp.int32 else s / c,
            "c/x": lambda: c / s if dtype != jnp.int32 else div(jnp.asarray(c, s.dtype), s),
            }[op]()
    return gshard.replicate(out) if pin == "annotation" else out

  if dtype == jnp.int32 and op in ("y/x", "c/x"):
    x = np.where(x == 0, 1, x)      # no integer division by zero
    x[..., 1:] = 0                  # so no sum is 0 either
  got = gshard.partition(f, m, in_specs=(P(None, None, "x"), P()),
                         out_specs=P() if pin == "out_specs" else None)(x, y)
  want = jax.jit(f)(x, y)
  assert got.dtype == want.dtype
  got, want = np.asarray(got), np.asarray(want)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_a_sum_times_inf_is_inf_where_one_device_is():
  """The README's case: a device whose partial term is 0 would add 0 * inf =
  NaN were the sum passed into the product. Resolved first (the psum costs
  the same after), the values are one device's: inf, -inf and NaN (0 * inf)
  where jax has them."""
  m = mesh((4,), ("x",))
  x = np.zeros((3, 8), np.float32)
  x[0, 0], x[1, 7], x[2, 0], x[2, 7] = 1.0, -1.0, 1.0, -1.0   # sums 1, -1, 0
  f = lambda x: jnp.sum(x, axis=1) * jnp.inf
  got = gshard.partition(f, m, in_specs=(P(None, "x"),))(x)
  want = jax.jit(f)(x)
  np.testing.assert_array_equal(np.asarray(want), [np.inf, -np.inf, np.nan])
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_pending_sum_convolved_with_inf_is_non_finite_where_one_device_is():
  """``conv(x @ a, w)`` with the first contraction split: its sum stays pending
  into the convolution (linear in its input; halos carry partial sums), so
  where w holds inf a device whose partial term is 0 adds NaN. The README
  states it: the non-finite positions are those of one device (the kind may be
  NaN for +-inf); replicating the sum first gives jax's values. A dot does not
  take a pending operand, so ``(x @ a) @ w`` is exact."""
  m = mesh((2, 4), ("a", "b"))
  x = np.zeros((2, 16, 8), np.float32)
  x[0, :, 0], x[1, :, 0], x[1, :, 1] = 1.0, 1.0, -2.0
  a = np.ones((8, 6), np.float32)
  w = np.zeros((3, 6, 1), np.float32)
  w[1, 0, 0], w[1, 1, 0] = np.inf, 1.0
  specs = (P(None, "a", "b"), P("b"), P())
  dn = ("NWC", "WIO", "NWC")

  def conv(y, w):
    return lax.conv_general_dilated(y, w, (1,), "SAME", dimension_numbers=dn)

  f = lambda x, a, w: conv(jnp.einsum("nlc,cd->nld", x, a), w)
  want = np.asarray(jax.jit(f)(x, a, w))
  got = np.asarray(gshard.partition(f, m, in_specs=specs)(x, a, w))
  assert not np.isfinite(want).all()
  np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
  np.testing.assert_array_equal(np.where(np.isfinite(want), got, 0),
                                np.where(np.isfinite(want), want, 0))
  fixed = gshard.partition(lambda x, a, w: conv(gshard.replicate(jnp.einsum(
      "nlc,cd->nld", x, a)), w), m, in_specs=specs)
  np.testing.assert_array_equal(np.asarray(fixed(x, a, w)), want)
  g = lambda x, a, w2: (x @ a) @ w2
  w2 = np.array([[np.inf, 0.0]] + [[0.0, 1.0]] * 5, np.float32)
  np.testing.assert_array_equal(
      np.asarray(gshard.partition(g, m, in_specs=specs)(x, a, w2)),
      np.asarray(jax.jit(g)(x, a, w2)))


@settings(max_examples=30, deadline=None)
@given(other=st.sampled_from(["0.0 literal", "jnp.zeros", "zeros via jit", "pending",
                              "1.0 literal", "y"]),
       dtype=st.sampled_from([jnp.float32, jnp.int32]), scalar_mask=st.booleans(),
       ys=st.lists(st.sampled_from(_SPECIAL), min_size=6, max_size=6),
       a=st.lists(st.integers(-2, 2), min_size=24, max_size=24),
       bits=st.lists(st.booleans(), min_size=6, max_size=6))
def test_a_pending_sum_selected_equals_one_device(other, dtype, scalar_mask, ys, a, bits):
  """``s = sum(x, axis=2)`` over a split dim is pending; ``where(m, s, o)``
  with ``o`` a zero (a literal, ``jnp.zeros``, one passed into a jit: each
  device picks its term or 0, and the terms sum to the select of the sum),
  another pending sum, or a non-zero (resolved first), ``m`` a complete mask
  or a scalar; then summed over an unsplit dim, so the select is where the
  sum stays pending. Equal to one device bit for bit, NaN and infinities in
  ``y`` included; for floats the gradient of the sum of squares too (jax
  transposes the select into one of the cotangent and zeros)."""
  m = mesh((4,), ("x",))
  x = np.asarray(a, np.float64).reshape(2, 3, 4).astype(dtype)
  y = np.asarray(ys, np.float64).reshape(2, 3)
  if dtype == jnp.int32:
    y = np.where(np.isfinite(y), y, 7)
  y = y.astype(dtype)
  mask = np.asarray(bits).reshape(2, 3)
  zero_jit = jax.jit(lambda s: jnp.zeros_like(s))

  def f(x, y, mask):
    s = jnp.sum(x, axis=2)
    o = {"0.0 literal": lambda: 0, "jnp.zeros": lambda: jnp.zeros(s.shape, s.dtype),
         "zeros via jit": lambda: zero_jit(s), "pending": lambda: jnp.sum(x * 2, axis=2),
         "1.0 literal": lambda: 1, "y": lambda: y}[other]()
    return jnp.sum(jnp.where(mask[0, 0] if scalar_mask else mask, s, o), axis=1)

  specs = (P(None, None, "x"), P(), P())
  got = gshard.partition(f, m, in_specs=specs)(x, y, mask)
  want = jax.jit(f)(x, y, mask)
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  if dtype == jnp.float32 and other != "y":
    g = jax.grad(lambda x, y, mask: jnp.sum(f(x, y, mask) ** 2))
    np.testing.assert_array_equal(
        np.asarray(gshard.partition(g, m, in_specs=specs)(x, y, mask)),
        np.asarray(jax.jit(g)(x, y, mask)))


def test_a_masked_sum_is_summed_after_its_select():
  """``where(m, x @ w, 0)`` then a sum over the rows: the select passes the
  contraction's pending sum, so one psum of the reduced vector (16 B) runs
  where a psum of the selected matrix (128 B) ran."""
  m = mesh((4,), ("x",))
  f = lambda x, w, mask: jnp.sum(jnp.where(mask, x @ w, 0.0), axis=0)
  args = (np.ones((8, 16), np.float32), np.ones((16, 4), np.float32),
          np.arange(32).reshape(8, 4) % 3 == 0)
  low = gshard.partition(f, m, in_specs=(P(None, "x"), P("x"), P())).lower(*args)
  assert [(c.kind, c.primitive) for c in low.collectives()] == [("psum", "reduce_sum")]
  assert low.total_bytes() == 2 * 3 * 16 // 4, low.explain()
