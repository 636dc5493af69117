"""Shape primitives: broadcast, reshape (compound factors), transpose, slices.

A dim that an op only partly keeps (a slice window, a padded or reversed dim,
the concatenated dim) gets factors of its own, blocked from being split:
propagation does not carry a split across it.
"""

from __future__ import annotations

import math

from gshard.spmd.partition import shape as partition
from gshard.spmd.registry import register
from gshard.spmd.rules._core import FactorRule, Factors, factor_rule, letters, shapes


def broadcast_in_dim_rule(in_avals, out_avals, *, shape, broadcast_dimensions,
                          **params) -> FactorRule:
  """``f32[1,16] -> f32[8,4,16]`` with dims (0, 2): ``Ac->abc`` (A has size 1)."""
  del params
  (op_shape, *dyn), (out_shape,) = shapes(in_avals), shapes(out_avals)
  new = Factors()
  out = [new(n) for n in out_shape]
  op = []
  for i, d in enumerate(broadcast_dimensions):
    op.append((out[d],) if op_shape[i] == out_shape[d] else (new(op_shape[i]),))
  return new.rule([[*op]] + [[]] * len(dyn), [[(f,) for f in out]])


def reshape_rule(in_avals, out_avals, *, new_sizes, dimensions=None, **params) -> FactorRule:
  """Compound factors: ``f32[6,4] -> f32[2,3,4]`` is ``(ab)c->abc``.

  Dims are matched by a gcd walk; where sizes cannot be aligned (``[6,4] ->
  [4,6]`` after the common factor 2) the rest gets blocked factors. With
  ``dimensions`` (reshape of the operand transposed by it) the operand's dims
  take the factors of the transposed dims they become.
  """
  del params, new_sizes
  (op_shape, *dyn), (out_shape,) = shapes(in_avals), shapes(out_avals)
  if dimensions is not None:
    op_shape = tuple(op_shape[d] for d in dimensions)
  new = Factors()
  op: list[list[str]] = [[] for _ in op_shape]
  out: list[list[str]] = [[] for _ in out_shape]

  def own(dims, i, n, block):
    dims[i].append(new(n, blocked=block))

  if 0 in op_shape or 0 in out_shape:   # an empty value: nothing to split
    for dims, shape in ((op, op_shape), (out, out_shape)):
      for i, n in enumerate(shape):
        own(dims, i, n, True)
    if dimensions is not None:
      back = [None] * len(op)
      for i, d in enumerate(dimensions):
        back[d] = op[i]
      op = back
    return new.rule([op] + [[]] * len(dyn), [out], linear="unary")

  # Size-1 dims take no part in the walk.
  for i, n in enumerate(op_shape):
    if n == 1:
      own(op, i, 1, False)
  for j, n in enumerate(out_shape):
    if n == 1:
      own(out, j, 1, False)
  ops = [i for i, n in enumerate(op_shape) if n != 1]
  outs = [j for j, n in enumerate(out_shape) if n != 1]
  for block_ops, block_outs in _blocks(ops, outs, op_shape, out_shape):
    a = b = 0
    op_rem, out_rem = op_shape[block_ops[0]], out_shape[block_outs[0]]
    while a < len(block_ops) and b < len(block_outs):
      g = math.gcd(op_rem, out_rem)
      if g == 1:
        break
      f = new(g)
      op[block_ops[a]].append(f)
      out[block_outs[b]].append(f)
      op_rem //= g
      out_rem //= g
      if op_rem == 1:
        a += 1
        op_rem = op_shape[block_ops[a]] if a < len(block_ops) else 1
      if out_rem == 1:
        b += 1
        out_rem = out_shape[block_outs[b]] if b < len(block_outs) else 1
    # What could not be aligned: blocked factors of its own.
    for dims, idx, k, rem, shape in ((op, block_ops, a, op_rem, op_shape),
                                     (out, block_outs, b, out_rem, out_shape)):
      if k < len(idx):
        own(dims, idx[k], rem, True)
        for i in idx[k + 1:]:
          own(dims, i, shape[i], True)
  if dimensions is not None:
    back = [None] * len(op)
    for i, d in enumerate(dimensions):
      back[d] = op[i]
    op = back
  return new.rule([op] + [[]] * len(dyn), [out], linear="unary")


def _blocks(ops, outs, op_shape, out_shape):
  """Split non-unit dims into minimal runs with equal products."""
  blocks, a, b = [], 0, 0
  while a < len(ops) and b < len(outs):
    bo, bu = [ops[a]], [outs[b]]
    po, pu = op_shape[ops[a]], out_shape[outs[b]]
    a, b = a + 1, b + 1
    while po != pu:
      if po < pu:
        bo.append(ops[a]); po *= op_shape[ops[a]]; a += 1
      else:
        bu.append(outs[b]); pu *= out_shape[outs[b]]; b += 1
    blocks.append((bo, bu))
  return blocks


def transpose_rule(in_avals, out_avals, *, permutation, **params) -> FactorRule:
  """``transpose(f32[2,3], (1,0))`` is ``ab->ba``."""
  del params
  f = letters(len(permutation))
  out = "".join(f[p] for p in permutation)
  return factor_rule(f"{f}->{out}", shapes(in_avals), shapes(out_avals), linear="unary")


def squeeze_rule(in_avals, out_avals, *, dimensions, **params) -> FactorRule:
  """``squeeze(f32[4,1,8], (1,))`` is ``abc->ac``."""
  del params
  (op_shape,) = shapes(in_avals)
  f = letters(len(op_shape))
  out = "".join(c for i, c in enumerate(f) if i not in dimensions)
  return factor_rule(f"{f}->{out}", shapes(in_avals), shapes(out_avals), linear="unary")


def windowed_rule(in_avals, out_avals, keep, *, linear="none") -> FactorRule:
  """Operand 0 and result 0 share the factor of each dim where ``keep[i]``;
  elsewhere each gets a blocked factor of its own. Further operands (start
  indices, a pad value) get blocked factors.

  ``slice(f32[8,16])`` to ``f32[8,4]`` is ``ab->ac blocked={bc}``.
  """
  (op_shape, *rest), (out_shape,) = shapes(in_avals), shapes(out_avals)
  new = Factors()
  op, out = [], []
  for i, (n, m) in enumerate(zip(op_shape, out_shape)):
    if keep[i]:
      f = new(n)
      op.append((f,))
      out.append((f,))
    else:
      op.append((new(n, blocked=True),))
      out.append((new(m, blocked=True),))
  others = [[(new(n, blocked=True),) for n in shape] for shape in rest]
  return new.rule([op] + others, [out], linear=linear)


def slice_rule(in_avals, out_avals, *, start_indices, limit_indices, strides,
               **params) -> FactorRule:
  """A dim the slice keeps whole shares its factor; a sliced one is blocked."""
  del params
  (op_shape,) = shapes(in_avals)
  strides = strides or (1,) * len(op_shape)
  keep = [s == 0 and l == n and st == 1 for s, l, st, n in
          zip(start_indices, limit_indices, strides, op_shape)]
  return windowed_rule(in_avals, out_avals, keep, linear="unary")


def pad_rule(in_avals, out_avals, *, padding_config, **params) -> FactorRule:
  """An unpadded dim shares its factor; a padded one is blocked."""
  del params
  keep = [tuple(c) == (0, 0, 0) for c in padding_config]
  return windowed_rule(in_avals, out_avals, keep)


def rev_rule(in_avals, out_avals, *, dimensions, **params) -> FactorRule:
  """An unreversed dim shares its factor; a reversed one is blocked."""
  del params
  keep = [i not in dimensions for i in range(len(in_avals[0].shape))]
  return windowed_rule(in_avals, out_avals, keep, linear="unary")


def _pieces_along(ins, outs, whole, dim: int, linear: str) -> FactorRule:
  """Tensors cut into pieces along ``dim`` of the ``whole`` shape: every other
  dim shares a factor; ``dim`` gets a blocked factor per tensor."""
  new = Factors()
  shared = [new(n) for n in whole]

  def dims(shape):
    return [(new(n, blocked=True),) if i == dim else (shared[i],)
            for i, n in enumerate(shape)]

  return new.rule([dims(s) for s in ins], [dims(s) for s in outs], linear=linear)


def concatenate_rule(in_avals, out_avals, *, dimension, **params) -> FactorRule:
  """``concatenate([f32[2,3], f32[2,5]], 1)`` is ``aB,aC->aD blocked={BCD}``."""
  del params
  outs = shapes(out_avals)
  return _pieces_along(shapes(in_avals), outs, outs[0], dimension, "sum")


def split_rule(in_avals, out_avals, *, axis, **params) -> FactorRule:
  """``split(f32[2,8], sizes=(3,5), axis=1)`` is ``aB->aC,aD blocked={BCD}``."""
  del params
  ins = shapes(in_avals)
  return _pieces_along(ins, shapes(out_avals), ins[0], axis, "unary")


def stack_rule(in_avals, out_avals, *, axis, **params) -> FactorRule:
  """``stack([f32[2,3], f32[2,3]], 0)`` (``jnp.stack``) is ``ab,ab->Cab blocked={C}``."""
  del params
  ins, (out,) = shapes(in_avals), shapes(out_avals)
  new = Factors()
  shared = [new(n) for n in ins[0]]
  f = new(out[axis % len(out)], blocked=True)
  res = [(g,) for g in shared]
  res.insert(axis % len(out), (f,))
  return new.rule([[(g,) for g in shared]] * len(ins), [res], linear="sum")


def unstack_rule(in_avals, out_avals, *, axis, **params) -> FactorRule:
  """``unstack(f32[2,4,3], 0)`` (the transpose of stack) is ``Cab->ab,ab blocked={C}``."""
  del params
  (op,), outs = shapes(in_avals), shapes(out_avals)
  new = Factors()
  f = new(op[axis % len(op)], blocked=True)
  shared = [new(n) for n in outs[0]]
  dims = [(g,) for g in shared]
  dims.insert(axis % len(op), (f,))
  return new.rule([dims], [[(g,) for g in shared]] * len(outs), linear="unary")


def tile_rule(in_avals, out_avals, *, reps, **params) -> FactorRule:
  """``jnp.tile(f32[4,8], (2, 1))`` is ``ab->(Ca)b linear=unary``: a repeated
  dim is its copies (major, ``C``) of the operand's dim. Splitting the copies
  leaves each device fewer of them; the operand's dim itself can split the
  result only when it is not repeated (a split minor factor would not be one
  contiguous block)."""
  del params
  (op,), _ = shapes(in_avals), shapes(out_avals)
  new = Factors()
  dims = [new(n) for n in op]
  res = [(new(r), f) if r != 1 else (f,) for f, r in zip(dims, reps)]
  return new.rule([[(f,) for f in dims]], [res], linear="unary")


def iota_rule(in_avals, out_avals, **params) -> FactorRule:
  """No operands: the result's factors are free for its consumers to choose."""
  del params
  (out_shape,) = shapes(out_avals)
  f = letters(len(out_shape))
  return factor_rule(f"->{f}", shapes(in_avals), [out_shape])


register("broadcast_in_dim", broadcast_in_dim_rule)
register("reshape", reshape_rule, partition=partition.reshape_rule)
register("transpose", transpose_rule)
register("squeeze", squeeze_rule)
register("slice", slice_rule, partition=partition.slice_rule)
register("pad", pad_rule, partition=partition.pad_rule)
register("rev", rev_rule, partition=partition.rev_rule)
register("concatenate", concatenate_rule)
register("split", split_rule)
register("stack", stack_rule)
register("unstack", unstack_rule)
register("iota", iota_rule, partition=partition.iota_rule)
register("tile", tile_rule)
# jax's uninitialised scalar (cond/scan residual placeholders in a VJP): no operands.
register("empty2", iota_rule)
