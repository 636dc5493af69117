"""Per-layer FLOPs and bytes, counted from the layer's jaxpr, for :func:`balance`.

``layer_costs(layer_fn, stacked_params, x)`` traces ``layer_fn(params_l, x)``
with ``jax.make_jaxpr`` (abstractly: no FLOP is run) for each layer ``l`` and
counts every equation, nested jaxprs included:

- ``dot_general``: ``2 * prod(batch) * prod(lhs free) * prod(rhs free) *
  prod(contracting)`` (a multiply and an add per term).
- ``conv_general_dilated``: ``2 * prod(output shape) * in-features-per-group *
  prod(kernel window)``.
- reductions (``reduce_sum``/``max``/``min``/``prod``/``and``/``or``/
  ``xor``, ``argmax``, ``argmin``, ``reduce``, the ``cum*`` scans) and
  ``scatter-add``-style scatters: 1 per input (update) element.
- data movement (reshape, broadcast, transpose, slices, gather, plain
  scatter, concatenate, pad, convert, iota, ...): 0.
- every other primitive (the elementwise ones: add, mul, exp, tanh, select,
  ...): 1 per output element. XLA counts transcendentals (exp, tanh, ...) in a
  separate counter; here they are one FLOP each.
- nested jaxprs: ``scan`` body times ``length``; ``while`` body times the trip
  count when it can be read off the jaxpr (a counter compared to a bound,
  the counter's start and the bound literals of the loop, the body adding a
  positive literal step: a hand-written counted ``while_loop``, or the
  ``fori_loop`` pattern with literal bounds), the condition once more;
  otherwise body and condition once, with a ``LayerCostWarning``.
  ``cond``: the most expensive branch. Calls (``jit``/``pjit``, ``remat``,
  ``custom_jvp_call``, ``custom_vjp_call``, ``shard_map``, ...): their inner
  jaxprs once each.

Bytes are a memory-traffic proxy without fusion: for each counted equation
the bytes of all its operands and results (a call's or loop's own boundary is
not counted, only its equations, scaled like the FLOPs). ``param_bytes`` is
the size of one layer's parameters, a start for ``balance(memory=...)``.

Example::

  def layer(p, x):                         # x: f32[B, D], p["w"]: f32[D, D]
    return jnp.tanh(x @ p["w"])
  c = layer_costs(layer, {"w": jnp.zeros((L, D, D))}, jnp.zeros((B, D)))
  c.flops    # L entries of 2*B*D*D + B*D
  balance(c, num_stages=4)                 # uses c.flops
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.extend import core as ex_core

from gshard.spmd.sharding import itemsize


class LayerCostWarning(UserWarning):
  """A count is a lower bound: a while loop's trip count could not be read."""


@dataclasses.dataclass(frozen=True)
class LayerCosts:
  """Per-layer costs, one entry per layer (``len(costs) == L``).

  Attributes:
    flops: FLOPs of one call of ``layer_fn`` for that layer (forward only).
    bytes: summed operand + result bytes of its equations (no fusion).
    param_bytes: bytes of that layer's parameters.
  """

  flops: tuple[float, ...]
  bytes: tuple[float, ...]
  param_bytes: tuple[int, ...]

  def __len__(self) -> int:
    return len(self.flops)


_REDUCTIONS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor", "argmax", "argmin", "reduce", "cumsum", "cumprod", "cummax", "cummin",
    "cumlogsumexp",
})
_SCATTER_COMBINE = frozenset({"scatter-add", "scatter_add", "scatter-mul", "scatter_mul",
                              "scatter-min", "scatter_min", "scatter-max", "scatter_max"})
_CALL_FREE = frozenset({"dot_general", "conv_general_dilated", "scatter"})
_MOVEMENT = frozenset({
    "reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "slice",
    "dynamic_slice", "dynamic_update_slice", "gather", "scatter", "concatenate", "pad", "rev",
    "convert_element_type", "bitcast_convert_type", "copy", "copy_p", "iota", "device_put",
    "sharding_constraint", "split", "optimization_barrier", "stop_gradient", "squeeze_p",
    "broadcast", "reduce_precision_p", "mesh_cast", "reshard", "empty",
    "xla_metadata_value",
})

_RULED = _REDUCTIONS | _SCATTER_COMBINE | _MOVEMENT | _CALL_FREE


def _size(aval) -> int:
  return int(math.prod(getattr(aval, "shape", ())))


def _nbytes(aval) -> int:
  dtype = getattr(aval, "dtype", None)
  if dtype is None:
    return 0
  return _size(aval) * itemsize(dtype)


def _aval(v):
  return v.aval


def _inner(value) -> list:
  """The jaxprs inside one equation parameter (a jaxpr, closed jaxpr, or tuple of them)."""
  if isinstance(value, ex_core.ClosedJaxpr):
    return [value.jaxpr]
  if isinstance(value, ex_core.Jaxpr):
    return [value]
  if isinstance(value, (tuple, list)):
    return [j for item in value for j in _inner(item)]
  return []


@dataclasses.dataclass
class _Count:
  flops: float = 0.0
  bytes: float = 0.0

  def add(self, other: _Count, times: float = 1.0):
    self.flops += other.flops * times
    self.bytes += other.bytes * times


def _count(jaxpr) -> _Count:
  total = _Count()
  for eqn in jaxpr.eqns:
    total.add(_equation(eqn))
  return total


def _literal_value(var):
  if isinstance(var, ex_core.Literal):
    value = np.asarray(var.val)
    if value.shape == () and np.issubdtype(value.dtype, np.integer):
      return int(value)
  return None


def _while_trips(eqn) -> int | None:
  """Trip count of a counted while loop, or None.

  Recognises a condition ``lt(c, n)`` (or ``le``, ``gt``/``ge`` with the
  operands swapped) on a carried counter ``c`` whose body adds a positive
  literal step, where ``c``'s start and the bound ``n`` are literals: either a
  literal in the condition or a carry that the body passes through unchanged
  (``lax.fori_loop``'s upper bound) with a literal initial value.
  """
  params = eqn.params
  cond, body = params["cond_jaxpr"].jaxpr, params["body_jaxpr"].jaxpr
  n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
  if len(cond.eqns) != 1 or cond.eqns[0].primitive.name not in ("lt", "le", "gt", "ge"):
    return None
  compare = cond.eqns[0]
  if compare.outvars[0] is not cond.outvars[0]:
    return None
  lhs, rhs = compare.invars
  name = compare.primitive.name
  if name in ("gt", "ge"):
    lhs, rhs = rhs, lhs
    name = "lt" if name == "gt" else "le"
  carries = cond.invars[n_cond:]
  init = eqn.invars[n_cond + n_body:]

  def carry_index(var):
    for i, c in enumerate(carries):
      if c is var:
        return i
    return None

  def start_value(var):
    literal = _literal_value(var)
    if literal is not None:
      return literal
    i = carry_index(var)
    if i is None:
      return None
    # A loop-invariant carry: the body returns its own input unchanged.
    if i != counter and body.outvars[i] is body.invars[n_body + i]:
      return _literal_value(init[i])
    return None

  counter = carry_index(lhs)
  if counter is None:
    return None
  start, bound = _literal_value(init[counter]), start_value(rhs)
  if start is None or bound is None:
    return None
  out = body.outvars[counter]
  step = None
  for e in body.eqns:
    if e.outvars[0] is out and e.primitive.name == "add":
      a, b = e.invars
      if a is body.invars[n_body + counter]:
        step = _literal_value(b)
      elif b is body.invars[n_body + counter]:
        step = _literal_value(a)
  if step is None or step <= 0:
    return None
  span = bound - start + (1 if name == "le" else 0)
  return max(0, -(-span // step))


def _equation(eqn) -> _Count:
  name = eqn.primitive.name
  params = eqn.params
  if name == "scan":
    out = _Count()
    out.add(_count(params["jaxpr"].jaxpr), params["length"])
    return out
  if name == "while":
    body, cond = _count(params["body_jaxpr"].jaxpr), _count(params["cond_jaxpr"].jaxpr)
    trips = _while_trips(eqn)
    out = _Count()
    if trips is None:
      warnings.warn(
          "layer_costs: a while loop's trip count cannot be read from the jaxpr (not a "
          "counter compared to a constant); its body is counted once, so the FLOPs are a lower "
          "bound. Use lax.scan or lax.fori_loop with static bounds for an exact count.",
          LayerCostWarning, stacklevel=4)
      out.add(body)
      out.add(cond)
    else:
      out.add(body, trips)
      out.add(cond, trips + 1)
    return out
  if name in ("cond", "stage_switch"):     # one branch runs (per device)
    branches = [_count(j) for j in _inner(params["branches"])]
    return _Count(max(b.flops for b in branches), max(b.bytes for b in branches))
  # Calls: whatever carries jaxprs and has no rule of its own (a scatter's
  # update_jaxpr or a reduce's computation is part of that primitive's rule).
  inner = [j for value in params.values() for j in _inner(value)]
  if inner and name not in _RULED:
    out = _Count()
    for j in inner:
      out.add(_count(j))
    return out
  traffic = sum(_nbytes(_aval(v)) for v in eqn.invars) + \
      sum(_nbytes(_aval(v)) for v in eqn.outvars)
  return _Count(float(_flops(eqn)), float(traffic))


def _flops(eqn) -> int:
  name = eqn.primitive.name
  if name == "dot_general":
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    batch = math.prod(lhs[d] for d in lb)
    contract = math.prod(lhs[d] for d in lc)
    lhs_free = math.prod(n for d, n in enumerate(lhs) if d not in lc and d not in lb)
    rhs_free = math.prod(n for d, n in enumerate(rhs) if d not in rc and d not in rb)
    return 2 * batch * lhs_free * rhs_free * contract
  if name == "conv_general_dilated":
    rhs = eqn.invars[1].aval.shape
    rhs_spec = eqn.params["dimension_numbers"].rhs_spec
    in_features, window = rhs[rhs_spec[1]], math.prod(rhs[d] for d in rhs_spec[2:])
    return 2 * _size(eqn.outvars[0].aval) * in_features * window
  if name in _REDUCTIONS:
    return sum(_size(_aval(v)) for v in eqn.invars)
  if name in _SCATTER_COMBINE:
    return _size(eqn.invars[2].aval)
  if name in _MOVEMENT:
    return 0
  return sum(_size(_aval(v)) for v in eqn.outvars)


def jaxpr_costs(fn: Callable, *args) -> tuple[float, float]:
  """``(flops, bytes)`` of ``fn(*args)`` by the rules of this module (args may be abstract)."""
  closed = jax.make_jaxpr(fn)(*args)
  count = _count(closed.jaxpr)
  return count.flops, count.bytes


def jaxpr_counts(jaxpr) -> tuple[float, float]:
  """``(flops, bytes)`` of a (closed) jaxpr as it is, e.g. the per-device program of
  ``gshard.partition(...).lower(...).per_device_jaxpr()`` (collectives count 0)."""
  count = _count(getattr(jaxpr, "jaxpr", jaxpr))
  return count.flops, count.bytes


def _abstract(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), _dtype(a)), tree)


def _dtype(a):
  return a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype


def _signature(tree):
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((tuple(np.shape(a)), str(_dtype(a))) for a in leaves)


def layer_costs(layer_fn: Callable, stacked_params, x, *, stacked: bool = True) -> LayerCosts:
  """FLOPs and bytes of each layer of a stack, counted from the jaxpr.

  Args:
    layer_fn: ``layer_fn(params_l, x) -> y``, one layer; ``y`` is the next
      layer's ``x`` (same pytree structure as ``x``, shapes may change).
    stacked_params: with ``stacked=True``, a pytree whose every leaf has the
      layer axis first (``f32[L, ...]``); with ``stacked=False``, a sequence of
      L per-layer pytrees (layers may differ in shape).
    x: the first layer's input (arrays or ``jax.ShapeDtypeStruct``).
    stacked: how ``stacked_params`` is laid out.

  Returns:
    :class:`LayerCosts` with L entries. Each distinct (params, input) shape
    signature is traced once, so a uniform stack is traced once.

  Example::

    c = layer_costs(lambda p, x: x @ p, jnp.zeros((3, 8, 8)), jnp.zeros((4, 8)))
    c.flops        # (512.0, 512.0, 512.0): 2 * 4 * 8 * 8 each
  """
  if stacked:
    leaves = jax.tree.leaves(stacked_params)
    if not leaves:
      raise ValueError("layer_costs: stacked_params has no arrays; pass the stacked pytree "
                       "(every leaf f32[L, ...]) or stacked=False with a list of layers.")
    sizes = {np.shape(a)[0] if np.ndim(a) else None for a in leaves}
    if len(sizes) != 1 or None in sizes:
      raise ValueError(f"layer_costs: with stacked=True every leaf of stacked_params needs the "
                       f"same leading layer axis, got leading sizes "
                       f"{sorted(map(str, sizes))}; pass stacked=False with a list of "
                       "per-layer params if the layers differ.")
    num_layers = sizes.pop()
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a)[1:], _dtype(a)),
                       stacked_params)
    layers = [one] * num_layers
  else:
    if isinstance(stacked_params, (str, bytes)) or not isinstance(stacked_params, Sequence):
      raise ValueError(f"layer_costs: with stacked=False, stacked_params must be a list of "
                       f"per-layer params, got {type(stacked_params).__name__}.")
    layers = [_abstract(p) for p in stacked_params]
  x = _abstract(x)
  cache: dict = {}
  flops, traffic, param_bytes = [], [], []
  for params in layers:
    key = (_signature(params), _signature(x))
    if key not in cache:
      closed = jax.make_jaxpr(layer_fn, return_shape=True)(params, x)
      jaxpr, out_shape = closed
      count = _count(jaxpr.jaxpr)
      cache[key] = (count, out_shape)
    count, out_shape = cache[key]
    flops.append(count.flops)
    traffic.append(count.bytes)
    param_bytes.append(sum(_nbytes(a) for a in jax.tree.leaves(params)))
    x = out_shape
  return LayerCosts(tuple(flops), tuple(traffic), tuple(param_bytes))
