"""``gshard.partition``: trace, propagate, partition, run under shard_map + jit."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gshard.annotate import mesh_context
from gshard.spmd.infer import ShardingResult, flatten_specs, spec_to_pin
from gshard.spmd.partition.context import Context, Recorder, Value, evenize
from gshard.spmd.partition.interpret import run_jaxpr
from gshard.spmd.propagate import Graph, propagate
from gshard.spmd.sharding import TensorSharding, mesh_sizes_of


@dataclasses.dataclass
class _Entry:
  """Everything built for one input signature."""

  result: ShardingResult
  in_shardings: list[TensorSharding]
  out_shardings: list[TensorSharding]
  out_tree: Any
  jitted: Callable
  shard_fn: Callable
  recorder: Recorder
  timings: dict[str, float]
  flat_avals: list[jax.ShapeDtypeStruct]
  in_place: list[TensorSharding]     # even layouts the arguments are placed with


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
    self._cache: dict[tuple, _Entry] = {}
    self.__wrapped__ = fn
    self.__name__ = getattr(fn, "__name__", "partitioned")

  # -- building -------------------------------------------------------------
  def _entry(self, args) -> _Entry:
    leaves, treedef = jax.tree_util.tree_flatten(tuple(args))
    key = (treedef, _signature(leaves))
    entry = self._cache.get(key)
    if entry is None:
      entry = self._build(args)
      self._cache[key] = entry
    return entry

  def _build(self, args) -> _Entry:
    timings = {}
    t0 = time.perf_counter()
    leaves, paths, specs = flatten_specs(self.in_specs, args)
    avals = [jax.ShapeDtypeStruct(np.shape(x), _dtype_of(x))
             for x in leaves]
    with mesh_context(self.mesh_sizes):
      closed, out_shape = jax.make_jaxpr(self.fn, return_shape=True)(*args)
    timings["trace"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    jaxpr = closed.jaxpr
    graph = Graph(jaxpr, self.mesh_sizes)
    for var, leaf, path, spec in zip(jaxpr.invars, leaves, paths, specs):
      if spec is not None:
        sharding, open_dims = spec_to_pin(spec, np.shape(leaf), self.mesh_sizes,
                                          f"in_specs{path}")
        graph.pin(graph.tensor((), var), sharding, open_dims, f"in_specs{path}")
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
    out_specs_flat = self._flat_out_specs(out_shape)
    for var, leaf, spec, j in zip(jaxpr.outvars, out_leaves, out_specs_flat,
                                  range(len(out_leaves))):
      t = graph.tensor((), var)
      if spec is not None and t is not None and not t.fixed:
        sharding, open_dims = spec_to_pin(spec, leaf.shape, self.mesh_sizes,
                                          f"out_specs[{j}]")
        graph.pin(t, sharding, open_dims, f"out_specs[{j}]")
    sweeps, conflicts = propagate(graph)
    result = ShardingResult(closed, self.mesh_sizes, graph, conflicts,
                            graph.unsupported, sweeps)
    timings["propagate"] = time.perf_counter() - t1
    in_sh = [result.sharding(v).without_partial() for v in jaxpr.invars]
    out_sh = []
    for var, leaf, spec in zip(jaxpr.outvars, out_leaves, out_specs_flat):
      if spec is not None:
        s = spec_to_pin(spec, leaf.shape, self.mesh_sizes, "out_specs")[0]
      elif hasattr(var, "aval") and not isinstance(var, jax.extend.core.Literal):
        s = result.sharding(var).without_partial()
      else:
        s = TensorSharding.replicated(len(leaf.shape))
      out_sh.append(s)
    recorder = Recorder()
    ctx = Context(graph, self.mesh_sizes, recorder, self.strict)

    def body(*xs):
      recorder.clear()
      vals = [Value(x, s, tuple(a.shape), a.dtype)
              for x, s, a in zip(xs, in_sh, avals)]
      outs = run_jaxpr(ctx, jaxpr, (), closed.consts, vals)
      res = []
      for j, (o, s) in enumerate(zip(outs, out_sh)):
        if o.literal:
          x = jax.numpy.broadcast_to(jax.numpy.asarray(o.x, out_leaves[j].dtype),
                                     s.local_shape(out_leaves[j].shape, self.mesh_sizes))
          res.append(x)
          continue
        res.append(ctx.reshard(o, s, None, f"output {j}").x)
      return tuple(res)

    shard_fn = jax.shard_map(body, mesh=self.mesh,
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
    donate = self._flat_donate(args)
    jitted = jax.jit(fn, donate_argnums=donate)
    timings["partition_setup"] = time.perf_counter() - t1 - timings["propagate"]
    return _Entry(result, in_sh, out_sh, out_tree, jitted, shard_fn, recorder, timings,
                  avals, in_place)

  def _flat_out_specs(self, out_shape) -> list:
    n = len(jax.tree_util.tree_leaves(out_shape))
    if self.out_specs is None:
      return [None] * n
    if isinstance(self.out_specs, P):
      return [self.out_specs] * n
    from jax._src.tree_util import broadcast_prefix
    specs = self.out_specs
    return broadcast_prefix(specs, out_shape,
                            is_leaf=lambda x: x is None or isinstance(x, P))

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
    entry = self._entry(args)
    leaves = jax.tree_util.tree_leaves(tuple(args))
    placed = [jax.device_put(x, NamedSharding(self.mesh, s.to_spec()))
              for x, s in zip(leaves, entry.in_place)]
    outs = entry.jitted(*placed)
    return jax.tree_util.tree_unflatten(entry.out_tree, list(outs))

  def lower(self, *args, platform: str | None = None):
    """Lower for inspection; ``args`` may be ``jax.ShapeDtypeStruct``s.

    ``platform="tpu"`` lowers for TPU from this machine (with an
    ``AbstractMesh`` of any size).
    """
    from gshard.spmd.inspect import Lowered
    entry = self._entry(args)
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype,
                                    sharding=NamedSharding(self.mesh, s.to_spec()))
               for a, s in zip(entry.flat_avals, entry.in_place)]
    t0 = time.perf_counter()
    traced = entry.jitted.trace(*structs)
    lowered = traced.lower(lowering_platforms=(platform,)) if platform else traced.lower()
    entry.timings["lower"] = time.perf_counter() - t0
    return Lowered(self, entry, lowered, structs)


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
