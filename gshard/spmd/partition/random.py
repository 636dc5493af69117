"""Partition rules for randomness: each device draws its block of the global bits.

JAX's default PRNG (threefry2x32, with ``jax_threefry_partitionable`` on, the
default since 0.5) draws element ``i`` (row-major flat index into the requested
``shape``) of ``random_bits(key, shape)`` as::

  b1, b2 = threefry2x32(key_data[0], key_data[1], hi32(i), lo32(i))
  bits[i] = b1 ^ b2            # 32-bit; 8/16-bit: truncated; 64-bit: b1 << 32 | b2

so an element depends only on the key and its own global index. A device whose
result block starts at ``offset`` along each split dim computes the counters
``sum_d (local_iota_d + offset_d) * global_stride_d`` (64-bit, as two uint32
words) for its block only and hashes them: the bits are those of the
unpartitioned program, bit for bit, at ``1/num_shards`` of the compute and with
no communication. ``random_split`` uses the same counters (it keeps both words
as the new key), and ``iota_2x32_shape`` is the counters themselves.

Other PRNG implementations (``rbg``, ``unsafe_rbg``, a user's), and threefry
with ``jax_threefry_partitionable`` off, do not derive an element from its
index alone. There the bits are drawn whole on every device and each keeps its
block (a local slice, no communication, no warning): exact, at the cost of
drawing the whole array per device (8x the hashing on a 2x4 mesh: measured
5.4e7 vs 4.2e8 flops per device for a dropout mask of f32[32,256,1024]).
Key dims (an array of keys) of a threefry key are split freely: each key
draws its own bits. Not so for the others: jax batches ``rng_bit_generator``
(what ``rbg``/``unsafe_rbg`` draw with) from the batch's first key, so under
``vmap`` a row depends on the whole batch of keys. Their ``random_bits``,
``random_split``, ``random_fold_in`` and ``random_gamma`` over an array of
keys run on the whole array on every device, each keeping its block (the keys
gathered once). ``random_gamma`` draws its sample dims whole too (see its rule).

The key-plumbing primitives (``random_wrap``/``unwrap``/``seed``/``clone``,
``fold_in`` of threefry keys), ``threefry2x32`` and ``bitcast_convert_type``
are elementwise on local values: the generic rule. ``reshard`` (jax's explicit-sharding move,
inserted by samplers given ``out_sharding=``) passes its value through.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p, threefry_prng_impl

from gshard.spmd.partition.context import Context, Value
from gshard.spmd.partition.generic import bind_local, generic_rule
from gshard.spmd.partition.plan import plan_local
from gshard.spmd.sharding import TensorSharding

_U32 = np.dtype("uint32")


# -- 64-bit counters as two uint32 words -------------------------------------

def mul_wide(x, c: int):
  """``x * c`` as ``(hi, lo)`` uint32 words; ``x`` a uint32 array, ``0 <= c < 2**32``.

  Schoolbook on 16-bit halves, so every partial product fits in 32 bits.
  ``mul_wide(jnp.uint32(2**31), 6) == (3, 0)``.
  """
  c_hi, c_lo = np.uint32(c >> 16), np.uint32(c & 0xFFFF)
  x_hi, x_lo = x >> np.uint32(16), x & np.uint32(0xFFFF)
  ll, lh, hl, hh = x_lo * c_lo, x_lo * c_hi, x_hi * c_lo, x_hi * c_hi
  mid = lh + hl
  mid_carry = (mid < lh).astype(_U32)
  lo = ll + (mid << np.uint32(16))
  lo_carry = (lo < ll).astype(_U32)
  hi = hh + (mid >> np.uint32(16)) + (mid_carry << np.uint32(16)) + lo_carry
  return hi, lo


def add_wide(a, b):
  """``(hi, lo) + (hi, lo)`` modulo 2**64."""
  lo = a[1] + b[1]
  return a[0] + b[0] + (lo < a[1]).astype(_U32), lo


def flat_counters(local_shape, global_shape, offsets):
  """The row-major global flat index of every element of a local block.

  Args:
    local_shape: the block's shape, e.g. ``(4, 4)``.
    global_shape: the whole array's shape, e.g. ``(8, 16)``.
    offsets: per dim, the block's first global index (int or traced uint32).

  Returns:
    ``(hi, lo)``: two uint32 arrays of ``local_shape``, the high and low words
    of the 64-bit index, as ``jax._src.random.prng.iota_2x32_shape`` gives for
    the whole array. For the block at ``(4, 8)`` of ``(8, 16)``, ``lo[0, 0] == 72``.
  """
  if not global_shape:
    return jnp.zeros((), _U32), jnp.zeros((), _U32)
  strides = [math.prod(global_shape[d + 1:]) for d in range(len(global_shape))]
  idx = [lax.broadcasted_iota(_U32, tuple(local_shape), d) + jnp.asarray(o, _U32)
         for d, o in enumerate(offsets)]
  if math.prod(global_shape) <= 2 ** 32:     # every index fits in the low word
    lo = sum((i * np.uint32(s) for i, s in zip(idx[:-1], strides[:-1])), idx[-1])
    return jnp.zeros(tuple(local_shape), _U32), lo
  acc = (jnp.zeros(tuple(local_shape), _U32), jnp.zeros(tuple(local_shape), _U32))
  for i, s in zip(idx, strides):
    hi, lo = mul_wide(i, s & 0xFFFFFFFF)
    acc = add_wide(acc, (hi + i * np.uint32(s >> 32), lo))
  return acc


# -- the rules -----------------------------------------------------------------

def _threefry_local(ctx: Context, key: Value, num_key_dims: int, out: TensorSharding,
                    global_shape):
  """(b1, b2): threefry of this device's block of the counters, per local key."""
  key_local = key.sharding.local_shape(key.shape, ctx.mesh_sizes)
  local = out.local_shape(tuple(key.shape) + tuple(global_shape),
                          ctx.mesh_sizes)[num_key_dims:]
  offsets = []
  for d, axes in enumerate(out.dims[num_key_dims:]):
    offsets.append(ctx.linear_index(axes).astype(_U32) * np.uint32(local[d]) if axes
                   else 0)
  hi, lo = flat_counters(local, tuple(global_shape), offsets)
  data = jax.random.key_data(key.x)                      # u32[*key_local, 2]
  full = tuple(key_local) + tuple(local)
  kdims = tuple(range(len(key_local)))
  k1 = lax.broadcast_in_dim(data[..., 0], full, kdims)
  k2 = lax.broadcast_in_dim(data[..., 1], full, kdims)
  cdims = tuple(range(len(key_local), len(full)))
  hi, lo = (lax.broadcast_in_dim(c, full, cdims) for c in (hi, lo))
  return threefry2x32_p.bind(k1, k2, hi, lo)


def _counter_based(key_dtype) -> bool:
  """Whether element i of the bits depends on the key and i alone."""
  return (getattr(key_dtype, "_impl", None) is threefry_prng_impl
          and jax.config.jax_threefry_partitionable)


def _per_key(key_dtype) -> bool:
  """Whether each key of an array of keys draws on its own (threefry's
  vmapped hash), not from its batch (``rng_bit_generator``'s batching)."""
  return getattr(key_dtype, "_impl", None) is threefry_prng_impl


def _whole_keys(ctx: Context, eqn, ins, scope) -> list[Value]:
  """The op on the whole array of keys (and its other operands) on every
  device; the interpreter keeps each device's block of the results."""
  plan = plan_local(ctx, eqn, ins, scope)
  whole = [TensorSharding.replicated(len(v.shape)) for v in ins]
  return bind_local(ctx, eqn, dataclasses.replace(plan, operands=whole, results=[
      TensorSharding.replicated(len(o.aval.shape)) for o in eqn.outvars]), ins)


def _batched_keys(eqn) -> bool:
  """A random op over an array of non-threefry keys (see :func:`_per_key`)."""
  key = eqn.invars[0].aval
  return bool(key.shape) and not _per_key(key.dtype)


def random_fold_in_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``random_fold_in``: elementwise for threefry keys, whole for the others."""
  if _batched_keys(eqn):
    return _whole_keys(ctx, eqn, ins, scope)
  return generic_rule(ctx, eqn, ins, scope, idx)


def _key_expand(ctx: Context, eqn, ins, scope, make) -> list[Value]:
  """Shared by random_bits and random_split: key dims as planned, new dims local.

  ``make(b1, b2)`` turns the two threefry words into the result's local value.
  """
  if _batched_keys(eqn):
    return _whole_keys(ctx, eqn, ins, scope)
  plan = plan_local(ctx, eqn, ins, scope)
  key = ctx.reshard(ins[0], plan.operands[0], eqn, "operand 0")
  out = plan.results[0]
  nk = len(key.shape)
  if not any(out.dims[nk:]):                     # new dims unsplit: the op itself
    return bind_local(ctx, eqn, plan, [key])
  (var,) = eqn.outvars
  global_shape = tuple(var.aval.shape)[nk:]
  if not _counter_based(key.dtype):
    # Draw the whole array here; the interpreter then keeps the local block
    # (a slice: no communication).
    whole = dataclasses.replace(plan, results=[
        TensorSharding(out.dims[:nk] + ((),) * len(global_shape))])
    return bind_local(ctx, eqn, whole, [key])
  b1, b2 = _threefry_local(ctx, key, nk, out, global_shape)
  return [Value(make(b1, b2), out, tuple(var.aval.shape), var.aval.dtype)]


def random_bits_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``random_bits`` with its bits dims split: this device's block, bit-exact."""
  del idx
  bit_width = eqn.params["bit_width"]
  dtype = np.dtype(f"uint{bit_width}")

  def make(b1, b2):
    if bit_width == 64:
      return (b1.astype(dtype) << dtype.type(32)) | b2.astype(dtype)
    return (b1 ^ b2).astype(dtype)

  return _key_expand(ctx, eqn, ins, scope, make)


def random_split_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``random_split`` with its new dims split: the keys of this device's block."""
  del idx
  key_dtype = eqn.outvars[0].aval.dtype

  def make(b1, b2):
    return jax.random.wrap_key_data(jnp.stack([b1, b2], axis=-1), dtype=key_dtype)

  return _key_expand(ctx, eqn, ins, scope, make)


def iota_2x32_shape_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """The 64-bit counters themselves, for this device's block."""
  del idx
  plan = plan_local(ctx, eqn, ins, scope)
  out = plan.results[0]
  shape = tuple(eqn.params["shape"])
  local = out.local_shape(shape, ctx.mesh_sizes)
  offsets = [ctx.linear_index(axes).astype(_U32) * np.uint32(n) if axes else 0
             for axes, n in zip(out.dims, local)]
  hi, lo = flat_counters(local, shape, offsets)
  return [Value(hi, out, shape, _U32), Value(lo, out, shape, _U32)]


def random_gamma_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``random_gamma(key[*k], alpha[*k, *rest])``: ``k`` split freely, ``rest`` whole.

  Each key is split into one key per element of ``rest``, so a block of
  ``rest`` could derive its keys from the counters like ``random_split``; but
  the rejection sampler compiled in a different program differs from the
  unpartitioned one in the last bit of a few samples (XLA's CPU fusion), so
  ``rest`` is drawn whole here (``alpha`` gathered along it) and sliced.
  """
  del idx
  if _batched_keys(eqn):
    return _whole_keys(ctx, eqn, ins, scope)
  plan = plan_local(ctx, eqn, ins, scope)
  nk = len(ins[0].shape)
  out = plan.results[0]
  whole = TensorSharding(out.dims[:nk] + ((),) * (len(out.dims) - nk))
  return bind_local(ctx, eqn, dataclasses.replace(
      plan, operands=[plan.operands[0], whole], results=[whole]), ins)
