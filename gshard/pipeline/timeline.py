"""A schedule's table replayed in time: costs per action, events, the makespan."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from gshard.pipeline.actions import Action


@dataclasses.dataclass(frozen=True)
class Costs:
  """Duration of each action kind, per virtual stage, and the send latency.

  Build it with :meth:`Costs.of` from ``dict(F=..., B=..., W=..., comm=...)``.
  Each of F, B, W is a number (every virtual stage), a sequence of ``K``
  numbers (per device stage, the same for all its chunks) or of ``K * v``
  numbers (per virtual stage). ``comm`` (default 0) is added to every
  dependency that crosses devices.

  For a schedule without W actions the B action is the full backward, so its
  duration is ``B + W`` (``W`` defaults to 0): the same dict ``dict(F=1, B=1,
  W=1)`` then describes the same model under ``1f1b`` (B lasts 2) and
  ``zero_bubble`` (B and W last 1 each). A split schedule needs ``W``.

  Attributes:
    F, B, W: per virtual stage, length ``K * v``.
    comm: latency of a cross-device send.
  """

  F: tuple[float, ...]
  B: tuple[float, ...]
  W: tuple[float, ...]
  comm: float = 0.0

  @classmethod
  def of(cls, costs: Mapping[str, object] | Costs, num_stages: int, repeats: int,
         split: bool) -> Costs:
    """Normalise a user's ``costs`` argument; errors name the bad entry."""
    if isinstance(costs, Costs):
      if len(costs.F) != num_stages * repeats:
        raise ValueError(f"costs: a Costs for {len(costs.F)} virtual stages, the schedule "
                         f"has {num_stages * repeats}; build it with Costs.of(...).")
      return costs
    if not isinstance(costs, Mapping):
      raise ValueError(f"costs must be a dict such as dict(F=1.0, B=2.0, W=0.0), got "
                       f"{type(costs).__name__} {costs!r}.")
    unknown = sorted(set(costs) - {"F", "B", "W", "comm"})
    if unknown:
      raise ValueError(f"costs: unknown keys {unknown}; use F, B, W (durations) and comm "
                       "(cross-device latency).")
    for key in ("F", "B"):
      if key not in costs:
        raise ValueError(f"costs needs an {key!r} entry (duration of one {key} action), got "
                         f"keys {sorted(costs)}.")
    if split and "W" not in costs:
      raise ValueError("costs: this schedule splits the backward into B (input gradient) and "
                       "W (weight gradient); give costs a 'W' entry too, e.g. "
                       "dict(F=1, B=1, W=1).")
    num_virtual = num_stages * repeats
    per = {key: cls._expand(key, costs.get(key, 0.0), num_stages, repeats)
           for key in ("F", "B", "W")}
    comm = costs.get("comm", 0.0)
    if not isinstance(comm, (int, float)) or isinstance(comm, bool) or comm < 0:
      raise ValueError(f"costs['comm'] must be a number >= 0, got {comm!r}.")
    if not split:
      per["B"] = tuple(b + w for b, w in zip(per["B"], per["W"]))
      per["W"] = (0.0,) * num_virtual
    return cls(F=per["F"], B=per["B"], W=per["W"], comm=float(comm))

  @staticmethod
  def _expand(key: str, value, num_stages: int, repeats: int) -> tuple[float, ...]:
    num_virtual = num_stages * repeats
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      values = [value] * num_virtual
    elif isinstance(value, Sequence) and len(value) in (num_stages, num_virtual):
      values = list(value)
      if len(values) == num_stages and num_virtual != num_stages:
        values = [values[u % num_stages] for u in range(num_virtual)]
    else:
      raise ValueError(
          f"costs[{key!r}] must be a number, or a list of num_stages={num_stages} (per "
          f"device stage) or num_stages*repeats={num_virtual} (per virtual stage) "
          f"numbers; got {value!r}.")
    for x in values:
      if not isinstance(x, (int, float)) or isinstance(x, bool) or not x >= 0 or x == math.inf:
        raise ValueError(f"costs[{key!r}]: durations must be finite numbers >= 0, got {x!r}.")
    return tuple(float(x) for x in values)

  def duration(self, kind: str, virtual: int) -> float:
    return getattr(self, kind)[virtual]


@dataclasses.dataclass(frozen=True)
class Event:
  """One action placed in time by :meth:`Schedule.timeline`."""

  stage: int
  tick: int
  action: Action
  start: float
  end: float


@dataclasses.dataclass(frozen=True)
class Timeline:
  """The table replayed under some costs.

  Attributes:
    events: every action with its start and end time, in table order.
    num_stages: K.
    makespan: the end of the last action (from time 0).
    busy: per device stage, the summed durations of its actions.
  """

  events: tuple[Event, ...]
  num_stages: int
  makespan: float
  busy: tuple[float, ...]

  @property
  def bubble_fraction(self) -> float:
    """``1 - sum(busy) / (K * makespan)``; 0 for an empty timeline."""
    if self.makespan <= 0:
      return 0.0
    return 1.0 - sum(self.busy) / (self.num_stages * self.makespan)


PHASES = ("F", "B", "W")   # the order of a tick's phases in pipeline.run


def lockstep_timeline(table, num_stages: int, costs: Costs | None) -> Timeline:
  """``table`` replayed as one SPMD program runs it: tick after tick, each tick
  one phase per kind of action in it (F, B, W in that order), a phase as long
  as its longest action (``comm`` added after F and B phases: their results
  move to a neighbour). Without costs every phase lasts 1."""
  events, busy, now = [], [0.0] * num_stages, 0.0
  for t, row in enumerate(table):
    for kind in PHASES:
      cells = [(s, a) for s, a in enumerate(row) if a is not None and a.kind == kind]
      if not cells:
        continue
      length, comm = 1.0, 0.0
      if costs is not None:
        durations = [costs.duration(kind, a.chunk * num_stages + s) for s, a in cells]
        length, comm = max(durations), (costs.comm if kind != "W" else 0.0)
      for s, a in cells:
        own = length if costs is None else costs.duration(kind, a.chunk * num_stages + s)
        events.append(Event(s, t, a, now, now + own))
        busy[s] += own
      now += length + comm
  return Timeline(tuple(events), num_stages, now, tuple(busy))
