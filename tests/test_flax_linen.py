"""Public-style Flax Linen code, partitioned as a new user would.

* a decoder LM whose params carry logical partitioning metadata
  (``nn.with_logical_partitioning``) and whose activations carry
  ``nn.with_logical_constraint`` (both emit ``with_sharding_constraint``
  under ``jax.set_mesh`` + ``nn.logical_axis_rules``), trained with optax Adam;
* a small ResNet with BatchNorm (mutable ``batch_stats``) and SGD with
  momentum, data parallel and with output channels split over ``model``.

Each step equals ``jax.jit`` of the same step on one device to float32
rounding (derived bound below), takes no safe path, is traced once for two
calls, and cites this file (not flax) in ``explain()``.

Tolerance: the partitioned and one-device steps differ only in the order of
the float32 sums (over at most 8 devices) inside each reduction. Adam divides
by the gradient's own size, which amplifies that rounding where a gradient is
near zero, so the LM's steps are checked with ``helpers_numerics``' derived
bound, each step from the same input state. One step of SGD with momentum
(lr 0.1) moves a parameter by at most lr * O(1), so a difference of a few ulps
of the update, ~8 * 2**-24 * lr * 10, bounds the ResNet's parameters: we allow
1e-6 absolute on parameters of size O(1) and the same relative on the loss.
"""

from __future__ import annotations

import re
import warnings

import flax.linen as nn
import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import gshard
from helpers_numerics import AdamSpec, assert_close_to_f64, f64_run, to_host
from helpers_partition import mesh

RULES = (("batch", "data"), ("embed", None), ("mlp", "model"), ("heads", "model"),
         ("vocab", "model"), ("length", None))
TOL = 1e-6
# where (params, opt_state, loss) keeps Adam's moments, for the derived bound
ADAM_SPEC = AdamSpec(params="[0]", mu="[1][0].mu", nu="[1][0].nu", count="[1][0].count",
                     lr=1e-2)


class Block(nn.Module):
  d: int
  h: int

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.lecun_normal()
    y = nn.LayerNorm()(x)
    q = nn.Dense(self.d, kernel_init=nn.with_logical_partitioning(init, ("embed", "heads")))(y)
    q = q.reshape(q.shape[:-1] + (4, self.d // 4))
    a = nn.dot_product_attention(q, q, q).reshape(y.shape)
    x = x + nn.Dense(self.d, kernel_init=nn.with_logical_partitioning(init, ("heads", "embed")))(a)
    y = nn.Dense(self.h, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(
        nn.LayerNorm()(x))
    y = nn.with_logical_constraint(nn.gelu(y), ("batch", "length", "mlp"))
    return x + nn.Dense(self.d, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(y)


class LM(nn.Module):
  vocab: int = 64
  d: int = 32

  @nn.compact
  def __call__(self, tok):
    emb = nn.Embed(self.vocab, self.d, embedding_init=nn.with_logical_partitioning(
        nn.initializers.normal(1.0), ("vocab", "embed")))
    x = nn.with_logical_constraint(emb(tok), ("batch", "length", "embed"))
    for _ in range(2):
      x = Block(self.d, 64)(x)
    return emb.attend(nn.LayerNorm()(x))


class ResNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.BatchNorm(use_running_average=False)(nn.Conv(8, (3, 3))(x)))
    y = nn.BatchNorm(use_running_average=False)(nn.Conv(8, (3, 3))(x))
    x = nn.max_pool(nn.relu(x + y), (2, 2), (2, 2))
    return nn.Dense(10)(x.mean(axis=(1, 2)))


def _close(got, want):
  for g, w in zip(jax.tree.leaves(gshard.unpad(got)), jax.tree.leaves(want)):
    g, w = np.asarray(g), np.asarray(w)
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_allclose(g, w, rtol=TOL, atol=TOL)


def _run_twice(step, m, args, in_specs):
  with warnings.catch_warnings():
    warnings.simplefilter("error", gshard.PartitionWarning)
    part = gshard.partition(step, m, in_specs=in_specs)
    first = part(*args)
    second = part(*first[:len(first) - 1], *args[len(first) - 1:])
  assert len(part._cache) == 1, "the second call traced again"
  return part, first, second


def test_linen_lm_with_logical_partitioning_and_adam():
  m = mesh((2, 4), ("data", "model"))
  model, opt = LM(), optax.adam(1e-2)
  tok = np.random.default_rng(0).integers(0, 64, (8, 16)).astype(np.int32)
  with jax.set_mesh(m), nn.logical_axis_rules(RULES):
    boxed = model.init(jax.random.PRNGKey(0), tok)
    specs = nn.logical_to_mesh(nn.get_partition_spec(boxed))
    params = nn.unbox(boxed)

    def step(params, opt_state, tok):
      def loss(p):
        logits = model.apply(p, tok)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1],
                                                               tok[:, 1:]).mean()
      value, grads = jax.value_and_grad(loss)(params)
      updates, opt_state = opt.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, value

    args = (params, opt.init(params), tok)
    part, got, got2 = _run_twice(step, m, args, (specs, None, P("data")))
    # each partitioned step against the reference steps from the same input
    # state; the longest sum: a weight gradient's, over the 8 x 16 tokens
    ref, exact = jax.jit(step), jax.jit(step)        # exact: traced in f64
    for i, (state, out) in enumerate(((args[:2], got), (got[:2], got2))):
      state = to_host(gshard.unpad(tuple(state)))
      out = gshard.unpad(out)
      want = ref(*state, tok)
      assert jax.tree.map(lambda a: a.dtype, out) == jax.tree.map(lambda a: a.dtype, want)
      assert_close_to_f64(out, want, f64_run(exact, *state, tok), n=tok.size, old=state,
                          adam=ADAM_SPEC, what=f"step {i}: ")
    # the embedding stays vocab-split: never gathered
    emb = got[0]["params"]["Embed_0"]["embedding"]
    assert emb.sharding.spec[0] == "model"
    report = part.lower(*args).explain()
  assert re.search(r"test_flax_linen\.py:\d+:\d+ \(Block\.__call__\) via flax/linen/linear\.py",
                   report), report


def test_resnet_with_batchnorm_data_and_channel_parallel():
  m = mesh((2, 4), ("data", "model"))
  model, opt = ResNet(), optax.sgd(0.1, momentum=0.9)
  x = np.random.default_rng(0).standard_normal((8, 8, 8, 3)).astype(np.float32)
  labels = np.arange(8) % 10
  v = model.init(jax.random.PRNGKey(0), x)

  def step(params, stats, opt_state, x, labels):
    def loss(p):
      logits, upd = model.apply({"params": p, "batch_stats": stats},
                                gshard.split(x, 0, "data"), mutable=["batch_stats"])
      return (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(),
              upd["batch_stats"])
    (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), stats, opt_state, value

  args = (v["params"], v["batch_stats"], opt.init(v["params"]), x, labels)
  want = jax.jit(step)(*args)
  channels = jax.tree.map(lambda a: P(*([None] * (a.ndim - 1) + ["model"]))
                          if a.shape[-1] % 4 == 0 else P(), v["params"])
  for specs in (None, (channels, None, None, P("data"), P("data"))):
    part, got, _ = _run_twice(step, m, args, specs)
    _close(got, want)
  # channel-split convs and their weight gradients agree on one layout: the
  # gradient takes the layout of its update, never an all-to-all between them
  kinds = {c.kind for c in part.lower(*args).collectives()}
  assert "all_to_all" not in kinds, kinds
