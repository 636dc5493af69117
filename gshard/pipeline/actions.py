"""Actions and virtual stages: the vocabulary of a pipeline schedule.

Chunk ``c`` of device stage ``s`` is virtual stage ``u = c * K + s``; an
:class:`Action` is one device's work in one tick. The tick rules between
actions (:data:`RULES`, :func:`dependencies`) are explained in
``gshard.pipeline.schedules``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Kind = Literal["F", "B", "W"]
KINDS = ("F", "B", "W")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")


def virtual_stage(stage: int, chunk: int, num_stages: int) -> int:
  """The virtual stage that chunk ``chunk`` of device ``stage`` holds: ``chunk * K + stage``.

  Example: with ``num_stages=4``, device 1's chunk 2 is virtual stage 9.
  """
  return chunk * num_stages + stage


def placement(virtual: int, num_stages: int) -> tuple[int, int]:
  """``(stage, chunk)`` holding virtual stage ``virtual``: ``(u % K, u // K)``."""
  return virtual % num_stages, virtual // num_stages


@dataclasses.dataclass(frozen=True)
class Action:
  """One device's work in one tick: ``kind`` of micro-batch ``microbatch`` on chunk ``chunk``.

  Attributes:
    kind: ``"F"`` (forward), ``"B"`` (backward; input gradient only in split
      schedules) or ``"W"`` (weight gradient, split schedules only).
    microbatch: the micro-batch index, ``0 .. M-1``.
    chunk: the chunk on this device, ``0 .. repeats-1``; the virtual stage is
      ``chunk * num_stages + stage`` where ``stage`` is the table column.

  ``str(Action("F", 3, 1))`` is ``"F3c1"``; chunk 0 is left out (``"F3"``).
  """

  kind: Kind
  microbatch: int
  chunk: int = 0

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"Action: kind must be 'F', 'B' or 'W', got {self.kind!r}.")
    for field in ("microbatch", "chunk"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"Action: {field} must be an int >= 0, got {value!r}.")

  def label(self, show_chunk: bool = True) -> str:
    """``"F3c1"``; with ``show_chunk=False`` just ``"F3"``."""
    tail = f"c{self.chunk}" if show_chunk and self.chunk else ""
    return f"{self.kind}{self.microbatch}{tail}"

  def __str__(self) -> str:
    return self.label()


Key = tuple[str, int, int]  # (kind, microbatch, virtual stage)


def dependencies(kind: str, m: int, u: int, num_virtual: int) -> list[Key]:
  """The actions whose results ``kind(m, u)`` consumes: ``F(m,u)`` needs
  ``F(m,u-1)``; ``B(m,u)`` needs ``F(m,u)`` and ``B(m,u+1)``; ``W(m,u)`` needs
  ``B(m,u)`` (the tick rules of ``gshard.pipeline.schedules``)."""
  if kind == "F":
    return [("F", m, u - 1)] if u > 0 else []
  if kind == "B":
    deps = [("F", m, u)]
    if u < num_virtual - 1:
      deps.append(("B", m, u + 1))
    return deps
  return [("B", m, u)]


def describe(key: Key, num_stages: int) -> str:
  """``F(microbatch=2, chunk=1) of virtual stage 5 on stage 1``."""
  kind, m, u = key
  stage, chunk = placement(u, num_stages)
  return f"{kind}(microbatch={m}, chunk={chunk}) of virtual stage {u} on stage {stage}"


RULES = {
    ("F", "F"): "F(m, u) must run at a strictly later tick than F(m, u-1)",
    ("B", "F"): "B(m, u) must run at a strictly later tick than F(m, u)",
    ("B", "B"): "B(m, u) must run at a strictly later tick than B(m, u+1)",
    ("W", "B"): "W(m, u) must run at a strictly later tick than B(m, u)",
}
