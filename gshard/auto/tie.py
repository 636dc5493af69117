"""Repeated layers solved once: variables whose surroundings look alike share a choice.

The unrolled layers of a model are copies of one subgraph: the same ops on
values of the same shapes, in the same pattern. Colour refinement (the
Weisfeiler-Lehman test) finds them without knowing what a layer is: every
variable starts with a colour of its own kind (a value: shape, dtype,
candidate layouts, pins, and for an argument its path with list indices
dropped, so ``params['layers'][3]['wq']`` looks like ``['layers'][0]['wq']``;
an op: primitive, factor rule, trip count), then takes, for a few rounds, the
colour of (its colour, the multiset of (role, neighbour's colour)). Variables
with the same final colour are one variable of the integer program: layer
``i``'s ``wq`` and layer ``j``'s get the same layout, and their ops the same
strategy. A few rounds (not until stable) tie the layers' insides while the
boundary layers keep what differs within those hops.
"""

from __future__ import annotations

import re

from gshard.auto.problem import Problem

ROUNDS = 3


def pattern(name: str) -> str:
  """``[0]['layers'][3]['wq']`` -> ``[0]['layers'][*]['wq']``."""
  return re.sub(r"\[(\d+)\]", "[*]", name)


def classes(prob: Problem, input_names: dict[int, str], rounds: int = ROUNDS) -> list[int]:
  """A class per variable (variables of one class share their choice)."""
  colour = []
  for vi, var in enumerate(prob.vars):
    if var.kind == "value":
      v = var.item
      key = ("value", v.shape, str(v.root.dtype), tuple(v.candidates),
             tuple(sorted(v.fixed.items())), pattern(input_names.get(vi, "")),
             vi if vi in input_names and pattern(input_names[vi]) == input_names[vi] else -1)
    else:
      b = var.item.bound
      key = ("op", b.eqn.primitive.name, str(b.rule), var.item.repeat, var.n)
    colour.append(key)
  colour = _compact(colour)
  nbrs: list[list[tuple]] = [[] for _ in prob.vars]
  for (o, v), role in prob.roles.items():
    nbrs[o].append((role, v))
    nbrs[v].append((role, o))
  for _ in range(rounds):
    colour = _compact([(colour[i], tuple(sorted((r, colour[j]) for r, j in nbrs[i])))
                       for i in range(len(prob.vars))])
  return colour


def _compact(keys) -> list[int]:
  ids: dict = {}
  return [ids.setdefault(k, len(ids)) for k in keys]
