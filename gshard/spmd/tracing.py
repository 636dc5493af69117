"""Tracing a user's function for gshard: ``jax.make_jaxpr`` with what jax
alone does not do for it.

- pmap-style collectives over names no transformation binds are bound with
  size 1 (:func:`bind_axis_names`);
- the function is traced afresh for gshard's mesh (the one its annotations
  read), nested ``jax.jit`` functions included (:func:`traced_for`);
- arguments jax's explicit-sharding rules refuse are traced as the one-device
  program, and a non-array argument is gshard's error (:func:`trace`);
- equations whose results nothing reads are dropped (:func:`live_only`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax
from jax.experimental.xla_metadata import set_xla_metadata
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from gshard.annotate import current_mesh_sizes
from gshard.spmd.graph import sub_jaxprs
from gshard.spmd.partition.padded import logical_args
from gshard.spmd.sharding import caller_mesh_scope

_UNBOUND = re.compile(r"unbound axis name: ([^\s.]+)")
MAX_BOUND_NAMES = 8


def bind_axis_names(fn: Callable, names: Sequence[str], batched: bool = False) -> Callable:
  """``fn`` with the named axes ``names`` bound, each of size 1.

  pmap-style code (``lax.pmean(grads, "batch")`` written for ``jax.pmap``)
  names an axis that only pmap binds. Run without pmap, a collective over a
  size-1 axis is an identity (``pmean``/``psum`` of one value, ``axis_index``
  0, ``all_gather`` a leading dim of 1): gshard's own partitioning then does
  the data-parallel reduction the pmap program did by hand. ``batched``: the
  arguments enter with a leading dim of 1 (see :func:`_needs_batched`).
  """
  for name in names:
    fn = _bind_axis(fn, name, batched)
  return fn


def _bind_axis(fn, name, batched: bool):
  @functools.wraps(fn)
  def bound(*args):
    if not batched:
      outs = jax.vmap(fn, in_axes=None, out_axes=0, axis_name=name, axis_size=1)(*args)
    else:
      lead = jax.tree.map(lambda a: lax.expand_dims(a, (0,)), args)
      outs = jax.vmap(fn, in_axes=0, out_axes=0, axis_name=name, axis_size=1)(*lead)
    return jax.tree.map(lambda y: y[0], outs)
  return bound


# the key of jax's trace caches that names the mesh gshard traces for
MESH_KEY = "gshard_mesh"


def traced_for(mesh_sizes):
  """A context in which jax keys its traces by ``mesh_sizes`` too: a jitted
  function ``fn`` calls (a model's ``jax.jit`` forward) is traced again for
  gshard's mesh, not reused from a trace made off it or for another mesh.
  ``pipeline.run`` decides at trace time whether it pipelines, and over how
  many stages: a forward traced by ``jax.jit`` on one device ran the plain
  loop inside every later partition, and one traced for 4 stages ran 4 on 2.
  (jax keys by its context, which holds ``set_xla_metadata``'s; the
  partitioner drops this key from what it binds, inner jaxprs bound as they
  are included: ``partition.generic.unkeyed``.)"""
  return set_xla_metadata(**{MESH_KEY: ",".join(f"{a}={n}" for a, n in mesh_sizes.items())})


def _fresh(fn):
  """``fn`` under a new identity: jax keys its traces by the function, not by
  gshard's mesh context, which ``pipeline.run`` and the annotations read while
  tracing (a ``jax.jit(f)`` first made ``partition(f)`` run the plain loop).
  It keeps ``fn``'s name and line, which jax's errors name."""
  @functools.wraps(fn)
  def fresh(*args):
    return fn(*args)
  return fresh


def _needs_batched(fn, names, args) -> bool:
  """Whether ``fn`` runs an ``all_to_all`` over a bound name: jax's batching
  rule mis-shapes its unbatched operand (``(8, 4)`` came out ``(8, 4, 1, 8,
  4)``), so its arguments enter batched. Not otherwise: batched, an index
  taken from an argument becomes a gather, and a callback cannot be vmapped.
  Found on the program traced with the names bound as collectives."""
  probe = jax.make_jaxpr(_fresh(fn), axis_env=[(n, 1) for n in names])(*args).jaxpr

  def uses(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "all_to_all":
        axes = eqn.params["axis_name"]
        if set(axes if isinstance(axes, (tuple, list)) else (axes,)) & set(names):
          return True
      if any(uses(sub) for _, sub in sub_jaxprs(eqn.params)):
        return True
    return False
  return uses(probe)


def trace(fn: Callable, args: Sequence[Any]):
  """``jax.make_jaxpr(fn, return_shape=True)(*args)``; axis names that no
  transformation binds (pmap-style collectives) are bound with size 1.

  Arguments committed to a mesh with Explicit axes are traced as given, as
  ``jax.jit`` traces them (a ``jax.shard_map`` over that mesh checks their
  layouts, and under ``jax.set_mesh`` of it the context: traced again under
  the caller's mesh when it refuses gshard's); where jax's sharding-in-types
  rules refuse the code under those layouts, as the one-device program
  (their shapes and dtypes): gshard
  chooses every layout itself. If that fails too, the first error is raised,
  as ``jax.jit`` raises it."""
  try:
    return _trace(fn, args)
  except Exception as e:
    bad = non_array_error(fn, getattr(fn, "__name__", "fn"), args, e)
    if bad is not e:                 # a non-array argument
      raise bad from None
    if _CONTEXT_MESH in str(e):      # a shard_map over the caller's jax.set_mesh mesh
      with caller_mesh_scope():
        return _trace(fn, args)
    plain = logical_args(args, untyped=True)
    if any(a is not b for a, b in zip(jax.tree_util.tree_leaves(plain),
                                      jax.tree_util.tree_leaves(args))):
      try:
        return _trace(fn, plain)
      except Exception:
        pass
    if any(m in str(e) for m in _EXPLICIT_CALLS):
      raise ValueError(
          f"{getattr(fn, '__name__', 'fn')}: gshard uses the mesh's axes as Auto and "
          "chooses every layout itself; jax's explicit-sharding calls "
          "(jax.sharding.reshard, out_sharding=, with_sharding_constraint on a "
          "NamedSharding of a mesh with Explicit axes) are not gshard's. Say the layout "
          "with gshard.shard(x, P(...)) / gshard.split, or with_sharding_constraint(x, "
          f"P(...)). jax said: {e}") from e
    raise


# jax's message for a shard_map whose mesh is not the context's (gshard's Auto one)
_CONTEXT_MESH = "should match the mesh passed to shard_map"

# jax's messages for explicit-sharding calls under Auto axes
_EXPLICIT_CALLS = ("cannot contain axis names that are of type Auto",
                   "can only refer to Auto axes")


def _trace(fn, args):
  mesh = current_mesh_sizes()     # the mesh gshard traces for, if any
  with traced_for(mesh) if mesh else contextlib.nullcontext():
    return _trace_bound(fn, args)


def _trace_bound(fn, args):
  names: list[str] = []
  while True:
    try:
      batched = bool(names) and _needs_batched(fn, names, args)
      return jax.make_jaxpr(_fresh(bind_axis_names(fn, names, batched)),
                            return_shape=True)(*args)
    except NameError as e:
      m = _UNBOUND.search(str(e))
      if m is None or m.group(1) in names or len(names) >= MAX_BOUND_NAMES:
        raise
      names.append(m.group(1))


def non_array_error(fn: Callable, name: str, args, error: Exception) -> Exception:
  """gshard's error for the first leaf of ``args`` that is not an array (jax
  refuses it: its message names ``static_argnums``, which gshard does not
  take), else ``error`` itself."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tuple(args))[0]:
    try:
      jax.typeof(leaf)
    except TypeError:
      kw = getattr(path[-1], "key", None)
      if not isinstance(kw, str):
        try:
          kw = list(inspect.signature(fn).parameters)[path[0].idx]
        except (TypeError, ValueError, IndexError, AttributeError):
          kw = "arg"
      return TypeError(
          f"{name}: a {type(leaf).__name__} ({leaf!r:.40}) was passed at path "
          f"args{jax.tree_util.keystr(path)}, where an array goes. The arguments of a "
          "partitioned function are arrays (or pytrees of arrays, ShapeDtypeStructs, "
          "Python scalars); bind any other before partitioning, e.g. gshard.partition("
          f"functools.partial({name}, {kw}=...), mesh), or close over it.")
  return error


# annotations: kept where their result is unused (their operand's layout)
_PINS = frozenset({"sharding_annotation", "sharding_constraint"})


def live_only(closed):
  """``closed`` without the top-level equations whose results nothing reads
  (``jax.grad`` keeps the forward's loss, which its gradient does not need):
  they were partitioned, and their collectives reported, though XLA drops
  them. An equation with effects (a callback, a print) stays, and so does an
  annotation whose result is unused (``gshard.split(x, ...)`` written as if
  it acted in place): it still says how its operand is laid out."""
  jaxpr = closed.jaxpr
  live = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
  kept = []
  for eqn in reversed(jaxpr.eqns):
    if eqn.effects or eqn.primitive.name in _PINS or any(v in live for v in eqn.outvars):
      kept.append(eqn)
      live.update(v for v in eqn.invars if not isinstance(v, Literal))
  if len(kept) == len(jaxpr.eqns):
    return closed
  return ClosedJaxpr(Jaxpr(jaxpr.constvars, jaxpr.invars, jaxpr.outvars, kept[::-1],
                           jaxpr.effects, jaxpr.debug_info), closed.consts)
