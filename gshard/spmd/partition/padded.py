"""``gshard.PaddedArray``: an unevenly split value kept split between calls.

jax places arrays only with even shardings: a table of 1003 rows cannot be a
``jax.Array`` split four ways. Inside the per-device program gshard pads it to
1004 rows (251 per device); a :class:`PaddedArray` is that padded global array
(an even ``NamedSharding``, so each device keeps its 251 rows) together with
the logical shape. ``gshard.partition`` returns the state it keeps split this
way and takes it back without moving it.

It is a pytree node with one child, the padded ``jax.Array`` (``.data``), and
the logical and padded shapes as its static part, so ``jax.tree`` functions,
``jax.jit`` and checkpointing libraries see the padded array. Under
``jax.vmap`` the batch dims are in front (``out_axes=0``); a batch dim
elsewhere, or mapping over a dim that holds padding, is an error
(``gshard.unpad`` the value first). The padding holds zeros as
created, and whatever the program left there after a step: read values
through :meth:`PaddedArray.logical` / :func:`unpad`, never ``.data`` directly.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding

from gshard.spmd.collectives import pad_zeros


@jax.tree_util.register_pytree_node_class
class PaddedArray:
  """A global array of logical ``shape``, held padded up to an even layout.

  Attributes:
    data: the padded global array (``jax.Array`` with a ``NamedSharding``
      whose split dims divide its shape).
    shape: the logical shape; ``data.shape`` is at least as large in every dim.

  Example::

    table, loss = step(table, batch)     # table: PaddedArray f32[1003,64] in f32[1004,64]
    table.shape                          # (1003, 64)
    np.asarray(table)                    # the logical 1003 rows, on the host
    table.logical()                      # the logical jax.Array (gathers the split dim)
  """

  __slots__ = ("data", "shape", "_held")

  def __init__(self, data, shape, held=None):
    self.data = data
    self.shape = tuple(int(n) for n in shape)
    # the padded shape, kept where data has none (a tree jax or a library
    # unflattens with placeholders): the pytree's static part, with shape
    self._held = held if held is not None else _shape_of(data)

  # -- the array protocol ------------------------------------------------------
  @property
  def dtype(self):
    """The element type (the padded array's)."""
    return self.data.dtype

  @property
  def ndim(self) -> int:
    """Rank of the logical value."""
    return len(self.shape)

  @property
  def size(self) -> int:
    """Elements of the logical value."""
    return int(np.prod(self.shape, dtype=np.int64))

  @property
  def sharding(self):
    """The layout of the padded data."""
    return self.data.sharding

  def _index(self) -> tuple:
    return tuple(slice(0, n) for n in self.shape)

  def logical(self):
    """The logical value as a ``jax.Array`` (the padding sliced off; jax lays
    out the result evenly, so an uneven split dim comes back gathered); of an
    abstract one (``checkpoint.abstract_args``), its ``ShapeDtypeStruct``."""
    if isinstance(self.data, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(self.shape, self.data.dtype)
    return self.data[self._index()]

  def __jax_array__(self):
    """jax functions read the logical value: ``jnp.asarray(p)``, ``x @ p``,
    ``jnp.take(p, ids, axis=0)``, a model evaluated on the state outside
    gshard (under ``jax.jit`` too, where it slices the padded data)."""
    return self.logical()

  def __getitem__(self, index):
    """Indexing reads the logical value (``p[ids]``, flax's ``variable[...]``)."""
    return self.logical()[index]

  def __array__(self, dtype=None, copy=None):
    out = np.asarray(self.data)[self._index()]
    return out.astype(dtype) if dtype is not None else out

  def __len__(self) -> int:
    return self.shape[0]

  def __iter__(self):
    """The logical rows (indexing alone would never stop: jax clamps an index
    past the end)."""
    return iter(self.logical())

  def block_until_ready(self):
    """Wait for the padded data; returns ``self``."""
    self.data.block_until_ready()
    return self

  def __getattr__(self, name):
    """The methods and properties of ``jax.Array`` (``p.T``, ``p.astype(...)``,
    ``p.sum()``, ``p.at[i].set(v)``) act on the logical value."""
    if name in _ARRAY_ATTRS:
      return getattr(self.logical(), name)
    raise AttributeError(f"'PaddedArray' object has no attribute {name!r}")

  def __repr__(self) -> str:
    if _shape_of(self.data) is None:      # a jax.tree.map to shapes, names, None
      return f"PaddedArray({self.data!r}, logical shape {list(self.shape)})"
    dtype = getattr(self.dtype, "name", self.dtype)
    spec = getattr(getattr(self.data, "sharding", None), "spec", None)
    return (f"PaddedArray({dtype}{list(self.shape)} held as {dtype}"
            f"{list(self.data.shape)}" + (f", {spec}" if spec is not None else "") + ")")

  # -- the pytree --------------------------------------------------------------
  def tree_flatten(self):
    return (self.data,), (self.shape, self._held)

  @classmethod
  def tree_unflatten(cls, aux, children):
    shape, held = aux
    data = children[0]
    now = _shape_of(data)
    if held is not None and now and len(now) != len(held):
      mapped = _mapped(shape, held, now)
      if mapped is not None:
        return cls(data, mapped, now)
    return cls(data, shape, held)


# Operators act on the logical value, as jax.Array's do: ``w - 0.1 * g`` on a
# gradient returned padded gives the jax.Array the unpartitioned step would.
def _operator(name: str):
  def op(self, *other):
    return getattr(self.logical(), name)(*other)
  op.__name__ = op.__qualname__ = name
  op.__doc__ = f"``{name}`` of the logical value."
  return op


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "divmod", "pow",
              "matmul", "and", "or", "xor", "lshift", "rshift"):
  for _form in (f"__{_name}__", f"__r{_name}__"):
    setattr(PaddedArray, _form, _operator(_form))
for _form in ("__neg__", "__pos__", "__abs__", "__invert__", "__lt__", "__le__", "__gt__",
              "__ge__", "__eq__", "__ne__"):
  setattr(PaddedArray, _form, _operator(_form))
PaddedArray.__hash__ = None     # as jax.Array: compared elementwise, not hashable

_ARRAY_ATTRS = frozenset({
    "T", "mT", "all", "any", "argmax", "argmin", "argsort", "astype", "at", "clip",
    "conj", "conjugate", "cumprod", "cumsum", "diagonal", "dot", "flatten", "imag",
    "item", "max", "mean", "min", "nonzero", "prod", "ravel", "real", "repeat",
    "reshape", "round", "sort", "squeeze", "std", "sum", "swapaxes", "take", "tolist",
    "trace", "transpose", "var", "view"})


def _shape_of(x) -> tuple | None:
  shape = getattr(x, "shape", None)
  return tuple(shape) if isinstance(shape, tuple) else None


def _mapped(shape: tuple, held: tuple, now: tuple) -> tuple | None:
  """The logical shape of a PaddedArray of logical ``shape`` held as ``held``
  whose data ``jax.vmap`` (or ``lax.scan``) made ``now``: batch dims added in
  front (``out_axes=0``) join the logical shape; leading dims mapped over
  (``in_axes=0``) leave it, where they hold no padding. None where ``now``
  is no such shape (a ``jax.tree.map`` to something else: left as it was)."""
  fix = ("Map over the batch dims in front only (in_axes=0 / out_axes=0 for it), or "
         "gshard.unpad(value) first (or return it unpadded from the mapped function).")
  if len(now) > len(held):
    k = len(now) - len(held)
    if now[k:] == held:
      return now[:k] + shape
    if any(now[:i] + now[i + k:] == held for i in range(1, len(held) + 1)):
      raise ValueError(
          f"A gshard.PaddedArray of logical shape {shape}, held as {held}, came out of "
          f"jax.vmap as {now}: its batch dim is not in front. {fix}")
    return None
  k = len(held) - len(now)
  if held[k:] != now:
    return None
  if held[:k] != shape[:k]:
    raise ValueError(
        f"A gshard.PaddedArray of logical shape {shape}, held as {held} (padded to an even "
        f"split), lost its dim(s) {list(range(k))} (jax.vmap or lax.scan over them, or a "
        f"jax.tree.map reducing them): the padding would count as data. {fix}")
  return shape[k:]


def is_padded(x) -> bool:
  """Whether ``x`` is a :class:`PaddedArray` (an ``is_leaf`` for ``jax.tree``)."""
  return isinstance(x, PaddedArray)


def unpad(tree):
  """``tree`` with every :class:`PaddedArray` replaced by its logical ``jax.Array``.

  Example: ``params = gshard.unpad(state.params)`` before evaluating the model
  outside gshard, or before saving a checkpoint of logical shapes.
  """
  return jax.tree_util.tree_map(lambda x: x.logical() if is_padded(x) else x, tree,
                                is_leaf=is_padded)


def logical_struct(x) -> jax.ShapeDtypeStruct:
  """The logical shape and dtype of an argument (weak types kept, as jax keys
  its caches): a ``PaddedArray``, array, ``ShapeDtypeStruct``, tracer or scalar."""
  if is_padded(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type)
  aval = jax.typeof(x)
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def traced_arg(x, untyped: bool = False):
  """What gshard traces an argument as: the array itself (jax traces a
  committed array as jax.jit would), or its logical struct where that is a
  :class:`PaddedArray`, or, ``untyped``, where its type carries a layout (an
  array or struct on a mesh with Explicit axes): the one-device program, for
  code jax's sharding-in-types rules refuse under those layouts (a gather
  from a table split over one axis by indices split over another)."""
  if is_padded(x):
    return logical_struct(x)
  if not untyped:
    return x
  try:
    sharding = (x.sharding if isinstance(x, jax.ShapeDtypeStruct)
                else getattr(jax.typeof(x), "sharding", None))
  except TypeError:            # not an array: jax's trace says which argument
    return x
  types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
  return logical_struct(x) if AxisType.Explicit in types else x


def logical_args(args, untyped: bool = False):
  """``args`` as tracing and propagation see them (:func:`traced_arg`): each
  ``PaddedArray`` (the uneven state a partitioned step returns) as the
  ``ShapeDtypeStruct`` of its logical value; ``untyped``, each array whose
  type carries a layout too."""
  return jax.tree_util.tree_map(lambda x: traced_arg(x, untyped), args, is_leaf=is_padded)


def elsewhere(x, mesh) -> bool:
  """``x`` is an array committed to devices other than ``mesh``'s, to them in
  another order, or to a mesh of them with another shape or axis names: a
  jit over ``mesh`` refuses it (or fails inside jax, mapping the program's
  output layouts onto the input's mesh). A tracer (a call under an outer jit,
  grad or scan) is committed nowhere."""
  x = x.data if is_padded(x) else x
  if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or not x.committed:
    return False
  flat = tuple(mesh.devices.flat)
  if x.sharding.device_set != set(flat):
    return True
  if not isinstance(x.sharding, NamedSharding):
    return False
  held = x.sharding.mesh
  return (tuple(held.devices.flat) != flat or held.devices.shape != mesh.devices.shape
          or tuple(held.axis_names) != tuple(mesh.axis_names))


def traced(args) -> bool:
  """Whether the call is traced by an outer transformation (jit, scan, vmap,
  grad): some argument is a tracer."""
  return any(isinstance(x.data if is_padded(x) else x, jax.core.Tracer)
             for x in jax.tree_util.tree_leaves(args, is_leaf=is_padded))


def batched(x) -> bool:
  """Whether ``x`` is a ``jax.vmap`` tracer (its layout is the batch trace's
  to set: a sharding for the unbatched value does not fit it)."""
  return type(x.data if is_padded(x) else x).__name__ == "BatchTracer"   # not exported


def as_given(args, out, pairs: dict[int, int]):
  """``out`` with each next value of a state input in that input's form: a
  :class:`PaddedArray` only where the input was one. Under an outer trace a
  loop carry must keep its type (``lax.scan`` over a step whose uneven state
  entered as a plain array)."""
  given = jax.tree_util.tree_leaves(args, is_leaf=is_padded)
  leaves, tree = jax.tree_util.tree_flatten(out, is_leaf=is_padded)
  for j, i in pairs.items():
    if is_padded(leaves[j]) and not is_padded(given[i]):
      leaves[j] = leaves[j].logical()
  return jax.tree_util.tree_unflatten(tree, leaves)


def pad_to(x, full_shape, sharding: NamedSharding) -> PaddedArray:
  """``x`` (an array of its logical shape) as a :class:`PaddedArray` of
  ``full_shape`` laid out as ``sharding``; the padding is zeros."""
  shape = tuple(np.shape(x))
  if elsewhere(x, sharding.mesh):
    # committed elsewhere: padded where it is, then moved (jit refuses the mix)
    return PaddedArray(jax.device_put(_pad_fn(shape, tuple(full_shape), None)(x), sharding),
                       shape)
  data = _pad_fn(shape, tuple(full_shape), sharding)(x)
  return PaddedArray(data, shape)


@functools.lru_cache(maxsize=256)
def _pad_fn(shape, full_shape, sharding):
  widths = [(0, f - n) for n, f in zip(shape, full_shape)]
  return jax.jit(lambda x: pad_zeros(x, widths), out_shardings=sharding)
