"""Running a reshard plan inside ``jax.shard_map``, and this device's coordinates.

``spmd/reshard.py`` chooses the steps; this module only executes them, one
jax collective (or local slice / pad) per step, following jax's
``NamedSharding``/``shard_map`` block convention: a dim split over ``(a1, a2)``
is cut into ``|a1|*|a2|`` blocks of ``ceil(n / k)`` elements and the device at
``(i1, i2)`` holds block ``i1*|a2| + i2``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gshard.spmd.reshard import ReshardPlan, linear_index, shard_count
from gshard.spmd.sharding import Axes, MeshSizes


def apply_plan(x_local, plan: ReshardPlan, global_shape: Sequence[int],
               mesh_sizes: MeshSizes, chunks_first: bool = False):
  """Run ``plan`` on this device's block; call inside ``jax.shard_map``.

  Args:
    x_local: ``plan.src.local_shape(global_shape, mesh_sizes)``.
    chunks_first: reduce-scatter or all-gather a dim that is not the leading
      one on a leading dim of the chunks (see ``_apply_psum_scatter``).
  Returns:
    this device's block under ``plan.dst``, of
    ``plan.dst.local_shape(global_shape, mesh_sizes)``.
  """
  return apply_plan_sharing(x_local, plan, global_shape, mesh_sizes, chunks_first, None)[0]


def apply_plan_sharing(x_local, plan: ReshardPlan, global_shape: Sequence[int],
                       mesh_sizes: MeshSizes, chunks_first: bool, done: dict | None):
  """:func:`apply_plan`, sharing the steps an earlier plan from the same
  block began with. ``done`` maps each prefix of steps already run on
  ``x_local`` (a tuple of steps) to its result, and gains this plan's; a plan
  whose first steps are such a prefix starts from its result (XLA would
  emit the same collective once). Returns (this device's block under
  ``plan.dst``, how many of ``plan.steps`` were shared). PRNG keys and 8-bit
  floats (moved as their data) share nothing."""
  want = plan.src.local_shape(global_shape, mesh_sizes)
  if tuple(x_local.shape) != want:
    raise ValueError(
        f"apply_plan: the local block has shape {tuple(x_local.shape)} but "
        f"source sharding {plan.src} of global shape {tuple(global_shape)} on "
        f"mesh {dict(mesh_sizes)} gives local shape {want}.")
  dtype = x_local.dtype
  if math.prod(global_shape) == 0:      # no data: every layout is the empty block
    return zeros(plan.dst.local_shape(global_shape, mesh_sizes), dtype), 0
  if is_key(dtype):   # PRNG keys move as their data: u32[*shape, 2] for threefry
    data = apply_plan(jax.random.key_data(x_local),
                      dataclasses.replace(plan, src=_trailing(plan.src, x_local),
                                          dst=_trailing(plan.dst, x_local)),
                      tuple(global_shape) + key_shape(x_local), mesh_sizes, chunks_first)
    return jax.random.wrap_key_data(data, dtype=dtype), 0
  if _moves_as_bits(dtype) and all(s.kind not in ("psum", "psum_scatter") for s in plan.steps):
    # float8 moves as its bits: XLA:CPU's all-gather made e5m2's -NaN +NaN
    bits = apply_plan(lax.bitcast_convert_type(x_local, np.uint8), plan, global_shape,
                      mesh_sizes, chunks_first)
    return lax.bitcast_convert_type(bits, dtype), 0
  order = mesh_axis_order(mesh_sizes)
  steps, done = tuple(plan.steps), {} if done is None else done
  shared = next((k for k in range(len(steps), 0, -1) if steps[:k] in done), 0)
  if shared:
    x_local = done[steps[:shared]]
  for k in range(shared, len(steps)):
    step = steps[k]
    if step.kind in ("psum_scatter", "all_gather"):
      x_local = _LEADING[step.kind](x_local, step, global_shape, mesh_sizes, order,
                                    chunks_first)
    else:
      x_local = _APPLY[step.kind](x_local, step, global_shape, mesh_sizes, order)
    done[steps[:k + 1]] = x_local
  assert tuple(x_local.shape) == plan.dst.local_shape(global_shape, mesh_sizes)
  assert x_local.dtype == dtype, (plan, dtype, x_local.dtype)
  return x_local, shared


def _moves_as_bits(dtype) -> bool:
  """An 8-bit float: moved (gathered, permuted) as uint8."""
  return (jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 1
          and jnp.finfo(dtype).bits == 8)


def is_key(dtype) -> bool:
  """Whether ``dtype`` is a typed PRNG key's (``jax.random.key``)."""
  return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def key_shape(keys) -> tuple[int, ...]:
  """The trailing dims ``jax.random.key_data`` adds to ``keys``' shape."""
  return tuple(keys.dtype._impl.key_shape)


def zeros(shape, dtype):
  """Zeros of ``shape``; for a PRNG key dtype, the key of all-zero data."""
  if is_key(dtype):
    data = jnp.zeros(tuple(shape) + tuple(dtype._impl.key_shape), np.uint32)
    return jax.random.wrap_key_data(data, dtype=dtype)
  return jnp.zeros(shape, dtype)


def pad_zeros(x, widths):
  """``jnp.pad(x, widths)`` (zeros), for PRNG keys too (padded as their data)."""
  if not is_key(x.dtype):
    return jnp.pad(x, widths)
  data = jnp.pad(jax.random.key_data(x), list(widths) + [(0, 0)] * len(key_shape(x)))
  return jax.random.wrap_key_data(data, dtype=x.dtype)


def _trailing(s, keys):
  """Sharding ``s`` with the key data's trailing dims added, unsplit."""
  return dataclasses.replace(s, dims=tuple(s.dims) + ((),) * len(key_shape(keys)))


def chunks_first(mesh) -> bool:
  """Whether a reduce-scatter or all-gather onto an inner dim runs on a leading
  dim of the chunks (``_apply_psum_scatter``): on XLA:CPU devices, where that
  was measured to help. An ``AbstractMesh`` (a program lowered for another
  machine) and other platforms keep the plain collective."""
  return isinstance(mesh, jax.sharding.Mesh) and mesh.devices.flat[0].platform == "cpu"


def mesh_axis_order(mesh_sizes: MeshSizes) -> Axes:
  """The axis order of the enclosing mesh (ppermute numbers devices by it)."""
  names = tuple(getattr(jax.sharding.get_abstract_mesh(), "axis_names", ()))
  return names if names else tuple(mesh_sizes)


def axis_name(axes: Axes):
  """The ``axis_name`` jax collectives take: one name, or a tuple of names."""
  return axes[0] if len(axes) == 1 else tuple(axes)


def linear_axis_index(axes: Axes, sizes: MeshSizes):
  """Inside ``shard_map``: this device's block index over ``axes``, major first
  (``i1*|a2| + i2``), a traced int32."""
  index = np.int32(0)
  for a in axes:
    index = index * sizes[a] + lax.axis_index(a)
  return index


def local_slice(x, start, size: int, axis: int):
  """``lax.dynamic_slice_in_dim``, kept clear of an XLA miscompile (jaxlib
  0.10.2): a length-1 dynamic slice of a rank-1 integer array computed as
  ``dynamic_slice(a) * scalar`` is folded into a slice of ``a``, dropping the
  multiply (``x * jnp.sum(x)`` split over ``('a', 'b')`` returned ``x``). A
  barrier on the operand stops the fold; such operands are a few elements."""
  if x.ndim == 1 and size == 1 and jnp.issubdtype(x.dtype, jnp.integer):
    x = lax.optimization_barrier(x)
  return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _apply_slice(x, step, global_shape, sizes, order):
  n = shard_count(step.axes, sizes)
  size = x.shape[step.dim] // n
  start = linear_axis_index(step.axes, sizes) * size
  return local_slice(x, start, size, step.dim)


def _apply_pad(x, step, global_shape, sizes, order):
  """Keep the logical part of an unsplit dim, zero-pad it to ``step.length``."""
  logical = min(global_shape[step.dim], x.shape[step.dim])
  x = lax.slice_in_dim(x, 0, logical, axis=step.dim)
  config = [(0, 0, 0)] * x.ndim
  config[step.dim] = (0, step.length - logical, 0)
  return lax.pad(x, np.zeros((), x.dtype), config)


def _apply_all_gather(x, step, global_shape, sizes, order, chunks_first=False):
  """An all-gather onto ``step.dim``. ``chunks_first``: when a dim before it is
  longer than 1, the blocks are gathered along a new leading dim and then moved
  into place (a copy of block-long runs; see ``_apply_psum_scatter``)."""
  name, d = axis_name(step.axes), step.dim
  if not chunks_first or all(n == 1 for n in x.shape[:d]):
    return lax.all_gather(x, name, axis=d, tiled=True)
  y = jnp.moveaxis(lax.all_gather(x, name, axis=0, tiled=False), 0, d)
  return y.reshape(x.shape[:d] + (y.shape[d] * x.shape[d],) + x.shape[d + 1:])


def _apply_all_to_all(x, step, global_shape, sizes, order):
  """One all-to-all. Its operand is a barrier's: XLA (jaxlib 0.10.2) splits an
  all-to-all of a concatenation or pad into one operand per piece, and rejects
  its own program when the pieces got different layouts ("all-to-all has
  operands with different shapes: f32[2,2] ... f32[2,2]"): a transposed outer
  product padded for an uneven split, or concatenated with zeros, did that.
  The operand is one buffer either way."""
  return lax.all_to_all(lax.optimization_barrier(x), axis_name(step.axes),
                        split_axis=step.dst_dim, concat_axis=step.src_dim, tiled=True)


def _apply_psum(x, step, global_shape, sizes, order):
  """Resolve a pending sum. Its combine keeps the dtype and the meaning of the
  unpartitioned op: a partial "sum" of bools (a dot, gather or masked slice of
  bools) is an OR, run as a max over uint8; integers wrap around as they would."""
  if x.dtype == np.bool_:
    return lax.pmax(x.astype(np.uint8), axis_name(step.axes)).astype(np.bool_)
  return lax.psum(x, axis_name(step.axes))


def _apply_psum_scatter(x, step, global_shape, sizes, order, chunks_first=False):
  """A reduce-scatter onto ``step.dim``. ``chunks_first``: when a dim before it
  is longer than 1, the chunks the devices receive are first made contiguous
  (``[.., n*c, ..] -> [n, .., c, ..]``, a copy of ``c``-long runs) and the scatter
  runs on that leading dim. XLA:CPU otherwise copies its operand to a layout
  with ``step.dim`` major-most: a full transpose, element by element when the
  dim is the minor one (a channel dim), which took longer than the
  reduce-scatter itself. The same values either way."""
  if x.dtype == np.bool_:
    raise ValueError("gshard internal error: a reshard plan scatters a bool pending sum "
                     "(plans psum bools, then slice)")
  name, d = axis_name(step.axes), step.dim
  if not chunks_first or all(n == 1 for n in x.shape[:d]):
    return lax.psum_scatter(x, name, scatter_dimension=d, tiled=True)
  n = shard_count(step.axes, sizes)
  c = x.shape[d] // n
  y = jnp.moveaxis(x.reshape(x.shape[:d] + (n, c) + x.shape[d + 1:]), d, 0)
  y = lax.psum_scatter(y, name, scatter_dimension=0, tiled=True)
  return y.reshape(x.shape[:d] + (c,) + x.shape[d + 1:])


def _apply_ppermute(x, step, global_shape, sizes, order):
  """jax numbers a multi-axis ppermute's devices in mesh order, whatever the
  order of ``axis_name``: renumber the plan's pairs to it."""
  axes = tuple(sorted(step.axes, key=order.index))
  renumber = renumbering(step.axes, axes, sizes)
  perm = [(renumber[s], renumber[d]) for s, d in step.perm]
  return lax.ppermute(x, axis_name(axes), perm)


def _apply_exchange(x, step, global_shape, sizes, order):
  return run_exchange(x, step.exchange, sizes)


def run_exchange(x, ex, sizes: MeshSizes):
  """Run an ``exchange.Exchange`` on this device's block ``x`` (inside
  ``shard_map``): the pieces it holds, then one received per round (a
  ppermute of the piece each device sends), stacked; its new block's pieces
  taken from the stack by its row of ``take`` and laid out."""
  me = linear_axis_index(ex.axes, sizes)

  def cut(offsets):                     # this device's piece at its row of offsets
    at = jnp.asarray(np.asarray(offsets, np.int32))[me]
    out = x
    for d, q in enumerate(ex.piece):
      if q != out.shape[d]:
        out = local_slice(out, at[d], q, d)
    return out

  pieces = [cut(offsets) for offsets in ex.held]
  for pairs, offsets in ex.rounds:
    dest = dict(pairs)
    pieces.append(permute(cut(offsets), ex.axes, sizes, dest.get))
  stack = jnp.stack(pieces)
  got = jnp.take(stack, jnp.asarray(np.asarray(ex.take, np.int32))[me], axis=0)
  rank, tail = len(ex.piece), tuple(x.shape[len(ex.piece):])   # (a key's data dims)
  got = got.reshape(ex.counts + ex.piece + tail)       # [c0, c1, .., q0, q1, ..]
  got = got.transpose([k for d in range(rank) for k in (d, rank + d)]
                      + list(range(2 * rank, 2 * rank + len(tail))))
  return got.reshape(tuple(c * q for c, q in zip(ex.counts, ex.piece)) + tail)


def permute(x, axes: Axes, sizes: MeshSizes, dest):
  """``lax.ppermute`` over ``axes``: the device at linear index ``i`` (major
  first over ``axes``) sends ``x`` to ``dest(i)`` (``None``: to nobody).

  jax numbers a multi-axis ppermute's devices in mesh order, whatever the
  order of the names given: the pairs are renumbered to it.
  """
  n = shard_count(tuple(axes), sizes)
  order = mesh_axis_order(sizes)
  mesh_axes = tuple(sorted(axes, key=order.index))
  renumber = renumbering(tuple(axes), mesh_axes, sizes)
  pairs = [(renumber[i], renumber[dest(i)]) for i in range(n) if dest(i) is not None]
  return lax.ppermute(x, axis_name(mesh_axes), pairs)


def renumbering(old: Axes, new: Axes, sizes: MeshSizes) -> list[int]:
  """Linear index over ``old`` -> linear index over ``new`` (same axes)."""
  out = []
  for c in itertools.product(*(range(sizes[a]) for a in old)):
    at = dict(zip(old, c))
    out.append(linear_index([at[a] for a in new], [sizes[a] for a in new]))
  return out


_APPLY = {"slice": _apply_slice, "pad": _apply_pad,
          "all_to_all": _apply_all_to_all, "psum": _apply_psum,
          "ppermute": _apply_ppermute, "exchange": _apply_exchange}
_LEADING = {"psum_scatter": _apply_psum_scatter, "all_gather": _apply_all_gather}
