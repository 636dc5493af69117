"""Printing a jaxpr with the sharding of every variable.

``c:f32[8@data,32@model] = dot_general[contract=((1,),(0,))] a b   # model.py:12``
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from jax.extend.core import Literal

from gshard.spmd.graph import sub_jaxprs
from gshard.spmd.sharding import TensorSharding

ShardingOf = Callable[[tuple, Any], "TensorSharding | None"]

_SKIP_PARAMS = {"jaxpr", "call_jaxpr", "jvp_jaxpr_fun", "fwd_jaxpr_thunk", "bwd",
                "out_trees", "branches", "cond_jaxpr", "body_jaxpr", "update_jaxpr",
                "in_shardings", "out_shardings", "in_layouts", "out_layouts",
                "donated_invars", "ctx_mesh", "compiler_options_kvs", "sharding",
                "out_sharding", "precision", "preferred_element_type", "accuracy",
                "keep_unused", "inline", "weak_type", "unique_indices",
                "indices_are_sorted", "fill_value", "update_consts", "symbolic_zeros",
                "jaxpr_param", "policy", "prevent_cse", "differentiated", "linear",
                "unroll", "_split_transpose", "out_dtype"}


class Namer:
  """Short names for variables: a, b, ..., z, ba, bb, ..."""

  def __init__(self):
    self.names: dict[int, str] = {}

  def __call__(self, var) -> str:
    if isinstance(var, Literal):
      return str(var.val) if np.ndim(var.val) == 0 else "lit"
    if type(var).__name__ == "DropVar":
      return "_"
    key = id(var)
    if key not in self.names:
      self.names[key] = _name(len(self.names))
    return self.names[key]


def _name(i: int) -> str:
  letters = "abcdefghijklmnopqrstuvwxyz"
  s = letters[i % 26]
  i //= 26
  while i:
    i -= 1
    s = letters[i % 26] + s
    i //= 26
  return s


def _typed(var, scope, sharding_of: ShardingOf, namer: Namer) -> str:
  aval = var.aval
  shape = tuple(getattr(aval, "shape", ()))
  s = sharding_of(scope, var)
  if s is None:
    s = TensorSharding.replicated(len(shape))
  return f"{namer(var)}:{s.format(shape, getattr(aval, 'dtype', None))}"


def _params(params) -> str:
  items = []
  for k, v in params.items():
    if k in _SKIP_PARAMS:
      continue
    if k == "name":
      items.append(f"name={v}")
      continue
    text = str(v)
    if len(text) > 60:
      text = text[:57] + "..."
    items.append(f"{k}={text}")
  return f"[{', '.join(items)}]" if items else ""


def format_jaxpr(jaxpr, sharding_of: ShardingOf, *, scope: tuple = (),
                 namer: Namer | None = None, indent: int = 0,
                 source_of: Callable[[Any], str] | None = None) -> str:
  """The jaxpr as text, every variable typed with its sharding."""
  namer = namer or Namer()
  pad = "  " * indent
  lines = []
  ins = " ".join(_typed(v, scope, sharding_of, namer)
                 for v in list(jaxpr.constvars) + list(jaxpr.invars))
  lines.append(f"{pad}{{ lambda {ins} . let")
  for idx, eqn in enumerate(jaxpr.eqns):
    outs = " ".join(_typed(v, scope, sharding_of, namer) for v in eqn.outvars)
    args = " ".join(namer(v) for v in eqn.invars)
    line = f"{pad}    {outs} = {eqn.primitive.name}{_params(eqn.params)} {args}"
    if source_of is not None and eqn.primitive.name not in ("jit", "pjit"):
      line = f"{line:<100}  # {source_of(eqn)}"
    lines.append(line.rstrip())
    for path, sub in sub_jaxprs(eqn.params):
      lines.append(format_jaxpr(sub, sharding_of, scope=scope + ((idx, path),),
                                namer=namer, indent=indent + 3, source_of=source_of))
  outs = " ".join(namer(v) for v in jaxpr.outvars)
  lines.append(f"{pad}  in ({outs}) }}")
  return "\n".join(lines)

