"""The one annotation primitive: identity on values, carrying a sharding.

Everything about it sits here, registration last: impl, abstract eval, MLIR
lowering (identity), batching (the vmapped dim is unsplit), and JVP/transpose
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

  def insert_dim(self, dim: int) -> Annotation:
    """The annotation of a value with a new unsplit dim at ``dim`` (vmap)."""
    dims = list(self.sharding.dims)
    dims.insert(dim, ())
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


def _batch(args, dims, *, annotation):
  (x,), (bdim,) = args, dims
  if bdim is None:   # not mapped (jax's batching.NotMapped is type(None))
    return annotate_p.bind(x, annotation=annotation), bdim
  return annotate_p.bind(x, annotation=annotation.insert_dim(bdim)), bdim


def _transpose(ct, x, *, annotation):
  del x
  return [annotate_p.bind(ct, annotation=annotation)]


def _make_primitive() -> Primitive:
  p = Primitive("sharding_annotation")
  p.def_impl(_impl)
  p.def_abstract_eval(_abstract_eval)
  mlir.register_lowering(p, _lowering)
  batching.primitive_batchers[p] = _batch
  ad.deflinear2(p, _transpose)
  return p


annotate_p = _make_primitive()
