"""The one annotation primitive: identity on values, carrying a sharding.

Everything about it sits here, registration last: impl, abstract eval, MLIR
lowering (identity), batching (the vmapped dim is unsplit, or split over
``spmd_axis_name``), and JVP/transpose
(tangents and cotangents carry the same annotation, so the backward pass of
annotated code is annotated too).
"""

from __future__ import annotations

import dataclasses

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from gshard.spmd.sharding import TensorSharding


@dataclasses.dataclass(frozen=True)
class Annotation:
  """A user's sharding annotation: the sharding, and dims left open.

  Attributes:
    sharding: the sharding the value must have at this point.
    open_dims: dims (``P.UNCONSTRAINED`` in the spec) whose split is left to
      propagation; their entry in ``sharding`` is ``()``.
  """

  sharding: TensorSharding
  open_dims: frozenset[int] = frozenset()

  def __str__(self) -> str:
    dims = ",".join("?" if i in self.open_dims else ("*".join(d) if d else "_")
                    for i, d in enumerate(self.sharding.dims))
    return f"[{dims}]"

  def insert_dim(self, dim: int, axes: tuple[str, ...] = ()) -> Annotation:
    """The annotation of a value with a new dim at ``dim`` (vmap), split over
    ``axes`` (``jax.vmap(..., spmd_axis_name=axes)``; default unsplit)."""
    used = set(self.sharding.partial).union(*map(set, self.sharding.dims))
    if set(axes) & used:
      raise ValueError(
          f"vmap(spmd_axis_name={axes!r}) over an annotation {self} that already uses "
          f"mesh axis {sorted(set(axes) & used)[0]!r}: a mesh axis can split only one dim. "
          "Use another spmd_axis_name, or annotate without that axis inside the vmap.")
    dims = list(self.sharding.dims)
    dims.insert(dim, tuple(axes))
    opened = frozenset(d + 1 if d >= dim else d for d in self.open_dims)
    return Annotation(TensorSharding(tuple(dims), self.sharding.partial), opened)


def _impl(x, *, annotation):
  del annotation
  return x


def _abstract_eval(aval, *, annotation):
  del annotation
  return aval


def _lowering(ctx, x, *, annotation):
  del ctx, annotation
  return [x]


def _batch(axis_data, args, dims, *, annotation):
  (x,), (bdim,) = args, dims
  if bdim is None:   # not mapped (jax's batching.NotMapped is type(None))
    return annotate_p.bind(x, annotation=annotation), bdim
  spmd = axis_data.spmd_name   # jax.vmap(..., spmd_axis_name=...): None or a tuple
  axes = () if spmd is None else (spmd,) if isinstance(spmd, str) else tuple(spmd)
  return annotate_p.bind(x, annotation=annotation.insert_dim(bdim, axes)), bdim


def _transpose(ct, x, *, annotation):
  del x
  return [annotate_p.bind(ct, annotation=annotation)]


def _make_primitive() -> Primitive:
  p = Primitive("sharding_annotation")
  p.def_impl(_impl)
  p.def_abstract_eval(_abstract_eval)
  mlir.register_lowering(p, _lowering)
  batching.fancy_primitive_batchers[p] = _batch
  ad.deflinear2(p, _transpose)
  return p


annotate_p = _make_primitive()
