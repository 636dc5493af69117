"""``shift``: move every row of one dim by ``offset`` rows, the pipeline's one move.

``shift(x, axis=0, offset=1)`` moves row ``i`` to row ``i + 1``; the first
row is filled with zeros and the last row falls off. With ``circular=True``
the last row comes round to row 0 instead (``jnp.roll``). Off gshard it is
exactly ``jnp.roll`` or a pad-and-slice; under ``gshard.partition``, along a
dim split over mesh axes it is **one collective permute** (one row per device
block: the whole block moves to the neighbouring device; larger blocks: a
local shift plus the ``|offset|`` boundary rows from the neighbour), where a
pad/slice or ``jnp.roll`` would gather the dim. ``gshard.pipeline.run``
passes activations between stages with it.

Everything about the primitive sits here, registration last: impl, abstract
eval, MLIR lowering (the same pad/slice or roll), JVP (it is linear),
transpose (the reverse shift, same ``circular``) and batching (the shifted
dim moves past a vmapped dim). Its sharding rule and partition rule are in
``gshard/spmd/rules/pipeline.py`` and ``gshard/spmd/partition/pipeline.py``.

Example::

  from gshard.pipeline import shift
  shift(jnp.arange(4), offset=1)                  # [0, 0, 1, 2]
  shift(jnp.arange(4), offset=1, circular=True)   # [3, 0, 1, 2]
  shift(jnp.arange(4), offset=-1)                 # [1, 2, 3, 0]
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir


def shift(x, axis: int = 0, offset: int = 1, circular: bool = False):
  """Move row ``i`` of dim ``axis`` to row ``i + offset``.

  Args:
    x: an array of rank >= 1.
    axis: the dim to shift (may be negative).
    offset: rows to move by (negative: towards row 0). ``|offset| >=`` the dim
      size gives zeros (non-circular) or wraps (circular).
    circular: rows shifted past the end come back at the start (``jnp.roll``);
      otherwise the rows they leave are zeros.

  Returns:
    An array like ``x``.
  """
  x = jnp.asarray(x)
  if x.ndim == 0:
    raise ValueError(f"shift(x, axis={axis}, offset={offset}): x is a scalar; shift a dim of "
                     "an array of rank >= 1.")
  if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or \
      not -x.ndim <= axis < x.ndim:
    raise ValueError(f"shift(x, axis={axis!r}, offset={offset}): x has shape {x.shape}; axis "
                     f"must be an int in [{-x.ndim}, {x.ndim - 1}].")
  if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
    raise ValueError(f"shift(x, axis={axis}, offset={offset!r}): offset must be an int.")
  return shift_p.bind(x, axis=int(axis) % x.ndim, offset=int(offset), circular=bool(circular))


def shift_reference(x, *, axis: int, offset: int, circular: bool):
  """The shift in jax.numpy: ``jnp.roll`` (circular) or zeros plus a slice."""
  n = x.shape[axis]
  if circular:
    return jnp.roll(x, offset, axis=axis)
  if abs(offset) >= n:
    return jnp.zeros_like(x)
  if offset == 0:
    return x
  zeros = jnp.zeros(x.shape[:axis] + (abs(offset),) + x.shape[axis + 1:], x.dtype)
  if offset > 0:
    kept = lax.slice_in_dim(x, 0, n - offset, axis=axis)
    return lax.concatenate([zeros, kept], axis)
  kept = lax.slice_in_dim(x, -offset, n, axis=axis)
  return lax.concatenate([kept, zeros], axis)


def _abstract_eval(aval, *, axis, offset, circular):
  del axis, offset, circular
  return aval


def _transpose(ct, x, *, axis, offset, circular):
  del x
  return [shift_p.bind(ct, axis=axis, offset=-offset, circular=circular)]


def _batch(args, dims, *, axis, offset, circular):
  (x,), (bdim,) = args, dims
  moved = axis + 1 if bdim <= axis else axis
  return shift_p.bind(x, axis=moved, offset=offset, circular=circular), bdim


def _make_primitive() -> Primitive:
  p = Primitive("pipeline_shift")
  p.def_impl(shift_reference)
  p.def_abstract_eval(_abstract_eval)
  mlir.register_lowering(p, mlir.lower_fun(shift_reference, multiple_results=False))
  batching.primitive_batchers[p] = _batch
  ad.deflinear2(p, _transpose)
  return p


shift_p = _make_primitive()
