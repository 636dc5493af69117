"""Values laid out for the op that reads them (``spmd/readers.py``).

An elementwise op whose operands disagree took the layout that moved the
fewest bytes at that op alone, and its reader then moved the result (a relu
gradient's ``select`` moved the forward's mask, and the weight gradient's
dot moved the select's result). The operand a reader moves is now tried in
the reader's layout, with the values it is made of, where the partitioner's
plans price every op touching them strictly cheaper. The property: over
random layouts of an MLP train step (plain SGD, gradients clipped by their
global norm, weight decay, Adam, a leaky activation written with
``jnp.where``), never more bytes than the same program
left as propagated, and the values of ``jax.jit``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import gshard
from benchmarks import hlo
from gshard.spmd import propagate, readers
import helpers_mlp
import helpers_partition
from helpers_partition import assert_within_ulps, mesh

CHOICES = helpers_mlp.CHOICES
STEPS = helpers_mlp.STEPS
_sgd, _args = helpers_mlp.sgd, helpers_mlp.args


def _close(got, want):
  # the same train step; sums of at most 128 products reordered across
  # devices: within 128 ulps of the largest magnitude of each weight's update
  # (Adam divides by the root of the second moment: a relative error of the
  # gradient is at most halved there, so the bound holds)
  assert_within_ulps(got, want, 128)


def _as_propagated(mp):
  mp.setattr(propagate, "lay_out_for_readers", lambda graph, touching: None)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w1=helpers_partition.specs_2d(CHOICES), w2=helpers_partition.specs_2d(CHOICES),
       x=helpers_partition.specs_2d(CHOICES), step=st.sampled_from(sorted(STEPS)),
       pin=st.sampled_from(["in", "in and out", "out only"]))
def test_laying_out_for_readers_never_sends_more(w1, w2, x, step, pin):
  helpers_mlp.check_never_sends_more("lay_out_for_readers", STEPS[step], w1, w2, x, pin, _close)


def _compiled_bytes(part, *args) -> float:
  return hlo.bytes_sent(part.lower(*args).compile().as_text(), 8)


def test_a_relu_gradient_is_selected_in_the_layout_its_dot_reads():
  # w1 [64, 128@(b,a)], w2 [128@(a,b), 64], x [32, 64@b]: the relu's mask
  # [32, 128@b*a] was moved to the gradient's a*b for the select (512 B),
  # and the dot making dW1 then moved the select's result back (2048 B);
  # GSPMD moves the gradient once. Now the gradient moves once, before the
  # select: the compiled program sends GSPMD's bytes
  p, xs = _args()
  specs = ({"w1": P(None, ("b", "a")), "w2": P(("a", "b"), None)}, P(None, "b"))
  m = mesh((2, 4), ("a", "b"))
  part = gshard.partition(_sgd, m, in_specs=specs, out_specs=specs[0])
  low = part.lower(p, xs)
  assert not [c for c in low.collectives() if c.primitive == "select_n"], low.explain()
  with pytest.MonkeyPatch.context() as mp:
    _as_propagated(mp)
    before = gshard.partition(_sgd, m, in_specs=specs, out_specs=specs[0])
    assert _compiled_bytes(before, p, xs) == 25088
  assert _compiled_bytes(part, p, xs) == 24576
  assert _compiled_bytes(gshard.gspmd_jit(_sgd, m, in_specs=specs, out_specs=specs[0]),
                         p, xs) == 24576
  _close(part(p, xs), jax.jit(_sgd)(p, xs))


def test_a_gradient_is_made_by_its_dot_in_the_layout_its_reader_wants():
  # x [32, 64@(b,a)], w1 [64, 128@(a,b)], w2 [128@b, 64@a]: the input
  # gradient of the second dot came out [32, 128@b] and was moved twice after
  # it (the mask to it for the select, the select's result to w1's a*b for
  # dW1): 24576 B against GSPMD's 23552. Made in a*b by its dot, the step
  # sends 21504
  p, xs = _args()
  specs = ({"w1": P(None, ("a", "b")), "w2": P("b", "a")}, P(None, ("b", "a")))
  m = mesh((2, 4), ("a", "b"))
  part = gshard.partition(_sgd, m, in_specs=specs, out_specs=specs[0])
  assert _compiled_bytes(part, p, xs) == 21504
  assert _compiled_bytes(gshard.gspmd_jit(_sgd, m, in_specs=specs, out_specs=specs[0]),
                         p, xs) == 23552
  _close(part(p, xs), jax.jit(_sgd)(p, xs))


@pytest.mark.parametrize("specs, before, after, xla", [
    # x [32, 64@a*b], w1 [64@a, 128@b], w2 [128, 64@b*a]: the forward gathers
    # x, and the weight gradient's dot reads that copy; priced without it, y's
    # cotangent stayed in w2's b*a and the dots around it moved it twice
    # (as propagated: 38912 B before its crossing move ran as an exchange)
    (({"w1": P(None, ("b", "a")), "w2": P("a", "b")}, P("a", "b")), 35840, 25600, 31744),
    # x [32, 64@a*b], w1 [64, 128@b*a], w2 [128@b, 64@a]: dW1 was made in
    # [64@a, 128@b] (a tie, with x's gather counted again) and all-to-alled
    # to w1's layout; from the forward's copy of x it is made in w1's layout
    (({"w1": P(None, ("b", "a")), "w2": P("b", "a")}, P(None, ("a", "b"))), 21504, 17408, 19456),
])
def test_an_operand_copied_by_an_earlier_reader_is_priced_as_the_copy(specs, before, after,
                                                                       xla):
  # the plans the pass prices read the copies the plans of earlier readers
  # leave (the partitioner reuses them: partition/context.py's reshard)
  p, xs = _args()
  m = mesh((2, 4), ("a", "b"))
  part = gshard.partition(_sgd, m, in_specs=specs, out_specs=specs[0])
  with pytest.MonkeyPatch.context() as mp:
    _as_propagated(mp)
    old = gshard.partition(_sgd, m, in_specs=specs, out_specs=specs[0])
    assert _compiled_bytes(old, p, xs) == before
  assert _compiled_bytes(part, p, xs) == after
  assert _compiled_bytes(gshard.gspmd_jit(_sgd, m, in_specs=specs, out_specs=specs[0]),
                         p, xs) == xla
  _close(part(p, xs), jax.jit(_sgd)(p, xs))


@pytest.mark.parametrize("specs, before, after, xla", [
    # x [32, 64@b], w1 [64, 128@b], w2 [128@a, 64@b]: dW1 was made in
    # [64@b, 128@a] from x's gathered copy and the relu's gradient as it is,
    # then all-to-alled and gathered to w1's [64, 128@b] for the update; made
    # in w1's layout (fewer shards) from the same copy it sends nothing
    (({"w1": P(None, "b"), "w2": P("a", "b")}, P(None, "b")), 40960, 26624, 36864),
    (({"w1": P(None, "b"), "w2": P("a", "b")}, P(None, ("b", "a"))), 41984, 27648, 37888),
])
def test_a_weight_gradient_is_made_in_its_weights_layout(specs, before, after, xla):
  p, xs = _args()
  m = mesh((2, 4), ("a", "b"))
  part = gshard.partition(_sgd, m, in_specs=specs, out_specs=specs[0])
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(readers._Pass, "aligns", lambda self, c, u, want: False)
    assert _compiled_bytes(gshard.partition(_sgd, m, in_specs=specs, out_specs=specs[0]),
                           p, xs) == before
  low = part.lower(p, xs)
  assert _compiled_bytes(part, p, xs) == after
  assert not [c for c in low.collectives() if c.primitive == "sub"], low.explain()
  assert _compiled_bytes(gshard.gspmd_jit(_sgd, m, in_specs=specs, out_specs=specs[0]),
                         p, xs) == xla
  _close(part(p, xs), jax.jit(_sgd)(p, xs))


@pytest.mark.parametrize("source, specs, before, after, absent", [
    # x [32@a, 64], w1 [64, 128@(b,a)], w2 [128@(b,a), 64]. x @ w1 is made
    # [32, 128@(b,a)] from x gathered; the relu (a custom_jvp_call) took its
    # operand as [32@a, 128@b] (an all-to-all at the call) and its gradient
    # was moved back for dW1 (another). The call's inner operand laid out as
    # the value it is passed, carried on to the relu's result, its mask and
    # the gradient it selects, sends neither: 20480 -> 18432 B, GSPMD's bytes
    ("pushed", ({"w1": P(None, ("b", "a")), "w2": P(("b", "a"), None)}, P("a", None)),
     20480, 18432, lambda c: c.kind == "all_to_all"),
    # x [32@a, 64], w1 [64, 128@(b,a)], w2 [128@(a,b), 64]. x @ w1 is made
    # [32, 128@(b,a)] and its plan moved it to w2's (a,b) for the relu: the
    # relu's mask was then made in (a,b), and moved back (512 B) for the
    # gradient's select, made in w1's (b,a) for dW1. The dot's result kept
    # in the layout it is made in, carried on to the relu's result and mask,
    # moves the relu's result instead (as GSPMD does): 23040 -> 22528 B
    ("made", ({"w1": P(None, ("b", "a")), "w2": P(("a", "b"), None)}, P("a", None)),
     23040, 22528, lambda c: c.dtype == "bool"),
], ids=["a call computes where its operand is", "a result stays where it is made"])
def test_a_value_is_carried_forward_from_where_it_is(source, specs, before, after, absent):
  p, xs = _args()
  m = mesh((2, 4), ("a", "b"))
  part = gshard.partition(_sgd, m, in_specs=specs, out_specs=specs[0])
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(readers._Pass, source, lambda self, c: [])
    assert _compiled_bytes(gshard.partition(_sgd, m, in_specs=specs, out_specs=specs[0]),
                           p, xs) == before
  low = part.lower(p, xs)
  xla = _compiled_bytes(gshard.gspmd_jit(_sgd, m, in_specs=specs, out_specs=specs[0]), p, xs)
  assert _compiled_bytes(part, p, xs) == after == xla    # GSPMD's bytes
  assert not [c for c in low.collectives() if absent(c)], low.explain()
  _close(part(p, xs), jax.jit(_sgd)(p, xs))


def _accumulated_fsdp_step(p, x):
  # an MLP's gradients accumulated over the micro-batches of x [K, M, D]
  # (a scan), the weights split over data on the hidden dim (FSDP), the
  # hidden activation annotated batch split (as Flax's logical constraint
  # writes it)
  def loss(p, xb):
    h = xb @ p["w_in"] + p["b_in"]
    h = gshard.shard(jax.nn.gelu(h), P("data", None))
    return jnp.mean((h @ p["w_out"]) ** 2)

  def body(acc, xb):
    return jax.tree.map(jnp.add, acc, jax.grad(loss)(p, xb)), None
  acc, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, p), x)
  return jax.tree.map(lambda w, g: w - 0.1 * g, p, acc)


def test_a_loop_body_is_laid_out_as_one_region_for_its_readers():
  # In the scan body, x_k [128@data, 64] @ w_in [64, 128@data] ties: gathering
  # either sends 56 KiB. Propagation left the tie to the bias add, which took
  # w_in's feature split, so the GELU ran feature split and its forward and
  # backward values were moved to the annotation's batch split and back, in
  # every trip (215040 B). The body is laid out too now, and where one way's
  # chain sends no fewer bytes the region of elementwise ops around it (the
  # GELU's forward and the backward ops reading it) is laid out as one where
  # its ops send fewer bytes: the weights are gathered and the gradients
  # reduce-scattered, FSDP's bytes (173376 B)
  rng = np.random.default_rng(0)
  p = {"w_in": rng.standard_normal((64, 128)).astype(np.float32) / 8,
       "b_in": rng.standard_normal(128).astype(np.float32) / 8,
       "w_out": rng.standard_normal((128, 64)).astype(np.float32) / 8}
  xs = rng.standard_normal((2, 128, 64)).astype(np.float32)
  specs = ({"w_in": P(None, "data"), "b_in": P("data"), "w_out": P("data", None)},
           P(None, "data"))
  m = mesh((8,), ("data",))

  def sent():
    return _compiled_bytes(gshard.partition(_accumulated_fsdp_step, m, in_specs=specs,
                                            out_specs=specs[0]), p, xs)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(readers, "_BODIES", frozenset())      # the body as propagated
    assert sent() == 215040
  sweeps = readers._Pass._sweeps
  with pytest.MonkeyPatch.context() as mp:            # chains one way only
    mp.setattr(readers._Pass, "_sweeps",
               lambda self, regions: False if regions else sweeps(self, False))
    assert sent() == 215040
  assert sent() == 173376
  part = gshard.partition(_accumulated_fsdp_step, m, in_specs=specs, out_specs=specs[0])
  assert {c.kind for c in part.lower(p, xs).collectives()} == {"all_gather", "psum_scatter"}
  assert _compiled_bytes(gshard.gspmd_jit(_accumulated_fsdp_step, m, in_specs=specs,
                                          out_specs=specs[0]), p, xs) == 288960
  _close(part(p, xs), jax.jit(_accumulated_fsdp_step)(p, xs))


def _relu_grad_step(pin, where):
  # the relu gradient of the first test, written out; ``where``: with
  # jnp.where (a jit call, run inline: its select is laid out too) or
  # lax.select; ``pin``: the select's result annotated in the gradient's layout
  def step(p, x):
    h = x @ p["w1"]
    dy = 2 * (jax.nn.relu(h) @ p["w2"])
    dh = dy @ p["w2"].T
    if where:
      g = jnp.where(h > 0, dh, 0.0)
    else:
      g = jax.lax.select(h > 0, dh, jnp.zeros_like(dh))
    if pin:
      g = gshard.shard(g, P(None, ("a", "b")))
    return p["w1"] - 0.01 * (x.T @ g)
  return step


@pytest.mark.parametrize("where", [False, True])
@pytest.mark.parametrize("pin", [False, True])
def test_a_pinned_value_keeps_its_layout(pin, where):
  p, xs = _args()
  specs = ({"w1": P(None, ("b", "a")), "w2": P(("a", "b"), None)}, P(None, "b"))
  m = mesh((2, 4), ("a", "b"))
  step = _relu_grad_step(pin, where)
  part = gshard.partition(step, m, in_specs=specs, out_specs=specs[0]["w1"])
  with pytest.MonkeyPatch.context() as mp:
    _as_propagated(mp)
    before = gshard.partition(step, m, in_specs=specs, out_specs=specs[0]["w1"])
    before = before.lower(p, xs).total_bytes()
  low = part.lower(p, xs)
  assert low.total_bytes() <= before
  # unpinned, the select's result is made in the layout the dot making dW1
  # reads; pinned, it stays in a*b and that dot moves it
  moved = [c for c in low.collectives()
           if c.primitive == "dot_general" and c.role == "operand 1"
           and "f32[32,128@a*b] ->" in str(c)]
  assert bool(moved) == pin, low.explain()
  assert_within_ulps(part(p, xs), jax.jit(step)(p, xs), 128)
