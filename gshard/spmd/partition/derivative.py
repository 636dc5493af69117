"""Derivatives of a partitioned function taken from outside it.

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
jvp program's primal half). Where ``fn`` calls a ``custom_vjp`` (reverse
mode only), the call is a ``jax.custom_vjp`` of the partitioned ``jax.vjp``
and pullback; traced values ``fn`` closes over become arguments first.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core.primitives import convert_element_type_p

from gshard.annotate import mesh_context
from gshard.spmd import infer
from gshard.spmd.graph import sub_jaxprs
from gshard.spmd.partition.padded import PaddedArray, as_given, is_padded, logical_args
from gshard.spmd.sharding import mesh_scope


def _differentiable(x) -> bool:
  """Whether jax gives ``x`` a tangent of its own dtype (float, complex)."""
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _weak(x) -> bool:
  return not is_padded(x) and bool(getattr(jax.typeof(x), "weak_type", False))


def _weak_as(weak: bool, t):
  """``t`` weakly typed or not: a weak primal's tangent enters the program
  strong, so its cotangent leaves weak (the transpose of this conversion
  restores the weak type), as ``jax.grad`` of ``jax.jit`` gives it."""
  if is_padded(t) or _weak(t) == weak:
    return t
  return convert_element_type_p.bind(t, new_dtype=jnp.result_type(t), weak_type=weak,
                                     sharding=None)


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
  if closes_over_tracers(part, args):
    return _closed_over(part, args)
  treedef = jax.tree_util.tree_flatten(tuple(args), is_leaf=is_padded)[1]
  if _calls_custom_vjp(prog.result.jaxpr.jaxpr):
    return _reverse_only(part, prog, treedef, args, call)

  @jax.custom_jvp
  def f(*xs):
    return as_given(xs, call(*xs), prog.pairs)

  @f.defjvp
  def f_jvp(primals, tangents):
    p_leaves = jax.tree_util.tree_flatten(tuple(primals), is_leaf=is_padded)[0]
    t_leaves = treedef.flatten_up_to(tuple(tangents))
    t_in = [_weak_as(False, t) if _differentiable(p.data if is_padded(p) else p) else p
            for p, t in zip(p_leaves, t_leaves)]
    jvp = _jvp_partitioned(part, prog, treedef, args)
    # its program run as it is: wrapped in a custom_jvp of its own (a traced
    # call's), jax's remat could not tell its primal outputs from its tangents
    # (jax.checkpoint around the partitioned call); padded only where the input
    # was (as a traced call's outputs: as_given)
    with mesh_scope(part.mesh):
      got = jvp._call(*p_leaves, *t_in)
    outs = list(as_given((*p_leaves, *t_in), got, jvp.pairs_override))
    n = len(outs) // 2
    tans = [t if _differentiable(o.data if is_padded(o) else o) else _zero_tangent(o)
            for o, t in zip(outs[:n], outs[n:])]
    return (jax.tree_util.tree_unflatten(prog.out_tree, outs[:n]),
            jax.tree_util.tree_unflatten(prog.out_tree, tans))

  return f(*args)


def closes_over_tracers(part, args: tuple) -> bool:
  """Whether ``part.fn`` reads traced values it closes over (its program's
  constants), with ``args`` themselves perhaps concrete."""
  if part._cache and not part.reads_tracers:   # no program built so far reads one:
    return False                             # a steady-state call looks nothing up
  return any(isinstance(c, jax.core.Tracer) for c in part.program(*args).result.jaxpr.consts)


def _sibling(part, fn: Callable, in_specs, out_specs, pairs=None):
  """A ``Partitioned`` of ``fn`` on ``part``'s mesh and options; ``pairs``, its
  state pairs where they are not found by structure."""
  made = type(part)(fn, part.mesh, in_specs=in_specs, out_specs=out_specs,
                    strict=part.strict, windowed_einsum=part.windowed_einsum)
  made.pairs_override = pairs
  return made


def _closed_over(part, args: tuple):
  """``part(*args)`` where ``fn`` closes over traced values (an outer
  ``jax.grad``'s parameters, read by ``partition(lambda x: apply(params, x))``):
  those become arguments (``jax.closure_convert``), left to propagation, so
  their derivative is the partitioned one too, not jax's of the per-device
  program (which reads them as constants)."""
  fn = infer.with_keywords(part.fn, tuple(args), None)[0]
  with mesh_context(part.mesh_sizes):
    converted, consts = jax.closure_convert(fn, *logical_args(tuple(args)))
  specs = part.in_specs
  if specs is not None:
    specs = tuple(specs) if isinstance(specs, (tuple, list)) else (specs,)
    specs = specs + (None,) * (len(args) - len(specs)) + (None,) * len(consts)

  def hoisted(*xs):
    return converted(*xs)
  hoisted.__name__ = part.__name__
  return _sibling(part, hoisted, specs, part.out_specs)(*args, *consts)


def _reverse_only(part, prog, treedef, args, call: Callable):
  """The call as a ``jax.custom_vjp`` (``fn`` calls one, which has a
  reverse-mode rule only): forward, the partitioned ``jax.vjp(fn)``, its
  outputs in ``prog``'s layouts and the pullback's residuals as propagation
  lays them out; backward, the partitioned pullback, each cotangent in its
  primal's layout (padded where that is). Forward mode is jax's error, as for
  any custom_vjp."""
  n_in, n_out = len(prog.flat_avals), len(prog.out_avals)
  fn = infer.with_keywords(part.fn, tuple(args), None)[0]
  ins = tuple(s.to_spec() for s in prog.in_shardings)
  outs = tuple(s.to_spec() for s in prog.out_shardings)
  grads = [j for j, a in enumerate(prog.out_avals) if _differentiable(a)]
  made: dict = {}

  def forward(*primals):
    out, pullback = jax.vjp(fn, *jax.tree_util.tree_unflatten(treedef, primals))
    res, made["res"] = jax.tree_util.tree_flatten(pullback)
    return tuple(jax.tree_util.tree_leaves(out)), tuple(res)
  forward.__name__ = f"vjp_{part.__name__}"

  def backward(*flat):
    primals, res, cts = flat[:n_in], flat[n_in:-len(grads) or None], flat[len(flat) - len(grads):]
    full = [np.zeros(np.shape(a), jax.dtypes.float0) for a in prog.out_avals]
    for j, c in zip(grads, cts):
      full[j] = c
    pullback = jax.tree_util.tree_unflatten(made["res"], res)
    got = jax.tree_util.tree_leaves(pullback(jax.tree_util.tree_unflatten(prog.out_tree, full)))
    # a leaf jax does not differentiate: its value stands in (no float0 leaves a program)
    return tuple(p if g.dtype == jax.dtypes.float0 else g for p, g in zip(primals, got))
  backward.__name__ = f"pullback_{part.__name__}"

  fwd_part = _sibling(part, forward, ins, (outs, None), dict(prog.pairs))

  @jax.custom_vjp
  def f(*xs):
    return as_given(xs, call(*xs), prog.pairs)

  def f_fwd(*xs):
    flat = jax.tree_util.tree_flatten(tuple(xs), is_leaf=is_padded)[0]
    y, res = fwd_part(*flat)
    y = as_given(flat, list(y), prog.pairs)
    return jax.tree_util.tree_unflatten(prog.out_tree, y), (flat, res)

  def f_bwd(saved, ct):
    flat, res = saved
    cts = jax.tree_util.tree_flatten(ct, is_leaf=is_padded)[0]
    laid = fwd_part.program(*flat).out_shardings[n_out:]
    bwd_part = _sibling(part, backward, ins + tuple(s.to_spec() for s in laid)
                        + tuple(outs[j] for j in grads), ins, {i: i for i in range(n_in)})
    got = as_given(flat, list(bwd_part(*flat, *res, *(cts[j] for j in grads))),
                   bwd_part.pairs_override)
    got = [_weak_as(_weak(p), g) if _differentiable(p.data if is_padded(p) else p) else None
           for p, g in zip(flat, got)]
    return tuple(jax.tree_util.tree_unflatten(treedef, got))

  f.defvjp(f_fwd, f_bwd)
  return f(*args)


def _calls_custom_vjp(jaxpr) -> bool:
  """Whether ``jaxpr`` (nested jaxprs included) calls a ``custom_vjp``."""
  return any(eqn.primitive.name.startswith("custom_vjp_call")
             or any(_calls_custom_vjp(sub) for _, sub in sub_jaxprs(eqn.params))
             for eqn in jaxpr.eqns)


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
  jvp = _sibling(part, jvp_of, ins, outs,
                 {**prog.pairs, **{n_out + j: n_in + i for j, i in prog.pairs.items()}})
  jvps[key] = (prog, jvp)
  return jvp
