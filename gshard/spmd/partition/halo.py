"""Halo exchange: how a windowed op keeps a split dim split (GShard §3.3).

A windowed op reads, for each result row, a window of operand rows. When a
dim is split, the rows a device needs reach a little past its own block: the
**halo**. Each device receives the halo rows from its neighbours with
``ppermute`` (GSPMD's halo exchange), fills rows beyond the global edges with
the op's padding value (0 for convolution and sums, ``-inf`` for max, the pad
value for ``pad`` ...) and runs the op locally with no padding on that dim.

One dim, seen globally. The operand (dilated first, if the op dilates it) has
``length`` rows split in ``n`` blocks of ``local``; device ``d`` produces its
block of results, which reads operand rows ``[d*advance - lo, d*advance - lo +
width)``. ``advance`` is the rows between the first rows read by two
neighbouring devices (``result block * stride`` for a convolution); when it
differs from ``local`` the offset into the device's extended block moves with
``d`` (a ``dynamic_slice``). :func:`halo_plan` turns this into rows to receive
from each side; a halo larger than one neighbour's block is not exchanged:
that dim is gathered instead (correct, and the reshard's role says why).

Users: ``partition/conv.py`` (convolution, pooling and their gradients) and
``partition/shape.py`` (``slice``, ``pad``, ``rev`` along a split dim).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from gshard.spmd import collectives
from gshard.spmd.partition.context import Context, Value
from gshard.spmd.partition.plan import plan_local
from gshard.spmd.sharding import itemsize


# -- the geometry of one split dim ---------------------------------------------

@dataclasses.dataclass(frozen=True)
class Halo:
  """How each device reads its window of one split dim.

  Device ``d``'s extended block is ``[pad_left fill rows, left rows from
  device d-1, its own local rows, right rows from device d+1, pad_right fill
  rows]``; its window is ``width`` rows from ``offset + d * slope``.

  Example: a SAME 3-wide convolution, stride 1, 16 rows on 4 devices
  (``halo_plan(4, 16, 1, 4, 6)``): ``left=right=1``, ``offset=0``,
  ``slope=0``, ``width=6``: one row from each neighbour, no dynamic offset.
  """

  left: int
  right: int
  pad_left: int
  pad_right: int
  offset: int
  slope: int
  width: int

  @property
  def exchanges(self) -> bool:
    """Whether any rows come from a neighbour."""
    return bool(self.left or self.right)


def halo_plan(n: int, length: int, lo: int, advance: int, width: int) -> Halo | None:
  """The halo of one dim, or ``None`` when a device would need more than one
  neighbour's block.

  Args:
    n: shards of the dim; ``length % n == 0``.
    length: operand rows (after any dilation).
    lo: low padding (negative: rows cut off).
    advance: rows between the first rows read by devices ``d`` and ``d+1``.
    width: rows device ``d`` reads, from ``d * advance - lo``.

  Example: a 5-wide max pool, stride 3, padding (2, 2) over 16 rows on 2
  devices makes 6 windows, 3 per device: device 0 reads rows -2..8, device 1
  rows 7..17 (``advance=9``, ``width=11``). ``halo_plan(2, 16, 2, 9, 11)`` is
  ``Halo(left=1, right=1, pad_left=1, pad_right=1, offset=0, slope=1,
  width=11)``: one row from each neighbour, one fill row beyond each, and
  device ``d``'s window starts ``d`` rows further into its extended block.
  """
  local = length // n
  need_left = lambda d: lo + d * (local - advance)
  need_right = lambda d: d * advance - lo + width - (d + 1) * local
  if width <= 0:
    return None
  ext_left = max(0, need_left(0), need_left(n - 1))
  ext_right = max(0, need_right(0), need_right(n - 1))
  # rows from neighbours, over the devices that have one (none when n == 1:
  # a dim "split" over size-1 axes is whole on every device)
  left = max(0, need_left(1), need_left(n - 1)) if n > 1 else 0
  right = max(0, need_right(0), need_right(n - 2)) if n > 1 else 0
  if left > local or right > local:
    return None
  return Halo(left, right, ext_left - left, ext_right - right, ext_left - lo,
              advance - local, width)


def permute(ctx: Context, x, axes, dest):
  """``lax.ppermute`` over ``axes``: the device at linear index ``i`` (major
  first over ``axes``) sends ``x`` to ``dest(i)`` (``None``: to nobody);
  :func:`gshard.spmd.collectives.permute` on this context's mesh."""
  return collectives.permute(x, axes, ctx.mesh_sizes, dest)


def _row_bytes(x, dim: int) -> int:
  rows = np.shape(x)
  return math.prod(s for i, s in enumerate(rows) if i != dim) * itemsize(x.dtype)


def _fill_rows(x, dim: int, rows: int, fill):
  shape = list(np.shape(x))
  shape[dim] = rows
  return jnp.broadcast_to(jnp.asarray(fill, x.dtype), shape)


def _is_zero(fill) -> bool:
  return isinstance(fill, (int, float)) and fill == 0


def exchange(ctx: Context, v: Value, x, dim: int, axes, halo: Halo, fill, eqn,
             role: str):
  """``x`` (this device's block of ``v`` along ``dim``, possibly dilated) with
  its halo: rows from the neighbours over ``axes``, fill beyond the edges.

  Each ppermute is recorded: ``rows * row bytes`` sent per device. A block's
  halo is exchanged once per trace: a convolution's weight gradient reads
  the forward's (it was sent, and reported, twice).
  """
  n = ctx.num_shards(axes)
  local = np.shape(x)[dim]
  index = ctx.linear_index(axes)

  def receive(rows: int, side: str):
    if side == "left":      # my last rows become my right neighbour's left halo
      start, shift, edge = local - rows, 1, 0
    else:
      start, shift, edge = 0, -1, n - 1

    def send():
      got = permute(ctx, lax.slice_in_dim(x, start, start + rows, axis=dim), axes,
                    lambda i: i + shift if 0 <= i + shift < n else None)
      ctx.record("ppermute", axes, rows * _row_bytes(x, dim), eqn,
                 f"{role} {side} halo (dim {dim}, {rows} rows)", v.sharding, v.sharding,
                 v.shape, v.dtype)
      return got
    got = ctx.once(("halo", dim, tuple(axes), rows, side), x, send)
    if not _is_zero(fill):   # the edge device received nothing: zeros, not fill
      got = jnp.where(index == edge, jnp.asarray(fill, x.dtype), got)
    return got

  parts = []
  if halo.pad_left:
    parts.append(_fill_rows(x, dim, halo.pad_left, fill))
  if halo.left:
    parts.append(receive(halo.left, "left"))
  parts.append(x)
  if halo.right:
    parts.append(receive(halo.right, "right"))
  if halo.pad_right:
    parts.append(_fill_rows(x, dim, halo.pad_right, fill))
  return lax.concatenate(parts, dim) if len(parts) > 1 else x


def window(ctx: Context, x, dim: int, axes, halo: Halo):
  """The ``halo.width`` rows this device reads, from its extended block."""
  if halo.slope == 0:
    return lax.slice_in_dim(x, halo.offset, halo.offset + halo.width, axis=dim)
  start = halo.offset + ctx.linear_index(axes) * halo.slope
  return collectives.local_slice(x, start, halo.width, dim)


def dilate(x, dim: int, factor: int, fill):
  """Insert ``factor - 1`` fill rows after every row (the last one too):
  ``[a, b] -> [a, f, b, f]`` for ``factor=2``. The global dilated value is then
  evenly split; its trailing fill rows are taken off the high padding."""
  if factor == 1:
    return x
  config = [(0, 0, 0)] * x.ndim
  config[dim] = (0, factor - 1, factor - 1)
  return lax.pad(x, jnp.asarray(fill, x.dtype), config)


def haloed(ctx: Context, v: Value, x, dim: int, axes, halo: Halo, fill, eqn, role: str):
  """Exchange then window: the rows of ``dim`` this device's op reads."""
  return window(ctx, exchange(ctx, v, x, dim, axes, halo, fill, eqn, role), dim, axes,
                halo)


# -- planning: keep a dim split where a halo works, gather it elsewhere ------------

def plan_with_halos(ctx: Context, eqn, ins, scope, factors: dict[int, str], geometry):
  """``plan_local`` with each windowed factor kept split only where ``geometry``
  finds a halo for it.

  Args:
    factors: operand-0 dim -> the factor of that windowed dim.
    geometry: ``(dim, n) -> geometry object, or a reason string`` when the dim
      cannot stay split ``n`` ways.
  Returns:
    (plan, {dim: (axes, geometry)}, notes): the notes say which dims were
    gathered and why; they go into the role of the gathering reshard, so
    ``explain()`` shows them.
  """
  blocked: set[str] = set()
  for _ in range(len(factors) + 1):
    plan = plan_local(ctx, eqn, ins, scope, blocked=frozenset(blocked))
    kept, refused = {}, False
    for d, f in factors.items():
      axes = plan.choice.get(f, ())
      if not axes:
        continue
      geo = geometry(d, ctx.num_shards(axes))
      if isinstance(geo, str):
        blocked.add(f)
        refused = True
      else:
        kept[d] = (axes, geo)
    if not refused:
      return plan, kept, _gather_notes(ctx, ins[0], factors, kept, geometry)
  raise AssertionError("unreachable: each round blocks one more factor")


def _gather_notes(ctx: Context, v: Value, factors, kept, geometry) -> list[str]:
  """Why each windowed dim split in ``v`` is not split in the plan."""
  notes = []
  for d in factors:
    have = () if v.literal else v.sharding.dims[d]
    if have and d not in kept:
      why = geometry(d, ctx.num_shards(have))
      notes.append(f"dim {d} gathered: {why if isinstance(why, str) else 'unsplit here'}")
  return notes


def role_with(base: str, notes: list[str]) -> str:
  """``operand 0 (dim 1 gathered: ...)``: a reshard's role with why."""
  return f"{base} ({'; '.join(notes)})" if notes else base


def check_shape(name, got, want, sharding):
  """Raise if a local op gave another shape than the plan says."""
  if tuple(np.shape(got)) != tuple(want):
    raise AssertionError(
        f"gshard internal error: {name} gave local shape {tuple(np.shape(got))}, "
        f"expected {tuple(want)} for {sharding}.")


def blocked_reason(n, sizes: dict[str, int]) -> str | None:
  """Why a dim cannot stay split ``n`` ways (a size not a multiple of ``n``), or None."""
  for what, size in sizes.items():
    if size % n:
      return f"{what} {size} is not a multiple of {n} shards"
  return None
