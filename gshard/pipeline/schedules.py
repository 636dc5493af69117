"""Pipeline schedules as tick tables: the validated :class:`Schedule`.

A schedule is a table ``table[tick][stage]`` of :class:`Action` (or ``None``
for an idle slot) that ``pipeline.run`` executes tick by tick over the
``stage`` mesh axis, each device its own action. The conventions the
executor relies on:

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
from collections.abc import Mapping, Sequence

from gshard.pipeline.actions import (KINDS, RULES, Action, Key, dependencies, describe,
                                     virtual_stage)
from gshard.pipeline.timeline import Costs, Event, Timeline, lockstep_timeline


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
    lockstep: how the metrics replay the table. False: asynchronously, each
      device starting an action once it is free and its inputs arrived (the
      schedule as published; torch-style runtimes). True: every tick one
      *phase* per kind of action in it (F, B, W) run on all stages, each phase
      as long as its slowest action on any stage (a one-program runtime
      without per-device branches; ``pipeline.run`` runs a table this way
      when each of its ticks holds one kind of action).
  """

  name: str
  num_stages: int
  num_microbatches: int
  repeats: int
  table: tuple[tuple[Action | None, ...], ...]
  costs: Costs | None = None
  lockstep: bool = False

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
    where: dict[Key, tuple[int, int]] = {}
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
              f"{self.name}: tick {t}, stage {s}: {describe(key, k)} appears a second time "
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
                f"{self.name}: {describe((kind, m, u), k)} is missing{extra}; rule: each "
                f"(microbatch, virtual stage) has exactly one {kind}. Add it to column "
                f"{u % k} with chunk {u // k}.")
    for key, (t, s) in sorted(where.items(), key=lambda item: item[1]):
      for dep in dependencies(*key, num_virtual):
        t_dep = where[dep][0]
        if t_dep >= t:
          raise ValueError(
              f"{self.name}: tick {t}, stage {s}: {describe(key, k)} runs at tick {t}, but "
              f"{describe(dep, k)} runs at tick {t_dep}; rule: {RULES[key[0], dep[0]]} "
              f"(a result is usable from the tick after it is produced). Move it to tick "
              f">= {t_dep + 1}.")

  # -- metrics ---------------------------------------------------------------

  @functools.cached_property
  def phases(self) -> int:
    """The phases a run with every stage in every phase would execute: the sum
    over ticks of the kinds of action in each. Equal to ``num_ticks`` when
    every tick holds one kind, as in the lockstep tables and ``gpipe`` (which
    ``pipeline.run`` runs that way); a tick mixing F and B counts two.
    ``pipeline.run`` runs a table with such ticks per device instead (each
    device only its own action: ``num_ticks`` ticks)."""
    return sum(len({a.kind for a in row if a is not None}) for row in self.table)

  def timeline(self, costs: Mapping[str, object] | Costs | None = None) -> Timeline:
    """Replay the table event by event under ``costs`` (default: this schedule's costs).

    Asynchronous (``lockstep=False``): each device runs its actions in table
    order; an action starts at ``max(device free, each dependency's end + comm
    if it crosses devices)``. Lockstep: ticks run one after the other, each as
    one phase per kind of action in it (F, then B, then W), a phase lasting as
    long as its longest action (plus ``comm`` for the F and B phases, whose
    results move to a neighbour); each action starts with its phase. With no
    costs at all every action lasts 1 and starts at its tick (the table
    itself; idle ticks a user put in are kept).
    """
    costs = self.costs if costs is None else Costs.of(costs, self.num_stages, self.repeats,
                                                      self.split)
    k = self.num_stages
    if self.lockstep:
      return lockstep_timeline(self.table, k, costs)
    events, busy = [], [0.0] * k
    if costs is None:
      for t, row in enumerate(self.table):
        for s, a in enumerate(row):
          if a is not None:
            events.append(Event(s, t, a, float(t), float(t + 1)))
            busy[s] += 1.0
      return Timeline(tuple(events), k, float(self.num_ticks), tuple(busy))
    num_virtual = self.num_virtual_stages
    end: dict[Key, float] = {}
    free = [0.0] * k
    for t, row in enumerate(self.table):
      for s, a in enumerate(row):
        if a is None:
          continue
        u = virtual_stage(s, a.chunk, k)
        start = free[s]
        for dep in dependencies(a.kind, a.microbatch, u, num_virtual):
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
    name = f"{self.name} (lockstep)" if self.lockstep else self.name
    return (f"{name}: K={self.num_stages} M={self.num_microbatches} v={self.repeats} "
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
    tail = ", lockstep=True" if self.lockstep else ""
    return (f"Schedule({self.name!r}, num_stages={self.num_stages}, num_microbatches="
            f"{self.num_microbatches}, repeats={self.repeats}, ticks={self.num_ticks}{tail})")

  def plot(self, path, *, costs: Mapping[str, object] | Costs | None = None,
           title: str | None = None) -> str:
    """Write a Gantt chart of the schedule to ``path`` (PNG; SVG, PDF ... by the
    path's suffix, as matplotlib writes them); returns ``str(path)``.

    Stages are rows (stage 0 on top), time runs left to right (ticks, or the
    replay under ``costs`` / this schedule's costs). Each micro-batch has its
    colour; F boxes are solid, B boxes hatched ``//``, W boxes paler and
    hatched ``..``; labels give kind, micro-batch and chunk; grey is idle.
    Needs matplotlib: ``pip install 'gshard[plot]'``.
    """
    from gshard.pipeline._plot import plot_timeline
    timeline = self.timeline(costs)
    bubble = timeline.bubble_fraction
    name = f"{self.name} (lockstep)" if self.lockstep else self.name
    title = title or (f"{name}: K={self.num_stages} M={self.num_microbatches} "
                      f"v={self.repeats}  bubble {bubble:.1%}  peak in flight "
                      f"{self.peak_in_flight}")
    return plot_timeline(timeline, path, num_microbatches=self.num_microbatches,
                         show_chunk=self.repeats > 1, title=title)
