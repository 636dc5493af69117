"""Partition rule for debug prints and host callbacks: run once, on whole values.

The unpartitioned program calls ``jax.debug.print("{}", x)`` or an
``io_callback`` once per step, with the whole ``x``. Bound on every device,
the per-device program would call it once per device, each with its own
block: a print repeated, and a stateful callback (a host-side counter, the
next batch of a data loader) advanced once per device, so the devices would
disagree on its result. So the operands are gathered (recorded against the
equation, like any reshard), the callback runs under a ``lax.cond`` on the
mesh's first device only (ordered or not; a ``sharding`` it names is left to
that ``cond``), and its results reach the other devices by one all-reduce of
their bits (the others add zeros: every value exact, NaN payloads and the
sign of zero included; a complex result travels as its two parts, a 4-bit
one widened to a byte). ``pure_callback`` is run the same way, once, as
``jax.jit`` runs it. An ordered ``jax.debug.print`` is bound as it is: jax
refuses ordered prints on more than one device, with or without gshard.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from gshard.spmd.partition.context import Context, Value
from gshard.spmd.partition.generic import safe_rule
from gshard.spmd.partition.reduce import allreduce_bytes_of
from gshard.spmd.sharding import TensorSharding

_BITS = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}


def _bits(d: np.dtype) -> int:
  return jnp.iinfo(d).bits if jnp.issubdtype(d, jnp.integer) else jnp.finfo(d).bits


def _wider(d: np.dtype):
  """A byte-wide (or f32) type that holds every value of the 4-bit type ``d``."""
  if jnp.issubdtype(d, jnp.floating):
    return jnp.float32
  return jnp.int8 if jnp.issubdtype(d, jnp.signedinteger) else jnp.uint8


def _carried(dtype) -> bool:
  """Whether a result of ``dtype`` can be sent exactly as bits: a bool, an
  integer, a real or complex float."""
  try:
    d = np.dtype(dtype)
  except TypeError:
    return False
  if d == np.bool_:
    return True
  if jnp.issubdtype(d, jnp.complexfloating):
    return d.itemsize // 2 * 8 in _BITS
  if jnp.issubdtype(d, jnp.integer) or jnp.issubdtype(d, jnp.floating):
    return _bits(d) in _BITS or _bits(d) < 8
  return False


def _from_first(x, first, axes):
  """``x`` as the first device holds it, on every device: its bits summed
  with the others' zeros."""
  d = np.dtype(x.dtype)
  if d == np.bool_:
    return _from_first(x.astype(jnp.uint8), first, axes).astype(np.bool_)
  if jnp.issubdtype(d, jnp.complexfloating):
    return lax.complex(_from_first(lax.real(x), first, axes),
                       _from_first(lax.imag(x), first, axes))
  if _bits(d) < 8:                      # widened and narrowed back exactly
    return _from_first(x.astype(_wider(d)), first, axes).astype(d)
  bits = lax.bitcast_convert_type(x, _BITS[_bits(d)])
  total = lax.psum(jnp.where(first, bits, jnp.zeros((), bits.dtype)), axes)
  return lax.bitcast_convert_type(total, d)


def once_rule(ctx: Context, eqn, ins: list[Value], scope, idx) -> list[Value]:
  """The operands gathered, the callback bound on the mesh's first device, its
  results (if any) sent from there to every device."""
  outs = [v.aval for v in eqn.outvars]
  if not all(_carried(a.dtype) for a in outs):
    if eqn.primitive.name == "pure_callback":
      return safe_rule(ctx, eqn, ins, scope, idx)     # pure: any number of calls
    raise NotImplementedError(
        f"gshard: {eqn.primitive.name} at {ctx.source(eqn)} returns "
        f"{[str(a.dtype) for a in outs]}; a result of that dtype cannot be sent from the "
        "one device that runs the callback to the others, and running it on every "
        f"device of the mesh {dict(ctx.mesh_sizes)} would repeat its effect. Return "
        "bools, integers or floats (convert on the host), or call it outside the "
        "partitioned function.")
  xs = [v.x if v.literal else
        ctx.reshard(v, TensorSharding.replicated(len(v.shape)), eqn, f"operand {j}").x
        for j, v in enumerate(ins)]
  axes = tuple(ctx.mesh_sizes)
  params = dict(eqn.params)
  if params.get("sharding") is not None:
    params["sharding"] = None          # the cond below picks the device

  def bind(operands) -> tuple:
    got = eqn.primitive.bind(*operands, **params)
    return tuple(got) if eqn.primitive.multiple_results else (got,) if outs else ()
  if (eqn.primitive.name == "debug_print" and params.get("ordered", False)) \
      or ctx.num_shards(axes) == 1:
    results = bind(xs)
  else:
    first = ctx.linear_index(axes) == 0
    got = lax.cond(first, bind, lambda _: tuple(jnp.zeros(a.shape, a.dtype) for a in outs),
                   xs)
    results = []
    for j, (r, a) in enumerate(zip(got, outs)):
      rep = TensorSharding.replicated(len(a.shape))
      ctx.record("psum", axes, allreduce_bytes_of(r, ctx.num_shards(axes)), eqn,
                 f"result {j}", rep, rep, a.shape, a.dtype)
      results.append(_from_first(r, first, axes))
  return [Value(r, TensorSharding.replicated(len(a.shape)), tuple(a.shape), a.dtype)
          for r, a in zip(results, outs)]


def inspect_rule(ctx: Context, eqn, ins: list[Value], scope, idx) -> list[Value]:
  """``jax.debug.inspect_array_sharding``: its callback gets the layout gshard
  gave the value, as a ``NamedSharding`` (a pending sum's axes as
  ``unreduced``, on the mesh with those axes ``Explicit``, as jax requires),
  once, while gshard partitions (``jax.jit`` calls it while XLA compiles).
  The value stays where it is: inspecting moves nothing."""
  del scope, idx
  s = ins[0].sharding
  mesh = ctx.mesh
  spec = s.to_spec()
  if s.partial:
    mesh = mesh.update(axis_types=tuple(
        AxisType.Explicit if a in s.partial else t
        for a, t in zip(mesh.axis_names, mesh.axis_types)))
    spec = P(*spec, unreduced=frozenset(s.partial))
  eqn.params["callback"](NamedSharding(mesh, spec))
  return []
