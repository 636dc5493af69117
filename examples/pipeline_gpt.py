"""Train a small GPT whose blocks are pipelined (GPipe) over 4 stages x 2 data.

8 simulated CPU devices as a (data=2, stage=4) mesh. The 8 Transformer
blocks are stacked with ``pipeline.stack`` and run by ``pipeline.run`` over
the ``stage`` axis: 2 blocks per stage, the batch of 16 cut into 8
micro-batches, remat per stage. The embedding before the stack and the head
and loss after it are ordinary code, partitioned on the same mesh; the batch
is split over ``data`` throughout. The whole Adam train step is one
partitioned program.

Prints the GPipe schedule chart, checks the first step's loss against the
same model run as a plain loop on one device, trains, and prints the
partition report (every collective, largest first).

Run: ``python examples/pipeline_gpt.py``.
"""

from __future__ import annotations

import os
import sys
import time

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import gshard  # noqa: E402
from examples.models import synthetic_batch  # noqa: E402
from gshard import pipeline  # noqa: E402

STAGES, DATA, MICROBATCHES = 4, 2, 8


def init(key, vocab=128, d_model=64, n_heads=4, n_layers=8, d_ff=256):
  """Parameters; the blocks stacked (leaves [n_layers, ...]) for ``pipeline.run``."""
  d_head = d_model // n_heads
  keys = iter(jax.random.split(key, 2 + 6 * n_layers))

  def normal(shape, fan_in):
    return jax.random.normal(next(keys), shape) / fan_in ** 0.5

  blocks = [{"ln1": jnp.ones((d_model,)), "ln2": jnp.ones((d_model,)),
             "wq": normal((d_model, n_heads, d_head), d_model),
             "wk": normal((d_model, n_heads, d_head), d_model),
             "wv": normal((d_model, n_heads, d_head), d_model),
             "wo": normal((n_heads, d_head, d_model), d_model),
             "w1": normal((d_model, d_ff), d_model),
             "w2": normal((d_ff, d_model), d_ff)} for _ in range(n_layers)]
  return {"embed": normal((vocab, d_model), d_model), "blocks": pipeline.stack(blocks),
          "ln_f": jnp.ones((d_model,))}


def specs(params):
  """The stacked blocks over ``stage`` (dim 0); embedding and final norm replicated."""
  return {"embed": P(), "blocks": jax.tree.map(lambda _: P("stage"), params["blocks"]),
          "ln_f": P()}


def layer_norm(x, scale):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale


def block(p, x):
  """One Transformer block on ``x: f32[b, t, d]`` (one micro-batch)."""
  h = layer_norm(x, p["ln1"])
  q = jnp.einsum("btd,dhk->bthk", h, p["wq"])
  k = jnp.einsum("btd,dhk->bthk", h, p["wk"])
  v = jnp.einsum("btd,dhk->bthk", h, p["wv"])
  q = gshard.shard(q, P("data", None, None, None))   # kept per stage under the pipeline
  scores = jnp.einsum("bqhk,bthk->bhqt", q, k) / q.shape[-1] ** 0.5
  t = x.shape[1]
  scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
  out = jnp.einsum("bhqt,bthk->bqhk", jax.nn.softmax(scores, axis=-1), v)
  x = x + jnp.einsum("bqhk,hkd->bqd", out, p["wo"])
  return x + jax.nn.gelu(layer_norm(x, p["ln2"]) @ p["w1"]) @ p["w2"]


def loss_fn(params, tokens, targets):
  tokens = gshard.split(tokens, 0, "data")
  x = params["embed"][tokens]                                   # before the stack
  x = pipeline.run(block, params["blocks"], x, num_microbatches=MICROBATCHES,
                   stage_axis="stage")
  logits = layer_norm(x, params["ln_f"]) @ params["embed"].T    # after the stack
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def make_step(optimizer):
  def step(params, opt_state, tokens, targets):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


def train(steps: int = 30, batch: int = 16, seq: int = 16, vocab: int = 128,
          log_every: int = 5, verbose: bool = True):
  """Train; returns (losses, plain-loop loss of the first batch, lowered program)."""
  mesh = gshard.make_mesh((DATA, STAGES), ("data", "stage"))
  params = init(jax.random.PRNGKey(0), vocab=vocab)
  optimizer = optax.adam(3e-3)
  opt_state = optimizer.init(params)
  step = gshard.partition(make_step(optimizer), mesh,
                          in_specs=(specs(params), None, P("data"), P("data")))
  key = jax.random.PRNGKey(42)
  tokens, targets = synthetic_batch(key, batch, seq, vocab)
  plain = float(loss_fn(params, tokens, targets))   # off mesh: the plain loop
  losses = []
  t0 = time.perf_counter()
  for i in range(steps):
    params, opt_state, loss = step(params, opt_state, tokens, targets)
    losses.append(float(loss))
    if verbose and (i % log_every == 0 or i == steps - 1):
      print(f"  step {i:3d}  loss {losses[-1]:.4f}")
    key, sub = jax.random.split(key)
    tokens, targets = synthetic_batch(sub, batch, seq, vocab)
  elapsed = time.perf_counter() - t0
  if verbose:
    print(f"  {steps} steps in {elapsed:.1f} s (the first includes tracing, propagation, "
          "partitioning and XLA compilation)")
  return losses, plain, step.lower(params, opt_state, tokens, targets)


def main():
  print(f"gshard: GPT, 8 blocks pipelined over {STAGES} stages x {DATA} data "
        f"({jax.device_count()} simulated CPU devices), {MICROBATCHES} micro-batches, Adam")
  print()
  print(pipeline.schedule("gpipe", num_stages=STAGES, num_microbatches=MICROBATCHES))
  print()
  losses, plain, lowered = train()
  print(f"  first loss {losses[0]:.6f} pipelined, {plain:.6f} as the plain loop on one "
        f"device; loss {losses[0]:.3f} -> {losses[-1]:.3f}")
  print()
  print(lowered.explain(top=10))


if __name__ == "__main__":
  main()
