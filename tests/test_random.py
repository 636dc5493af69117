"""``jax.random`` inside a partitioned function: the same values as on one device.

Each device draws only its block of a split ``random_bits`` / ``random_split``
(threefry counters with per-device offsets, ``partition/random.py``); other
PRNG implementations draw the whole array and keep their block. Values are
compared bit for bit with ``jax.jit`` of the unpartitioned function, for old
(``jax.random.PRNGKey``, uint32 data) and new (``jax.random.key``) keys, on 1-D
and 2-D meshes. Every test runs with ``strict=True``: none of these primitives
may take the safe path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import gshard
from gshard.spmd.partition.random import flat_counters, mul_wide
from gshard.spmd.registry import sharding_rule
from helpers_partition import assert_trees_close, mesh

S = jax.ShapeDtypeStruct
MESH_2D = ((2, 4), ("data", "model"))
MESH_1D = ((8,), ("data",))


def partitioned(fn, mesh_def=MESH_2D, **kw):
  return gshard.partition(fn, mesh(*mesh_def), strict=True, **kw)


def assert_bit_equal(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = np.asarray(g), np.asarray(w)
    assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
    assert np.array_equal(g, w), f"{np.sum(g != w)} of {g.size} elements differ"


# -- the counters ----------------------------------------------------------------

def test_mul_wide_matches_uint64():
  x = np.random.default_rng(0).integers(0, 2 ** 32, 4096, dtype=np.uint64)
  for c in (0, 1, 6, 2 ** 16, 0xFFFF0001, 2 ** 32 - 1):
    hi, lo = mul_wide(jnp.asarray(x.astype(np.uint32)), c)
    got = (np.asarray(hi).astype(object) << 32) + np.asarray(lo).astype(object)
    assert (got == x.astype(object) * c).all(), c


def test_flat_counters_equal_jax_iota_2x32():
  from jax._src.random.prng import iota_2x32_shape
  for shape in [(5,), (6, 10), (2, 3, 4)]:
    assert_bit_equal(flat_counters(shape, shape, [0] * len(shape)),
                     tuple(iota_2x32_shape(shape)))


@pytest.mark.parametrize("offsets", [(0, 0, 0, 0), (0, 4 * 12345, 8 * 777, 0),
                                     (0, 2 ** 20 - 4, 2 ** 13 - 8, 0)])
def test_flat_counters_past_2_to_32(offsets):
  """A block of a global array of 2**35 elements: 64-bit indices, hi word set."""
  global_shape, local = (3, 2 ** 20, 2 ** 13, 5), (3, 4, 8, 5)
  hi, lo = jax.jit(lambda o: flat_counters(local, global_shape, o))(
      jnp.asarray(offsets, jnp.uint32))
  idx = np.indices(local).astype(object)
  strides = [int(np.prod(global_shape[d + 1:], dtype=object)) for d in range(4)]
  want = sum((idx[d] + offsets[d]) * strides[d] for d in range(4))
  got = (np.asarray(hi).astype(object) << 32) + np.asarray(lo).astype(object)
  assert (got == want).all()


# -- sharding rules: golden rows -------------------------------------------------

def _rule(fn, args, prim):
  eqns = [e for e in _all_eqns(jax.make_jaxpr(fn)(*args).jaxpr)
          if e.primitive.name == prim]
  assert eqns, prim
  e = eqns[0]
  return str(sharding_rule(prim)([v.aval for v in e.invars], [v.aval for v in e.outvars],
                                  **e.params))


def _all_eqns(jaxpr):
  from gshard.spmd.graph import sub_jaxprs
  for e in jaxpr.eqns:
    yield e
    for _, j in sub_jaxprs(e.params):
      yield from _all_eqns(j)


KEY = S((), jax.random.key(0).dtype)
GOLDEN = [
    (lambda k: jax.random.bits(k, (8, 16)), [KEY], "random_bits", "->ab"),
    (jax.vmap(lambda k: jax.random.bits(k, (8, 16))), [S((2,), KEY.dtype)], "random_bits",
     "a->abc"),
    (lambda k: jax.random.split(k, 4), [KEY], "random_split", "->a"),
    (lambda d: jax.random.wrap_key_data(d), [S((4, 2), jnp.uint32)], "random_wrap",
     "aZ->a blocked={Z}"),
    (lambda k: jax.random.key_data(k), [S((4,), KEY.dtype)], "random_unwrap",
     "a->aZ blocked={Z}"),
    (lambda k, m: jax.random.fold_in(k, m), [KEY, S((), jnp.uint32)], "random_fold_in",
     ",->"),
    (lambda x: jax.lax.bitcast_convert_type(x, jnp.uint32), [S((8, 4), jnp.float32)],
     "bitcast_convert_type", "ab->ab"),
    (lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8), [S((8,), jnp.float32)],
     "bitcast_convert_type", "a->aZ blocked={Z}"),
    (lambda x: jax.lax.bitcast_convert_type(x, jnp.float32), [S((8, 4), jnp.uint8)],
     "bitcast_convert_type", "aZ->a blocked={Z}"),
    (lambda k, a: jax.random.gamma(k, a), [KEY, S((2, 8), jnp.float32)], "random_gamma",
     ",ab->ab"),
]


@pytest.mark.parametrize("fn,args,prim,want", GOLDEN, ids=[g[2] + str(i)
                                                          for i, g in enumerate(GOLDEN)])
def test_golden_rule(fn, args, prim, want):
  assert _rule(fn, args, prim) == want


def test_key_data_dim_is_never_split():
  """Key data annotated as split over its key-data dim is gathered before wrapping."""
  def f(data):
    data = gshard.shard(data, P(None, "data"))
    keys = jax.random.wrap_key_data(data)
    return jax.vmap(lambda k: jax.random.normal(k, (8,)))(keys)
  data = jax.random.key_data(jax.random.split(jax.random.key(0), 4))
  step = gshard.partition(f, mesh(*MESH_2D), in_specs=P(None, "data"), strict=True)
  assert_bit_equal(step(data), jax.jit(f)(data))
  (c,) = step.lower(data).collectives()
  assert (c.kind, c.primitive, c.axes) == ("all_gather", "random_wrap", ("data",))


# -- partitioned values: bit-exact ----------------------------------------------

SPEC_2D, SPEC_1D = P("data", "model"), P("data", None)


def _dropout(key, x, spec=SPEC_2D):
  x = gshard.shard(x, spec)
  keep = jax.random.bernoulli(key, 0.8, x.shape)
  return jnp.where(keep, x / 0.8, 0.0)


def _normal_uniform(key, x, spec=SPEC_2D):
  x = gshard.shard(x, spec)
  k1, k2 = jax.random.split(key)
  return (x + jax.random.normal(k1, x.shape),
          jax.random.uniform(jax.random.fold_in(k2, 7), x.shape, minval=-1.0))


def _bits_3d(key, x, spec=SPEC_2D):
  b = jax.random.bits(key, (4,) + x.shape, jnp.uint8)
  return gshard.shard(b, P(None, *spec)), jax.random.randint(key, x.shape, 0, 1000)


def _per_example_keys(key, x, spec=SPEC_2D):
  """``vmap`` over keys split per row: the keys follow the batch split."""
  x = gshard.shard(x, spec)
  keys = jax.random.split(key, x.shape[0])
  return jax.vmap(lambda k, r: jax.random.bernoulli(k, 0.5, r.shape) * r)(keys, x)


def _split_keys(key, x, spec=SPEC_2D):
  keys = jax.random.split(key, x.shape)
  return gshard.shard(jax.random.key_data(keys), P(*spec, None))


SAMPLERS = {"dropout": _dropout, "normal_uniform": _normal_uniform, "bits_3d": _bits_3d,
            "per_example_keys": _per_example_keys, "split_keys": _split_keys}
KEYS = {   # old-style uint32 key data, new-style typed key
    "PRNGKey": lambda f, spec: lambda seed, x: f(jax.random.PRNGKey(seed), x, spec),
    "key": lambda f, spec: lambda seed, x: f(jax.random.key(seed), x, spec),
}


@pytest.mark.parametrize("mesh_def", [MESH_2D, MESH_1D], ids=["2x4", "8"])
@pytest.mark.parametrize("key_kind", sorted(KEYS))
@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
def test_same_bits_as_one_device(mesh_def, key_kind, sampler, shape=(16, 24)):
  fn = KEYS[key_kind](SAMPLERS[sampler], SPEC_2D if mesh_def == MESH_2D else SPEC_1D)
  x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
  assert_bit_equal(partitioned(fn, mesh_def)(11, x), jax.jit(fn)(11, x))


def test_old_style_key_argument():
  x = jnp.ones((8, 16))
  key = jax.random.PRNGKey(3)
  assert_bit_equal(partitioned(_normal_uniform)(key, x), jax.jit(_normal_uniform)(key, x))


def test_new_style_key_argument():
  x = jnp.ones((8, 16))
  key = jax.random.key(3)
  assert_bit_equal(partitioned(_normal_uniform)(key, x), jax.jit(_normal_uniform)(key, x))


def test_only_the_local_block_is_drawn():
  """The per-device program hashes a 4x4 block of counters and sends nothing."""
  fn = KEYS["PRNGKey"](_dropout, SPEC_2D)
  lowered = partitioned(fn).lower(0, jnp.ones((8, 16)))
  assert _threefry_shapes(lowered) == [(4, 4)]
  assert "random_bits" not in lowered.as_text("jaxpr")
  assert lowered.collectives() == []


def _threefry_shapes(lowered):
  jaxpr = lowered.per_device_jaxpr()
  return [tuple(e.outvars[0].aval.shape) for e in _all_eqns(jaxpr)
          if e.primitive.name == "threefry2x32"]


@pytest.mark.parametrize("impl", ["rbg", "unsafe_rbg"])
def test_other_prng_impls_draw_whole_and_slice(impl):
  def fn(seed, x):
    return _dropout(jax.random.key(seed, impl=impl), x)
  x = jnp.ones((8, 16))
  step = partitioned(fn)
  assert_bit_equal(step(5, x), jax.jit(fn)(5, x))
  lowered = step.lower(5, x)
  assert "random_bits" in lowered.as_text("jaxpr")
  assert lowered.collectives() == []


def test_threefry_partitionable_off_draws_whole():
  fn = KEYS["key"](_normal_uniform, SPEC_2D)
  x = jnp.ones((8, 16))
  with jax.threefry_partitionable(False):
    step = partitioned(fn)
    assert_bit_equal(step(5, x), jax.jit(fn)(5, x))
    assert "random_bits" in step.lower(5, x).as_text("jaxpr")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_uniform_float_dtypes(dtype):
  def fn(seed):
    u = jax.random.uniform(jax.random.key(seed), (8, 16), dtype)
    return gshard.shard(u, P("model", "data"))
  assert_bit_equal(partitioned(fn)(1), jax.jit(fn)(1))


def test_uneven_split_still_exact():
  def fn(seed):
    x = jax.random.normal(jax.random.key(seed), (6, 10))
    return gshard.shard(x, P("data", "model"))
  assert_bit_equal(partitioned(fn)(2), jax.jit(fn)(2))


def test_gamma_and_friends():
  def fn(seed, a):
    a = gshard.shard(a, P("data", "model"))
    k = jax.random.key(seed)
    return (jax.random.gamma(k, a), jax.random.truncated_normal(k, -1.0, 1.0, a.shape),
            jax.random.categorical(k, jnp.zeros(a.shape + (5,))))
  a = jnp.linspace(0.5, 3.0, 128).reshape(8, 16)
  assert_bit_equal(partitioned(fn)(4, a), jax.jit(fn)(4, a))


def test_key_carried_through_scan():
  """A layer stack that splits its key each layer: keys are loop carries."""
  def fn(seed, x):
    x = gshard.shard(x, P("data", "model"))

    def layer(carry, _):
      h, key = carry
      key, sub = jax.random.split(key)
      keep = jax.random.bernoulli(sub, 0.9, h.shape)
      return (jnp.where(keep, jnp.tanh(h), 0.0), key), None
    (h, _), _ = jax.lax.scan(layer, (x, jax.random.key(seed)), None, length=3)
    return h
  x = jnp.linspace(-2, 2, 128).reshape(8, 16)
  assert_bit_equal(partitioned(fn)(9, x), jax.jit(fn)(9, x))


# -- a dropout MLP trained: masks bit-exact, losses and weights to f32 rounding ----

def _mlp_step(params, seed, x, y, spec=SPEC_2D):
  def loss_fn(params, key):
    h = jax.nn.relu(gshard.split(x, 0, "data") @ params["w1"])
    h = gshard.shard(h, spec)
    k1, k2 = jax.random.split(key)
    keep = jax.random.bernoulli(k1, 0.75, h.shape)
    h = jnp.where(keep, h / 0.75, 0.0)
    out = h @ params["w2"]
    out = out * (1.0 + 0.1 * jax.random.normal(k2, out.shape))
    return jnp.mean((out - y) ** 2), keep
  key = jax.random.fold_in(jax.random.key(0), seed)
  (loss, keep), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, key)
  params = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
  return params, loss, keep


@pytest.mark.parametrize("mesh_def", [MESH_2D, MESH_1D], ids=["2x4", "8"])
def test_dropout_mlp_grads_match_one_device(mesh_def):
  k = jax.random.split(jax.random.key(1), 4)
  params = {"w1": jax.random.normal(k[0], (32, 64)) / 32 ** 0.5,
            "w2": jax.random.normal(k[1], (64, 32)) / 8.0}
  x = jax.random.normal(k[2], (16, 32))
  y = jax.random.normal(k[3], (16, 32))
  specs = ({"w1": P(None, "model"), "w2": P("model", None)} if mesh_def == MESH_2D
           else {"w1": P(), "w2": P()})
  fn = functools.partial(_mlp_step, spec=SPEC_2D if mesh_def == MESH_2D else SPEC_1D)
  step = partitioned(fn, mesh_def, in_specs=(specs, None, None, None))
  ref = jax.jit(fn)
  p_got = p_want = params
  for seed in range(4):
    p_got, loss_got, keep_got = step(p_got, seed, x, y)
    p_want, loss_want, keep_want = ref(p_want, seed, x, y)
    assert_bit_equal(keep_got, keep_want)
    assert_trees_close((p_got, loss_got), (p_want, loss_want), rtol=1e-5, atol=1e-6,
                       what=f"step {seed}")


# -- typed key arrays held split: moved as their key data --------------------------

def _draw(ks):
  return jax.vmap(lambda k: jax.random.normal(k, (3,)))(ks.reshape(-1))


KEY_PROGRAMS = {
    # name: f(keys [n, m], ints [n]) -> floats or keys
    "draw": lambda ks, i: _draw(ks),
    "lookup in a split table": lambda ks, i: _draw(ks[i % ks.shape[0]]),
    "transpose and reshape": lambda ks, i: _draw(ks.T.reshape(-1)),
    "concatenate": lambda ks, i: jax.random.key_data(jnp.concatenate([ks, ks[::-1]])),
    "where": lambda ks, i: jax.random.key_data(jnp.where((i % 2 == 0)[:, None], ks,
                                                         ks[::-1])),
    "fold_in": lambda ks, i: _draw(jax.vmap(jax.vmap(jax.random.fold_in, (0, None)), (0, None))(
        ks, i[0])),
    "dynamic slice": lambda ks, i: _draw(jax.lax.dynamic_slice_in_dim(
        ks, i[0] % ks.shape[0], 1)),
    "split inside": lambda ks, i: _draw(gshard.split(
        jax.random.split(ks[0, 0], ks.shape[0]), 0, ("x",))),
    "returned (state)": lambda ks, i: ks,
    "returned as new keys": lambda ks, i: jax.vmap(jax.vmap(
        lambda k: jax.random.split(k)[1]))(ks),
}


@st.composite
def _key_cases(draw):
  shape, names = draw(st.sampled_from([((8,), ("x",)), ((2, 4), ("x", "y")),
                                       ((4, 2), ("x", "y"))]))
  n = draw(st.sampled_from([1, 2, 3, 5, 6, 8, 12]))
  m = draw(st.sampled_from([1, 2, 3, 4]))
  spec0 = draw(st.sampled_from([None, names[0], names[-1], names]))
  rest = [a for a in names if spec0 is None or a not in (spec0 if isinstance(spec0, tuple)
                                                         else (spec0,))]
  spec1 = draw(st.sampled_from([None] + rest))
  name = draw(st.sampled_from(sorted(KEY_PROGRAMS)))
  # rbg/unsafe_rbg: a vmapped draw reads the whole batch of keys (jax batches
  # rng_bit_generator from the batch's first key)
  impl = draw(st.sampled_from(["threefry2x32", "threefry2x32", "rbg", "unsafe_rbg"]))
  return shape, names, n, m, P(spec0, spec1), name, impl, draw(st.integers(0, 2 ** 31 - 1))


@pytest.mark.filterwarnings("error::gshard.PartitionWarning")
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_key_cases())
def test_key_arrays_split_evenly_or_not(case):
  """A ``jax.random.key`` array (threefry, rbg, unsafe_rbg) split over the
  mesh (evenly or not: the padding is key data of zeros), looked up,
  transposed, concatenated, selected, folded, drawn from and returned: keys
  and draws bit for bit as on one device. Keys move between layouts as their
  data (``u32[..., 2]``)."""
  shape, names, n, m, spec, name, impl, seed = case
  f = KEY_PROGRAMS[name]
  ks = jax.random.split(jax.random.key(seed, impl=impl), (n, m))
  i = jnp.asarray(np.random.default_rng(seed).integers(0, 100, n), jnp.int32)
  want = jax.jit(f)(ks, i)
  got = gshard.unpad(gshard.partition(f, mesh(shape, names), in_specs=(spec, P()))(ks, i))
  if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
    assert got.dtype == want.dtype
    got, want = jax.random.key_data(got), jax.random.key_data(want)
  assert_bit_equal(got, want)


def test_key_array_committed_to_one_device_split_unevenly():
  """An uneven key input committed to one device is padded there and moved;
  returned, it is a key array again (jax.random reads no PaddedArray)."""
  ks = jax.device_put(jax.random.split(jax.random.key(3), 6), jax.devices()[5])
  step = partitioned(lambda ks: ks, MESH_1D, in_specs=(P("data"),))
  got = step(ks)
  assert isinstance(got, jax.Array) and jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key)
  assert_bit_equal(jax.random.key_data(got), jax.random.key_data(ks))


@settings(max_examples=8, deadline=None)
@given(batch=st.sampled_from([6, 8, 9, 13]), impl=st.sampled_from(["threefry2x32", "rbg"]))
def test_per_example_keys_carried_as_state_come_back_as_keys(batch, impl):
  # Typed keys split unevenly came back as a PaddedArray, which jax.random
  # refuses (key_data, vmap(split): "invalid PRNG key data"); they leave the
  # program as a key array, evenly, while other uneven state stays padded.
  m = mesh((2, 4), ("data", "model"))

  def step(keys, w):
    return jax.vmap(lambda k: jax.random.split(k)[0])(keys), w * 2

  keys = jax.random.split(jax.random.key(0, impl=impl), batch)
  w = jnp.ones((batch, 8))
  p = gshard.partition(step, m, in_specs=(P("data"), P("data")))
  k, v = keys, w
  kj, vj = keys, w
  for _ in range(2):
    k, v = p(k, v)
    kj, vj = jax.jit(step)(kj, vj)
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(k)),
                                  np.asarray(jax.random.key_data(kj)))
    assert jax.vmap(jax.random.split)(k).shape == (batch, 2)
  assert isinstance(v, gshard.PaddedArray) == (batch % 2 != 0)
  assert len(p._cache) == 1
