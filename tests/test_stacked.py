"""Scan residuals stacked as the backward loop reads them (``spmd/stacked.py``).

A scanned body that reshards a value for one consumer (``v`` laid out as the
carry) and whose backward reads ``v`` as a residual in that layout: the
residual is stacked as the forward body's copy, and the backward loop moves
nothing for it. Property over meshes, shapes and the two layouts: values and
gradients equal the unpartitioned program, and the scanned program sends no
more than its unrolled form, per step (which reuses the forward copy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import gshard
from gshard.spmd import propagate
from gshard.spmd.stacked import stack_as_read
from helpers_partition import assert_trees_close, mesh

MESHES = [((4,), ("x",)), ((2, 2), ("x", "y")), ((2, 4), ("x", "y"))]


def _spec(draw, rank, names):
  """A PartitionSpec of ``rank`` dims over a subset of ``names``, each axis once."""
  dims = [None] * rank
  for name in names:
    d = draw(st.integers(-1, rank - 1))
    if d >= 0 and dims[d] is None:
      dims[d] = name
  return P(*dims)


def _program(made, carried, layers, scanned):
  """h <- h + tanh(v * h) with v = annotate(w_l * 2, made) and h annotated as
  ``carried``: the product reads v in h's layout; its backward reads v again
  (d(h) = dy * (1 - t^2) * v)."""
  def layer(h, w):
    v = gshard.shard(w * 2.0, made)
    h = gshard.shard(h, carried)
    return h + jnp.tanh(v * h), None

  def loss(ws, x):
    if scanned:
      h, _ = jax.lax.scan(layer, x, ws)
    else:
      h = x
      for i in range(layers):
        h, _ = layer(h, ws[i])
    return jnp.sum(h * jnp.cos(h))
  return jax.value_and_grad(loss, argnums=(0, 1))


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_residual_stacked_as_read(data):
  shape, names = data.draw(st.sampled_from(MESHES))
  m = mesh(shape, names)
  dims = (8, data.draw(st.sampled_from([4, 8])))
  made, carried = _spec(data.draw, 2, names), _spec(data.draw, 2, names)
  layers = data.draw(st.integers(2, 3))
  rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
  ws = rng.standard_normal((layers, *dims)).astype(np.float32)
  x = rng.standard_normal(dims).astype(np.float32)
  specs = (P(None, *made), carried)
  lowered = {}
  for scanned in (True, False):
    step = _program(made, carried, layers, scanned)
    part = gshard.partition(step, m, in_specs=specs)
    got = part(ws, x)
    # one elementwise chain per element: the only sum is the loss's, of 8*d terms
    assert_trees_close(got, jax.jit(step)(ws, x), rtol=1e-5, atol=1e-5 * dims[1],
                       what=f"scanned={scanned} made={made} carried={carried}")
    lowered[scanned] = part.lower(ws, x)
  # the scanned loops send at most what the unrolled layers do (which reuse the
  # forward's copy of v in the backward), both as propagated: the readers pass
  # (spmd/readers.py) lays out the top program's values, not a loop body's,
  # so it can make the unrolled layers send less still (a gradient made in
  # the layout of the pinned value it is added to: docs/design.md, known
  # limits); it never makes either send more
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(propagate, "lay_out_for_readers", lambda graph, touching: None)
    plain = {scanned: gshard.partition(_program(made, carried, layers, scanned), m,
                                       in_specs=specs).lower(ws, x)
             for scanned in (True, False)}
  assert plain[True].total_bytes() <= plain[False].total_bytes(), (
      plain[True].explain(), plain[False].explain())
  for scanned in (True, False):
    assert lowered[scanned].total_bytes() <= plain[scanned].total_bytes()


def test_stack_as_read_moves_the_residual(monkeypatch):
  # v split on dim 0, h on dim 1: the product reads v split on dim 1, and so
  # does the backward: the residual is stacked split on dim 1, one all-to-all
  # fewer a step than with the pass turned off.
  made, carried = P("x", None), P(None, "x")
  step = _program(made, carried, 3, True)
  ws, x = jnp.ones((3, 8, 8)), jnp.ones((8, 8))
  m = mesh((4,), ("x",))
  moved = []

  def lower(pass_on):
    monkeypatch.setattr(propagate, "stack_as_read",
                        lambda g: moved.append(stack_as_read(g)) if pass_on else None)
    return gshard.partition(step, m, in_specs=(P(None, *made), carried)).lower(ws, x)
  on, off = lower(True), lower(False)
  assert moved == [1]
  a2a = {k: [c for c in low.collectives() if c.kind == "all_to_all"]
         for k, low in (("on", on), ("off", off))}
  step_bytes = 8 * 8 * 4 // 4 * 3 // 4          # (n-1)/n of a local [8, 2] block
  assert [c.bytes for c in a2a["on"]] == [3 * step_bytes] * 4, on.explain()
  assert [c.bytes for c in a2a["off"]] == [3 * step_bytes] * 5, off.explain()


def test_a_pinned_stacked_result_is_stacked_as_made():
  """Only a stacked value the pass moved is stacked in its own layout: one
  out_specs pins in another layout is stacked as the body made it and moved
  once after the loop, not resharded a step at a time inside it (found by a
  second reader)."""
  def f(xs):
    def body(c, xi):
      return c, gshard.shard(jnp.sin(xi), P("x", None))
    _, ys = jax.lax.scan(body, 0.0, xs)
    return ys, gshard.shard(ys * 2.0, P(None, "x", None))

  xs = np.random.default_rng(0).standard_normal((3, 8, 8)).astype(np.float32)
  part = gshard.partition(f, mesh((4,), ("x",)), in_specs=P(),
                          out_specs=(P(None, None, "x"), P(None, "x", None)))
  assert_trees_close(gshard.unpad(part(xs)), jax.jit(f)(xs))
  low = part.lower(xs)
  assert not [c for c in low.collectives() if c.role.startswith("ys")], low.explain()
