"""Checkpoint, kill, resume: training that survives a dead process.

Run: ``python examples/checkpoint_resume.py [--dir DIR] [--steps 16] [--save-every 4]
[--kill-at 12]``. On this machine it plays what happens on a cluster:

1. ``python -m gshard.launch`` starts 2 processes x 4 CPU devices, which train
   a small GPT (Adam; vocabulary 50, which does not divide ``model=4``, so the
   embedding is padded inside the program) on a ``data=2 x model=4`` mesh,
   saving a checkpoint with orbax every ``--save-every`` steps. Right after
   starting the save of step ``--kill-at``, process 1 is killed (SIGKILL): the
   other process stops too, and that last checkpoint is left unfinished.
2. A second launch restores the latest finished checkpoint, every array laid
   out as the train step wants it (``gshard.checkpoint.abstract_args``), and
   trains on to ``--steps``.
3. The same processes then train from step 0 straight through, without
   checkpoints, and compare: the same losses and the same parameters and
   optimizer state, bit for bit.

Each step's batch is a function of the step number, and each process feeds
only its own rows of it (``jax.make_array_from_process_local_data``), as a
data loader on a cluster would.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gshard.distributed  # noqa: E402  (first: the worker joins the runtime before jax runs)

if "--worker" in sys.argv:
  gshard.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import gshard  # noqa: E402
from examples import models  # noqa: E402

VICTIM = 1           # the process that is killed


# -- the training run (one process of a launch) --------------------------------------

def init_params(cfg, seed: int = 0):
  """The GPT's parameters from numpy's seeded generator: the same on every process."""
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(lambda k: models.gpt_init(
      k, vocab=cfg.vocab, d_model=cfg.d_model, n_heads=4, n_layers=cfg.layers,
      d_ff=cfg.d_ff), jax.random.PRNGKey(0))

  def leaf(path, s):
    if str(getattr(path[-1], "key", "")).startswith("ln"):
      return np.ones(s.shape, s.dtype)
    return (rng.standard_normal(s.shape) / np.sqrt(s.shape[0])).astype(s.dtype)
  return jax.tree_util.tree_map_with_path(leaf, shapes)


def global_batch(cfg, i: int):
  """Step ``i``'s batch (the same on every process): sequences counting up by a
  per-sequence stride, so the loss can fall."""
  rng = np.random.default_rng(1000 + i)
  start = rng.integers(0, cfg.vocab, (cfg.batch, 1))
  stride = rng.integers(1, 4, (cfg.batch, 1))
  seqs = ((start + stride * np.arange(cfg.seq + 1)) % cfg.vocab).astype(np.int32)
  return seqs[:, :-1], seqs[:, 1:]


def feed(mesh, value):
  """The global batch array, this process feeding only the rows its devices hold."""
  sharding = NamedSharding(mesh, P("data"))
  rows = gshard.distributed.process_rows(sharding, value.shape)
  return jax.make_array_from_process_local_data(sharding, value[rows], value.shape)


def logical(tree):
  """Padded values as their logical arrays (the padding sliced off)."""
  def f(x):
    return x.data[tuple(slice(0, n) for n in x.shape)] if gshard.checkpoint.is_padded(x) else x
  return jax.tree.map(f, tree, is_leaf=gshard.checkpoint.is_padded)


def build(cfg, mesh_shape=(2, 4)):
  """The mesh, the partitioned Adam train step, initial params and optimizer state."""
  mesh = gshard.make_mesh(mesh_shape, ("data", "model"))
  params = init_params(cfg)
  optimizer = optax.adam(3e-3)

  def train_step(params, opt_state, tokens, targets):
    loss, grads = jax.value_and_grad(models.gpt_loss)(params, tokens, targets)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step = gshard.partition(train_step, mesh,
                          in_specs=(models.gpt_specs(params), None, P("data"), P("data")))
  return mesh, step, params, optimizer.init(params)


def train(cfg, mesh, step, state, start: int, log, mngr=None, kill: bool = False):
  """Steps ``start .. cfg.steps - 1``, saving to ``mngr`` if given (and with
  ``kill``, killing process 1 at ``cfg.kill_at``); returns the state."""
  params, opt_state = state
  for i in range(start, cfg.steps):
    tokens, targets = global_batch(cfg, i)
    params, opt_state, loss = step(params, opt_state, feed(mesh, tokens), feed(mesh, targets))
    log(i, float(loss))
    if mngr is not None and ((i + 1) % cfg.save_every == 0 or i + 1 == cfg.steps):
      gshard.checkpoint.save(mngr, (params, opt_state), step=i + 1)
      if kill and i + 1 == cfg.kill_at and jax.process_index() == VICTIM:
        print(f"process {VICTIM}: killed (SIGKILL) while checkpoint {i + 1} is being written",
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
  return params, opt_state


def worker(cfg):
  import orbax.checkpoint as ocp
  mesh, step, params, opt_state = build(cfg)
  me = jax.process_index()
  logs = {}

  def logger(name):
    path = os.path.join(cfg.dir, f"losses-{name}.jsonl")

    def log(i, loss):
      logs.setdefault(name, []).append(loss)
      if me == 0:
        with open(path, "a") as f:
          f.write(json.dumps({"step": i, "loss": loss}) + "\n")
      print(f"  [{name}] step {i:3d}  loss {loss:.6f}", flush=True)
    return log

  options = ocp.CheckpointManagerOptions(max_to_keep=3, cleanup_tmp_directories=True)
  with ocp.CheckpointManager(os.path.join(cfg.dir, "ckpt"), options=options) as mngr:
    if cfg.worker == "train":
      train(cfg, mesh, step, (params, opt_state), 0, logger("killed"), mngr, kill=True)
      return
    start = mngr.latest_step()
    if start is None:
      raise SystemExit(f"no finished checkpoint in {cfg.dir}/ckpt to resume from")
    target = gshard.checkpoint.abstract_args(step, params, opt_state,
                                             *global_batch(cfg, 0))[:2]
    state = gshard.checkpoint.restore(mngr, target, step=start)
    print(f"  restored step {start} (finished checkpoints: {list(mngr.all_steps())})",
          flush=True)
    resumed = train(cfg, mesh, step, state, start, logger("resumed"), mngr)
    mngr.wait_until_finished()
  straight = train(cfg, mesh, step, (params, opt_state), 0, logger("straight"))
  resumed, straight = (multihost_utils.process_allgather(logical(s), tiled=True)
                       for s in (resumed, straight))
  if me == 0:
    np.savez(os.path.join(cfg.dir, "final.npz"), start=start,
             **{f"resumed_{k}": np.asarray(x) for k, x in enumerate(jax.tree.leaves(resumed))},
             **{f"straight_{k}": np.asarray(x)
                for k, x in enumerate(jax.tree.leaves(straight))})


# -- the driver ------------------------------------------------------------------------

def _read_losses(path):
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f)}


def run(cfg, launch_timeout: float = 600.0, quiet: bool = False) -> dict:
  """Play the three phases; returns what happened (losses per phase, exit codes,
  the restored step, whether the final states agree)."""
  from gshard.launch import launch
  out = open(os.devnull, "w") if quiet else None
  base = [os.path.abspath(__file__), "--dir", cfg.dir, "--steps", str(cfg.steps),
          "--save-every", str(cfg.save_every), "--kill-at", str(cfg.kill_at),
          "--vocab", str(cfg.vocab), "--layers", str(cfg.layers)]
  if not quiet:
    print(f"1. train on 2 processes x 4 devices, checkpoint every {cfg.save_every} steps; "
          f"process {VICTIM} is killed at step {cfg.kill_at}")
  killed_rc = launch(base + ["--worker", "train"], 2, 4, timeout=launch_timeout,
                     heartbeat_timeout=cfg.heartbeat, stdout=out, stderr=out)
  if not quiet:
    print(f"   the launch exited with {killed_rc} "
          f"({'killed, as planned' if killed_rc else 'NOT killed'})\n"
          "2. relaunch: restore the latest finished checkpoint, train on; "
          "3. train straight through")
  resumed_rc = launch(base + ["--worker", "resume"], 2, 4, timeout=launch_timeout,
                      heartbeat_timeout=cfg.heartbeat, stdout=out, stderr=out)
  if resumed_rc:
    raise RuntimeError(f"the resumed run failed (exit {resumed_rc}); its output is above")
  final = np.load(os.path.join(cfg.dir, "final.npz"))
  n = sum(k.startswith("resumed_") for k in final.files)
  same_state = all(np.array_equal(final[f"resumed_{k}"], final[f"straight_{k}"])
                   for k in range(n))
  res = {name: _read_losses(os.path.join(cfg.dir, f"losses-{name}.jsonl"))
         for name in ("killed", "resumed", "straight")}
  res.update(killed_rc=killed_rc, start=int(final["start"]), same_state=same_state,
             n_leaves=n)
  if not quiet:
    _print_table(res, cfg)
  return res


def _print_table(res, cfg):
  print(f"\n   restored checkpoint: step {res['start']}\n")
  print("   step   killed run    resumed run   straight through")
  for i in range(cfg.steps):
    cells = []
    for name in ("killed", "resumed", "straight"):
      v = res[name].get(i)
      cells.append(f"{v:11.6f}" if v is not None else " " * 11)
    print(f"   {i:4d}   " + "   ".join(cells))
  resumed_ok = all(res["resumed"][i] == res["straight"][i] for i in res["resumed"])
  killed_ok = all(res["killed"][i] == res["straight"][i] for i in res["killed"])
  print(f"\n   losses identical to straight through: killed run {killed_ok}, "
        f"resumed run {resumed_ok}")
  print(f"   final params and optimizer state identical ({res['n_leaves']} arrays): "
        f"{res['same_state']}")


def parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--dir", default=None, help="working directory (default: a new temporary one)")
  p.add_argument("--steps", type=int, default=16)
  p.add_argument("--save-every", type=int, default=4)
  p.add_argument("--kill-at", type=int, default=12,
                 help="the step whose checkpoint process 1 is killed while writing")
  p.add_argument("--vocab", type=int, default=50)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--heartbeat", type=int, default=5,
                 help="JAX heartbeat timeout of the launches, seconds")
  p.add_argument("--worker", choices=("train", "resume"), default=None, help=argparse.SUPPRESS)
  cfg = p.parse_args(argv)
  cfg.d_model, cfg.d_ff, cfg.batch, cfg.seq = 32, 64, 8, 16
  if not 0 < cfg.kill_at < cfg.steps:
    p.error(f"--kill-at ({cfg.kill_at}) must be a step before --steps ({cfg.steps})")
  if cfg.kill_at % cfg.save_every:
    p.error(f"--kill-at ({cfg.kill_at}) must be a step that saves (a multiple of "
            f"--save-every {cfg.save_every})")
  return cfg


def main(argv=None):
  cfg = parse(argv)
  if cfg.worker:
    worker(cfg)
    return
  made = cfg.dir is None
  cfg.dir = cfg.dir or tempfile.mkdtemp(prefix="gshard-resume-")
  if not made and os.path.exists(cfg.dir):
    shutil.rmtree(cfg.dir)
  os.makedirs(cfg.dir, exist_ok=True)
  run(cfg)
  print(f"\n   checkpoints and logs in {cfg.dir}")


if __name__ == "__main__":
  main()
