"""The sharding algebra: a frozen ``TensorSharding`` and pure functions on it.

A ``TensorSharding`` says, for each dimension of a value, which mesh axes split
it (major to minor), and over which mesh axes the value is a pending partial
sum. Every mesh axis not named is a replication axis. Nothing here touches a
device or a jaxpr: shardings are plain values, compared and combined by the
functions below, each with a worked example.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh
from jax.sharding import PartitionSpec as P

Axes = tuple[str, ...]
MeshSizes = Mapping[str, int]

_UNCONSTRAINED = P.UNCONSTRAINED


@functools.lru_cache(maxsize=64)
def _replicated(cls, rank: int):
  return cls(((),) * rank)      # frozen: one value per rank is shared


@dataclasses.dataclass(frozen=True)
class TensorSharding:
  """How one value is laid out over a mesh.

  Attributes:
    dims: for each dimension, the mesh axes that split it, major to minor.
      ``()`` means the dimension is not split.
    partial: mesh axes over which each device holds a partial sum; the true
      value is the sum over those axes (``psum`` resolves it).

  Example::

    >>> s = TensorSharding((("data",), (), ("model",)))
    >>> s.format((64, 8, 1024), "f32")
    'f32[64@data,8,1024@model]'
  """

  dims: tuple[Axes, ...]
  partial: frozenset[str] = frozenset()

  def __post_init__(self):
    # a name alone is that one axis (not its characters)
    dims = tuple((d,) if isinstance(d, str) else tuple(d) for d in self.dims)
    object.__setattr__(self, "dims", dims)
    partial = self.partial
    object.__setattr__(self, "partial",
                       frozenset((partial,) if isinstance(partial, str) else partial))
    used = [a for d in dims for a in d]
    seen: set[str] = set()
    for a in used + sorted(self.partial):
      if a in seen:
        raise ValueError(
            f"TensorSharding{self._raw()}: mesh axis {a!r} is used twice; a mesh "
            "axis can split at most one dimension (or be partial) of a value.")
      seen.add(a)

  def _raw(self) -> str:
    return f"(dims={self.dims}, partial={sorted(self.partial)})"

  # -- constructors -----------------------------------------------------------
  @classmethod
  def replicated(cls, rank: int) -> TensorSharding:
    """``replicated(2)`` is ``TensorSharding(((), ()))``."""
    return _replicated(cls, rank)

  @classmethod
  def from_spec(cls, spec: P | None, rank: int) -> TensorSharding:
    """From a ``PartitionSpec``; missing trailing entries are unsplit.

    ``from_spec(P(("data", "model"), None), 3).dims == (("data", "model"), (), ())``.
    ``P.UNCONSTRAINED`` entries become ``()``: use :func:`open_dims_of_spec` to
    know which dims were left open.
    """
    if spec is None:
      return cls.replicated(rank)
    entries = list(spec)
    if len(entries) > rank:
      raise ValueError(f"PartitionSpec {spec} has {len(entries)} entries but "
                       f"the value has rank {rank}.")
    dims = [_entry_axes(e) for e in entries] + [()] * (rank - len(entries))
    return cls(tuple(dims))

  # -- queries ----------------------------------------------------------------
  @property
  def rank(self) -> int:
    """Number of dims."""
    return len(self.dims)

  @property
  def axes(self) -> frozenset[str]:
    """Every mesh axis this sharding splits a dim over (partial not included)."""
    return frozenset(a for d in self.dims for a in d)

  @property
  def is_replicated(self) -> bool:
    """No dim split and nothing pending."""
    return not self.axes and not self.partial

  def to_spec(self) -> P:
    """``TensorSharding((("data",), ())).to_spec() == P("data", None)``."""
    return P(*[_axes_entry(d) for d in self.dims])

  def num_shards(self, dim: int, mesh_sizes: MeshSizes) -> int:
    """How many blocks dim ``dim`` is cut into."""
    return math.prod(mesh_sizes[a] for a in self.dims[dim])

  def local_shape(self, global_shape: Sequence[int],
                  mesh_sizes: MeshSizes) -> tuple[int, ...]:
    """Per-device shape; an uneven dim is padded up to a multiple.

    ``local_shape((30, 8), {"model": 4})`` with dims ``(("model",), ())`` is
    ``(8, 8)``: 30 is padded to 32 and split 4 ways.
    """
    self._check_rank(global_shape)
    return tuple(-(-n // self.num_shards(i, mesh_sizes))
                 for i, n in enumerate(global_shape))

  def padded_shape(self, global_shape: Sequence[int],
                   mesh_sizes: MeshSizes) -> tuple[int, ...]:
    """Global shape after padding: ``(30, 8)`` split 4 ways on dim 0 is ``(32, 8)``."""
    local = self.local_shape(global_shape, mesh_sizes)
    return tuple(l * self.num_shards(i, mesh_sizes) for i, l in enumerate(local))

  def fits(self, global_shape: Sequence[int], mesh_sizes: MeshSizes) -> bool:
    """Whether no dim is split into more shards than it has elements (as
    propagation never splits one; a pinned value may be)."""
    return all(self.num_shards(i, mesh_sizes) <= n for i, n in enumerate(global_shape))

  def is_even(self, global_shape: Sequence[int], mesh_sizes: MeshSizes) -> bool:
    """Whether every split dim divides evenly (no padding)."""
    return tuple(global_shape) == self.padded_shape(global_shape, mesh_sizes)

  def format(self, shape: Sequence[int], dtype: str | np.dtype | None = None) -> str:
    """The compact printed form, ``f32[64@data,1024@model]+model``."""
    self._check_rank(shape)
    parts = []
    for n, axes in zip(shape, self.dims):
      parts.append(f"{n}@{'*'.join(axes)}" if axes else f"{n}")
    s = f"{short_dtype(dtype)}[{','.join(parts)}]"
    if self.partial:
      s += "+" + "+".join(sorted(self.partial))
    return s

  def __str__(self) -> str:
    body = ",".join("*".join(d) if d else "_" for d in self.dims)
    s = f"[{body}]"
    if self.partial:
      s += "+" + "+".join(sorted(self.partial))
    return s

  def _check_rank(self, shape: Sequence[int]) -> None:
    if len(shape) != self.rank:
      raise ValueError(f"sharding {self} has rank {self.rank} but the shape "
                       f"{tuple(shape)} has rank {len(shape)}.")

  # -- transforms -------------------------------------------------------------
  def with_partial(self, axes: Iterable[str]) -> TensorSharding:
    """The same dims, pending over ``axes``."""
    return TensorSharding(self.dims, frozenset(axes))

  def without_partial(self) -> TensorSharding:
    """The same dims, nothing pending (itself where nothing is)."""
    return TensorSharding(self.dims) if self.partial else self

  def transpose(self, permutation: Sequence[int]) -> TensorSharding:
    """Dims permuted like ``lax.transpose``: ``[a,_].transpose((1,0)) == [_,a]``."""
    return TensorSharding(tuple(self.dims[p] for p in permutation), self.partial)


def _entry_axes(entry) -> Axes:
  if entry is None or entry is _UNCONSTRAINED:
    return ()
  if isinstance(entry, str):
    return (entry,)
  return tuple(entry)


def _axes_entry(axes: Axes):
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else tuple(axes)


def check_spec_entries(spec: P, where: str, entries: bool = True) -> None:
  """Errors for what gshard cannot read as a layout: jax's ``unreduced`` /
  ``reduced`` sets (explicit-sharding partial sums; gshard keeps pending sums
  itself) and (``entries``) entries that are not axis names. ``where``
  starts the message (the argument, the shape, the mesh)."""
  extra = sorted(set(getattr(spec, "unreduced", ())) | set(getattr(spec, "reduced", ())))
  if extra:
    raise ValueError(
        f"{where}: the spec marks mesh axes {extra} unreduced/reduced, jax's partial "
        "sums for Explicit axes; gshard takes a layout only and keeps pending sums "
        f"itself. Give P{tuple(spec._partitions)!r} (without unreduced= / reduced=).")
  for e in spec._partitions if entries else ():
    names = e if isinstance(e, tuple) else (e,)
    if e is not _UNCONSTRAINED and not all(n is None or isinstance(n, str) for n in names):
      raise TypeError(
          f"{where}: spec entry {e!r} is not a mesh axis name; each entry is None, "
          "a mesh axis name (a string), a tuple of names or P.UNCONSTRAINED, e.g. "
          "P('data', None).")


def open_dims_of_spec(spec: P | None) -> frozenset[int]:
  """Indices of ``P.UNCONSTRAINED`` entries: dims propagation may still split."""
  if spec is None:
    return frozenset()
  return frozenset(i for i, e in enumerate(spec) if e is _UNCONSTRAINED)


_DTYPE_SHORT = {"float32": "f32", "float64": "f64", "float16": "f16",
                "bfloat16": "bf16", "int32": "i32", "int64": "i64", "int8": "i8",
                "int16": "i16", "uint32": "u32", "uint8": "u8", "uint64": "u64",
                "bool": "bool", "complex64": "c64", "key<fry>": "key<fry>"}


def itemsize(dtype) -> int:
  """Bytes per element of ``dtype``: numpy's, or a jax extended dtype's (a
  threefry PRNG key is 8: its two uint32 words)."""
  try:   # np.dtype instances and scalar types alike (np.float32, jnp.bfloat16)
    return np.dtype(dtype).itemsize
  except TypeError:
    return int(getattr(dtype, "itemsize", 4))


def short_dtype(dtype) -> str:
  """``short_dtype(np.float32) == 'f32'``; jax key dtypes print as themselves."""
  if dtype is None:
    return ""
  if isinstance(dtype, str):
    name = dtype
  else:
    try:   # np.dtype instances and scalar types alike (np.float32, jnp.bfloat16)
      name = np.dtype(dtype).name
    except TypeError:   # jax extended dtypes (PRNG keys)
      name = str(dtype)
  return _DTYPE_SHORT.get(name, name)


# -- the algebra --------------------------------------------------------------

def is_refinement(old: TensorSharding, new: TensorSharding) -> bool:
  """True when ``new`` keeps every split of ``old`` and may add more.

  Per dim, ``old``'s axes must be a prefix of ``new``'s:
  ``is_refinement([data,_], [data*model,_])`` is True,
  ``is_refinement([data,_], [model,_])`` is False. Partial axes are ignored.
  """
  return old.rank == new.rank and all(
      n[:len(o)] == o for o, n in zip(old.dims, new.dims))


def is_more_specific(new: TensorSharding, old: TensorSharding) -> bool:
  """A strict refinement: ``new`` splits strictly more than ``old``.

  ``is_more_specific([data,model], [data,_])`` is True; equal shardings are not.
  """
  return is_refinement(old, new) and new.dims != old.dims


def merge(a: TensorSharding, b: TensorSharding) -> TensorSharding | None:
  """The most specific sharding refining both, or None when they conflict.

  ``merge([data,_], [_,model]) == [data,model]``;
  ``merge([data,_], [model,_])`` is None (dim 0 cannot be both);
  ``merge([data,_], [_,data])`` is None (``data`` would split two dims).
  Partial axes must agree.
  """
  if a.rank != b.rank or a.partial != b.partial:
    return None
  dims = []
  for x, y in zip(a.dims, b.dims):
    if y[:len(x)] == x:
      dims.append(y)
    elif x[:len(y)] == y:
      dims.append(x)
    else:
      return None
  try:
    return TensorSharding(tuple(dims), a.partial)
  except ValueError:
    return None


def validate(sharding: TensorSharding, shape: Sequence[int], mesh_sizes: MeshSizes,
             what: str = "value") -> None:
  """Raise a ValueError naming ``what`` if ``sharding`` does not fit ``shape``/mesh."""
  mesh_desc = mesh_str(mesh_sizes)
  if sharding.rank != len(shape):
    raise ValueError(
        f"{what}: the sharding {sharding.to_spec()} has {sharding.rank} entries "
        f"but the value has shape {tuple(shape)} (rank {len(shape)}). Give one "
        "entry per dimension (None for an unsplit one).")
  for a in sorted(sharding.axes | sharding.partial):
    if a not in mesh_sizes:
      raise ValueError(
          f"{what}: mesh axis {a!r} is not in the mesh {mesh_desc}. "
          f"Use one of {list(mesh_sizes)}.")


def fit_axes(axes: Sequence[str], n: int, mesh_sizes: MeshSizes, *,
             exact: bool = True) -> Axes:
  """The longest prefix of ``axes`` that splits a dim of ``n`` elements.

  ``exact``: the number of shards must divide ``n`` (an even split);
  otherwise it must only not exceed ``n`` (an uneven split, padded).
  ``fit_axes(("data", "model"), 6, {"data": 2, "model": 4}) == ("data",)``;
  with ``exact=False`` and ``n=5`` it is ``("data",)`` too (8 shards > 5).
  """
  keep = list(axes)
  while keep:
    k = math.prod(mesh_sizes[a] for a in keep)
    if (n % k == 0) if exact else (k <= n):
      break
    keep.pop()
  return tuple(keep)


def mesh_str(mesh_sizes: MeshSizes) -> str:
  """``{'data': 2, 'model': 4}`` prints as ``(data=2, model=4)``."""
  return "(" + ", ".join(f"{k}={v}" for k, v in mesh_sizes.items()) + ")"


def mesh_sizes_of(mesh) -> dict[str, int]:
  """Axis name -> size for a jax ``Mesh``/``AbstractMesh`` or a plain mapping."""
  if isinstance(mesh, Mapping):
    return dict(mesh)
  shape = getattr(mesh, "shape", None)
  if not isinstance(shape, Mapping):
    raise TypeError(
        f"mesh must be a jax Mesh or AbstractMesh (e.g. gshard.make_mesh((2, 4), "
        f"('data', 'model'))), got {mesh!r} ({type(mesh).__name__}).")
  return dict(shape)


def require_mesh(mesh):
  """``mesh`` if it is a jax ``Mesh`` or ``AbstractMesh`` (what runs a
  program; a mapping of axis sizes only propagates), else the TypeError."""
  if not isinstance(mesh, (Mesh, AbstractMesh)):
    raise TypeError(
        f"mesh must be a jax Mesh or AbstractMesh (e.g. gshard.make_mesh((2, 4), "
        f"('data', 'model'))), got {mesh!r} ({type(mesh).__name__}).")
  return mesh


def with_auto_axes(mesh):
  """``mesh`` (a ``Mesh`` or ``AbstractMesh``) with every axis ``Auto``.

  gshard chooses every layout itself; a mesh from ``jax.make_mesh`` (Explicit
  axes by default) would have jax type each value's sharding as well, and jax
  refuses some of gshard's per-device code under those types (slicing off the
  padding of an uneven output). Same devices, same names, same sizes.
  """
  types = getattr(mesh, "axis_types", None)
  if not types or all(t == AxisType.Auto for t in types):
    return mesh
  return mesh.update(axis_types=(AxisType.Auto,) * len(types))


def mesh_scope(mesh):
  """``mesh`` as jax's context mesh while gshard traces, where the caller set
  another (under ``jax.set_mesh`` of a mesh with Explicit axes, ``shard_map``
  refuses gshard's Auto one); otherwise nothing. ``mesh`` is used with Auto
  axes; a mapping of axis sizes sets none."""
  if not isinstance(mesh, (Mesh, AbstractMesh)):
    return contextlib.nullcontext()
  mesh = with_auto_axes(mesh)
  current = jax.sharding.get_abstract_mesh()
  mesh_type = mesh if isinstance(mesh, AbstractMesh) else mesh.abstract_mesh
  if current.empty or current == mesh_type:
    return contextlib.nullcontext()
  scope = (jax.sharding.use_abstract_mesh(mesh) if isinstance(mesh, AbstractMesh)
           else jax.set_mesh(mesh))
  return _replacing(scope, current)


# the context mesh the innermost mesh_scope replaced (per thread, as jax's own)
_CALLER = contextvars.ContextVar("gshard_caller_mesh", default=None)


@contextlib.contextmanager
def _replacing(scope, caller):
  token = _CALLER.set(caller)
  try:
    with scope:
      yield
  finally:
    _CALLER.reset(token)


def caller_mesh_scope():
  """Inside :func:`mesh_scope`: the caller's own context mesh again (the
  user's function is traced as ``jax.jit`` would trace it, where a
  ``jax.shard_map`` over that mesh checks the context); otherwise nothing."""
  caller = _CALLER.get()
  return contextlib.nullcontext() if caller is None else jax.sharding.use_abstract_mesh(caller)
