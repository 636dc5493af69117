"""Derivatives of a partitioned function: gshard's partition of ``jax.jvp(fn)``.

Under ``jax.grad`` or ``jax.jvp`` of ``gshard.partition(fn)`` (directly, or
through an outer ``jax.jit``), jax would differentiate the per-device program,
which is not the function's own derivative where gshard rewrote an op into
another of the same values: a max over a split dim combined through integer
keys (no tangent), a ``custom_jvp`` / ``custom_vjp`` run as its body (the rule
not carried), a linear solve inlined (its matrix read through
``stop_gradient``). Each traced call is therefore a ``jax.custom_jvp``: its
value is the partitioned ``fn``; its derivative is the partitioned
``jax.jvp(fn)``, with the same layouts at the boundary (the tangent of a leaf
in its primal's layout), so ``jax.grad`` linearizes and transposes gshard's
program of the true derivative (reverse mode computes the forward once: the
jvp program's primal half).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from gshard.spmd import infer
from gshard.spmd.graph import sub_jaxprs
from gshard.spmd.partition.padded import PaddedArray, as_given, is_padded
from gshard.spmd.source import source_of


def _differentiable(x) -> bool:
  """Whether jax gives ``x`` a tangent of its own dtype (float, complex)."""
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _zero_tangent(x):
  """The ``float0`` zero tangent of a leaf jax does not differentiate."""
  if is_padded(x):
    return PaddedArray(np.zeros(np.shape(x.data), jax.dtypes.float0), x.shape)
  return np.zeros(np.shape(x), jax.dtypes.float0)


def traced_call(part, args: tuple, call: Callable):
  """``part(*args)`` under an outer trace, as a ``jax.custom_jvp`` whose rule is
  ``part``'s partition of ``jax.jvp(part.fn)``; ``call`` runs ``part``'s own
  program (``Partitioned._call``)."""
  prog = part.program(*args)
  leaves, treedef = jax.tree_util.tree_flatten(tuple(args), is_leaf=is_padded)

  @jax.custom_jvp
  def f(*xs):
    return as_given(xs, call(*xs), prog.pairs)

  @f.defjvp
  def f_jvp(primals, tangents):
    where = _custom_vjp_in(prog.result.jaxpr.jaxpr)
    if where is not None:
      raise TypeError(
          f"jax.grad / jax.jvp of the partitioned {part.__name__} reached a jax.custom_vjp "
          f"function (at {where}): gshard differentiates a partitioned function as "
          "jax.jvp of it, and a custom_vjp has a reverse-mode rule only. Differentiate "
          f"inside instead: gshard.partition(jax.grad({part.__name__}), mesh, ...) "
          "partitions the custom_vjp's own backward rule.")
    p_leaves = jax.tree_util.tree_flatten(tuple(primals), is_leaf=is_padded)[0]
    t_leaves = treedef.flatten_up_to(tuple(tangents))
    t_in = [t if _differentiable(p.data if is_padded(p) else p) else p
            for p, t in zip(p_leaves, t_leaves)]
    jvp = _jvp_partitioned(part, prog, treedef, args)
    # padded only where the input was (as a traced call's outputs: as_given)
    outs = list(as_given((*p_leaves, *t_in), jvp(*p_leaves, *t_in), jvp.pairs_override))
    n = len(outs) // 2
    tans = [t if _differentiable(o.data if is_padded(o) else o) else _zero_tangent(o)
            for o, t in zip(outs[:n], outs[n:])]
    return (jax.tree_util.tree_unflatten(prog.out_tree, outs[:n]),
            jax.tree_util.tree_unflatten(prog.out_tree, tans))

  return f(*args)


def _custom_vjp_in(jaxpr):
  """The source line of the first ``custom_vjp`` call in ``jaxpr`` (nested
  jaxprs included), or None."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name.startswith("custom_vjp_call"):
      return source_of(eqn) or "<unknown source>"
    for _, sub in sub_jaxprs(eqn.params):
      found = _custom_vjp_in(sub)
      if found is not None:
        return found
  return None


def _jvp_partitioned(part, prog, treedef, args):
  """The partitioned ``jax.jvp`` of ``part.fn`` for ``prog``'s signature, made
  once: flat primals then flat tangents in, flat outputs then flat tangents
  out; every leaf in ``prog``'s layout, each state output paired as ``prog``
  pairs it (its tangent with its input's tangent), so both halves leave as
  ``prog``'s outputs do (padded where those are)."""
  key, jvps = id(prog), part._jvps
  if key in jvps and jvps[key][0] is prog:
    return jvps[key][1]
  n_in, n_out = len(prog.flat_avals), len(prog.out_avals)
  fn = infer.with_keywords(part.fn, tuple(args), None)[0]

  def jvp_of(*flat):
    primals, tangents = flat[:n_in], flat[n_in:]
    tangents = [t if _differentiable(p) else _zero_tangent(p)
                for p, t in zip(primals, tangents)]
    out, tout = jax.jvp(fn, tuple(jax.tree_util.tree_unflatten(treedef, primals)),
                        tuple(jax.tree_util.tree_unflatten(treedef, tangents)))
    outs, touts = jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(tout)
    # a leaf jax does not differentiate: its value stands in (a float0 leaves no program)
    touts = [o if t.dtype == jax.dtypes.float0 else t for o, t in zip(outs, touts)]
    return (*outs, *touts)
  jvp_of.__name__ = f"jvp_{part.__name__}"

  ins = tuple(s.to_spec() for s in prog.in_shardings) * 2
  outs = tuple(s.to_spec() for s in prog.out_shardings) * 2
  jvp = type(part)(jvp_of, part.mesh, in_specs=ins, out_specs=outs, strict=part.strict,
                   windowed_einsum=part.windowed_einsum)
  jvp.pairs_override = {**prog.pairs, **{n_out + j: n_in + i for j, i in prog.pairs.items()}}
  jvps[key] = (prog, jvp)
  return jvp
