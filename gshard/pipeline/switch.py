"""``stage_switch``: in one tick, every pipeline stage runs its own action.

A schedule such as 1F1B has ticks where stage 0 runs a forward while stage 3
runs a backward. Seen globally (one program over ``[K, ...]`` values, one row
per stage) that is::

  out[j][k] = branches[index[k]](*operands)[j][k]     (row k along kdims[j])

Off gshard (one device) it is exactly that: every branch computed, rows
selected. Under ``gshard.partition``, where the results' K dims are split
over the stage mesh axes one row per device, the per-device program is one
``lax.switch`` on the device's own ``index`` entry: device ``d`` runs only
``branches[index[d]]``, partitioned like any inner jaxpr, and its block of
that branch's results is row ``d``, which is what the global semantics asks
for. Collectives inside a branch are fine when they run over other mesh
axes (all their participants share the stage coordinate, hence the branch);
a branch needing one over the stage axes makes the partition rule fall back
to computing every branch and selecting rows (correct, slower, warned).

Everything about the primitive sits here: the builder (branches traced once,
their closed-over values hoisted to operands), impl / abstract eval /
lowering (the select form) and batching. Its sharding and partition rules are
in ``gshard/spmd/rules/pipeline.py`` and ``gshard/spmd/partition/pipeline.py``.
Used by ``gshard.pipeline.executor``; not a public API.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Primitive, Var, jaxpr_as_fun
from jax.interpreters import ad, batching, mlir

from gshard.spmd.partition.pipeline import select_rows


def stage_switch(index, branches: Sequence[Callable], operands: Sequence, kdims: Sequence[int]):
  """Row ``k`` of every result from ``branches[index[k]]`` (module docstring).

  Args:
    index: ``int32[K]``, each stage's branch (clamped into range).
    branches: functions ``f(*operands) -> list of arrays``, all returning the
      same shapes and dtypes.
    operands: arrays.
    kdims: for each result, its dim of size K (one row per stage).

  Returns:
    The list of results.
  """
  avals = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in operands]
  traced = [jax.make_jaxpr(lambda *xs, f=f: list(f(*xs)))(*avals) for f in branches]
  outs = [tuple((a.shape, a.dtype) for a in j.out_avals) for j in traced]
  if any(o != outs[0] for o in outs):
    raise AssertionError(f"gshard internal error: stage_switch branches return {outs}.")
  k = jnp.shape(index)[0]
  for d, a in zip(kdims, traced[0].out_avals):
    if a.shape[d] != k:
      raise AssertionError(f"gshard internal error: stage_switch result {a} has no dim {d} "
                           f"of size K={k}.")
  # Every branch's closed-over values (outer tracers, constants) become
  # operands shared by all branches, deduplicated by identity.
  consts, const_avals, where = [], [], {}
  for j in traced:
    for c, v in zip(j.consts, j.jaxpr.constvars):
      if id(c) not in where:
        where[id(c)] = len(consts)
        consts.append(c)
        const_avals.append(v.aval)
  jaxprs = []
  for j in traced:
    own = {id(c): v for c, v in zip(j.consts, j.jaxpr.constvars)}
    const_vars = [own.get(id(c)) or Var(a) for c, a in zip(consts, const_avals)]
    jaxprs.append(ClosedJaxpr(j.jaxpr.replace(constvars=[],
                                              invars=const_vars + list(j.jaxpr.invars)), ()))
  return stage_switch_p.bind(jnp.asarray(index, jnp.int32), *consts, *operands,
                             branches=tuple(jaxprs), kdims=tuple(int(d) for d in kdims))


def _reference(index, *operands, branches, kdims):
  per_branch = [jaxpr_as_fun(b)(*operands) for b in branches]
  return select_rows(index, per_branch, kdims)


def _abstract_eval(index, *operands, branches, kdims):
  del index, operands, kdims
  return list(branches[0].out_avals)


def _batch(args, dims, *, branches, kdims):
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  args = [jnp.moveaxis(a, d, 0) if d is not None else
          jnp.broadcast_to(a, (size,) + jnp.shape(a)) for a, d in zip(args, dims)]
  out = jax.vmap(lambda *xs: _reference(*xs, branches=branches, kdims=kdims))(*args)
  return out, [0] * len(out)


def _no_jvp(primals, tangents, **params):
  """Differentiating the schedule itself: a second derivative through
  ``pipeline.run(loss_fn=...)`` (its gradients are computed with the loss)."""
  del primals, tangents, params
  raise NotImplementedError(
      "pipeline.run(loss_fn=...) on a mesh, with a schedule whose stages run different "
      "actions in one tick (1f1b, interleaved, zero_bubble or your own table), gives first "
      "derivatives only (jax.grad, value_and_grad, vjp, jacrev of the loss): the schedule "
      "computes them in its forward pass, and differentiating it again (grad of grad, "
      "jvp of grad, a Hessian) is not supported. For second derivatives use "
      "schedule='gpipe', whose loop jax differentiates to any order.")


def _make_primitive() -> Primitive:
  p = Primitive("stage_switch")
  p.multiple_results = True
  p.def_impl(_reference)
  p.def_abstract_eval(_abstract_eval)
  mlir.register_lowering(p, mlir.lower_fun(_reference, multiple_results=True))
  batching.primitive_batchers[p] = _batch
  ad.primitive_jvps[p] = _no_jvp
  return p


stage_switch_p = _make_primitive()
