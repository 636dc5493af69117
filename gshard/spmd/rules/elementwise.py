"""Elementwise primitives: every operand and result shares the same factors.

Rank-0 operands (scalar literals, ``select_n``'s scalar predicate) hold no
factors. One family helper registers all of them.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from gshard.spmd.registry import register
from gshard.spmd.rules._core import FactorRule, Factors, factor_rule, letters, shapes


def elementwise_rule(in_avals, out_avals, *, linear: str = "none", **params) -> FactorRule:
  """``add`` of two ``f32[8,16]``: ``ab,ab->ab``; a scalar operand is ``''``.

  An operand dim of size 1 against a larger result dim (implicit broadcast)
  gets a size-1 factor of its own: ``f32[8,1] * f32[8,16]`` is ``aC,ab->ab``.
  """
  del params
  out_shape = tuple(out_avals[0].shape)
  rank = len(out_shape)
  f = letters(rank)
  extra = iter(letters(rank * (len(in_avals) + 1), rank))
  ins = []
  for s in shapes(in_avals):
    if len(s) == 0:
      ins.append("")
    elif len(s) == rank:
      ins.append("".join(c if n == m else next(extra)
                         for c, n, m in zip(f, s, out_shape)))
    else:
      raise ValueError(f"elementwise operand of rank {len(s)} with result rank {rank}")
  return factor_rule(",".join(ins) + "->" + ",".join([f] * len(out_avals)),
                     shapes(in_avals), shapes(out_avals), linear=linear)


def register_elementwise(names: str, linear: str = "none") -> None:
  """Register each of ``names`` with :func:`elementwise_rule` (generic partition)."""
  register(names, functools.partial(elementwise_rule, linear=linear))


# Nonlinear maps: a pending partial sum must be resolved before them.
register_elementwise(
    "abs acos acosh asin asinh atan atan2 atanh cbrt ceil clamp cos cosh "
    "digamma erf erf_inv erfc exp exp2 expm1 floor igamma igamma_grad_a igammac imag "
    "is_finite "
    "lgamma log log1p logistic max min nextafter polygamma pow random_gamma_grad "
    "real regularized_incomplete_beta rem round rsqrt sign sin sinh sqrt square "
    "tan tanh integer_pow zeta bessel_i0e bessel_i1e conj complex "
    "eq ne lt le gt ge eq_to le_to lt_to and or not xor shift_left shift_right_arithmetic "
    "shift_right_logical population_count clz "
    "reduce_precision stop_gradient")
# Linear maps of their one operand: a partial sum passes through.
# (xla_metadata_value: the value form of set_xla_metadata, an identity whose
# lowering tags the op that produced its operand.)
register_elementwise("neg copy copy_p real_to_complex xla_metadata_value",
                     linear="unary")


def _holds(dst, src) -> bool:
  """Whether float type ``dst`` represents every value of ``src`` exactly."""
  a, b = jnp.finfo(src), jnp.finfo(dst)
  return b.nmant >= a.nmant and b.maxexp >= a.maxexp and b.minexp <= a.minexp


def convert_rule(in_avals, out_avals, **params) -> FactorRule:
  """A conversion to a float type that holds every value of the source (f32 to
  f32 or f64, bf16 to f32) is linear; a narrowing one (f32 to bf16) is not,
  nor one to an int or bool: each device would round its partial sum, and the
  sum of the rounded parts is not the rounded sum (f32 partials 1001 and
  -1000 are 1000 and -1000 in bf16)."""
  floats = all(jnp.issubdtype(a.dtype, jnp.inexact) for a in (*in_avals, *out_avals))
  linear = floats and (jnp.issubdtype(in_avals[0].dtype, jnp.complexfloating)
                       <= jnp.issubdtype(out_avals[0].dtype, jnp.complexfloating)) and \
      _holds(out_avals[0].dtype, in_avals[0].dtype)
  return elementwise_rule(in_avals, out_avals, linear="unary" if linear else "none",
                          **params)


register("convert_element_type", convert_rule)
register_elementwise("add sub add_any", linear="sum")
# select_n(p, x, y) of pending cases is the select of their sums: each device
# picks its term or the other case's (a zero's: jax's transpose of a select)
register_elementwise("select_n", linear="select")


def div_rule(in_avals, out_avals, **params) -> FactorRule:
  """A float quotient is linear in its dividend; an integer one truncates, so it
  takes no pending sum: (1 + 1) / 2 is not 1/2 + 1/2."""
  floats = all(jnp.issubdtype(a.dtype, jnp.inexact) for a in out_avals)
  return elementwise_rule(in_avals, out_avals, linear="first" if floats else "none",
                          **params)


# A product passes a pending sum (a float one by a tensor holding inf turns a
# device's 0 * inf into NaN where one device has +-inf: see the README).
register_elementwise("mul", linear="product")
register("div", div_rule)


def barrier_rule(in_avals, out_avals, **params) -> FactorRule:
  """``optimization_barrier`` of several values: each result is its operand
  (``ab,->ab,``), whatever their shapes."""
  del params
  new = Factors()
  dims = [[(new(n),) for n in s] for s in shapes(in_avals)]
  return new.rule(dims, dims)


register("optimization_barrier", barrier_rule)
