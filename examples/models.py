"""Small models for the examples, tests and benchmarks: a Megatron MLP and a
GPT-style Transformer, in plain JAX with a few gshard annotations.

Annotations (GShard practice: annotate inputs and a few key tensors):
  - activations split on the batch over ``data``;
  - attention heads and the MLP hidden dim split over ``model``;
  - the embedding table split on its vocabulary over ``model``.
Run on one device, the annotations are identities.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import gshard


def synthetic_batch(key, batch: int, seq: int, vocab: int):
  """Sequences that count up by a per-sequence stride: learnable from context."""
  k1, k2 = jax.random.split(key)
  start = jax.random.randint(k1, (batch, 1), 0, vocab)
  stride = jax.random.randint(k2, (batch, 1), 1, 4)
  seqs = (start + stride * jnp.arange(seq + 1)[None, :]) % vocab
  return seqs[:, :-1].astype(jnp.int32), seqs[:, 1:].astype(jnp.int32)


# -- Megatron MLP -------------------------------------------------------------

def mlp_init(key, d_model: int = 64, d_hidden: int = 256):
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (d_model, d_hidden)) / d_model ** 0.5,
          "w2": jax.random.normal(k2, (d_hidden, d_model)) / d_hidden ** 0.5}


MLP_SPECS = {"w1": P(None, "model"), "w2": P("model", None)}


def mlp_loss(params, x, y):
  """Mean squared error of ``gelu(x @ w1) @ w2``; x, y: f32[B, D]."""
  x = gshard.split(x, 0, "data")
  h = jax.nn.gelu(x @ params["w1"])
  out = h @ params["w2"]
  return jnp.mean((out - y) ** 2)


def sgd_step(loss_fn, lr: float = 0.1):
  def step(params, *batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss
  return step


# -- GPT-style Transformer ----------------------------------------------------

def gpt_init(key, vocab: int = 128, d_model: int = 64, n_heads: int = 4,
             n_layers: int = 2, d_ff: int = 256):
  d_head = d_model // n_heads
  keys = iter(jax.random.split(key, 1 + 6 * n_layers))

  def normal(shape, fan_in):
    return jax.random.normal(next(keys), shape) / fan_in ** 0.5

  layers = []
  for _ in range(n_layers):
    layers.append({
        "ln1": jnp.ones((d_model,)), "ln2": jnp.ones((d_model,)),
        "wq": normal((d_model, n_heads, d_head), d_model),
        "wk": normal((d_model, n_heads, d_head), d_model),
        "wv": normal((d_model, n_heads, d_head), d_model),
        "wo": normal((n_heads, d_head, d_model), d_model),
        "w1": normal((d_model, d_ff), d_model),
        "w2": normal((d_ff, d_model), d_ff),
    })
  return {"embed": normal((vocab, d_model), d_model), "layers": layers,
          "ln_f": jnp.ones((d_model,))}


def gpt_specs(params):
  """PartitionSpecs for the parameters: heads, d_ff and vocabulary on ``model``."""
  layer = {"ln1": P(), "ln2": P(), "wq": P(None, "model"), "wk": P(None, "model"),
           "wv": P(None, "model"), "wo": P("model"), "w1": P(None, "model"),
           "w2": P("model")}
  return {"embed": P("model"), "layers": [dict(layer) for _ in params["layers"]],
          "ln_f": P()}


def _layer_norm(x, scale):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale


def _pin(x, spec, annotate: bool):
  return gshard.shard(x, spec) if annotate else x


def _attention(x, layer, annotate: bool = True):
  b, t, _ = x.shape
  q = jnp.einsum("btd,dhk->bthk", x, layer["wq"])
  k = jnp.einsum("btd,dhk->bthk", x, layer["wk"])
  v = jnp.einsum("btd,dhk->bthk", x, layer["wv"])
  q = _pin(q, P("data", None, "model", None), annotate)
  scores = jnp.einsum("bqhk,bthk->bhqt", q, k) / q.shape[-1] ** 0.5
  causal = jnp.tril(jnp.ones((t, t), dtype=bool))
  scores = jnp.where(causal, scores, -1e9)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bhqt,bthk->bqhk", probs, v)
  return jnp.einsum("bqhk,hkd->bqd", out, layer["wo"])


def gpt_logits(params, tokens, annotate: bool = True):
  """tokens: i32[B, T] -> logits f32[B, T, V]; ``annotate=False``: no gshard
  annotations at all (for ``gshard.auto_shard`` to find the layouts)."""
  if annotate:
    tokens = gshard.split(tokens, 0, "data")
  x = params["embed"][tokens]
  for layer in params["layers"]:
    x = x + _attention(_layer_norm(x, layer["ln1"]), layer, annotate)
    h = jax.nn.gelu(_layer_norm(x, layer["ln2"]) @ layer["w1"])
    h = _pin(h, P("data", None, "model"), annotate)
    x = x + h @ layer["w2"]
  x = _layer_norm(x, params["ln_f"])
  return x @ params["embed"].T


def gpt_loss(params, tokens, targets, annotate: bool = True):
  """Mean next-token cross-entropy; tokens, targets: i32[B, T]."""
  logits = gpt_logits(params, tokens, annotate)
  logp = jax.nn.log_softmax(logits, axis=-1)
  gold = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return -gold.mean()


# -- the same Transformer with its layers stacked and scanned (MaxText style) --

def gpt_scan_init(key, vocab: int = 128, d_model: int = 64, n_heads: int = 4,
                  n_layers: int = 2, d_ff: int = 256):
  """Like :func:`gpt_init`, with the layers stacked on a leading dim."""
  p = gpt_init(key, vocab, d_model, n_heads, n_layers, d_ff)
  layers = jax.tree.map(lambda *xs: jnp.stack(xs), *p["layers"])
  return {"embed": p["embed"], "layers": layers, "ln_f": p["ln_f"]}


def gpt_scan_specs(params):
  """The specs of :func:`gpt_specs`, with the stacked (layer) dim unsplit."""
  del params
  layer = {"ln1": P(), "ln2": P(), "wq": P(None, None, "model"),
           "wk": P(None, None, "model"), "wv": P(None, None, "model"),
           "wo": P(None, "model"), "w1": P(None, None, "model"), "w2": P(None, "model")}
  return {"embed": P("model"), "layers": layer, "ln_f": P()}


def gpt_scan_loss(params, tokens, targets):
  """:func:`gpt_loss` with ``lax.scan`` over the stacked layers."""
  tokens = gshard.split(tokens, 0, "data")
  x = params["embed"][tokens]

  def layer_fn(x, layer):
    x = x + _attention(_layer_norm(x, layer["ln1"]), layer)
    h = jax.nn.gelu(_layer_norm(x, layer["ln2"]) @ layer["w1"])
    h = gshard.shard(h, P("data", None, "model"))
    return x + h @ layer["w2"], None

  x, _ = jax.lax.scan(layer_fn, x, params["layers"])
  logits = _layer_norm(x, params["ln_f"]) @ params["embed"].T
  logp = jax.nn.log_softmax(logits, axis=-1)
  gold = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return -gold.mean()
