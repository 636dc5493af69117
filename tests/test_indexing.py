"""Indexing over split dims: gathers, scatters, dynamic slices.

Values are compared with ``jax.jit`` on one device. Structure is checked twice:
in gshard's own record (``lowered.collectives()``) and in XLA's optimized HLO
(``lowered.compile().as_text()``, parsed by ``helpers_partition``):

* an embedding lookup from a vocab-split table never gathers the table (one
  psum of the looked-up rows), and its gradient (scatter-add) lands in the
  split table without gathering it;
* ``take_along_axis`` / one-hot cross-entropy over a split vocabulary;
* a KV cache split over its sequence dim: ``dynamic_update_slice`` (the write)
  needs no communication, ``dynamic_slice`` (the read) one psum of the slice;
  traced positions, including the edges of each block and positions out of
  range (jax clamps them);
* general scatters (``x.at[i].set``, ``.max``, ``.mul``) take the safe path
  with a ``PartitionWarning`` and are still exact.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import PartitionSpec as P

import gshard
from gshard.spmd.partition import plan as plan_module
from helpers_numerics import check_steps
from helpers_partition import assert_named_sharding, assert_trees_close, hlo_collectives, mesh

pytestmark = pytest.mark.filterwarnings("error::gshard.PartitionWarning")

M24 = ((2, 4), ("data", "model"))
DATA, MODEL = 2, 4


def rand(*shape, seed=0):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def kinds(low) -> set[str]:
  return {c.kind for c in low.collectives()}


def hlo_of(low):
  return hlo_collectives(low.compile().as_text(), mesh(*M24))


def eqns_of(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from eqns_of(sub)


# -- the embedding lookup ---------------------------------------------------------

# The masked-lookup tests give the table a feature dim the model axis does not
# divide: it cannot move to a feature split (the cheaper plan where it can,
# test_a_table_split_like_its_tokens_moves_to_its_feature_dim below), so its
# lookup is the vocab-split masked one.
FEAT = 18


def embed_args(vocab, d_model=FEAT, seed=0):
  rng = np.random.default_rng(seed)
  table = rng.standard_normal((vocab, d_model)).astype(np.float32)
  tokens = rng.integers(0, vocab, (8, 12)).astype(np.int32)
  block = -(-vocab // MODEL)
  tokens[0, :8] = [0, block - 1, block, 2 * block - 1, 2 * block, 3 * block - 1, 3 * block,
                   vocab - 1]                 # both edges of every block
  return table, tokens


def _lookup(table, tokens):
  return jnp.tanh(table[tokens])


@pytest.mark.parametrize("vocab", [64, 50])
def test_vocab_split_embedding_never_gathers_the_table(vocab):
  m = mesh(*M24)
  table, tokens = embed_args(vocab)
  step = gshard.partition(_lookup, m, in_specs=(P("model"), P("data")))
  out = step(table, tokens)
  np.testing.assert_allclose(np.asarray(out), np.tanh(table[tokens]), rtol=1e-6, atol=1e-6)
  low = step.lower(table, tokens)
  # gshard's record: one psum over model of the looked-up rows, nothing else
  cols = low.collectives()
  assert [(c.kind, c.axes, c.primitive) for c in cols] == [("psum", ("model",), "gather")]
  assert cols[0].shape == (8, 12, FEAT)
  # the per-device program looks up in its own block of the table
  (gather,) = [e for e in eqns_of(low.per_device_jaxpr()) if e.primitive.name == "gather"]
  assert gather.invars[0].aval.shape == (-(-vocab // MODEL), FEAT)
  # XLA's program: no all-gather; all-reduces over model of at most the local rows
  hlo = hlo_of(low)
  assert hlo and not [c for c in hlo if c.kind == "all-gather"], hlo
  local_rows = (8 // DATA) * 12 * FEAT * 4
  assert all(c.kind == "all-reduce" and c.axes == ("model",) for c in hlo), hlo
  assert sum(c.nbytes for c in hlo) == local_rows < table.nbytes


@pytest.mark.parametrize("vocab", [64, 50])
def test_embedding_gradient_scatter_adds_into_the_split_table(vocab):
  m = mesh(*M24)
  table, tokens = embed_args(vocab, seed=1)
  w = rand(8, 12, FEAT, seed=2)
  grad = jax.grad(lambda t, k: jnp.sum(_lookup(t, k) * w))
  step = gshard.partition(grad, m, in_specs=(P("model"), P("data")), out_specs=P("model"))
  out = step(table, tokens)
  assert out.shape == table.shape
  np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(grad)(table, tokens)),
                             rtol=1e-5, atol=1e-5)
  low = step.lower(table, tokens)
  local = (-(-vocab // MODEL), FEAT)
  scatters = [e for e in eqns_of(low.per_device_jaxpr()) if e.primitive.name == "scatter-add"]
  # into each device's block as it is: the updates of the others' rows are
  # sent out of bounds and dropped (no padded copy of the block)
  assert scatters and all(e.outvars[0].aval.shape == local for e in scatters)
  # the only collectives: the lookup's psum and the data-parallel sum of each
  # device's block of the gradient; the table itself never moves
  cols = low.collectives()
  assert "all_gather" not in kinds(low), low.explain()
  grad_sums = [c for c in cols if c.primitive == "scatter-add"]
  assert [(c.kind, c.axes) for c in grad_sums] == [("psum", ("data",))]
  hlo = hlo_of(low)
  gathers = [c for c in hlo if c.kind == "all-gather"]
  if vocab % MODEL == 0:
    assert not gathers, hlo
  else:
    # jax arrays hold only even layouts: the 50-row gradient leaves the program
    # replicated, so the padded table is gathered once, at the output only
    padded = (local[0] * MODEL, FEAT)
    assert all(c.shapes == (("f32", padded),) for c in gathers), hlo
  table_sums = [(c.axes, s) for c in hlo if c.kind == "all-reduce"
                for _, s in c.shapes if len(s) == 2]
  assert table_sums == [(("data",), local)], hlo


def test_embedding_sgd_step_keeps_the_table_split():
  """A whole step (lookup, loss, gradient, update): the updated table comes
  out vocab-split, no all-gather anywhere."""
  m = mesh(*M24)
  table, tokens = embed_args(50, seed=3)
  w = rand(8, 12, FEAT, seed=4)

  def step_fn(t, k):
    loss, g = jax.value_and_grad(lambda t: jnp.mean((_lookup(t, k) - w) ** 2))(t)
    return t - 0.3 * g, loss

  step = gshard.partition(step_fn, m, in_specs=(P("model"), P("data")),
                          out_specs=(P("model"), P()))
  # against a float64 run, within the bound the 1-device f32 run's error gives
  # (helpers_numerics); the longest sum is the loss's mean over w's elements
  check_steps(step, jax.jit(step_fn), jax.jit(step_fn), (table,), (tokens,), n=w.size)
  assert "all_gather" not in kinds(step.lower(table, tokens))


def _small_ints(rng, shape, dtype, low=-3, high=4):
  """Small integers: every product and sum below is exact in f32, so a
  partitioned run must equal one device's bit for bit, in any order."""
  return rng.integers(low, high, shape).astype(dtype)


def test_a_table_split_like_its_tokens_moves_to_its_feature_dim():
  """FSDP: the table split on its vocabulary over ``data``, like the batch of
  its tokens. Gathering the table for the lookup sends 7/8 of it, and
  reduce-scattering its gradient the same again; moving the table to a
  feature split (an all-to-all of 1/8 of it) and gathering the small int32
  tokens sends less. The looked-up rows stay feature split: what reads them
  (``w * rows ** 2`` and its sum, ``w`` a constant every device holds whole)
  is laid out where they are made (``spmd/readers.py``), where before they
  were moved to the batch split and their gradient back (two all-to-alls of
  1344 B). The gradient is the mirror image. explain() lists the
  alternatives with their bytes."""
  m = mesh((8,), ("data",))
  rng = np.random.default_rng(0)
  table = _small_ints(rng, (64, 16), np.float32)
  tokens = rng.integers(0, 64, (16, 12)).astype(np.int32)
  w = _small_ints(rng, (16, 12, 16), np.float32, -2, 3)
  fn = jax.value_and_grad(lambda t, k: jnp.sum(w * t[k] ** 2))
  step = gshard.partition(fn, m, in_specs=(P("data"), P("data")), out_specs=(P(), P("data")))
  for got, want in zip(step(table, tokens), jax.jit(fn)(table, tokens)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  low = step.lower(table, tokens)
  moves = {(c.primitive, c.role): (c.kind, c.bytes) for c in low.collectives()
           if c.primitive in ("gather", "scatter-add")}
  table_block = table.nbytes // 8
  assert moves == {
      ("gather", "operand 0"): ("all_to_all", 7 * table_block // 8),
      ("gather", "operand 1"): ("all_gather", 7 * tokens.nbytes // 8),
      ("scatter-add", "result 0"): ("all_to_all", 7 * table_block // 8),
  }, low.explain()
  # one choice per equation with options, its operands as they arrive (the
  # scatter-add, its rows' gradient arriving feature split, has one plan left)
  assert sorted(c.primitive for c in low.choices()) == ["gather"], low.explain()
  (lookup,) = [c for c in low.choices() if c.primitive == "gather"]
  assert lookup.signature.startswith("f32[64@data,16] x i32[16@data,12,1]"), lookup
  gather_table = 7 * table.nbytes // 8
  assert lookup.chosen.bytes == sum(b for (p, _), (_, b) in moves.items() if p == "gather")
  assert lookup.chosen.bytes < gather_table
  # gathering the table instead (its rows then moved to the feature split)
  gathering = [o for o in lookup.options if not o.chosen and
               ("operand 0", "all_gather[data]") in o.moves]
  assert len(gathering) == 1 and gathering[0].bytes >= gather_table, lookup
  assert "contractions and lookups:" in low.explain()


@pytest.mark.parametrize("summed", [False, True], ids=["rows", "summed"])
def test_a_lookup_whose_sum_passes_on_is_weighed_where_it_is_resolved(summed):
  """Flax's ``nn.Embed`` looks up inside a jit: the pending sum of a lookup
  from a vocab-split table passes out of the jit and is resolved after it.
  Weighed by that psum (an all-reduce of the looked-up rows), moving the
  table to a feature split first (an all-to-all of its block) and gathering
  the rows sends less: that plan runs. Summed over the features first, the
  sum is resolved on [B, T] only, which is cheaper than any move: the
  masked lookup runs."""
  m = mesh(*M24)
  rng = np.random.default_rng(0)
  table = _small_ints(rng, (64, 32), np.float32)
  tokens = rng.integers(0, 64, (8, 16)).astype(np.int32)
  embed = jax.jit(lambda t, k: jnp.take(t, k, axis=0))
  fn = (lambda t, k: jnp.tanh(embed(t, k).sum(-1))) if summed else (
      lambda t, k: jnp.tanh(embed(t, k)))
  step = gshard.partition(fn, m, in_specs=(P("model"), P("data")))
  np.testing.assert_array_equal(np.asarray(step(table, tokens)),
                                np.asarray(jax.jit(fn)(table, tokens)))
  low = step.lower(table, tokens)
  (lookup,) = low.choices()
  rows_block = 4 * 16 * 32 * 4                      # f32[8@data,16,32] per device
  masked = [o for o in lookup.options if o.label.startswith("(b)")]
  moved = [o for o in lookup.options if o.moves[:1] == (("operand 0", "all_to_all[model]"),)]
  assert len(masked) == 1 and len(moved) == 1, low.explain()
  if summed:
    assert masked[0].chosen and masked[0].bytes == 2 * 3 * (4 * 16 * 4) // 4, low.explain()
    assert {c.kind for c in low.collectives()} == {"psum"}, low.explain()
    return
  # the masked lookup's psum of the rows, listed where it is resolved
  assert masked[0].moves == (("result 0", "psum[model] downstream"),), low.explain()
  assert masked[0].bytes == 2 * 3 * rows_block // 4
  assert moved[0].chosen and moved[0].bytes < masked[0].bytes, low.explain()
  sent = {(c.kind, c.role): c.bytes for c in low.collectives()}
  assert sent == {("all_to_all", "operand 0"): 3 * (16 * 32 * 4) // 4,
                  ("all_gather", "result 0"): 3 * rows_block // 4}, low.explain()
  assert moved[0].bytes == low.total_bytes()


@pytest.mark.parametrize("other", ["contraction", "lookup"])
def test_a_lookup_sharing_its_downstream_sum_is_not_credited_with_anothers(other):
  """A lookup's pending rows are added to another pending sum (a contraction
  split on its contracted dim, or a lookup from a large table, which stays
  masked) that has a psum of its own elsewhere. Were the rows complete, that
  other sum would be resolved at the add instead, but the partitioner keeps
  it pending there and pays both psums either way: the move saves nothing
  and is not run. Values are jax.jit's; bytes no more than with no move."""
  m = mesh(*M24)
  rng = np.random.default_rng(3)
  table = _small_ints(rng, (64, 32), np.float32)
  big = _small_ints(rng, (4096, 32), np.float32)
  tokens = rng.integers(0, 64, (8, 16)).astype(np.int32)
  x, w = _small_ints(rng, (8, 16, 24), np.float32), _small_ints(rng, (24, 32), np.float32)
  embed = jax.jit(lambda t, k: jnp.take(t, k, axis=0))
  relu = lambda v: jnp.maximum(v, 0.0)
  if other == "contraction":
    def fn(t, k, x, w):
      v = x @ w     # kept pending: its other use sums it over d first (a smaller psum)
      return relu(embed(t, k) + v), relu(jnp.sum(v * 2.0, -1))
    args, specs = (table, tokens, x, w), (P("model"), P("data"), P("data", None, "model"),
                                          P("model"))
  else:
    def fn(t, k, b):
      v = embed(b, k)
      return relu(embed(t, k) + v), relu(v * 2.0)
    args, specs = (table, tokens, big), (P("model"), P("data"), P("model"))
  step = gshard.partition(fn, m, in_specs=specs)
  for a, b in zip(step(*args), jax.jit(fn)(*args)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  low = step.lower(*args)
  with _lookups_keep_their_split():
    kept = gshard.partition(fn, m, in_specs=specs).lower(*args)
  assert low.total_bytes() <= kept.total_bytes(), (low.explain(), kept.explain())
  assert {c.kind for c in low.collectives()} == {"psum"}, low.explain()


def test_a_data_parallel_table_gradient_stays_one_all_reduce():
  """Data parallel: the table is replicated, the tokens split over data, and
  the table's gradient (a scatter-add of the cotangent) a pending sum over
  data. Moving it to a feature split would send fewer bytes (the cotangent
  all-to-all'd, the tokens and the gradient all-gathered: three collectives)
  but it stays the one all-reduce data parallelism runs for every gradient."""
  m = mesh((8,), ("data",))
  rng = np.random.default_rng(1)
  table = _small_ints(rng, (64, 32), np.float32)
  tokens = rng.integers(0, 64, (8, 4)).astype(np.int32)
  loss = lambda t, k: jnp.sum(jnp.take(t, k, axis=0) ** 2)
  fn = jax.grad(loss)
  step = gshard.partition(fn, m, in_specs=(P(), P("data")))
  np.testing.assert_array_equal(np.asarray(step(table, tokens)),
                                np.asarray(jax.jit(fn)(table, tokens)))
  low = step.lower(table, tokens)
  grad_block = 64 * 32 * 4
  sent = [(c.kind, c.bytes) for c in low.collectives()]
  assert sent == [("psum", 2 * 7 * grad_block // 8)], low.explain()
  # what the move would send (the plan the lookup weighs when its sum is charged)
  moved = 7 * (8 * 4 * 4) // 8 + 7 * (8 * 4 * 32 * 4) // 64 + 7 * grad_block // 8
  assert moved < sent[0][1]


@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_lookup_whose_table_may_move_equals_one_device(data):
  """Random meshes, table and token splits (the same axis or not), vocabularies
  the axis divides or not, feature dims it divides or not, f32 / bf16 / int32:
  the lookup (and, for f32, its gradient) equals one device's bit for bit,
  whichever plan ran."""
  shape, names = data.draw(st.sampled_from([((8,), ("x",)), ((2, 4), ("x", "y")),
                                            ((4, 2), ("x", "y"))]), label="mesh")
  m = mesh(shape, names)
  sizes = dict(zip(names, shape))
  t_axis = data.draw(st.sampled_from(names), label="table axis")
  k_axis = data.draw(st.sampled_from([None, *names]), label="token axis")
  n = sizes[t_axis]
  vocab = data.draw(st.integers(n, 6 * n), label="vocab")
  feat = data.draw(st.sampled_from([n, 2 * n, n + 1]), label="features")
  batch = data.draw(st.sampled_from([8, 16]), label="batch")
  seq = data.draw(st.integers(1, 6), label="seq")
  dtype = data.draw(st.sampled_from([np.float32, jnp.bfloat16, np.int32]), label="dtype")
  # what reads the rows: the square resolves the lookup's pending sum where it
  # is produced; through a jit (flax's nn.Embed) or a sum over the features
  # the sum passes on and is resolved downstream (smaller, after the sum)
  look = data.draw(st.sampled_from(["square", "jit", "sum"]), label="consumer")
  rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
  table = _small_ints(rng, (vocab, feat), dtype)
  tokens = rng.integers(0, vocab, (batch, seq)).astype(np.int32)
  specs = (P(t_axis), P(k_axis))
  rows = {"square": lambda t, k: t[k], "jit": jax.jit(lambda t, k: t[k]),
          "sum": lambda t, k: t[k].sum(-1)}[look]
  if dtype == np.float32:
    w = _small_ints(rng, (batch, seq, feat)[:3 - (look == "sum")], dtype, -2, 3)
    fn = jax.value_and_grad(lambda t, k: jnp.sum(w * rows(t, k) ** 2))
  else:
    def fn(t, k):
      r = rows(t, k)     # one lookup (two would share the table's moves)
      return r * r       # the square resolves the lookup
  step = gshard.partition(fn, m, in_specs=specs)
  got, want = gshard.unpad(step(table, tokens)), jax.jit(fn)(table, tokens)
  for g, x in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(g, np.float64), np.asarray(x, np.float64))
  low = step.lower(table, tokens)
  assert not low.fallbacks
  # the plan run is the cheapest of those explain() lists for each lookup
  for choice in low.choices():
    assert choice.chosen.bytes == min(o.bytes for o in choice.options
                                       if o.chosen or not o.memory), choice
  # and weighing a pending sum by what it costs downstream never makes the
  # whole program send more than keeping the sum pending would
  with _lookups_keep_their_split():
    kept = gshard.partition(fn, m, in_specs=specs).lower(table, tokens)
  assert low.total_bytes() <= kept.total_bytes(), (low.explain(), kept.explain())


@contextlib.contextmanager
def _lookups_keep_their_split():
  """Plans with no lookup moving its table's split first (the comparison)."""
  relocations = plan_module._relocations
  plan_module._relocations = lambda *args: iter(())
  plan_module._plan_memo.cache_clear()
  try:
    yield
  finally:
    plan_module._relocations = relocations
    plan_module._plan_memo.cache_clear()


# -- cross-entropy over a split vocabulary --------------------------------------------

def _xent_take(logits, targets):
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def _xent_one_hot(logits, targets):
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.sum(jax.nn.one_hot(targets, logits.shape[-1]) * logp, axis=-1)


@pytest.mark.parametrize("fn", [_xent_take, _xent_one_hot], ids=["take_along_axis",
                                                                  "one_hot"])
@pytest.mark.parametrize("vocab", [32, 50])
def test_cross_entropy_over_split_vocab(fn, vocab):
  m = mesh(*M24)
  logits = rand(8, 4, vocab, seed=5) * 3.0
  targets = np.random.default_rng(6).integers(0, vocab, (8, 4)).astype(np.int32)
  block = -(-vocab // MODEL)
  targets[0] = [0, block - 1, block, vocab - 1]
  spec = (P("data", None, "model"), P("data"))
  step = gshard.partition(fn, m, in_specs=spec)
  np.testing.assert_allclose(np.asarray(step(logits, targets)),
                             np.asarray(jax.jit(fn)(logits, targets)), rtol=1e-5, atol=1e-5)
  low = step.lower(logits, targets)
  assert "all_gather" not in kinds(low), low.explain()
  # only [B, T]-sized reductions cross devices: the logits never do
  assert all(math.prod(c.shape) <= 8 * 4 for c in low.collectives()), low.explain()
  grad = jax.value_and_grad(lambda lg, t: jnp.sum(fn(lg, t)))
  gstep = gshard.partition(grad, m, in_specs=spec, out_specs=(P(), P("data", None, "model")))
  out = gstep(logits, targets)
  assert_trees_close(out, jax.jit(grad)(logits, targets), rtol=1e-5, atol=1e-5)
  assert "all_gather" not in kinds(gstep.lower(logits, targets))


# -- dynamic_slice / dynamic_update_slice: a KV cache --------------------------------

B, T, H, D = 2, 16, 4, 8
POSITIONS = [0, 3, 4, 7, 8, 12, 13, 15, 16, 100, -1, -5]   # block edges, out of range


def _write(cache, new, pos):
  return lax.dynamic_update_slice(cache, new, (0, pos, 0, 0))


def _read(cache, pos):
  return lax.dynamic_slice(cache, (0, pos, 0, 0), (B, 3, H, D))


def _write_then_read(cache, new, pos):
  cache = _write(cache, new, pos)
  return cache, lax.dynamic_slice(cache, (0, pos, 0, 0), (B, 1, H, D))


def _run_positions(fn, args, in_specs, out_specs=None, positions=POSITIONS):
  """One partitioned function, called at every position (traced: one compile)."""
  m = mesh(*M24)
  step = gshard.partition(fn, m, in_specs=in_specs + (None,), out_specs=out_specs)
  ref = jax.jit(fn)
  for pos in positions:
    assert_trees_close(step(*args, np.int32(pos)), ref(*args, np.int32(pos)), rtol=0, atol=0,
                       what=f"pos={pos}")
  assert len(step._cache) == 1
  return step.lower(*args, np.int32(0))


@pytest.mark.parametrize("seq", [16, 15], ids=["16 over 4", "15 over 4 (uneven)"])
def test_kv_cache_write_needs_no_communication(seq):
  cache, new = rand(B, seq, H, D), rand(B, 1, H, D, seed=1)
  low = _run_positions(_write, (cache, new), (P("data", "model"), P("data")),
                       out_specs=P("data", "model"))
  assert low.collectives() == [], low.explain()
  if seq % MODEL == 0:       # an uneven output is sliced back, outside the per-device program
    assert hlo_of(low) == []
  # each device writes into its own block of the cache
  assert low.per_device_jaxpr().outvars[0].aval.shape == (B // DATA, -(-seq // MODEL), H, D)


@pytest.mark.parametrize("seq", [16, 15], ids=["16 over 4", "15 over 4 (uneven)"])
def test_kv_cache_read_is_one_psum_of_the_slice(seq):
  cache = rand(B, seq, H, D)
  low = _run_positions(_read, (cache,), (P("data", "model"),))
  cols = low.collectives()
  assert [(c.kind, c.axes, c.primitive) for c in cols] == \
      [("psum", ("model",), "dynamic_slice")], low.explain()
  assert cols[0].shape == (B, 3, H, D)
  hlo = hlo_of(low)
  assert [(c.kind, c.axes) for c in hlo] == [("all-reduce", ("model",))], hlo
  assert hlo[0].shapes == (("f32", (B // DATA, 3, H, D)),)     # the local slice only


def test_kv_cache_write_then_read():
  cache, new = rand(B, T, H, D), rand(B, 1, H, D, seed=1)
  low = _run_positions(_write_then_read, (cache, new), (P("data", "model"), P("data")),
                       out_specs=(P("data", "model"), P("data")))
  cols = low.collectives()
  assert [(c.kind, c.axes, c.primitive) for c in cols] == \
      [("psum", ("model",), "dynamic_slice")], low.explain()
  assert cols[0].bytes == 2 * (MODEL - 1) * (B // DATA) * H * D * 4 // MODEL


def test_kv_cache_split_on_heads_slices_locally():
  """The sequence dim unsplit (heads over model): reads and writes are local."""
  cache, new = rand(B, T, H, D), rand(B, 1, H, D, seed=1)
  spec = P("data", None, "model")
  for fn, args, specs in [(_write, (cache, new), (spec, spec)), (_read, (cache,), (spec,))]:
    low = _run_positions(fn, args, specs)
    assert low.collectives() == [], low.explain()


def test_dynamic_slice_on_two_split_dims():
  """Sequence over model, heads over data, both sliced at traced positions."""
  cache = rand(B, T, H, D)
  upd = rand(B, 3, 2, D, seed=1)
  m = mesh(*M24)
  read = lambda c, p, q: lax.dynamic_slice(c, (0, p, q, 0), (B, 3, 2, D))     # noqa: E731
  write = lambda c, u, p, q: lax.dynamic_update_slice(c, u, (0, p, q, 0))    # noqa: E731
  spec = P(None, "model", "data")
  rstep = gshard.partition(read, m, in_specs=(spec, None, None))
  wstep = gshard.partition(write, m, in_specs=(spec, None, None, None), out_specs=spec)
  for p, q in [(0, 0), (3, 1), (6, 2), (14, 3), (20, -1)]:
    p, q = np.int32(p), np.int32(q)
    assert_trees_close(rstep(cache, p, q), jax.jit(read)(cache, p, q), rtol=0, atol=0)
    assert_trees_close(wstep(cache, upd, p, q), jax.jit(write)(cache, upd, p, q), rtol=0,
                       atol=0)
  p = np.int32(0)
  assert [(c.kind, c.axes) for c in rstep.lower(cache, p, p).collectives()] == \
      [("psum", ("data", "model"))]
  assert wstep.lower(cache, upd, p, p).collectives() == []


def test_decode_loop_writes_and_reads_the_cache():
  """A decode loop: each step writes one position and reads a window ending
  there, in a ``fori_loop``; the cache stays split, the reads sum slices only."""
  m = mesh(*M24)
  steps = rand(6, B, 1, H, D, seed=3)

  def decode(cache, steps, start):
    def body(i, carry):
      cache, acc = carry
      pos = start + i
      cache = lax.dynamic_update_slice(cache, steps[i], (0, pos, 0, 0))
      window = lax.dynamic_slice(cache, (0, pos - 2, 0, 0), (B, 3, H, D))
      return cache, acc + jnp.tanh(window).sum(1)
    return lax.fori_loop(0, steps.shape[0], body, (cache, jnp.zeros((B, H, D))))

  step = gshard.partition(decode, m, in_specs=(P("data", "model"), P(None, "data"), None),
                          out_specs=(P("data", "model"), P("data")))
  cache = rand(B, T, H, D)
  for start in (0, 2, 11, 14):
    assert_trees_close(step(cache, steps, np.int32(start)),
                       jax.jit(decode)(cache, steps, np.int32(start)), rtol=1e-6, atol=1e-6,
                       what=f"start={start}")
  low = step.lower(cache, steps, np.int32(0))
  assert "all_gather" not in kinds(low), low.explain()
  assert {c.kind for c in low.collectives()} <= {"psum"}


# -- general scatters: each device writes its own rows ------------------------------------

SCATTERS = [
    ("scatter", lambda a, i, v: a.at[i].set(v), [0, 5, 15, 4, 9]),           # unique
    ("scatter-max", lambda a, i, v: a.at[i].max(v), [0, 5, 15, 4, 4]),
    ("scatter-min", lambda a, i, v: a.at[i].min(v), [3, 3, 12, 7, 0]),
    ("scatter-mul", lambda a, i, v: a.at[i].mul(v), [1, 14, 14, 8, 2]),
]


@pytest.mark.parametrize("prim,fn,idx", SCATTERS, ids=[s[0] for s in SCATTERS])
def test_general_scatter_writes_into_the_split_operand(prim, fn, idx):
    """``.at[].set/max/min/mul`` into an operand split over ``model`` (rows)
    and ``data`` (columns), indices and updates replicated: each device
    applies the updates that land in its rows (the others are sent out of
    bounds and dropped); no safe path, nothing moves, and
    ``strict=True`` has nothing to refuse."""
    m = mesh(*M24)
    x, v = rand(16, 8), rand(5, 8, seed=1)
    idx = np.asarray(idx, np.int32)
    assert prim in str(jax.make_jaxpr(fn)(x, idx, v))
    for strict in (False, True):
      step = gshard.partition(fn, m, in_specs=(P("model", "data"), None, None),
                              out_specs=P("model", "data"), strict=strict)
      out = step(x, idx, v)
      np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(fn)(x, idx, v)))
      assert_named_sharding(out, m, P("model", "data"))
    low = step.lower(x, idx, v)
    assert not low.fallbacks
    assert not [c for c in low.collectives() if c.primitive == prim], low.explain()
    (scatter,) = [e for e in eqns_of(low.per_device_jaxpr()) if e.primitive.name == prim]
    assert scatter.outvars[0].aval.shape == (16 // MODEL, 8 // DATA)   # the block itself


def test_scatter_add_is_not_the_safe_path():
  """``.at[].add`` (scatter-add) has a rule: each device adds the rows it
  holds; out-of-range indices are dropped as in jax."""
  m = mesh(*M24)
  x, v = rand(16, 8), rand(6, 8, seed=1)
  idx = np.asarray([0, 16, -1, 3, 20, 3], np.int32)
  fn = lambda a, i, u: a.at[i].add(u)   # noqa: E731
  step = gshard.partition(fn, m, in_specs=(P("model"), None, None), out_specs=P("model"))
  np.testing.assert_allclose(np.asarray(step(x, idx, v)),
                             np.asarray(jax.jit(fn)(x, idx, v)), rtol=1e-6, atol=1e-6)
  low = step.lower(x, idx, v)
  assert not low.fallbacks and low.collectives() == [], low.explain()


@pytest.mark.parametrize("mode,idx", [
    ("fill", [0, 16, -1, 3, 20, 15]),
    ("clip", [0, 16, -1, 3, 20, 15]),
    (None, [0, -16, -1, 3, 15, 4]),          # negative indices wrap
])
def test_gather_modes_over_a_split_table(mode, idx):
  m = mesh(*M24)
  x = rand(16, 7)             # 7 features: the table stays vocab-split (see FEAT)
  idx = np.asarray(idx, np.int32)
  if mode is None:
    fn = lambda a, i: a[i]                                          # noqa: E731
  elif mode == "fill":
    fn = lambda a, i: a.at[i].get(mode="fill", fill_value=-7.0)     # noqa: E731
  else:
    fn = lambda a, i: a.at[i].get(mode="clip")                      # noqa: E731
  step = gshard.partition(fn, m, in_specs=(P("model"), None))
  np.testing.assert_array_equal(np.asarray(step(x, idx)), np.asarray(jax.jit(fn)(x, idx)))
  assert "all_gather" not in kinds(step.lower(x, idx))


@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_scatter_into_a_split_operand_equals_one_device(data):
  """Random meshes; operands whose scattered dim, the other, both or neither
  is split, evenly or not; the operand an argument, zeros made in the program (a
  gradient's) or a pad (XLA fuses producers into the scatter); add / set /
  max / min / mul, modes drop and clip; indices in range, negative (jax
  wraps them) and out of range (dropped), duplicates except for set;
  indices and updates replicated or split: each device applies what lands in
  its rows, bit for bit one device's, with no safe path."""
  shape, names = data.draw(st.sampled_from([((8,), ("x",)), ((2, 4), ("x", "y")),
                                            ((4, 2), ("x", "y"))]), label="mesh")
  m = mesh(shape, names)
  row_axes = data.draw(st.sampled_from([(), (names[0],), (names[-1],), tuple(names)]),
                       label="row axes")
  free = [a for a in names if a not in row_axes]
  col_axis = data.draw(st.sampled_from([None, *free]), label="column axis")
  n = math.prod(dict(zip(names, shape))[a] for a in row_axes)
  rows = data.draw(st.integers(1, 3 * n), label="rows")
  cols = data.draw(st.integers(1, 4), label="columns")
  op = data.draw(st.sampled_from(["add", "set", "max", "min", "mul"]), label="op")
  mode = data.draw(st.sampled_from(["drop", "clip"]), label="mode")
  made = data.draw(st.sampled_from(["argument", "zeros", "pad"]), label="operand")
  dtype = data.draw(st.sampled_from([np.float32, np.int32]), label="dtype")
  k = data.draw(st.integers(1, 6), label="updates")
  pool = list(range(-rows - 2, rows + 3))
  if op == "set":          # which of two writes to one row wins is unspecified
    idx = data.draw(st.lists(st.sampled_from(pool), min_size=k, max_size=k,
                             unique_by=lambda i: i % rows if -rows <= i < rows else i),
                    label="indices")
  else:
    idx = data.draw(st.lists(st.sampled_from(pool), min_size=k, max_size=k), label="indices")
  idx_axis = data.draw(st.sampled_from([None, *names]), label="index axis")
  rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
  x = _small_ints(rng, (rows, cols), dtype)
  upd = _small_ints(rng, (k, cols), dtype, -2, 3)
  idx = np.asarray(idx, np.int32)
  row_spec = row_axes if len(row_axes) != 1 else row_axes[0]

  def fn(a, i, u):
    if made == "zeros":
      a = jnp.zeros_like(a) + a.sum()
    elif made == "pad":
      a = jnp.pad(a[1:], ((0, 1), (0, 0)), constant_values=2)
    a = gshard.shard(a, P(row_spec, col_axis))
    ref = a.at[i]
    return getattr(ref, op)(u, mode=mode)

  step = gshard.partition(fn, m, in_specs=(None, P(idx_axis), P(idx_axis)))
  got, want = gshard.unpad(step(x, idx, upd)), jax.jit(fn)(x, idx, upd)
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert not step.lower(x, idx, upd).fallbacks


def test_a_scatter_into_a_padded_uneven_block_drops_what_is_not_its_own():
  """Found by the property above: a pad's result split unevenly (9 rows, 8
  devices), scatter-added at a row out of range. Fused with the pad, XLA
  (jaxlib 0.10.2) put dropped updates in the block; the scatter's operand is
  a barrier's, so it cannot fuse."""
  m = mesh((8,), ("x",))
  x = np.arange(9.0, dtype=np.float32).reshape(9, 1)

  def fn(a, i, u):
    a = jnp.pad(a[1:], ((0, 1), (0, 0)), constant_values=2)
    return gshard.shard(a, P("x")).at[i].add(u, mode="drop")
  step = gshard.partition(fn, m, in_specs=(None, None, None))
  for idx in ([-11], [9], [0, 8, -3, 12]):
    i, u = np.asarray(idx, np.int32), np.ones((len(idx), 1), np.float32)
    np.testing.assert_array_equal(np.asarray(gshard.unpad(step(x, i, u))),
                                  np.asarray(jax.jit(fn)(x, i, u)))


@pytest.mark.parametrize("rows,start,mode", [(8, 1, "drop"), (8, 7, "drop"), (7, 5, "clip"),
                                             (8, -1, "drop"), (6, 3, "clip")])
def test_a_window_scatter_along_a_split_dim_equals_one_device(rows, start, mode):
  """A scatter whose scattered dim is a window dim (a 2-row window added at
  a traced start, ``dynamic_update_slice``-like): where the window lands
  depends on the index, so the dim is not computed split (found by review:
  each device added the window at the start within its own block)."""
  m = mesh((2, 4), ("x", "y"))
  dn = lax.ScatterDimensionNumbers(update_window_dims=(1, 2), inserted_window_dims=(),
                                   scatter_dims_to_operand_dims=(0,))
  gmode = {"drop": lax.GatherScatterMode.FILL_OR_DROP, "clip": lax.GatherScatterMode.CLIP}[mode]

  def fn(a, i, u):
    a = gshard.shard(a, P(("x", "y"), None))
    return lax.scatter_add(a, i, u, dn, mode=gmode)
  a = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
  i, u = np.array([[start]], np.int32), 10 * np.ones((1, 2, 3), np.float32)
  step = gshard.partition(fn, m, in_specs=(None, None, None))
  np.testing.assert_array_equal(np.asarray(gshard.unpad(step(a, i, u))),
                                np.asarray(jax.jit(fn)(a, i, u)))


INDEX_DTYPES = [jnp.uint8, jnp.int8, jnp.uint16, jnp.int16, jnp.uint32, jnp.int32]


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_narrow_and_unsigned_index_dtypes(data):
  """Indices of any integer dtype into a table split on the indexed dim
  (byte-level token ids as uint8 into 300 rows): gshard subtracted each
  device's row offset in the index dtype, which wrapped, so devices read and
  wrote the wrong rows; a uint32 start of 2**32 - 1 became -1, clamped to 0
  where jax clamps it to the end. Lookups, their gradient (a scatter-add into
  the split table) and dynamic slices and updates equal jax.jit's, for in-
  and out-of-range indices."""
  dtype = data.draw(st.sampled_from(INDEX_DTYPES))
  rows = data.draw(st.sampled_from([130, 300, 301]))
  shape, names = data.draw(st.sampled_from([((4,), ("y",)), M24]))
  info = np.iinfo(dtype)
  idx = np.array(data.draw(st.lists(st.integers(int(info.min), int(info.max)), min_size=1,
                                    max_size=6)) + [0, min(rows - 1, int(info.max))],
                 dtype=dtype)
  start = np.asarray(data.draw(st.integers(int(info.min), int(info.max))), dtype)
  mode = data.draw(st.sampled_from(["clip", "fill"]))
  table = (np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) - rows) / 7
  split = P(names[-1], None)

  def f(t, i, s):
    looked = jnp.take(t, i, axis=0, mode=mode)
    grad = jax.grad(lambda t: jnp.sum(jnp.take(t, i, axis=0, mode="clip") ** 2))(t)
    window = lax.dynamic_slice(t, (s, jnp.zeros((), s.dtype)), (3, 2))
    moved = lax.dynamic_update_slice(t, jnp.full((3, 2), -1.0), (s, jnp.zeros((), s.dtype)))
    return looked, grad, window, moved

  got = gshard.partition(f, mesh(shape, names), in_specs=(split, P(), P()))(table, idx, start)
  assert_trees_close(got, jax.jit(f)(table, idx, start), rtol=0, atol=0,
                     what=f"{np.dtype(dtype).name} indices {idx} start {start} mode {mode}")


def test_rewritten_indices_claim_neither_sorted_nor_unique():
  """A lookup into a split table rewrites its indices to local rows (masked
  ones to row 0, a scatter's to one past the end): sorted, unique indices are
  neither any more, and a backend may rely on jax's hints (found by a
  review). Values equal jax.jit's."""
  table = jnp.arange(32.0).reshape(16, 2)
  idx = jnp.array([1, 5, 9, 14])

  def f(t, i):
    looked = jnp.take(t, i, axis=0, indices_are_sorted=True, unique_indices=True)
    put = t.at[i].add(1.0, indices_are_sorted=True, unique_indices=True)
    return looked, put

  part = gshard.partition(f, mesh((4,), ("y",)), in_specs=(P("y", None), P()))
  assert_trees_close(part(table, idx), jax.jit(f)(table, idx), rtol=0, atol=0)
  hints = [(e.primitive.name, e.params["indices_are_sorted"], e.params["unique_indices"])
           for e in _all_eqns(part.lower(table, idx).per_device_jaxpr())
           if e.primitive.name in ("gather", "scatter-add")]
  assert hints and all(not sorted_ and not unique for _, sorted_, unique in hints), hints


def _all_eqns(closed):
  from gshard.spmd.graph import sub_jaxprs
  stack = [getattr(closed, "jaxpr", closed)]
  while stack:
    j = stack.pop()
    for e in j.eqns:
      yield e
      stack.extend(getattr(s, "jaxpr", s) for _, s in sub_jaxprs(e.params))


def test_an_empty_update_along_a_split_dim():
  """dynamic_update_slice of a zero-size update along a split dim raised
  jax's "Cannot do a non-empty jnp.take() from an empty axis" from gshard's
  rule; it writes nothing."""
  f = lambda x, s: lax.dynamic_update_slice(x, jnp.zeros((0,)), (s,))
  x = jnp.arange(8.0)
  got = gshard.partition(f, mesh((4,), ("y",)), in_specs=(P("y"), P()))(x, 3)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(x))
