"""The result of ``gshard.auto_shard``: layouts to partition with, and why.

A :class:`Plan` holds what ``gshard.partition`` needs (``in_specs``, and the
``annotations`` to apply with :meth:`Plan.annotate`), what it will cost
(bytes sent per device, from the partitioned program's own collectives, and
the predicted memory per device), and for each argument the layout chosen, the
runner-up and what each costs. ``print(plan)`` shows all of it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from jax.sharding import PartitionSpec as P

from gshard.auto.annotations import Annotation, annotate
from gshard.spmd.inspect import format_bytes
from gshard.spmd.sharding import mesh_str


@dataclasses.dataclass(frozen=True)
class Choice:
  """The layout of one argument (with the leaves that share it).

  Attributes:
    names: the argument leaves laid out together (a parameter, its gradient's
      optimizer state ...), as ``params['w1']``.
    shape, dtype: of the first of them.
    spec: the chosen PartitionSpec.
    held: bytes one device holds of these leaves.
    runner_up: the best other layout (None when the leaf has only one, or
      no other fits the memory limit).
    runner_up_bytes: bytes per device the best plan with the runner-up sends.
    runner_up_memory: that plan's predicted memory per device.
    runner_up_exact: the runner-up plan was solved exactly (else: the rest of
      the plan held fixed, when the time for runner-ups ran out).
  """

  names: tuple[str, ...]
  shape: tuple[int, ...]
  dtype: str
  spec: P
  held: float
  runner_up: P | None
  runner_up_bytes: float
  runner_up_memory: float
  runner_up_exact: bool


@dataclasses.dataclass(frozen=True)
class Cost:
  """What a layout costs per device: bytes sent (by the partitioned program's
  collectives), predicted memory (arguments + activations at the peak), and
  the compiled program's memory (temp + arguments + outputs - aliased, from
  ``memory_analysis()``; None when not compiled)."""

  bytes: float
  memory: float
  arguments: float
  activations: float
  collectives: tuple = ()
  compiled_memory: float | None = None

  def __str__(self) -> str:
    out = (f"{format_bytes(self.bytes)} sent, {format_bytes(self.memory)} memory "
           f"({format_bytes(self.arguments)} arguments + "
           f"{format_bytes(self.activations)} activations) per device")
    if self.compiled_memory is not None:
      out += f"; compiled: {format_bytes(self.compiled_memory)}"
    return out


@dataclasses.dataclass
class Plan:
  """Layouts for a function's arguments, found by ``gshard.auto_shard``.

  Attributes:
    in_specs: a pytree of PartitionSpecs, one per argument leaf, for
      ``gshard.partition(plan.annotate(fn), mesh, in_specs=plan.in_specs)``
      (without ``annotate``, the program is not the one priced where the
      plan has annotations).
    annotations: internal annotations the plan needs (:class:`Annotation`:
      source line, value, spec); apply them with :meth:`annotate` or write
      them at their source lines. Usually empty or few.
    cost: the partitioned program's bytes sent and predicted memory per device.
    predicted_bytes: the solver's own estimate of the bytes sent.
    choices: per argument (leaves sharing a layout grouped), the layout, the
      runner-up and their costs, largest first.
    mesh_sizes: the mesh.
    memory_limit: the limit the plan was found under (None: none).
    seconds: time per phase (trace, build, solve, runner_ups, realize, check).
    size: the integer program after reduction (variables, choices, matrices,
      entries).
    status: the solver's status ("optimal" unless it ran out of time).
  """

  in_specs: Any
  annotations: list[Annotation]
  cost: Cost
  predicted_bytes: float
  choices: list[Choice]
  mesh_sizes: dict[str, int]
  memory_limit: float | None
  seconds: dict[str, float]
  size: dict[str, int]
  status: str
  _evaluate: Callable | None = dataclasses.field(default=None, repr=False)

  def annotate(self, fn: Callable) -> Callable:
    """``fn`` with the plan's annotations (``fn`` itself when there are none).

    Partition ``plan.annotate(train_step)`` with ``in_specs=plan.in_specs``
    to get exactly the program the plan priced."""
    return annotate(fn, self.annotations)

  def evaluate(self, in_specs, annotations: bool = False) -> Cost:
    """What another layout of the same arguments costs, measured the same way
    (e.g. a hand-written one, or pure data parallel): propagation and the
    partitioner's collectives from ``in_specs``; with ``annotations`` the plan's
    annotations are applied too."""
    return self._evaluate(in_specs, self.annotations if annotations else [])

  @property
  def search_seconds(self) -> float:
    """Seconds from the call to the plan, everything included."""
    return sum(self.seconds.values())

  def __str__(self) -> str:
    limit = (f", memory limit {format_bytes(self.memory_limit)} per device"
             if self.memory_limit is not None else "")
    lines = [f"gshard.auto_shard plan on mesh {mesh_str(self.mesh_sizes)}{limit}",
             f"  {self.cost}",
             f"  (the solver predicted {format_bytes(self.predicted_bytes)} sent; "
             f"found in {self.search_seconds:.1f} s, {self.status}, integer program of "
             f"{self.size.get('variables', 0)} variables / "
             f"{self.size.get('choices', 0)} choices after reduction)", ""]
    rows = _grouped(self.choices)
    head = ("argument", "layout", "held", "runner-up", "its bytes", "its memory")
    table = [head] + [r for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    for r in table:
      lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    if self.annotations:
      lines += ["", f"annotations ({len(self.annotations)}; apply with plan.annotate(fn)):"]
      lines += [f"  {a}" for a in self.annotations]
    return "\n".join(lines)


def _spec_str(spec: P | None) -> str:
  if spec is None:
    return "-"
  return "P(" + ", ".join(repr(e) if e is not None else "None" for e in spec) + ")"


def _grouped(choices: list[Choice]) -> list[tuple[str, ...]]:
  """Table rows; leaves of repeated layers (names differing only in list
  indices, same layouts) collapse into one row with ``[*]``."""
  groups: dict[tuple, list[Choice]] = {}
  for c in choices:
    pattern = re.sub(r"\[\d+\]", "[*]", c.names[0])
    key = (pattern, str(c.spec), str(c.runner_up), c.shape)
    groups.setdefault(key, []).append(c)
  rows = []
  for (pattern, _, _, _), cs in groups.items():
    c = cs[0]
    name = pattern if len(cs) > 1 else c.names[0]
    if len(cs) > 1:
      name += f" x{len(cs)}"
    if len(c.names) > 1:
      name += f" (+{len(c.names) - 1} sharing it)"
    ru = _spec_str(c.runner_up)
    star = "" if c.runner_up_exact else "~"
    rows.append((name, _spec_str(c.spec), format_bytes(c.held), ru,
                 star + format_bytes(c.runner_up_bytes) if c.runner_up is not None else "-",
                 star + format_bytes(c.runner_up_memory) if c.runner_up is not None else "-"))
  return rows
