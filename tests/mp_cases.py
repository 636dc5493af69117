"""The programs of tests/test_multiprocess.py, run the same way on 1 process x 8
devices (in the pytest process) and on 2 processes x 4 devices (tests/mp_worker.py
under ``python -m gshard.launch``).

Every case builds its inputs identically on every process: parameters from a
fixed seed, the global batch from numpy's seeded generator. It feeds the batch
the multi-process way, each process only its own rows
(``jax.make_array_from_process_local_data``), which on one process is the whole
batch, so both sides run the same code and compile the same program.
Each case returns ``{"losses": [...], "state": [...], "out_global": bool}``
with every array fetched to the host in full.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import gshard  # noqa: E402
from examples import models  # noqa: E402
from gshard.moe import moe_apply, moe_init, moe_specs  # noqa: E402

STEPS = 3
GPT_VOCAB = 50          # over model=4: 13 rows per device, the last 2 rows padding


def numpy_init(init, *args, seed=0):
  """``init(key, *args)``'s tree, filled from numpy's generator (identical on every
  process, and no XLA compilation of the random initializer): ``ln*`` scales
  ones, the rest normal / sqrt(fan-in)."""
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(lambda key: init(key, *args), jax.random.PRNGKey(0))

  def leaf(path, s):
    if jax.tree_util.keystr(path).split("'")[-2].startswith("ln"):
      return np.ones(s.shape, s.dtype)
    return (rng.standard_normal(s.shape) / np.sqrt(s.shape[0])).astype(s.dtype)
  return jax.tree_util.tree_map_with_path(leaf, shapes)


def feed(mesh, spec, value: np.ndarray):
  """The global array of ``value`` laid out with ``spec``, each process feeding only
  the rows its devices hold."""
  sharding = NamedSharding(mesh, spec)
  rows = gshard.distributed.process_rows(sharding, value.shape)
  return jax.make_array_from_process_local_data(sharding, value[rows], value.shape)


def fetch(tree):
  """Every leaf's logical value in full on the host: one jitted copy to fully
  replicated (across processes, an all-gather), then the local copy. A padded
  value (gshard.PaddedArray) is its logical rows."""
  mesh = jax.tree.leaves(tree)[0].sharding.mesh
  padded = gshard.checkpoint.is_padded

  def logical(t):
    return jax.tree.map(lambda x: x.data[tuple(slice(0, n) for n in x.shape)]
                        if padded(x) else x, t, is_leaf=padded)
  full = jax.jit(logical, out_shardings=NamedSharding(mesh, P()))(tree)
  return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), full)


def _result(losses, state, outs):
  leaves = jax.tree.leaves(outs)
  return {"losses": np.asarray([float(l) for l in losses]),
          "state": [np.asarray(x) for x in jax.tree.leaves(fetch(state))],
          "out_global": all(isinstance(x, jax.Array) and x.sharding.mesh.size == 8
                            for x in leaves),
          "out_fully_addressable": any(x.is_fully_addressable for x in leaves)}


def mlp():
  """The Megatron MLP, SGD: data=2 x model=4; w1 by columns, w2 by rows."""
  mesh = gshard.make_mesh((2, 4), ("data", "model"))
  params = numpy_init(models.mlp_init, 32, 128)
  rng = np.random.default_rng(0)
  step = gshard.partition(models.sgd_step(models.mlp_loss), mesh,
                          in_specs=(models.MLP_SPECS, P("data"), P("data")))
  losses = []
  for _ in range(STEPS):
    x = rng.standard_normal((16, 32), np.float32)
    y = rng.standard_normal((16, 32), np.float32)
    params, loss = step(params, feed(mesh, P("data"), x), feed(mesh, P("data"), y))
    losses.append(loss)
  return _result(losses, params, (params, loss))


def gpt():
  """The GPT train step (Adam), vocabulary 50 over model=4 (padded inside)."""
  mesh = gshard.make_mesh((2, 4), ("data", "model"))
  params = numpy_init(models.gpt_init, GPT_VOCAB, 32, 4, 1, 64)
  optimizer = optax.adam(3e-3)
  opt_state = jax.jit(optimizer.init)(params)

  def train_step(params, opt_state, tokens, targets):
    loss, grads = jax.value_and_grad(models.gpt_loss)(params, tokens, targets)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step = gshard.partition(train_step, mesh,
                          in_specs=(models.gpt_specs(params), None, P("data"), P("data")))
  rng = np.random.default_rng(1)
  losses = []
  for _ in range(STEPS):
    seqs = rng.integers(0, GPT_VOCAB, (8, 9)).astype(np.int32)
    params, opt_state, loss = step(params, opt_state, feed(mesh, P("data"), seqs[:, :-1]),
                                   feed(mesh, P("data"), seqs[:, 1:]))
    losses.append(loss)
  return _result(losses, (params, opt_state), (params, opt_state, loss))


def moe():
  """One GShard MoE layer, SGD, experts and token groups over expert=8: its
  dispatch and combine all-to-alls span both processes."""
  mesh = gshard.make_mesh((8,), ("expert",))
  params = numpy_init(moe_init, 16, 32, 8)

  def loss_fn(params, x, key):
    y, aux, _ = moe_apply(params, x, key=key, capacity_factor=2.0)
    return jnp.mean((x + y) ** 2) + 1e-2 * aux

  def sgd(params, x, key):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, key)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

  step = gshard.partition(sgd, mesh, in_specs=(moe_specs("expert"), P("expert"), P()))
  crossing = all_to_all_processes(step, mesh, params, jax.ShapeDtypeStruct((8, 16, 16), jnp.float32),
                                  jax.ShapeDtypeStruct((2,), jnp.uint32))
  rng = np.random.default_rng(2)
  losses = []
  for i in range(STEPS):
    x = rng.standard_normal((8, 16, 16), np.float32)
    key = np.asarray([0, 100 + i], np.uint32)          # jax.random.PRNGKey(100 + i)
    params, loss = step(params, feed(mesh, P("expert"), x), key)
    losses.append(loss)
  return {**_result(losses, params, (params, loss)), "all_to_all_processes": crossing}


def all_to_all_processes(step, mesh, *args) -> np.ndarray:
  """For each all-to-all of ``step``'s StableHLO, the number of distinct
  processes its replica group spans (replica ids index the mesh's devices)."""
  import re
  text = step.lower(*args).as_text()
  procs = [d.process_index for d in mesh.devices.flat]
  out = []
  for groups in re.findall(r'"stablehlo.all_to_all".*?replica_groups = dense<(\[\[.*?\]\])>', text):
    for group in re.findall(r"\[([\d, ]+)\]", groups):
      out.append(len({procs[int(i)] for i in group.split(",")}))
  return np.asarray(out)


CASES = {"mlp": mlp, "gpt": gpt, "moe": moe}
