"""Tensors as the factor solver reads them: bytes, and a sharding read as
mesh axes per factor of a rule (:func:`project`) and back (:func:`unproject`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

from gshard.spmd.sharding import Axes, TensorSharding, fit_axes, itemsize

MeshSizes = Mapping[str, int]


class Held(Protocol):
  """What the solver reads of a tensor."""

  sharding: TensorSharding
  fixed: frozenset[int]
  shape: tuple[int, ...]
  dtype: Any


def nbytes(t: Held) -> int:
  """Global bytes of ``t``."""
  return math.prod(t.shape) * itemsize(t.dtype)


def local_nbytes(t: Held, mesh: MeshSizes) -> int:
  """Bytes one device holds of ``t``: what resharding it roughly sends."""
  return nbytes(t) // max(1, math.prod(mesh[a] for d in t.sharding.dims for a in d))


# -- projection -----------------------------------------------------------------

def project(dims_factors, sharding_dims, size_of, mesh) -> dict[str, Axes]:
  """The axes each factor of a tensor holds under its sharding.

  A dim of factors ``(a, b)`` split over mesh axes ``(x, y)`` gives ``a`` the
  leading axes whose product divides its size; ``b`` gets the rest only when
  ``a`` is split fully. ``project([("a", "b")], [("x", "y")], {"a": 2, "b": 8},
  {"x": 2, "y": 4}) == {"a": ("x",), "b": ("y",)}``.
  """
  out: dict[str, Axes] = {}
  for factors, axes in zip(dims_factors, sharding_dims):
    rest = list(axes)
    if len(factors) == 1:
      if rest:
        out[factors[0]] = tuple(rest)
      continue
    for f in factors:
      take, prod = [], 1
      while rest and size_of[f] % (prod * mesh[rest[0]]) == 0:
        prod *= mesh[rest[0]]
        take.append(rest.pop(0))
      if take:
        out[f] = tuple(take)
      if prod != size_of[f]:
        break
  return out


def unproject(dims_factors, choice, size_of, mesh) -> list[Axes]:
  """The inverse of :func:`project`: a tensor's dims from per-factor axes.

  A factor inside a compound dim keeps only the leading axes that divide it,
  and the next factor of that dim gets axes only when this one is split fully.
  """
  dims = []
  for factors in dims_factors:
    if len(factors) == 1:          # the common case: one factor, its axes
      dims.append(tuple(choice.get(factors[0], ())))
      continue
    axes: list[str] = []
    for f in factors:
      a = list(choice.get(f, ()))
      if len(factors) > 1:
        a = list(fit_axes(a, size_of[f], mesh))
      axes += a
      if math.prod(mesh[x] for x in a) != size_of[f]:
        break
    dims.append(tuple(axes))
  return dims
