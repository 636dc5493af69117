"""The executor's slot pools: ``[n, ..., K, ...]`` buffers, read and written per stage.

A pool (``act``, ``grad``, ``stash``, ``keep``; ``gshard.pipeline.plan``)
holds ``n`` slots of one value per stage, the K dim split over the stage
axis and the slot dim unsplit, so every read and write is local to a device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from gshard.pipeline.stages import mask, on_stages


def read(buf, slot, kdim: int):
  """Each stage's slot ``slot[s]`` of ``buf`` (``[n, ..., K at kdim, ...]``): a
  per-stage ``dynamic_slice`` (local: the slot dim is not split). Where
  ``slot`` is -1 it reads slot 0, which the caller never uses."""
  index = jnp.maximum(slot, 0)

  def one(b):
    return jax.vmap(lambda bb, i: lax.dynamic_index_in_dim(bb, i, 0, keepdims=False),
                    in_axes=(kdim, 0), out_axes=kdim - 1)(b, index)
  return jax.tree.map(one, buf)


def write(buf, slot, value, on, kdim: int, shared: bool = True):
  """``value`` (``buf`` without its slot dim) into a slot on the stages where
  ``on`` (``[K]``; the others keep what the slot held); nothing where the slot
  is -1. ``shared``: ``slot`` is one number for every stage, one in-place
  ``dynamic_update_slice``; else ``slot[s]`` (``[K]``) is each stage's own (a
  per-stage scatter, local to each device)."""
  if not shared:
    def per_stage(b, v):
      def one(bb, vv, i, o):   # a stage that does not write aims past the end: dropped
        index = jnp.where(o & (i >= 0), i, bb.shape[0])
        return bb.at[index].set(vv.astype(bb.dtype), mode="drop")
      return jax.vmap(one, in_axes=(kdim, kdim - 1, 0, 0), out_axes=kdim)(b, v, slot, on)
    return jax.tree.map(per_stage, buf, value)

  def one(b, v):
    index = jnp.maximum(slot, 0)
    old = lax.dynamic_index_in_dim(b, index, 0, keepdims=False)
    new = jnp.where(mask(on & (slot >= 0), old, kdim - 1), v.astype(b.dtype), old)
    return lax.dynamic_update_index_in_dim(b, new, index, 0)
  return jax.tree.map(one, buf, value)


def buffer(n: int, avals, lead: tuple, axis: str, kdim: int):
  """``n`` slots of ``lead + aval.shape`` per leaf, K (in ``lead``) over ``axis``."""
  return on_stages(jax.tree.map(lambda a: jnp.zeros((n,) + lead + tuple(a.shape), a.dtype), avals), axis, kdim)


def put(acc, g, where_k, index, add: bool = False):
  """Row ``index`` of ``acc`` (``[K, M, ...]``) takes ``g`` (``[K, ...]``) on the
  stages in ``where_k`` (added to it with ``add``)."""
  old = lax.dynamic_index_in_dim(acc, index, 1, keepdims=False)
  new = old + g.astype(acc.dtype) if add else g.astype(acc.dtype)
  new = jnp.where(mask(where_k, old), new, old)
  return lax.dynamic_update_index_in_dim(acc, new, index, 1)
