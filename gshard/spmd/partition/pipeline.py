"""Partition rule of ``pipeline_shift``: rows move between devices by ``ppermute``.

Seen globally the shift is ``y[j] = x[j - k]`` along one dim (``k`` the
offset; circular: indices mod the dim size ``N``; otherwise rows from outside
``[0, N)`` are zeros). When that dim is split over mesh axes ``A`` into ``n``
blocks of ``l`` rows, device ``d``'s block of ``y`` is, with ``k = q*l + r``
(``0 <= r < l``):

- rows ``r .. l-1``: rows ``0 .. l-r-1`` of block ``d - q``;
- rows ``0 .. r-1``: rows ``l-r .. l-1`` of block ``d - q - 1``.

Each part is one ``ppermute`` over ``A`` (device ``i`` sends to ``i + q``, or
``i + q + 1``; mod ``n`` when circular, nobody when the target is past an end,
so the edge device receives zeros), or no communication when its source block
is the device's own. The pipeline's shift (``l = 1``, ``k = 1``) is one
ppermute of the whole block; a halo-like shift (``l > 1``, ``k = 1``) is a
local move plus one row from the left neighbour. Every ppermute is recorded
with its bytes. A split that does not divide the dim evenly is gathered (the
factor is planned unsplit) and the shift runs on local values.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from gshard.spmd.partition.context import Context, Value
from gshard.spmd.partition.generic import plan_local
from gshard.spmd.partition.halo import permute


def _moved(ctx: Context, eqn, v: Value, piece, axes, blocks: int, circular: bool, role: str):
  """``piece`` of every device moved ``blocks`` devices along ``axes``."""
  n = ctx.num_shards(axes)
  if circular:
    blocks %= n
    if blocks == 0:
      return piece
    dest = lambda i: (i + blocks) % n
  else:
    if blocks == 0:
      return piece
    if abs(blocks) >= n:
      return jnp.zeros_like(piece)
    dest = lambda i: i + blocks if 0 <= i + blocks < n else None
  got = permute(ctx, piece, axes, dest)
  nbytes = math.prod(np.shape(piece)) * np.dtype(piece.dtype).itemsize
  ctx.record("ppermute", axes, nbytes, eqn, role, v.sharding, v.sharding, v.shape, v.dtype)
  return got


def shift_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``pipeline_shift`` along a split dim: ppermutes of whole blocks or of the
  boundary rows (module docstring); along an unsplit dim: the shift on local
  values."""
  del idx
  p = eqn.params
  axis, offset, circular = p["axis"], p["offset"], p["circular"]
  size = eqn.invars[0].aval.shape[axis]
  plan = plan_local(ctx, eqn, ins, scope)
  factor = plan.rule.operands[0][axis][0]
  axes = plan.choice.get(factor, ())
  if axes and size % ctx.num_shards(axes):
    plan = plan_local(ctx, eqn, ins, scope, blocked=frozenset({factor}))
    axes = ()
  v = ctx.reshard(ins[0], plan.operands[0], eqn, "operand 0")
  out_s = plan.results[0]
  out = lambda y: [Value(y, out_s, v.shape, v.dtype)]
  if not axes:
    return out(eqn.primitive.bind(v.x, **p))
  x = v.x
  n = ctx.num_shards(axes)
  local = size // n
  k = offset % size if circular else offset
  if not circular and abs(k) >= size:
    return out(jnp.zeros_like(x))
  if k == 0:
    return out(x)
  q, r = divmod(k, local)
  role = f"rows shifted by {offset} along dim {axis}"

  def hop(blocks: int) -> str:
    return f"{abs(blocks)} device{'s' if abs(blocks) != 1 else ''} " + \
        ("on" if blocks > 0 else "back")

  body_role = (f"{role} (whole blocks, {hop(q)})" if r == 0 else
               f"{role} ({local - r} of {local} rows, {hop(q)})")
  body = _moved(ctx, eqn, v, lax.slice_in_dim(x, 0, local - r, axis=axis), axes, q,
                circular, body_role)
  if r == 0:
    return out(body)
  edge = _moved(ctx, eqn, v, lax.slice_in_dim(x, local - r, local, axis=axis), axes, q + 1,
                circular, f"{role} ({r} boundary rows, {hop(q + 1)})")
  return out(lax.concatenate([edge, body], axis))
