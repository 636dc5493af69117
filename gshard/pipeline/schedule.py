"""Pipeline schedules as tick tables: GPipe, 1F1B, interleaved 1F1B, zero bubble.

A schedule is a table ``table[tick][stage]`` of :class:`Action` (or ``None``
for an idle slot) that the executor runs in lockstep over the ``stage`` mesh
axis. The conventions the executor relies on:

**Stages, chunks, virtual stages.** There are ``K = num_stages`` devices along
the pipeline axis and ``v = repeats`` model chunks per device, so the model's
layers are cut into ``V = K * v`` contiguous *virtual stages*. Device stage
``s`` holds chunks ``c = 0 .. v-1``, and chunk ``c`` of device ``s`` is virtual
stage ``u = c * K + s`` (circular / interleaved placement: device ``s`` holds
virtual stages ``s, s + K, s + 2K, ...``). Conversely virtual stage ``u`` lives
on device ``u % K`` as chunk ``u // K``. See :func:`virtual_stage` and
:func:`placement`. With ``v = 1`` the chunk is always 0 and ``u = s``.

**Actions.** ``Action(kind, microbatch, chunk)`` on column ``s`` of a tick is
that device running virtual stage ``chunk * K + s`` for one micro-batch:

- ``"F"``: the forward pass; its output activation goes to virtual stage
  ``u + 1``.
- ``"B"``: for ``gpipe``, ``1f1b`` and ``interleaved``, the full backward (input
  gradient, sent to ``u - 1``, and weight gradient). For ``zero_bubble`` (a
  *split* schedule, one with ``"W"`` actions) only the input gradient.
- ``"W"``: the weight gradient of that micro-batch and virtual stage (split
  schedules only). W actions are per micro-batch: the executor adds each one
  into a running sum of the chunk's weight gradients; nothing needs all
  micro-batches at once.

**Ticks.** In one tick every device runs at most one action. A value produced
at tick ``t`` (an activation by ``F``, an input gradient by ``B``) is sent by a
collective permute at the end of tick ``t`` and is usable from tick ``t + 1``.
So the table must satisfy (``Schedule.validate`` checks, on construction):

- every (micro-batch, virtual stage) has exactly one F and one B, and exactly
  one W when the schedule splits (then every B has its W);
- ``F(m, u)`` is at a strictly later tick than ``F(m, u - 1)``;
- ``B(m, u)`` is strictly later than ``F(m, u)`` and, for ``u < V - 1``, than
  ``B(m, u + 1)`` (the last virtual stage starts the backward from its own F:
  the loss is computed inside it);
- ``W(m, u)`` is strictly later than ``B(m, u)``.

One action per (tick, stage) and "the action runs on the device that holds its
virtual stage" hold by construction of the table (a column *is* a device and
the chunk selects the virtual stage). Hence each device runs exactly
``M * v`` forwards and ``M * v`` backwards.

**Metrics.** ``bubble_fraction`` is the idle share of ``K x makespan``;
``peak_in_flight`` is the largest number of (micro-batch, chunk) pairs any one
device holds activations for: counted from the F until the last action that
reads them (B without a split, W with one), both inclusive; two chunks of one
micro-batch count as two. Without costs both are read off the table (every
action one tick); with ``costs`` the table is replayed event by event
(:meth:`Schedule.timeline`): each device runs its actions in table order, each
as soon as the device is free and its inputs have arrived.

Example::

  from gshard import pipeline
  s = pipeline.schedule("1f1b", num_stages=4, num_microbatches=8)
  s.bubble_fraction          # 3/11 = 0.2727...
  s.peak_in_flight           # 4
  print(s)                   # stage x tick chart
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
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


_Key = tuple[str, int, int]  # (kind, microbatch, virtual stage)


def _dependencies(kind: str, m: int, u: int, num_virtual: int) -> list[_Key]:
  """The actions whose results ``kind(m, u)`` consumes (see the module docstring)."""
  if kind == "F":
    return [("F", m, u - 1)] if u > 0 else []
  if kind == "B":
    deps = [("F", m, u)]
    if u < num_virtual - 1:
      deps.append(("B", m, u + 1))
    return deps
  return [("B", m, u)]


def _describe(key: _Key, num_stages: int) -> str:
  kind, m, u = key
  stage, chunk = placement(u, num_stages)
  return f"{kind}(microbatch={m}, chunk={chunk}) of virtual stage {u} on stage {stage}"


_RULES = {
    ("F", "F"): "F(m, u) must run at a strictly later tick than F(m, u-1)",
    ("B", "F"): "B(m, u) must run at a strictly later tick than F(m, u)",
    ("B", "B"): "B(m, u) must run at a strictly later tick than B(m, u+1)",
    ("W", "B"): "W(m, u) must run at a strictly later tick than B(m, u)",
}


# ----------------------------------------------------------------------------
# Costs


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


# ----------------------------------------------------------------------------
# The schedule


def _as_action(entry, tick: int, stage: int) -> Action | None:
  if entry is None or isinstance(entry, Action):
    return entry
  if isinstance(entry, (tuple, list)) and len(entry) in (2, 3):
    try:
      return Action(*entry)
    except (TypeError, ValueError) as e:
      raise ValueError(f"table: tick {tick}, stage {stage}: {entry!r} is not an action: "
                       f"{e}") from None
  raise ValueError(f"table: tick {tick}, stage {stage}: entries must be Action, None (idle) "
                   f"or a tuple (kind, microbatch[, chunk]), got {entry!r}.")


@dataclasses.dataclass(frozen=True, repr=False)
class Schedule:
  """A validated pipeline schedule: ``table[tick][stage]`` of Action or None.

  Build one with :func:`schedule`. Construction normalises the table to tuples
  and runs :meth:`validate` (a ``ValueError`` naming the tick, stage, action
  and rule if the table is not a valid schedule).

  Attributes:
    name: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zero_bubble"`` or the
      label of a user's table (``"custom"``).
    num_stages: K, the devices along the pipeline axis (the table's width).
    num_microbatches: M.
    repeats: v, chunks per device; virtual stage of (stage s, chunk c) is
      ``c * K + s``.
    table: T ticks, each a tuple of K entries (Action or None).
    costs: the :class:`Costs` the metrics use, or None for the table's own
      ticks (every action one tick).
  """

  name: str
  num_stages: int
  num_microbatches: int
  repeats: int
  table: tuple[tuple[Action | None, ...], ...]
  costs: Costs | None = None

  def __post_init__(self):
    for field in ("num_stages", "num_microbatches", "repeats"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"schedule: {field} must be an int >= 1, got {value!r}.")
    if isinstance(self.table, (str, bytes)) or not isinstance(self.table, Sequence):
      raise ValueError(f"schedule: table must be a list of ticks (each a list of "
                       f"num_stages={self.num_stages} entries), got {type(self.table).__name__}.")
    rows = []
    for t, row in enumerate(self.table):
      if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) \
          or len(row) != self.num_stages:
        raise ValueError(f"table: tick {t} must have num_stages={self.num_stages} entries (one "
                         f"per stage, None for idle), got {row!r}.")
      rows.append(tuple(_as_action(entry, t, s) for s, entry in enumerate(row)))
    object.__setattr__(self, "table", tuple(rows))
    if self.costs is not None and not isinstance(self.costs, Costs):
      object.__setattr__(self, "costs", Costs.of(self.costs, self.num_stages, self.repeats,
                                                 self.split))
    elif isinstance(self.costs, Costs):
      Costs.of(self.costs, self.num_stages, self.repeats, self.split)
    self.validate()

  # -- structure -------------------------------------------------------------

  @property
  def num_ticks(self) -> int:
    """T, the table's length."""
    return len(self.table)

  @property
  def num_virtual_stages(self) -> int:
    """V = K * repeats."""
    return self.num_stages * self.repeats

  @functools.cached_property
  def split(self) -> bool:
    """Whether the backward is split into B (input gradient) and W (weight gradient)."""
    return any(a is not None and a.kind == "W" for row in self.table for a in row)

  def virtual_stage(self, stage: int, chunk: int) -> int:
    """``chunk * num_stages + stage``."""
    return virtual_stage(stage, chunk, self.num_stages)

  def stage_actions(self, stage: int) -> tuple[tuple[int, Action], ...]:
    """``(tick, action)`` of device ``stage``, in table order."""
    return tuple((t, row[stage]) for t, row in enumerate(self.table) if row[stage] is not None)

  def validate(self) -> None:
    """Check the rules of the module docstring; ValueError naming tick, stage, action, rule."""
    k, m_total, v = self.num_stages, self.num_microbatches, self.repeats
    num_virtual = k * v
    where: dict[_Key, tuple[int, int]] = {}
    for t, row in enumerate(self.table):
      for s, a in enumerate(row):
        if a is None:
          continue
        if a.microbatch >= m_total:
          raise ValueError(f"{self.name}: tick {t}, stage {s}: {a} has microbatch "
                           f"{a.microbatch}, but num_microbatches={m_total} (use 0.."
                           f"{m_total - 1}).")
        if a.chunk >= v:
          raise ValueError(f"{self.name}: tick {t}, stage {s}: {a} has chunk {a.chunk}, but "
                           f"repeats={v} (use 0..{v - 1}, or raise repeats).")
        key = (a.kind, a.microbatch, virtual_stage(s, a.chunk, k))
        if key in where:
          raise ValueError(
              f"{self.name}: tick {t}, stage {s}: {_describe(key, k)} appears a second time "
              f"(first at tick {where[key][0]}); rule: each (microbatch, virtual stage) has "
              f"exactly one {a.kind}. Remove one of them.")
        where[key] = (t, s)
    kinds = KINDS if self.split else ("F", "B")
    for m in range(m_total):
      for u in range(num_virtual):
        for kind in kinds:
          if (kind, m, u) not in where:
            extra = (" (the table has W actions, so every B needs its W)"
                     if kind == "W" else "")
            raise ValueError(
                f"{self.name}: {_describe((kind, m, u), k)} is missing{extra}; rule: each "
                f"(microbatch, virtual stage) has exactly one {kind}. Add it to column "
                f"{u % k} with chunk {u // k}.")
    for key, (t, s) in sorted(where.items(), key=lambda item: item[1]):
      for dep in _dependencies(*key, num_virtual):
        t_dep = where[dep][0]
        if t_dep >= t:
          raise ValueError(
              f"{self.name}: tick {t}, stage {s}: {_describe(key, k)} runs at tick {t}, but "
              f"{_describe(dep, k)} runs at tick {t_dep}; rule: {_RULES[key[0], dep[0]]} "
              f"(a result is usable from the tick after it is produced). Move it to tick "
              f">= {t_dep + 1}.")

  # -- metrics ---------------------------------------------------------------

  def timeline(self, costs: Mapping[str, object] | Costs | None = None) -> Timeline:
    """Replay the table event by event under ``costs`` (default: this schedule's costs).

    Each device runs its actions in table order; an action starts at
    ``max(device free, each dependency's end + comm if it crosses devices)``.
    With no costs at all every action lasts 1 and starts at its tick (the
    table itself; idle ticks a user put in are kept).
    """
    costs = self.costs if costs is None else Costs.of(costs, self.num_stages, self.repeats,
                                                      self.split)
    k = self.num_stages
    events, busy = [], [0.0] * k
    if costs is None:
      for t, row in enumerate(self.table):
        for s, a in enumerate(row):
          if a is not None:
            events.append(Event(s, t, a, float(t), float(t + 1)))
            busy[s] += 1.0
      return Timeline(tuple(events), k, float(self.num_ticks), tuple(busy))
    num_virtual = self.num_virtual_stages
    end: dict[_Key, float] = {}
    free = [0.0] * k
    for t, row in enumerate(self.table):
      for s, a in enumerate(row):
        if a is None:
          continue
        u = virtual_stage(s, a.chunk, k)
        start = free[s]
        for dep in _dependencies(a.kind, a.microbatch, u, num_virtual):
          hop = costs.comm if dep[2] % k != s else 0.0
          start = max(start, end[dep] + hop)
        finish = start + costs.duration(a.kind, u)
        end[(a.kind, a.microbatch, u)] = finish
        free[s] = finish
        busy[s] += finish - start
        events.append(Event(s, t, a, start, finish))
    return Timeline(tuple(events), k, max(free), tuple(busy))

  @functools.cached_property
  def bubble_fraction(self) -> float:
    """Idle share ``1 - busy / (K * makespan)`` under this schedule's costs (or ticks)."""
    return self.timeline().bubble_fraction

  @functools.cached_property
  def in_flight(self) -> tuple[int, ...]:
    """Per device stage, the peak number of (micro-batch, chunk) activations held.

    Counted in table order: +1 at an F, -1 after the action that last reads
    the activations (B, or W in a split schedule). The count only depends on
    each device's order, so costs do not change it.
    """
    release = "W" if self.split else "B"
    peaks = []
    for s in range(self.num_stages):
      alive = peak = 0
      for _, a in self.stage_actions(s):
        if a.kind == "F":
          alive += 1
          peak = max(peak, alive)
        elif a.kind == release:
          alive -= 1
      peaks.append(peak)
    return tuple(peaks)

  @property
  def peak_in_flight(self) -> int:
    """``max(in_flight)``: the most (micro-batch, chunk) activations one device holds."""
    return max(self.in_flight)

  # -- display ---------------------------------------------------------------

  def header(self) -> str:
    """One line: name, K, M, v, ticks, bubble and peak."""
    cost_note = "" if self.costs is None else " (given costs)"
    return (f"{self.name}: K={self.num_stages} M={self.num_microbatches} v={self.repeats} "
            f"ticks={self.num_ticks} bubble={self.bubble_fraction:.1%}{cost_note} "
            f"peak_in_flight={self.peak_in_flight}")

  def chart(self, width: int | None = 100) -> str:
    """Text chart, one row per stage, one column per tick, ``.`` for idle.

    Cells are ``F3`` (forward of micro-batch 3), ``B3``, ``W3``, with the chunk
    appended when ``repeats > 1`` (``F3c1``). Rows wider than ``width`` wrap
    into blocks of ticks, each titled ``ticks a-b``; ``width=None`` never wraps.
    Example (``gpipe``, K=2, M=3)::

      gpipe: K=2 M=3 v=1 ticks=8 bubble=25.0% peak_in_flight=3
      stage 0 | F0 F1 F2 .  .  B2 B1 B0
      stage 1 | .  F0 F1 F2 B2 B1 B0 .
    """
    show_chunk = self.repeats > 1
    cells = [[a.label(show_chunk) if a is not None else "." for a in row] for row in self.table]
    cell_width = max([len(c) for row in cells for c in row] + [1])
    names = [f"stage {s}" for s in range(self.num_stages)]
    name_width = max(len(n) for n in names)
    prefix = name_width + 3
    per_block = self.num_ticks or 1
    if width is not None:
      per_block = max(1, (width - prefix + 1) // (cell_width + 1))
    lines = [self.header()]
    blocks = range(0, self.num_ticks, per_block)
    for start in blocks:
      stop = min(start + per_block, self.num_ticks)
      if len(blocks) > 1:
        lines.append(f"ticks {start}-{stop - 1}")
      for s in range(self.num_stages):
        row = " ".join(cells[t][s].ljust(cell_width) for t in range(start, stop))
        lines.append(f"{names[s].ljust(name_width)} | {row}".rstrip())
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.chart()

  def __repr__(self) -> str:
    return (f"Schedule({self.name!r}, num_stages={self.num_stages}, num_microbatches="
            f"{self.num_microbatches}, repeats={self.repeats}, ticks={self.num_ticks})")

  def plot(self, path, *, costs: Mapping[str, object] | Costs | None = None,
           title: str | None = None) -> str:
    """Write a PNG Gantt chart of the schedule to ``path``; returns ``str(path)``.

    Stages are rows (stage 0 on top), time runs left to right (ticks, or the
    replay under ``costs`` / this schedule's costs). Each micro-batch has its
    colour; F boxes are solid, B boxes hatched ``//``, W boxes paler and
    hatched ``..``; labels give kind, micro-batch and chunk; grey is idle.
    Needs matplotlib: ``pip install 'gshard[plot]'``.
    """
    from gshard.pipeline._plot import plot_timeline
    timeline = self.timeline(costs)
    bubble = timeline.bubble_fraction
    title = title or (f"{self.name}: K={self.num_stages} M={self.num_microbatches} "
                      f"v={self.repeats}  bubble {bubble:.1%}  peak in flight "
                      f"{self.peak_in_flight}")
    return plot_timeline(timeline, path, num_microbatches=self.num_microbatches,
                         show_chunk=self.repeats > 1, title=title)


# ----------------------------------------------------------------------------
# Built-in schedules: a per-device order of actions, placed on ticks as early
# as the tick rules allow.


def _place(orders: list[list[Action]], num_stages: int, repeats: int, name: str):
  """Place each device's ordered actions at the earliest tick its inputs allow."""
  num_virtual = num_stages * repeats
  done: dict[_Key, int] = {}
  pos = [0] * num_stages
  remaining = sum(len(o) for o in orders)
  table = []
  while remaining:
    t = len(table)
    row: list[Action | None] = [None] * num_stages
    for s, order in enumerate(orders):
      if pos[s] == len(order):
        continue
      a = order[pos[s]]
      deps = _dependencies(a.kind, a.microbatch, virtual_stage(s, a.chunk, num_stages),
                           num_virtual)
      if all(done.get(d, t) < t for d in deps):
        row[s] = a
    if not any(row):
      raise AssertionError(f"{name}: the per-device orders deadlock at tick {t}; this is a "
                           "bug in gshard.pipeline.schedule, please report it.")
    for s, a in enumerate(row):
      if a is not None:
        done[(a.kind, a.microbatch, virtual_stage(s, a.chunk, num_stages))] = t
        pos[s] += 1
        remaining -= 1
    table.append(tuple(row))
  return tuple(table)


def _grouped(num_stages: int, num_microbatches: int, repeats: int, backward: bool):
  """(microbatch, chunk) in Megatron's interleaved order: K micro-batches per chunk."""
  pairs = [(m, c) for m in range(num_microbatches) for c in range(repeats)]
  if backward:
    key = lambda p: (p[0] // num_stages, repeats - 1 - p[1], p[0] % num_stages)
  else:
    key = lambda p: (p[0] // num_stages, p[1], p[0] % num_stages)
  return sorted(pairs, key=key)


def _gpipe_orders(k: int, m: int, v: int) -> list[list[Action]]:
  """All forwards (grouped order), then all backwards in the exact reverse order."""
  fwd = _grouped(k, m, v, backward=False)
  order = [Action("F", mb, c) for mb, c in fwd] + [Action("B", mb, c) for mb, c in reversed(fwd)]
  return [list(order) for _ in range(k)]


def _interleaved_orders(k: int, m: int, v: int) -> list[list[Action]]:
  """Megatron's (interleaved) 1F1B: warm-up forwards, then F/B pairs, then backwards.

  Device s warms up with ``K-1-s`` forwards when ``v = 1`` (PipeDream-flush),
  and with ``2(K-1-s) + (v-1)K`` when ``v > 1`` (Megatron-LM's count), capped
  at ``M * v``.
  """
  fwd = _grouped(k, m, v, backward=False)
  bwd = _grouped(k, m, v, backward=True)
  total = m * v
  orders = []
  for s in range(k):
    warmup = k - 1 - s if v == 1 else 2 * (k - 1 - s) + (v - 1) * k
    warmup = min(warmup, total)
    order = [Action("F", *fwd[i]) for i in range(warmup)]
    for i in range(total - warmup):
      order += [Action("F", *fwd[warmup + i]), Action("B", *bwd[i])]
    order += [Action("B", *bwd[i]) for i in range(total - warmup, total)]
    orders.append(order)
  return orders


def _zb_h1_orders(k: int, m: int) -> list[list[Action]]:
  """ZB-H1: 1F1B's warm-up, B split from W, device s holding back ``s`` W actions.

  After ``K-1-s`` warm-up forwards, device s repeats F, B, W; its W actions
  lag its B actions by ``s`` micro-batches (the last device's W trail furthest),
  and the held-back W fill the cool-down where 1F1B idles. Peak activations:
  ``(K-1-s) + 1 + s = K`` on every device, 1F1B's peak (that of device 0).
  """
  orders = []
  for s in range(k):
    warmup = min(k - 1 - s, m)
    order = [Action("F", i) for i in range(warmup)]
    next_f, pending = warmup, []
    for b in range(m):
      if next_f < m:
        order.append(Action("F", next_f))
        next_f += 1
      order.append(Action("B", b))
      pending.append(b)
      if len(pending) > s:
        order.append(Action("W", pending.pop(0)))
    order += [Action("W", w) for w in pending]
    orders.append(order)
  return orders


def schedule(name: str | None = None, *, num_stages: int, num_microbatches: int,
             repeats: int = 1, costs: Mapping[str, object] | None = None,
             table: Sequence[Sequence[object]] | None = None) -> Schedule:
  """A pipeline schedule by name, or a user's own ``table``, validated.

  Args:
    name: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"zero_bubble"``;
      with ``table``, any label (default ``"custom"``).
    num_stages: K, devices along the pipeline axis.
    num_microbatches: M.
    repeats: v, chunks per device (virtual stage of (s, c) is ``c*K + s``).
    costs: ``dict(F=..., B=..., W=..., comm=...)`` for ``bubble_fraction``
      (see :class:`Costs`); None means every action takes one tick.
    table: a user's schedule, ``table[tick][stage]`` of Action, None or
      ``(kind, microbatch[, chunk])``.

  The built-in schedules. Numbers are exact (the tests check them) in the
  table's ticks, i.e. every action, a chunk's F, B or W, lasts one tick; they
  also hold under uniform ``costs`` where noted (``F``, ``B``, ``W`` the
  durations of one chunk's actions, ``comm=0``):

  - ``gpipe``: every forward, then every backward in the exact reverse order
    (the mirror image, what autodiff of a forward loop gives). ``repeats > 1``
    is the circular pipeline, forwards grouped K micro-batches per chunk;
    needs K to divide M. Bubble ``(K-1)/(vM+K-1)``, also under any uniform
    F, B (makespan ``(vM+K-1)(F+B)``). Peak in flight ``vM``: all of them.
  - ``1f1b``: PipeDream-flush / Megatron non-interleaved: device s runs
    ``min(K-1-s, M)`` warm-up forwards, then one F / one B alternately, then
    the remaining backwards. Bubble ``(K-1)/(M+K-1)``, as GPipe, also under
    uniform F, B. Peak in flight ``min(K, M)`` (device s: ``min(K-s, M)``).
    Needs ``repeats=1`` (use ``interleaved``).
  - ``interleaved``: Megatron-LM's interleaved 1F1B, forwards grouped K
    micro-batches per chunk, warm-up ``2(K-1-s) + (v-1)K`` on device s; needs
    K to divide M when ``repeats > 1``. Bubble ``(K-1)/(vM+K-1)``, also under
    uniform per-chunk F, B: Megatron's "bubble / ideal = (K-1)/(vM)" written as a
    share of the total. Peak in flight on device s ``min(vK+K-1-2s, vM)``
    (per chunk), so ``vK+K-1`` once ``M >= 2K``. ``repeats=1`` is ``1f1b``.
  - ``zero_bubble``: ZB-H1 of Qi et al. (arXiv 2401.10241); B is the input
    gradient, W the weight gradient, device s keeps ``s`` W actions back to
    fill the cool-down. For ``M >= K``: ``3M+K-1`` ticks, bubble
    ``(K-1)/(3M+K-1)`` (1F1B's is ``(K-1)/(M+K-1)`` with its B lasting 2); for
    ``M < K``: ``2(M+K)-1`` ticks. Under uniform costs with ``W <= F`` and
    ``W <= B`` (and ``M >= K``) the makespan is the paper's
    ``M(F+B+W) + (K-1)(F+B-W)``. Peak in flight ``min(K, M)``, as 1F1B.
    Needs ``repeats=1``.

  Raises:
    ValueError: unknown name, a requirement not met (message names the fix),
      or an invalid ``table`` (message names tick, stage, action and rule).
  """
  for field, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                       ("repeats", repeats)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"schedule: {field} must be an int >= 1, got {value!r}.")
  if table is not None:
    return Schedule(name or "custom", num_stages, num_microbatches, repeats, table, costs)
  if name not in SCHEDULES:
    raise ValueError(f"schedule: name must be one of {', '.join(map(repr, SCHEDULES))} (or pass "
                     f"table=...), got {name!r}.")
  k, m, v = num_stages, num_microbatches, repeats
  if v > 1 and m % k and name in ("gpipe", "interleaved"):
    raise ValueError(
        f"schedule({name!r}): num_microbatches={m} must be a multiple of num_stages={k} when "
        f"repeats={v} > 1 (chunks run K micro-batches at a time; a partial group would stall "
        f"every device); use num_microbatches={k * -(-m // k)}, or repeats=1.")
  if name == "gpipe":
    orders = _gpipe_orders(k, m, v)
  elif name == "1f1b":
    if v != 1:
      raise ValueError(f"schedule('1f1b'): repeats must be 1, got repeats={v}; for several "
                       "chunks per device use schedule('interleaved', repeats=...).")
    orders = _interleaved_orders(k, m, 1)
  elif name == "interleaved":
    orders = _interleaved_orders(k, m, v)
  else:
    if v != 1:
      raise ValueError(f"schedule('zero_bubble'): repeats must be 1 (ZB-H1), got repeats={v}.")
    orders = _zb_h1_orders(k, m)
  return Schedule(name, k, m, v, _place(orders, k, v, name), costs)
