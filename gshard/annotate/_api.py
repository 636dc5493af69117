"""``split`` / ``replicate`` / ``shard``: annotations users write in model code.

Each validates its arguments at call time and binds :data:`annotate_p`, an
identity on values. Outside gshard the annotated code runs unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gshard.annotate._primitive import Annotation, annotate_p
from gshard.spmd.sharding import (TensorSharding, check_spec_entries, mesh_sizes_of, mesh_str,
                                  open_dims_of_spec, short_dtype)

_current_mesh: contextvars.ContextVar[Mapping[str, int] | None] = (
    contextvars.ContextVar("gshard_mesh", default=None))

# While set to a jax Mesh (by ``as_sharding_constraints``), the annotations
# become jax.lax.with_sharding_constraint on that mesh instead of binding
# annotate_p, so XLA's own partitioner sees the same intent.
_gspmd_mesh: contextvars.ContextVar = contextvars.ContextVar("gshard_gspmd_mesh",
                                                             default=None)


def _bind(x, annotation: Annotation, spec: P):
  mesh = _gspmd_mesh.get()
  if mesh is None:
    return annotate_p.bind(x, annotation=annotation)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def current_mesh_sizes() -> dict[str, int] | None:
  """The mesh gshard is tracing for (axis name -> size), or None outside gshard."""
  mesh = _current_mesh.get()
  return None if mesh is None else dict(mesh)


@contextlib.contextmanager
def mesh_context(mesh) -> Iterator[None]:
  """While tracing under gshard, annotations check axis names against ``mesh``."""
  token = _current_mesh.set(mesh_sizes_of(mesh))
  try:
    yield
  finally:
    _current_mesh.reset(token)


@contextlib.contextmanager
def as_sharding_constraints(mesh) -> Iterator[None]:
  """While tracing inside, annotations are ``jax.lax.with_sharding_constraint``
  on ``mesh`` (a concrete ``Mesh``): XLA's GSPMD partitions them.

  Validation is unchanged; ``P.UNCONSTRAINED`` dims stay unconstrained. This
  is how ``gshard.gspmd_jit`` runs the same annotations through XLA.
  """
  token = _gspmd_mesh.set(mesh)
  try:
    with mesh_context(mesh):
      yield
  finally:
    _gspmd_mesh.reset(token)


def _describe(x) -> str:
  dtype = getattr(x, "dtype", None)
  shape = tuple(getattr(x, "shape", ()))
  return f"{short_dtype(dtype)}[{','.join(map(str, shape))}]"


def _as_array(x):
  return x if hasattr(x, "shape") and hasattr(x, "dtype") else jnp.asarray(x)


def _is_tree(x) -> bool:
  """A pytree of arrays (a tuple, dict, dataclass ...) rather than one array."""
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return False
  leaves = jax.tree.leaves(x)
  return not (len(leaves) == 1 and leaves[0] is x)


def _is_spec(s) -> bool:
  return s is None or isinstance(s, P)


def _check_axes(call: str, x, spec_axes: list[tuple[str, ...]]) -> None:
  seen: dict[str, int] = {}
  for dim, axes in enumerate(spec_axes):
    for a in axes:
      if not isinstance(a, str):
        raise TypeError(f"{call}: mesh axis names must be strings, got {a!r}.")
      if a in seen:
        raise ValueError(
            f"{call}: x is {_describe(x)}; mesh axis {a!r} is used for dim "
            f"{seen[a]} and again for dim {dim}. A mesh axis can split only one "
            "dimension; use a different axis for one of them.")
      seen[a] = dim
  mesh = _current_mesh.get()
  if mesh is not None:
    for axes in spec_axes:
      for a in axes:
        if a not in mesh:
          raise ValueError(
              f"{call}: x is {_describe(x)}; mesh axis {a!r} is not in the mesh "
              f"{mesh_str(mesh)}. Use one of {list(mesh)}.")


def shard(x, spec: P):
  """Annotate ``x`` with a general sharding given as a ``PartitionSpec``.

  Args:
    x: an array of rank r, or a pytree of arrays (as for
      ``jax.lax.with_sharding_constraint``).
    spec: a ``PartitionSpec`` with at most r entries; each entry is None (not
      split), a mesh axis name, a tuple of names (split over their product,
      major first) or ``P.UNCONSTRAINED`` (left for propagation to decide).
      For a pytree: one spec for every leaf, or a pytree of specs that is a
      prefix of ``x``'s.

  Returns:
    ``x`` unchanged; under gshard the value has this sharding here.

  Example::

    h = gshard.shard(h, P("data", None, "model"))  # h: f32[B, T, H]
  """
  if _is_tree(x):
    if _is_spec(spec):
      return jax.tree.map(lambda leaf: shard(leaf, spec), x)
    try:
      return jax.tree.map(lambda s, sub: shard(sub, s), spec, x, is_leaf=_is_spec)
    except ValueError as e:
      raise ValueError(
          f"shard(x, spec): spec is a pytree of PartitionSpecs whose structure is not a "
          f"prefix of x's ({jax.tree.structure(x)}): {str(e).splitlines()[0]} Give one "
          "PartitionSpec, or one "
          "per subtree of x.") from None
  x = _as_array(x)
  if spec is None:
    spec = P()
  if not isinstance(spec, P):
    raise TypeError(
        f"shard(x, spec={spec!r}): spec must be a jax.sharding.PartitionSpec, "
        f"e.g. P('data', None) for x of rank {np.ndim(x)}.")
  call = f"shard(x, {spec})"
  check_spec_entries(spec, f"{call}: x is {_describe(x)}", entries=False)   # _check_axes
  rank = np.ndim(x)
  if len(spec) > rank:
    raise ValueError(
        f"{call}: x is {_describe(x)} (rank {rank}) but the spec has "
        f"{len(spec)} entries. Give at most one entry per dimension, e.g. "
        f"{P(*list(spec)[:rank])}.")
  open_dims = open_dims_of_spec(spec)
  spec_axes = [_axes(e) for e in spec]
  _check_axes(call, x, spec_axes)
  sharding = TensorSharding(tuple(spec_axes) + ((),) * (rank - len(spec_axes)))
  return _bind(x, Annotation(sharding, open_dims), spec)


def _axes(entry) -> tuple[str, ...]:
  if entry is None or entry is P.UNCONSTRAINED:
    return ()
  if isinstance(entry, str) or not isinstance(entry, (tuple, list)):
    return (entry,)   # a non-string name is reported by _check_axes
  return tuple(entry)


def split(x, dim: int, axis: str | tuple[str, ...]):
  """Annotate ``x`` as split along ``dim`` over mesh ``axis`` (or axes, major first).

  Every other dim is replicated. ``dim`` may be negative.

  Example::

    x = gshard.split(x, dim=0, axis="data")  # x: f32[B, D], B split over 'data'

  A pytree of arrays is annotated leaf by leaf.
  """
  if _is_tree(x):
    return jax.tree.map(lambda leaf: split(leaf, dim, axis), x)
  x = _as_array(x)
  rank = np.ndim(x)
  call = f"split(x, dim={dim}, axis={axis!r})"
  if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool):
    raise TypeError(f"split(x, dim={dim!r}, axis={axis!r}): dim must be an int, got "
                    f"{type(dim).__name__}.")
  if rank == 0:
    raise ValueError(
        f"{call}: x is a scalar ({_describe(x)}): it has no dim to split. "
        "Use gshard.replicate(x), or drop the annotation.")
  if not -rank <= dim < rank:
    raise ValueError(
        f"{call}: x is {_describe(x)} (rank {rank}); dim must be in "
        f"[{-rank}, {rank - 1}].")
  if not axis:
    raise ValueError(f"{call}: give a mesh axis name (or a tuple of names); "
                     "to replicate use gshard.replicate(x).")
  axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
  dim = int(dim) % rank
  _check_axes(call, x, [axes])
  dims = tuple(axes if i == dim else () for i in range(rank))
  return _bind(x, Annotation(TensorSharding(dims)),
               P(*(d if d else None for d in dims)))


def replicate(x):
  """Annotate ``x`` as fully replicated: every device holds the whole value
  (each leaf of a pytree)."""
  if _is_tree(x):
    return jax.tree.map(replicate, x)
  x = _as_array(x)
  return _bind(x, Annotation(TensorSharding.replicated(np.ndim(x))), P())
