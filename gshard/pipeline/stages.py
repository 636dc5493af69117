"""Values laid out over the stage axis: the helpers both executors share.

``[K, ...]`` values have one row per stage, pinned over the stage mesh axis
(dim ``K`` split, every other dim left to propagation); stacked weights are
reshaped stage-major, ``[S, K, ...]`` per chunk (S layer slots per stage);
batches are cut into micro-batches ``[M, B/M, ...]`` whose micro-batch ``m``
holds rows ``m, m+M, ...`` (a batch split over a data axis stays split the
same way in every micro-batch). :class:`Stage` runs one layer's pieces over a
stage's layer slots, every stage at once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from gshard.annotate import shard
from gshard.pipeline.layout import Layout
from gshard.pipeline.pieces import Pieces


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


@dataclasses.dataclass(frozen=True, eq=False)
class Stage:
  """One layer's pieces run over a stage's layer slots (a scan), every stage at
  once (vmap over the ``[K, ...]`` dim)."""

  pieces: Pieces
  shared: tuple
  active: np.ndarray | None      # [S, K] balance: which slots hold a layer
  axis: str

  def _vmap(self, fn, in_axes):
    return jax.vmap(fn, in_axes=in_axes, spmd_axis_name=self.axis)

  def _pin(self, tree, dim=0):
    return on_stages(tree, self.axis, dim)

  def _xs(self, w):
    return (w, self.active)

  def primal(self, w, h):
    def body(h, xs):
      wl, on = xs
      y = self._vmap(lambda wl, h: self.pieces.primal((wl, self.shared), h), (0, 0))(wl, h)
      if on is not None:
        y = jax.tree.map(lambda new, old: jnp.where(mask(on, old), new, old), y, h)
      return self._pin(y), None
    return lax.scan(body, self._pin(h), self._xs(w))[0]

  def forward(self, w, h):
    def body(h, xs):
      wl, on = xs
      y, saved = self._vmap(lambda wl, h: self.pieces.forward((wl, self.shared), h),
                            (0, 0))(wl, h)
      if on is not None:
        y = jax.tree.map(lambda new, old: jnp.where(mask(on, old), new, old), y, h)
      return self._pin(y), self._pin(saved)
    return lax.scan(body, self._pin(h), self._xs(w))

  def _masked(self, on, dw, ds, dh, ct):
    if on is None:
      return dw, ds, dh
    keep = lambda g: jnp.where(mask(on, g), g, jnp.zeros((), g.dtype))
    dh = jax.tree.map(lambda new, old: jnp.where(mask(on, old), new, old), dh, ct)
    return jax.tree.map(keep, dw), jax.tree.map(keep, ds), dh

  def _zero_shared(self, k):
    return jax.tree.map(lambda a: jnp.zeros((k,) + np.shape(a), acc_dtype(a)), self.shared)

  def backward(self, w, saved, ct, k):
    """``(dh, dw [S, K, ...], dshared [K, ...])``."""
    def body(carry, xs):
      ct, acc = carry
      wl, on, res = xs
      (dw, ds), dh = self._vmap(
          lambda wl, res, ct: self.pieces.backward((wl, self.shared), res, ct), (0, 0, 0))(
              wl, res, ct)
      dw, ds, dh = self._masked(on, dw, ds, dh, ct)
      return (self._pin(dh), add_into(acc, ds)), dw
    (dh, ds), dw = lax.scan(body, (self._pin(ct), self._zero_shared(k)),
                            (w, self.active, saved), reverse=True)
    return dh, dw, ds

  def input_grad(self, w, saved, ct):
    """``(dh, kept [S, K, ...])``."""
    def body(ct, xs):
      wl, on, res = xs
      dh, kept = self._vmap(
          lambda wl, res, ct: self.pieces.input_grad((wl, self.shared), res, ct), (0, 0, 0))(
              wl, res, ct)
      if on is not None:
        dh = jax.tree.map(lambda new, old: jnp.where(mask(on, old), new, old), dh, ct)
      return self._pin(dh), self._pin(kept)
    return lax.scan(body, self._pin(ct), (w, self.active, saved), reverse=True)

  def weight_grad(self, w, kept, k):
    """``(dw [S, K, ...], dshared [K, ...])``."""
    def body(acc, xs):
      wl, on, kl = xs
      dw, ds = self._vmap(lambda wl, kl: self.pieces.weight_grad((wl, self.shared), kl),
                          (0, 0))(wl, kl)
      if on is not None:
        keep = lambda g: jnp.where(mask(on, g), g, jnp.zeros((), g.dtype))
        dw, ds = jax.tree.map(keep, dw), jax.tree.map(keep, ds)
      return add_into(acc, ds), dw
    ds, dw = lax.scan(body, self._zero_shared(k), (w, self.active, kept))
    return dw, ds


def acc_dtype(a):
  """The dtype a running sum of ``a`` is kept in (at least float32)."""
  return jnp.promote_types(jnp.result_type(a), jnp.float32)


def add_into(acc, g):
  return jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, g)
