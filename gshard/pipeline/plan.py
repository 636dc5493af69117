"""A schedule's table as the executor's static per-tick arrays.

The executor (``gshard.pipeline.executor``) runs a table tick by tick in one
``lax.scan``; everything it needs to know about a tick is read here from the
table, once, as small numpy arrays (the scan's inputs):

- which *phases* run (``pattern``): the kinds of action in the tick (``F``,
  ``B``, ``W``), plus ``H`` (the loss head) when the last virtual stage runs a
  forward in it; the executor runs each phase under a ``lax.cond``, so a
  phase that no stage needs in a tick costs nothing;
- per stage, each kind's action: on or off, its chunk, and whether it is the
  first virtual stage (F reads ``x``, B writes ``dx``);
- slots. Values wait on a device between the tick that makes them and the
  tick that uses them, in four pools of numbered slots:

  ======  ===================================  ==========================
  pool    holds                                from .. to
  ======  ===================================  ==========================
  act     an activation sent by the previous   its arrival .. its F
          virtual stage
  grad    a cotangent sent by the next         its arrival (or the loss
          virtual stage (or the loss head's)   head) .. its B
  stash   what B needs of an F (residuals, or  F .. B
          the input under ``remat=True``)
  keep    what W needs of a B (split only)     B .. W
  ======  ===================================  ==========================

  Every write (one phase of one tick) takes one slot number for all the
  stages it writes on, the lowest that is free on each of them, so the
  executor writes it with one in-place ``dynamic_update_slice``, unless that
  costs slots: then the pool numbers its slots per stage (the optimum, as
  many as values ever wait in it at once on one stage) and a write takes each
  stage's own slot (``shared[pool]`` False; still local to each device). The
  lockstep tables share at no cost for ``gpipe``, ``1f1b`` and
  ``zero_bubble``; the asynchronous 1F1B's stash needs its own numbers per
  stage to hold K (shared: K+1). Reads pick each stage's own slot; ``-1``
  means "no slot" (nothing read or written). tests/test_pipeline_plan.py
  replays every table on the host.

Within a tick the phases run F, H, B, W; in each, slots are read before
arrivals are written, so a slot read in a phase can take an arrival in the
same phase.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from gshard.pipeline.actions import placement
from gshard.pipeline.schedules import Schedule

PHASES = ("F", "H", "B", "W")
# (tick, order) of each read / write: reads of a phase before its writes.
_ORDER = {"F-read": 0, "F-write": 1, "H-write": 2, "B-read": 3, "B-write": 4, "W-read": 5}


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
  """The static arrays of one schedule (module docstring). ``[T]`` arrays are
  the same on every stage; ``[T, K]`` arrays have one entry per stage."""

  num_ticks: int
  num_stages: int
  num_microbatches: int
  repeats: int
  split: bool
  patterns: tuple[tuple[str, ...], ...]   # distinct phase sets, branch order
  pattern: np.ndarray                     # [T] branch of each tick
  slots: dict                             # pool -> number of slots
  shared: dict                            # pool -> one slot number per write event
  f_on: np.ndarray
  f_chunk: np.ndarray
  f_first: np.ndarray                     # [T, K]: u == 0 (reads x)
  f_read: np.ndarray                      # [T, K] act slot read
  f_stash: np.ndarray                     # [T, K] stash slot written (where f_on)
  f_arrive: np.ndarray                    # [T, K] act slot a received activation goes to
  f_into: np.ndarray                      # [T, K] the stage receives one
  m_x: np.ndarray                         # [T] micro-batch of x read
  h_slot: np.ndarray                      # [T, K] grad slot of the loss cotangent (last stage)
  m_head: np.ndarray                      # [T] micro-batch of the targets read
  b_on: np.ndarray
  b_chunk: np.ndarray
  b_first: np.ndarray                     # [T, K]: u == 0 (writes dx)
  b_read: np.ndarray                      # [T, K] grad slot read
  b_stash: np.ndarray                     # [T, K] stash slot read
  b_keep: np.ndarray                      # [T, K] keep slot written (split; where b_on)
  b_arrive: np.ndarray                    # [T, K] grad slot a received cotangent goes to
  b_into: np.ndarray                      # [T, K] the stage receives one
  m_dx: np.ndarray                        # [T] micro-batch of dx written
  w_on: np.ndarray
  w_chunk: np.ndarray
  w_read: np.ndarray                      # [T, K] keep slot read

  def count(self, phase: str) -> int:
    """Ticks that run ``phase`` (``"F"``, ``"H"``, ``"B"`` or ``"W"``)."""
    return int(sum(phase in self.patterns[p] for p in self.pattern))


class _Pool:
  """One pool's slots: every write event (a tick's phase) takes one slot number
  for all the stages it writes on, the lowest free on each of them, so the
  executor writes with one ``dynamic_update_slice`` per event (in place)."""

  def __init__(self):
    self.events: dict[tuple, list] = {}     # write time -> [(stage, end, key)]

  def add(self, stage: int, start: tuple, end: tuple, key) -> None:
    if not start < end:
      raise AssertionError(f"gshard internal error: a value of {key} is used at {end} "
                           f"before it is made at {start}.")
    self.events.setdefault(start, []).append((stage, end, key))

  def colour(self) -> tuple[dict, dict, int]:
    """((stage, key) -> slot, (write time, stage) -> slot, number of slots),
    every write event one slot number on all its stages (shared)."""
    busy: dict[int, list] = {}               # stage -> per slot: end of its value
    slot_of, event_slot, most = {}, {}, 0
    for start in sorted(self.events):
      writes = self.events[start]
      slot = 0
      while any(slot < len(busy.get(s, ())) and not busy[s][slot] < start
                for s, _, _ in writes):
        slot += 1
      for s, end, key in writes:
        ends = busy.setdefault(s, [])
        ends.extend([(-1, 0)] * (slot + 1 - len(ends)))
        ends[slot] = end
        slot_of[s, key] = slot
        event_slot[start, s] = slot
      most = max(most, slot + 1)
    return slot_of, event_slot, most

  def colour_per_stage(self) -> tuple[dict, dict, int]:
    """Like :meth:`colour`, each stage numbering its own slots: greedy in
    order of writes, which is optimal for intervals (as many slots as values
    ever wait at once on one stage)."""
    busy: dict[int, list] = {}
    slot_of, event_slot, most = {}, {}, 0
    for start in sorted(self.events):
      for s, end, key in self.events[start]:
        ends = busy.setdefault(s, [])
        slot = next((i for i, e in enumerate(ends) if e < start), len(ends))
        if slot == len(ends):
          ends.append(end)
        ends[slot] = end
        slot_of[s, key] = slot
        event_slot[start, s] = slot
        most = max(most, slot + 1)
    return slot_of, event_slot, most


def _at(tick: int, what: str) -> tuple:
  return (tick, _ORDER[what])


@functools.lru_cache(maxsize=64)
def plan(sched: Schedule) -> Plan:
  """The executor's arrays for ``sched`` (cached per schedule)."""
  k, m, v = sched.num_stages, sched.num_microbatches, sched.repeats
  num_virtual = k * v
  t_len = sched.num_ticks
  where = {}
  for t, row in enumerate(sched.table):
    for s, a in enumerate(row):
      if a is not None:
        where[a.kind, a.microbatch, a.chunk * k + s] = t
  pools = {name: _Pool() for name in ("act", "grad", "stash", "keep")}
  for (kind, mb, u), t in where.items():
    s = u % k
    if kind == "F":
      if u + 1 < num_virtual:
        pools["act"].add((u + 1) % k, _at(t, "F-write"), _at(where["F", mb, u + 1], "F-read"),
                         (mb, u + 1))
      else:
        pools["grad"].add(s, _at(t, "H-write"), _at(where["B", mb, u], "B-read"), (mb, u))
      pools["stash"].add(s, _at(t, "F-write"), _at(where["B", mb, u], "B-read"), (mb, u))
    elif kind == "B":
      if u > 0:
        pools["grad"].add((u - 1) % k, _at(t, "B-write"), _at(where["B", mb, u - 1], "B-read"),
                          (mb, u - 1))
      if sched.split:
        pools["keep"].add(s, _at(t, "B-write"), _at(where["W", mb, u], "W-read"), (mb, u))
  slots, slot_of, event_slot, shared = {}, {}, {}, {}
  for name, pool in pools.items():
    together, apart = pool.colour(), pool.colour_per_stage()
    shared[name] = together[2] <= apart[2]
    slot_of[name], event_slot[name], slots[name] = together if shared[name] else apart

  def written(pool: str, t: int, what: str) -> np.ndarray:
    return np.array([event_slot[pool].get((_at(t, what), s), -1) for s in range(k)], np.int32)

  def grid(dtype, fill):
    return np.full((t_len, k), fill, dtype)

  arrays = {name: grid(bool, False) for name in ("f_on", "f_first", "b_on", "b_first", "w_on")}
  arrays.update({name: grid(np.int32, 0) for name in ("f_chunk", "b_chunk", "w_chunk")})
  arrays.update({name: grid(bool, False) for name in ("f_into", "b_into")})
  arrays.update({name: grid(np.int32, -1) for name in ("f_read", "b_read", "b_stash", "w_read")})
  m_x, m_head, m_dx = (np.zeros(t_len, np.int32) for _ in range(3))
  phases = [set() for _ in range(t_len)]
  for (kind, mb, u), t in where.items():
    s, c = placement(u, k)
    phases[t].add(kind)
    if kind == "F":
      arrays["f_on"][t, s], arrays["f_chunk"][t, s] = True, c
      if u == 0:
        arrays["f_first"][t, s], m_x[t] = True, mb
      else:
        arrays["f_read"][t, s] = slot_of["act"][s, (mb, u)]
      if u + 1 < num_virtual:
        arrays["f_into"][t, (u + 1) % k] = True
      else:
        phases[t].add("H")
        m_head[t] = mb
    elif kind == "B":
      arrays["b_on"][t, s], arrays["b_chunk"][t, s] = True, c
      arrays["b_read"][t, s] = slot_of["grad"][s, (mb, u)]
      arrays["b_stash"][t, s] = slot_of["stash"][s, (mb, u)]
      if u == 0:
        arrays["b_first"][t, s], m_dx[t] = True, mb
      else:
        arrays["b_into"][t, (u - 1) % k] = True
    else:
      arrays["w_on"][t, s], arrays["w_chunk"][t, s] = True, c
      arrays["w_read"][t, s] = slot_of["keep"][s, (mb, u)]
  per_tick = {name: np.stack([written(pool, t, what) for t in range(t_len)])
              for name, pool, what in (("f_stash", "stash", "F-write"),
                                       ("f_arrive", "act", "F-write"),
                                       ("h_slot", "grad", "H-write"),
                                       ("b_keep", "keep", "B-write"),
                                       ("b_arrive", "grad", "B-write"))}
  keyed = [tuple(p for p in PHASES if p in ph) for ph in phases]
  patterns = tuple(dict.fromkeys(keyed))
  pattern = np.array([patterns.index(p) for p in keyed], np.int32)
  return Plan(num_ticks=t_len, num_stages=k, num_microbatches=m, repeats=v,
              split=sched.split, patterns=patterns, pattern=pattern, slots=slots,
              shared=shared,
              m_x=m_x, m_head=m_head, m_dx=m_dx, **per_tick, **arrays)


# -- per-device ticks ----------------------------------------------------------------

WRITES = {"f_stash": "stash", "f_arrive": "act", "h_slot": "grad", "b_keep": "keep",
           "b_arrive": "grad"}
IDLE, F, FH, B, W = range(5)
KIND_NAMES = ("idle", "F", "F+loss", "B", "W")


def per_device(p: Plan) -> bool:
  """Whether the table has a tick where stages run different kinds of action:
  then every tick runs one ``stage_switch`` (each stage its own action);
  otherwise each tick runs its one phase on every stage."""
  return any(len(p.patterns[i]) - ("H" in p.patterns[i]) > 1 for i in p.pattern)


def per_device_codes(p: Plan) -> np.ndarray:
  """``[T, K]``: each stage's action per tick (idle, F, F and the loss, B, W)."""
  k, v = p.num_stages, p.repeats
  code = np.full(p.f_on.shape, IDLE, np.int32)
  code[p.f_on] = F
  last = p.f_on & (np.arange(k) == k - 1)[None, :] & (p.f_chunk == v - 1)
  code[last] = FH
  code[p.b_on] = B
  code[p.w_on] = W
  return code


def per_device_kinds(p: Plan) -> list[int]:
  """The action kinds the table uses (the switch's branches), idle first."""
  used = set(np.unique(per_device_codes(p)).tolist())
  return [c for c in range(len(KIND_NAMES)) if c == IDLE or c in used]


def action_chunks(p: Plan) -> np.ndarray:
  """``[T, K]``: the chunk of each stage's action (0 when idle)."""
  return np.where(p.f_on, p.f_chunk, np.where(p.b_on, p.b_chunk, p.w_chunk)).astype(np.int32)
