"""One layer's backward in pieces, for the schedule executor.

``pieces(layer, weights, h)`` traces ``jax.vjp(layer, weights, h)`` once, at
one stage's shapes for one micro-batch, and returns :class:`Pieces`, pure
functions the executor calls in different ticks:

- ``forward(w, h) -> (y, saved)``: the layer, and the residuals its backward
  needs *except* the weights themselves (read again from ``w`` when the
  backward runs) and values computed from the weights alone (recomputed
  then). A stash of in-flight micro-batches then grows with activations,
  never with parameters.
- ``primal(w, h) -> y``: the layer alone.
- ``backward(w, saved, ct) -> (dw, dh)``: the whole backward.
- ``input_grad(w, saved, ct) -> (dh, kept)`` and ``weight_grad(w, kept) ->
  dw``: the backward cut in two along its data flow, for schedules that
  split B from W (zero bubble). ``input_grad`` runs every equation the input
  gradient needs; ``weight_grad`` runs the rest, reading ``kept``: the values
  of ``input_grad`` and the residuals and cotangents it uses (for a matmul
  ``y = h @ w``: ``h`` and the cotangent of ``y``). No equation runs twice, so
  B plus W costs what the whole backward costs. Nested ``jit`` and
  ``jax.checkpoint`` calls are inlined before the cut; any other equation that
  feeds the input gradient (a ``scan`` inside the layer, say) runs whole in B.

The traced jaxprs are evaluated equation by equation (``primitive.bind``, each
under its original source line, so ``explain()`` still names the user's code);
batching them with ``jax.vmap(..., spmd_axis_name=stage)`` batches every
primitive, annotations included, as tracing ``layer`` under the vmap would.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import DropVar, Literal

from gshard.spmd.source import rebinding

# Calls whose inner equations are inlined (their results then split finely).
_INLINE = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
           "core_call": "call_jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr"}


class _Key:
  """A value of a flattened program (identity-hashed)."""

  __slots__ = ()


@dataclasses.dataclass(frozen=True, eq=False)
class _Eqn:
  primitive: object
  params: dict
  ins: tuple       # _Key or Literal
  outs: tuple      # _Key or None (dropped)
  source: object
  ctx: object


def _flatten(closed, avals: dict):
  """(input keys, output keys or Literals, equations, constants) of ``closed``,
  nested calls inlined; ``avals`` gets every key's shape and dtype."""
  consts: dict[_Key, object] = {}
  eqns: list[_Eqn] = []

  def new(v):
    k = _Key()
    avals[k] = jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
    return k

  def walk(jaxpr, const_values, in_keys):
    env = {}

    def key(v):
      return v if isinstance(v, Literal) else env[v]

    for v, c in zip(jaxpr.constvars, const_values):
      k = new(v)
      consts[k] = c
      env[v] = k
    for v, k in zip(jaxpr.invars, in_keys):
      env[v] = k
    for e in jaxpr.eqns:
      ins = [key(v) for v in e.invars]
      param = _INLINE.get(e.primitive.name)
      if param is not None and param in e.params:
        inner = e.params[param]
        outs = walk(getattr(inner, "jaxpr", inner), getattr(inner, "consts", ()), ins)
        for v, o in zip(e.outvars, outs):
          if not isinstance(v, DropVar):
            env[v] = o
        continue
      outs = []
      for v in e.outvars:
        if isinstance(v, DropVar):
          outs.append(None)
        else:
          env[v] = new(v)
          outs.append(env[v])
      eqns.append(_Eqn(e.primitive, e.params, tuple(ins), tuple(outs), e.source_info, e.ctx))
    return [key(v) for v in jaxpr.outvars]

  in_keys = [new(v) for v in closed.jaxpr.invars]
  outs = walk(closed.jaxpr, closed.consts, in_keys)
  return in_keys, outs, eqns, consts


def _cone(eqns, targets) -> list:
  """The equations (in order) that ``targets`` depend on."""
  need = {t for t in targets if isinstance(t, _Key)}
  keep = []
  for e in reversed(eqns):
    if any(o is not None and o in need for o in e.outs):
      keep.append(e)
      need.update(v for v in e.ins if isinstance(v, _Key))
  return keep[::-1]


def _downstream(eqns, sources) -> set:
  """Every key computed (transitively) from ``sources``."""
  reached = set(sources)
  for e in eqns:
    if any(isinstance(v, _Key) and v in reached for v in e.ins):
      reached.update(o for o in e.outs if o is not None)
  return reached


def _evaluate(eqns, env: dict) -> dict:
  for e in eqns:
    xs = [v.val if isinstance(v, Literal) else env[v] for v in e.ins]
    params = e.primitive.get_bind_params(e.params)
    with rebinding(e.source), e.ctx.manager:
      out = e.primitive.bind(*xs, **params)
    outs = out if e.primitive.multiple_results else [out]
    for k, o in zip(e.outs, outs):
      if k is not None:
        env[k] = o
  return env


def _read(env: dict, key, aval):
  if isinstance(key, Literal):
    return jnp.full(aval.shape, key.val, aval.dtype)
  return env[key]


@dataclasses.dataclass(frozen=True, eq=False)
class Pieces:
  """One layer's forward and backward, cut for the executor (module docstring).

  Attributes:
    saved: avals of the residuals ``forward`` returns (the stash of one
      micro-batch in flight, per layer).
    kept: avals of what ``input_grad`` keeps for ``weight_grad``.
  """

  saved: tuple
  kept: tuple
  _w_tree: object
  _h_tree: object
  _y_tree: object
  _dw_tree: object
  _fwd: tuple          # (w keys, h keys, y outs, eqns, consts)
  _res: tuple          # per residual: ("weight", i) | ("saved", j) | ("recomputed", key) | ("literal", v)
  _saved_keys: tuple
  _recompute: tuple    # forward equations computing the recomputed residuals
  _bwd: tuple          # (res keys, ct keys, dw outs, dh outs, eqns, consts, out avals)
  _cut: tuple          # (B eqns, W eqns, kept sources)

  # -- forward ---------------------------------------------------------------

  def _forward_env(self, w, h):
    w_keys, h_keys, _, _, consts = self._fwd
    env = dict(consts)
    env.update(zip(w_keys, jax.tree.leaves(w)))
    env.update(zip(h_keys, jax.tree.leaves(h)))
    return env

  def primal(self, w, h):
    """The layer's output."""
    _, _, y_outs, eqns, _ = self._fwd
    env = _evaluate(_cone(eqns, y_outs), self._forward_env(w, h))
    return self._y_tree.unflatten([env[k] if not isinstance(k, Literal) else k.val
                                   for k in y_outs])

  def forward(self, w, h):
    """``(y, saved)``: the output and the stashed residuals (no weights)."""
    _, _, y_outs, eqns, _ = self._fwd
    env = _evaluate(_cone(eqns, list(y_outs) + list(self._saved_keys)),
                    self._forward_env(w, h))
    y = self._y_tree.unflatten([env[k] if not isinstance(k, Literal) else k.val
                                for k in y_outs])
    return y, tuple(env[k] for k in self._saved_keys)

  # -- backward --------------------------------------------------------------

  def _backward_env(self, w, saved, ct):
    """The backward's inputs: residuals rebuilt from ``w`` and ``saved``."""
    res_keys, ct_keys, _, _, _, consts, _ = self._bwd
    w_leaves = jax.tree.leaves(w)
    recomputed = {}
    if self._recompute:
      w_keys, _, _, _, fconsts = self._fwd
      env = dict(fconsts)
      env.update(zip(w_keys, w_leaves))
      recomputed = _evaluate(self._recompute, env)
    env = dict(consts)
    for k, (what, ref) in zip(res_keys, self._res):
      if what == "weight":
        env[k] = w_leaves[ref]
      elif what == "saved":
        if saved is not None:      # weight_grad reads the ones it needs from `kept`
          env[k] = saved[ref]
      elif what == "recomputed":
        env[k] = recomputed[ref]
      else:
        env[k] = ref
    if ct is not None:
      env.update(zip(ct_keys, jax.tree.leaves(ct)))
    return env

  def _outputs(self, env, outs, avals, tree):
    return tree.unflatten([_read(env, k, a) for k, a in zip(outs, avals)])

  def backward(self, w, saved, ct):
    """``(dw, dh)`` for output cotangent ``ct``."""
    _, _, dw_outs, dh_outs, eqns, _, avals = self._bwd
    outs = list(dw_outs) + list(dh_outs)
    env = _evaluate(_cone(eqns, outs), self._backward_env(w, saved, ct))
    dw = self._outputs(env, dw_outs, avals[:len(dw_outs)], self._dw_tree)
    dh = self._outputs(env, dh_outs, avals[len(dw_outs):], self._h_tree)
    return dw, dh

  def input_grad(self, w, saved, ct):
    """``(dh, kept)``: the input gradient, and what ``weight_grad`` needs."""
    _, _, dw_outs, dh_outs, _, _, avals = self._bwd
    b_eqns, _, sources = self._cut
    env = _evaluate(b_eqns, self._backward_env(w, saved, ct))
    dh = self._outputs(env, dh_outs, avals[len(dw_outs):], self._h_tree)
    return dh, tuple(env[k] for k in sources)

  def weight_grad(self, w, kept):
    """``dw`` from ``kept`` (and the weights)."""
    _, _, dw_outs, _, _, _, avals = self._bwd
    _, w_eqns, sources = self._cut
    env = self._backward_env(w, None, None)
    env.update(zip(sources, kept))
    env = _evaluate(w_eqns, env)
    return self._outputs(env, dw_outs, avals[:len(dw_outs)], self._dw_tree)


def _aval(x):
  return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))


def pieces(layer, weights, h) -> Pieces:
  """Trace ``layer(weights, h)``'s vjp once and cut it (module docstring).

  ``weights`` and ``h`` may be arrays or ``jax.ShapeDtypeStruct`` pytrees.
  """
  weights = jax.tree.map(_aval, weights)
  h = jax.tree.map(_aval, h)
  box = {}

  def fwd(w, x):
    y, vjp = jax.vjp(layer, w, x)
    leaves, box["vjp"] = jax.tree.flatten(vjp)
    return y, leaves

  closed, (y_shape, res_shape) = jax.make_jaxpr(fwd, return_shape=True)(weights, h)
  n_w, n_h = len(jax.tree.leaves(weights)), len(jax.tree.leaves(h))
  avals: dict = {}
  in_keys, outs, eqns, consts = _flatten(closed, avals)
  w_keys, h_keys = in_keys[:n_w], in_keys[n_w:n_w + n_h]
  n_y = len(jax.tree.leaves(y_shape))
  y_outs, r_outs = outs[:n_y], outs[n_y:]
  from_h = _downstream(eqns, h_keys)
  w_index = {k: i for i, k in enumerate(w_keys)}
  res, saved_keys, recompute_keys = [], [], []
  for r in r_outs:
    if isinstance(r, Literal):
      res.append(("literal", r.val))
    elif r in w_index:
      res.append(("weight", w_index[r]))
    elif r in from_h:
      if r not in saved_keys:
        saved_keys.append(r)
      res.append(("saved", saved_keys.index(r)))
    else:
      recompute_keys.append(r)
      res.append(("recomputed", r))
  res_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in res_shape]
  ct_avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), y_shape)
  vjp_tree = box["vjp"]
  bclosed, (dw_shape, dh_shape) = jax.make_jaxpr(
      lambda r, ct: vjp_tree.unflatten(r)(ct), return_shape=True)(res_avals, ct_avals)
  b_in, b_outs, b_eqns, b_consts = _flatten(bclosed, avals)
  res_keys, ct_keys = b_in[:len(res_avals)], b_in[len(res_avals):]
  n_dw = len(jax.tree.leaves(dw_shape))
  dw_outs, dh_outs = b_outs[:n_dw], b_outs[n_dw:]
  out_avals = tuple(jax.tree.leaves(dw_shape)) + tuple(jax.tree.leaves(dh_shape))
  # The cut: B runs what dh needs; W the rest of what dw needs, from `sources`.
  b_part = _cone(b_eqns, dh_outs)
  in_b = {id(e) for e in b_part}
  w_part = _cone([e for e in b_eqns if id(e) not in in_b], dw_outs)
  made_by_w = {o for e in w_part for o in e.outs if o is not None}
  rebuilt = {k for k, (what, _) in zip(res_keys, res) if what != "saved"}
  sources = []
  for k in [v for e in w_part for v in e.ins] + list(dw_outs):
    if isinstance(k, _Key) and k not in made_by_w and k not in b_consts and \
        k not in rebuilt and k not in sources:
      sources.append(k)
  return Pieces(
      saved=tuple(avals[k] for k in saved_keys), kept=tuple(avals[k] for k in sources),
      _w_tree=jax.tree.structure(weights), _h_tree=jax.tree.structure(h),
      _y_tree=jax.tree.structure(y_shape), _dw_tree=jax.tree.structure(dw_shape),
      _fwd=(tuple(w_keys), tuple(h_keys), tuple(y_outs), tuple(eqns), consts),
      _res=tuple(res), _saved_keys=tuple(saved_keys),
      _recompute=tuple(_cone(eqns, recompute_keys)),
      _bwd=(tuple(res_keys), tuple(ct_keys), tuple(dw_outs), tuple(dh_outs), tuple(b_eqns),
            b_consts, out_avals),
      _cut=(tuple(b_part), tuple(w_part), tuple(sources)))
