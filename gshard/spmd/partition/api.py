"""``gshard.partition``: trace, propagate, partition, run under shard_map + jit.

Building the program for one input signature is a few named steps
(:meth:`Partitioned._build`): analyze (trace + pin + propagate, shared with
``infer_shardings`` and ``coverage``), the boundary layouts, the per-device
body, the uneven-boundary wrapper, and ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import Literal
from jax.sharding import NamedSharding

from gshard.spmd.infer import ShardingResult, analyze, flatten_specs, spec_to_pin
from gshard.spmd.inspect import Lowered
from gshard.spmd.partition.context import Context, Recorder, Value, evenize
from gshard.spmd.partition.interpret import run_jaxpr
from gshard.spmd.sharding import TensorSharding, mesh_sizes_of


@dataclasses.dataclass
class Program:
  """Everything built for one input signature of a :class:`Partitioned`.

  Attributes:
    result: what propagation found (the global program and every sharding).
    in_shardings, out_shardings: the layouts of the flat inputs and outputs
      inside the partitioned program (uneven dims padded).
    out_tree: the outputs' tree structure.
    jitted: the compiled-on-first-call function of the placed flat inputs.
    shard_fn: the ``shard_map`` of the per-device body (padded inputs).
    recorder: every collective and safe-path fallback of the per-device program
      (filled when it is traced).
    timings: seconds per phase (trace, propagate, partition_setup, lower).
    flat_avals: shape and dtype of each flat input.
    in_place: the even layouts the inputs are placed with outside the program.
  """

  result: ShardingResult
  in_shardings: list[TensorSharding]
  out_shardings: list[TensorSharding]
  out_tree: Any
  jitted: Callable
  shard_fn: Callable
  recorder: Recorder
  timings: dict[str, float]
  flat_avals: list[jax.ShapeDtypeStruct]
  in_place: list[TensorSharding]


def _signature(leaves) -> tuple:
  return tuple((tuple(np.shape(x)), str(_dtype_of(x)),
                bool(getattr(x, "weak_type", False))) for x in leaves)


def _dtype_of(x):
  """The dtype jax will see for ``x``, without copying it (key dtypes kept)."""
  dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return dtype
  return jax.dtypes.canonicalize_dtype(dtype)


def _padded(shard_fn, in_sh, in_shapes, out_sh, out_shapes, mesh_sizes):
  """Wrap ``shard_fn`` for uneven layouts, which jax cannot place.

  Arguments arrive evenly placed; they are padded up to a multiple of their
  shards (zeros) before the per-device program, and outputs are sliced back
  to their logical shapes after it.
  """
  def fn(*xs):
    padded = []
    for x, s, shape in zip(xs, in_sh, in_shapes):
      full = s.padded_shape(shape, mesh_sizes)
      if full != tuple(shape):
        x = jax.numpy.pad(x, [(0, f - n) for f, n in zip(full, shape)])
      padded.append(x)
    outs = shard_fn(*padded)
    return tuple(o if tuple(o.shape) == shape else o[tuple(slice(0, n) for n in shape)]
                 for o, shape in zip(outs, out_shapes))
  return fn


def _body(ctx: Context, result: ShardingResult, in_sh, out_sh, avals, out_leaves):
  """The per-device program: interpret the jaxpr on local blocks, then bring each
  output to its layout (a literal output is broadcast to its local shape)."""
  closed = result.jaxpr

  def body(*xs):
    ctx.recorder.clear()
    ctx.forget()
    vals = [Value(x, s, tuple(a.shape), a.dtype) for x, s, a in zip(xs, in_sh, avals)]
    try:
      outs = ctx.run_jaxpr(closed.jaxpr, (), closed.consts, vals)
      res = []
      for j, (o, s) in enumerate(zip(outs, out_sh)):
        if o.literal:
          leaf = out_leaves[j]
          res.append(jax.numpy.broadcast_to(jax.numpy.asarray(o.x, leaf.dtype),
                                            s.local_shape(leaf.shape, ctx.mesh_sizes)))
        else:
          res.append(ctx.reshard(o, s, None, f"output {j}").x)
    finally:
      ctx.forget()
    return tuple(res)
  return body


class Partitioned:
  """A function partitioned over a mesh; call it like the original.

  ``step(*args)`` runs the per-device program on the mesh and returns global
  ``jax.Array``s; ``step.lower(*args)`` gives the inspection object. Each new
  input signature (shapes, dtypes, tree) is traced, propagated, partitioned
  and compiled once, as ``jax.jit`` does.
  """

  def __init__(self, fn: Callable, mesh, in_specs=None, out_specs=None,
               strict: bool = False, donate_argnums: Sequence[int] | int = ()):
    self.fn = fn
    self.mesh = mesh
    self.mesh_sizes = mesh_sizes_of(mesh)
    self.in_specs = in_specs
    self.out_specs = out_specs
    self.strict = strict
    self.donate_argnums = ((donate_argnums,) if isinstance(donate_argnums, int)
                           else tuple(donate_argnums))
    self._cache: dict[tuple, Program] = {}
    self.__wrapped__ = fn
    self.__name__ = getattr(fn, "__name__", "partitioned")

  # -- building -------------------------------------------------------------
  def program(self, *args) -> Program:
    """The :class:`Program` for this input signature, built once and cached."""
    leaves, treedef = jax.tree_util.tree_flatten(tuple(args))
    key = (treedef, _signature(leaves))
    prog = self._cache.get(key)
    if prog is None:
      prog = self._build(args)
      self._cache[key] = prog
    return prog

  def _build(self, args) -> Program:
    result = analyze(self.fn, self.mesh_sizes, args, self.in_specs, self.out_specs)
    timings = dict(result.timings)
    t0 = time.perf_counter()
    leaves = jax.tree_util.tree_leaves(tuple(args))
    avals = [jax.ShapeDtypeStruct(np.shape(x), _dtype_of(x)) for x in leaves]
    out_leaves, out_tree = jax.tree_util.tree_flatten(result.out_shape)
    in_sh, out_sh = self._boundary(result, out_leaves)
    ctx = Context(result.graph, self.mesh_sizes, Recorder(), self.strict, run_jaxpr)
    shard_fn = jax.shard_map(_body(ctx, result, in_sh, out_sh, avals, out_leaves),
                             mesh=self.mesh,
                             in_specs=tuple(s.to_spec() for s in in_sh),
                             out_specs=tuple(s.to_spec() for s in out_sh),
                             check_vma=False)
    in_place = [evenize(s, a.shape, self.mesh_sizes) for s, a in zip(in_sh, avals)]
    out_shapes = [tuple(o.shape) for o in out_leaves]
    fn = shard_fn
    if in_place != in_sh or any(not s.is_even(n, self.mesh_sizes)
                                for s, n in zip(out_sh, out_shapes)):
      fn = _padded(shard_fn, in_sh, [tuple(a.shape) for a in avals], out_sh, out_shapes,
                   self.mesh_sizes)
    jitted = jax.jit(fn, donate_argnums=self._flat_donate(args))
    timings["partition_setup"] = time.perf_counter() - t0
    return Program(result, in_sh, out_sh, out_tree, jitted, shard_fn, ctx.recorder, timings,
                   avals, in_place)

  def _boundary(self, result: ShardingResult, out_leaves):
    """The layouts of the program's flat inputs and outputs (no pending sums)."""
    jaxpr = result.jaxpr.jaxpr
    in_sh = [result.sharding(v).without_partial() for v in jaxpr.invars]
    _, _, specs = flatten_specs(self.out_specs, result.out_shape, "out_specs")
    out_sh = []
    for var, leaf, spec in zip(jaxpr.outvars, out_leaves, specs):
      if spec is not None:
        s = spec_to_pin(spec, leaf.shape, self.mesh_sizes, "out_specs")[0]
      elif not isinstance(var, Literal):
        s = result.sharding(var).without_partial()
      else:
        s = TensorSharding.replicated(len(leaf.shape))
      out_sh.append(s)
    return in_sh, out_sh

  def _flat_donate(self, args) -> tuple[int, ...]:
    out, k = [], 0
    for i, a in enumerate(args):
      n = len(jax.tree_util.tree_leaves(a))
      if i in self.donate_argnums:
        out += range(k, k + n)
      k += n
    return tuple(out)

  # -- running --------------------------------------------------------------
  def __call__(self, *args):
    prog = self.program(*args)
    leaves = jax.tree_util.tree_leaves(tuple(args))
    placed = [jax.device_put(x, NamedSharding(self.mesh, s.to_spec()))
              for x, s in zip(leaves, prog.in_place)]
    outs = prog.jitted(*placed)
    return jax.tree_util.tree_unflatten(prog.out_tree, list(outs))

  def lower(self, *args, platform: str | None = None):
    """Lower for inspection; ``args`` may be ``jax.ShapeDtypeStruct``s.

    ``platform="tpu"`` lowers for TPU from this machine (with an
    ``AbstractMesh`` of any size).
    """
    prog = self.program(*args)
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype,
                                    sharding=NamedSharding(self.mesh, s.to_spec()))
               for a, s in zip(prog.flat_avals, prog.in_place)]
    t0 = time.perf_counter()
    traced = prog.jitted.trace(*structs)
    lowered = traced.lower(lowering_platforms=(platform,)) if platform else traced.lower()
    prog.timings["lower"] = time.perf_counter() - t0
    return Lowered(self, prog, lowered, structs)


def partition(fn: Callable, mesh, in_specs=None, out_specs=None, strict: bool = False,
              donate_argnums: Sequence[int] | int = ()) -> Partitioned:
  """Partition ``fn`` over ``mesh`` from its annotations.

  Args:
    fn: a function of arrays (pytrees allowed), annotated with gshard.split etc.
    mesh: a jax ``Mesh`` (``gshard.make_mesh``) or ``AbstractMesh`` (lowering only).
    in_specs: a pytree prefix of the positional arguments with PartitionSpecs at
      the leaves; ``None`` (whole or per leaf) lets propagation decide.
    out_specs: the same for the outputs; ``None`` takes the inferred shardings.
    strict: raise instead of taking the safe path for a primitive without a
      partition rule.
    donate_argnums: positional arguments whose buffers may be reused.

  Returns:
    A :class:`Partitioned` callable; ``.lower(*args)`` inspects it.

  Example::

    step = gshard.partition(train_step, mesh, in_specs=(param_specs, P("data")))
    params, loss = step(params, batch)
  """
  return Partitioned(fn, mesh, in_specs, out_specs, strict, donate_argnums)
