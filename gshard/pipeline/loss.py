"""The loss head of ``pipeline.run(..., loss_fn=...)``: its value and its checks.

With ``loss_fn``, ``run`` returns the mean over micro-batches of
``loss_fn(loss_params, y_m, targets_m)``: ``y_m`` is micro-batch ``m`` of the
stack's output (rows ``m, m+M, ...``, as the pipeline cuts the batch) and
``targets_m`` the same rows of ``targets``. For a loss that is a mean over
rows this is the batch mean. Off mesh and on mesh the number is the same; on
a mesh with the stage axis the schedule executor computes it micro-batch by
micro-batch on the last stage, and its gradients in the schedule's order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from gshard.pipeline.stages import microbatches


def mean_loss(loss_fn, loss_params, y, targets, m: int):
  """``mean_m loss_fn(loss_params, y_m, targets_m)``."""
  ys = jax.tree.map(lambda a: microbatches(a, m), y)
  ts = jax.tree.map(lambda a: microbatches(a, m), targets)
  return jnp.mean(jax.vmap(functools.partial(loss_fn, loss_params))(ys, ts))


def _rows(tree, rows: int):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct((rows,) + np.shape(a)[1:],
                                                     jnp.result_type(a)), tree)


def check_loss(loss_fn, loss_params, targets, x, stacked, batch: int, m: int, where: str):
  """Errors naming the argument, its shape, where (mesh) and a fix."""
  if not callable(loss_fn):
    raise ValueError(f"run(loss_fn={loss_fn!r}): loss_fn must be a function "
                     "loss_fn(loss_params, y, targets) -> scalar loss of one micro-batch.")
  for name, tree in (("x", x), ("stacked", stacked)):
    for path, a in jax.tree_util.tree_flatten_with_path(tree)[0]:
      if not jnp.issubdtype(jnp.result_type(a), jnp.inexact):
        raise ValueError(
            f"run(loss_fn=...): {name} leaf {jax.tree_util.keystr(path) or name} is "
            f"{jnp.result_type(a)}{list(np.shape(a))} ({where}); with loss_fn the pipeline "
            f"differentiates the layers' parameters and activations itself, so they must "
            f"be floating point. Cast it, or keep integer data in targets.")
  for path, a in jax.tree_util.tree_flatten_with_path(targets)[0]:
    shape = tuple(np.shape(a))
    if not shape or shape[0] != batch:
      raise ValueError(
          f"run: targets leaf {jax.tree_util.keystr(path) or 'targets'} has shape {shape}, "
          f"but x has batch {batch} ({where}); every leaf of targets needs the same batch as "
          f"dim 0 (micro-batch m of the targets goes with micro-batch m of x).")
  mb = batch // m
  y = jax.tree.map(lambda a: jax.ShapeDtypeStruct((mb,) + np.shape(a)[1:],
                                                  jnp.result_type(a)), x)
  got = jax.eval_shape(loss_fn, loss_params, y, _rows(targets, mb))
  leaves = jax.tree.leaves(got)
  if len(leaves) != 1 or np.shape(leaves[0]) != () or \
      not jnp.issubdtype(leaves[0].dtype, jnp.floating):
    raise ValueError(
        f"run: loss_fn(loss_params, y, targets) must return one float scalar (the loss of one "
        f"micro-batch); for y of {jax.tree.map(lambda a: a.shape, y)} ({mb} rows) it "
        f"returned {got}. Reduce it, e.g. with jnp.mean.")
