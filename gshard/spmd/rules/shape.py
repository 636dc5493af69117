"""Shape primitives: broadcast, reshape (compound factors), transpose, slices.

A dim that an op only partly keeps (a slice window, a padded or reversed dim,
the concatenated dim) gets factors of its own, blocked from being split:
propagation does not carry a split across it.
"""

from __future__ import annotations

import math

from gshard.spmd.rules._core import (FactorRule, factor_rule, letters, register,
                                     shapes)


class _Names:
  """Fresh factor names, ``a``, ``b``, ... in order of request."""

  def __init__(self):
    self.i = 0

  def __call__(self) -> str:
    self.i += 1
    return letters(1, self.i - 1)


def _build(operands, results, sizes, *, blocked=(), reduction=(), other_reduction=(),
           linear="none") -> FactorRule:
  return FactorRule(
      operands=tuple(tuple(tuple(d) for d in t) for t in operands),
      results=tuple(tuple(tuple(d) for d in t) for t in results),
      sizes=tuple(sorted(sizes.items())), reduction=frozenset(reduction),
      other_reduction=frozenset(other_reduction), blocked=frozenset(blocked),
      linear=linear)


def broadcast_in_dim_rule(in_avals, out_avals, *, shape, broadcast_dimensions,
                          **params) -> FactorRule:
  """``f32[1,16] -> f32[8,4,16]`` with dims (0, 2): ``Ac->abc`` (A has size 1)."""
  del params
  (op_shape, *dyn), (out_shape,) = shapes(in_avals), shapes(out_avals)
  new = _Names()
  out = [new() for _ in out_shape]
  sizes = dict(zip(out, out_shape))
  op = []
  for i, d in enumerate(broadcast_dimensions):
    if op_shape[i] == out_shape[d]:
      op.append((out[d],))
    else:
      f = new()
      sizes[f] = op_shape[i]
      op.append((f,))
  return _build([[*op]] + [[]] * len(dyn), [[(f,) for f in out]], sizes)


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
  new = _Names()
  op: list[list[str]] = [[] for _ in op_shape]
  out: list[list[str]] = [[] for _ in out_shape]
  sizes: dict[str, int] = {}
  blocked: list[str] = []

  def own(dims, i, n, block):
    f = new()
    sizes[f] = n
    dims[i].append(f)
    if block:
      blocked.append(f)

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
      f = new()
      sizes[f] = g
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
  return _build([op] + [[]] * len(dyn), [out], sizes, blocked=blocked, linear="unary")


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


def _windowed(in_avals, out_avals, keep, *, n_scalar_in=0, linear="none") -> FactorRule:
  """Operand 0 and result 0 share the factor of each dim where ``keep[i]``;
  elsewhere each gets a blocked factor of its own."""
  (op_shape, *rest), (out_shape,) = shapes(in_avals), shapes(out_avals)
  new = _Names()
  op, out, sizes, blocked = [], [], {}, []
  for i, (n, m) in enumerate(zip(op_shape, out_shape)):
    if keep[i]:
      f = new()
      sizes[f] = n
      op.append((f,))
      out.append((f,))
    else:
      f, g = new(), new()
      sizes[f], sizes[g] = n, m
      blocked += [f, g]
      op.append((f,))
      out.append((g,))
  others = [_scalar_dims(s, new, sizes, blocked) for s in rest]
  return _build([op] + others, [out], sizes, blocked=blocked, linear=linear)


def _scalar_dims(shape, new, sizes, blocked):
  dims = []
  for n in shape:
    f = new()
    sizes[f] = n
    blocked.append(f)
    dims.append((f,))
  return dims


def slice_rule(in_avals, out_avals, *, start_indices, limit_indices, strides,
               **params) -> FactorRule:
  del params
  (op_shape,) = shapes(in_avals)
  strides = strides or (1,) * len(op_shape)
  keep = [s == 0 and l == n and st == 1 for s, l, st, n in
          zip(start_indices, limit_indices, strides, op_shape)]
  return _windowed(in_avals, out_avals, keep, linear="unary")


def pad_rule(in_avals, out_avals, *, padding_config, **params) -> FactorRule:
  del params
  keep = [tuple(c) == (0, 0, 0) for c in padding_config]
  return _windowed(in_avals, out_avals, keep)


def rev_rule(in_avals, out_avals, *, dimensions, **params) -> FactorRule:
  del params
  keep = [i not in dimensions for i in range(len(in_avals[0].shape))]
  return _windowed(in_avals, out_avals, keep, linear="unary")


def dynamic_slice_rule(in_avals, out_avals, *, slice_sizes, **params) -> FactorRule:
  del params
  op_shape = in_avals[0].shape
  keep = [s == n for s, n in zip(slice_sizes, op_shape)]
  return _windowed(in_avals, out_avals, keep, linear="unary")


def dynamic_update_slice_rule(in_avals, out_avals, **params) -> FactorRule:
  """Operand and result share every factor; the update shares the dims it covers."""
  del params
  op_shape, upd_shape, *idx = shapes(in_avals)
  new = _Names()
  op, upd, sizes = [], [], {}
  for n, m in zip(op_shape, upd_shape):
    f = new()
    sizes[f] = n
    op.append((f,))
    if n == m:
      upd.append((f,))
    else:
      g = new()
      sizes[g] = m
      upd.append((g,))
  return _build([op, upd] + [[] for _ in idx], [op], sizes)


def _pieces_along(ins, outs, whole, dim: int, linear: str) -> FactorRule:
  """Tensors cut into pieces along ``dim`` of the ``whole`` shape: every other
  dim shares a factor; ``dim`` gets a blocked factor per tensor."""
  new = _Names()
  shared = [new() for _ in whole]
  sizes = dict(zip(shared, whole))
  blocked = []

  def dims(shape):
    ds = []
    for i, n in enumerate(shape):
      if i == dim:
        f = new()
        sizes[f] = n
        blocked.append(f)
        ds.append((f,))
      else:
        ds.append((shared[i],))
    return ds

  return _build([dims(s) for s in ins], [dims(s) for s in outs], sizes,
                blocked=blocked, linear=linear)


def concatenate_rule(in_avals, out_avals, *, dimension, **params) -> FactorRule:
  """``concatenate([f32[2,3], f32[2,5]], 1)`` is ``aB,aC->aD blocked={BCD}``."""
  del params
  outs = shapes(out_avals)
  return _pieces_along(shapes(in_avals), outs, outs[0], dimension, "sum")


def split_rule(in_avals, out_avals, *, axis, **params) -> FactorRule:
  del params
  ins = shapes(in_avals)
  return _pieces_along(ins, shapes(out_avals), ins[0], axis, "unary")


def stack_rule(in_avals, out_avals, *, axis, **params) -> FactorRule:
  """``stack([f32[2,3], f32[2,3]], 0)`` (``jnp.stack``) is ``ab,ab->Cab blocked={C}``."""
  del params
  ins, (out,) = shapes(in_avals), shapes(out_avals)
  new = _Names()
  shared = [new() for _ in ins[0]]
  sizes = dict(zip(shared, ins[0]))
  f = new()
  sizes[f] = out[axis % len(out)]
  res = [(g,) for g in shared]
  res.insert(axis % len(out), (f,))
  return _build([[(g,) for g in shared]] * len(ins), [res], sizes, blocked=[f],
                linear="sum")


def unstack_rule(in_avals, out_avals, *, axis, **params) -> FactorRule:
  """``unstack(f32[2,4,3], 0)`` (the transpose of stack) is ``Cab->ab,ab blocked={C}``."""
  del params
  (op,), outs = shapes(in_avals), shapes(out_avals)
  new = _Names()
  f = new()
  shared = [new() for _ in outs[0]]
  sizes = dict(zip(shared, outs[0]))
  sizes[f] = op[axis % len(op)]
  dims = [(g,) for g in shared]
  dims.insert(axis % len(op), (f,))
  return _build([dims], [[(g,) for g in shared]] * len(outs), sizes, blocked=[f],
                linear="unary")


def iota_rule(in_avals, out_avals, **params) -> FactorRule:
  """No operands: the result's factors are free for its consumers to choose."""
  del params
  (out_shape,) = shapes(out_avals)
  f = letters(len(out_shape))
  return factor_rule(f"->{f}", shapes(in_avals), [out_shape])


register("broadcast_in_dim", broadcast_in_dim_rule)
register("reshape", reshape_rule)
register("transpose", transpose_rule)
register("squeeze", squeeze_rule)
register("slice", slice_rule)
register("pad", pad_rule)
register("rev", rev_rule)
register("dynamic_slice", dynamic_slice_rule)
register("dynamic_update_slice", dynamic_update_slice_rule)
register("concatenate", concatenate_rule)
register("split", split_rule)
register("stack", stack_rule)
register("unstack", unstack_rule)
register("iota", iota_rule)
# jax's uninitialised scalar (cond/scan residual placeholders in a VJP): no operands.
register("empty2", iota_rule)
