"""Pending partial sums through ``lax.cond`` / ``lax.switch``.

A cond's result stays a pending sum over the axes every branch leaves its
result pending (a branch returning zeros, ``lax.cond(p, f, zeros)``, any): a
weight gradient computed under a cond inside a loop (the pipeline's ticks)
is then summed once, after the loop, not once per step. Where the branches
disagree (one pending, one complete; pending over different axes), each
branch resolves its own sum before the cond returns.

Every program equals ``jax.jit`` of it on one device, bit for bit (small
integers in float32 and int32: every order of the sums is exact), dtypes
included.
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import PartitionSpec as P

import gshard
from helpers_partition import mesh

pytestmark = pytest.mark.filterwarnings("error::gshard.PartitionWarning")


def eqns_of(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from eqns_of(sub)


def vector_psums(jaxpr, n: int):
  """The psums of an ``[n]`` value (the branches' sums) in ``jaxpr``."""
  return [e for e in eqns_of(jaxpr) if e.primitive.name in ("psum", "psum2")
          and e.invars[0].aval.shape == (n,)]


# what a branch returns, from x, z: [6, 16] (dim 1 split, z's maybe over other
# axes) and c: [6] (complete)
BRANCHES = {
    "sum": lambda x, z, c: jnp.sum(x * 2, axis=1),        # pending over x's axes
    "neg_sum": lambda x, z, c: -jnp.sum(x, axis=1),       # pending too
    "sum_z": lambda x, z, c: jnp.sum(z, axis=1),          # pending over z's axes
    "zeros": lambda x, z, c: jnp.zeros((6,), x.dtype),    # any
    "value": lambda x, z, c: c * 3,                       # complete
    "affine": lambda x, z, c: jnp.sum(x, axis=1) + 1,     # complete (resolved first)
}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_sum_under_cond_equals_one_device(data):
  """Random meshes and splits of the summed dim, 2 or 3 branches of every
  kind above, the cond's result accumulated in a scan, passed through a
  non-linear op, or returned; the index per step or fixed. Equal to one
  device bit for bit. Where every branch is a sum over the same split or
  zeros and the result only accumulates, no psum of the sum runs in the loop:
  one after it. Branches pending over different axes (x's and z's) keep
  pending the axes both do and sum the others each in its own branch."""
  shape, names = data.draw(st.sampled_from([((8,), ("x",)), ((2, 4), ("x", "y")),
                                            ((4, 2), ("x", "y"))]), label="mesh")
  axes = data.draw(st.sampled_from([names[:1], names[-1:], names]), label="axes")
  z_axes = data.draw(st.sampled_from([names[:1], names[-1:], names]), label="z axes")
  dtype = data.draw(st.sampled_from([np.float32, np.int32]), label="dtype")
  kinds = data.draw(st.lists(st.sampled_from(sorted(BRANCHES)), min_size=2, max_size=3),
                    label="branches")
  use = data.draw(st.sampled_from(["accumulate", "tanh", "ys"]), label="use")
  length = data.draw(st.integers(1, 4), label="length")
  rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
  xs = rng.integers(-3, 4, (length, 6, 16)).astype(dtype)
  z = rng.integers(-3, 4, (6, 16)).astype(dtype)
  c = rng.integers(-3, 4, (6,)).astype(dtype)
  idx = rng.integers(0, len(kinds), (length,)).astype(np.int32)

  def f(xs, z, c, idx):
    def body(acc, step):
      x, i = step
      u = lax.switch(i, [lambda x, z, c, k=k: BRANCHES[k](x, z, c) for k in kinds], x, z, c)
      if use == "accumulate":
        return acc + u, None
      if use == "tanh":
        return acc, jnp.tanh(u.astype(np.float32))
      return acc, u
    return lax.scan(body, jnp.zeros((6,), dtype), (xs, idx))

  spec = P(None, None, axes if len(axes) > 1 else axes[0])
  z_spec = P(None, z_axes if len(z_axes) > 1 else z_axes[0])
  step = gshard.partition(f, mesh(shape, names), in_specs=(spec, z_spec, P(), P()))
  got, want = step(xs, z, c, idx), jax.jit(f)(xs, z, c, idx)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  summed = {k for k in kinds if k in ("sum", "neg_sum")}
  if use == "accumulate" and summed and set(kinds) <= summed | {"zeros"} and length > 1:
    body = step.lower(xs, z, c, idx).per_device_jaxpr()
    (scan,) = [e for e in eqns_of(body) if e.primitive.name == "scan"]
    assert not vector_psums(scan.params["jaxpr"].jaxpr, 6), body
    assert len(vector_psums(body, 6)) == 1, body


def _grad_under_cond(w, xs, ys, on):
  """Per step, the weight gradient of a micro-batch where ``on``, zeros
  elsewhere (the pipeline's ``lax.cond(run, backward, zeros)``), summed."""
  def body(g, step):
    x, y, run = step
    dw = lax.cond(run, lambda: jax.grad(lambda w: jnp.sum((jnp.tanh(x @ w) - y) ** 2))(w),
                  lambda: jnp.zeros_like(w))
    return g + dw, None
  g, _ = lax.scan(body, jnp.zeros_like(w), (xs, ys, on))
  return w - 0.1 * g


def test_a_gradient_under_cond_in_a_loop_is_summed_once_after_it():
  """Micro-batches split on data, the gradient under a cond: one all-reduce
  of the gradient after the loop (one gradient's bytes), none per step."""
  rng = np.random.default_rng(0)
  w = (rng.standard_normal((16, 16)) / 4).astype(np.float32)
  xs = rng.standard_normal((4, 8, 16)).astype(np.float32)
  ys = rng.standard_normal((4, 8, 16)).astype(np.float32)
  on = np.array([True, False, True, True])
  step = gshard.partition(_grad_under_cond, mesh((8,), ("data",)),
                          in_specs=(P(), P(None, "data"), P(None, "data"), P()))
  got = step(w, xs, ys, on)
  np.testing.assert_allclose(got, jax.jit(_grad_under_cond)(w, xs, ys, on),
                             rtol=1e-5, atol=1e-5)
  low = step.lower(w, xs, ys, on)
  assert low.total_bytes() == 2 * 7 * (16 * 16 * 4) // 8, low.explain()   # one all-reduce
  assert all(c.repeat == 1 for c in low.collectives()), low.explain()


@pytest.mark.parametrize("pinned", ["out_specs", "state", "annotation"])
def test_a_pending_sum_two_pinned_cond_results_read_is_summed_once(pinned):
  """A branch returns a pending sum X twice ((X, 2X)), and both cond results
  are pinned (out_specs, the next value of an input, an annotation): the
  branch sums them in itself, and propagation prices those sums, so it sums
  X once where it is made (one psum, not one per result)."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, 16)).astype(np.float32)
  w = rng.standard_normal((16, 16)).astype(np.float32)
  state = (np.zeros((8, 16), np.float32), np.ones((8, 16), np.float32))

  def f(state, x, w, p):
    def branch(x, w):
      y = x @ w                         # pending over model
      return y, y * 2
    out = lax.cond(p, branch, lambda x, w: state, x, w)
    return tuple(gshard.replicate(o) for o in out) if pinned == "annotation" else out

  step = gshard.partition(f, mesh((2, 4), ("data", "model")),
                          in_specs=(P(), P(None, "model"), P("model"), P()),
                          out_specs=(P(), P()) if pinned == "out_specs" else None)
  for p in (True, False):
    got, want = step(state, x, w, p), jax.jit(f)(state, x, w, p)
    for g, v in zip(got, want):
      np.testing.assert_allclose(g, v, rtol=1e-5, atol=1e-5)
  low = step.lower(state, x, w, True)
  # one sum of X (a psum, or a reduce-scatter where both results are returned
  # split: the first is x's next value, the second follows it through the cond)
  ((kind, axes),) = [(c.kind, c.axes) for c in low.collectives()]
  assert kind in ("psum", "psum_scatter") and axes == ("model",), low.explain()
