"""Train a small GPT-style Transformer with data and tensor parallelism.

A 2x4 mesh of simulated CPU devices: the batch is split over ``data``; heads,
the MLP hidden dim and the vocabulary over ``model`` (Megatron layout). The
model is plain JAX (examples/models.py) with a few gshard annotations;
``gshard.partition`` turns the whole Adam train step into one per-device
program with explicit collectives.

Run: ``python examples/train_gpt.py`` (``make demo`` runs it).
"""

from __future__ import annotations

import os
import sys
import time

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import gshard  # noqa: E402
from examples import models  # noqa: E402


def make_step(optimizer):
  def step(params, opt_state, tokens, targets):
    loss, grads = jax.value_and_grad(models.gpt_loss)(params, tokens, targets)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


def train(steps: int = 40, batch: int = 16, seq: int = 32, vocab: int = 128,
          log_every: int = 5, verbose: bool = True):
  """Train and return (losses, lowered program)."""
  mesh = gshard.make_mesh((2, 4), ("data", "model"))
  params = models.gpt_init(jax.random.PRNGKey(0), vocab=vocab, d_model=64, n_heads=4,
                           n_layers=2, d_ff=256)
  optimizer = optax.adam(3e-3)
  opt_state = optimizer.init(params)
  step = gshard.partition(
      make_step(optimizer), mesh,
      in_specs=(models.gpt_specs(params), None, P("data"), P("data")))
  losses = []
  key = jax.random.PRNGKey(42)
  t0 = time.perf_counter()
  for i in range(steps):
    key, sub = jax.random.split(key)
    tokens, targets = models.synthetic_batch(sub, batch, seq, vocab)
    params, opt_state, loss = step(params, opt_state, tokens, targets)
    losses.append(float(loss))
    if verbose and (i % log_every == 0 or i == steps - 1):
      print(f"  step {i:3d}  loss {losses[-1]:.4f}")
  elapsed = time.perf_counter() - t0
  lowered = step.lower(params, opt_state, tokens, targets)
  if verbose:
    print(f"  {steps} steps in {elapsed:.1f} s (first step includes tracing, "
          f"propagation, partitioning and XLA compilation)")
  return losses, lowered


def main():
  print("gshard: GPT-style Transformer, Adam, mesh data=2 x model=4 "
        f"({jax.device_count()} simulated CPU devices)")
  losses, lowered = train()
  print(f"  loss {losses[0]:.3f} -> {losses[-1]:.3f}")
  print()
  print(lowered.explain(top=8))


if __name__ == "__main__":
  main()
