"""A split value whose elementwise tail leaves as several coarser outputs is
gathered once, where the tail begins (gshard/spmd/hoist.py)."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import gshard
import gshard.spmd.partition.api as api_module
from helpers_partition import mesh


@contextlib.contextmanager
def _gathered_where_it_ends():
  """Programs as they were without the pass (the comparison)."""
  pass_ = api_module.gather_early
  api_module.gather_early = lambda *args: 0
  try:
    yield
  finally:
    api_module.gather_early = pass_


def _ints(rng, shape, dtype=np.float32):
  # small integers: every sum of products is exact in f32, so a partial sum
  # and its psum equal the one-device value bit for bit
  return rng.integers(-3, 4, shape).astype(dtype)


def _momentum_step(w, mom, x):
  g = jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)
  mom2 = 0.5 * mom + g
  return w - 0.25 * mom2, mom2


def test_sgd_momentum_of_a_split_gradient_gathers_it_once():
  """The kernel is replicated, its input features split over model: the
  kernel's gradient comes out split on its rows. The momentum and the kernel
  (both replicated state) are its elementwise tail: one all-gather of the
  gradient where there were two (the momentum's and the update's)."""
  m = mesh((2, 4), ("data", "model"))
  rng = np.random.default_rng(0)
  w, mom, x = _ints(rng, (32, 10)), _ints(rng, (32, 10)), _ints(rng, (16, 32))
  specs = (P(), P(), P("data", "model"))
  step = gshard.partition(_momentum_step, m, in_specs=specs)
  got, want = step(w, mom, x), jax.jit(_momentum_step)(w, mom, x)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  low = step.lower(w, mom, x)
  gathers = [c for c in low.collectives() if c.kind == "all_gather"]
  assert [c.bytes for c in gathers] == [3 * 32 * 10 * 4 // 4], low.explain()
  with _gathered_where_it_ends():
    before = gshard.partition(_momentum_step, m, in_specs=specs).lower(w, mom, x)
  assert [c.bytes for c in before.collectives() if c.kind == "all_gather"] == [960, 960]
  assert low.total_bytes() == before.total_bytes() - 960
  # the tail runs in the outputs' layout
  assert {str(s) for s in low.out_shardings} == {str(low.in_shardings[0])}


def test_adam_state_of_a_split_gradient_gathers_it_once():
  """optax.adam, every leaf of the state replicated: the first and second
  moments and the kernel all come from the split gradient elementwise; the
  gradient is gathered once (adam's tail reads it twice: g and g*g)."""
  m = mesh((2, 4), ("data", "model"))
  rng = np.random.default_rng(1)
  w, x = _ints(rng, (32, 10)), _ints(rng, (16, 32))
  opt = optax.adam(1e-2)
  state = opt.init(w)

  def step(w, state, x):
    g = jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)
    u, state = opt.update(g, state, w)
    return optax.apply_updates(w, u), state

  specs = (P(), jax.tree.map(lambda _: P(), state), P("data", "model"))
  part = gshard.partition(step, m, in_specs=specs)
  got, want = part(w, state, x), jax.jit(step)(w, state, x)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  low = part.lower(w, state, x)
  gathers = [c for c in low.collectives() if c.kind == "all_gather"]
  assert [c.bytes for c in gathers] == [960], low.explain()
  with _gathered_where_it_ends():
    before = gshard.partition(step, m, in_specs=specs).lower(w, state, x)
  assert len([c for c in before.collectives() if c.kind == "all_gather"]) >= 2
  assert low.total_bytes() < before.total_bytes()


def test_a_sink_reading_several_values_of_the_tail_is_one_gather_now():
  """A clamp whose result leaves replicated (``out_specs``) reads three
  values computed split from two contractions. Without the pass, the clamp
  runs split and its one result is gathered; moving the tail would gather
  both contractions' results instead: more bytes, so it stays."""
  m = mesh((2, 4), ("data", "model"))
  rng = np.random.default_rng(2)
  x, k1, k2 = _ints(rng, (16, 32)), _ints(rng, (16, 10)), _ints(rng, (16, 10))

  def fn(x, k1, k2):
    g1, g2 = x.T @ k1, x.T @ k2
    return jax.lax.clamp(g1 * 2.0, g2, g1 * 3.0)

  kw = dict(in_specs=(P("data", "model"), P("data"), P("data")), out_specs=P())
  step = gshard.partition(fn, m, **kw)
  np.testing.assert_array_equal(np.asarray(step(x, k1, k2)),
                                np.asarray(jax.jit(fn)(x, k1, k2)))
  low = step.lower(x, k1, k2)
  with _gathered_where_it_ends():
    before = gshard.partition(fn, m, **kw).lower(x, k1, k2)
  assert low.total_bytes() == before.total_bytes(), (low.explain(), before.explain())


_OPS = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "max": jnp.maximum,
    "where": lambda a, b: jnp.where(a > b, a, b * 2),
    "clamp": lambda a, b: jax.lax.clamp(a * 2, b, a * 3),
}


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_an_elementwise_tail_equals_one_device_and_sends_no_more(data):
  """Random meshes, a value split over one or two axes (a contraction or an
  elementwise product of a split input), random elementwise tails over it and replicated state (two to four
  outputs, the next values of replicated inputs; f32 with NaNs and infs, or
  int32): every output equals jax.jit's bit for bit, NaN positions included,
  and the program sends no more bytes than gathering where the tail ends."""
  shape, names = data.draw(st.sampled_from([((8,), ("x",)), ((2, 4), ("x", "y")),
                                            ((4, 2), ("x", "y"))]), label="mesh")
  m = mesh(shape, names)
  axes = data.draw(st.sampled_from([(n,) for n in names] + ([tuple(names)] if len(names) > 1
                                                              else [])), label="axes")
  dim = data.draw(st.sampled_from([0, 1]), label="split dim")
  dtype = data.draw(st.sampled_from([np.float32, np.int32]), label="dtype")
  n_state = data.draw(st.integers(2, 4), label="state")
  rows = 8 * data.draw(st.integers(1, 3), label="rows")
  rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
  vals = rng.integers(-4, 5, (rows, 6)).astype(dtype)
  if dtype == np.float32:
    flat = vals.reshape(-1)
    flat[rng.choice(flat.size, 3, replace=False)] = [np.nan, np.inf, -np.inf]
  states = [rng.integers(-4, 5, (rows, 6)).astype(dtype) for _ in range(n_state)]
  # each state's next value: an op of the split value (or an earlier next
  # value) and the state, then maybe one more op
  # (scaled: the state times a constant first, as optimizers decay it; a
  # value computed from the state is not pinned by its annotation)
  plan = [(data.draw(st.sampled_from(sorted(_OPS)), label=f"op {k}"),
           data.draw(st.integers(-1, k - 1), label=f"reads {k}"),
           data.draw(st.booleans(), label=f"swap {k}"),
           data.draw(st.sampled_from([True, True, False]), label=f"scaled {k}"))
          for k in range(n_state)]

  source = data.draw(st.sampled_from(["dot", "dot", "elementwise"]), label="source")
  kernel = rng.integers(-2, 3, (6, 6)).astype(dtype)

  def step(*args):     # the states first: output k is the next value of input k
    *states, x = args
    # the split value: computed by a contraction (resharded once where it is
    # produced), or elementwise from the split input (gathered per reader)
    g = x @ kernel if source == "dot" else x * x - x
    out = []
    for (op, reads, swap, scaled), s in zip(plan, states):
      a = g if reads < 0 else out[reads]
      s = s * 2 if scaled else s
      out.append(_OPS[op](s, a) if swap else _OPS[op](a, s))
    return tuple(out)

  spec = [None, None]
  spec[dim] = axes if len(axes) > 1 else axes[0]
  specs = (P(),) * n_state + (P(*spec),)
  # the outputs leave as the next values of the replicated states, or
  # replicated by out_specs (then no annotation pins the tail's values)
  kw = dict(in_specs=specs, out_specs=data.draw(st.sampled_from([None, P()]), label="out"))
  part = gshard.partition(step, m, **kw)
  got, want = part(*states, vals), jax.jit(step)(*states, vals)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  low = part.lower(*states, vals)
  with _gathered_where_it_ends():
    before = gshard.partition(step, m, **kw).lower(*states, vals)
  assert low.total_bytes() <= before.total_bytes(), (low.explain(), before.explain())
