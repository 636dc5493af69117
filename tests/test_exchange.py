"""The exchange (spmd/exchange.py): between two complete layouts, each device
receives the pieces of its new block it lacks, in ppermute rounds, where the
reshard planner's chain of collectives would send more."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import gshard
import helpers_mlp
import helpers_partition
from benchmarks import hlo
from gshard.spmd import exchange
from gshard.spmd.exchange import plan_move
from gshard.spmd.reshard import plan_reshard
from gshard.spmd.sharding import TensorSharding
from gshard.spmd.collectives import apply_plan
from test_reshard import assemble, block_slices, device_coords, logical, make_mesh, place

MESHES = [((2, 4), ("a", "b")), ((4, 2), ("a", "b")), ((2, 2, 2), ("a", "b", "c")),
          ((8,), ("a",))]


def lacks(src, dst, shape, sizes) -> int:
  """The most elements one device must receive: its new block less what its
  old block already holds (no plan can send less)."""
  worst = 0
  for c in device_coords(tuple(sizes), tuple(sizes.values())):
    new, old = (block_slices(s, c, sizes, shape) for s in (dst, src))
    kept = math.prod(max(0, min(a.stop, b.stop) - max(a.start, b.start)) for a, b in zip(new, old))
    worst = max(worst, math.prod(a.stop - a.start for a in new) - kept)
  return worst


def check_moves(src, dst, global_shape, names, mesh_shape, seed=0):
  """``plan_move``'s plan run under ``shard_map`` on test_reshard's blocks
  (no padding here: every split is even): each new block holds the value."""
  sizes = dict(zip(names, mesh_shape))
  rng = np.random.default_rng(seed)
  value = rng.integers(-9, 10, global_shape).astype(np.float32)
  spec = P(names)

  def body(x_):
    plan = plan_move(src, dst, global_shape, x_.dtype, sizes)
    return apply_plan(x_[0], plan, global_shape, sizes)[None]
  run = jax.jit(jax.shard_map(body, mesh=make_mesh(mesh_shape, names), in_specs=spec,
                              out_specs=spec, check_vma=False))
  out = np.asarray(run(place(value, src, names, mesh_shape, rng, np.nan)))
  assert out.shape[1:] == dst.local_shape(global_shape, sizes)
  for full in assemble(out, dst, names, mesh_shape, global_shape):
    np.testing.assert_array_equal(full[logical(global_shape)], value)


def chain(src, dst, shape, sizes):
  """The plan without the exchange: the planner's chain of collectives."""
  return plan_reshard(src, dst, shape, "float32", sizes)


@st.composite
def crossings(draw):
  """A mesh, a global shape every layout splits evenly, two complete layouts."""
  shape_, names = draw(st.sampled_from(MESHES))
  rank = draw(st.integers(1, 3))
  n = math.prod(shape_)
  shape = tuple(draw(st.sampled_from((n, 2 * n, 3 * n))) for _ in range(rank))

  def layout():
    dims = [[] for _ in range(rank)]
    for a in names:
      where = draw(st.sampled_from(["none", *range(rank)]))
      if where != "none":
        dims[where].append(a)
    return TensorSharding(tuple(tuple(draw(st.permutations(d))) for d in dims))
  return names, shape_, shape, layout(), layout()


def test_crossed_split_is_one_ppermute():
  """[_, a] -> [(a, b), _] on a 2x4 mesh: each device lacks the other column
  half of its rows, held by the device across ``a``: one ppermute (512 B)
  where the chain sent an all-to-all and a ppermute (1536 B)."""
  sizes = {"a": 2, "b": 4}
  src, dst = TensorSharding(((), ("a",))), TensorSharding((("a", "b"), ()))
  plan = plan_move(src, dst, (32, 64), "float32", sizes)
  assert plan.kinds == ("exchange",) and plan.bytes_per_device == 512
  assert len(plan.steps[0].exchange.rounds) == 1
  assert chain(src, dst, (32, 64), sizes).bytes_per_device == 1536
  check_moves(src, dst, (32, 64), ("a", "b"), (2, 4))


@settings(max_examples=30, deadline=None)
@given(crossings())
def test_exchange_values_and_bytes(case):
  """Wherever the move is an exchange: the values arrive, it sends fewer
  bytes than the chain and no fewer than a device lacks."""
  names, mesh_shape, shape, src, dst = case
  sizes = dict(zip(names, mesh_shape))
  plan = plan_move(src, dst, shape, "float32", sizes)
  old = chain(src, dst, shape, sizes)
  assert plan.bytes_per_device <= old.bytes_per_device
  if plan.kinds == ("exchange",):
    assert plan.bytes_per_device < old.bytes_per_device
    assert plan.bytes_per_device >= 4 * lacks(src, dst, shape, sizes)
  check_moves(src, dst, shape, names, mesh_shape)


@settings(max_examples=200, deadline=None)
@given(crossings())
def test_exchange_plans_only(case):
  """Planning alone, many more layouts: every round is a permutation (each
  device sends and receives at most one piece), every piece of every new
  block comes from a held slot or a round a device receives in, and there
  are as many rounds as the most pieces one device lacks (no fewer can
  bring them, one a round; the greedy schedule it replaced took up to two
  more in 1122 of the 6912 crossings of 2-D layouts on 2x4, 2x2x2 and 8
  devices)."""
  names, mesh_shape, shape, src, dst = case
  sizes = dict(zip(names, mesh_shape))
  ex = exchange.plan(src, dst, shape, 4, sizes, math.inf)
  if ex is None:
    return
  n = math.prod(sizes[a] for a in ex.axes)
  received = [set() for _ in range(n)]
  for r, (pairs, _) in enumerate(ex.rounds):
    senders, receivers = [s for s, _ in pairs], [d for _, d in pairs]
    assert len(set(senders)) == len(senders) and len(set(receivers)) == len(receivers)
    for d in receivers:
      received[d].add(len(ex.held) + r)
  for i, row in enumerate(ex.take):
    assert len(row) == math.prod(ex.counts)
    for slot in row:
      assert slot < len(ex.held) or slot in received[i]
  assert ex.bytes_per_device == len(ex.rounds) * math.prod(ex.piece) * 4
  assert len(ex.rounds) == max(sum(s >= len(ex.held) for s in row) for row in ex.take)


# [_, b*a] -> [_, _] on 2x4: each device lacks 7 pieces, each held by one
# device; the greedy schedule took 9 rounds
def test_a_gather_by_exchange_takes_as_many_rounds_as_pieces_lacked():
  sizes = {"a": 2, "b": 4}
  ex = exchange.plan(TensorSharding(((), ("b", "a"))), TensorSharding(((), ())),
                     (32, 64), 4, sizes, math.inf)
  assert len(ex.rounds) == 7


@pytest.mark.parametrize("k", [2, 4])
def test_micro_batches_of_the_first_axis_move_their_block(k):
  """``[32@(x, y)] -> [K, 32/K]`` read split over ``(x, y)`` on its rows
  (``K`` the size of ``x``, or of ``y`` on a 4x2 mesh): the reshape splits
  ``[K@x, M@y]`` for free, and the exchange moves each device's 4 elements
  (16 B) where the chain sent 24 B. Bit for bit ``jax.jit``'s."""
  mesh = gshard.make_mesh((k, 8 // k), ("x", "y"))

  def f(v):
    return gshard.shard(-v.reshape(k, 32 // k), P(None, ("x", "y")))
  x = jnp.arange(32, dtype=jnp.float32) * 1.5
  step = gshard.partition(f, mesh, in_specs=(P(("x", "y")),))
  sent = step.lower(x).collectives()
  assert sum(c.bytes for c in sent) <= 16 and {c.kind for c in sent} <= {"ppermute"}
  np.testing.assert_array_equal(np.asarray(gshard.unpad(step(x))), np.asarray(jax.jit(f)(x)))


@pytest.mark.parametrize("dtype", ["key", "bool", "bfloat16", "int8"])
def test_program_outputs_move_by_exchange(dtype):
  """A program's output laid out across its input's layout (``[_, a] ->
  [(a, b), _]``): keys (moved as their data), bools and narrow types arrive
  as they were, by ppermutes of each device's missing half."""
  mesh = gshard.make_mesh((2, 4), ("a", "b"))
  if dtype == "key":
    x = jax.random.split(jax.random.key(0), 32 * 64).reshape(32, 64)
  else:
    x = (jnp.arange(32 * 64).reshape(32, 64) % 7 == 3) if dtype == "bool" else (
        (jnp.arange(32 * 64).reshape(32, 64) % 100).astype(dtype))
  step = gshard.partition(lambda v: v, mesh, in_specs=(P(None, "a"),),
                          out_specs=P(("a", "b"), None))
  sent = step.lower(x).collectives()
  assert {c.kind for c in sent} == {"ppermute"}
  out = step(x)
  if dtype == "key":
    out, x = jax.random.key_data(out), jax.random.key_data(x)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(x))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w1=helpers_partition.specs_2d(helpers_mlp.CHOICES),
       w2=helpers_partition.specs_2d(helpers_mlp.CHOICES),
       x=helpers_partition.specs_2d(helpers_mlp.CHOICES),
       step=st.sampled_from(sorted(helpers_mlp.STEPS)))
# a layout whose weight gradient moves across (47104 -> 45056 B; GSPMD 45056)
@example(w1=P("a", None), w2=P(("a", "b"), None), x=P(None, "b"), step="sgd")
def test_a_program_never_sends_more_than_with_the_chains(w1, w2, x, step):
  """Random layouts of an MLP train step (the weights as they came in and
  go out): the compiled program sends no more bytes (its optimized HLO, where
  XLA emits a collective two moves repeat once) than with every move a chain,
  and gives ``jax.jit``'s values."""
  fn, (p, xs) = helpers_mlp.STEPS[step], helpers_mlp.args()
  specs = ({"w1": w1, "w2": w2}, x)
  m = helpers_partition.mesh((2, 4), ("a", "b"))

  def sent(part):
    return hlo.bytes_sent(part.lower(p, xs).compile().as_text(), 8)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(exchange, "plan_move", lambda src, dst, shape, dtype, sizes:
               plan_reshard(src, dst, shape, dtype, sizes))
    chains = sent(gshard.partition(fn, m, in_specs=specs, out_specs=specs[0]))
  part = gshard.partition(fn, m, in_specs=specs, out_specs=specs[0])
  got = sent(part)
  assert got <= chains
  if (w1, w2, x) == (P("a", None), P(("a", "b"), None), P(None, "b")):
    assert got < chains                  # (the example's move is an exchange)
  helpers_partition.assert_within_ulps(part(p, xs), jax.jit(fn)(p, xs), 128)


def test_an_empty_value_moves_by_its_chain():
  """A dim of 0 elements: no exchange (nothing to cut into pieces)."""
  sizes = {"a": 2, "b": 4}
  src, dst = TensorSharding(((), ("a",))), TensorSharding((("a", "b"), ()))
  assert exchange.plan(src, dst, (0, 64), 4, sizes, math.inf) is None
  assert plan_move(src, dst, (0, 64), "float32", sizes) == plan_reshard(
      src, dst, (0, 64), "float32", sizes)
