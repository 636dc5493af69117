"""Values laid out over the stage axis: the helpers both executors share.

``[K, ...]`` values have one row per stage, pinned over the stage mesh axis
(dim ``K`` split, every other dim left to propagation); stacked weights are
reshaped stage-major, ``[S, K, ...]`` per chunk (S layer slots per stage);
batches are cut into micro-batches ``[M, B/M, ...]`` whose micro-batch ``m``
holds rows ``m, m+M, ...`` (a batch split over a data axis stays split the
same way in every micro-batch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gshard.annotate import shard
from gshard.pipeline.layout import Layout


def open_spec(ndim: int, *fixed):
  """``P(*fixed, UNCONSTRAINED, ...)`` for a value of rank ``ndim``."""
  return P(*fixed, *([P.UNCONSTRAINED] * (ndim - len(fixed))))


def on_stages(tree, axis: str, dim: int = 0):
  """Pin dim ``dim`` of every leaf over the stage axis (other dims left open)."""
  def pin(a):
    return shard(a, open_spec(a.ndim, *([P.UNCONSTRAINED] * dim), axis))
  return jax.tree.map(pin, tree)


def mask(m, like, dim: int = 0):
  """A ``[K]`` (or ``[S, K]``) mask shaped to broadcast against ``like``, its
  dims placed at ``like``'s dims ``dim, dim+1, ...``."""
  return jnp.reshape(m, (1,) * dim + m.shape + (1,) * (like.ndim - m.ndim - dim))


def stage_major(a, layout: Layout, k: int, axis: str) -> list:
  """A stacked leaf as one ``[S, K, ...]`` array per chunk, K over ``axis``: S
  layer slots per stage, each a ``[K, ...]`` value the stages run at once."""
  v = layout.repeats
  if layout.balance is not None:
    return [jnp.swapaxes(shard(a, open_spec(a.ndim, axis, None)), 0, 1)]
  per_stage = layout.num_layers // (v * k)
  if v == 1:
    a = shard(a.reshape((k, per_stage) + a.shape[1:]), open_spec(a.ndim + 1, axis, None))
    return [jnp.swapaxes(a, 0, 1)]
  a = a.reshape((v, k, per_stage) + a.shape[2:])
  a = jnp.swapaxes(shard(a, open_spec(a.ndim, None, axis, None)), 1, 2)
  return [a[c] for c in range(v)]


def from_stage_major(chunks: list, layout: Layout, axis: str):
  """The inverse of :func:`stage_major`: per-chunk ``[S, K, ...]`` leaves back
  in the stack's layout."""
  per = [shard(jnp.swapaxes(c, 0, 1), open_spec(c.ndim, axis, None)) for c in chunks]
  if layout.balance is not None:
    return per[0]
  if layout.repeats == 1:
    a = per[0]
    return a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])
  a = jnp.stack(per)                                  # [v, K, S, ...]
  return a.reshape((a.shape[0], a.shape[1] * a.shape[2]) + a.shape[3:])


def microbatches(a, m: int):
  """``[B, ...] -> [M, B/M, ...]``: micro-batch i holds rows i, i+M, i+2M, ..."""
  return jnp.swapaxes(a.reshape((a.shape[0] // m, m) + a.shape[1:]), 0, 1)


def merged(a):
  """The inverse of :func:`microbatches`."""
  return jnp.swapaxes(a, 0, 1).reshape((-1,) + a.shape[2:])
