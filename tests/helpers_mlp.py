"""The two-layer MLP train steps the layout tests draw layouts for
(test_update_layout, test_reader_layout): ``x [32, 64] @ w1 [64, 128]``,
relu, ``@ w2 [128, 64]``, a squared-sum loss, and several updates."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gshard
import helpers_partition
from gshard.spmd import propagate

# each dim unsplit or split over a, b, (a, b) or (b, a) of a 2x4 mesh
CHOICES = (None, "a", "b", ("a", "b"), ("b", "a"))


def grad(p, x):
  def loss(p):
    h = jax.nn.relu(x @ p["w1"])
    return jnp.sum((h @ p["w2"]) ** 2)
  return jax.grad(loss)(p)


def sgd(p, x):
  return jax.tree.map(lambda w, g: w - 0.01 * g, p, grad(p, x))


def clipped(p, x):      # the gradients also read by their global norm
  g = grad(p, x)
  s = jnp.minimum(1.0, 1.0 / optax.tree.norm(g))
  return jax.tree.map(lambda w, g: w - 0.01 * g * s, p, g)


def decayed(p, x):      # the weight read by its own update
  return jax.tree.map(lambda w, g: w - 0.01 * (g + 0.1 * w), p, grad(p, x))


def adam(p, x):         # moments made from the gradient, then the update
  opt = optax.adam(1e-2)
  updates, _ = opt.update(grad(p, x), opt.init(p), p)
  return optax.apply_updates(p, updates)


def leaky(p, x):        # jnp.where (a jit call) and tanh: values of calls run inline
  def loss(p):
    h = x @ p["w1"]
    h = jnp.where(h > 0, h, 0.1 * jnp.tanh(h))
    return jnp.sum((h @ p["w2"]) ** 2)
  return jax.tree.map(lambda w, g: w - 0.01 * g, p, jax.grad(loss)(p))


STEPS = {"sgd": sgd, "clipped": clipped, "decayed": decayed, "adam": adam, "leaky": leaky}


def args():
  k = np.random.default_rng(0)
  p = {"w1": jnp.asarray(k.standard_normal((64, 128)) / 8, jnp.float32),
       "w2": jnp.asarray(k.standard_normal((128, 64)) / 8, jnp.float32)}
  return p, jnp.asarray(k.standard_normal((32, 64)), jnp.float32)


def check_never_sends_more(pass_name: str, fn, w1, w2, x, pin: str, close) -> None:
  """``fn`` partitioned over the 2x4 mesh (weights ``w1``, ``w2`` pinned by
  ``in_specs``, ``out_specs`` or both as ``pin`` says; ``x`` by ``in_specs``)
  sends no more bytes than with propagation's ``pass_name`` left out, and
  gives ``jax.jit``'s values (``close(got, want)``)."""
  p, xs = args()
  weights = {"w1": w1, "w2": w2}
  specs = (None if pin == "out only" else weights, x)
  out = None if pin == "in" else weights
  m = helpers_partition.mesh((2, 4), ("a", "b"))
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(propagate, pass_name, lambda graph, touching: None)
    before = gshard.partition(fn, m, in_specs=specs, out_specs=out).lower(p, xs)
    before = before.total_bytes()
  part = gshard.partition(fn, m, in_specs=specs, out_specs=out)
  assert part.lower(p, xs).total_bytes() <= before
  close(part(p, xs), jax.jit(fn)(p, xs))
