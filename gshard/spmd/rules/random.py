"""Randomness: PRNG keys, random bits, and the bit casts every sampler uses.

A key array ``key<fry>[4]`` has the logical shape ``(4,)``; its data is
``u32[4,2]``. The trailing key-data dim appears only around ``random_wrap`` /
``random_unwrap`` and is blocked there: a key is never cut in half.

``random_bits`` and ``random_split`` keep the key's dims and add new ones (the
requested ``shape``): ``key[b] -> u32[b,t,d]`` is ``a->abc``. The new factors
are free, so a dropout mask takes the split of the activation it multiplies;
the partition rule then generates only the local block of bits
(``partition/random.py``). ``threefry2x32`` and ``random_fold_in`` are
elementwise.

``reshard`` (jax's explicit-sharding move, which samplers insert for
``out_sharding=``) is an identity here.

``jax.random.uniform``/``normal``/``bernoulli`` turn bits into floats with
``bitcast_convert_type``, registered here with them: elementwise between types
of one width; a narrowing cast ``f32[8] -> u8[8,4]`` adds a blocked trailing
dim (``a->aZ``) and a widening one removes it.
"""

from __future__ import annotations

import functools

from gshard.spmd.partition import random as partition
from gshard.spmd.partition.generic import identity_rule as identity_partition
from gshard.spmd.registry import register
from gshard.spmd.rules._core import FactorRule, factor_rule, letters, shapes
from gshard.spmd.rules.elementwise import elementwise_rule


def key_data_rule(in_avals, out_avals, *, wrap: bool, **params) -> FactorRule:
  """``random_wrap(u32[4,2]) -> key[4]`` is ``aZ->a blocked={Z}``; unwrap mirrors it."""
  del params
  (key_shape,) = shapes(out_avals if wrap else in_avals)
  f = letters(len(key_shape))
  data = f + "Z"
  spec = f"{data}->{f}" if wrap else f"{f}->{data}"
  return factor_rule(spec, shapes(in_avals), shapes(out_avals), blocked="Z")


def key_expand_rule(in_avals, out_avals, **params) -> FactorRule:
  """``random_bits(key[2], shape=(8,16)) -> u32[2,8,16]`` is ``a->abc``.

  The new dims (``b``, ``c``) are free: consumers choose their split, and the
  partition rule generates the local block of the global bits.
  """
  del params
  (key_shape,), (out_shape,) = shapes(in_avals), shapes(out_avals)
  f = letters(len(out_shape))
  return factor_rule(f"{f[:len(key_shape)]}->{f}", [key_shape], [out_shape])


def gamma_rule(in_avals, out_avals, **params) -> FactorRule:
  """``random_gamma(key[2], f32[2,8])``: ``a,ab->ab``; each key draws for its row.

  The key's dims are the leading dims of ``alpha``; a key of lower rank is
  split into one key per element of the remaining dims.
  """
  del params
  (key_shape, a_shape), (out_shape,) = shapes(in_avals), shapes(out_avals)
  f = letters(len(out_shape))
  return factor_rule(f"{f[:len(key_shape)]},{f}->{f}", [key_shape, a_shape], [out_shape])


def counters_rule(in_avals, out_avals, **params) -> FactorRule:
  """``iota_2x32_shape(shape=(8,16))`` gives two ``u32[8,16]``: ``->ab,ab``."""
  del params
  (out_shape, _) = shapes(out_avals)
  f = letters(len(out_shape))
  return factor_rule(f"->{f},{f}", [], shapes(out_avals))


def bitcast_rule(in_avals, out_avals, **params) -> FactorRule:
  """``bitcast_convert_type``: elementwise, ``ab->ab``, between types of one width.

  ``f32[8] -> u8[8,4]`` is ``a->aZ blocked={Z}``; ``u8[8,4] -> f32[8]`` is
  ``aZ->a blocked={Z}``.
  """
  (in_shape,), (out_shape,) = shapes(in_avals), shapes(out_avals)
  if len(in_shape) == len(out_shape):
    return elementwise_rule(in_avals, out_avals, **params)
  rank = min(len(in_shape), len(out_shape))
  f = letters(rank)
  spec = f"{f}Z->{f}" if len(in_shape) > rank else f"{f}->{f}Z"
  return factor_rule(spec, [in_shape], [out_shape], blocked="Z")


# ``reshard`` is jax's explicit-sharding move. jax.random's samplers insert it
# around their operands and result when given ``out_sharding=`` (flax's Dropout
# passes its input's sharding) and the arguments are mesh-committed arrays.
# gshard chooses layouts itself, so to it ``reshard`` is the identity.
register("reshard", functools.partial(elementwise_rule, linear="unary"),
         partition=identity_partition)
register("random_seed random_clone threefry2x32", elementwise_rule)
register("random_fold_in", elementwise_rule, partition=partition.random_fold_in_rule)
register("random_wrap", functools.partial(key_data_rule, wrap=True))
register("random_unwrap", functools.partial(key_data_rule, wrap=False))
register("random_bits", key_expand_rule, partition=partition.random_bits_rule)
register("random_split", key_expand_rule, partition=partition.random_split_rule)
register("random_gamma", gamma_rule, partition=partition.random_gamma_rule)
register("iota_2x32_shape", counters_rule, partition=partition.iota_2x32_shape_rule)
register("bitcast_convert_type", bitcast_rule)
