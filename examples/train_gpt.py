"""Train a small GPT-style Transformer with data and tensor parallelism.

A 2x4 mesh of simulated CPU devices: the batch is split over ``data``; heads,
the MLP hidden dim and the vocabulary over ``model`` (Megatron layout). The
model is plain JAX (examples/models.py) with a few gshard annotations;
``gshard.partition`` turns the whole Adam train step into one per-device
program with explicit collectives.

Run: ``python examples/train_gpt.py`` (``make demo`` runs it).

``--processes 2`` trains the same model on the same 2x4 mesh made of 2
processes x 4 devices (``python -m gshard.launch`` starts them; running
``python -m gshard.launch -n 2 -d 4 examples/train_gpt.py`` is the same): each
process joins JAX's runtime with ``gshard.distributed.initialize()``, makes the
parameters itself from the same seed, and feeds only its own rows of each
batch. It prints the losses of the 1-process run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gshard.distributed  # noqa: E402

if gshard.distributed.launched():          # one of several processes: join them first
  gshard.distributed.initialize()
else:
  _FLAG = "--xla_force_host_platform_device_count=8"
  if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import gshard  # noqa: E402
from examples import models  # noqa: E402


def make_step(optimizer):
  def step(params, opt_state, tokens, targets):
    loss, grads = jax.value_and_grad(models.gpt_loss)(params, tokens, targets)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


def feed(mesh, value):
  """The global batch array, split over ``data``; this process feeds only the rows
  its devices hold (with one process: all of them)."""
  value = np.asarray(value)
  sharding = NamedSharding(mesh, P("data"))
  rows = gshard.distributed.process_rows(sharding, value.shape)
  return jax.make_array_from_process_local_data(sharding, value[rows], value.shape)


def train(steps: int = 40, batch: int = 16, seq: int = 32, vocab: int = 128,
          log_every: int = 5, verbose: bool = True):
  """Train and return (losses, lowered program). With several processes, call
  ``gshard.distributed.initialize()`` first; only process 0 prints."""
  verbose = verbose and jax.process_index() == 0
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
    tokens, targets = feed(mesh, tokens), feed(mesh, targets)
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


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--processes", type=int, default=1,
                      help="processes to train on, 1, 2, 4 or 8 (8 devices in all)")
  parser.add_argument("--steps", type=int, default=40)
  args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
  if args.processes > 1 and not gshard.distributed.launched():
    if 8 % args.processes:
      parser.error(f"--processes {args.processes}: 8 devices do not split evenly")
    from gshard.launch import launch
    sys.exit(launch([os.path.abspath(__file__), "--steps", str(args.steps)],
                    args.processes, 8 // args.processes))
  lead = jax.process_index() == 0
  if lead:
    where = (f"{jax.process_count()} processes x {jax.local_device_count()}"
             if jax.process_count() > 1 else f"{jax.device_count()}")
    print(f"gshard: GPT-style Transformer, Adam, mesh data=2 x model=4 "
          f"({where} simulated CPU devices)")
  losses, lowered = train(steps=args.steps)
  if lead:
    print(f"  loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    print()
    print(lowered.explain(top=8))


if __name__ == "__main__":
  main()
