"""Train a small Transformer whose every other feed-forward layer is a GShard MoE.

Eight simulated CPU devices. The batch is split over ``expert`` (data
parallelism for attention and the dense layers; each sequence is one group of
tokens for the gating), and the experts are split over ``expert`` too, so the
MoE layers move tokens to their experts and back with all-to-alls
(gshard/moe/layer.py). With ``--mesh 4x2`` a second axis ``model`` splits the
attention heads, the dense hidden dim, the vocabulary and each expert's
hidden dim (Megatron style inside every expert).

The model is plain JAX with gshard annotations; ``gshard.partition`` turns the
whole Adam train step into one per-device program. Routing is random (the
paper's second-expert policy) with a key passed to the step, so a run is
reproducible.

Run: ``python examples/moe_transformer.py [--mesh 8|4x2|2x4] [--steps N]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import gshard  # noqa: E402
from examples import models  # noqa: E402
from gshard.moe import moe_apply, moe_init, moe_specs  # noqa: E402


# -- the model ------------------------------------------------------------------

def init(key, *, vocab: int = 128, d_model: int = 64, n_heads: int = 4,
         n_layers: int = 4, d_ff: int = 256, num_experts: int = 8,
         d_expert: int = 128):
  """Parameters: layers 1, 3, ... have an MoE instead of the dense FFN (GShard)."""
  d_head = d_model // n_heads
  keys = iter(jax.random.split(key, 1 + 7 * n_layers))

  def normal(shape, fan_in):
    return jax.random.normal(next(keys), shape) / fan_in ** 0.5

  layers = []
  for i in range(n_layers):
    layer = {"ln1": jnp.ones((d_model,)), "ln2": jnp.ones((d_model,)),
             "wq": normal((d_model, n_heads, d_head), d_model),
             "wk": normal((d_model, n_heads, d_head), d_model),
             "wv": normal((d_model, n_heads, d_head), d_model),
             "wo": normal((n_heads, d_head, d_model), d_model)}
    if i % 2:
      layer["moe"] = moe_init(next(keys), d_model, d_expert, num_experts)
    else:
      layer["w1"] = normal((d_model, d_ff), d_model)
      layer["w2"] = normal((d_ff, d_model), d_ff)
    layers.append(layer)
  return {"embed": normal((vocab, d_model), d_model), "layers": layers,
          "ln_f": jnp.ones((d_model,))}


def specs(params, expert_axis="expert", model_axis=None):
  """PartitionSpecs: experts on ``expert_axis``; heads, d_ff, vocab and each
  expert's hidden dim on ``model_axis`` (if given); the rest replicated."""
  m = model_axis
  out = []
  for layer in params["layers"]:
    s = {"ln1": P(), "ln2": P(), "wq": P(None, m), "wk": P(None, m), "wv": P(None, m),
         "wo": P(m)}
    if "moe" in layer:
      s["moe"] = moe_specs(expert_axis, model_axis)
    else:
      s["w1"], s["w2"] = P(None, m), P(m)
    out.append(s)
  return {"embed": P(m), "layers": out, "ln_f": P()}


def _layer_norm(x, scale):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale


def _attention(x, layer, batch_axis, model_axis):
  t = x.shape[1]
  q = jnp.einsum("btd,dhk->bthk", x, layer["wq"])
  k = jnp.einsum("btd,dhk->bthk", x, layer["wk"])
  v = jnp.einsum("btd,dhk->bthk", x, layer["wv"])
  q = gshard.shard(q, P(batch_axis, None, model_axis, None))
  scores = jnp.einsum("bqhk,bthk->bhqt", q, k) / q.shape[-1] ** 0.5
  scores = jnp.where(jnp.tril(jnp.ones((t, t), dtype=bool)), scores, -1e9)
  out = jnp.einsum("bhqt,bthk->bqhk", jax.nn.softmax(scores, axis=-1), v)
  return jnp.einsum("bqhk,hkd->bqd", out, layer["wo"])


def forward(params, tokens, key, *, expert_axis="expert", model_axis=None,
            capacity_factor: float = 2.0, second_policy: str = "random"):
  """tokens i32[B, T] -> (logits f32[B, T, V], aux loss, per-MoE-layer metrics).

  Each sequence is one gating group (G = B, S = T): B must be a multiple of
  the number of devices on ``expert_axis``.
  """
  tokens = gshard.split(tokens, 0, expert_axis)
  x = params["embed"][tokens]
  aux, metrics = 0.0, []
  for i, layer in enumerate(params["layers"]):
    x = x + _attention(_layer_norm(x, layer["ln1"]), layer, expert_axis, model_axis)
    h = _layer_norm(x, layer["ln2"])
    if "moe" in layer:
      y, layer_aux, m = moe_apply(layer["moe"], h, expert_axis=expert_axis,
                                  model_axis=model_axis, key=jax.random.fold_in(key, i),
                                  capacity_factor=capacity_factor,
                                  second_policy=second_policy,
                                  activation=jax.nn.gelu, aux_loss_scaling="lingvo")
      aux, metrics = aux + layer_aux, metrics + [m]
    else:
      h = gshard.shard(jax.nn.gelu(h @ layer["w1"]), P(expert_axis, None, model_axis))
      y = h @ layer["w2"]
    x = x + y          # the residual: how tokens an expert dropped pass through
  x = _layer_norm(x, params["ln_f"])
  return x @ params["embed"].T, aux, metrics


def loss_fn(params, tokens, targets, key, *, aux_weight: float = 1e-2, **kw):
  """Next-token cross-entropy + aux_weight * the sum of the MoE aux losses.

  Returns (loss, (cross_entropy, aux_loss, metrics)).
  """
  logits, aux, metrics = forward(params, tokens, key, **kw)
  logp = jax.nn.log_softmax(logits, axis=-1)
  ce = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0].mean()
  return ce + aux_weight * aux, (ce, aux, metrics)


def make_step(optimizer, **kw):
  """One Adam step: (params, opt_state, tokens, targets, key) ->
  (params, opt_state, loss, (ce, aux, metrics))."""
  def step(params, opt_state, tokens, targets, key):
    (loss, extra), grads = jax.value_and_grad(
        lambda p: loss_fn(p, tokens, targets, key, **kw), has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, extra
  return step


# -- training -------------------------------------------------------------------

def train(mesh_shape=(8,), steps: int = 30, batch: int = 16, seq: int = 32,
          vocab: int = 128, log_every: int = 5, verbose: bool = True):
  """Train; returns (losses, lowered step) ."""
  names = ("expert", "model")[:len(mesh_shape)]
  mesh = gshard.make_mesh(mesh_shape, names)
  model_axis = "model" if len(mesh_shape) == 2 else None
  num_experts = mesh_shape[0]
  params = init(jax.random.PRNGKey(0), vocab=vocab, num_experts=num_experts)
  optimizer = optax.adam(3e-3)
  opt_state = optimizer.init(params)
  step = gshard.partition(
      make_step(optimizer, model_axis=model_axis), mesh,
      in_specs=(specs(params, "expert", model_axis), None, P("expert"), P("expert"), P()))
  losses = []
  key = jax.random.PRNGKey(42)
  t_compiled = None
  for i in range(steps):
    key, data_key, route_key = jax.random.split(key, 3)
    tokens, targets = models.synthetic_batch(data_key, batch, seq, vocab)
    params, opt_state, loss, (ce, aux, metrics) = step(params, opt_state, tokens, targets,
                                                       route_key)
    losses.append(float(loss))
    if i == 0:
      t_compiled = time.perf_counter()
    if verbose and (i % log_every == 0 or i == steps - 1):
      dropped = np.mean([float(m.dropped_fraction) for m in metrics])
      load = np.sum([np.asarray(m.tokens_per_expert) for m in metrics], axis=0)
      load = load / load.sum()
      print(f"  step {i:3d}  loss {losses[-1]:.4f}  ce {float(ce):.4f}  "
            f"aux {float(aux):.3f}  dropped {dropped:6.2%}  "
            f"expert load min/max {load.min():.3f}/{load.max():.3f} (uniform "
            f"{1 / num_experts:.3f})")
  elapsed = time.perf_counter() - t_compiled
  tokens_per_s = (steps - 1) * batch * seq / elapsed if steps > 1 else float("nan")
  lowered = step.lower(params, opt_state, tokens, targets, route_key)
  if verbose:
    print(f"  {tokens_per_s:,.0f} tokens/s over steps 1..{steps - 1} "
          f"(step 0 traced, propagated, partitioned and compiled in "
          f"{sum(lowered.timings.values()):.1f} s + XLA)")
  return losses, lowered


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mesh", default="8", help="8, 4x2 or 2x4 (expert x model)")
  parser.add_argument("--steps", type=int, default=30)
  args = parser.parse_args()
  mesh_shape = tuple(int(v) for v in args.mesh.split("x"))
  names = " x ".join(f"{n}={s}" for n, s in zip(("expert", "model"), mesh_shape))
  print(f"gshard: Transformer with MoE every other layer (top-2, random routing), "
        f"Adam, mesh {names} ({jax.device_count()} simulated CPU devices)")
  losses, lowered = train(mesh_shape, steps=args.steps)
  print(f"  loss {losses[0]:.3f} -> {losses[-1]:.3f}")
  a2a = [c for c in lowered.collectives() if c.kind == "all_to_all"]
  print(f"  per step: {len(a2a)} all-to-alls ({sum(c.bytes for c in a2a) / 1024:.1f} KiB "
        "per device): dispatch and combine of each MoE layer, forward and backward")
  print()
  print(lowered.explain(top=6).split("\nconflicts")[0])


if __name__ == "__main__":
  main()
