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

import dataclasses
from collections.abc import Sequence
import math
import warnings

import jax.numpy as jnp
import numpy as np
from jax import lax

from gshard.spmd.partition.context import Context, Value
from gshard.spmd.partition.generic import fit
from gshard.spmd.partition.halo import permute
from gshard.spmd.partition.plan import plan_local
from gshard.spmd.sharding import TensorSharding, itemsize


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
  nbytes = math.prod(np.shape(piece)) * itemsize(piece.dtype)
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


# -- stage_switch ----------------------------------------------------------------------

def select_rows(index, per_branch: Sequence[Sequence], kdims: Sequence[int]) -> list:
  """``per_branch[b][j]`` row-selected by ``index`` along ``kdims[j]``."""
  n = len(per_branch)
  index = jnp.clip(index, 0, n - 1)
  out = []
  for j, d in enumerate(kdims):
    cases = [outs[j] for outs in per_branch]
    if n == 1:
      out.append(cases[0])
      continue
    shape = cases[0].shape
    which = jnp.broadcast_to(
        jnp.reshape(index, (1,) * d + (shape[d],) + (1,) * (len(shape) - d - 1)), shape)
    out.append(lax.select_n(which, *cases))
  return out



class SwitchWarning(UserWarning):
  """A stage_switch computes every branch on every stage (see its rule)."""


class _CrossesStages(Exception):
  """A branch would run a collective over the stage axes (devices in other branches)."""


def _with_dim(s: TensorSharding, dim: int, axes: tuple) -> TensorSharding:
  dims = [tuple(a for a in d if a not in axes) for d in s.dims]
  dims[dim] = tuple(axes)
  return TensorSharding(tuple(dims), s.partial - set(axes))


def stage_switch_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``stage_switch`` (``gshard/pipeline/switch.py``): where its results' K dims
  are split one row per device over the stage axes, one ``lax.switch`` on the
  device's own index entry (each device runs one branch); otherwise, or when a
  branch needs a collective over the stage axes, every branch on every device
  and the rows selected."""
  branches, kdims = eqn.params["branches"], eqn.params["kdims"]
  k = eqn.invars[0].aval.shape[0]
  first = ctx.target(scope, eqn.outvars[0]).without_partial()
  axes = first.dims[kdims[0]]
  # pending over the axes propagation left them (rules.control.cond_rule)
  out_s = [_with_dim(ctx.target(scope, v), d, axes) for v, d in zip(eqn.outvars, kdims)]
  index = ctx.reshard(ins[0], TensorSharding((tuple(axes),)), eqn, "operand 0")
  ops = ins[1:]
  rec = ctx.recorder
  marks = (len(rec.collectives), len(rec.fallbacks), len(rec.choices))

  def branch(b, check: bool):
    sub = scope + ((idx, ("branches", b)),)

    def f(*xs):
      start = len(rec.collectives)
      args = [dataclasses.replace(v, x=x) for v, x in zip(ops, xs)]
      outs = ctx.run_jaxpr(branches[b].jaxpr, sub, (), args)
      outs = [fit(ctx, o, s, eqn, f"result {j}").x for j, (o, s) in
              enumerate(zip(outs, out_s))]
      if check and any(set(c.axes) & set(axes) for c in rec.collectives[start:]):
        raise _CrossesStages
      return outs
    return f

  xs = [v.x for v in ops]
  outs = None
  if axes and k == ctx.num_shards(axes):
    try:
      outs = lax.switch(index.x[0], [branch(b, True) for b in range(len(branches))], *xs)
    except _CrossesStages:
      del rec.collectives[marks[0]:], rec.fallbacks[marks[1]:], rec.choices[marks[2]:]
      warnings.warn(
          f"gshard: a pipeline tick at {ctx.source(eqn)} needs a collective over the stage "
          f"axes {list(axes)} inside a stage's action, so every stage computes every action "
          "and keeps its own (correct, but each tick costs all of them). Keep annotations "
          "inside layer_fn off the stage axis.", SwitchWarning, stacklevel=2)
  if outs is None:
    per_branch = [branch(b, False)(*xs) for b in range(len(branches))]
    outs = select_rows(index.x, per_branch, kdims)
  return [Value(x, s, tuple(v.aval.shape), v.aval.dtype)
          for x, s, v in zip(outs, out_s, eqn.outvars)]
